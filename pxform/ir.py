"""The typed IR: `TensorType`, `Value`, `Op`, `Graph`, a printer and `check`.

A `Graph` is a function in SSA form: named typed inputs, a straight-line list of ops, each
defining fresh output values, and outputs. Everything is a frozen, slotted dataclass;
rewriting returns a new graph (`Graph.replace`). The printer is in the style of a jaxpr:

    def mlp(%w1: f32[16,32], %w2: f32[32,16], %x: f32[8,16]):
      %0: f32[8,32] = linear(%x, %w1)
      %1: f32[8,32] = gelu(%0)
      %2: f32[8,16] = linear(%1, %w2)
      return %2

Op arguments keep the structure of the aten call: `Value`s (possibly inside lists, as for
`cat`) and Python constants. Device arguments are replaced by `DEVICE`, so the IR is
device-independent and runs wherever its inputs live.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from dataclasses import replace as _dc_replace
from typing import Any

import torch

from pxform.errors import GraphCheckError
from pxform.spec import UNCONSTRAINED, P, Spec

_DTYPE_NAMES = {
    torch.float64: "f64", torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.float8_e4m3fn: "f8e4m3", torch.float8_e5m2: "f8e5m2",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a dtype as printed in types, e.g. `f32`, `bf16`, `i64`."""
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


