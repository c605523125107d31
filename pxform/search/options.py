"""Option costing: what one block costs under one option (axis roles x recompute) on one
configuration, and the option tables blocks choose from (`block_tables`).

Per block option, per microbatch (`blockcost.walk`):

    F = forward compute + forward re-layouts
    B = 2 x forward compute + activation-gradient re-layouts (+ the forward up to the last
        op making a tensor the backward saved, when recomputed: `WalkCost.redo_fwd`)
    parameter-gradient reductions overlap B (`CostModel.overlap`): ZeRO-3's reduce-scatter
    every microbatch, data parallel's all-reduce once per step (gradients accumulate
    locally, as DDP's no_sync and Megatron do)

and per device memory: parameter + gradient + optimizer bytes, plus the microbatches in
flight x (bytes saved for backward, or only the block's inputs when recomputed)
(`OptionCost.memory`), plus a workspace (`OptionCost.workspace`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from pxform.core.errors import SpecError
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.frontend.regions import RECOMPUTE
from pxform.ops.strategy import Strategy
from pxform.search.analysis import Analysis, BlockInfo
from pxform.search.blockcost import (
    WalkCost,
    combine,
    data_layout,
    is_activation,
    sdp_layout,
    sequence_layout,
    walk,
)
from pxform.search.context import (
    BlockLayouts,
    OptionCost,
    OptionTable,
    SearchContext,
    first_block,
)
from pxform.search.space import INNER, OUTER, Config, Option, options


def block_strategies(ctx: SearchContext, block: BlockInfo, config: Config, option: Option,
                     mesh: AbstractMesh | None = None,
                     extra: Mapping[str, str] | None = None) -> list[Strategy]:
    """Per op of `block`, its strategy on `mesh` (default: the stage mesh) under `option`;
    `extra` gives roles of further axes (the pipeline's microbatch axis is data)."""
    a = ctx.analysis
    mesh = mesh or config.stage_mesh
    roles = dict(option.roles)
    roles.update(extra or {})
    picks = ctx.tensor_picks(block.kind, config, option.sequence_parallel) \
        if option.tensor_axis else None
    # the representative block of the kind has the same ops at the same offsets
    return [combine(a, k, mesh, roles, picks[k - block.start] if picks else None)
            for k in range(block.start, block.stop)]


def param_layouts(ctx: SearchContext, block: BlockInfo, config: Config, option: Option,
                  strats: Sequence[Strategy], mesh: AbstractMesh) -> dict[str, Layout]:
    """Where each parameter the block reads is stored: as its first reader needs it on
    the tensor axis, split over the sharded-data axes under `sdp`."""
    a = ctx.analysis
    out: dict[str, Layout] = {}
    for k, s in zip(range(block.start, block.stop), strats):
        for i, v in enumerate(a.graph.ops[k].inputs):
            if v.name in a.params and v.name not in out:
                tensor_axis = option.tensor_axis
                dims = tuple(tuple(ax for ax in axes if ax == tensor_axis)
                             for axes in s.inputs[i].dims)
                base = Layout(dims)
                out[v.name] = (sdp_layout(v, base, option.sdp_axes, mesh)
                               if option.sdp_axes else base)
    return out


def canonical(ctx: SearchContext, name: str, rank: int, option: Option,
              inner: int = 1) -> Layout:
    """Where a value crossing blocks is laid out under `option`: split over its data axes,
    and, with sequence parallelism, over the tensor axis (of size `inner`) along its
    sequence dim (`blockcost.sequence_layout`)."""
    a = ctx.analysis
    base = data_layout(a, name, rank, option.data_axes)
    if option.sequence_parallel and inner > 1 and is_activation(a, name):
        return sequence_layout(a, name, a.values()[name].type.shape, base,
                               option.tensor_axis or INNER, inner)
    return base


def walk_cost(ctx: SearchContext, block: BlockInfo, config: Config, option: Option
              ) -> WalkCost:
    """The block's walk at this configuration's microbatch size, interpolated linearly
    between walks at the powers of two of the traced batch around it (at the traced
    batch and half of it above half). Bytes and the affine part of times scale with the
    microbatch, but a measured op curve or comm table is not affine: an op's time stays
    at its smallest measured point's below it (`OpCurve`), so a line through the walks
    at 1 and 1/2 of the batch, carried down to 1/8 or 1/32, missed what the curves say
    there (GPT small's 8-microbatch pipelines moved by -2 to +7 % with three calibrated
    profiles) and, where a curve rose faster than its size between them, went below
    zero (a block of the reference transformer at -6 us forward, 2026-11-29). Walks are
    cached per scale."""
    scale = (ctx.global_batch // config.microbatches) / ctx.analysis.traced_batch
    key = (block.kind, config.outer, config.inner, option.roles, scale)
    hit = ctx.walks.get(key)
    if hit is not None:
        return hit
    upper, lower = walked_around(scale)
    if scale in (lower, upper):
        # (at a walked scale the line is that walk: one-stage plans at the traced batch
        # walked half of it for nothing, 54 of BERT-large's 315 walks on 8 devices)
        cost = _walk_at(ctx, block, config, option, scale)
    else:
        above = _walk_at(ctx, block, config, option, upper)
        below = _walk_at(ctx, block, config, option, lower)
        cost = WalkCost(*(b + (a - b) * (scale - lower) / (upper - lower)
                          for a, b in zip(_fields(above), _fields(below))))
    ctx.walks[key] = cost
    return cost


def walked_around(scale: float) -> tuple[float, float]:
    """(upper, lower): the walked scales `walk_cost` draws its line through at `scale`: 1
    and 1/2 from half the batch up (a line beyond the batch), then every fourth power of
    two below (1/2, 1/8, 1/32, ...). One level per factor of 4 takes a quarter fewer walks
    than one per factor of 2 on BERT-large's search (315 against 417).

    Example:
        >>> walked_around(0.75), walked_around(1 / 16)
        ((1.0, 0.5), (0.125, 0.03125))
    """
    upper, lower = 1.0, 0.5
    while scale < lower and lower > 2.0 ** -30:
        upper, lower = lower, lower / 4
    return upper, lower


def _fields(w: WalkCost) -> tuple[float, ...]:
    return (w.fwd_compute, w.fwd_comm, w.bwd_comm, w.grad_comm, w.saved_bytes, w.kept_bytes,
            w.param_bytes, w.grad_bytes, w.transient_bytes, w.packed_bytes, w.packed_outer,
            w.packed_inner, w.redo_bytes, w.bwd_compute, w.weight_compute,
            w.weight_out_bytes, w.gather_s, w.weight_ops, w.gathered_saved_bytes,
            w.weight_held_bytes, w.redo_fwd, w.largest_grad_bytes,
            w.gather_transient_bytes, w.freed_bytes, w.kept_freed_bytes, w.redo_first_bytes)


def _walk_at(ctx: SearchContext, block: BlockInfo, config: Config, option: Option,
             scale: float) -> WalkCost:
    key = (block.kind, config.outer, config.inner, option.roles, scale)
    hit = ctx.measured_walks.get(key)
    if hit is not None:
        return hit
    a = ctx.analysis
    block = first_block(a, block.kind)
    layout_key = (block.kind, config.outer, config.inner, option.roles)
    laid = ctx.block_layouts.get(layout_key)
    if laid is None:  # the same at every scale
        mesh = config.stage_mesh
        strats = block_strategies(ctx, block, config, option)
        params = param_layouts(ctx, block, config, option, strats, mesh)
        vals = a.values()
        outside: dict[str, Layout] = {}
        for k in range(block.start, block.stop):
            for v in a.graph.ops[k].inputs:
                if v.name not in params and v.name not in outside:
                    outside[v.name] = canonical(ctx, v.name, v.type.rank, option,
                                                config.inner)
        outputs = {n: canonical(ctx, n, vals[n].type.rank, option, config.inner)
                   for n in block.crossing
                   if block.start <= a.defined_at.get(n, -1) < block.stop}
        laid = ctx.block_layouts[layout_key] = BlockLayouts(strats, outside, params, outputs)
    cost = walk(a, block, laid.strategies, laid.outside, laid.params, ctx.cache(config),
                scale, a.batch_values, laid.outputs)
    ctx.measured_walks[key] = cost
    return cost



def option_cost(ctx: SearchContext, block: BlockInfo, config: Config, option: Option
                ) -> OptionCost:
    w = walk_cost(ctx, block, config, option)
    model = ctx.model
    f = w.fwd_compute + w.fwd_comm
    # recomputed: the forward again, as far as the backward needs it (`WalkCost.redo_fwd`),
    # and the checkpoint's own cost per region (a recomputed block is one region)
    bc = w.bwd_compute + w.bwd_comm
    if option.recompute:
        bc += w.redo_fwd + ctx.hardware.recompute_overhead_s
    saved = w.saved_bytes
    if not option.reshard:
        # ZeRO-3 keeping what forward gathered (`Option.reshard`): backward gathers
        # nothing, and each microbatch in flight holds the gathered parameters its ops
        # saved (the runtime gathers per microbatch)
        bc -= w.gather_s
        saved += w.gathered_saved_bytes
    transient, freed = w.transient_bytes, w.freed_bytes
    if not option.reshard:  # (nothing gathered in backward)
        transient, freed = transient - w.gather_transient_bytes, w.kept_freed_bytes
    if option.sdp_axes:
        b = model.overlap(bc, w.grad_comm)
        extra = 0.0
    else:
        b = bc
        extra = model.overlap(bc, w.grad_comm) - bc
    # the packed all-reduces: this block's share of the step's (`assemble` prices the
    # chosen blocks' sum exactly)
    extra += (ctx.packed_rate(config, OUTER) * w.packed_outer
              + ctx.packed_rate(config, INNER) * w.packed_inner)
    return OptionCost(f, b, extra, saved, w.kept_bytes, w.param_bytes, w.grad_bytes,
                      transient, w.packed_bytes, w.redo_bytes, w.packed_outer,
                      w.packed_inner, w.weight_compute, w.weight_out_bytes,
                      round(w.weight_ops), w.weight_held_bytes, w.largest_grad_bytes,
                      freed, w.redo_first_bytes)



def transition(ctx: SearchContext, prev: BlockInfo, config: Config, s: Option, s2: Option
               ) -> float:
    """Per microbatch: re-layout of the values crossing from `prev` into the next block
    when `prev` takes `s` and the next `s2` (forward and backward)."""
    if (s.data_axes, s.sequence_parallel) == (s2.data_axes, s2.sequence_parallel):
        return 0.0
    key = (prev.kind, config.outer, config.inner, (s.data_axes, s.sequence_parallel),
           (s2.data_axes, s2.sequence_parallel), ctx.global_batch // config.microbatches)
    hit = ctx.transitions.get(key)
    if hit is not None:
        return hit
    a = ctx.analysis
    vals = a.values()
    cache = ctx.cache(config)
    scale = (ctx.global_batch // config.microbatches) / a.traced_batch
    batch_values = a.batch_values
    t = 0.0
    for name in prev.crossing:
        v = vals[name]
        src = canonical(ctx, name, v.type.rank, s, config.inner)
        dst = canonical(ctx, name, v.type.rank, s2, config.inner)
        if src == dst:
            continue
        sc = scale if name in batch_values else 1.0
        t += cache.time(v, src, dst, sc)
        if v.type.dtype.is_floating_point:
            t += cache.time(v, Layout(dst.dims), Layout(src.dims), sc)
    ctx.transitions[key] = t
    return t



def _valid(ctx: SearchContext, config: Config, option: Option) -> bool:
    b = ctx.global_batch // config.microbatches
    ways = math.prod(config.outer if ax == OUTER else config.inner for ax in option.data_axes)
    return b % ways == 0


def block_tables(ctx: SearchContext, config: Config) -> list[OptionTable] | None:
    """Per block, the options allowed on `config` and their costs (None when some block
    has no valid option: the batch per microbatch does not split over the data axes, or
    a pinned option does not exist on this mesh)."""
    if config in ctx.tables:
        return ctx.tables[config]
    a = ctx.analysis
    opts_all = tuple(o for o in options(config, ctx.pin.sequence_parallel is not False)
                     if _valid(ctx, config, o))
    per_block: list[tuple[Option, ...]] = []
    out: list[OptionTable] | None = None
    if opts_all:
        for k, blk in enumerate(a.blocks):
            allowed = opts_all
            pinned = ctx.pin.block_options[k] if ctx.pin.block_options else None
            if pinned is not None:
                allowed = tuple(o for o in opts_all if o == pinned)
            elif _user_recomputed(a, blk):
                allowed = tuple(o for o in opts_all if o.recompute)
            if not allowed:
                break
            per_block.append(allowed)
        else:
            by_kind: dict[tuple[int, int], OptionTable] = {}
            out = []
            for blk, opts in zip(a.blocks, per_block):
                key = ctx.table_key(opts)
                if (blk.kind, key) not in by_kind:
                    costed = [(o, _cost_or_none(ctx, blk, config, o)) for o in opts]
                    kept = tuple(o for o, c in costed if c is not None)
                    if not kept:
                        out = None
                        break
                    by_kind[blk.kind, key] = OptionTable(
                        ctx.table_key(kept), kept, tuple(c for _, c in costed if c is not None))
                out.append(by_kind[blk.kind, key])
    ctx.tables[config] = out
    return out



def _cost_or_none(ctx: SearchContext, block: BlockInfo, config: Config, option: Option
                  ) -> OptionCost | None:
    """The option's cost, or None where its layouts cannot exist on this mesh: a value's
    data-parallel layout splitting a dim that does not divide (an 8-channel dim 64 ways)."""
    try:
        return option_cost(ctx, block, config, option)
    except SpecError:
        return None


def _user_recomputed(a: Analysis, blk: BlockInfo) -> bool:
    ops = a.graph.ops[blk.start:blk.stop]
    return bool(ops) and all(op.tag(RECOMPUTE) is not None for op in ops)

