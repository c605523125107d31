"""ZeRO-3's reshard after forward: a gathered parameter is freed once its forward use is
done and gathered again when backward needs it (FSDP2's `reshard_after_forward`).

Autograd keeps every tensor an op saves for backward; a linear layer saves its weight, so
without this every weight a ZeRO-3 program gathers stays whole from forward to backward
and a rank ends up holding the whole model. Here a `Convert` that gathers a parameter
records its output (`note_gathered`); while the program's forward runs under
`reshard_after_forward()`, saved-tensor hooks replace such a tensor (or a view of it, as
`linear` saves `w.t()` in some paths) by a small handle holding the shard and the steps;
backward unpacks it by gathering again. Activations and everything else are saved as usual.

Gathering again runs the same collectives in backward on every rank, in the order the
backward graph runs, which is the same everywhere.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from pxform.core.layout import Step
from pxform.runtime.collectives import AxisGroups, run_steps

_REGISTRY: contextvars.ContextVar[dict[int, _Gathered] | None] = contextvars.ContextVar(
    "pxform_gathered", default=None)


@dataclass(frozen=True)
class _Gathered:
    """A parameter gathered in forward: how to gather it again."""

    ref: Any  # weakref to the gathered tensor: the registry must not keep it alive
    shard: torch.Tensor
    steps: tuple[Step, ...]
    axes: AxisGroups


@dataclass(frozen=True)
class _Handle:
    """What autograd keeps instead of a gathered parameter (or a view of one)."""

    gathered: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    whole: bool


def note_gathered(out: torch.Tensor, shard: torch.Tensor, steps: tuple[Step, ...],
                  axes: AxisGroups) -> None:
    """Record that `out` is `shard` gathered by `steps` (called by `Convert`); a no-op
    outside `reshard_after_forward()`."""
    registry = _REGISTRY.get()
    if registry is not None:
        registry[id(out)] = _Gathered(weakref.ref(out), shard.detach(), steps, axes)


def _pack(t: torch.Tensor) -> Any:
    registry = _REGISTRY.get()
    if registry is None:
        return t
    base = t._base if t._base is not None else t
    g = registry.get(id(base))
    if g is None or g.ref() is not base:
        return t
    return _Handle(g, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()), t is base)


def _unpack(saved: Any) -> torch.Tensor:
    if not isinstance(saved, _Handle):
        return saved
    g = saved.gathered
    with torch.no_grad():
        full = run_steps(g.shard, g.steps, g.axes)
    if saved.whole:
        return full
    return full.as_strided(saved.size, saved.stride, saved.offset)


@contextlib.contextmanager
def reshard_after_forward(enabled: bool = True) -> Iterator[None]:
    """Run a program's forward so that the parameters it gathers are not kept for
    backward (module doc). With `enabled=False`, nothing changes.

    Example:
        >>> with with_groups(axes, buckets), reshard_after_forward():
        ...     outs = module_of(program)(*inputs)
    """
    if not enabled:
        yield
        return
    token = _REGISTRY.set({})
    try:
        # the hooks must outlive the registry's use: they run during forward only (pack);
        # unpack needs nothing but the handle
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _REGISTRY.reset(token)
