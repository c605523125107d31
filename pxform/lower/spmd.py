"""SPMD lowering: a Graph, a mesh, a strategy per op and layouts for inputs and outputs ->
a per-rank `Program` of local ops and conversions (DESIGN.md §7).

Each op input is converted from its producer's layout L to the layout R the op's strategy
needs. The conversion's backward takes the gradient from the layout C the consumer delivers
to the canonical gradient layout G(L) (shard stays shard; replicate and partial become
replicate). C follows from the consumer's strategy, per mesh axis: where the input is
sharded, C is the same shard; where the input is a partial sum or the op does nothing on
the axis, C is replicated; where the op splits a dim the input lacks, C is partial.

When every consumer of a converted value delivers the same C, the conversion's backward
goes straight from C to G(L) (ZeRO-3's reduce-scatter). Otherwise each consumer whose C
differs gets its own identity conversion whose backward takes C to G(R) (Megatron's f), so
the gradients autograd sums are all in one layout.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from pxform.core.errors import UnsupportedOpError
from pxform.core.ir import Graph, Op, TensorType, Value, dtype_name, map_values
from pxform.core.layout import LOCAL_STEPS, Layout, Relayout
from pxform.core.mesh import AbstractMesh
from pxform.frontend.precision import INPUT_CAST
from pxform.frontend.rng import PLAN_INDEPENDENT, RANDOM
from pxform.ops.local import LocalCall, local_call
from pxform.ops.strategy import Strategy
from pxform.passes.propagate import (
    consumer_gradient_layout,
    gradient_layout,
    layout_of,
    relayout,
    typed_layout,
)


@dataclass(frozen=True, slots=True)
class ConvertInstr:
    """`dst = convert(src)`: forward steps L -> R, backward steps C -> G(L). An
    `asynchronous` conversion returns without waiting for its last collective, in forward
    and in backward; the first op that reads the result waits (`pxform.lower.overlap`).

    A conversion with `cast` also changes the dtype (a program input cast by mixed
    precision, `pxform.frontend.precision.INPUT_CAST`): forward casts `src` before its
    steps, so ZeRO-3 gathers the cast shard; backward casts the gradient to `grad_dtype`
    before its steps (the reduce dtype) and returns it in `src`'s dtype."""

    src: str
    dst: Value
    forward: Relayout
    backward: Relayout
    asynchronous: bool = False
    cast: torch.dtype | None = None
    grad_dtype: torch.dtype | None = None


