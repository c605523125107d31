"""ZeRO-3's parameter all-gathers, grouped per block and prefetched one block ahead
(FSDP2's per-module all-gather with forward and backward prefetch).

A program gathers a parameter where an op needs it whole (`Convert.gathers`). Those
conversions ("sites") are grouped per block: consecutive sites, in program order, whose
parameters belong to the same block of the model. A parameter's block is read off its
pytree path: the path up to its first list index (`blocks.3.fc_w` -> `blocks.3`,
`model.layers.7.mlp.up_proj.weight` -> `model.layers.7`); parameters outside any list
(embeddings, final norm) form the root group wherever they are read. One group's shards
go out as one packed all-gather (`buckets.start_gather`).

Forward: the first site of group g waits for g's all-gather and launches g + 1's, so one
block's gather runs while the block before computes, and at most two blocks are gathered
at a time. Backward (with reshard after forward, `pxform.runtime.reshard`): the first
saved weight of group g that backward needs gathers every saved weight of g at once and
launches the gather of the group before it, in the order backward runs, which is the same
on every rank.

Example:
    >>> plan = gather_plan(program)              # once per program
    >>> state = Prefetch(plan, axes, inputs)     # once per call, read by `Convert`
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pxform.core.ir import block_name
from pxform.core.layout import Step
from pxform.lower.comm import is_gather
from pxform.lower.spmd import ConvertInstr, Program
from pxform.runtime.buckets import finish_gather, start_gather
from pxform.runtime.collectives import AxisGroups


@dataclass(frozen=True)
class GatherPlan:
    """The gather sites of a program, grouped: `groups[g]` lists sites in program order;
    per site, its group, its block (`""`: the root), its program input and its steps."""

    groups: tuple[tuple[int, ...], ...]
    group_of: tuple[int, ...]
    block_of: tuple[str, ...]
    input_of: tuple[int, ...]
    steps: tuple[tuple[Step, ...], ...]
    sites: tuple[tuple[str, int], ...]  # (conversion destination name, site), for `build`
    casts: tuple[torch.dtype | None, ...] = ()  # mixed precision: the dtype each is gathered in

    def site_of(self) -> dict[str, int]:
        """{conversion destination name: site} (how `build` numbers its `Convert`s)."""
        return dict(self.sites)


def gather_plan(program: Program) -> GatherPlan:
    """The program's gather sites, in order, grouped per block (cached on the program)."""
    found = program.__dict__.get("_gather_plan")
    if found is not None:
        return found
    position = {v.name: k for k, v in enumerate(program.inputs)}
    groups: list[list[int]] = []
    group_of: list[int] = []
    block_of: list[str] = []
    input_of: list[int] = []
    steps: list[tuple[Step, ...]] = []
    names: list[tuple[str, int]] = []
    casts: list[torch.dtype | None] = []
    last: tuple[object, ...] | None = None
    inputs = frozenset(position)
    for instr in program.instrs:
        if not (isinstance(instr, ConvertInstr) and is_gather(instr, inputs)):
            continue
        site = len(group_of)
        block = block_name(instr.src)
        # one packed collective per group: same block, first step and dtype
        key = (block, instr.forward.steps[0], instr.dst.type.dtype)
        if key != last:
            groups.append([])
            last = key
        groups[-1].append(site)
        group_of.append(len(groups) - 1)
        block_of.append(block)
        input_of.append(position[instr.src])
        steps.append(instr.forward.steps)
        names.append((instr.dst.name, site))
        casts.append(instr.cast)
    plan = GatherPlan(tuple(map(tuple, groups)), tuple(group_of), tuple(block_of),
                      tuple(input_of), tuple(steps), tuple(names), tuple(casts))
    program.__dict__["_gather_plan"] = plan  # frozen dataclass: no __setattr__
    return plan


class Prefetch:
    """One call's forward gathers: what is in flight and what is gathered, per site.

    Example:
        >>> prefetch = Prefetch(gather_plan(program), axes, inputs)
        >>> full = prefetch.take(site)    # from `Convert`, in program order
    """

    def __init__(self, plan: GatherPlan, axes: AxisGroups,
                 inputs: Sequence[torch.Tensor]) -> None:
        self.plan = plan
        self.axes = axes
        self.inputs = inputs
        self.pending: dict[int, tuple[torch.Tensor, list[tuple[int, ...]]]] = {}
        self.ready: dict[int, torch.Tensor] = {}
        self.taken: set[int] = set()
        self.launched: set[int] = set()
        self.gathers = 0  # packed all-gathers launched (read by tests)

    def take(self, site: int) -> torch.Tensor | None:
        """The gathered parameter of `site`, from its group's packed gather; launches the
        next group's gather first. None for a site taken already in this call (a
        recompute region running again in backward): it gathers on its own."""
        if site in self.taken:
            return None
        self.taken.add(site)
        g = self.plan.group_of[site]
        self._launch(g)
        self._launch(g + 1)  # prefetch: overlaps this block's compute
        if g in self.pending:
            pending, shapes = self.pending.pop(g)
            sites = self.plan.groups[g]
            steps = [self.plan.steps[s] for s in sites]
            self.ready.update(zip(sites, finish_gather(pending, steps, shapes, self.axes)))
        return self.ready.pop(site)

    def _launch(self, g: int) -> None:
        if g >= len(self.plan.groups) or g in self.launched:
            return
        self.launched.add(g)
        sites = self.plan.groups[g]
        shards = [self._shard(s) for s in sites]
        first = [self.plan.steps[s][0] for s in sites]
        self.pending[g] = (start_gather(shards, first, self.axes),
                           [tuple(t.shape) for t in shards])
        self.gathers += 1

    def _shard(self, site: int) -> torch.Tensor:
        """The local shard `site` gathers (cast first under mixed precision: ZeRO-3
        gathers half the bytes in bfloat16, as FSDP2 does)."""
        shard = self.inputs[self.plan.input_of[site]].detach()
        cast = self.plan.casts[site] if self.plan.casts else None
        return shard if cast is None else shard.to(cast)
