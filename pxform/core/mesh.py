"""Meshes: named device axes.

`AbstractMesh` is names and sizes only, ordered outer to inner (slowest link first). It is
what planning and lowering need, so a plan for 1,024 ranks can be made on a laptop, as with
JAX's `AbstractMesh`. Binding a mesh to the `torch.distributed` world (process groups per
axis) belongs to the runtime: `pxform.Mesh` is `pxform.runtime.mesh.Mesh`.

`check_spec` validates a partition spec against a tensor shape and a mesh, with messages that
name the function, the argument path, the shape, the mesh and a fix.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pxform.core.errors import SpecError
from pxform.core.spec import P

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True, slots=True, init=False)
class AbstractMesh:
    """Mesh axis names and sizes, ordered outer (slowest link) to inner (fastest).

    Example:
        >>> mesh = AbstractMesh({"dp": 16, "tp": 8})
        >>> mesh.size, mesh.axis_size("tp")
        (128, 8)
        >>> str(mesh)
        'Mesh(dp=16, tp=8)'
    """

    axes: tuple[tuple[str, int], ...]
    _names: tuple[str, ...] = field(init=False, repr=False, compare=False)

    def __init__(self, axes: Mapping[str, int] | tuple[tuple[str, int], ...]) -> None:
        items = tuple(axes.items()) if isinstance(axes, Mapping) else tuple(axes)
        if not items:
            raise ValueError("Mesh: give at least one axis, e.g. Mesh({'dp': 2})")
        seen = set()
        for name, size in items:
            if not isinstance(name, str) or not _NAME.match(name):
                raise ValueError(f"Mesh: axis name {name!r} must be an identifier such as 'dp'")
            if name in seen:
                raise ValueError(f"Mesh: axis {name!r} appears twice")
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"Mesh: axis {name!r} has size {size!r}; sizes are integers >= 1")
            seen.add(name)
        object.__setattr__(self, "axes", tuple((n, int(s)) for n, s in items))
        # derived, kept because lowering and search ask for it millions of times
        object.__setattr__(self, "_names", tuple(n for n, _ in self.axes))

    @property
    def names(self) -> tuple[str, ...]:
        return self._names

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(s for _, s in self.axes)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def axis_size(self, name: str) -> int:
        for n, s in self.axes:
            if n == name:
                return s
        raise KeyError(name)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{n}={s}" for n, s in self.axes) + ")"


def check_spec(spec: P, shape: tuple[int, ...], mesh: AbstractMesh, *, fn: str,
               path: str) -> None:
    """Raise `SpecError` unless `spec` can lay out a tensor of `shape` over `mesh`.

    Checks, in order: the spec is no longer than the tensor's rank; every axis exists in the
    mesh; no axis is used twice (`P` already refuses that at construction); every split dim
    is divisible by the product of its axes' sizes.

    Example:
        >>> check_spec(P("dp", None), (8, 4), AbstractMesh({"dp": 2}), fn="shard(f)",
        ...            path="batch['x']")
    """
    where = f"{fn}: {path} (shape {list(shape)}, spec {spec!r}, {mesh})"
    if len(spec) > len(shape):
        raise SpecError(
            f"{where}: the spec has {len(spec)} entries but the tensor has rank {len(shape)}.\n"
            f"  Fix: give at most one entry per dim, e.g. {P(*spec.entries[:len(shape)])!r}.")
    for d in range(len(spec)):
        for axis in spec.axes_of(d):
            if axis not in mesh:
                raise SpecError(
                    f"{where}: mesh axis {axis!r} (dim {d}) is not in the mesh.\n"
                    f"  Fix: use one of {list(mesh.names)}.")
    for axis, dims in spec.repeated_axes().items():
        fixed: list[Any] = [None] * len(spec)
        for d in range(len(spec)):
            fixed[d] = spec.entries[d] if d == dims[0] or axis not in spec.axes_of(d) else \
                tuple(a for a in spec.axes_of(d) if a != axis) or None
        raise SpecError(
            f"{where}: mesh axis {axis!r} splits dims {dims}; an axis can split at most one "
            f"dim of a tensor.\n  Fix: use it for one dim only, e.g. {P(*fixed)!r}.")
    for d in range(len(spec)):
        axes = spec.axes_of(d)
        if not axes:
            continue
        ways = math.prod(mesh.axis_size(a) for a in axes)
        if shape[d] % ways:
            over = " x ".join(f"{a}={mesh.axis_size(a)}" for a in axes)
            raise SpecError(
                f"{where}: dim {d} has size {shape[d]}, which is not divisible by {ways} "
                f"({over}).\n  Fix: make dim {d} a multiple of {ways}, or shard it over "
                f"fewer or smaller axes.")


def abstract_mesh(axes: int | Mapping[str, int]) -> AbstractMesh:
    """A mesh for planning only, not bound to processes: a device count (one axis
    `"devices"`) or named axis sizes. Reached as `pxform.Mesh.abstract(...)`.

    Example:
        >>> pxform.Mesh.abstract(1024).size
        1024
    """
    if isinstance(axes, bool) or not isinstance(axes, (int, Mapping)):
        raise ValueError(f"Mesh.abstract: {axes!r}; give a device count or axis sizes")
    if isinstance(axes, int):
        return AbstractMesh({"devices": axes})
    return AbstractMesh(axes)


