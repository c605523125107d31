"""The one compile path every transform uses: trace -> prepare -> a strategy per op ->
lower (DESIGN.md §2).

- `trace` the function on the arguments (fake or meta tensors are fine);
- `prepare` the graph: strip markers, expand coshard regions, number recompute regions;
- give every op a strategy: a plan's (`PlanLowering`, for `pxform.auto`) or greedy
  propagation (`pxform.passes.propagate`);
- `lower` to a per-rank `Program` (plain data), which the runtime builds and runs.

`pxform.shard` and the region transforms run outside a trace call `compile_program`;
`pxform.pipeline` cuts the prepared graph into stages between the second and third steps and
calls `op_strategies` itself.

Example:
    >>> traced, program = compile_program(loss_fn, (params, batch), {}, mesh, layouts)
    >>> print(program.as_text())
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pxform.core.ir import Graph
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.core.precision import Precision
from pxform.frontend.trace import Traced, trace
from pxform.lower.comm import comm_cost
from pxform.lower.defer import defer_reductions
from pxform.lower.overlap import interleave
from pxform.lower.spmd import Program, lower
from pxform.ops.strategy import Strategy
from pxform.passes.expand import prepare
from pxform.passes.propagate import propagate, split_constants, zero3_axes


@dataclass(frozen=True)
class Fallback:
    """Ops without a sharding rule: refused (`allow=False`, the default), or run replicated
    (inputs gathered, every rank computing the whole op) and reported per op in one
    `PxformWarning` (`report=False` when the caller already reported them)."""

    allow: bool = False
    report: bool = True


class Planner(Protocol):
    """Chooses every op's strategy instead of propagation (`pxform.lower.plan.PlanLowering`
    for a plan). It may return a rewritten graph (markers removed, recompute tagged)."""

    def strategies(self, graph: Graph, mesh: AbstractMesh, layouts: Sequence[Layout]
                   ) -> tuple[Graph, list[Strategy]]: ...


def op_strategies(graph: Graph, mesh: AbstractMesh, layouts: Sequence[Layout],
                  planner: Planner | None = None,
                  sequential: frozenset[str] = frozenset()) -> tuple[Graph, list[Strategy]]:
    """The graph to lower and one strategy per op: the planner's, or propagation's
    (`sequential`: axes no collective can run over, a pipeline's microbatches)."""
    if planner is not None:
        return planner.strategies(graph, mesh, layouts)
    return graph, propagate(graph, mesh, list(layouts), sequential)


def compile_program(fn: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                    mesh: AbstractMesh, layouts: Sequence[Layout] | None = None,
                    out_layouts: Callable[[Traced], list[Layout | None]] | None = None,
                    planner: Planner | None = None, fallback: Fallback | None = None,
                    keep: Sequence[bool] | None = None, traced: Traced | None = None,
                    precision: Precision | None = None, sync_batch_norm: bool = False
                    ) -> tuple[Traced, Program]:
    """Trace `fn(*args, **kwargs)` and lower it for one rank of `mesh`.

    Args:
        layouts: of every tensor leaf of the arguments (None: replicated).
        out_layouts: the outputs' layouts from the trace (None: wherever the ops leave
            them).
        planner: chooses the strategies instead of propagation.
        fallback: whether ops without a rule run replicated (default: they are refused).
        keep: which outputs to compute (None: all); the program returns only those, and
            computes nothing only the others need (`step.init` on a pipeline rank).
        traced: `fn` already traced on these arguments (not traced again).
        precision: a mixed-precision policy, applied by the trace (`pxform.Precision`).
        sync_batch_norm: training-mode BatchNorm by the whole batch's statistics (see
            `pxform.trace`); by default each rank's rows by their own, as DDP.
    """
    fallback = fallback or Fallback()
    if traced is None:
        traced = trace(fn, *args, allow_fallback=fallback.allow,
                       report_fallbacks=fallback.report, precision=precision,
                       sync_batch_norm=sync_batch_norm, **kwargs)
    if layouts is None:
        layouts = [Layout.replicated(v.type.rank) for v in traced.graph.inputs]
    graph = traced.graph if keep is None else traced.graph.pruned(keep)
    graph = prepare(graph, mesh, list(layouts))  # recompute and coshard regions
    graph, strategies = op_strategies(graph, mesh, layouts, planner)
    outs: list[Layout | None] = (out_layouts(traced) if out_layouts is not None
                                 else [None] * len(traced.graph.outputs))
    if keep is not None:
        outs = [lay for lay, k in zip(outs, keep) if k]
    if planner is None:  # values of no input are computed in the pieces wanted
        strategies = split_constants(graph, mesh, strategies, outs)
    # partial gradients stay partial up to their parameters' buckets (DDP's all-reduces)
    program = interleave(defer_reductions(lower(graph, mesh, list(layouts), strategies, outs)))
    zero3 = zero3_axes(graph, list(layouts), mesh) if planner is None else frozenset()
    if zero3:
        # ZeRO-3: gathering a block's parameters (packed, prefetched) against moving its
        # activations; the program whose collectives cost less wins, so small batches keep
        # moving activations and large ones gather weights
        other = split_constants(graph, mesh, propagate(graph, mesh, list(layouts),
                                                       zero3=zero3), outs)
        if other != strategies:
            alt = interleave(defer_reductions(lower(graph, mesh, list(layouts), other, outs)))
            if comm_cost(alt) < comm_cost(program):
                program = alt
    return traced, program
