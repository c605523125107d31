"""Layouts of one tensor over a mesh, and the re-layout planner.

A `Layout` says, per tensor dim, which mesh axes split it (major to minor) and over which
axes the tensor is a partial sum. Axes in neither are replicated. `P` is the user's view;
`Layout` adds the partial axes that only types carry.

`plan_relayout` finds the cheapest sequence of collectives that turns one layout into
another: a shortest path over layouts (TensorOpt), where each edge acts on one mesh axis:

    all_gather(a, d)      Shard(d) -> Replicate        sends (n-1) x local bytes
    reduce_scatter(a, d)  Partial  -> Shard(d)         sends (n-1)/n x local bytes
    all_reduce(a)         Partial  -> Replicate        sends 2(n-1)/n x local bytes (ring)
    all_to_all(a, d, e)   Shard(d) -> Shard(e)         sends (n-1)/n x local bytes
    slice(a, d)           Replicate -> Shard(d)        local, free
    zero(a)               Replicate -> Partial         local, free (keep one copy, zero the rest)

Byte counts are per rank for ring algorithms (the standard alpha-beta model, e.g. Thakur et
al. 2005; DTensor's `_collective_utils.py` uses the same). Only the innermost axis of a dim
can be gathered or moved, and new axes become innermost: that keeps every shard contiguous
(gathering a major axis first would leave strided pieces).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from pxform.core.errors import SpecError
from pxform.core.mesh import AbstractMesh
from pxform.core.spec import P


@dataclass(frozen=True, slots=True)
class Layout:
    """Dim-major placement of one tensor: `dims[d]` are the axes splitting dim d (major to
    minor); `partial` are the axes it is a partial sum over.

    Example:
        >>> Layout.of(P("dp", None), rank=2)
        Layout(dp, -)
        >>> Layout.of(P(None, "tp"), rank=2, partial={"dp"})
        Layout(-, tp){+dp}
    """

    dims: tuple[tuple[str, ...], ...]
    partial: frozenset[str] = frozenset()
    # layouts key the search's caches by the hundred thousand: the hash of the nested
    # tuples is taken once, not on every lookup
    _hash: int = field(init=False, repr=False, compare=False, default=0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash((self.dims, self.partial)))

    def __hash__(self) -> int:
        return self._hash

    @staticmethod
    def of(spec: P, rank: int, partial: set[str] | frozenset[str] = frozenset()) -> Layout:
        dims = tuple(spec.axes_of(d) for d in range(rank))
        return Layout(dims, frozenset(partial))

    @staticmethod
    def replicated(rank: int) -> Layout:
        return Layout(((),) * rank)

    def to_spec(self) -> P:
        return P(*[None if not a else a[0] if len(a) == 1 else a for a in self.dims])

    def used_axes(self) -> frozenset[str]:
        return frozenset(a for axes in self.dims for a in axes) | self.partial

    def local_shape(self, shape: tuple[int, ...], mesh: AbstractMesh) -> tuple[int, ...]:
        return tuple(s // math.prod(mesh.axis_size(a) for a in axes)
                     for s, axes in zip(shape, self.dims))

    def __repr__(self) -> str:
        body = ", ".join(".".join(axes) if axes else "-" for axes in self.dims)
        tail = "{" + ",".join("+" + a for a in sorted(self.partial)) + "}" if self.partial else ""
        return f"Layout({body}){tail}"


LOCAL_STEPS = frozenset({"slice", "zero", "pad"})
"""Step kinds that move nothing between ranks: `slice` keeps this rank's piece of a
replicated dim, `zero` makes a replicated value partial (zeros off index 0), `pad` makes a
sharded dim partial (this rank's piece in place, zeros elsewhere: a pipeline's gradient of
a value every microbatch computes, summed over microbatches by accumulation)."""


@dataclass(frozen=True, slots=True)
class Step:
    """One collective (or local op, `LOCAL_STEPS`) on one mesh axis."""

    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | slice | zero | pad
    axis: str
    dim: int | None = None
    to_dim: int | None = None

    def __str__(self) -> str:
        if self.kind == "all_to_all":
            return f"all_to_all({self.axis}, dim {self.dim} -> {self.to_dim})"
        if self.dim is None:
            return f"{self.kind}({self.axis})"
        return f"{self.kind}({self.axis}, dim {self.dim})"


@dataclass(frozen=True, slots=True)
class Relayout:
    """A re-layout plan: the steps, bytes each rank sends per axis, and the total cost."""

    src: Layout
    dst: Layout
    steps: tuple[Step, ...]
    volume: tuple[tuple[str, float], ...] = field(default=())
    cost: float = 0.0

    def volume_of(self, axis: str) -> float:
        return dict(self.volume).get(axis, 0.0)

    def __str__(self) -> str:
        steps = "; ".join(map(str, self.steps)) or "nothing to do"
        return f"{self.src} -> {self.dst}: {steps}"


# Per-axis cost of the planner, in seconds: latency per collective + bytes x seconds per byte.
# Defaults: 10 us and 100 GB/s per rank, the order of an NVLink-connected GPU node (NCCL's
# published all-reduce latencies are 5-20 us intra-node; H100 NVLink 4 carries ~450 GB/s
# per direction, of which collectives reach a fraction). Equal on every axis, so without
# real numbers the planner prefers fewer bytes, then fewer collectives. The search's cost
# model passes preset or measured numbers per axis.
@dataclass(frozen=True, slots=True)
class AxisCost:
    latency: float = 10e-6
    seconds_per_byte: float = 1 / 100e9


def plan_relayout(shape: tuple[int, ...], itemsize: int, src: Layout, dst: Layout,
                  mesh: AbstractMesh, costs: Mapping[str, AxisCost] | None = None) -> Relayout:
    """The cheapest sequence of steps from `src` to `dst` (Dijkstra over layouts).

    Args:
        shape: the tensor's global shape; itemsize: bytes per element.
        costs: per mesh axis latency and seconds per byte (default: bytes, equal axes).

    Raises:
        SpecError: a layout does not fit the shape or mesh, or `dst` is unreachable.

    Example:
        >>> mesh = AbstractMesh({"tp": 4})
        >>> r = plan_relayout((8, 16), 4, Layout.of(P(), 2, {"tp"}), Layout.of(P("tp"), 2),
        ...                   mesh)
        >>> [str(s) for s in r.steps]
        ['reduce_scatter(tp, dim 0)']
    """
    for name, layout in (("source", src), ("target", dst)):
        _check_layout(layout, shape, mesh, name)
    costs = costs or {}
    start, goal = src, dst
    best: dict[Layout, float] = {start: 0.0}
    back: dict[Layout, tuple[Layout, Step, float]] = {}
    heap: list[tuple[float, int, Layout]] = [(0.0, 0, start)]
    tiebreak = 1
    while heap:
        cost, _, layout = heapq.heappop(heap)
        if layout == goal:
            break
        if cost > best.get(layout, math.inf):
            continue
        for step, nxt, sent in _moves(layout, shape, itemsize, mesh):
            c = costs.get(step.axis, AxisCost())
            ncost = cost + (c.latency if step.kind not in LOCAL_STEPS else 0.0) \
                + sent * c.seconds_per_byte
            if ncost < best.get(nxt, math.inf) - 1e-12:
                best[nxt] = ncost
                back[nxt] = (layout, step, sent)
                heapq.heappush(heap, (ncost, tiebreak, nxt))
                tiebreak += 1
    if goal not in best:
        raise SpecError(f"plan_relayout: no sequence of collectives turns {src} into {dst} "
                        f"for shape {list(shape)} on {mesh}")
    steps: list[Step] = []
    volume: dict[str, float] = {}
    node = goal
    while node != start:
        prev, step, sent = back[node]
        steps.append(step)
        volume[step.axis] = volume.get(step.axis, 0.0) + sent
        node = prev
    steps.reverse()
    return Relayout(src, dst, tuple(steps), tuple(sorted(volume.items())), best[goal])


def _check_layout(layout: Layout, shape: tuple[int, ...], mesh: AbstractMesh, name: str) -> None:
    if len(layout.dims) != len(shape):
        raise SpecError(f"plan_relayout: {name} layout {layout} has {len(layout.dims)} dims "
                        f"but the tensor has shape {list(shape)}")
    seen: set[str] = set()
    for axes in [*layout.dims, tuple(layout.partial)]:
        for a in axes:
            if a not in mesh:
                raise SpecError(f"plan_relayout: {name} layout {layout} uses axis {a!r}, "
                                f"which is not in {mesh}")
            if a in seen:
                raise SpecError(f"plan_relayout: {name} layout {layout} uses axis {a!r} twice")
            seen.add(a)
    for d, axes in enumerate(layout.dims):
        ways = math.prod(mesh.axis_size(a) for a in axes)
        if shape[d] % ways:
            raise SpecError(f"plan_relayout: {name} layout {layout} splits dim {d} of size "
                            f"{shape[d]} {ways} ways on {mesh}")


def _moves(layout: Layout, shape: tuple[int, ...], itemsize: int,
           mesh: AbstractMesh) -> Iterator[tuple[Step, Layout, float]]:
    local_bytes = math.prod(layout.local_shape(shape, mesh)) * itemsize
    used = layout.used_axes()

    def with_dims(dims: list[tuple[str, ...]], partial: frozenset[str]) -> Layout:
        return Layout(tuple(dims), partial)

    def fits(dims: list[tuple[str, ...]], d: int) -> bool:
        return shape[d] % math.prod(mesh.axis_size(a) for a in dims[d]) == 0

    for d, axes in enumerate(layout.dims):
        if not axes:
            continue
        a, n = axes[-1], mesh.axis_size(axes[-1])
        dims = list(layout.dims)
        dims[d] = axes[:-1]
        yield Step("all_gather", a, d), with_dims(dims, layout.partial), local_bytes * (n - 1)
        for e in range(len(shape)):
            if e == d:
                continue
            moved = list(dims)
            moved[e] = moved[e] + (a,)
            if fits(moved, e):
                yield (Step("all_to_all", a, d, e), with_dims(moved, layout.partial),
                       local_bytes * (n - 1) / n)
    for a in sorted(layout.partial):
        n = mesh.axis_size(a)
        rest = layout.partial - {a}
        yield Step("all_reduce", a), with_dims(list(layout.dims), rest), \
            2 * local_bytes * (n - 1) / n
        for d in range(len(shape)):
            dims = list(layout.dims)
            dims[d] = dims[d] + (a,)
            if fits(dims, d):
                yield Step("reduce_scatter", a, d), with_dims(dims, rest), \
                    local_bytes * (n - 1) / n
    for a in mesh.names:
        if a in used:
            continue
        for d in range(len(shape)):
            dims = list(layout.dims)
            dims[d] = dims[d] + (a,)
            if fits(dims, d):
                yield Step("slice", a, d), with_dims(dims, layout.partial), 0.0
        yield Step("zero", a), with_dims(list(layout.dims), layout.partial | {a}), 0.0


def apply_step(layout: Layout, step: Step, shape: tuple[int, ...], mesh: AbstractMesh) -> Layout:
    """The layout after `step` (checks a lowered program's conversions).

    Raises:
        SpecError: the step cannot act on `layout` (e.g. gathers an axis that is not the
            innermost of its dim, or reduces an axis the value is not partial over).
    """
    if step.kind == "pad":  # not a move the planner makes (`pxform.lower.mpmd` does)
        d = step.dim
        if d is not None and d < len(layout.dims) and layout.dims[d] and \
                layout.dims[d][-1] == step.axis:
            return Layout(tuple(axes[:-1] if k == d else axes
                                for k, axes in enumerate(layout.dims)),
                          layout.partial | {step.axis})
    for s, nxt, _ in _moves(layout, shape, 1, mesh):
        if s == step:
            return nxt
    raise SpecError(f"{step} cannot act on {layout} (shape {list(shape)}, {mesh})")
