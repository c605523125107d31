"""Bounds for branch and bound: no plan of a configuration is faster (`lower_bound`) or
needs less memory per device (`memory_lower_bound`) than these, so configurations and
option groups that cannot beat the best plan so far are skipped."""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence

from pxform.cost.model import BACKWARD_RATIO
from pxform.search.blockcost import op_seconds
from pxform.search.context import OptionTable, SearchContext, first_block
from pxform.search.options import block_tables, walked_around
from pxform.search.pipelines import ScheduleChoice, bubble_bound, choices
from pxform.search.space import Config
from pxform.search.stages import host_seconds


def lower_bound(ctx: SearchContext, config: Config,
                tables: Sequence[OptionTable] | None = None,
                schedules: Sequence[ScheduleChoice] | None = None) -> float:
    """No plan of `config` is faster than this: the least work T of any choice of block
    options whose memory fits the p stages together (`least_work`), spread evenly over
    the p stages, and the least warm-up and drain of the
    `schedules` (default: every one tried), each's equal-stage closed form
    (`pipelines.bubble_bound`): 1F1B's `(m - 1) x max stage + sum of stages` per microbatch
    is at least `T (m - 1 + p) / (p m)`; the shifted schedule's work has its recompute.
    The blocks' per-step costs (`OptionCost.step_extra`, part of T) run after the
    schedule, once: the factor over 1 is not charged on them (each block's largest).
    And no less than m times the busiest rank's share of the blocks per microbatch, each
    block at its least (`least_bottleneck`, `least_busiest`): a pipeline whose blocks do
    not cut evenly into its stages (BERT-large's 24 layers, embedding and head on 8) is
    as slow as its busiest stage, which the even spread did not see.
    `tables`: per block, the options to bound (default: all).

    On a device that overlaps the host's time per op (`Hardware.host_overlaps`), a
    stage's F and B are the longer of their device and host parts, not the sums the
    options' costs are (`stages.host_overlapped`): the bound is then the larger of two
    taken over parts that never exceed a stage's, each option's cost less its host part,
    and half of it (`_host_overlapped_tables`)."""
    if tables is None:
        tables = block_tables(ctx, config)
        if tables is None:
            return math.inf
    if not ctx.hardware.host_overlaps:
        return _bound(ctx, config, tables, schedules)
    # (the busiest rank's form over the half mix only: less its host part, a recomputed
    # option's cost may go below 0, where the cuts' forms do not hold)
    return max(_bound(ctx, config, _host_overlapped_tables(ctx, tables, share), schedules,
                      busiest=share < 1.0)
               for share in (1.0, 0.5))


def _timeless(table: OptionTable) -> OptionTable:
    """`table` with each option's forward, backward and weight gradients at no time (its
    memory as it was)."""
    return OptionTable(table.key, table.options, tuple(
        dataclasses.replace(c, forward=0.0, backward=0.0, weight=0.0)
        for c in table.costs))


def _host_overlapped_tables(ctx: SearchContext, tables: Sequence[OptionTable],
                            share: float) -> list[OptionTable]:
    """The tables with each option's forward and backward replaced by `share` of their
    device part and `1 - share` of their host part (`stages.host_seconds`): a stage's
    overlapped F, `max(sum F - host, host)`, is at least any such mix of the two, and so,
    with one share for every block, at least the sum of its blocks' mixes (B alike)."""
    made: dict[int, OptionTable] = {}
    out: list[OptionTable] = []
    for t, block in zip(tables, ctx.analysis.blocks):
        hit = made.get(id(t))
        if hit is None:
            costs = []
            for o, c in zip(t.options, t.costs):
                host_f, host_b = host_seconds(ctx.hardware, block, o)
                costs.append(dataclasses.replace(
                    c, forward=share * (c.forward - host_f) + (1.0 - share) * host_f,
                    backward=share * (c.backward - host_b) + (1.0 - share) * host_b))
            hit = made[id(t)] = OptionTable(t.key, t.options, tuple(costs))
        out.append(hit)
    return out


