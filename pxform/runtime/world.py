"""The torch.distributed world as the rest of pxform sees it: whether there is one, its
size and this rank, and the few whole-world calls tools make (a barrier, gathering a
Python object from every rank). Everything above the runtime asks here instead of calling
torch.distributed, so the runtime stays the one place that does.

Example:
    >>> if world.initialized():
    ...     figures = world.gather_objects(mine)   # one per rank, by rank
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def initialized() -> bool:
    """Is a torch.distributed process group initialised in this process?"""
    return dist.is_available() and dist.is_initialized()


def size() -> int:
    """The number of ranks (1 without a process group)."""
    return dist.get_world_size() if initialized() else 1


def rank() -> int:
    """This process's rank (0 without a process group)."""
    return dist.get_rank() if initialized() else 0


def backend() -> str:
    """The default group's backend ("gloo", "nccl", "fake"), "none" without one."""
    return str(dist.get_backend()) if initialized() else "none"


def barrier() -> None:
    """Wait for every rank (nothing without a process group). Under NCCL, on this rank's
    current CUDA device, named: without it torch warns that it guesses the device (and a
    guess can hang ranks that map to devices differently).

    Example:
        >>> world.barrier()
    """
    if not initialized():
        return
    if "nccl" in backend() and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def gather_objects(obj: Any) -> list[Any]:
    """`obj` from every rank, in rank order (`[obj]` without a process group). Every rank
    must call it."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def all_reduce_sum(tensor: Any, group: Any = None) -> None:
    """Sum `tensor` in place over `group` (default: the world)."""
    dist.all_reduce(tensor, group=group)


def init_gloo(rank: int, num_ranks: int, port: int, timeout_s: float) -> None:
    """Join a gloo world of `num_ranks` processes on this host (TCP rendezvous on `port`).
    A rank that fails mid-collective leaves its peers waiting; `timeout_s` bounds that wait,
    so a broken program fails instead of hanging."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=num_ranks, timeout=datetime.timedelta(seconds=timeout_s))


def init_fake(rank: int, num_ranks: int) -> None:
    """Make this process rank `rank` of a world whose collectives do nothing (torch's fake
    process group): enough to build meshes of any size and lower programs, never to run.

    Raises:
        RuntimeError: a process group is already initialised here.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if initialized():
        raise RuntimeError("fake_world: a torch.distributed process group is already "
                           "initialised in this process; use a fresh process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=num_ranks)


def destroy() -> None:
    """Leave the world (nothing without a process group)."""
    if initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def torchrun_world() -> Iterator[None]:
    """Within it, this process is in the torchrun world when it was started by torchrun
    (WORLD_SIZE set) and had none yet: joined here (nccl with CUDA, on the LOCAL_RANK
    device; else gloo) and left on the way out, errors included. Outside torchrun, or with
    a process group already initialised, it does nothing (the command measures alone, or
    in the caller's world). The console commands that run on every rank use it.

    Example:
        >>> with world.torchrun_world():
        ...     hw = calibrate()
    """
    created = False
    if "WORLD_SIZE" in os.environ and dist.is_available() and not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        created = True
    try:
        yield
    finally:
        if created:
            dist.destroy_process_group()
