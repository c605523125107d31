"""The search: configurations x per-stage frontier DP x stage partition (DESIGN.md §6).

For each configuration (`space.configs`) the blocks are split into stages balancing their
fastest time (`pxform.cuts.balance`), then each stage's chain of blocks is solved by the
frontier DP (`frontier.chain_frontier`) under the memory budget left after its workspace;
a stage that does not fit gives a block to its neighbour towards the end of the pipeline
(later stages hold fewer microbatches in flight under 1F1B), up to `stages` moves
(Galvatron-BMW's bi-objective balance: time first, memory as the constraint that moves the
cuts). The step time of a pipeline is 1F1B's closed form over the stages' times (see
`pxform.cost.one_f_one_b_time`); the chosen plan is simulated exactly afterwards.

Per block option, per microbatch (`blockcost.walk`):

    F = forward compute + forward re-layouts
    B = 2 x forward compute + activation-gradient re-layouts (+ F when recomputed)
    parameter-gradient reductions overlap B (`CostModel.overlap`): ZeRO-3's reduce-scatter
    every microbatch, data parallel's all-reduce once per step (gradients accumulate
    locally, as DDP's no_sync and Megatron do)

and per device memory: parameter + gradient + optimizer bytes, plus the microbatches in
flight x (bytes saved for backward, or only the block's inputs when recomputed), with
gradients counted only as they replace freed activations when every microbatch is in
flight before the first backward (`OptionCost.memory`), plus a workspace: the largest op's
inputs and outputs, and a recomputed block's activations (`OptionCost.workspace`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pxform.cost import (
    BACKWARD_RATIO,
    CostModel,
    one_f_one_b_in_flight,
    one_f_one_b_time,
)
from pxform.layout import Layout
from pxform.mesh import AbstractMesh
from pxform.ops.strategy import Strategy
from pxform.search.analysis import Analysis, BlockInfo
from pxform.search.blockcost import (
    RelayoutCache,
    WalkCost,
    combine,
    data_layout,
    sdp_layout,
    tensor_strategies,
    walk,
)
from pxform.search.frontier import Point, chain_frontier
from pxform.search.space import INNER, OUTER, Config, Option, options

FRONTIER_LEVELS = (1.0, 0.8, 0.65, 0.5, 0.4, 0.3, 0.22, 0.15, 0.1)
"""Memory limits, as fractions of the budget, at which each configuration's fastest plan
is read off the stage frontiers for `Plan.frontier()`."""

QUANTUM = 1 / 256
"""Frontier memory rounding, as a fraction of the budget (`frontier` module doc)."""


@dataclass(frozen=True)
class Pin:
    """Choices fixed before the search: by the user's transforms (stage boundaries,
    recompute regions) or a plan passed back to `auto` (all of it, or some fields)."""

    stages: int | None = None
    outer: int | None = None
    inner: int | None = None
    microbatches: int | None = None
    block_options: tuple[Option | None, ...] | None = None  # per block, None: free
    block_stage: tuple[int, ...] | None = None
    tensor_choices: Mapping[int, tuple[tuple, ...]] | None = None  # kind -> per op choice


@dataclass(frozen=True)
class StageResult:
    stage: int
    blocks: tuple[int, ...]
    time: float            # per step, this stage alone (all microbatches)
    forward: float         # per microbatch
    backward: float        # per microbatch
    memory: float          # peak bytes per device
    in_flight: int
    param_bytes: float


@dataclass(frozen=True)
class Candidate:
    """One complete plan the search found."""

    config: Config
    options: tuple[Option, ...]     # per block
    block_stage: tuple[int, ...]
    stages: tuple[StageResult, ...]
    step_time: float
    peak_memory: float
    block_time: tuple[float, ...]   # per block, per step
    block_memory: tuple[float, ...]  # per block, per device
    batch: int = 0                   # the global batch planned for


@dataclass
class SearchContext:
    """Inputs and caches of one search."""

    analysis: Analysis
    model: CostModel
    budget: float
    global_batch: int
    pin: Pin = field(default_factory=Pin)
    _tensor: dict = field(default_factory=dict)
    _walk: dict = field(default_factory=dict)
    _relayout: dict = field(default_factory=dict)
    _trans: dict = field(default_factory=dict)
    _stages: dict = field(default_factory=dict)

    @property
    def hardware(self) -> Any:
        return self.model.hardware

    def axes(self, config: Config) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (size, link level) of the stage mesh."""
        hw = self.hardware
        return {OUTER: (config.outer, hw.level(config.outer * config.inner)),
                INNER: (config.inner, hw.level(config.inner))}

    def cache(self, config: Config) -> RelayoutCache:
        mesh = config.stage_mesh
        axes = {a: v for a, v in self.axes(config).items() if a in mesh.names}
        key = mesh, tuple(sorted(axes.items()))
        if key not in self._relayout:
            self._relayout[key] = RelayoutCache(self.model, axes, mesh)
        return self._relayout[key]

    def tensor_picks(self, kind: int, config: Config) -> tuple[Strategy, ...]:
        """The tensor-axis strategy of each op of blocks of `kind`."""
        a = self.analysis
        if self.pin.tensor_choices is not None and kind in self.pin.tensor_choices:
            return _from_choices(a, _first_block(a, kind), self.pin.tensor_choices[kind],
                                 config.inner)
        level = self.hardware.level(config.inner)
        key = (kind, config.inner, level)
        if key not in self._tensor:
            block = _first_block(a, kind)
            self._tensor[key] = tensor_strategies(a, block, INNER, config.inner, level,
                                                  self.model, 1.0)
        return self._tensor[key]