def _bound(ctx: SearchContext, config: Config, tables: Sequence[OptionTable],
           schedules: Sequence[ScheduleChoice] | None, busiest: bool = True) -> float:
    """`lower_bound` over these tables' costs (`busiest`: with the busiest rank's form,
    which needs costs of at least 0)."""
    m, p = config.microbatches, config.stages
    first = ctx.analysis.first_trained
    if p > 1 and first > 0:
        # a stage before the first that trains runs no backward and its forward without
        # autograd's graph, below its blocks' costs: such blocks bound at no time, in the
        # spread and the busiest rank's forms alike, as `quick_bound` takes them (an
        # uneven MLP behind a frozen prefix, `tests/test_search.py`: a 2-stage 1F1B plan
        # came out 0.04 % under the spread's bound once a search evaluated it)
        tables = [_timeless(t) if k < first else t for k, t in enumerate(tables)]
    total = least_work(tables, m, p, ctx.budget - _least_workspace(tables))
    if p == 1:
        return total
    if schedules is None:
        schedules = choices(config, len(ctx.analysis.blocks), ctx.pin.schedule)
    # the weight gradients' largest share of any option's work: ZB's least bubble
    share = max((c.weight / (c.forward + c.backward) if c.forward + c.backward > 0
                 else math.inf for t in tables for c in t.costs), default=0.0)
    # the shifted schedule recomputes the forward of all stages but the last: of about
    # (p - 1) / p of the blocks, with stages of equal work; their first forwards run
    # without autograd's graph, at most its share and time per op less (`stages`)
    # (none behind a frozen prefix: the stages before the first that trains recompute
    # nothing, and where the cut falls is not known here)
    hw = ctx.hardware
    redo = (p - 1) / p * m * sum(
        max(0.0, min(c.forward for c in t.costs) - hw.autograd_share * max(
            c.forward for c in t.costs) - hw.autograd_op_overhead_s * (b.stop - b.start))
        for t, b in zip(tables, ctx.analysis.blocks)) if first == 0 else 0.0
    # the blocks' per-step costs (`OptionCost.step_extra`, in `total`) run once per step on
    # their stage's rank, after the schedule (`stages.after_schedule`), not through its
    # warm-up and drain: the bubble's factor is taken off them (at each block's largest)
    extra = sum(max((c.step_extra for c in t.costs), default=0.0) for t in tables)

    def bound(c: ScheduleChoice) -> float:
        factor = bubble_bound(c, p, m, share)
        return (factor * (total + (redo if c.name == "shifted" else 0.0))
                - (factor - 1.0) * extra) / p

    if not busiest:
        return min(bound(c) for c in schedules)
    # and no faster than its busiest rank's m forwards and backwards, whose blocks are
    # whole: a stage per rank, cut from the blocks in order (`least_bottleneck`), or, a
    # rank running several chunks, at least its share of the blocks (`least_busiest`)
    least = block_least(tables)
    spread = least_busiest(least, p)
    cut = least_bottleneck(least, p) if any(c.virtual_stages == 1 for c in schedules) \
        else spread
    return min(max(bound(c), m * (cut if c.virtual_stages == 1 else spread))
               for c in schedules)


