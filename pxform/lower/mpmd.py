"""MPMD lowering: a graph cut into stages -> one SPMD program per stage (DESIGN.md §7).

Microbatches are a mesh axis. The lowering mesh is the stage's sub-mesh (the enclosing
mesh without the pipeline axis) plus an axis `mb` of size `microbatches`, innermost, and
every batch input is split along its batch dim over `mb` (after the axes the caller already
splits it over, so each rank cuts its own piece into microbatches). One microbatch is one
coordinate of `mb`, so the SPMD rules say how microbatches combine, with no special case:

- a mean over the batch becomes a partial sum over `mb` scaled by 1/microbatches (or
  divided by a count summed over all microbatches, for `cross_entropy(ignore_index=...)`),
  so the microbatch results add up to the full-batch loss;
- a parameter read by a batch-split op has a gradient that is partial over `mb`; its
  all-reduce over `mb` is the accumulation of gradients over microbatches, which autograd
  does by summing into the same tensor (the runtime runs it as an identity);
- any other collective over `mb` in the forward pass would need several microbatches at
  once (a batch statistic such as batch norm): the lowering refuses it, naming the op.

The whole graph is lowered once (`spmd.lower`), then its instructions are split by stage:
an op runs on the stage the cuts give it; a conversion runs with the first op that reads
it. Values defined on a stage and read on a later one cross every boundary in between
(passed along, so transfers are only ever between neighbouring stages).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pxform.core.errors import PipelineError
from pxform.core.ir import Graph, Value
from pxform.core.layout import Layout, Step
from pxform.core.mesh import AbstractMesh
from pxform.lower.defer import defer_reductions
from pxform.lower.overlap import interleave
from pxform.lower.spmd import CallInstr, ConvertInstr, Instr, Program, lower
from pxform.lower.spmd import defines as _defines
from pxform.lower.spmd import reads as _reads
from pxform.ops import bind
from pxform.ops.local import CountSpec
from pxform.ops.strategy import Strategy
from pxform.passes.propagate import layout_of

MB = "mb"
"""The microbatch axis of the lowering mesh."""

_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")


@dataclass(frozen=True)
class CountPrepass:
    """A loss divided by a data-dependent count (`cross_entropy(ignore_index=...)`) over
    the microbatch axis needs the count of every microbatch before the first backward:
    `program` computes the loss's target (and class weight) from graph inputs, and the
    runtime sums the counts over microbatches before the schedule starts."""

    key: str
    spec: CountSpec
    program: Program
    graph_inputs: tuple[int, ...]


@dataclass(frozen=True)
class StageProgram:
    """One stage: an SPMD program whose inputs are the graph inputs it reads
    (`graph_inputs`: their indices in the graph) then the values received from the previous
    stage (`receives`), and whose outputs are the values sent to the next stage (`sends`),
    then the function's outputs (last stage), then, in pairs, each weight op's outputs and
    weight inputs (`weight_ops`, for zero-bubble `W` actions)."""

    stage: int
    program: Program
    graph_inputs: tuple[int, ...]
    receives: tuple[Value, ...]
    sends: tuple[Value, ...]
    num_outputs: int
    weight_ops: tuple[tuple[int, int], ...]
    counts: tuple[CountPrepass, ...] = ()
    grad: bool = True

    def local_shape(self, v: Value) -> tuple[int, ...]:
        return self.program.local_shape(v)


@dataclass(frozen=True)
class PipelineProgram:
    """Per-stage programs of a pipelined function, and how to combine the microbatches'
    outputs: `output_modes[i]` is "sum" (partial over `mb`), ("cat", dim) (split over `mb`
    along dim) or "first" (the same for every microbatch)."""

    name: str
    mesh: AbstractMesh
    stages: tuple[StageProgram, ...]
    output_modes: tuple[Any, ...]
    outputs: tuple[Any, ...]

    @property
    def microbatches(self) -> int:
        return self.mesh.axis_size(MB)

    def as_text(self) -> str:
        """Every stage's program, with what it receives and sends."""
        parts = []
        for st in self.stages:
            head = (f"# stage {st.stage}: receives {_names(st.receives)}; sends "
                    f"{_names(st.sends)}")
            parts.append(head + "\n" + st.program.as_text())
        return "\n\n".join(parts)


def _names(values: tuple[Value, ...]) -> str:
    return "(" + ", ".join(f"%{v.name}: {v.type}" for v in values) + ")" if values else "nothing"


