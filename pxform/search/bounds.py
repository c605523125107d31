"""Bounds for branch and bound: no plan of a configuration is faster (`lower_bound`) or
needs less memory per device (`memory_lower_bound`) than these, so configurations and
option groups that cannot beat the best plan so far are skipped."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pxform.search.context import OptionTable, SearchContext
from pxform.search.options import block_tables
from pxform.search.space import Config


def lower_bound(ctx: SearchContext, config: Config,
                tables: Sequence[OptionTable] | None = None) -> float:
    """No plan of `config` is faster than this: every block at its fastest option, the
    work T spread evenly over the p stages, and 1F1B's warm-up and drain: the closed form
    `(m - 1) x max stage + sum of stages` per microbatch is at least
    `T (m - 1 + p) / (p m)`. `tables`: per block, the options to bound (default: all)."""
    if tables is None:
        tables = block_tables(ctx, config)
        if tables is None:
            return math.inf
    m, p = config.microbatches, config.stages
    total = sum(min(c.step_time(m) for c in t.costs) for t in tables)
    return total * (m - 1 + p) / (p * m) if p > 1 else total


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
    workspace = min(c.workspace(o.recompute) for t in tables
                    for o, c in zip(t.options, t.costs))
    return total / config.stages + workspace
