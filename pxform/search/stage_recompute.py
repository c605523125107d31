"""Stage-aware recompute (Merak): in a pipeline, how many blocks each stage recomputes.

Under 1F1B the first stage holds the activations of as many microbatches as there are
stages, the last only one; recomputing the same layers everywhere wastes time on the late
stages, recomputing too few overflows the early ones. Given a per-device memory budget, this
chooses per stage the blocks to recompute so that the stage fits and recomputes as few
FLOPs as it can.

Memory of a pipeline rank during a step, estimated per stage with the search's memory
model (`pxform.cost.model.peak_bytes` and `workspace_bytes`):

    peak_bytes(parameters, their gradients, sum over blocks of (kept if recomputed else
               saved), in_flight, microbatches)
  + the largest workspace of a block: its largest op's inputs and outputs, plus its saved
    activations when it is recomputed (they are made again in backward)

`saved` is what a block's ops save for backward for one microbatch, measured by the
search's meter (`pxform.cost.model.saved_bytes_per_op`: fake tensors under saved-tensor
hooks, no memory, no device); `kept` is what a recomputed block keeps: the activations it
reads from before it. `in_flight` is the most microbatches whose forward ran and backward
did not yet, read off the schedule's actions. Blocks are chosen greedily by bytes saved per
FLOP recomputed (blocks of a stage are usually identical layers, where greedy is optimal).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pxform.core.errors import PipelineError
from pxform.core.ir import Graph, Value
from pxform.core.units import format_bytes, format_table
from pxform.cost.model import peak_bytes, requiring_grad, saved_bytes_per_op, workspace_bytes
from pxform.passes.cuts import Block
from pxform.schedules.timing import most_between


@dataclass(frozen=True)
class BlockMemory:
    """One block's activation bytes for one microbatch on one device."""

    label: str
    saved_bytes: int  # saved for backward by its ops when not recomputed
    kept_bytes: int   # kept when recomputed: the activations it reads from earlier blocks
    flops: int        # forward FLOPs: the cost of recomputing it
    transient_bytes: int = 0  # its largest op's inputs and outputs


@dataclass(frozen=True)
class StageRecompute:
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
    stages: tuple[StageRecompute, ...]

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
        lines = format_table(rows)
        head = (f"stage-aware recompute, budget {format_bytes(self.budget_bytes)} per device"
                if self.budget_bytes is not None else "recompute per stage, as given")
        return "\n".join([head, *lines])


def block_memory(graph: Graph, blocks: Sequence[Block], batch_inputs: set[str],
                 divisor: int) -> list[BlockMemory]:
    """Per block, its saved and kept bytes for one microbatch on one device: the whole
    batch's, measured on fake tensors, divided by `divisor` (microbatches x data-parallel
    ways)."""
    depends = _batch_dependent(graph, batch_inputs)
    op_block = [0] * len(graph.ops)
    for k, b in enumerate(blocks):
        for i in range(b.start, b.stop):
            op_block[i] = k
    # the search's meter (`pxform.cost.model.saved_bytes_per_op`), block by block as the
    # search measures: parameters and batch inputs are stored anyway, so not counted
    stored = {v.name for v in graph.inputs}
    # (what the step differentiates: the floating arguments that are not the batch)
    trainable = {v.name for v in graph.inputs
                 if v.name not in batch_inputs and v.type.dtype.is_floating_point}
    grads = requiring_grad(graph, trainable)
    saved = [sum(s.total for s in saved_bytes_per_op(graph, b.start, b.stop, stored, grads))
             for b in blocks]
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
        # as the search counts it: batch-dependent values per microbatch and device,
        # parameters whole
        transient = max((sum(v.type.nbytes / (divisor if v.name in depends else 1)
                             for v in (*op.inputs, *op.outputs) if hasattr(v, "type"))
                         for op in graph.ops[b.start:b.stop]), default=0.0)
        out.append(BlockMemory(b.label, math.ceil(saved[k] / divisor),
                               math.ceil(kept / divisor), b.flops, math.ceil(transient)))
    return out


def in_flight(actions: dict[int, list], num_stages: int) -> list[int]:
    """Per stage, the most microbatches whose forward has run and backward has not."""
    peak = list(most_between(actions, "F", "B"))
    return peak + [0] * (num_stages - len(peak))


def choose_recompute(blocks: Sequence[BlockMemory], block_stage: Sequence[int],
                     param_bytes: Sequence[int], flights: Sequence[int], budget: int | None,
                     fixed: Sequence[int] | None = None, fn: str = "pipeline",
                     microbatches: int = 1) -> RecomputePlan:
    """Choose the blocks each stage recomputes.

    Args:
        blocks, block_stage: the blocks and the stage of each.
        param_bytes, flights: per stage, its parameter bytes and in-flight microbatches.
        budget: bytes per device; None with `fixed`.
        fixed: per stage, recompute its first `fixed[s]` blocks instead of choosing.
        microbatches: per step (with `flights`, when the peak comes: `peak_bytes`).

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
                if _estimate(mine, flags, param_bytes[s], flights[s], microbatches) <= budget:
                    break
                flags[k] = True
            need = _estimate(mine, flags, param_bytes[s], flights[s], microbatches)
            if need > budget:
                raise PipelineError(
                    f"pxform.{fn}: stage {s} needs about {format_bytes(need)} per device even "
                    f"recomputing all of its {len(mine)} blocks ({format_bytes(param_bytes[s])} "
                    f"of parameters, their gradients, and {flights[s]} microbatches in "
                    f"flight), more than memory_budget={format_bytes(budget)}.\n  Fix: use "
                    f"more stages or more microbatches (smaller ones), shard the stage "
                    f"(pxform.shard), or raise the budget.")
        stages.append(StageRecompute(s, tuple(mine), tuple(flags), param_bytes[s], flights[s],
                                _estimate(mine, flags, param_bytes[s], flights[s], microbatches)))
    return RecomputePlan(budget, tuple(stages))


def _estimate(blocks: Sequence[BlockMemory], flags: Sequence[bool], params: int,
              flight: int, microbatches: int) -> int:
    """The stage's peak per device: the search's memory model over the stage's blocks
    (parameters and their gradients; no optimizer state: it lives outside the step)."""
    held = sum(b.kept_bytes if r else b.saved_bytes for b, r in zip(blocks, flags))
    work = max((workspace_bytes(b.transient_bytes, b.saved_bytes, r)
                for b, r in zip(blocks, flags)), default=0.0)
    return math.ceil(peak_bytes(params, params, held, flight, microbatches) + work)


def _batch_dependent(graph: Graph, batch_inputs: set[str]) -> set[str]:
    out = set(batch_inputs)
    for op in graph.ops:
        if any(v.name in out for v in op.inputs):
            out.update(v.name for v in op.outputs)
    return out
