"""A simulated mesh for tests: every rank's local tensor in one process, and the semantics
of each re-layout step written out plainly over them. It is the reference the re-layout
planner is checked against (and later, the runtime's collectives)."""

from __future__ import annotations

import itertools
import math

import torch

from pxform.core.layout import Layout, Step
from pxform.core.mesh import AbstractMesh

Coord = tuple[int, ...]


def coords(mesh: AbstractMesh) -> list[Coord]:
    return list(itertools.product(*[range(s) for s in mesh.shape]))


def shard_of(full: torch.Tensor, layout: Layout, mesh: AbstractMesh, c: Coord) -> torch.Tensor:
    """The slice of `full` that rank `c` holds under `layout` (ignoring partial axes)."""
    out = full
    index = dict(zip(mesh.names, c))
    for d, axes in enumerate(layout.dims):
        for a in axes:  # major to minor: successive contiguous chunks
            out = out.chunk(mesh.axis_size(a), dim=d)[index[a]]
    return out


def distribute(full: torch.Tensor, layout: Layout, mesh: AbstractMesh,
               gen: torch.Generator) -> dict[Coord, torch.Tensor]:
    """Per-rank locals of `full` under `layout`; partial axes get random addends that sum
    to the true shard over each partial group."""
    ks = [mesh.names.index(a) for a in sorted(layout.partial)]

    def root(c: Coord) -> Coord:  # the rank of c's partial group with every partial coord 0
        return tuple(0 if i in ks else x for i, x in enumerate(c))

    # Replicated axes must hold identical copies, so the noise of a rank depends only on its
    # coordinates on the axes the layout uses (shard and partial axes).
    used = [mesh.names.index(a) for a in layout.used_axes()]
    local = {c: shard_of(full, layout, mesh, c).clone() for c in coords(mesh)}
    noise_of: dict[Coord, torch.Tensor] = {}
    for c in coords(mesh):
        if root(c) != c:  # a non-root member: holds noise that its root cancels
            key = tuple(c[i] for i in sorted(used))
            if key not in noise_of:
                noise_of[key] = torch.randn(local[c].shape, generator=gen, dtype=full.dtype)
            local[c] = noise_of[key]
    for c in coords(mesh):
        if root(c) != c:
            local[root(c)] = local[root(c)] - local[c]
    return local


def _group(mesh: AbstractMesh, c: Coord, axis: str) -> list[Coord]:
    k = mesh.names.index(axis)
    return [c[:k] + (i,) + c[k + 1:] for i in range(mesh.axis_size(axis))]


def apply(step: Step, local: dict[Coord, torch.Tensor], mesh: AbstractMesh
          ) -> dict[Coord, torch.Tensor]:
    k = mesh.names.index(step.axis)
    n = mesh.axis_size(step.axis)
    out = {}
    for c in local:
        group = [local[g] for g in _group(mesh, c, step.axis)]
        if step.kind == "all_gather":
            out[c] = torch.cat(group, dim=step.dim)
        elif step.kind == "all_reduce":
            out[c] = sum(group)
        elif step.kind == "reduce_scatter":
            out[c] = sum(group).chunk(n, dim=step.dim)[c[k]]
        elif step.kind == "all_to_all":
            out[c] = torch.cat([g.chunk(n, dim=step.to_dim)[c[k]] for g in group], dim=step.dim)
        elif step.kind == "slice":
            out[c] = local[c].chunk(n, dim=step.dim)[c[k]]
        elif step.kind == "zero":
            out[c] = local[c] if c[k] == 0 else torch.zeros_like(local[c])
        else:
            raise ValueError(step.kind)
    return out


def assemble_check(full: torch.Tensor, local: dict[Coord, torch.Tensor], layout: Layout,
                   mesh: AbstractMesh) -> None:
    """Assert that `local` holds `full` under `layout`: summing over partial groups gives
    each rank's true shard."""
    names = mesh.names
    for c in local:
        total = local[c]
        if layout.partial:
            ranks = [c]
            for a in sorted(layout.partial):
                ranks = [g for r in ranks for g in _group(mesh, r, a)]
            total = sum(local[r] for r in ranks)
        expected = shard_of(full, layout, mesh, c)
        assert total.shape == expected.shape, (c, total.shape, expected.shape)
        torch.testing.assert_close(total, expected, msg=lambda m, c=c: f"rank {c}: {m}")
    assert math.prod(mesh.shape) == len(local) and len(names) == len(mesh.shape)
