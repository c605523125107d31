"""`Mesh`: named axes bound to the torch.distributed world, one process group per axis
(a `DeviceMesh`). Planning and lowering need only its `AbstractMesh` (`mesh.abstract`);
`Mesh.abstract(n)` on the class builds one.
"""

from __future__ import annotations

import math
import os
import weakref
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from pxform.core.errors import SpecError
from pxform.core.mesh import AbstractMesh, abstract_mesh
from pxform.runtime import heap


def default_timeout(backend: str) -> float:
    """Seconds a collective may wait for its peers: `PXFORM_TIMEOUT_S`, else a minute on
    CPU (gloo) and ten on GPUs (NCCL, where first calls compile kernels)."""
    env = os.environ.get("PXFORM_TIMEOUT_S")
    if env:
        return float(env)
    return 600.0 if backend == "nccl" else 60.0


# Process groups made for meshes, per (ranks, timeout), in the world they were made in
# (`_group`): a weak reference to that world's default group, and the groups.
_GROUPS: dict[tuple[tuple[int, ...], float], Any] = {}
_GROUPS_WORLD: list[Any] = [None]


def _group(ranks: list[int], timeout_s: float) -> Any:
    """The process group over `ranks` with `timeout_s`: made once per world and reused
    by every mesh that needs it. A gloo group holds threads and a socket per peer until
    destroyed, and torch never destroys one by itself: every `Mesh` making its own leaked
    81 threads per rank on each `runtime_costs` (its meshes, 2 ranks; 333 threads after
    four), and on a large world it would run out of sockets. Every rank makes the same
    meshes in the same order (SPMD), so every rank finds or makes each group alike
    (`new_group` is collective)."""
    world = dist.distributed_c10d._get_default_group()
    known = _GROUPS_WORLD[0]() if _GROUPS_WORLD[0] is not None else None
    if known is not world:  # a new world (or the first): the old groups are gone with it
        _GROUPS.clear()
        _GROUPS_WORLD[0] = weakref.ref(world)
    key = (tuple(ranks), timeout_s)
    group = _GROUPS.get(key)
    if group is None or group not in dist.distributed_c10d._world.pg_map:
        group = _GROUPS[key] = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s))
    return group


def _mesh_with_timeout(device: str, abstract: AbstractMesh, timeout_s: float) -> DeviceMesh:
    """A DeviceMesh over process groups made with `timeout_s` (`init_device_mesh` gives
    torch's default, 30 minutes on gloo), shared with the meshes before it over the same
    ranks (`_group`). Every rank makes every group, in one order."""
    shape = abstract.shape
    grid = torch.arange(math.prod(shape)).view(shape)
    me = dist.get_rank()
    mine = []
    for d in range(len(shape)):
        for ranks in grid.movedim(d, -1).reshape(-1, shape[d]).tolist():
            group = _group(ranks, timeout_s)
            if me in ranks:
                mine.append(group)
    return DeviceMesh.from_group(mine, device, mesh=grid, mesh_dim_names=abstract.names)


class _Abstract:
    """`Mesh.abstract(n)` on the class builds a planning mesh (`abstract_mesh`);
    `mesh.abstract` on a bound mesh is its axes as an `AbstractMesh`."""

    @overload
    def __get__(self, obj: None, owner: type) -> Callable[[int | Mapping[str, int]],
                                                          AbstractMesh]: ...

    @overload
    def __get__(self, obj: Mesh, owner: type) -> AbstractMesh: ...

    def __get__(self, obj: Any, owner: type) -> Any:
        if obj is None:
            return abstract_mesh
        return obj._abstract


class Mesh:
    """A mesh bound to the `torch.distributed` world: named axes over all ranks, ordered
    outer (slowest link) to inner (fastest), as a `DeviceMesh` with one process group per
    axis. Ranks are laid out row-major: with `{"dp": 2, "tp": 2}`, ranks 0 and 1 share a
    tensor-parallel group.

    Every collective on the mesh's groups gives up after `timeout` seconds (default
    `PXFORM_TIMEOUT_S`, else 60 on gloo and 600 on NCCL): a rank that failed, or runs
    another program, then ends its peers with a `CollectiveError` instead of a hang.
    `device` is the device type of the DTensors it makes (default: "cuda" under NCCL,
    else "cpu").

    Example (under `torchrun --nproc-per-node 4`):
        >>> mesh = pxform.Mesh({"dp": 2, "tp": 2})
        >>> mesh.coordinate()        # on rank 3
        {'dp': 1, 'tp': 1}
    """

    def __init__(self, axes: Mapping[str, int] | AbstractMesh,
                 timeout: float | None = None, device: str | None = None) -> None:
        self._abstract = axes if isinstance(axes, AbstractMesh) else AbstractMesh(axes)
        if not dist.is_available() or not dist.is_initialized():
            raise SpecError(
                f"pxform.{self.abstract}: torch.distributed is not initialised.\n  Fix: run "
                f"under torchrun (or call torch.distributed.init_process_group first); to plan "
                f"or lower without devices use pxform.AbstractMesh({dict(self.abstract.axes)}).")
        world = dist.get_world_size()
        if world != self.abstract.size:
            raise SpecError(
                f"pxform.{self.abstract}: the mesh has {self.abstract.size} devices but the "
                f"torch.distributed world has {world} ranks.\n  Fix: make the axis sizes "
                f"multiply to {world}, or launch {self.abstract.size} processes.")
        backend = dist.get_backend()
        # the DTensors it returns live on this device type (a fake process group has none
        # of its own: say "cuda" to test device placement, `tests/test_fake_cuda.py`)
        device = device or ("cuda" if backend == "nccl" else "cpu")
        self.timeout_s = float(timeout) if timeout is not None else default_timeout(backend)
        if device == "cpu":  # freed host memory stays for the next step (`heap`)
            heap.keep_pages()
        if backend in ("gloo", "nccl"):
            self.device_mesh = _mesh_with_timeout(device, self.abstract, self.timeout_s)
        else:  # a fake or custom backend: torch's own groups
            self.device_mesh = init_device_mesh(device, self.abstract.shape,
                                                mesh_dim_names=self.abstract.names)

    abstract = _Abstract()

    @staticmethod
    def from_world(name: str = "dp") -> Mesh:
        """A 1-D mesh over every rank of the initialised world."""
        if not dist.is_initialized():
            raise SpecError("pxform.Mesh.from_world: torch.distributed is not initialised.\n"
                            "  Fix: run under torchrun or call init_process_group first.")
        return Mesh({name: dist.get_world_size()})

    @property
    def names(self) -> tuple[str, ...]:
        return self.abstract.names

    @property
    def size(self) -> int:
        return self.abstract.size

    def axis_size(self, name: str) -> int:
        return self.abstract.axis_size(name)

    def group(self, axis: str):  # type: ignore[no-untyped-def]
        return self.device_mesh.get_group(axis)

    def coordinate(self) -> dict[str, int]:
        coord = self.device_mesh.get_coordinate()
        assert coord is not None, "this rank is not in the mesh"
        return dict(zip(self.names, coord))

    def __str__(self) -> str:
        return str(self.abstract)

    def __repr__(self) -> str:
        return f"pxform.{self.abstract}"
