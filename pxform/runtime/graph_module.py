"""A lowered `Program` as a per-rank `torch.fx.GraphModule`.

Ops become `call_function` nodes on local tensors (with their rewrites: a `mul` for a
rescaled mean, a `div` by a `GlobalCount` submodule for counted losses); conversions become
`Convert` submodules holding their forward and backward steps, so the generated code shows
every collective:

    linear = torch.ops.aten.linear.default(x, w1_1, b1_1)
    ...
    mean_1 = self.convert_7(mean)      # Convert(fwd: all_reduce(dp) | bwd: identity)

The module is built once per program, without process groups: it runs inside `bind(axes,
buckets)`, which tells the conversions this rank's groups and where to send parameter
gradients (`GradBuckets`). So a program lowered for a fake or abstract mesh can be built and
printed as well.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx

from pxform.ir import DEVICE, Value
from pxform.layout import Step
from pxform.lower.local import CountSpec
from pxform.lower.spmd import CallInstr, ConvertInstr, Program
from pxform.runtime import collectives
from pxform.runtime.buckets import GradSink
from pxform.runtime.collectives import AxisGroups, all_reduce_sum, convert

_ACTIVE: contextvars.ContextVar[tuple[AxisGroups, GradSink | None] | None] = \
    contextvars.ContextVar("pxform_runtime", default=None)


@contextlib.contextmanager
def bind(axes: AxisGroups, buckets: GradSink | None = None) -> Iterator[None]:
    """Run program modules on this rank's process groups (and gradient buckets)."""
    token = _ACTIVE.set((axes, buckets))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _active() -> tuple[AxisGroups, GradSink | None]:
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("pxform: a program module ran outside pxform.runtime.bind(...); "
                           "call it through pxform.shard or runtime.execute")
    return active


class Convert(torch.nn.Module):
    """The conversion rule as a module: forward steps L -> R, backward steps C -> G(L).
    `param` is the program input index when the source is an input: its gradient goes to
    the active `GradBuckets` (if any) instead of running the backward steps in place."""

    def __init__(self, forward_steps: tuple[Step, ...], backward_steps: tuple[Step, ...],
                 param: int | None) -> None:
        super().__init__()
        self.forward_steps = forward_steps
        self.backward_steps = backward_steps
        self.param = param

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        axes, buckets = _active()
        if (buckets is not None and self.param is not None and x.requires_grad
                and any(s.kind not in ("slice", "zero") for s in self.backward_steps)):
            return _BucketedConvert.apply(x, self.forward_steps, self.backward_steps, axes,
                                          buckets, self.param)
        return convert(x, self.forward_steps, self.backward_steps, axes)

    def extra_repr(self) -> str:
        fwd = "; ".join(map(str, self.forward_steps)) or "identity"
        bwd = "; ".join(map(str, self.backward_steps)) or "identity"
        return f"fwd: {fwd} | bwd: {bwd}" + (f", param={self.param}" if self.param is not None
                                               else "")


class _BucketedConvert(torch.autograd.Function):
    """Forward as `Convert`; backward hands the gradient to the buckets and returns none:
    the reduced gradient comes back from `GradBuckets.finish`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_steps: tuple[Step, ...],  # type: ignore[override]
                backward_steps: tuple[Step, ...], axes: AxisGroups, buckets: GradSink,
                param: int) -> torch.Tensor:
        ctx.buckets, ctx.param = buckets, param
        buckets.expect(backward_steps, x)
        return collectives.Convert.forward(ctx, x, forward_steps, backward_steps, axes)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is not None:
            ctx.buckets.add(ctx.param, grad, ctx.backward_steps)
        return (None,) * 6


class GlobalCount(torch.nn.Module):
    """The number of counted targets of a mean loss, summed over the axes splitting the
    batch (`cross_entropy(ignore_index=...)` divides by it)."""

    def __init__(self, spec: CountSpec, key: str = "") -> None:
        super().__init__()
        self.spec = spec
        self.key = key  # the loss value's name: where a pipeline's precomputed count is

    def forward(self, target: torch.Tensor, weight: torch.Tensor | None,
                like: torch.Tensor) -> torch.Tensor:
        axes, _ = _active()
        for a in self.spec.axes:
            group = axes.groups.get(a)
            if isinstance(group, collectives.Microbatches):
                return group.counts[self.key].to(like.dtype)  # over all microbatches
        with torch.no_grad():
            count = local_count(target, weight, self.spec)
            count = all_reduce_sum(count.reshape(1), self.spec.axes, axes).reshape(())
        return count.to(like.dtype)

    def extra_repr(self) -> str:
        return f"over {', '.join(self.spec.axes)}, ignore_index={self.spec.ignore_index}"


def local_count(target: torch.Tensor, weight: torch.Tensor | None, spec: CountSpec
                ) -> torch.Tensor:
    """This rank's number of counted targets (weighted by class weight if any)."""
    with torch.no_grad():
        keep = target != spec.ignore_index
        if weight is not None:
            return (weight.detach()[target.clamp(min=0)] * keep).sum().to(torch.float64)
        return keep.sum().to(torch.float64)


