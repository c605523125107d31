"""Bounds for branch and bound: no plan of a configuration is faster (`lower_bound`) or
needs less memory per device (`memory_lower_bound`) than these, so configurations and
option groups that cannot beat the best plan so far are skipped."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from pxform.search.context import OptionTable, SearchContext
from pxform.search.options import block_tables
from pxform.search.pipelines import ScheduleChoice, bubble_bound, choices
from pxform.search.space import Config


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
    `tables`: per block, the options to bound (default: all)."""
    if tables is None:
        tables = block_tables(ctx, config)
        if tables is None:
            return math.inf
    m, p = config.microbatches, config.stages
    total = least_work(tables, m, p, ctx.budget - _least_workspace(tables))
    if p == 1:
        return total
    if schedules is None:
        schedules = choices(config, len(ctx.analysis.blocks), ctx.pin.schedule)
    # the weight gradients' largest share of any option's work: ZB's least bubble
    share = max((c.weight / (c.forward + c.backward) for t in tables for c in t.costs
                 if c.forward + c.backward > 0), default=0.0)
    # the shifted schedule recomputes the forward of all stages but the last: of about
    # (p - 1) / p of the blocks, with stages of equal work; their first forwards run
    # without autograd's graph, at most its share and time per op less (`stages`)
    hw = ctx.hardware
    redo = (p - 1) / p * m * sum(
        max(0.0, min(c.forward for c in t.costs) - hw.autograd_share * max(
            c.forward for c in t.costs) - hw.autograd_op_overhead_s * (b.stop - b.start))
        for t, b in zip(tables, ctx.analysis.blocks))
    # the blocks' per-step costs (`OptionCost.step_extra`, in `total`) run once per step on
    # their stage's rank, after the schedule (`stages.after_schedule`), not through its
    # warm-up and drain: the bubble's factor is taken off them (at each block's largest)
    extra = sum(max((c.step_extra for c in t.costs), default=0.0) for t in tables)

    def bound(c: ScheduleChoice) -> float:
        factor = bubble_bound(c, p, m, share)
        return (factor * (total + (redo if c.name == "shifted" else 0.0))
                - (factor - 1.0) * extra)

    return min(bound(c) for c in schedules) / p


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
