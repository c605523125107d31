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
backward graph runs, which is the same everywhere. Parameters gathered per block
(`pxform.runtime.prefetch`) are gathered again per block: the first saved weight of a
block that backward unpacks gathers all of the block's saved weights in one packed
all-gather and launches the block before it (backward prefetch); each gathered weight is
dropped once its last saved use is unpacked.
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
from pxform.runtime.buckets import finish_gather, start_gather
from pxform.runtime.collectives import AxisGroups, run_steps

_REGISTRY: contextvars.ContextVar[dict[int, _Gathered] | None] = contextvars.ContextVar(
    "pxform_gathered", default=None)
_REGATHER: contextvars.ContextVar[Regather | None] = contextvars.ContextVar(
    "pxform_regather", default=None)
# the blocks (`pxform.core.ir.block_name`) and parameters (pytree paths) that reshard,
# None: every one
_BLOCKS: contextvars.ContextVar[frozenset[str] | None] = contextvars.ContextVar(
    "pxform_reshard_blocks", default=None)

# Which parameters reshard after forward: all (True), none (False), or those of the named
# blocks and parameters (the choice is per block, as FSDP2's is per module, or per
# parameter, as `pxform.auto`'s plans make it per block of the search)
Reshard = bool | frozenset[str]


def reshard_when(reshard: Reshard, condition: bool) -> Reshard:
    """`reshard` where `condition` holds, else False (a forward without backward keeps
    nothing, so it has nothing to reshard)."""
    return reshard if condition else False


@dataclass(frozen=True, eq=False)
class _Gathered:
    """A parameter gathered in forward: how to gather it again, and its block's group
    (None: gathered on its own)."""

    ref: Any  # weakref to the gathered tensor: the registry must not keep it alive
    shard: torch.Tensor
    steps: tuple[Step, ...]
    axes: AxisGroups
    group: int | None = None
    regather: Regather | None = None
    cast: torch.dtype | None = None  # mixed precision: the shard is gathered in this dtype

    def cast_shard(self) -> torch.Tensor:
        """The shard as it is gathered (cast to the compute dtype when there is one)."""
        return self.shard if self.cast is None else self.shard.to(self.cast)


class Regather:
    """One call's backward gathers, per group: which gathered weights autograd saved
    (and how many times), the weights gathered again and not yet used up, and the group
    in flight (backward prefetch).

    It holds the saved weights' records weakly: each record holds it (`_Gathered.regather`),
    and records held back made a reference cycle per ZeRO-3 call that kept them, and the
    parameter shards they hold, alive until Python's cycle collector ran (35 records of
    GPT small's step on each rank, 2026-11-29): a training loop that makes new parameters
    every step kept the last steps' shards besides."""

    def __init__(self) -> None:
        self.members: dict[int, list[weakref.ref[_Gathered]]] = {}
        self.uses: dict[int, int] = {}  # id(_Gathered) -> saved uses not yet unpacked
        self.full: dict[int, torch.Tensor] = {}
        self.pending: dict[int, tuple[torch.Tensor, list[_Gathered]]] = {}
        self.done: set[int] = set()
        self.gathers = 0  # packed all-gathers launched in backward (read by tests)

    def saved(self, g: _Gathered) -> None:
        assert g.group is not None
        if id(g) not in self.uses:
            self.members.setdefault(g.group, []).append(weakref.ref(g))
            self.uses[id(g)] = 0
        self.uses[id(g)] += 1

    def get(self, g: _Gathered) -> torch.Tensor:
        """`g` gathered again: with the rest of its group, at the group's first use."""
        assert g.group is not None
        if id(g) not in self.full:
            self._launch(g.group)
            earlier = [k for k in self.members if k < g.group and k not in self.done]
            if earlier:
                self._launch(max(earlier))  # the block backward reaches next
            pending, members = self.pending.pop(g.group)
            shapes = [tuple(m.shard.shape) for m in members]
            gathered = finish_gather(pending, [m.steps for m in members], shapes, g.axes)
            self.full.update((id(m), full) for m, full in zip(members, gathered))
        full = self.full[id(g)]
        self.uses[id(g)] -= 1
        if self.uses[id(g)] == 0:  # its last saved use: free it
            del self.full[id(g)]
        return full

    def _launch(self, group: int) -> None:
        if group in self.done:
            return
        self.done.add(group)
        # (those whose saved uses autograd dropped unread are gone: nothing asks for them)
        members = [m for m in (ref() for ref in self.members[group]) if m is not None]
        if not members:
            return
        self.pending[group] = (start_gather([m.cast_shard() for m in members],
                                            [m.steps[0] for m in members], members[0].axes),
                               members)
        self.gathers += 1


@dataclass(frozen=True)
class _Handle:
    """What autograd keeps instead of a gathered parameter (or a view of one)."""

    gathered: _Gathered
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    whole: bool


def note_gathered(out: torch.Tensor, shard: torch.Tensor, steps: tuple[Step, ...],
                  axes: AxisGroups, group: int | None = None,
                  names: tuple[str, str] = ("", ""),
                  cast: torch.dtype | None = None) -> None:
    """Record that `out` is `shard` (cast to `cast`, if given) gathered by `steps` (called
    by `Convert`), with the block group it was gathered with (None: alone) and `names`, its
    block's name and its own path; a no-op outside `reshard_after_forward()` and for
    parameters it names neither of."""
    registry = _REGISTRY.get()
    blocks = _BLOCKS.get()
    if registry is not None and (blocks is None or not blocks.isdisjoint(names)):
        # a gather computed ahead (prefetch) comes out of its autograd function as a view
        # of the gathered tensor: what autograd saves are views of that base
        base = out._base if out._base is not None else out
        regather = _REGATHER.get() if group is not None else None
        registry[id(base)] = _Gathered(weakref.ref(base), shard.detach(), steps, axes,
                                       group if regather is not None else None, regather,
                                       cast)


def _pack(t: torch.Tensor) -> Any:
    registry = _REGISTRY.get()
    if registry is None:
        return t
    base = t._base if t._base is not None else t
    g = registry.get(id(base))
    if g is None or g.ref() is not base:
        return t
    if g.regather is not None:
        g.regather.saved(g)
    return _Handle(g, tuple(t.size()), tuple(t.stride()), int(t.storage_offset()), t is base)


def _unpack(saved: Any) -> torch.Tensor:
    if not isinstance(saved, _Handle):
        return saved
    g = saved.gathered
    with torch.no_grad():
        full = (g.regather.get(g) if g.regather is not None
                else run_steps(g.cast_shard(), g.steps, g.axes))
    if saved.whole:
        return full
    return full.as_strided(saved.size, saved.stride, saved.offset)


@contextlib.contextmanager
def reshard_after_forward(enabled: Reshard = True) -> Iterator[None]:
    """Run a program's forward so that the parameters it gathers are not kept for
    backward (module doc). With `enabled=False`, nothing changes; with a set of block
    names and parameter paths, only the parameters of those blocks and those named
    reshard.

    Example:
        >>> with with_groups(axes, buckets), reshard_after_forward():
        ...     outs = module_of(program)(*inputs)
    """
    if not enabled:
        yield
        return
    token = _REGISTRY.set({})
    regather = _REGATHER.set(Regather())
    blocks = _BLOCKS.set(None if enabled is True else frozenset(enabled))
    try:
        # the hooks must outlive the registry's use: they run during forward only (pack);
        # unpack needs nothing but the handle
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        _BLOCKS.reset(blocks)
        _REGATHER.reset(regather)
        _REGISTRY.reset(token)
