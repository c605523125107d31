"""What a lowered program's collectives cost, as the runtime runs them: the planner's
per-axis costs (`pxform.core.layout.AxisCost`: latency per collective plus bytes), forward
and backward.

A parameter gathered whole (ZeRO-3) is gathered with the rest of its block in one packed
collective launched a block ahead (`pxform.runtime.prefetch`): its bytes count, and one
latency per block. With reshard after forward it is gathered again in backward, and its
gradient is reduce-scattered: three times its bytes, two without reshard.

Example:
    >>> comm_cost(program) < comm_cost(other)     # which of two programs moves less
"""

from __future__ import annotations

from pxform.core.ir import block_name
from pxform.core.layout import LOCAL_STEPS, AxisCost, Relayout, Step
from pxform.lower.spmd import ConvertInstr, Program


def is_gather(instr: ConvertInstr, inputs: set[str] | frozenset[str]) -> bool:
    """Does the conversion gather a program input, with nothing but all-gathers?"""
    return instr.src in inputs and gathers_only(instr.forward.steps)


def gathers_only(steps: tuple[Step, ...]) -> bool:
    """Are `steps` all-gathers, at least one (a ZeRO-3 parameter's forward)?"""
    return bool(steps) and all(s.kind == "all_gather" for s in steps)


def comm_cost(program: Program, reshard: bool = True) -> float:
    """Seconds the program's collectives take under the planner's default axis costs,
    forward and backward (module doc)."""
    cost = AxisCost()
    inputs = frozenset(v.name for v in program.inputs)
    total = 0.0
    blocks: set[tuple[str, str]] = set()
    for instr in program.instrs:
        if not isinstance(instr, ConvertInstr):
            continue
        if is_gather(instr, inputs):
            moved = sum(b for _, b in instr.forward.volume)
            total += (3 if reshard else 2) * moved * cost.seconds_per_byte
            blocks.add((block_name(instr.src), instr.forward.steps[0].axis))
            continue
        total += _cost(instr.forward, program) + _cost(instr.backward, program)
    per_block = 3 if reshard else 2  # gather, gather again, reduce-scatter
    return total + per_block * len(blocks) * cost.latency


def _cost(r: Relayout, program: Program) -> float:
    if r.cost or not r.steps:
        return r.cost
    # a re-layout made without planning (an inserted reduction): price its steps
    cost = AxisCost()
    return sum(cost.latency for s in r.steps
               if s.kind not in LOCAL_STEPS and program.mesh.axis_size(s.axis) > 1)
