"""Lowering with a plan: a `Plan` and the traced graph -> the stage of every op, the
recompute regions, and every op's strategy on the lowering mesh.

Nothing else is needed: no cost model, no search, no analysis of the graph. The plan was
made for one graph (stage markers removed), whose `Graph.fingerprint()` it records; a
graph with another fingerprint is refused. Each op's strategy is rebuilt from the choices
the plan stores (`BlockPlan.ops`, "<data>/<tensor>"): on each axis of the lowering mesh,
the tensor choice where the block gives that axis the tensor role, the data choice on every
other axis (the data and sharded-data axes, and a pipeline's microbatch axis).

Example:
    >>> lowering = PlanLowering(pxform.Plan.load("plan.json"), "auto(loss_fn)")
    >>> graph, strategies = lowering.strategies(graph, mesh, layouts)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pxform.core.errors import PxformError
from pxform.core.ir import Graph
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.ops.strategy import Strategy, parse_choice, strategy_for
from pxform.passes.cuts import StageCuts, strip_markers, tag_blocks
from pxform.search.plan import TENSOR_ROLES, Plan


@dataclass(frozen=True, eq=False)
class PlanLowering:
    """Lays a traced graph out per a plan (module doc). `fn` names the function in
    messages."""

    plan: Plan
    fn: str
    # graphs already checked: (the graph, kept alive so its id stays its own, stripped)
    _checked: dict[int, tuple[Graph, Graph]] = field(default_factory=dict, repr=False)

    def graph(self, graph: Graph) -> Graph:
        """`graph` without stage markers, checked to be the graph the plan was made for.

        Raises:
            PxformError: the plan was made for other arguments or another function.
        """
        hit = self._checked.get(id(graph))
        if hit is not None and hit[0] is graph:
            return hit[1]
        stripped, _ = strip_markers(graph)
        plan = self.plan
        covered = plan.blocks[-1].stop if plan.blocks else 0
        if stripped.fingerprint() != plan.fingerprint or covered != len(stripped.ops):
            raise PxformError(
                f"pxform.{self.fn}: the plan was made for other arguments or another "
                f"function (plan fingerprint {plan.fingerprint}, {covered} ops in "
                f"{len(plan.blocks)} blocks; these arguments give {stripped.fingerprint()}, "
                f"{len(stripped.ops)} ops).\n  Fix: call with arguments of the shapes and "
                f"dtypes the plan was searched for, or search again (step.plan(*args)).")
        self._checked[id(graph)] = (graph, stripped)
        return stripped

    def cuts(self, cuts: StageCuts) -> StageCuts:
        """`cuts` with every op on the stage the plan gives its block."""
        graph = self.graph(cuts.graph)
        op_stage = [0] * len(graph.ops)
        for b in self.plan.blocks:
            op_stage[b.start:b.stop] = [b.stage] * (b.stop - b.start)
        return StageCuts(graph, tuple(op_stage), self.plan.num_stages, cuts.blocks, "plan")

    def reshard(self, graph: Graph) -> bool | frozenset[str]:
        """Which gathered parameters the runtime frees after forward (the runtime's
        `reshard_after_forward`): every one (True) unless a block keeps them
        (`BlockPlan.reshard` False); then the paths of all parameters but those read only
        by such blocks. A parameter read by a block that reshards and one that keeps
        reshards: the plan's memory holds either way, its time is a gather short.

        Example:
            >>> lowering.reshard(graph)      # blocks 1 and 2 keep theirs
            frozenset({'wte', 'blocks.0.w', 'blocks.3.w', ...})
        """
        graph = self.graph(graph)
        params = {name for name, _ in self.plan.parameter_specs}
        keep: set[str] = set()
        free: set[str] = set()
        for b in self.plan.blocks:
            read = {v.name for op in graph.ops[b.start:b.stop] for v in op.inputs
                    if v.name in params}
            (free if b.reshard else keep).update(read)
        kept = keep - free
        if not kept:
            return True
        return frozenset(params - kept) or False

    def strategies(self, graph: Graph, mesh: AbstractMesh, layouts: Sequence[Layout]
                   ) -> tuple[Graph, list[Strategy]]:
        """The graph to lower (markers removed, the plan's recompute blocks tagged) and
        each op's strategy on `mesh` (the stage mesh, plus a pipeline's microbatch axis).
        `layouts` are the inputs' (unused: the plan fixed every choice)."""
        graph = self.graph(graph)
        out: list[Strategy] = []
        for b in self.plan.blocks:
            roles = dict(b.roles)
            for k, text in zip(range(b.start, b.stop), b.ops):
                data, tensor = _choices(text, self.fn)
                if tensor is None and set(TENSOR_ROLES) & set(roles.values()):
                    raise PxformError(
                        f"pxform.{self.fn}: the plan's block {b.label} has a tensor role but "
                        f"op {k - b.start} has no tensor choice ({text!r}).\n  Fix: write the "
                        f"plan again with Plan.save (or search again).")
                combo = tuple(tensor if roles.get(ax) in TENSOR_ROLES else data
                              for ax in mesh.names)
                out.append(strategy_for(graph.ops[k], mesh, combo))
        flags = [b.recompute for b in self.plan.blocks]
        if any(flags):
            graph = tag_blocks(graph, self.plan.blocks, flags, self.fn)
        return graph, out


def _choices(text: str, fn: str) -> tuple[Any, Any]:
    try:
        data, _, tensor = text.partition("/")
        return parse_choice(data), (parse_choice(tensor) if tensor != "-" else None)
    except ValueError as exc:
        raise PxformError(f"pxform.{fn}: the plan's op strategy {text!r} is malformed "
                          f"({exc}).\n  Fix: write the plan again with Plan.save.") from None
