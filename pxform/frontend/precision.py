"""Mixed precision in the IR: autocast regions of the traced function and a `Precision`
policy become explicit casts, so every value's type is the dtype that runs.

`pxform.trace` records `torch.autocast(...)` blocks of the user's function as a tag on each
op inside (`AUTOCAST`: device, dtype, enabled of the innermost block), then `apply_precision`
rewrites the graph once:

- a parameter (a leaf of the parameter arguments) is cast to the policy's `param_dtype`
  where it is read;
- each op under autocast (a region's, or the policy's `compute_dtype` outside any region;
  a region with `enabled=False` turns both off) gets its inputs cast as autocast would
  cast them (`pxform.ops.autocast`): to the compute dtype, to float32, or to the widest;
- ops downstream take the dtypes that result (torch's own dtype rules, on meta tensors);
- floating outputs are cast to the policy's `output_dtype`.

Casts are `aten._to_copy(x, dtype=...)` ops tagged `CAST`, placed before their reader. As
in eager autocast, a program input's cast is shared by its readers with the same tags
(autocast's weight-cast cache), and any other value is cast once per reader: each reader's
bf16 gradient then returns to float32 on its own and the gradients add up in float32, as
eager autocast's do. A cast of a
program input carries `INPUT_CAST`: the dtype its gradient is reduced in. Lowering folds it
into the input's conversion (`pxform.lower.spmd`), so a ZeRO-3 parameter is cast on its
shard before the all-gather and its gradient is reduced in that dtype and returned in the
parameter's.

A region's device type picks the op lists (`torch.autocast("cuda")` follows CUDA's lists
wherever the program runs), and the innermost region wins when regions nest.

Example:
    >>> graph = apply_precision(traced.graph, pxform.Precision(), {"params.w1"}, "loss_fn")
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch

from pxform.core.errors import TraceError
from pxform.core.ir import Graph, Op, TensorType, Value, dtype_name, map_values
from pxform.core.precision import Precision
from pxform.frontend.boundary import STAGE_BOUNDARY
from pxform.frontend.rng import RANDOM
from pxform.ops import FALLBACK_TAG, meta_types
from pxform.ops.autocast import autocast_kind, eligible

AUTOCAST = "pxform.autocast"
"""Tag of ops inside a `torch.autocast` block: `(device type, dtype, enabled)`."""

CAST = "pxform.cast"
"""Tag of a cast the precision rewrite inserted."""

INPUT_CAST = "pxform.input_cast"
"""Tag of a cast of a program input: the dtype its gradient is reduced in."""

_TO_COPY = torch.ops.aten._to_copy.default
_NOT_COPIED = {RANDOM, FALLBACK_TAG, AUTOCAST, CAST, INPUT_CAST}


def apply_precision(graph: Graph, policy: Precision | None, params: Collection[str],
                    fn_name: str) -> Graph:
    """`graph` with its autocast regions and `policy` made explicit casts (module doc).
    A graph without regions, under no policy, comes back unchanged.

    Args:
        params: names of the graph inputs that are parameters (`param_dtype` casts them).
    """
    if policy is None and not any(op.tag(AUTOCAST) is not None for op in graph.ops):
        return graph
    return _Rewrite(graph, policy, frozenset(params), fn_name).run()


class _Rewrite:
    def __init__(self, graph: Graph, policy: Precision | None, params: frozenset[str],
                 fn_name: str) -> None:
        self.graph = graph
        self.policy = policy
        self.params = params
        self.fn_name = fn_name
        self.inputs = {v.name for v in graph.inputs}
        self.retyped: dict[str, Value] = {}  # values whose dtype the rewrite changed
        self.casts: dict[tuple[Any, ...], Value] = {}
        self.names = {v.name for v in graph.values()}
        self.ops: list[Op] = []
        self.stage = 0  # stage boundaries seen: casts are not shared across them
        self.index = 0  # the op being rewritten, or the graph output being cast
        self.reduce = None if policy is None else policy.reduce_dtype

    def run(self) -> Graph:
        for k, op in enumerate(self.graph.ops):
            self.index = k
            changed = any(v.name in self.retyped for v in op.inputs)
            op = self._rewired(op, self.retyped)
            if op.target is STAGE_BOUNDARY:
                self.stage += 1
            self.ops.append(self._rewrite(op, changed))
        outputs = [self.retyped.get(o.name, o) if isinstance(o, Value) else o
                   for o in self.graph.outputs]
        want = None if self.policy is None else self.policy.output_dtype
        if want is not None:
            for k, o in enumerate(outputs):
                self.index = len(self.graph.ops) + k
                if isinstance(o, Value) and o.type.dtype.is_floating_point and \
                        o.type.dtype != want:
                    outputs[k] = self._cast(o, want, None)
        return self.graph.replace(ops=tuple(self.ops), outputs=tuple(outputs))

    def _rewrite(self, op: Op, changed: bool) -> Op:
        new: dict[str, Value] = {}
        policy = self.policy
        if policy is not None and policy.param_dtype is not None:
            for v in op.inputs:
                if v.name in self.params and v.type.dtype.is_floating_point and \
                        v.type.dtype != policy.param_dtype:
                    new[v.name] = self._cast(v, policy.param_dtype, op)
        op = self._rewired(op, new)
        state = self._state(op)
        if state is not None:
            device, dtype = state
            kind = autocast_kind(op, device, dtype)
            name = op.name
            if policy is not None and op.tag(AUTOCAST) is None:
                if name in policy.float32_ops:
                    kind = "float32"
                elif name in policy.compute_ops:
                    kind = "lower"
            target = {"lower": dtype, "float32": torch.float32}.get(kind or "")
            if kind == "promote":
                dtypes = [v.type.dtype for v in op.inputs if eligible(v.type.dtype)]
                target = max(dtypes, key=lambda d: d.itemsize)
            if target is not None:
                more = {v.name: self._cast(v, target, op) for v in op.inputs
                        if eligible(v.type.dtype) and v.type.dtype != target}
                op = self._rewired(op, more)
                new.update(more)
        if not new and not changed:
            return op
        return self._retyped(op)

    def _state(self, op: Op) -> tuple[str, torch.dtype] | None:
        """The autocast (device type, dtype) `op` runs under, or None."""
        region = op.tag(AUTOCAST)
        if region is not None:
            device, dtype, enabled = region
            return (device, dtype) if enabled else None
        policy = self.policy
        if policy is None or policy.compute_dtype is None:
            return None
        return policy.autocast_device, policy.compute_dtype

    def _rewired(self, op: Op, new: dict[str, Value]) -> Op:
        if not new or not any(v.name in new for v in op.inputs):
            return op

        def sub(v: Value) -> Value:
            return new.get(v.name, v)

        return op.replace(args=tuple(map_values(a, sub) for a in op.args),
                          kwargs=tuple((k, map_values(a, sub)) for k, a in op.kwargs))

    def _cast(self, v: Value, dtype: torch.dtype, reader: Op | None) -> Value:
        """`v` cast to `dtype`, for `reader` (None: a graph output). A program input's
        cast is shared by readers with the same tags and gradient mode in one stage; any
        other value's is the reader's own (module doc)."""
        tags = () if reader is None else tuple(
            (k, t) for k, t in reader.tags if k not in _NOT_COPIED)
        grad = True if reader is None else reader.grad
        key = (v.name, dtype, tags, grad, self.stage) if v.name in self.inputs else \
            (v.name, dtype, self.index)
        if key in self.casts:
            return self.casts[key]
        name = f"{v.name}.{dtype_name(dtype)}"
        k = 1
        while name in self.names:
            k += 1
            name = f"{v.name}.{dtype_name(dtype)}{k}"
        self.names.add(name)
        out = Value(name, dataclasses.replace(v.type, dtype=dtype))
        tags += ((CAST, True),)
        if v.name in self.inputs:
            tags += ((INPUT_CAST, self.reduce),)
        self.ops.append(Op(_TO_COPY, (v,), (out,), (("dtype", dtype),), tuple(sorted(tags)),
                           "" if reader is None else reader.module,
                           "" if reader is None else reader.source, grad))
        self.casts[key] = out
        return out

    def _retyped(self, op: Op) -> Op:
        """`op` with output types from its new input types; later readers follow."""
        try:
            found = meta_types(op)
        except Exception as exc:
            raise TraceError(
                f"pxform.trace({self.fn_name}): {op} at {op.source or 'an unknown line'} "
                f"cannot run on the dtypes mixed precision gives it "
                f"({', '.join(str(v.type) for v in op.inputs)}): {exc}.\n  Fix: keep this "
                f"op in float32 (Precision(float32_ops=({op.name!r},))), or cast its "
                f"inputs in the function.") from exc
        outs = []
        changed = False
        for v, t in zip(op.outputs, found):
            if t.dtype == v.type.dtype:
                outs.append(v)
                continue
            nv = Value(v.name, TensorType(v.type.shape, t.dtype, v.type.spec, v.type.partial))
            self.retyped[v.name] = nv
            outs.append(nv)
            changed = True
        return op.replace(outputs=tuple(outs)) if changed else op