def _first_block(a: Analysis, kind: int) -> BlockInfo:
    return next(b for b in a.blocks if b.kind == kind)


def _from_choices(a: Analysis, block: BlockInfo, choices: Sequence[tuple], size: int
                  ) -> tuple[Strategy, ...]:
    from pxform.ops.registry import rule_info
    from pxform.ops.strategy import _build

    mesh = AbstractMesh({INNER: size})
    out = []
    for k, choice in zip(range(block.start, block.stop), choices):
        if choice[0] == "partial":
            choice = ("partial", frozenset(choice[1]))
        s = _build(rule_info(a.graph.ops[k]).signature, mesh, (choice,))
        if s is None:
            from pxform.errors import PxformError

            raise PxformError(f"pxform.auto: the pinned plan's tensor choice {choice} for op "
                              f"{a.graph.ops[k]} does not fit an inner axis of size {size}.")
        out.append(s)
    return tuple(out)


# ---------------------------------------------------------------- per block option

def block_strategies(ctx: SearchContext, block: BlockInfo, config: Config, option: Option,
                     mesh: AbstractMesh | None = None,
                     extra: Mapping[str, str] | None = None) -> list[Strategy]:
    """Per op of `block`, its strategy on `mesh` (default: the stage mesh) under `option`;
    `extra` gives roles of further axes (the pipeline's microbatch axis is data)."""
    a = ctx.analysis
    mesh = mesh or config.stage_mesh
    roles = dict(option.roles)
    roles.update(extra or {})
    picks = ctx.tensor_picks(block.kind, config) if option.tensor_axis else None
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


def canonical(ctx: SearchContext, name: str, rank: int, option: Option) -> Layout:
    return data_layout(ctx.analysis, name, rank, option.data_axes)


