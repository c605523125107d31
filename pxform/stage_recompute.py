"""Stage-aware recompute (Merak): in a pipeline, how many blocks each stage recomputes.

Under 1F1B the first stage holds the activations of as many microbatches as there are
stages, the last only one; recomputing the same layers everywhere wastes time on the late
stages, recomputing too few overflows the early ones. Given a per-device memory budget, this
chooses per stage the blocks to recompute so that the stage fits and recomputes as few
FLOPs as it can.

Memory of a pipeline rank during a step, estimated per stage from the graph:

    parameters + their gradients                      (the stage's parameter bytes x 2)
  + in_flight x sum over blocks of (kept if recomputed else saved)
  + workspace: 2 x the largest block's saved bytes    (one block's activations brought
                                                       back, and its gradients, in backward)

`saved` is what a block's ops save for backward for one microbatch, measured by running the
graph on fake tensors under saved-tensor hooks (no memory, no device); `kept` is what a
recomputed block keeps: the activations it reads from before it. `in_flight` is the most
microbatches whose forward ran and backward did not yet, read off the schedule's actions.
Blocks are chosen greedily by bytes saved per FLOP recomputed (blocks of a stage are
usually identical layers, where greedy is optimal). The search (issue 6) will use the same
numbers with its cost model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pxform.cuts import Block
from pxform.errors import PipelineError
from pxform.ir import Graph, Op, Value
from pxform.regions import RECOMPUTE, Policy, RecomputeTag
from pxform.trace import run_graph
from pxform.units import format_bytes

WORKSPACE_BLOCKS = 2
"""Blocks' worth of saved bytes alive on top of the in-flight activations during backward:
the block being recomputed, and the gradients flowing through it."""


@dataclass(frozen=True)
class BlockMemory:
    """One block's activation bytes for one microbatch on one device."""

    label: str
    saved_bytes: int  # saved for backward by its ops when not recomputed
    kept_bytes: int   # kept when recomputed: the activations it reads from earlier blocks
    flops: int        # forward FLOPs: the cost of recomputing it


@dataclass(frozen=True)
class StagePlan:
    stage: int
    blocks: tuple[BlockMemory, ...]
    recompute: tuple[bool, ...]
    param_bytes: int
    in_flight: int
    estimate_bytes: int

    @property
    def num_recomputed(self) -> int:
        return sum(self.recompute)


@dataclass(frozen=True)
class RecomputePlan:
    """Which blocks each pipeline stage recomputes, and the memory that leaves.

    Example:
        >>> print(step.recompute_plan(params, batch))
        stage  in flight  recompute        estimate
        0      4          3 of 4 blocks    1.2 GiB
        ...
    """

    budget_bytes: int | None
    stages: tuple[StagePlan, ...]

    @property
    def counts(self) -> tuple[int, ...]:
        return tuple(s.num_recomputed for s in self.stages)

    def __str__(self) -> str:
        rows = [("stage", "in flight", "recompute", "estimate")]
        for s in self.stages:
            names = [b.label for b, r in zip(s.blocks, s.recompute) if r]
            what = f"{s.num_recomputed} of {len(s.blocks)} blocks" + (
                f" ({', '.join(names)})" if names else "")
            rows.append((str(s.stage), str(s.in_flight), what, format_bytes(s.estimate_bytes)))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        head = (f"stage-aware recompute, budget {format_bytes(self.budget_bytes)} per device"
                if self.budget_bytes is not None else "recompute per stage, as given")
        return "\n".join([head, *lines])


