"""Coshard expansion (nnScaler's coshard): a region becomes `chunks` copies, one per piece
of its split arguments, run one after another on the same devices, each recomputed in
backward (unless `recompute=False`). With `overlap=True` every op of piece c carries a
`PieceTag`, by which the lowering interleaves the pieces so that one piece's collectives
run while the next computes (`pxform.lower.overlap`: Merak's sub-pipelined tensor
parallelism).

The pieces are a mesh axis that exists only in time: a virtual axis `cs` of size `chunks`.
Each op of the region gets the strategy on `cs` that takes its inputs exactly as they are
(no communication is possible between pieces that never coexist), found among the same
strategies `pxform.ops.strategy` generates from the op's dim signature for real mesh axes.
`pxform.ops.local.local_call` then rewrites each op for one piece (view sizes, a mean over
a split dim scaled by 1/chunks, a counted loss divided by the whole batch's count), exactly
as it rewrites ops for one rank. Outputs are combined per their layout on `cs`: split ->
`cat` along the dim, partial sum -> `add`, whole -> the first piece's.

Because the expansion is an ordinary graph, everything downstream (SPMD lowering with
tensor parallelism inside the pieces, pipelines, the runtime) needs no special case.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pxform.core.ir import Graph, Op, Renames, TensorType, Value, map_values
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.core.rng import PieceMap
from pxform.frontend.boundary import is_boundary
from pxform.frontend.regions import (
    COSHARD,
    PIECE,
    RECOMPUTE,
    CoshardTag,
    PieceTag,
    Policy,
    RecomputeTag,
    RegionError,
    next_region,
)
from pxform.frontend.rng import RANDOM
from pxform.frontend.trace import last_uses
from pxform.ops.local import local_call
from pxform.ops.registry import bind, rule_info
from pxform.ops.strategy import REPLICATE, Strategy, strategies

AXIS = "cs"
aten = torch.ops.aten


def expand(graph: Graph, region_inputs: dict[int, dict[int, Value]],
           ways: Callable[[str, int], int] | None = None) -> Graph:
    """`graph` with every coshard region expanded (see module doc).

    Args:
        region_inputs: per region number, its argument values by leaf index (from the
            region's markers).
        ways: `ways(value name, dim)`: into how many shards the mesh splits that dim of the
            value (the batch over data parallelism and microbatches). A piece then takes
            its share of every shard, so each rank's pieces are pieces of what it holds and
            no piece needs another rank's data.
    """
    ways = ways or (lambda name, dim: 1)
    if not any(op.tag(COSHARD) is not None for op in graph.ops):
        return graph
    last_use = last_uses(graph)
    ops: list[Op] = []
    renames = Renames()
    seen: set[int] = set()
    k = 0
    while k < len(graph.ops):
        op = renames.rewire(graph.ops[k])
        tag = op.tag(COSHARD)
        if tag is None:
            ops.append(op)
            k += 1
            continue
        if tag.region in seen:
            raise RegionError(f"pxform.coshard({tag.fn}): the region's ops are not contiguous "
                              f"in the trace (op {op.name} at {op.source or '?'} comes after "
                              f"other ops); this is a bug in pxform, please report it.")
        seen.add(tag.region)
        stop = k
        while stop < len(graph.ops) and graph.ops[stop].tag(COSHARD) == tag:
            stop += 1
        body = [renames.rewire(o) for o in graph.ops[k:stop]]
        later = {v.name for o in body for v in o.outputs if last_use.get(v.name, -1) >= stop}
        ops += _expand_region(body, tag, region_inputs.get(tag.region, {}), later, renames,
                              ways)
        k = stop
    return graph.replace(ops=tuple(ops), outputs=renames.outputs(graph.outputs))


def _expand_region(body: list[Op], tag: CoshardTag, inputs: dict[int, Value],
                   later: set[str], renames: Renames,
                   ways: Callable[[str, int], int]) -> list[Op]:
    n = tag.chunks
    mesh = AbstractMesh({AXIS: n})
    where = f"pxform.coshard({tag.fn})"
    for op in body:
        if is_boundary(op):
            raise RegionError(
                f"{where}: pxform.stage_boundary at {op.source or 'an unknown line'} is inside "
                f"the cosharded function; its pieces run one after another on the same "
                f"devices, so a pipeline cannot cut between them.\n  Fix: move the "
                f"stage_boundary out of the cosharded function (before or after the call).")
    layouts: dict[str, Layout] = {}
    split_inputs: dict[str, tuple[Value, int]] = {}
    for index, v in sorted(inputs.items()):
        d = tag.dims[index]
        if d is None or v.name in split_inputs:
            continue
        dims: list[tuple[str, ...]] = [()] * v.type.rank
        dims[d] = (AXIS,)
        layouts[v.name] = Layout(tuple(dims))
        split_inputs[v.name] = (v, d)

    def layout(v: Value) -> Layout:
        return layouts.get(v.name, Layout.replicated(v.type.rank))

    chosen: list[Strategy] = []
    for op in body:
        need = tuple(layout(v) for v in op.inputs)
        fits = [s for s in strategies(op, mesh) if s.inputs == need]
        if not fits:
            raise RegionError(_cannot_split(op, need, tag, split_inputs, where))
        # a label no input carries (a factory's size) is not split: fewest splits wins
        best = min(fits, key=lambda s: sum(c != REPLICATE for _, c in s.choices))
        chosen.append(best)
        for v, lay in zip(op.outputs, best.outputs):
            layouts[v.name] = lay

    out: list[Op] = []
    first = body[0]
    # One grouping for every split input (and the outputs), so piece c means the same
    # examples (or heads) in all of them: the mesh's shards, each cut into n pieces.
    g = math.lcm(1, *(ways(name, d) for name, (v, d) in split_inputs.items()))
    for v, d in split_inputs.values():
        if v.type.shape[d] % (g * n):
            raise RegionError(
                f"{where}: {v} ({v.type}) is split {g} ways along dim {d} by the mesh, and "
                f"{v.type.shape[d] // g} per shard does not divide into {n} pieces.\n  Fix: "
                f"choose chunks dividing {v.type.shape[d] // g}.")

    def pieces(c: int, suffix: str, tags: _Tags) -> dict[str, Value]:
        """Piece c of every split input, made by ops of the piece's own region (so only
        one piece is materialised at a time)."""
        return {name: _piece_of(v, d, c, n, g, first, out, suffix, tags)
                for name, (v, d) in split_inputs.items()}
    counts = _counts(body, chosen, mesh, n, g, pieces, out, where)

    envs: list[dict[str, Value]] = []
    for c in range(n):
        tags = _Tags(grad=True)
        if tag.recompute:  # each piece its own recompute region
            tags = tags.plus(RECOMPUTE, RecomputeTag(next_region(), Policy(),
                                                     f"{tag.fn} piece {c}"))
        elif first.tag(RECOMPUTE) is not None:  # all pieces in the enclosing region
            tags = tags.plus(RECOMPUTE, first.tag(RECOMPUTE))
        if tag.overlap:  # pieces interleaved by `pxform.lower.overlap`
            tags = tags.plus(PIECE, PieceTag(tag.region, c))
        env = pieces(c, f"cs{c}", tags)
        _emit_piece(body, chosen, mesh, env, f"c{c}", (c, n, g), tags, counts, out)
        envs.append(env)

    for op in body:  # combine the pieces of every value read after the region
        for v in op.outputs:
            if v.name not in later:
                continue
            parts = [env[v.name] for env in envs]
            lay = layouts[v.name]
            split = [d for d, axes in enumerate(lay.dims) if AXIS in axes]
            if split:
                _join(parts, v, split[0], g, op, out)
            elif AXIS in lay.partial:
                acc = parts[0]
                for c, part in enumerate(parts[1:], start=1):
                    total = v if c == n - 1 else Value(f"{v.name}.sum{c}", parts[0].type)
                    out.append(Op(aten.add.Tensor, (acc, part), (total,), module=op.module,
                                  source=op.source))
                    acc = total
                if n == 1:
                    renames.add(v, parts[0])
            else:  # whole on every piece: each computed the same value
                renames.add(v, parts[0])
    return out


@dataclass(frozen=True)
class _Tags:
    """What the ops of one piece carry: `tags` (its recompute region, its `PieceTag`), and
    whether they are differentiated (`grad`: the count ops ahead of the pieces are not)."""

    grad: bool
    tags: tuple[tuple[str, Any], ...] = ()

    def plus(self, key: str, value: Any) -> _Tags:
        return _Tags(self.grad, (*self.tags, (key, value)))


def _emit_piece(ops: list[Op], chosen: list[Strategy], mesh: AbstractMesh,
                env: dict[str, Value], suffix: str, piece: tuple[int, int, int],
                tags: _Tags, counts: dict[int, Value], out: list[Op]) -> None:
    """Append the ops of piece c of n (the mesh splitting split dims g ways) to `out`,
    rewritten for piece shapes and carrying the piece's `tags`; `env` maps each value of
    the region to its piece (filled in as ops are emitted)."""
    c, n, g = piece
    for op, s in zip(ops, chosen):
        call = local_call(op, s.inputs, s.outputs, mesh)

        def sub(v: Value) -> Value:
            return env.get(v.name, v)

        args = tuple(map_values(a, sub) for a in call.args)
        kwargs = tuple((key, map_values(a, sub)) for key, a in call.kwargs)
        outs = tuple(Value(f"{v.name}.{suffix}",
                           TensorType(lay.local_shape(v.type.shape, mesh), v.type.dtype))
                     for v, lay in zip(op.outputs, s.outputs))
        own = {k for k, _ in tags.tags}  # the piece's tags replace the op's
        kept = [(k, v) for k, v in op.tags if k not in (COSHARD, RANDOM, *own)]
        kept += tags.tags
        random = op.tag(RANDOM)
        if random is not None:  # its piece's elements keep their traced positions
            kept.append((RANDOM, random.with_piece(tuple(
                _piece_map(v_size, c, n, g) if AXIS in axes else None
                for v_size, axes in zip(op.outputs[0].type.shape, s.outputs[0].dims)))))
        new = Op(call.target, args, outs, kwargs, tuple(sorted(kept, key=lambda kv: kv[0])),
                 op.module, op.source, op.grad and tags.grad)
        out.append(new)
        results = list(outs)
        if call.scale != 1.0 or call.count is not None:
            divisor = counts[id(op)] if call.count is not None else None
            results = [_rescale(r, call.scale, divisor, new, out) for r in results]
        for v, r in zip(op.outputs, results):
            env[v.name] = r


def _piece_map(size: int, c: int, n: int, g: int) -> PieceMap:
    """Where piece c of n of a dim of `size` takes its elements (`_piece_of`): from each of
    the g shards, the c-th run of size / (g n)."""
    block = size // (g * n)
    return PieceMap(block=block, stride=size // g, offset=c * block)


def _piece_of(v: Value, d: int, c: int, n: int, g: int, op: Op, out: list[Op], suffix: str,
              piece: _Tags) -> Value:
    """Piece `c` of `n` of `v` along dim `d`, taken from each of the `g` shards the mesh
    splits that dim into: a slice when `g` is 1; otherwise view the dim as [g, n, rest],
    take index c of the middle and merge back, so the piece stays laid out like `v`."""
    shape, size = v.type.shape, v.type.shape[d]
    piece_shape = shape[:d] + (size // n,) + shape[d + 1:]
    tags, grad = tuple(sorted(piece.tags, key=lambda kv: kv[0])), piece.grad
    res = Value(f"{v.name}.{suffix}", TensorType(piece_shape, v.type.dtype))
    if g == 1:
        out.append(Op(aten.slice.Tensor, (v, d, c * size // n, (c + 1) * size // n), (res,),
                      tags=tags, module=op.module, source=op.source, grad=grad))
        return res
    grouped = shape[:d] + (g, n, size // (g * n)) + shape[d + 1:]
    a = Value(f"{v.name}.{suffix}g", TensorType(grouped, v.type.dtype))
    b = Value(f"{v.name}.{suffix}s", TensorType(grouped[:d + 1] + grouped[d + 2:], v.type.dtype))
    out.append(Op(aten.view.default, (v, list(grouped)), (a,), tags=tags, module=op.module,
                  source=op.source, grad=grad))
    out.append(Op(aten.select.int, (a, d + 1, c), (b,), tags=tags, module=op.module,
                  source=op.source, grad=grad))
    out.append(Op(aten.reshape.default, (b, list(piece_shape)), (res,), tags=tags,
                  module=op.module, source=op.source, grad=grad))
    return res


def _join(parts: list[Value], v: Value, d: int, g: int, op: Op, out: list[Op]) -> None:
    """Define `v` from its pieces along dim `d`: concatenated when the mesh does not split
    the dim; otherwise each shard's pieces in turn (the inverse of `_piece_of`)."""
    if g == 1:
        out.append(Op(aten.cat.default, (parts, d), (v,), module=op.module, source=op.source))
        return
    n, shape = len(parts), v.type.shape
    size = shape[d]
    grouped = shape[:d] + (g, size // (g * n)) + shape[d + 1:]
    views = []
    for p in parts:
        w = Value(f"{p.name}.g", TensorType(grouped, v.type.dtype))
        out.append(Op(aten.view.default, (p, list(grouped)), (w,), module=op.module,
                      source=op.source))
        views.append(w)
    stacked_shape = shape[:d] + (g, n, size // (g * n)) + shape[d + 1:]
    stacked = Value(f"{v.name}.stack", TensorType(stacked_shape, v.type.dtype))
    out.append(Op(aten.stack.default, (views, d + 1), (stacked,), module=op.module,
                  source=op.source))
    out.append(Op(aten.view.default, (stacked, list(shape)), (v,), module=op.module,
                  source=op.source))


def _counts(body: list[Op], chosen: list[Strategy], mesh: AbstractMesh, n: int, g: int,
            pieces: Callable[[int, str, _Tags], dict[str, Value]],
            out: list[Op], where: str) -> dict[int, Value]:
    """For losses averaged over counted targets (`cross_entropy(ignore_index=...)`) split
    into pieces: the whole batch's count, summed over the pieces before any piece runs (each
    piece's targets are recomputed, without gradient, from the ops that make them), so
    each piece divides its sum by it and the pieces add up to the mean."""
    counts: dict[int, Value] = {}
    producers = {v.name: k for k, op in enumerate(body) for v in op.outputs}
    for op, s in zip(body, chosen):
        call = local_call(op, s.inputs, s.outputs, mesh)
        if call.count is None:
            continue
        target = bind(op).get("target")
        if call.count.weighted or not isinstance(target, Value):
            raise RegionError(
                f"{where}: {op.name} at {op.source or 'an unknown line'} averages over targets "
                f"split into pieces, with class weights, which coshard cannot count.\n  Fix: "
                f"use reduction='sum' inside the region and divide outside it.")
        needed: set[int] = set()
        stack = [target]
        while stack:  # the region's ops the targets come from
            v = stack.pop()
            k = producers.get(v.name)
            if k is not None and k not in needed:
                needed.add(k)
                stack += list(body[k].inputs)
        subset = sorted(needed)
        total: Value | None = None
        name = op.outputs[0].name
        for c in range(n):
            env = pieces(c, f"t{c}_{name}", _Tags(grad=False))
            _emit_piece([body[k] for k in subset], [chosen[k] for k in subset], mesh, env,
                        f"t{c}_{name}", (c, n, g), _Tags(grad=False), counts, out)
            t = env.get(target.name, target)
            keep = Value(f"{name}.keep{c}", TensorType(t.type.shape, torch.bool))
            got = Value(f"{name}.count{c}", TensorType((), torch.int64))
            out.append(Op(aten.ne.Scalar, (t, call.count.ignore_index), (keep,),
                          module=op.module, source=op.source, grad=False))
            out.append(Op(aten.sum.default, (keep,), (got,), module=op.module,
                          source=op.source, grad=False))
            if total is None:
                total = got
            else:
                summed = Value(f"{name}.counts{c}", TensorType((), torch.int64))
                out.append(Op(aten.add.Tensor, (total, got), (summed,), module=op.module,
                              source=op.source, grad=False))
                total = summed
        assert total is not None
        counts[id(op)] = total
    return counts


def _rescale(v: Value, scale: float, divisor: Value | None, op: Op, out: list[Op]) -> Value:
    """`v * scale` (a mean over a split dim) or `v / divisor` (a counted loss), as ops of
    the same piece."""
    tags = op.tags
    if divisor is not None:
        res = Value(f"{v.name}.div", v.type)
        out.append(Op(aten.div.Tensor, (v, divisor), (res,), tags=tags, module=op.module,
                      source=op.source, grad=op.grad))
        return res
    res = Value(f"{v.name}.scaled", v.type)
    out.append(Op(aten.mul.Tensor, (v, scale), (res,), tags=tags, module=op.module,
                  source=op.source, grad=op.grad))
    return res


def _cannot_split(op: Op, need: tuple[Layout, ...], tag: CoshardTag,
                  split_inputs: dict[str, tuple[Value, int]], where: str) -> str:
    """Why no strategy of `op` takes its inputs as they come, in words."""
    sig = rule_info(op).signature
    splittable = sig.splittable()
    head = (f"{where}: {op.name} at {op.source or 'an unknown line'} cannot run in "
            f"{tag.chunks} pieces")
    fix = ("\n  Fix: coshard along a dim that every op of the region keeps (the batch, or "
           "the heads of attention), or end the region before this op.")
    args = list(op.inputs)
    for i, (v, lay) in enumerate(zip(args, need)):
        if AXIS in lay.partial:
            return (f"{head}: its input {v} ({v.type}) is a partial sum over the pieces (an "
                    f"earlier op of the region contracted the split dim), and {op.name} is "
                    f"not linear in it.{fix}")
        for d, axes in enumerate(lay.dims):
            if AXIS not in axes:
                continue
            term = sig.inputs[i][d] if i < len(sig.inputs) and d < len(sig.inputs[i]) else ()
            label = term[0] if term else None
            if label is None or label not in splittable:
                verb = ("reduces or normalises over" if label in sig.labels()
                        else "cannot split")
                return (f"{head}: its input {v} ({v.type}) is split along dim {d}, which "
                        f"{op.name} {verb}.{fix}")
            if sig.size(label) % tag.chunks:
                return (f"{head}: its input {v} ({v.type}) is split along dim {d} "
                        f"({sig.size(label)}), which does not divide into {tag.chunks} pieces "
                        f"where {op.name} uses it.{fix}")
    shown = ", ".join(f"{v} {v.type} " + ("split along dim " + ", ".join(
        str(d) for d, axes in enumerate(lay.dims) if AXIS in axes) if lay.used_axes()
        else "whole") for v, lay in zip(args, need))
    return (f"{head}: its inputs come as {shown}, which no way of splitting {op.name} "
            f"accepts without communication (an input from outside the region's split "
            f"arguments is whole where the op needs it split like the others).{fix}")
