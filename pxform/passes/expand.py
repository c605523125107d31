"""From region tags to what the runtime runs (the first lowering pass, before SPMD).

`prepare(graph)`:

1. strips `pxform::mark` ops (their outputs renamed to their inputs), except a
   `checkpoint_name` that its recompute region's policy saves: that one stays as an op (a
   copy) tagged with its name (`NAME`), and the saved copy is what backward reads; a
   coshard region's argument markers say which value is which argument;
2. expands every coshard region into one recomputed copy per piece (`pxform.passes.coshard`);
3. numbers the recompute regions in order of appearance (so printed programs do not depend
   on how many regions were traced before), tags the ops whose outputs the region's policy
   saves (`SAVE`), and refuses a policy naming a value that no op of its region is named.

The result is an ordinary graph: SPMD lowering and pipeline cuts treat it like any other;
the runtime groups each recompute region's instructions into one checkpointed module.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace

from pxform.core.ir import Graph, Op, Renames, Value
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.frontend.regions import (
    COSHARD,
    NAME,
    RECOMPUTE,
    SAVE,
    RecomputeTag,
    RegionError,
    is_mark,
    mark_text,
)
from pxform.passes.coshard import expand
from pxform.passes.propagate import propagate


def prepare(graph: Graph, mesh: AbstractMesh | None = None,
            layouts: list[Layout] | None = None) -> Graph:
    """The graph with markers stripped, coshard regions expanded and recompute regions
    numbered and tagged with what they save (see module doc).

    Example:
        >>> g = prepare(pxform.trace(loss_fn, params, x).graph)
        >>> [op.tag("pxform.recompute") for op in g.ops][:2]
        [recompute#0(save nothing), recompute#0(save nothing)]
    """
    if not any(is_mark(op) or op.tag(COSHARD) is not None or op.tag(RECOMPUTE) is not None
               for op in graph.ops):
        return graph
    graph, inputs, names = _strip_marks(graph)
    ways = None
    if inputs and mesh is not None and layouts is not None:
        ways = _mesh_ways(graph, mesh, layouts)
    graph = expand(graph, inputs, ways)
    return _settle(graph, names)


def _mesh_ways(graph: Graph, mesh: AbstractMesh, layouts: list[Layout]
               ) -> Callable[[str, int], int]:
    """`ways(value, dim)`: how many shards the mesh splits a dim of a value into, as the
    propagation lays the graph out (so coshard pieces are pieces of each rank's shard)."""
    have = {v.name: lay for v, lay in zip(graph.inputs, layouts)}
    for op, s in zip(graph.ops, propagate(graph, mesh, layouts)):
        for v, lay in zip(op.outputs, s.outputs):
            have[v.name] = lay

    def ways(name: str, dim: int) -> int:
        lay = have.get(name)
        return math.prod(mesh.axis_size(a) for a in lay.dims[dim]) if lay is not None else 1

    return ways


def _strip_marks(graph: Graph) -> tuple[Graph, dict[int, dict[int, Value]],
                                         dict[int, set[str]]]:
    """Remove markers. Returns the graph, per coshard region its argument values by leaf
    index, and per recompute region the names given inside it."""
    renames = Renames()
    producer: dict[str, int] = {}
    ops: list[Op] = []
    inputs: dict[int, dict[int, Value]] = {}
    names: dict[int, set[str]] = {}

    for op in graph.ops:
        op = renames.rewire(op)
        kind, _, rest = mark_text(op).partition(":") if is_mark(op) else ("", "", "")
        if kind == "name" and _saved_by_name(op, rest):
            # kept as an op (a copy) that the policy saves: tagging the producer instead
            # would save nothing when it returns an alias (dropout with p=0 does)
            names.setdefault(op.tag(RECOMPUTE).region, set()).add(rest)
            op = op.with_tag(NAME, (rest,))
        if not is_mark(op) or kind == "name" and op.tag(NAME):
            for v in op.outputs:
                producer[v.name] = len(ops)
            ops.append(op)
            continue
        source = op.inputs[0]
        renames.add(op.outputs[0], source)
        if kind == "in":
            tag = op.tag(COSHARD)
            if tag is not None:
                inputs.setdefault(tag.region, {}).setdefault(int(rest), source)
        elif kind == "name":
            rtag = op.tag(RECOMPUTE)
            if rtag is not None:
                names.setdefault(rtag.region, set()).add(rest)
    return graph.replace(ops=tuple(ops), outputs=renames.outputs(graph.outputs)), inputs, names


def _settle(graph: Graph, names: dict[int, set[str]]) -> Graph:
    numbers: dict[int, int] = {}
    regions: dict[int, RecomputeTag] = {}
    ops = []
    for op in graph.ops:
        tag = op.tag(RECOMPUTE)
        if tag is None:
            ops.append(op)
            continue
        if tag.region not in numbers:
            numbers[tag.region] = len(numbers)
            regions[tag.region] = tag
        new = replace(tag, region=numbers[tag.region])
        op = op.with_tag(RECOMPUTE, new)
        if tag.policy.saves(op):
            op = op.with_tag(SAVE, True)
        ops.append(op)
    for region, tag in regions.items():
        if tag.policy.kind != "names":
            continue
        given = names.get(region, set())
        missing = [n for n in tag.policy.names if n not in given]
        if missing:
            have = ", ".join(repr(n) for n in sorted(given)) or "none"
            raise RegionError(
                f"pxform.recompute({tag.fn}): the policy saves "
                f"{', '.join(repr(n) for n in missing)}, but no value inside the region has "
                f"that name (names given in it: {have}).\n  Fix: mark the value inside the "
                f"function with pxform.checkpoint_name(x, {missing[0]!r}), or correct the "
                f"name in policy=.")
    return graph.replace(ops=tuple(ops))


def _saved_by_name(op: Op, name: str) -> bool:
    tag = op.tag(RECOMPUTE)
    return tag is not None and tag.policy.kind == "names" and name in tag.policy.names


def region_of(op: Op) -> RecomputeTag | None:
    """The recompute region an op of a prepared graph belongs to, or None."""
    return op.tag(RECOMPUTE)

