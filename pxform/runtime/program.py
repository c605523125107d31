"""Running a lowered `Program` on this rank's local tensors, with autograd."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pxform.ir import DEVICE, Value, map_values
from pxform.lower.spmd import CallInstr, ConvertInstr, Program
from pxform.runtime.collectives import AxisGroups, all_reduce_sum, convert


def execute(program: Program, inputs: Sequence[torch.Tensor], axes: AxisGroups) -> list[Any]:
    """Evaluate `program` on local input shards; returns local outputs."""
    device = inputs[0].device if inputs else torch.device("cpu")
    env: dict[str, Any] = {v.name: t for v, t in zip(program.inputs, inputs)}
    for c in program.constants:
        env[c.value.name] = c.data.to(device)
    for instr in program.instrs:
        if isinstance(instr, ConvertInstr):
            env[instr.dst.name] = convert(env[instr.src], instr.forward.steps,
                                          instr.backward.steps, axes)
            continue
        assert isinstance(instr, CallInstr)
        local = dict(instr.inputs)

        def resolve(a: Any, local: dict[str, str] = local) -> Any:
            a = map_values(a, lambda v: env[local[v.name]])
            return device if a is DEVICE else a

        call = instr.call
        with torch.set_grad_enabled(instr.op.grad and torch.is_grad_enabled()):
            result = call.target(*[resolve(a) for a in call.args],
                                 **{k: resolve(a) for k, a in call.kwargs})
            results = [r for r in (result if isinstance(result, (list, tuple)) else [result])
                       if isinstance(r, torch.Tensor)]
            if call.scale != 1.0:
                results = [r * call.scale for r in results]
            if call.count is not None:
                results = [r / _global_count(instr, env, local, axes) for r in results]
        for out, r in zip(instr.outputs, results):
            env[out.name] = r
    return [env[o.name] if isinstance(o, Value) else o for o in program.outputs]


def _global_count(instr: CallInstr, env: dict[str, Any], local: dict[str, str],
                  axes: AxisGroups) -> torch.Tensor:
    """Targets that count toward a mean loss, summed over the ranks that split the batch."""
    from pxform.ops import bind

    spec = instr.call.count
    assert spec is not None
    args = bind(instr.op)
    target = env[local[args["target"].name]]
    keep = target != spec.ignore_index
    with torch.no_grad():
        if spec.weighted:
            weight = env[local[args["weight"].name]].detach()
            count = (weight[target.clamp(min=0)] * keep).sum()
        else:
            count = keep.sum().to(torch.float64)
        count = all_reduce_sum(count.reshape(1), spec.axes, axes).reshape(())
    return count.to(env[local[args["self"].name]].dtype)