@dataclass(frozen=True, slots=True)
class TensorType:
    """Shape, dtype and layout of a tensor value.

    Example:
        >>> str(TensorType((8, 1024), torch.float32))
        'f32[8,1024]'
        >>> str(TensorType((8, 1024), torch.float32, P("dp", "tp")))
        'f32[8@dp,1024@tp]'
        >>> str(TensorType((8, 1024), torch.float32, P(None, None), frozenset({"tp"})))
        'f32[8,1024]{+tp}'
    """

    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: Spec = UNCONSTRAINED
    partial: frozenset[str] = frozenset()

    @property
    def rank(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        dims = []
        for d, size in enumerate(self.shape):
            axes = self.spec.axes_of(d) if isinstance(self.spec, P) else ()
            dims.append(str(size) + "".join("@" + a for a in axes))
        text = f"{dtype_name(self.dtype)}[{','.join(dims)}]"
        if self.partial:
            text += "{" + ",".join("+" + a for a in sorted(self.partial)) + "}"
        return text

    @staticmethod
    def of(tensor: torch.Tensor) -> TensorType:
        """The (unconstrained) type of a real, meta or fake tensor."""
        return TensorType(tuple(int(s) for s in tensor.shape), tensor.dtype)


@dataclass(frozen=True, slots=True)
class Value:
    """A named SSA value. Names are unique within a graph and print as `%name`."""

    name: str
    type: TensorType

    def __str__(self) -> str:
        return "%" + self.name


class _Device:
    """Stands for "the device the graph runs on" wherever the trace saw a device argument."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "DEVICE"


DEVICE = _Device()


def iter_values(arg: Any) -> Iterator[Value]:
    """Yield the `Value`s inside an op argument (which may be a nested list or tuple)."""
    if isinstance(arg, Value):
        yield arg
    elif isinstance(arg, (list, tuple)):
        for a in arg:
            yield from iter_values(a)


def map_values(arg: Any, fn: Any) -> Any:
    """Rebuild an op argument with every `Value` `v` replaced by `fn(v)`."""
    if isinstance(arg, Value):
        return fn(arg)
    if isinstance(arg, (list, tuple)):
        return type(arg)(map_values(a, fn) for a in arg)
    return arg


@dataclass(frozen=True, slots=True)
class Op:
    """One call of an aten op (or another callable) in a graph.

    Attributes:
        target: the callable, usually a `torch._ops.OpOverload` such as `aten.linear.default`.
        args: positional arguments; `Value`s stand for tensors.
        kwargs: keyword arguments as `(name, value)` pairs.
        outputs: the values this op defines, one per tensor it returns.
        tags: `(key, value)` pairs left by transforms (region path, stage, recompute, ...).
        module: the dotted path of the `nn.Module` that issued the op, or "".
        source: the user's source line, `file.py:12 in fn: code`, or "".
        grad: False when the op ran under `torch.no_grad()` in the traced function.
    """

    target: Any
    args: tuple[Any, ...]
    outputs: tuple[Value, ...]
    kwargs: tuple[tuple[str, Any], ...] = ()
    tags: tuple[tuple[str, Any], ...] = ()
    module: str = ""
    source: str = ""
    grad: bool = True

    @property
    def name(self) -> str:
        """Short name, e.g. `linear` for `aten.linear.default`."""
        return op_name(self.target)

    @property
    def inputs(self) -> tuple[Value, ...]:
        """Tensor inputs in argument order (positional, then keyword)."""
        vals = [v for a in self.args for v in iter_values(a)]
        vals += [v for _, a in self.kwargs for v in iter_values(a)]
        return tuple(vals)

    def kwarg(self, key: str, default: Any = None) -> Any:
        for k, v in self.kwargs:
            if k == key:
                return v
        return default

    def tag(self, key: str, default: Any = None) -> Any:
        for k, v in self.tags:
            if k == key:
                return v
        return default

    def replace(self, **changes: Any) -> Op:
        return _dc_replace(self, **changes)

    def __str__(self) -> str:
        outs = ", ".join(f"{v}: {v.type}" for v in self.outputs) or "_"
        parts = [_fmt(a) for a in self.args] + [f"{k}={_fmt(v)}" for k, v in self.kwargs]
        text = f"{outs} = {self.name}({', '.join(parts)})"
        if not self.grad:
            text += "  [no_grad]"
        return text


def op_name(target: Any) -> str:
    """Printable short name of an op target."""
    if isinstance(target, torch._ops.OpOverload):
        return target._opname
    return getattr(target, "__name__", str(target))


def _fmt(arg: Any) -> str:
    if isinstance(arg, Value):
        return str(arg)
    if isinstance(arg, list):
        return "[" + ", ".join(_fmt(a) for a in arg) + "]"
    if isinstance(arg, tuple):
        return "(" + ", ".join(_fmt(a) for a in arg) + ("," if len(arg) == 1 else "") + ")"
    if isinstance(arg, torch.dtype):
        return dtype_name(arg)
    if isinstance(arg, _Device):
        return "device"
    if isinstance(arg, float):
        return repr(arg)
    if isinstance(arg, (torch.memory_format, torch.layout)):
        return str(arg).removeprefix("torch.")
    return repr(arg)


@dataclass(frozen=True, slots=True)
class Constant:
    """A tensor the traced function held as data (e.g. a buffer a model did not pass in)."""

    value: Value
    data: torch.Tensor = field(repr=False, compare=False)


@dataclass(frozen=True, slots=True)
class Graph:
    """A function in SSA form.

    Attributes:
        inputs: one value per tensor leaf of the traced arguments, in pytree order.
        ops: the ops, in execution order.
        outputs: per output leaf, a `Value` or a Python constant the function returned.
        constants: tensors captured by the function, available to every op.
        name: the traced function's name (for printing).
    """

    inputs: tuple[Value, ...]
    ops: tuple[Op, ...]
    outputs: tuple[Any, ...]
    constants: tuple[Constant, ...] = ()
    name: str = "fn"

    def replace(self, **changes: Any) -> Graph:
        """A copy with some fields replaced; graphs are never mutated."""
        return _dc_replace(self, **changes)

    def values(self) -> Iterator[Value]:
        """Every value defined in the graph: inputs, constants, then op outputs."""
        yield from self.inputs
        for c in self.constants:
            yield c.value
        for op in self.ops:
            yield from op.outputs

    def producers(self) -> dict[str, Op]:
        """Map from value name to the op that defines it (inputs and constants absent)."""
        return {v.name: op for op in self.ops for v in op.outputs}

    def users(self) -> dict[str, list[Op]]:
        """Map from value name to the ops that read it, in order."""
        out: dict[str, list[Op]] = {v.name: [] for v in self.values()}
        for op in self.ops:
            for v in op.inputs:
                out.setdefault(v.name, []).append(op)
        return out

    def __str__(self) -> str:
        params = [f"{v}: {v.type}" for v in self.inputs]
        head = f"def {self.name}(" + ", ".join(params) + "):"
        if len(head) <= 100:
            lines = [head]
        else:  # one input per line keeps big models readable
            lines = [f"def {self.name}("] + [f"    {p}," for p in params] + ["):"]
        for c in self.constants:
            lines.append(f"  {c.value}: {c.value.type} = constant")
        for op in self.ops:
            line = f"  {op}"
            if op.module:
                line += f"  # {op.module}"
            lines.append(line)
        outs = [_fmt(o) for o in self.outputs]
        lines.append("  return " + (outs[0] if len(outs) == 1 else "(" + ", ".join(outs) + ")"))
        return "\n".join(lines)


def check(graph: Any) -> None:
    """Verify that `graph` is in SSA form and that every op's types agree with its rule.
    Given a lowered per-rank `Program` (a fully specified graph), verify its layouts and
    local shapes instead (`pxform.lower.check.check_program`).

    Checks: value names are unique; every value an op reads is defined before it; outputs
    are defined; every op has a rule (or is a reported fallback), its inputs have the shapes
    its dim signature expects, and its outputs have the shapes the signature predicts and
    the dtypes the op produces (found by running it on meta tensors).

    Raises:
        GraphCheckError: naming the op, its position and what disagrees.

    Example:
        >>> check(pxform.trace(fn, *args).graph)   # silent when the graph is well formed
    """
    if not isinstance(graph, Graph):
        from pxform.lower.check import check_program  # lowering imports ir: import late

        return check_program(graph)
    from pxform.ops import infer_types, meta_types, rule_info  # ops import ir: import late

    defined: dict[str, Value] = {}

    def define(v: Value, where: str) -> None:
        if v.name in defined:
            raise GraphCheckError(f"check: value %{v.name} is defined twice (again by {where}); "
                                  f"SSA form needs one definition per value")
        defined[v.name] = v

    for v in graph.inputs:
        define(v, "a graph input")
    for c in graph.constants:
        define(c.value, "a constant")
        if TensorType.of(c.data) != c.value.type:
            raise GraphCheckError(f"check: constant {c.value} is declared {c.value.type} but "
                                  f"holds {TensorType.of(c.data)}")
    for i, op in enumerate(graph.ops):
        where = f"op {i} ({op.name}{_at(op)})"
        for v in op.inputs:
            if v.name not in defined:
                raise GraphCheckError(f"check: {where} reads {v}, which is not defined before it")
            if defined[v.name] != v:
                raise GraphCheckError(f"check: {where} reads {v} as {v.type}, but it was "
                                      f"defined as {defined[v.name].type}")
        expected_in = rule_info(op).signature.input_shapes()
        got_in = tuple(v.type.shape for v in op.inputs)
        if expected_in != got_in:
            raise GraphCheckError(
                f"check: {where} reads inputs of shapes {[list(s) for s in got_in]} but its "
                f"rule's signature expects {[list(s) for s in expected_in]}")
        got = tuple(TensorType(v.type.shape, v.type.dtype) for v in op.outputs)
        for source, expected in (("its rule", infer_types(op)), ("torch", meta_types(op))):
            if tuple(expected) != got:
                raise GraphCheckError(
                    f"check: {where} declares outputs ({', '.join(map(str, got))}) but "
                    f"{source} gives ({', '.join(map(str, expected))})")
        for v in op.outputs:
            define(v, where)
    for o in graph.outputs:
        if isinstance(o, Value) and defined.get(o.name) != o:
            raise GraphCheckError(f"check: graph output {o} is not defined by any op or input")


def _at(op: Op) -> str:
    return f" at {op.source}" if op.source else ""