def with_microbatches(mesh: AbstractMesh, microbatches: int, fn: str) -> AbstractMesh:
    """The lowering mesh: `mesh` plus the innermost axis `mb`."""
    if MB in mesh:
        raise PipelineError(f"pxform.{fn}: the mesh {mesh} has an axis named {MB!r}, which "
                            f"pipelines use for microbatches.\n  Fix: rename that axis.")
    return AbstractMesh(mesh.axes + ((MB, microbatches),))


def split_batch(layout: Layout, dim: int) -> Layout:
    """`layout` with the batch dim also split over `mb`, innermost."""
    dims = list(layout.dims)
    dims[dim] = tuple(dims[dim]) + (MB,)
    return Layout(tuple(dims), layout.partial)


def lower_pipeline(graph: Graph, op_stage: tuple[int, ...], num_stages: int,
                   mesh: AbstractMesh, input_layouts: list[Layout],
                   strategies: list[Strategy], output_layouts: list[Layout | None],
                   batch_inputs: set[int], fn: str = "pipeline",
                   weight_stages: set[int] | None = None) -> PipelineProgram:
    """Lower `graph` on `mesh` (which has the `mb` axis) and split it into stages.

    Args:
        op_stage: the stage of each op (non-decreasing).
        batch_inputs: indices of the graph inputs that carry the batch (the rest are
            parameters or other per-step constants: their derived values are "weights").
        weight_stages: the stages whose schedule has zero-bubble `W` actions (None: all);
            only those return their weight ops' outputs, which keeps them alive until W
            (elsewhere that would defeat recompute regions, whose outputs stay alive).
    """
    whole = interleave(defer_reductions(lower(graph, mesh, input_layouts, strategies,
                                                 output_layouts)))
    _refuse_microbatch_collectives(whole, fn)
    whole = _pad_microbatch_gradients(whole)
    instr_stage = _instr_stages(whole, op_stage, num_stages)
    values = _local_values(whole)
    input_index = {v.name: i for i, v in enumerate(whole.inputs)}
    constants = {c.value.name: c for c in whole.constants}
    weights = _weight_values(whole, {whole.inputs[i].name for i in range(len(whole.inputs))
                                     if i not in batch_inputs})
    producer = {v.name: n for n, instr in enumerate(whole.instrs) for v in _defines(instr)}
    last = num_stages - 1
    # Each stage's instructions. A weight (a value made from parameters only, such as a
    # converted tied embedding) is made again on every stage that reads it rather than sent
    # with every microbatch: its chain reads only graph inputs, which every rank has.
    per_stage: list[list[int]] = [[] for _ in range(num_stages)]
    for n, s in enumerate(instr_stage):
        per_stage[s].append(n)
    for k in range(num_stages):
        mine = set(per_stage[k])
        stack = [name for n in per_stage[k] for name in _reads(whole.instrs[n])]
        if k == last:
            stack += [o.name for o in whole.outputs if isinstance(o, Value)]
        while stack:
            name = stack.pop()
            at = producer.get(name)
            if at is None or at in mine or name not in weights:
                continue
            mine.add(at)
            stack += _reads(whole.instrs[at])
        per_stage[k] = sorted(mine)
    defined_in: dict[str, int] = {}
    used_in: dict[str, list[int]] = {}
    for k in range(num_stages):
        for n in per_stage[k]:
            for name in _reads(whole.instrs[n]):
                used_in.setdefault(name, []).append(k)
            for v in _defines(whole.instrs[n]):
                defined_in.setdefault(v.name, k)
    for o in whole.outputs:
        if isinstance(o, Value):
            used_in.setdefault(o.name, []).append(last)
    order = {name: producer[name] for name in defined_in}
    # crossing[k]: values defined on a stage <= k and read on a stage > k, in program order
    crossing: list[list[str]] = []
    made = [_defined(whole, per_stage[k]) for k in range(num_stages)]
    for k in range(num_stages - 1):
        names = [n for n, s in defined_in.items() if s <= k and n not in weights
                 and any(u > k and n not in made[u] for u in used_in.get(n, []))]
        crossing.append(sorted(names, key=order.__getitem__))
    stages = []
    for k in range(num_stages):
        instrs = tuple(whole.instrs[n] for n in per_stage[k])
        reads = [n for instr in instrs for n in _reads(instr)]
        if k == last:
            reads += [o.name for o in whole.outputs if isinstance(o, Value)]
        graph_inputs = sorted({input_index[n] for n in reads if n in input_index})
        receives = tuple(values[n] for n in crossing[k - 1]) if k > 0 else ()
        sends = tuple(values[n] for n in crossing[k]) if k < last else ()
        finals = tuple(whole.outputs) if k == last else ()
        weight_pairs, extra = (_weight_ops(instrs, weights, values)
                               if weight_stages is None or k in weight_stages else ((), ()))
        used_consts = tuple(constants[n] for n in dict.fromkeys(reads) if n in constants)
        program = Program(f"{whole.name}.stage{k}", mesh,
                          tuple(whole.inputs[i] for i in graph_inputs) + receives, instrs,
                          sends + finals + extra, used_consts)
        counts = _count_prepasses(program, len(graph_inputs), graph_inputs, fn)
        stages.append(StageProgram(k, program, tuple(graph_inputs), receives, sends,
                                   len(finals), weight_pairs, counts,
                                   any(isinstance(i, CallInstr) and i.op.grad for i in instrs)))
    modes = tuple(_output_mode(o) for o in whole.outputs)
    return PipelineProgram(whole.name, mesh, tuple(stages), modes, whole.outputs)