def tensor_results(result: Any) -> tuple[torch.Tensor, ...]:
    """The tensor outputs of a multi-output op, in order (IR outputs are tensors only)."""
    items = result if isinstance(result, (list, tuple)) else (result,)
    return tuple(r for r in items if isinstance(r, torch.Tensor))


def call_no_grad(target: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an op traced under `torch.no_grad()`."""
    with torch.no_grad():
        return target(*args, **kwargs)


def device_of(x: torch.Tensor) -> torch.device:
    return x.device


def _single_tensor(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and \
        str(schema.returns[0].type) == "Tensor"


def build(program: Program, input_ids: Sequence[int] | None = None) -> torch.fx.GraphModule:
    """The program as an fx GraphModule taking this rank's local inputs, in order.
    Gradients of input i go to the buckets under key i, or `input_ids[i]` when given (a
    pipeline stage's program reads some of the function's inputs; later inputs, values
    received from another stage, are not bucketed).

    Example:
        >>> gm = build(sharded.lower(params, batch))
        >>> print(gm.code)   # local ops and `self.convert_N(...)` collectives
    """
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env: dict[str, torch.fx.Node] = {}
    index = {v.name: i if input_ids is None else input_ids[i]
             for i, v in enumerate(program.inputs) if input_ids is None or i < len(input_ids)}
    for v in program.inputs:
        env[v.name] = graph.placeholder(_ident(v.name))
        env[v.name].meta["local_shape"] = program.local_shape(v)
    for j, c in enumerate(program.constants):
        root.register_buffer(f"constant_{j}", c.data)
        env[c.value.name] = graph.get_attr(f"constant_{j}")
    device: Any = None

    def get_device() -> Any:
        nonlocal device
        if device is None:
            device = (graph.call_function(device_of, (env[program.inputs[0].name],))
                      if program.inputs else torch.device("cpu"))
        return device

    num = 0
    for instr in program.instrs:
        num += 1
        if isinstance(instr, ConvertInstr):
            name = f"convert_{num}"
            root.add_module(name, Convert(instr.forward.steps, instr.backward.steps,
                                          index.get(instr.src)))
            node = graph.call_module(name, (env[instr.src],))
            node.meta["local_shape"] = program.local_shape(instr.dst)
            env[instr.dst.name] = node
            continue
        assert isinstance(instr, CallInstr)
        call = instr.call
        args, kwargs = instr.local_args(lambda name: env[name])
        args = tuple(get_device() if a is DEVICE else a for a in args)
        kwargs = {k: get_device() if a is DEVICE else a for k, a in kwargs.items()}
        if instr.op.grad:
            node = graph.call_function(call.target, args, kwargs)
        else:
            node = graph.call_function(call_no_grad, (call.target, *args), kwargs)
        if len(instr.outputs) == 1 and _single_tensor(call.target):
            outs = [node]
        else:
            tensors = graph.call_function(tensor_results, (node,))
            outs = [graph.call_function(operator.getitem, (tensors, i))
                    for i in range(len(instr.outputs))]
        if call.scale != 1.0:
            outs = [graph.call_function(operator.mul, (o, call.scale)) for o in outs]
        if call.count is not None:
            name = f"count_{num}"
            root.add_module(name, GlobalCount(call.count, instr.outputs[0].name))
            b = _bound_inputs(instr)
            count = graph.call_module(name, (env[b["target"]],
                                             env[b["weight"]] if "weight" in b else None,
                                             env[b["self"]]))
            outs = [graph.call_function(operator.truediv, (o, count)) for o in outs]
        for v, o in zip(instr.outputs, outs):
            o.meta["local_shape"] = program.local_shape(v)
            env[v.name] = o
    results = [env[o.name] if isinstance(o, Value) else o for o in program.outputs]
    graph.output(tuple(results))
    gm = torch.fx.GraphModule(root, graph, class_name=f"Rank_{_ident(program.name)}")
    return gm


def _bound_inputs(instr: CallInstr) -> dict[str, str]:
    """The op's tensor arguments by schema name (`self`, `target`, `weight`) -> the local
    value the call reads for them."""
    from pxform.ops import bind as bind_args

    return {k: instr.local_input(v) for k, v in bind_args(instr.op).items()
            if isinstance(v, Value)}


def _ident(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"v_{out}"
