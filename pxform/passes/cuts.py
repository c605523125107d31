"""Stage cuts: which ops of a traced graph run on which pipeline stage.

Two sources:

- **Markers.** `pxform.stage_boundary(x)` calls in the model. Adjacent markers (one call on
  a pytree) form one cut; `stages - 1` cuts are needed.
- **Graph sharding** (Merak). The graph, in program order, is split into *blocks* with as
  few activations crossing each boundary as possible, then blocks are grouped into stages
  balancing forward FLOPs (the search of a later issue balances time and memory).

Blocks. An *activation* is a value that depends on both a batch input and a parameter (any
other floating input). Values that depend on only one side (attention masks, positions,
rotary tables, transposed weights) are not counted: they are cheap, used by many blocks,
and passed along from stage to stage. Every position where the fewest activations cross
(one, the residual stream, in a transformer) is a candidate cut; the segments between
candidates are compared by their ops and input shapes, and the longest run of a repeated
pattern of segments becomes one block per repetition (a transformer layer is two segments:
attention and MLP). What precedes and follows the repeated run is searched the same way
(encoder-decoder models have two runs); what is left over becomes one block on each side
("embed" and "head" in a language model). A model with no repeated run at all (a CNN
whose stages differ in width, one layer each) gets one block per numbered module instead.

Example:
    >>> cuts = stage_cuts(traced.graph, num_stages=2, batch_inputs={"batch.idx"})
    >>> print(cuts)           # per stage: ops, FLOPs and the blocks (modules) it holds
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pxform.core.errors import PipelineError
from pxform.core.ir import Graph, Op, Renames
from pxform.frontend.boundary import is_boundary
from pxform.frontend.regions import RECOMPUTE, Policy, RecomputeTag
from pxform.frontend.trace import last_uses, si
from pxform.ops import rule_info


@dataclass(frozen=True, slots=True)
class Block:
    """Ops `[start, stop)` of a graph (program order), their forward FLOPs and a label."""

    start: int
    stop: int
    flops: int
    label: str


@dataclass(frozen=True)
class StageCuts:
    """The stage of every op of a graph, and the blocks the stages were grouped from.

    Attributes:
        graph: the graph the cuts are for (markers removed).
        op_stage: the stage of each op, non-decreasing in program order.
        num_stages: the number of stages.
        blocks: the blocks stages are made of (one per marker-delimited stage for markers).
        source: "markers" or "auto".
    """

    graph: Graph
    op_stage: tuple[int, ...]
    num_stages: int
    blocks: tuple[Block, ...]
    source: str

    def stage_ops(self, stage: int) -> range:
        """The op indices of `stage` (a contiguous range)."""
        idx = [i for i, s in enumerate(self.op_stage) if s == stage]
        return range(idx[0], idx[-1] + 1) if idx else range(0)

    def stage_flops(self, stage: int) -> int:
        return sum(rule_info(self.graph.ops[i]).flops for i in self.stage_ops(stage))

    def __str__(self) -> str:
        lines = [f"{self.graph.name}: {self.num_stages} stages from "
                 f"{'stage_boundary markers' if self.source == 'markers' else 'graph sharding'}"
                 f" ({len(self.blocks)} blocks)"]
        total = max(1, sum(self.stage_flops(s) for s in range(self.num_stages)))
        for s in range(self.num_stages):
            ops = self.stage_ops(s)
            flops = self.stage_flops(s)
            names = [b.label for b in self.blocks if b.start in ops]
            lines.append(f"  stage {s}: ops {ops.start}-{ops.stop - 1} ({len(ops)} ops), "
                         f"{si(flops)}FLOP ({100 * flops / total:.0f}%): " + _span(names))
        return "\n".join(lines)


def strip_markers(graph: Graph) -> tuple[Graph, list[int]]:
    """The graph without `stage_boundary` ops (their outputs renamed to their inputs), and
    the cut positions they stood for: the op index, in the new graph, each group of adjacent
    markers precedes."""
    renames = Renames()
    ops: list[Op] = []
    cuts: list[int] = []
    previous_marker = False
    for op in graph.ops:
        if is_boundary(op):
            renames.add(op.outputs[0], op.inputs[0])
            if not previous_marker:
                cuts.append(len(ops))
            previous_marker = True
            continue
        previous_marker = False
        ops.append(renames.rewire(op))
    return graph.replace(ops=tuple(ops), outputs=renames.outputs(graph.outputs)), cuts


def stage_cuts(graph: Graph, num_stages: int, batch_inputs: set[str],
               fn: str = "pipeline") -> StageCuts:
    """Cut `graph` into `num_stages` stages: at its `stage_boundary` markers if it has any,
    otherwise by graph sharding and FLOP balance.

    Raises:
        PipelineError: the number of marker cuts is not `num_stages - 1`, or there are fewer
            blocks than stages.
    """
    stripped, marks = strip_markers(graph)
    n = len(stripped.ops)
    if marks:
        if len(marks) != num_stages - 1:
            raise PipelineError(
                f"pxform.{fn}: the function has {len(marks)} stage_boundary cuts, so it "
                f"makes {len(marks) + 1} stages, but the pipeline has {num_stages} stages."
                f"\n  Fix: pass stages={len(marks) + 1}, or mark {num_stages - 1} cuts "
                f"(adjacent markers, as one call on a pytree makes, count as one cut).")
        bounds = [0, *marks, n]
        blocks = tuple(Block(a, b, _flops(stripped.ops[a:b]), f"marked stage {k}")
                       for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
        for k, b in enumerate(blocks):
            if b.start == b.stop:
                raise PipelineError(
                    f"pxform.{fn}: stage {k} would hold no ops (two stage_boundary cuts "
                    f"with nothing between them, or a cut at the very start or end).\n  Fix: "
                    f"remove the extra marker.")
        op_stage = tuple(k for k, b in enumerate(blocks) for _ in range(b.start, b.stop))
        return StageCuts(stripped, op_stage, num_stages, blocks, "markers")
    blocks = graph_blocks(stripped, batch_inputs)
    if len(blocks) < num_stages:
        raise PipelineError(
            f"pxform.{fn}: {num_stages} stages but graph sharding finds only {len(blocks)} "
            f"blocks ({_span([b.label for b in blocks])}); a stage holds whole blocks.\n"
            f"  Fix: use at most {len(blocks)} stages, or cut by hand with "
            f"pxform.stage_boundary(x) in the model.")
    groups = balance([b.flops for b in blocks], num_stages)
    op_stage = tuple(s for s, b in zip(groups, blocks) for _ in range(b.start, b.stop))
    return StageCuts(stripped, op_stage, num_stages, blocks, "auto")


def balance(costs: Sequence[float], parts: int) -> tuple[int, ...]:
    """The part of each item: contiguous, non-empty parts minimising the largest part's
    sum (binary search on that sum with a greedy fill, then the cuts as early as the
    bound allows). The one partitioner: stage cuts by FLOPs here, and the search's stages
    by time (96 layers x 64 stages inside the search: dynamic programming, O(parts x n^2),
    was too slow).

    Example:
        >>> balance([1, 1, 1, 1], 2)
        (0, 0, 1, 1)
    """
    n = len(costs)
    if parts >= n:
        return tuple(range(n))

    def fill(bound: float) -> list[int] | None:
        out, part, acc = [], 0, 0.0
        for _k, c in enumerate(costs):
            if acc + c > bound and acc > 0:
                part += 1
                acc = 0.0
            if part >= parts:
                return None
            out.append(part)
            acc += c
        return out

    lo, hi = max(costs), sum(costs)
    for _ in range(60):
        mid = (lo + hi) / 2
        if fill(mid) is None:
            lo = mid
        else:
            hi = mid
    found = fill(hi)
    assert found is not None
    best: list[int] = found
    # a greedy fill may use fewer parts: split the heaviest parts until there are enough
    while max(best) + 1 < parts:
        counts = [best.count(q) for q in range(max(best) + 1)]
        weight = [0.0] * len(counts)
        for c, b in zip(costs, best):
            weight[b] += c
        q = max((q for q in range(len(counts)) if counts[q] > 1), key=lambda q: weight[q])
        first = best.index(q)
        best = [b + 1 if (b > q or (b == q and k > first)) else b for k, b in enumerate(best)]
    return tuple(best)


# ---------------------------------------------------------------- graph sharding

def graph_blocks(graph: Graph, batch_inputs: set[str]) -> tuple[Block, ...]:
    """The blocks of `graph` (module doc). `batch_inputs` names the graph inputs that carry
    the batch; every other floating input is a parameter."""
    ops = graph.ops
    n = len(ops)
    if n == 0:
        return ()
    activation = _activations(graph, batch_inputs)
    crossing = _crossing_counts(graph, activation)
    positive = [c for c in crossing[1:] if c > 0]
    least = min(positive) if positive else 0
    cuts = [k for k in range(1, n) if crossing[k] <= least]
    bounds = [0, *cuts, n]
    segments = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
    ids: dict[tuple, int] = {}
    sigs = [ids.setdefault(block_signature(ops[a:b]), len(ids)) for a, b in segments]
    seg_flops = [_flops(ops[a:b]) for a, b in segments]
    groups = _group_repeats(sigs, seg_flops, 0, len(sigs))
    if len(groups) == 1 and len(segments) > 1:
        groups = _by_module([module_label(ops[a:b]) for a, b in segments])
    blocks = []
    layer = 0
    for lo, hi, kind in groups:
        start, stop = segments[lo][0], segments[hi - 1][1]
        if kind.startswith("layer "):  # a numbered module's (`_by_module`)
            label = kind[len("layer "):]
            layer += 1
        elif kind == "layer":
            label = module_label(ops[start:stop]) or f"layer {layer}"
            layer += 1
        else:
            modules = sorted({op.module for op in ops[start:stop] if op.module})
            label = kind + (f" ({', '.join(modules[:3])}{', ...' if len(modules) > 3 else ''})"
                            if modules else "")
        blocks.append(Block(start, stop, _flops(ops[start:stop]), label))
    return tuple(blocks)


def _activations(graph: Graph, batch_inputs: set[str]) -> set[str]:
    """Names of values depending on a batch input and on a parameter."""
    batch = set(batch_inputs)
    param = {v.name for v in graph.inputs
             if v.name not in batch and v.type.dtype.is_floating_point}
    for op in graph.ops:
        names = [v.name for v in op.inputs]
        on_batch = any(x in batch for x in names)
        on_param = any(x in param for x in names)
        for o in op.outputs:
            if on_batch:
                batch.add(o.name)
            if on_param:
                param.add(o.name)
    return batch & param


def _crossing_counts(graph: Graph, activation: set[str]) -> list[int]:
    """crossing[k]: activations defined before op k and read at or after it."""
    n = len(graph.ops)
    last = last_uses(graph)
    delta = [0] * (n + 2)
    for k, op in enumerate(graph.ops):
        for v in op.outputs:
            if v.name in activation and last.get(v.name, k) > k:
                delta[k + 1] += 1
                delta[last[v.name] + 1] -= 1
    out = []
    running = 0
    for k in range(n + 1):
        running += delta[k]
        out.append(running)
    return out


def block_signature(ops: Sequence[Op]) -> tuple:
    """What makes two blocks the same kind: their ops and input shapes, in order.

    Example:
        >>> block_signature(graph.ops[0:2])
        (('linear', ((8, 16), (32, 16))), ('gelu', ((8, 32),)))
    """
    return tuple((op.name, tuple(v.type.shape for v in op.inputs)) for op in ops)


def _group_repeats(sigs: list[int], flops: list[int], lo: int, hi: int,
                   min_flops: float = 0.0) -> list[tuple[int, int, str]]:
    """Segments [lo, hi) grouped as (first, stop, kind): the repeated run of a pattern
    covering the most FLOPs gives one "layer" group per repetition; the rest is searched
    the same way, accepting runs whose repetitions weigh at least a quarter of the main
    run's (so mask and rotary-table ops repeated in a prologue stay in it); what has no
    such run is one group ("embed" before the layers, "head" after them)."""
    if hi <= lo:
        return []
    prefix = [0]
    for f in flops:
        prefix.append(prefix[-1] + f)
    best = None
    for period in range(1, (hi - lo) // 2 + 1):
        for start in range(lo, hi - 2 * period + 1):
            reps = 1
            while (start + (reps + 1) * period <= hi and
                   sigs[start + reps * period:start + (reps + 1) * period]
                   == sigs[start:start + period]):
                reps += 1
            per_rep = prefix[start + period] - prefix[start]
            if reps >= 2 and per_rep > 0 and per_rep >= min_flops:
                key = (per_rep * reps, -period, -start)
                if best is None or key > best[0]:
                    best = (key, start, period, reps)
    if best is None:
        return [(lo, hi, "block")]
    _, start, period, reps = best
    stop = start + period * reps
    threshold = max(min_flops, 0.25 * (prefix[start + period] - prefix[start]))
    before = _group_repeats(sigs, flops, lo, start, threshold)
    after = _group_repeats(sigs, flops, stop, hi, threshold)
    before = [(a, b, "embed" if k == "block" and lo == 0 else k) for a, b, k in before]
    after = [(a, b, "head" if k == "block" and hi == len(sigs) else k) for a, b, k in after]
    layers = [(start + i * period, start + (i + 1) * period, "layer") for i in range(reps)]
    return before + layers + after


def _by_module(labels: list[str]) -> list[tuple[int, int, str]]:
    """Segments grouped by the numbered module holding them (`encoder.stages.0.layers.1`),
    for models with no repeated run at all: a hierarchical CNN whose stages differ in
    width, one layer each, still gets a block per layer (planned per layer, pipelined). A
    layer is numbered twice in hierarchical models (`stages.0.layers.1`), once in flat
    ones (`layers.3`): the depth is the most numbers any label has, up to 2; deeper numbers
    are parts of a layer. Segments numbered less deeply (a stem, a pooler, a `Sequential`
    head) join the group before them ("embed" for the first). The kind is "layer <key>"."""
    numbered = [[j for j, part in enumerate(lb.split(".")) if part.isdigit()] if lb else []
                for lb in labels]
    depth = min(2, max(len(n) for n in numbered))
    groups: list[tuple[int, int, str]] = []
    for i, (label, nums) in enumerate(zip(labels, numbered)):
        key = ".".join(label.split(".")[:nums[depth - 1] + 1]) if depth and len(nums) >= depth \
            else ""
        if groups and (not key or groups[-1][2] == f"layer {key}"):
            groups[-1] = (groups[-1][0], i + 1, groups[-1][2])
        else:
            groups.append((i, i + 1, f"layer {key}" if key else "embed"))
    return groups if len(groups) > 1 else [(0, len(labels), "block")]


def module_label(ops: Sequence[Op]) -> str:
    """The deepest module path shared by the block's ops, e.g. `transformer.h.3`; "" for
    pure functions or when they share none.

    Example:
        >>> module_label(graph.ops[10:40])
        'transformer.h.0'
    """
    paths = [op.module.split(".") for op in ops if op.module]
    if not paths:
        return ""
    return ".".join(os.path.commonprefix(paths))


def _flops(ops: Sequence[Op]) -> int:
    return sum(rule_info(op).flops for op in ops)


def _span(labels: list[str]) -> str:
    if len(labels) <= 4:
        return ", ".join(labels)
    return f"{labels[0]}, {labels[1]}, ..., {labels[-1]} ({len(labels)} blocks)"


def tag_blocks(graph: Graph, blocks: Sequence[Any], recompute: Sequence[bool],
               fn: str) -> Graph:
    """`graph` with the ops of every chosen block in a recompute region of its own (ops
    already in a user's region keep theirs: user transforms are constraints). A block is
    anything with `start`, `stop` (its ops) and `label` (a `Block`, a plan's `BlockPlan`)."""
    start = 1 + max((op.tag(RECOMPUTE).region for op in graph.ops
                     if op.tag(RECOMPUTE) is not None), default=-1)
    ops = list(graph.ops)
    for k, (b, flag) in enumerate(zip(blocks, recompute)):
        if not flag:
            continue
        tag = RecomputeTag(start + k, Policy(), f"{fn} {b.label}")
        for i in range(b.start, b.stop):
            if ops[i].tag(RECOMPUTE) is None:
                ops[i] = ops[i].with_tag(RECOMPUTE, tag)
    return graph.replace(ops=tuple(ops))