def output_layouts(graph: Graph, mesh: AbstractMesh, input_layouts: list[Layout],
                   strategies: list[Strategy], wanted: list[Layout | None]) -> list[Layout | None]:
    """Layouts to lower the outputs to: as `wanted` (replicated where None) on the mesh's
    own axes, while a dim or partial sum over `mb` stays as produced (microbatches are
    combined by the runtime: summed, or concatenated along the dim)."""
    layouts = {v.name: lay for v, lay in zip(graph.inputs, input_layouts)}
    for c in graph.constants:
        layouts[c.value.name] = Layout.replicated(c.value.type.rank)
    for op, strategy in zip(graph.ops, strategies):
        for v, lay in zip(op.outputs, strategy.outputs):
            layouts[v.name] = lay
    out: list[Layout | None] = []
    for o, want in zip(graph.outputs, wanted):
        if not isinstance(o, Value):
            out.append(None)
            continue
        have = layouts[o.name]
        base = want if want is not None else Layout.replicated(o.type.rank)
        dims = tuple(have_axes if MB in have_axes else base_axes
                     for have_axes, base_axes in zip(have.dims, base.dims))
        partial = base.partial | (have.partial & {MB})
        out.append(Layout(dims, frozenset(partial)))
    return out


# ---------------------------------------------------------------- helpers

def _defined(program: Program, indices: list[int]) -> set[str]:
    return {v.name for n in indices for v in _defines(program.instrs[n])}


def _local_values(program: Program) -> dict[str, Value]:
    out = {v.name: v for v in program.inputs}
    for c in program.constants:
        out[c.value.name] = c.value
    for instr in program.instrs:
        for v in _defines(instr):
            out[v.name] = v
    return out


def _instr_stages(program: Program, op_stage: tuple[int, ...], num_stages: int) -> list[int]:
    """A call runs on its op's stage; a conversion with the next call (the one it was
    emitted for); conversions after the last call (outputs) on the last stage."""
    out: list[int | None] = []
    op_index = 0
    for instr in program.instrs:
        if isinstance(instr, CallInstr):
            out.append(op_stage[op_index])
            op_index += 1
        else:
            out.append(None)
    following = num_stages - 1
    for i in range(len(out) - 1, -1, -1):
        if out[i] is None:
            out[i] = following
        else:
            following = out[i]  # type: ignore[assignment]
    return out  # type: ignore[return-value]


def _refuse_microbatch_collectives(program: Program, fn: str) -> None:
    consumer = None
    for instr in reversed(program.instrs):
        if isinstance(instr, CallInstr):
            consumer = instr
            continue
        for step in instr.forward.steps:
            if step.axis == MB and step.kind in _COLLECTIVES:
                what = (f"{consumer.op} at {consumer.op.source or 'an unknown line'}"
                        if consumer is not None else "the function's outputs")
                raise PipelineError(
                    f"pxform.{fn}: {what} needs %{instr.src} ({instr.dst.type}) combined "
                    f"across microbatches ({step}): the value depends on the whole batch, "
                    f"which no single microbatch has.\n  Fix: compute it per example or "
                    f"per microbatch (e.g. layer norm instead of batch norm), or reduce it "
                    f"last: the function's output may be a sum or mean over the batch.")


