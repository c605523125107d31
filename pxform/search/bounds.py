"""Bounds for branch and bound: no plan of a configuration is faster (`lower_bound`) or
needs less memory per device (`memory_lower_bound`) than these, so configurations and
option groups that cannot beat the best plan so far are skipped."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pxform.search.context import OptionTable, SearchContext
from pxform.search.options import block_tables
from pxform.search.pipelines import ScheduleChoice, bubble_bound, choices
from pxform.search.space import Config


def lower_bound(ctx: SearchContext, config: Config,
                tables: Sequence[OptionTable] | None = None,
                schedules: Sequence[ScheduleChoice] | None = None) -> float:
    """No plan of `config` is faster than this: every block at its fastest option, the
    work T spread evenly over the p stages, and the least warm-up and drain of the
    `schedules` (default: every one tried), each's equal-stage closed form
    (`pipelines.bubble_bound`): 1F1B's `(m - 1) x max stage + sum of stages` per microbatch
    is at least `T (m - 1 + p) / (p m)`; the shifted schedule's work has its recompute.
    `tables`: per block, the options to bound (default: all)."""
    if tables is None:
        tables = block_tables(ctx, config)
        if tables is None:
            return math.inf
    m, p = config.microbatches, config.stages
    total = sum(min(c.step_time(m) for c in t.costs) for t in tables)
    if p == 1:
        return total
    if schedules is None:
        schedules = choices(config, len(ctx.analysis.blocks), ctx.pin.schedule)
    # the weight gradients' largest share of any option's work: ZB's least bubble
    share = max((c.weight / (c.forward + c.backward) for t in tables for c in t.costs
                 if c.forward + c.backward > 0), default=0.0)
    # the shifted schedule recomputes the forward of all stages but the last: of about
    # (p - 1) / p of the blocks, with stages of equal work
    redo = (p - 1) / p * m * sum(min(c.forward for c in t.costs) for t in tables)
    return min(bubble_bound(c, p, m, share) * (total + (redo if c.name == "shifted" else 0.0))
               for c in schedules) / p


def memory_lower_bound(ctx: SearchContext, config: Config) -> float:
    """No plan of `config` needs less memory per device than this: every block at its
    least-memory option with one microbatch in flight, spread evenly over the p stages (the
    peak is the largest stage's), plus the smallest workspace any block option has."""
    tables = block_tables(ctx, config)
    if tables is None:
        return math.inf
    m = config.microbatches
    total = sum(min(c.memory(1, o.recompute, m) for o, c in zip(t.options, t.costs))
                for t in tables)
    # (the transient: a recomputed block's recompute may peak before its gradients
    # exist, `backward_extra`, and charges no less than it)
    workspace = min(c.transient for t in tables for c in t.costs)
    return total / config.stages + workspace