def quick_bound(ctx: SearchContext, config: Config) -> float:
    """A lower bound on `config`'s step time without its option tables (no walks): each
    block's ops at the largest split the stage's devices allow (`blockcost.op_seconds`,
    which only grows with a device's share of an op), at the microbatch size as
    `options.walk_cost` interpolates it, and nothing else (no re-layouts, transfers,
    reductions or per-step costs), under `lower_bound`'s spread and busiest-rank forms (a
    zero-bubble bubble taken as none; on a device that overlaps the host's time, as
    `lower_bound` mixes the two parts). The search skips configurations on it before it
    builds their tables (`partition._in_bound_order`): the tables of BERT-large's 33
    pipelines on 8 devices were 0.15 s of a 0.4 s search, and its busiest-stage form
    bounds the 16 of 4 and 8 stages out.

    Example:
        >>> quick_bound(ctx, Config(stages=8, outer=1, inner=1, microbatches=128))
    """
    a, hw = ctx.analysis, ctx.hardware
    m, p = config.microbatches, config.stages
    devices = config.outer * config.inner
    scale = (ctx.global_batch // m) / a.traced_batch
    per_op = hw.op_step_overhead_s / (1 + BACKWARD_RATIO)
    compute = [0.0 if p > 1 and k < a.first_trained else
               _block_compute(ctx, b.kind, scale, devices) for k, b in enumerate(a.blocks)]
    # (on a device that overlaps the host's time per op, `lower_bound`'s two mixes of
    # device and host parts: the first less a recompute's host time, which a recomputed
    # option adds to its host part beyond its own forward again)
    mixes = ((1.0, 0.0),) if not hw.host_overlaps else ((1.0, 1.0), (0.5, 0.0))
    schedules = choices(config, len(a.blocks), ctx.pin.schedule)
    best = 0.0
    for share, host in mixes:
        least = [share * c - host * (b.stop - b.start) * (hw.op_step_overhead_s + per_op)
                 for c, b in zip(compute, a.blocks)]
        total = m * sum(least)
        if p == 1:
            best = max(best, total)
            continue
        spread = [bubble_bound(c, p, m, 0.5) * total / p for c in schedules]
        if host:  # (below 0 in places: no busiest rank's form, as `lower_bound`)
            best = max(best, min(spread))
            continue
        busiest = least_busiest(least, p)
        cut = least_bottleneck(least, p) if any(c.virtual_stages == 1 for c in schedules) \
            else busiest
        best = max(best, min(max(t, m * (cut if c.virtual_stages == 1 else busiest))
                             for c, t in zip(schedules, spread)))
    return best


def _block_compute(ctx: SearchContext, kind: int, scale: float, devices: int) -> float:
    """A block of `kind`'s forward and backward compute per microbatch, every op split
    over all `devices` (`quick_bound`), at `scale` as `options.walk_cost` has it: the line
    through the walked scales around it (beyond the traced batch, at least the traced
    batch's)."""
    key = (kind, scale, devices)
    hit = ctx.compute.get(key)
    if hit is not None:
        return hit
    upper, lower = walked_around(scale)

    def at(s: float) -> float:
        a, model = ctx.analysis, ctx.model
        block = first_block(a, kind)
        total = 0.0
        for k in range(block.start, block.stop):
            o = op_seconds(a, k, model, s if a.op_batch[k] else 1.0, devices)
            total += o.forward + o.backward
        return total

    if scale in (lower, upper) or scale > upper:
        value = at(min(scale, upper))
    else:
        above, below = at(upper), at(lower)
        value = below + (above - below) * (scale - lower) / (upper - lower)
    ctx.compute[key] = value
    return value


def block_least(tables: Sequence[OptionTable]) -> list[float]:
    """Per block, the least seconds per microbatch its forward and backward add to its
    rank's F and B actions under any of its options (`stages._stage_sums` adds transfers
    and per-action costs to them). `_bound` passes the blocks before the first that
    trains at no time (`_timeless`): such a stage runs no backward, and its forward
    without autograd's graph.

    Example:
        >>> block_least(block_tables(ctx, config))
    """
    return [min(c.forward + c.backward for c in t.costs) for t in tables]


def least_bottleneck(times: Sequence[float], parts: int) -> float:
    """At most the least, over every cut of `times` in order into `parts` runs, of the
    largest run's sum (within a relative 1e-7 of it): the busiest stage of any
    partition of blocks with these least times into `parts` pipeline stages.

    Example:
        >>> round(least_bottleneck([1.0, 1.0, 1.0], 2), 6)  # 2 + 1
        2.0
    """
    n = len(times)
    if n == 0:
        return 0.0
    prefix = list(itertools.accumulate(times, initial=0.0))

    def fits(most: float) -> bool:  # greedy: each run as long as it fits
        at = 0
        for _ in range(parts):
            at = bisect.bisect_right(prefix, prefix[at] + most, lo=at) - 1
            if at >= n:
                return True
        return False

    # between the even share (or the largest block) and that plus the largest block
    lo = max(max(times), prefix[-1] / parts)
    if fits(lo):
        return lo * (1.0 - 1e-9)
    hi = lo + max(times)
    while hi - lo > 1e-7 * hi:  # (`lo` never fits: the answer is above it)
        mid = 0.5 * (lo + hi)
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return lo * (1.0 - 1e-9)


def least_busiest(times: Sequence[float], ranks: int) -> float:
    """A lower bound on the busiest rank's sum when the blocks with these least `times`
    go to `ranks` ranks in any way (an interleaved pipeline's chunks): at least the even
    share, and, of the k largest blocks, some rank holds ceil(k / ranks), so at least the
    sum of the ceil(k / ranks) smallest of them.

    Example (24 layers and a smaller head on 8 ranks: one holds 3 layers and the head):
        >>> least_busiest([1.0] * 24 + [0.5], 8)
        3.5
    """
    if not times:
        return 0.0
    ordered = sorted(times, reverse=True)
    prefix = list(itertools.accumulate(ordered, initial=0.0))
    best = prefix[-1] / ranks
    for k in range(ranks + 1, len(ordered) + 1):
        q = -(-k // ranks)
        best = max(best, prefix[k] - prefix[k - q])
    return best


def least_work(tables: Sequence[OptionTable], microbatches: int, stages: int,
               per_stage: float) -> float:
    """The least total step time of the blocks over every choice of one option per block
    whose memories (each at its least: one microbatch in flight) are each at most
    `per_stage` and sum to at most `stages` times it, relaxed to fractions of options (a
    linear program, so a bound): each block starts at its least-memory option and buys
    time with memory along the lower convex hull of its (memory, time) options, best rate
    first. inf: even the least-memory options do not fit.

    Why: the fastest option of every block ignores memory, and at scale memory is what
    forces recompute and sharding. For GPT-3 175B on 1,024 GPUs branch and bound
    evaluated 29 of 142 configurations with that bound and 14 with this one (67 and 42 for
    Hugging Face's GPT-2 of that shape), finding the same plans. A plan's stages each fit
    the budget less a workspace, so each block does, and all of them together fit p of
    those: the bound never exceeds a plan (`tests/test_search.py` checks it against every
    choice on random tables).

    Example:
        >>> least_work(tables, 8, stages=4, per_stage=80 * 2**30)
        3.91
    """
    capacity = stages * per_stage
    base_time = base_memory = 0.0
    steps: list[tuple[float, float, float]] = []  # (seconds saved per byte, bytes, seconds)
    hulls: dict[int, list[tuple[float, float]]] = {}  # by table: blocks of a kind share one
    for t in tables:
        hull = hulls.get(id(t))
        if hull is None:
            points = [(c.memory(1, o.recompute, microbatches), c.step_time(microbatches))
                      for o, c in zip(t.options, t.costs)]
            # an option is in some stage, which fits one device
            hull = hulls[id(t)] = _lower_hull(pt for pt in points if pt[0] <= per_stage)
            if not hull:
                return math.inf
        base_memory += hull[0][0]
        base_time += hull[0][1]
        for (m0, t0), (m1, t1) in zip(hull, hull[1:]):
            steps.append(((t0 - t1) / (m1 - m0), m1 - m0, t0 - t1))
    if base_memory > capacity:
        return math.inf
    left = capacity - base_memory
    total = base_time
    for rate, memory, seconds in sorted(steps, key=lambda s: -s[0]):
        if memory <= left:
            total -= seconds
            left -= memory
        else:
            total -= rate * left
            break
    return total


def _lower_hull(points: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The (memory, time) points no mix of others beats, by memory: time falls and each
    byte more saves less than the one before."""
    hull: list[tuple[float, float]] = []
    for memory, time in sorted(points):
        if hull and (memory == hull[-1][0] or time >= hull[-1][1]):
            continue  # as much memory and no faster, or more memory and no faster
        while len(hull) >= 2 and (hull[-1][1] - hull[-2][1]) / (hull[-1][0] - hull[-2][0]) \
                >= (time - hull[-1][1]) / (memory - hull[-1][0]):
            hull.pop()  # above the chord from its left neighbour to this point
        hull.append((memory, time))
    return hull


def _least_workspace(tables: Sequence[OptionTable]) -> float:
    """The least workspace any block option has (a stage has at least one block)."""
    return min(c.transient - c.freed for t in tables for c in t.costs)


def memory_lower_bound(ctx: SearchContext, config: Config) -> float:
    """No plan of `config` needs less memory per device than this: every block at its
    least-memory option with one microbatch in flight, spread evenly over the p stages (the
    peak is the largest stage's), plus the smallest workspace any block option has.

    With several microbatches a block holds its parameters, state and gradients and one
    microbatch's activations at least. With one, a block's least memory is counted twice
    over and the larger total kept: its parameters and state with its activations (the
    last block's backward starts while every block holds them), and with its gradients
    (the first block's backward ends beside every gradient). Not max(activations,
    gradients) per block: a stage whose blocks keep more activations than they have
    gradients never holds both maxima at once (`cost.model.backward_extra`)."""
    tables = block_tables(ctx, config)
    if tables is None:
        return math.inf
    m = config.microbatches
    acts = grads = 0.0
    for t in tables:
        acts += min(c.params - (c.grads if m == 1 else 0.0)
                    + (c.kept if o.recompute else c.saved)
                    for o, c in zip(t.options, t.costs))
        grads += min(c.params for c in t.costs)
    # (the transient: a recomputed block's recompute may peak before its gradients
    # exist, `backward_extra`, and charges no less than it)
    return max(acts, grads) / config.stages + _least_workspace(tables)