def _pad_microbatch_gradients(program: Program) -> Program:
    """A value every microbatch computes whole (a class token a parameter expands to the
    batch) but a batch-split op reads in its microbatch's piece: the conversion's backward
    would all-gather the pieces' gradients over `mb`, which cannot run, microbatches coming
    one at a time. Its gradient is the sum over microbatches of each one's piece padded
    with zeros, and autograd adds up what every microbatch's backward returns: so the
    all-gather over `mb` becomes `pad` (local), and the sum is the accumulation."""
    instrs = list(program.instrs)
    changed = False
    for k, instr in enumerate(instrs):
        if not isinstance(instr, ConvertInstr):
            continue
        steps = instr.backward.steps
        if any(s.axis == MB and s.kind == "all_gather" for s in steps):
            padded = tuple(Step("pad", MB, s.dim) if s.axis == MB and s.kind == "all_gather"
                           else s for s in steps)
            dst = Layout(instr.backward.dst.dims, instr.backward.dst.partial | {MB})
            instrs[k] = dataclasses.replace(instr, backward=dataclasses.replace(
                instr.backward, steps=padded, dst=dst))
            changed = True
    return dataclasses.replace(program, instrs=tuple(instrs)) if changed else program


def _weight_values(program: Program, params: set[str]) -> set[str]:
    """Local names that depend only on parameters and constants (not on the batch)."""
    weights = set(params) | {c.value.name for c in program.constants}
    for instr in program.instrs:
        if all(n in weights for n in _reads(instr)):
            weights.update(v.name for v in _defines(instr))
    return weights


def _weight_ops(instrs: tuple[Instr, ...], weights: set[str], values: dict[str, Value]
                ) -> tuple[tuple[tuple[int, int], ...], tuple[Value, ...]]:
    """Ops that read a floating weight and an activation: their weight gradient is what a
    zero-bubble `W` action computes. Returns (number of outputs, number of weight inputs)
    per op and the values to append to the stage's outputs (outputs, then weights)."""
    pairs = []
    extra: list[Value] = []
    for instr in instrs:
        if not isinstance(instr, CallInstr) or not instr.op.grad:
            continue
        reads = list(dict.fromkeys(_reads(instr)))
        w = [n for n in reads if n in weights and values[n].type.dtype.is_floating_point]
        acts = [n for n in reads if n not in weights]
        outs = [v for v in instr.outputs if v.type.dtype.is_floating_point]
        if w and acts and outs:
            pairs.append((len(outs), len(w)))
            extra += outs + [values[n] for n in w]
    return tuple(pairs), tuple(extra)


def _count_prepasses(program: Program, num_graph_inputs: int, graph_inputs: list[int],
                     fn: str) -> tuple[CountPrepass, ...]:
    out = []
    produced = {v.name: instr for instr in program.instrs for v in _defines(instr)}
    for instr in program.instrs:
        if not (isinstance(instr, CallInstr) and instr.call.count is not None
                and MB in instr.call.count.axes):
            continue
        wanted = [instr.local_input(v) for k, v in bind(instr.op).items()
                  if k in ("target", "weight") and isinstance(v, Value)]
        needed: list[Instr] = []
        stack = list(wanted)
        seen: set[str] = set()
        while stack:
            name = stack.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in produced:
                needed.append(produced[name])
                stack += _reads(produced[name])
        reads = {n for i in needed for n in _reads(i)} | set(wanted)
        outside = [v for v in program.inputs[num_graph_inputs:] if v.name in reads]
        if outside:
            raise PipelineError(
                f"pxform.{fn}: {instr.op} at {instr.op.source or 'an unknown line'} divides "
                f"by the number of counted targets over all microbatches, but its targets "
                f"are computed from an earlier stage's activations (%{outside[0].name}), so "
                f"they cannot be counted before the first backward.\n  Fix: compute the "
                f"targets from the batch inputs, or use reduction='sum' and divide by a "
                f"count you pass in.")
        order = {id(i): n for n, i in enumerate(program.instrs)}
        needed.sort(key=lambda i: order[id(i)])
        inputs = [(j, v) for j, v in enumerate(program.inputs[:num_graph_inputs])
                  if v.name in reads]
        values = _local_values(program)
        sub = Program(f"{program.name}.count", program.mesh, tuple(v for _, v in inputs),
                      tuple(needed), tuple(values[n] for n in wanted), program.constants)
        out.append(CountPrepass(instr.outputs[0].name, instr.call.count, sub,
                                tuple(graph_inputs[j] for j, _ in inputs)))
    return tuple(out)


def _output_mode(o: Any) -> Any:
    if not isinstance(o, Value):
        return "first"
    layout = layout_of(o.type)
    if MB in layout.partial:
        return "sum"
    for d, axes in enumerate(layout.dims):
        if MB in axes:
            if axes[-1] != MB:
                raise PipelineError(
                    f"pxform.pipeline: an output ({o.type}) is split over microbatches on "
                    f"dim {d} but not innermost; it cannot be reassembled by concatenation."
                    f"\n  Fix: return a loss (a sum or mean over the batch) or a value split "
                    f"on the batch dim only.")
            return ("cat", d)
    return "first"