@dataclass(frozen=True, slots=True)
class CallInstr:
    """One op on local shards. `inputs` pairs each of the op's tensor inputs, in argument
    order, with the local value it reads: positionally, since one value may be read in two
    layouts by one op (attention's q and v both `x`, one replicated, one partial)."""

    op: Op
    call: LocalCall
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[Value, ...]

    def local_args(self, resolve: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The call's args and kwargs with the i-th tensor input replaced by
        `resolve(local name of input i)` (the walk order of `Op.inputs`)."""
        names = iter([local for _, local in self.inputs])

        def sub(v: Value) -> Any:
            return resolve(next(names))

        args = tuple(map_values(a, sub) for a in self.call.args)
        kwargs = {k: map_values(a, sub) for k, a in self.call.kwargs}
        return args, kwargs

    def local_input(self, value: Value) -> str:
        """The local name read for the first occurrence of `value` among the inputs."""
        return next(local for name, local in self.inputs if name == value.name)


Instr = ConvertInstr | CallInstr


def reads(instr: Instr) -> list[str]:
    """The local values an instruction reads."""
    if isinstance(instr, ConvertInstr):
        return [instr.src]
    return [local for _, local in instr.inputs]


def defines(instr: Instr) -> tuple[Value, ...]:
    """The values an instruction defines."""
    return (instr.dst,) if isinstance(instr, ConvertInstr) else instr.outputs


@dataclass(frozen=True)
class Program:
    """The per-rank program. Values carry global types with their specs and partial axes;
    `local_shape` gives what a rank holds."""

    name: str
    mesh: AbstractMesh
    inputs: tuple[Value, ...]
    instrs: tuple[Instr, ...]
    outputs: tuple[Any, ...]
    constants: tuple[Any, ...] = ()

    def local_shape(self, v: Value) -> tuple[int, ...]:
        layout = layout_of(v.type)
        return layout.local_shape(v.type.shape, self.mesh)

    def collectives(self) -> list[str]:
        """Forward collectives in program order, e.g. `['all_reduce(tp)']`."""
        return self._collectives(backward=False)

    def backward_collectives(self) -> list[str]:
        """Collectives the backward pass runs (in forward program order)."""
        return self._collectives(backward=True)

    def _collectives(self, backward: bool) -> list[str]:
        out = []
        for instr in self.instrs:
            if isinstance(instr, ConvertInstr):
                steps = (instr.backward if backward else instr.forward).steps
                out += [str(s) for s in steps
                        if s.kind not in LOCAL_STEPS and self.mesh.axis_size(s.axis) > 1]
        return out

    def as_text(self) -> str:
        """The program as text: each value's global type with its layout, local shapes in
        comments, and every conversion with its forward and backward steps."""
        def typed(v: Value) -> str:
            return f"{v}: {v.type}"

        lines = [f"def {self.name}[{self.mesh}]("]
        lines += [f"    {typed(v)},  # local {list(self.local_shape(v))}" for v in self.inputs]
        lines.append("):")
        for instr in self.instrs:
            if isinstance(instr, ConvertInstr):
                fwd_steps = [str(s) for s in instr.forward.steps]
                bwd_steps = [str(s) for s in instr.backward.steps]
                if instr.cast is not None:
                    fwd_steps.insert(0, f"cast {dtype_name(instr.cast)}")
                    if instr.grad_dtype is not None and instr.grad_dtype != instr.cast:
                        bwd_steps.insert(0, f"cast {dtype_name(instr.grad_dtype)}")
                fwd = "; ".join(fwd_steps) or "identity"
                bwd = "; ".join(bwd_steps) or "identity"
                how = "convert_async" if instr.asynchronous else "convert"
                lines.append(f"  {typed(instr.dst)} = {how}(%{instr.src})  "
                             f"# fwd: {fwd} | bwd: {bwd}")
            else:
                types = iter(v.type for v in instr.op.inputs)
                args, kwargs = instr.local_args(lambda name, t=types: Value(name, next(t)))
                shown = Op(instr.call.target, args, instr.outputs, tuple(kwargs.items()))
                extra = ""
                if instr.call.scale != 1.0:
                    extra += f" * {instr.call.scale:g}"
                if instr.call.count is not None:
                    extra += f" / count(over {', '.join(instr.call.count.axes)})"
                local = ", ".join(str(list(self.local_shape(v))) for v in instr.outputs)
                lines.append(f"  {shown}{extra}  # local {local}")
        outs = [f"%{o.name}" if isinstance(o, Value) else repr(o) for o in self.outputs]
        lines.append("  return " + (outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"))
        return "\n".join(lines)


def lower(graph: Graph, mesh: AbstractMesh, input_layouts: list[Layout],
          strategies: list[Strategy], output_layouts: list[Layout | None]) -> Program:
    """Lower `graph` to a per-rank program.

    Args:
        input_layouts: one per graph input (how the caller's local tensors are laid out).
        strategies: one per op (e.g. from `propagate`).
        output_layouts: one per graph output; None keeps the producer's layout.
    """
    # Pass 1: every (value, layout needed) pair and the gradient layouts its consumers give.
    consumers: dict[tuple[str, Layout], list[Layout]] = defaultdict(list)
    for op, strategy in zip(graph.ops, strategies):
        for i, v in enumerate(op.inputs):
            consumers[(v.name, strategy.inputs[i])].append(consumer_gradient_layout(strategy, i))
    for o, want in zip(graph.outputs, output_layouts):
        if isinstance(o, Value) and want is not None:
            consumers[(o.name, want)].append(gradient_layout(want))

    layouts: dict[str, Layout] = {v.name: lay for v, lay in zip(graph.inputs, input_layouts)}
    for c in graph.constants:
        layouts[c.value.name] = Layout.replicated(c.value.type.rank)
    types: dict[str, TensorType] = {v.name: v.type for v in graph.values()}
    instrs: list[Instr] = []
    converted: dict[tuple[str, Layout], str] = {}
    fresh: defaultdict[str, int] = defaultdict(int)

    def new_name(base: str) -> str:
        fresh[base] += 1
        return f"{base}.{fresh[base]}"

    def emit_convert(src: str, src_layout: Layout, dst_layout: Layout, grad_from: Layout,
                     grad_to: Layout) -> str:
        cast = casts.get(src)
        t = types[src]
        grad_dtype = t.dtype
        if cast is not None:  # a cast input: read the input, cast inside the conversion
            src, grad_dtype = cast[0], cast[1] or types[cast[0]].dtype
        fwd = relayout(t.shape, t.dtype.itemsize, src_layout, dst_layout, mesh)
        if t.dtype.is_floating_point or t.dtype.is_complex:
            bwd = relayout(t.shape, grad_dtype.itemsize, grad_from, grad_to, mesh)
        else:  # integer values (token ids, positions) have no gradient
            bwd = Relayout(grad_from, grad_to, ())
        dst = Value(new_name(src), typed_layout(t, dst_layout))
        types[dst.name] = t  # a consumer whose gradient differs converts it again
        instrs.append(ConvertInstr(src, dst, fwd, bwd, cast=None if cast is None else t.dtype,
                                   grad_dtype=None if cast is None else grad_dtype))
        return dst.name

    def use(name: str, need: Layout, grad: Layout) -> str:
        """The local name of `name` laid out as `need`, with gradients arriving as `grad`."""
        have = layouts[name]
        key = (name, need)
        grads = set(consumers[key])
        shared = grads.pop() if len(grads) == 1 else gradient_layout(need)
        if key not in converted:
            if have != need or shared != gradient_layout(have) or name in casts:
                converted[key] = emit_convert(name, have, need, shared, gradient_layout(have))
            else:
                converted[key] = name
        local = converted[key]
        if grad != shared:  # consumers disagree: this one brings its gradient to G(need)
            local = emit_convert(local, need, need, grad, shared)
            layouts[local] = need
        return local

    # casts of program inputs (mixed precision) on the input's own layout become part of
    # the input's conversions: {cast output: (input, the gradient's reduce dtype)}
    casts: dict[str, tuple[str, torch.dtype | None]] = {}
    inputs_by_name = {v.name for v in graph.inputs}
    for op, strategy in zip(graph.ops, strategies):
        _check_random(graph, op, strategy, mesh)
        if op.tag(INPUT_CAST, False) is not False and op.inputs[0].name in inputs_by_name \
                and strategy.inputs[0] == layouts[op.inputs[0].name] \
                and strategy.outputs[0] == strategy.inputs[0]:
            casts[op.outputs[0].name] = (op.inputs[0].name, op.tag(INPUT_CAST))
            layouts[op.outputs[0].name] = strategy.outputs[0]
            continue
        names = []
        for i, v in enumerate(op.inputs):
            local = use(v.name, strategy.inputs[i], consumer_gradient_layout(strategy, i))
            names.append((v.name, local))
        call = local_call(op, strategy.inputs, strategy.outputs, mesh)
        outs = tuple(Value(v.name, typed_layout(v.type, lay))
                     for v, lay in zip(op.outputs, strategy.outputs))
        for v, lay in zip(op.outputs, strategy.outputs):
            layouts[v.name] = lay
        instrs.append(CallInstr(op, call, tuple(names), outs))
    outputs: list[Any] = []
    for o, want in zip(graph.outputs, output_layouts):
        if isinstance(o, Value):
            target = want if want is not None else layouts[o.name]
            name = use(o.name, target, gradient_layout(target))
            outputs.append(Value(name, typed_layout(o.type, target)))
        else:
            outputs.append(o)
    inputs = tuple(Value(v.name, typed_layout(v.type, lay))
                   for v, lay in zip(graph.inputs, input_layouts))
    return Program(graph.name, mesh, inputs, tuple(instrs), tuple(outputs), graph.constants)


def _check_random(graph: Graph, op: Op, strategy: Strategy, mesh: AbstractMesh) -> None:
    """Refuse random ops without a plan-independent form (`multinomial`) whose result is
    replicated over a mesh axis: they draw from each rank's own generator, so the replicas
    would silently diverge. Every other random op draws from the counter-based stream
    (`pxform.frontend.rng`), the same at each position under any layout."""
    if op.tag(RANDOM) is None or op.name in PLAN_INDEPENDENT:
        return
    used = strategy.outputs[0].used_axes() if strategy.outputs else frozenset()
    replicated = [a for a in mesh.names if mesh.axis_size(a) > 1 and a not in used]
    if replicated:
        a = replicated[0]
        raise UnsupportedOpError(
            f"pxform.shard({graph.name}): {op} at {op.source or 'an unknown line'} draws "
            f"random numbers from torch's generator for a value replicated over mesh axis "
            f"{a!r} (size {mesh.axis_size(a)}) of {mesh}: each rank would draw its own, and "
            f"the replicas would silently diverge. pxform's plan-independent stream covers "
            f"{', '.join(sorted(PLAN_INDEPENDENT))}.\n  Fix: compute it from those (e.g. "
            f"multinomial by inverse CDF on torch.rand), or lay the value out split over "
            f"{a!r}.")
