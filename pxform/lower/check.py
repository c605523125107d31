"""Checking a lowered per-rank program (`pxform.check(program)`).

A program is a fully specified graph: every value's type carries its layout (spec and
partial axes). It is well formed when

- every op's input and output layouts are one of the op's strategies on the mesh (so the
  local op computes the right piece of the global result);
- every conversion's forward steps take its source layout to its destination layout, and
  its dtype to the destination's (a mixed-precision cast, or none);
- running each op on `meta` tensors of the local input shapes gives the local output shapes
  and dtypes the program claims.

Nothing runs on devices and no process group is needed, so programs lowered for worlds far
larger than this machine (a 1,024-rank mesh) are checked here.
"""

from __future__ import annotations

from typing import Any

import torch

from pxform.core.errors import GraphCheckError
from pxform.core.ir import DEVICE, Graph, TensorType
from pxform.core.layout import Layout, SpecError, apply_step
from pxform.lower.spmd import CallInstr, ConvertInstr, Program
from pxform.ops.check import check_graph
from pxform.ops.strategy import strategies
from pxform.passes.propagate import layout_of


def check(graph: Any) -> None:
    """Verify a traced `Graph` against the op rules (SSA form, every op's types as its rule
    and torch say), or a lowered per-rank `Program` against its layouts and local shapes.

    Raises:
        GraphCheckError: naming the op, its position and what disagrees.

    Example:
        >>> pxform.check(pxform.trace(fn, *args).graph)   # silent when well formed
        >>> pxform.check(step.lower(params, batch))        # a per-rank program
    """
    if isinstance(graph, Graph):
        return check_graph(graph)
    return check_program(graph)


def check_program(program: Program) -> None:
    """Raise `GraphCheckError` naming the first instruction that is not well formed.

    Example:
        >>> check_program(pxform.shard(fn, mesh=AbstractMesh({"dp": 1024}), ...).lower(*args))
    """
    mesh = program.mesh
    types: dict[str, TensorType] = {v.name: v.type for v in program.inputs}
    for c in program.constants:
        types[c.value.name] = c.value.type
    metas: dict[str, torch.Tensor] = {name: _meta(t, program) for name, t in types.items()}

    def fail(where: str, what: str) -> GraphCheckError:
        return GraphCheckError(f"pxform.check({program.name}) on {mesh}: {where}: {what}")

    for instr in program.instrs:
        if isinstance(instr, ConvertInstr):
            src = types[instr.src]
            layout = layout_of(src)
            try:
                for step in instr.forward.steps:
                    layout = apply_step(layout, step, src.shape, mesh)
            except SpecError as exc:
                raise fail(f"%{instr.dst.name} = convert(%{instr.src})", str(exc)) from None
            if layout != layout_of(instr.dst.type):
                raise fail(f"%{instr.dst.name} = convert(%{instr.src})",
                           f"the steps end at {layout}, not at {layout_of(instr.dst.type)}")
            dtype = instr.cast or src.dtype  # mixed precision: a cast conversion
            if dtype != instr.dst.type.dtype:
                raise fail(f"%{instr.dst.name} = convert(%{instr.src})",
                           f"it makes {dtype} from {src.dtype}, but the program says "
                           f"{instr.dst.type.dtype}")
            types[instr.dst.name] = instr.dst.type
            metas[instr.dst.name] = _meta(instr.dst.type, program)
            continue
        assert isinstance(instr, CallInstr)
        op = instr.op
        where = f"{op}"
        ins = tuple(layout_of(types[local]) for _, local in instr.inputs)
        outs = tuple(layout_of(v.type) for v in instr.outputs)
        if not any(s.inputs == ins and s.outputs == outs for s in strategies(op, mesh)):
            raise fail(where, f"inputs laid out as {list(ins)} and outputs as {list(outs)} "
                              f"are not a strategy of {op.name}")
        results = _run_meta(instr, metas)
        if len(results) != len(instr.outputs):
            raise fail(where, f"the local op gives {len(results)} tensors, the program "
                              f"expects {len(instr.outputs)}")
        for v, r in zip(instr.outputs, results):
            want = program.local_shape(v)
            if tuple(r.shape) != want or r.dtype != v.type.dtype:
                raise fail(where, f"on local inputs the op gives %{v.name} shape "
                                  f"{list(r.shape)} {r.dtype}, the program says {list(want)} "
                                  f"{v.type.dtype} (global {v.type})")
            types[v.name] = v.type
            metas[v.name] = r


def _meta(t: TensorType, program: Program) -> torch.Tensor:
    shape = Layout.local_shape(layout_of(t), t.shape, program.mesh)
    return torch.empty(shape, dtype=t.dtype, device="meta")


def _run_meta(instr: CallInstr, metas: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    args, kwargs = instr.local_args(lambda name: metas[name])
    meta = torch.device("meta")
    with torch.no_grad():
        result = instr.call.target(*[meta if a is DEVICE else a for a in args],
                                   **{k: meta if a is DEVICE else a for k, a in kwargs.items()})
    items = result if isinstance(result, (list, tuple)) else [result]
    return [r for r in items if isinstance(r, torch.Tensor)]