def block_memory(graph: Graph, blocks: Sequence[Block], batch_inputs: set[str],
                 divisor: int) -> list[BlockMemory]:
    """Per block, its saved and kept bytes for one microbatch on one device: the whole
    batch's, measured on fake tensors, divided by `divisor` (microbatches x data-parallel
    ways)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    depends = _batch_dependent(graph, batch_inputs)
    with mode:
        inputs = [torch.empty(v.type.shape, dtype=v.type.dtype).requires_grad_(
                  v.name not in batch_inputs and v.type.dtype.is_floating_point)
                  for v in graph.inputs]
    input_storages = {id(t.untyped_storage()) for t in inputs}
    op_block = [0] * len(graph.ops)
    for k, b in enumerate(blocks):
        for i in range(b.start, b.stop):
            op_block[i] = k
    saved = [0] * len(blocks)
    seen: dict[int, object] = {}  # storage id -> storage (kept alive so ids stay unique)
    pending: list[tuple[int, int]] = []
    index = {id(op): k for k, op in enumerate(graph.ops)}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = id(storage)
        if key not in seen and key not in input_storages:
            seen[key] = storage
            pending.append((key, storage.nbytes()))
        return t

    def on_op(op: Op, args: object, results: object) -> None:
        k = op_block[index[id(op)]]
        saved[k] += sum(n for _, n in pending)
        pending.clear()

    with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_graph(graph, inputs, on_op=on_op)
    out = []
    defined_in: dict[str, int] = {v.name: op_block[k] for k, op in enumerate(graph.ops)
                                  for v in op.outputs}
    for k, b in enumerate(blocks):
        reads: dict[str, Value] = {}
        for op in graph.ops[b.start:b.stop]:
            for v in op.inputs:
                if defined_in.get(v.name, k) < k and v.name in depends:
                    reads[v.name] = v
        kept = sum(v.type.nbytes for v in reads.values())
        out.append(BlockMemory(b.label, math.ceil(saved[k] / divisor),
                               math.ceil(kept / divisor), b.flops))
    return out


def in_flight(actions: dict[int, list], num_stages: int) -> list[int]:
    """Per stage, the most microbatches whose forward has run and backward has not."""
    peak = [0] * num_stages
    for acts in actions.values():
        live = [0] * num_stages
        for a in acts:
            if a is None:
                continue
            if a.kind == "F":
                live[a.stage] += 1
                peak[a.stage] = max(peak[a.stage], live[a.stage])
            elif a.kind == "B":
                live[a.stage] -= 1
    return peak


def plan(blocks: Sequence[BlockMemory], block_stage: Sequence[int], param_bytes: Sequence[int],
         flights: Sequence[int], budget: int | None, fixed: Sequence[int] | None = None,
         fn: str = "pipeline") -> RecomputePlan:
    """Choose the blocks each stage recomputes.

    Args:
        blocks, block_stage: the blocks and the stage of each.
        param_bytes, flights: per stage, its parameter bytes and in-flight microbatches.
        budget: bytes per device; None with `fixed`.
        fixed: per stage, recompute its first `fixed[s]` blocks instead of choosing.

    Raises:
        PipelineError: a stage does not fit the budget even recomputing every block.
    """
    stages = []
    for s in range(len(param_bytes)):
        mine = [b for b, st in zip(blocks, block_stage) if st == s]
        if fixed is not None:
            n = min(fixed[s], len(mine))
            flags = [k < n for k in range(len(mine))]
        else:
            assert budget is not None
            flags = [False] * len(mine)
            order = sorted(range(len(mine)), key=lambda k: (
                -(mine[k].saved_bytes - mine[k].kept_bytes) / max(mine[k].flops, 1), k))
            for k in order:
                if _estimate(mine, flags, param_bytes[s], flights[s]) <= budget:
                    break
                flags[k] = True
            need = _estimate(mine, flags, param_bytes[s], flights[s])
            if need > budget:
                raise PipelineError(
                    f"pxform.{fn}: stage {s} needs about {format_bytes(need)} per device even "
                    f"recomputing all of its {len(mine)} blocks ({format_bytes(param_bytes[s])} "
                    f"of parameters, their gradients, and {flights[s]} microbatches in "
                    f"flight), more than memory_budget={format_bytes(budget)}.\n  Fix: use "
                    f"more stages or more microbatches (smaller ones), shard the stage "
                    f"(pxform.shard), or raise the budget.")
        stages.append(StagePlan(s, tuple(mine), tuple(flags), param_bytes[s], flights[s],
                                _estimate(mine, flags, param_bytes[s], flights[s])))
    return RecomputePlan(budget, tuple(stages))


def _estimate(blocks: Sequence[BlockMemory], flags: Sequence[bool], params: int,
              flight: int) -> int:
    held = sum(b.kept_bytes if r else b.saved_bytes for b, r in zip(blocks, flags))
    work = max((b.saved_bytes for b in blocks), default=0) * WORKSPACE_BLOCKS
    return 2 * params + flight * held + work


def tag_blocks(graph: Graph, blocks: Sequence[Block], recompute: Sequence[bool],
               fn: str) -> Graph:
    """`graph` with the ops of every chosen block in a recompute region of its own (ops
    already in a user's region keep theirs: user transforms are constraints)."""
    start = 1 + max((op.tag(RECOMPUTE).region for op in graph.ops
                     if op.tag(RECOMPUTE) is not None), default=-1)
    ops = list(graph.ops)
    for k, (b, flag) in enumerate(zip(blocks, recompute)):
        if not flag:
            continue
        tag = RecomputeTag(start + k, Policy(), f"{fn} {b.label}")
        for i in range(b.start, b.stop):
            if ops[i].tag(RECOMPUTE) is None:
                tags = tuple(sorted((*ops[i].tags, (RECOMPUTE, tag)), key=lambda kv: kv[0]))
                ops[i] = ops[i].replace(tags=tags)
    return graph.replace(ops=tuple(ops))


def _batch_dependent(graph: Graph, batch_inputs: set[str]) -> set[str]:
    out = set(batch_inputs)
    for op in graph.ops:
        if any(v.name in out for v in op.inputs):
            out.update(v.name for v in op.outputs)
    return out
