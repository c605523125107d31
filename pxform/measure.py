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

`plan.report(measured)` (`pxform.report`) sets the figures beside the plan's predictions.

Example:
    >>> measured = pxform.measure(step, params, batch, optimizer=opt)
    >>> print(step.plan(params, batch).report(measured))
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from pxform.errors import PxformError
from pxform.memory import MemoryMeter, _tensors

__all__ = ["Measured", "RankMeasure", "measure"]


@dataclass(frozen=True)
class RankMeasure:
    """One rank's figures (times in seconds, bytes).

    Attributes:
        rank: the global rank.
        step_times_s: the timed `value_and_grad` calls, in order.
        peak_memory_bytes: metered peak of a call (arguments included) + `state_bytes`.
        activation_bytes: of which saved for backward (`MemoryStats.saved_bytes`).
        state_bytes: the optimizer's state on this rank (0 without an optimizer).
        device: "cpu" or the CUDA device measured.
    """

    rank: int
    step_times_s: tuple[float, ...]
    peak_memory_bytes: int
    activation_bytes: int
    state_bytes: int
    device: str

    @property
    def step_time_s(self) -> float:
        """The median timed call."""
        return statistics.median(self.step_times_s)


@dataclass(frozen=True)
class Measured:
    """Every rank's measurement of one function's training step (`measure`)."""

    function: str
    ranks: tuple[RankMeasure, ...]  # by rank

    @property
    def step_time_s(self) -> float:
        """A step lasts as long as its slowest rank: the largest median."""
        return max(r.step_time_s for r in self.ranks)

    @property
    def peak_memory_bytes(self) -> int:
        """The largest peak over the ranks."""
        return max(r.peak_memory_bytes for r in self.ranks)


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
    from pxform.transforms.grad import value_and_grad

    if steps < 1 or warmup < 0:
        raise PxformError(f"pxform.measure({_name(step)}): steps={steps}, warmup={warmup}; "
                          f"give steps >= 1 and warmup >= 0.")
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized()
    run = value_and_grad(step, argnums)
    device = _device(args)
    times: list[float] = []
    for k in range(warmup + steps):
        if distributed:
            dist.barrier()
        _sync(device)
        start = time.perf_counter()
        result = run(*args)
        _sync(device)
        if k >= warmup:
            times.append(time.perf_counter() - start)
        del result
    if distributed:
        dist.barrier()
    tracked = _held(step, args)
    with MemoryMeter(device) as meter:
        meter.track(tracked)  # DTensors count by their local pieces
        result = run(*args)
    del result
    stats = meter.stats
    state = _state_bytes(optimizer)
    mine = RankMeasure(stats.rank, tuple(times), stats.peak_bytes + state, stats.saved_bytes,
                       state, str(device))
    if distributed:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        ranks = tuple(sorted(gathered, key=lambda r: r.rank))
    else:
        ranks = (mine,)
    return Measured(_name(step), ranks)


def _name(fn: Any) -> str:
    return getattr(fn, "__name__", "fn")


def _device(args: Any) -> torch.device:
    """The CUDA device of the first CUDA tensor in `args` (DTensors opened), else the CPU."""
    for t in _tensors(args):
        if t.device.type == "cuda":
            return t.device
    return torch.device("cpu")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _state_bytes(optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the tensors in the optimizer's per-parameter state, local pieces only
    (scalars such as Adam's step count too: they are tensors)."""
    if optimizer is None:
        return 0
    seen: set[int] = set()
    total = 0
    for local in _tensors(list(optimizer.state.values())):
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

    from pxform.transforms.auto import Auto
    from pxform.transforms.shard import _is_dtensor

    leaves = optree.tree_leaves(args, is_leaf=_is_dtensor, none_is_leaf=True)  # type: ignore[arg-type]
    if not isinstance(step, Auto):
        return leaves
    flags = optree.tree_leaves(step.holds(*args), none_is_leaf=True)  # type: ignore[arg-type]
    return [leaf for leaf, held in zip(leaves, flags, strict=True) if held]
