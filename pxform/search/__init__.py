"""Floor 7, search: graph -> `Plan`, the auto-search (DESIGN.md §6).

    analysis   blocks from graph sharding, kinds, per-op FLOPs and saved bytes (`analysis`)
    space      pipeline degree x stage mesh x microbatches; per block, axis roles x recompute
    blockcost  op-level strategies under a role (tensor axis: beam search), their costs
    frontier   per stage, DP over the block chain keeping the (time, memory) frontier
    context    what a search knows and caches (`SearchContext`), pinned choices (`Pin`)
    options    option costing: a block's time and memory under each option
    bounds     lower bounds on time and memory, for branch and bound
    stages     a stage's frontier over its blocks, and a plan assembled from the stages
    partition  per configuration, stage cuts balanced and moved; configurations in turn
    pipelines  the pipeline schedules searched (`ScheduleChoice`), their timing and memory
    solve      `search(graph, ...)`: the whole search, and the `Plan` it returns
    plan       the `Plan` value: every choice, saved as versioned JSON
    report     a plan's predictions beside measured figures
    stage_recompute  Merak's stage-aware recompute for `pipeline(recompute="stage_aware")`

May import core, schedules, ops, frontend, passes and cost. The names below load on first
use, so `pxform.search.plan` (the `Plan` value, which lowering reads) imports without the
search or the cost model.

Example:
    >>> from pxform.search import search
    >>> plan = search(graph, {"batch.x"}, devices=8, budget=40 * 2**30,
    ...               hardware=pxform.hardware.hardware("a100-40gb"))
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"OBJECTIVES": "solve", "SearchError": "solve", "configs": "solve",
            "pin_of": "solve", "search": "solve", "Pin": "context",
            "ScheduleChoice": "pipelines"}

__all__ = ["OBJECTIVES", "Pin", "ScheduleChoice", "SearchError", "configs", "pin_of",
           "search"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pxform.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"pxform.search.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from pxform.search.context import Pin
    from pxform.search.pipelines import ScheduleChoice
    from pxform.search.solve import OBJECTIVES, SearchError, configs, pin_of, search