def walk_cost(ctx: SearchContext, block: BlockInfo, config: Config, option: Option
              ) -> WalkCost:
    """The block's walk at this configuration's microbatch size. Every term is affine in
    the microbatch size (compute and bytes scale, latencies do not), so two walks per
    kind, roles and mesh (at the traced batch and at half of it) give every size; with a
    measured comm table, which is not affine, this interpolates it linearly."""
    scale = (ctx.global_batch // config.microbatches) / ctx.analysis.traced_batch
    key = (block.kind, config.outer, config.inner, option.roles, scale)
    hit = ctx._walk.get(key)
    if hit is not None:
        return hit
    one = _walk_at(ctx, block, config, option, 1.0)
    half = _walk_at(ctx, block, config, option, 0.5)
    cost = WalkCost(*(h + (o - h) * (scale - 0.5) / 0.5 for o, h in zip(_fields(one),
                                                                          _fields(half))))
    ctx._walk[key] = cost
    return cost


def _fields(w: WalkCost) -> tuple[float, ...]:
    return (w.fwd_compute, w.fwd_comm, w.bwd_comm, w.grad_comm, w.saved_bytes, w.kept_bytes,
            w.param_bytes, w.grad_bytes, w.transient_bytes)


def _walk_at(ctx: SearchContext, block: BlockInfo, config: Config, option: Option,
             scale: float) -> WalkCost:
    key = ("at", block.kind, config.outer, config.inner, option.roles, scale)
    hit = ctx._walk.get(key)
    if hit is not None:
        return hit
    a = ctx.analysis
    block = _first_block(a, block.kind)
    layout_key = ("layouts", block.kind, config.outer, config.inner, option.roles)
    laid = ctx._walk.get(layout_key)
    if laid is None:  # the same at every scale
        mesh = config.stage_mesh
        strats = block_strategies(ctx, block, config, option)
        params = param_layouts(ctx, block, config, option, strats, mesh)
        vals = a.values()
        outside: dict[str, Layout] = {}
        for k in range(block.start, block.stop):
            for v in a.graph.ops[k].inputs:
                if v.name not in params and v.name not in outside:
                    outside[v.name] = canonical(ctx, v.name, v.type.rank, option)
        outputs = {n: canonical(ctx, n, vals[n].type.rank, option) for n in block.crossing
                   if block.start <= a.defined_at.get(n, -1) < block.stop}
        laid = ctx._walk[layout_key] = (strats, outside, params, outputs)
    strats, outside, params, outputs = laid
    cost = walk(a, block, strats, outside, params, ctx.cache(config), scale, a.batch_values,
                outputs)
    ctx._walk[key] = cost
    return cost


@dataclass(frozen=True)
class OptionCost:
    forward: float      # per microbatch
    backward: float     # per microbatch, with per-microbatch gradient reductions overlapped
    step_extra: float   # per step: data-parallel gradient all-reduce beyond what overlaps
    saved: float
    kept: float
    params: float       # parameters, their gradients and optimizer state
    grads: float        # of which the gradients
    transient: float    # the largest op's inputs and outputs (`WalkCost.transient_bytes`)

    def step_time(self, m: int) -> float:
        return m * (self.forward + self.backward) + self.step_extra

    def memory(self, in_flight: int, recompute: bool, microbatches: int) -> float:
        """The block's bytes at its stage's peak, without the workspace.

        When every microbatch is in flight before the stage's first backward (`in_flight >=
        microbatches`: no pipeline and one microbatch, or an early 1F1B stage with few
        microbatches), the peak comes during that backward, as the activations are freed
        block by block and the gradients appear: it is at most (in_flight - 1) x act +
        max(act, grads) summed over the blocks. Otherwise the gradients exist from the
        first backward on, while the stage again holds `in_flight` microbatches."""
        act = self.kept if recompute else self.saved
        state = self.params - self.grads
        if in_flight >= microbatches:
            return state + (in_flight - 1) * act + max(act, self.grads)
        return state + self.grads + in_flight * act

    def workspace(self, recompute: bool) -> float:
        """Bytes alive only while this block's backward runs: its largest op's inputs and
        outputs (their gradients), and when recomputed its activations, made again."""
        return self.transient + (self.saved if recompute else 0.0)


def option_cost(ctx: SearchContext, block: BlockInfo, config: Config, option: Option
                ) -> OptionCost:
    w = walk_cost(ctx, block, config, option)
    model = ctx.model
    f = w.fwd_compute + w.fwd_comm
    bc = BACKWARD_RATIO * w.fwd_compute + w.bwd_comm + (f if option.recompute else 0.0)
    if option.sdp_axes:
        b = model.overlap(bc, w.grad_comm)
        extra = 0.0
    else:
        b = bc
        extra = model.overlap(bc, w.grad_comm) - bc
    return OptionCost(f, b, extra, w.saved_bytes, w.kept_bytes, w.param_bytes, w.grad_bytes,
                      w.transient_bytes)


def transition(ctx: SearchContext, prev: BlockInfo, config: Config, s: Option, s2: Option
               ) -> float:
    """Per microbatch: re-layout of the values crossing from `prev` into the next block
    when `prev` takes `s` and the next `s2` (forward and backward)."""
    if s.data_axes == s2.data_axes:
        return 0.0
    key = (prev.kind, config.outer, config.inner, s.data_axes, s2.data_axes,
           ctx.global_batch // config.microbatches)
    hit = ctx._trans.get(key)
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
        src = canonical(ctx, name, v.type.rank, s)
        dst = canonical(ctx, name, v.type.rank, s2)
        if src == dst:
            continue
        sc = scale if name in batch_values else 1.0
        t += cache.time(v, src, dst, sc)
        if v.type.dtype.is_floating_point:
            t += cache.time(v, Layout(dst.dims), Layout(src.dims), sc)
    ctx._trans[key] = t
    return t


# ---------------------------------------------------------------- one configuration

def _valid(ctx: SearchContext, config: Config, option: Option) -> bool:
    b = ctx.global_batch // config.microbatches
    ways = math.prod(config.outer if ax == OUTER else config.inner for ax in option.data_axes)
    return b % ways == 0


def block_costs(ctx: SearchContext, config: Config
                ) -> tuple[list[list[Option]], list[list[OptionCost]]] | None:
    """Per block, the options allowed on `config` and their costs (None when some block
    has no valid option: the batch per microbatch does not split over the data axes, or
    a pinned option does not exist on this mesh)."""
    key = ("costs", config)
    if key in ctx._stages:
        return ctx._stages[key]
    a = ctx.analysis
    opts_all = [o for o in options(config) if _valid(ctx, config, o)]
    per_block: list[list[Option]] = []
    out: tuple[list[list[Option]], list[list[OptionCost]]] | None = None
    if opts_all:
        for k, blk in enumerate(a.blocks):
            allowed = opts_all
            pinned = ctx.pin.block_options[k] if ctx.pin.block_options else None
            if pinned is not None:
                allowed = [o for o in opts_all if o == pinned]
            elif _user_recomputed(a, blk):
                allowed = [o for o in opts_all if o.recompute]
            if not allowed:
                break
            per_block.append(allowed)
        else:
            by_kind: dict[tuple, list[OptionCost]] = {}
            costs = []
            for blk, opts in zip(a.blocks, per_block):
                kk = (blk.kind, tuple(opts))
                if kk not in by_kind:
                    by_kind[kk] = [option_cost(ctx, blk, config, o) for o in opts]
                costs.append(by_kind[kk])
            out = (per_block, costs)
    ctx._stages[key] = out
    return out


def lower_bound(ctx: SearchContext, config: Config,
                costs: list[list[OptionCost]] | None = None) -> float:
    """No plan of `config` is faster than this: every block at its fastest option, the
    work T spread evenly over the p stages, and 1F1B's warm-up and drain: the closed form
    `(m - 1) x max stage + sum of stages` per microbatch is at least
    `T (m - 1 + p) / (p m)`. `costs`: per block, the options to bound (default: all)."""
    if costs is None:
        table = block_costs(ctx, config)
        if table is None:
            return math.inf
        costs = table[1]
    m, p = config.microbatches, config.stages
    total = sum(min(c.step_time(m) for c in cs) for cs in costs)
    return total * (m - 1 + p) / (p * m) if p > 1 else total


def memory_lower_bound(ctx: SearchContext, config: Config) -> float:
    """No plan of `config` needs less memory per device than this: every block at its
    least-memory option with one microbatch in flight, spread evenly over the p stages (the
    peak is the largest stage's), plus the smallest workspace any block option has."""
    table = block_costs(ctx, config)
    if table is None:
        return math.inf
    per_block, costs = table
    m = config.microbatches
    total = sum(min(c.memory(1, o.recompute, m) for o, c in zip(opts, cs))
                for opts, cs in zip(per_block, costs))
    workspace = min(c.workspace(o.recompute) for opts, cs in zip(per_block, costs)
                    for o, c in zip(opts, cs))
    return total / config.stages + workspace


def evaluate(ctx: SearchContext, config: Config, objective: str = "time",
             incumbent: float = math.inf) -> tuple[Candidate | None, list[Candidate]]:
    """The best plan of `config` under the budget (None if nothing fits), and the fastest
    plans at lower memory limits (for the frontier). Option groups (`_data_groups`) whose
    lower bound cannot beat `incumbent` (the best step time so far) are skipped."""
    table = block_costs(ctx, config)
    if table is None:
        return None, []
    best: Candidate | None = None
    extra: list[Candidate] = []
    groups = sorted(_data_groups(ctx, config, *table),
                    key=lambda g: lower_bound(ctx, config, g[1]))
    for per_block, costs in groups:
        if objective == "time" and len(groups) > 1:
            beat = min(incumbent, best.step_time if best is not None else math.inf)
            if lower_bound(ctx, config, costs) >= beat:
                continue
        cand, more = _evaluate(ctx, config, objective, per_block, costs)
        extra += more
        if cand is not None and (best is None or _key(cand, objective) < _key(best, objective)):
            best = cand
    return best, extra


def _data_groups(ctx: SearchContext, config: Config, per_block: list[list[Option]],
                 costs: list[list[OptionCost]]
                 ) -> list[tuple[list[list[Option]], list[list[OptionCost]]]]:
    """The option tables to search: with microbatches, one per set of data axes that every
    block has options for. The microbatch axis is the innermost split of the batch
    (`pxform.lower.mpmd`), so a batch value split over other data axes than the block
    before it would have to be regrouped across microbatches, which no microbatch can
    do: all blocks of a pipelined plan split the batch over the same data axes."""
    sets = sorted({o.data_axes for opts in per_block for o in opts})
    if config.microbatches == 1 or len(sets) <= 1:
        return [(per_block, costs)]
    key = ("groups", config)
    hit = ctx._stages.get(key)
    if hit is not None:
        return hit
    out = []
    for axes in sets:
        # blocks that shared an option list share the filtered one (stage caches key on it)
        shared: dict[tuple[int, int], tuple[list[Option], list[OptionCost]]] = {}
        group_opts: list[list[Option]] = []
        group_costs: list[list[OptionCost]] = []
        for opts, cs in zip(per_block, costs):
            pair = shared.get((id(opts), id(cs)))
            if pair is None:
                keep = [j for j, o in enumerate(opts) if o.data_axes == axes]
                pair = ([opts[j] for j in keep], [cs[j] for j in keep])
                shared[id(opts), id(cs)] = pair
            if not pair[0]:
                break
            group_opts.append(pair[0])
            group_costs.append(pair[1])
        else:
            out.append((group_opts, group_costs))
    ctx._stages[key] = out  # kept alive: stage caches key on the lists' ids
    return out


def _evaluate(ctx: SearchContext, config: Config, objective: str,
              per_block: list[list[Option]], costs: list[list[OptionCost]]
              ) -> tuple[Candidate | None, list[Candidate]]:
    a = ctx.analysis
    blocks = a.blocks
    p, m = config.stages, config.microbatches
    flights = one_f_one_b_in_flight(p, m)
    fastest = [min(c.step_time(m) for c in cs) for cs in costs]
    if ctx.pin.block_stage is not None:
        partitions = [tuple(ctx.pin.block_stage)]
    elif a.marked:
        starts = set(a.marked)
        stage, out = 0, []
        for k in range(len(blocks)):
            if k in starts and k > 0:
                stage += 1
            out.append(stage)
        partitions = [tuple(out)]
    else:
        partitions = [linear_partition(fastest, p)] if p > 1 else [(0,) * len(blocks)]
    best: Candidate | None = None
    extra: list[Candidate] = []
    tried: set[tuple[int, ...]] = set()
    moves = 0
    while partitions:
        part = partitions.pop(0)
        if part in tried:
            continue
        tried.add(part)
        stage_points = []
        failed = None
        for s in range(p):
            idx = [k for k in range(len(blocks)) if part[k] == s]
            # stages with the same kinds, options and flight have the same frontier
            key = (config, tuple((a.blocks[k].kind, id(per_block[k])) for k in idx),
                   flights[s], _borrowed(ctx, idx, costs) if p > 1 else 0.0)
            pts = ctx._stages.get(key)
            if pts is None:
                pts = _stage_frontier(ctx, config, idx, per_block, costs, flights[s])
                ctx._stages[key] = pts
            if not pts:
                failed = s
                break
            stage_points.append((idx, pts))
        if failed is not None:
            if ctx.pin.block_stage is None and not a.marked and moves < p and p > 1:
                moved = _shift(part, failed, p)
                if moved is not None:
                    partitions.append(moved)
                    moves += 1
            continue
        for level in FRONTIER_LEVELS:
            cand = _assemble(ctx, config, part, stage_points, per_block, costs, flights,
                             level * ctx.budget, objective if level == 1.0 else "time")
            if cand is None:
                continue
            if level == 1.0 and (best is None or _key(cand, objective) < _key(best, objective)):
                best = cand
            extra.append(cand)
        # try handing a block of the worst stage (slowest; fullest for "memory") on
        if p > 1 and best is not None and moves < p and ctx.pin.block_stage is None \
                and not a.marked:
            top = best
            worst = max(range(p), key=lambda s: top.stages[s].memory if objective == "memory"
                        else top.stages[s].time)
            moved = _shift(part, worst, p)
            if moved is not None and moved not in tried:
                partitions.append(moved)
                moves += 1
    return best, extra


def linear_partition(costs: Sequence[float], parts: int) -> tuple[int, ...]:
    """The part of each item: contiguous, non-empty parts minimising the largest part's
    sum (binary search on that sum with a greedy fill, then the cuts as early as the
    bound allows). `pxform.cuts.balance` solves the same problem by O(parts x n^2)
    dynamic programming, too slow for 96 layers x 64 stages inside the search.

    Example:
        >>> linear_partition([1, 1, 1, 1], 2)
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


def _key(c: Candidate, objective: str) -> tuple[float, float]:
    if objective == "memory":
        return (c.peak_memory, c.step_time)
    return (c.step_time, c.peak_memory)


def _user_recomputed(a: Analysis, blk: BlockInfo) -> bool:
    from pxform.regions import RECOMPUTE

    ops = a.graph.ops[blk.start:blk.stop]
    return bool(ops) and all(op.tag(RECOMPUTE) is not None for op in ops)


def _shift(part: tuple[int, ...], stage: int, p: int) -> tuple[int, ...] | None:
    """Move one block off `stage`: its last to the next stage, or (last stage) its first
    to the previous one; None when the stage has a single block."""
    idx = [k for k, s in enumerate(part) if s == stage]
    if len(idx) <= 1:
        return None
    out = list(part)
    if stage < p - 1:
        out[idx[-1]] = stage + 1
    else:
        out[idx[0]] = stage - 1
    return tuple(out)


def _borrowed(ctx: SearchContext, idx: list[int], costs: list[list[OptionCost]],
              chosen: Sequence[OptionCost | None] | None = None) -> float:
    """Bytes a pipeline stage holds for parameters an earlier stage's block owns (a tied
    embedding read again by the head): their weights, gradients and optimizer state live on
    every stage that reads them. Counted at the owner's share of its option's state bytes:
    the chosen option's when `chosen` gives it, else the least over its options (what the
    frontier DP can count before the owner's stage is chosen)."""
    total = 0.0
    for o, share in _borrowed_shares(ctx, idx):
        cost = chosen[o] if chosen is not None else None
        total += share * (cost.params if cost is not None else min(c.params for c in costs[o]))
    return total


def _borrowed_shares(ctx: SearchContext, idx: list[int]) -> tuple[tuple[int, float], ...]:
    """Per parameter the stage `idx` reads but an outside block owns: the owner's index and
    the parameter's share of the owner's elements. Depends on the blocks only: computed
    once per stage (the search asks for every partition and frontier level)."""
    key = ("borrowed", tuple(idx))
    hit = ctx._trans.get(key)
    if hit is not None:
        return hit
    a = ctx.analysis
    inside = set(idx)
    owned = {name for k in idx for name in a.blocks[k].params}
    owner = {name: j for j, b in enumerate(a.blocks) for name in b.params}
    reads = {v.name for k in idx for op in a.graph.ops[a.blocks[k].start:a.blocks[k].stop]
             for v in op.inputs if v.name in a.params}
    vals = a.values()
    out = []
    for name in sorted(reads - owned):
        o = owner.get(name)
        if o is None or o in inside:
            continue
        whole = sum(vals[n].type.numel for n in a.blocks[o].params)
        out.append((o, vals[name].type.numel / max(1, whole)))
    ctx._trans[key] = shares = tuple(out)
    return shares


def _stage_frontier(ctx: SearchContext, config: Config, idx: list[int],
                    per_block: list[list[Option]], costs: list[list[OptionCost]],
                    flight: int) -> list[tuple[Point, float]]:
    """The stage's frontier points within the budget, each with its peak memory including
    the workspace."""
    a = ctx.analysis
    m = config.microbatches
    times = [np.array([c.step_time(m) for c in costs[k]]) for k in idx]
    mems = [np.array([c.memory(flight, o.recompute, m) for c, o in zip(costs[k], per_block[k])])
            for k in idx]
    trans_time: list[np.ndarray | None] = [None]
    for j in range(1, len(idx)):
        prev, cur = idx[j - 1], idx[j]
        key = ("matrix", a.blocks[prev].kind, config, tuple(per_block[prev]),
               tuple(per_block[cur]))
        mat = ctx._trans.get(key)
        if mat is None:
            mat = np.zeros((len(per_block[prev]), len(per_block[cur])))
            for r, s in enumerate(per_block[prev]):
                for c, s2 in enumerate(per_block[cur]):
                    mat[r, c] = m * transition(ctx, a.blocks[prev], config, s, s2)
            ctx._trans[key] = mat
        trans_time.append(mat)
    borrowed = _borrowed(ctx, idx, costs) if config.stages > 1 else 0.0
    budget = ctx.budget - borrowed
    workspace = max(min(c.workspace(o.recompute) for c, o in zip(costs[k], per_block[k]))
                    for k in idx)
    for _ in range(3):
        limit = budget - workspace
        if limit <= 0:
            return []
        # without a budget (the least-memory search) round to the device's memory scale
        scale = budget if math.isfinite(budget) else ctx.hardware.memory_bytes
        pts = chain_frontier(times, mems, trans_time, None, quantum=QUANTUM * scale,
                             limit=limit)
        out = []
        worst = workspace
        for pt in pts:
            ws = max(costs[k][c].workspace(per_block[k][c].recompute)
                     for k, c in zip(idx, pt.choices))
            worst = max(worst, ws)
            if pt.memory + ws <= budget:
                out.append((pt, pt.memory + ws + borrowed))
        if out or worst == workspace:
            return out
        workspace = worst
    return []


def _assemble(ctx: SearchContext, config: Config, part: tuple[int, ...],
              stage_points: list[tuple[list[int], list[tuple[Point, float]]]],
              per_block: list[list[Option]], costs: list[list[OptionCost]],
              flights: list[int], limit: float, objective: str) -> Candidate | None:
    """A pipeline plan: per stage the frontier point that is best under `limit`."""
    m = config.microbatches
    chosen: list[Option | None] = [None] * len(part)
    chosen_cost: list[OptionCost | None] = [None] * len(part)
    block_time = [0.0] * len(part)
    block_mem = [0.0] * len(part)
    stages = []
    fw, bw = [], []
    for s, (idx, pts) in enumerate(stage_points):
        fit = [(pt, mem) for pt, mem in pts if mem <= limit]
        if not fit:
            return None
        if objective == "memory":
            pt, mem = min(fit, key=lambda x: (x[1], x[0].time))
        else:
            pt, mem = min(fit, key=lambda x: (x[0].time, x[1]))
        f = b = extra = pbytes = 0.0
        for k, c in zip(idx, pt.choices):
            o = per_block[k][c]
            oc = costs[k][c]
            chosen[k] = o
            chosen_cost[k] = oc
            block_time[k] = oc.step_time(m)
            block_mem[k] = oc.memory(flights[s], o.recompute, m)
            f += oc.forward
            b += oc.backward
            extra += oc.step_extra
            pbytes += oc.params
        if config.stages > 1:  # the owner's chosen option, not the least the DP assumed
            exact = _borrowed(ctx, idx, costs, chosen_cost)
            mem += exact - _borrowed(ctx, idx, costs)
            pbytes += exact
            if mem > limit:
                return None
        # transitions are in the point's time; spread them over forward and backward
        trans = (pt.time - sum(costs[k][c].step_time(m) for k, c in zip(idx, pt.choices))) / m
        p2p = _p2p(ctx, config, idx) if config.stages > 1 else 0.0
        f += trans / 2 + p2p
        b += trans / 2 + p2p
        fw.append(f)
        bw.append(b + extra / m)
        stages.append(StageResult(s, tuple(idx), pt.time, f, b + extra / m, mem, flights[s],
                                  pbytes))
    step = one_f_one_b_time(fw, bw, m) if config.stages > 1 else m * (fw[0] + bw[0])
    return Candidate(config, tuple(o for o in chosen if o is not None), part, tuple(stages),
                     step, max(st.memory for st in stages), tuple(block_time),
                     tuple(block_mem), ctx.global_batch)


def _p2p(ctx: SearchContext, config: Config, idx: list[int]) -> float:
    """Seconds to send one microbatch's boundary activations to the next stage."""
    key = ("p2p", config, idx[-1])
    hit = ctx._trans.get(key)
    if hit is not None:
        return hit
    ctx._trans[key] = t = _p2p_time(ctx, config, idx)
    return t


def _p2p_time(ctx: SearchContext, config: Config, idx: list[int]) -> float:
    a = ctx.analysis
    last = a.blocks[idx[-1]]
    vals = a.values()
    scale = (ctx.global_batch // config.microbatches) / a.traced_batch
    data = config.outer * config.inner
    sent = sum(vals[n].type.nbytes * scale / data for n in last.crossing)
    hw = ctx.hardware
    level = hw.level(2 * config.outer * config.inner)
    return hw.comm_time("p2p", sent, 2, level) if sent else 0.0


def search_configs(ctx: SearchContext, configs: Sequence[Config], objective: str,
                   progress: Callable[[int, int], None] | None = None, *,
                   first_fit: bool = False
                   ) -> tuple[Candidate | None, list[Candidate], float]:
    """Evaluate every configuration; the best plan, every plan found (for the frontier),
    and the seconds it took. `first_fit`: stop at the first plan that fits (to ask
    whether any does)."""
    start = time.perf_counter()
    best: Candidate | None = None
    found: list[Candidate] = []
    # branch and bound: the most promising configurations first, and none whose lower
    # bound (step time, or peak memory for the memory objective) cannot beat the best
    # plan so far. Memory ties are kept: step time breaks them.
    if objective == "time":
        bounds = {c: lower_bound(ctx, c) for c in configs}
    else:
        bounds = {c: memory_lower_bound(ctx, c) for c in configs}
    order = sorted(configs, key=lambda c: (bounds[c], c.stages, c.outer, c.microbatches))
    for n, config in enumerate(order):
        if best is not None and (bounds[config] >= best.step_time if objective == "time"
                                 else bounds[config] > best.peak_memory):
            if progress is not None:
                progress(n + 1, len(configs))
            continue
        cand, extra = evaluate(ctx, config, objective,
                               best.step_time if best is not None else math.inf)
        found.extend(extra)
        if cand is not None and (best is None or _key(cand, objective) < _key(best, objective)):
            best = cand
        if progress is not None:
            progress(n + 1, len(configs))
        if first_fit and best is not None:
            break
    return best, found, time.perf_counter() - start


def pareto(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other beats in both step time and peak memory, by memory."""
    out: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (c.peak_memory, c.step_time)):
        if not out or c.step_time < out[-1].step_time - 1e-15:
            out.append(c)
    return out
