"""Measure a training step on every rank: step time and peak memory, to check a plan.

`measure(step, *args, optimizer=opt)` runs `pxform.value_and_grad(step)(*args)` a few times
on every rank of the world (it is pure: parameters and optimizer are not touched), and
gathers per rank

* the step time: the wall time of one `value_and_grad` call (forward, backward and the
  gradient collectives, which is what a plan's `step_time_s` predicts; the optimizer
  update is not part of it), each call after a barrier, the median over `steps` calls
  after `warmup` untimed ones;
* the peak memory: one more call under `pxform.MemoryMeter` with the arguments as
  baseline (parameters, batch: this rank's local pieces; for a pipelined `pxform.auto`
  plan only those `step.holds`, its stages' own: the copies of other stages' parameters a
  rank may keep are never read, and the plan does not need them), plus the bytes of the
  optimizer's state on this rank (Adam's two moments), which live between steps and which
  a plan counts in its 16 bytes per parameter. The metered call is not timed (the meter's
  dispatch mode slows every op).

`plan.report(measured)` (`pxform.search.report`) sets the figures beside the plan's predictions.

Example:
    >>> measured = pxform.measure(step, params, batch, optimizer=opt)
    >>> print(step.plan(params, batch).report(measured))
"""

from __future__ import annotations

import time
from typing import Any

import torch

from pxform.core.errors import PxformError
from pxform.runtime import world
from pxform.runtime.boundary import is_dtensor
from pxform.runtime.graph_module import synchronize
from pxform.search.report import Measured, RankMeasure
from pxform.tools.memory import MemoryMeter, tensors_of
from pxform.transforms.auto import Auto
from pxform.transforms.grad import value_and_grad

__all__ = ["Measured", "RankMeasure", "measure"]


def measure(step: Any, *args: Any, optimizer: torch.optim.Optimizer | None = None,
            steps: int = 3, warmup: int = 1, argnums: int | tuple[int, ...] = 0) -> Measured:
    """Time and meter `pxform.value_and_grad(step, argnums)(*args)` on every rank (module
    doc). Every rank of the world must call it, with the arguments it trains with (e.g.
    the DTensors of `step.distribute`).

    Args:
        step: what the training loop differentiates (a `pxform.auto` function, or any
            function `pxform.value_and_grad` accepts).
        optimizer: its state's bytes on this rank count in the peak.
        steps: timed calls per rank (the median counts); warmup: untimed calls first.

    Example:
        >>> measured = pxform.measure(step, params, batch, optimizer=opt, steps=5)
        >>> measured.step_time_s, measured.peak_memory_bytes
    """
    if steps < 1 or warmup < 0:
        raise PxformError(f"pxform.measure({_name(step)}): steps={steps}, warmup={warmup}; "
                          f"give steps >= 1 and warmup >= 0.")
    run = value_and_grad(step, argnums)
    device = _device(args)
    times: list[float] = []
    for k in range(warmup + steps):
        world.barrier()
        synchronize(device)
        start = time.perf_counter()
        result = run(*args)
        synchronize(device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
        del result
    world.barrier()
    tracked = _held(step, args)
    with MemoryMeter(device) as meter:
        meter.track(tracked)  # DTensors count by their local pieces
        result = run(*args)
    del result
    stats = meter.stats
    state = _state_bytes(optimizer)
    mine = RankMeasure(stats.rank, tuple(times), stats.peak_bytes + state, stats.saved_bytes,
                       state, str(device))
    ranks = tuple(sorted(world.gather_objects(mine), key=lambda r: r.rank))
    return Measured(_name(step), ranks)


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", "fn")


def _device(args: Any) -> torch.device:
    """The CUDA device of the first CUDA tensor in `args` (DTensors opened), else the CPU."""
    for t in tensors_of(args):
        if t.device.type == "cuda":
            return t.device
    return torch.device("cpu")


def _state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the tensors in the optimizer's per-parameter state, local pieces only
    (scalars such as Adam's step count too: they are tensors)."""
    if optimizer is None:
        return 0
    seen: set[int] = set()
    total = 0
    for local in tensors_of(list(optimizer.state.values())):
        key = local.untyped_storage().data_ptr()
        if key in seen and key != 0:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def _held(step: Any, args: tuple[Any, ...]) -> list[Any]:
    """The leaves of `args` this rank computes with: for `pxform.auto` those its
    `holds` names (a pipeline stage's own), otherwise all."""
    import optree

    leaves = optree.tree_leaves(args, is_leaf=is_dtensor, none_is_leaf=True)  # type: ignore[arg-type]
    if not isinstance(step, Auto):
        return leaves
    flags = optree.tree_leaves(step.holds(*args), none_is_leaf=True)  # type: ignore[arg-type]
    return [leaf for leaf, held in zip(leaves, flags, strict=True) if held]
