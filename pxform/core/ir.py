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

import hashlib
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from dataclasses import replace as _dc_replace
from typing import Any

import torch

from pxform.core.spec import UNCONSTRAINED, P, Spec

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


class Renames:
    """Values renamed away while rewriting a graph: when an identity op (a marker) is
    removed, its output is renamed to its input, and every later reader is rewired. The one
    mechanism behind every pass that drops markers.

    Example:
        >>> renames = Renames()
        >>> renames.add(marker.outputs[0], marker.inputs[0])
        >>> op = renames.rewire(op)          # reads the marker's input instead
    """

    def __init__(self) -> None:
        self._to: dict[str, Value] = {}

    def __bool__(self) -> bool:
        return bool(self._to)

    def add(self, old: Value, new: Value) -> None:
        """Readers of `old` read `new` (itself resolved) from now on."""
        self._to[old.name] = self.resolve(new)

    def resolve(self, v: Value) -> Value:
        """What `v` is renamed to (itself when it is not)."""
        while v.name in self._to:
            v = self._to[v.name]
        return v

    def rewire(self, op: Op) -> Op:
        """`op` reading the renamed values."""
        if not self._to or not any(v.name in self._to for v in op.inputs):
            return op
        return op.replace(args=tuple(map_values(a, self.resolve) for a in op.args),
                          kwargs=tuple((k, map_values(a, self.resolve)) for k, a in op.kwargs))

    def outputs(self, outputs: tuple[Any, ...]) -> tuple[Any, ...]:
        """A graph's outputs with renamed values resolved."""
        return tuple(self.resolve(o) if isinstance(o, Value) else o for o in outputs)


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
    # `inputs`, computed once: the search and the lowering ask for it ~100 times per op
    _inputs: tuple[Value, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        vals = [v for a in self.args for v in iter_values(a)]
        vals += [v for _, a in self.kwargs for v in iter_values(a)]
        object.__setattr__(self, "_inputs", tuple(vals))

    @property
    def name(self) -> str:
        """Short name, e.g. `linear` for `aten.linear.default`."""
        return op_name(self.target)

    @property
    def inputs(self) -> tuple[Value, ...]:
        """Tensor inputs in argument order (positional, then keyword)."""
        return self._inputs

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

    def with_tag(self, key: str, value: Any) -> Op:
        """This op with tag `key` set to `value` (replacing the one it had), its tags sorted
        by key, as transforms and passes leave them.

        Example:
            >>> op.with_tag("pxform.stage", 1).tag("pxform.stage")
            1
        """
        kept = tuple((k, v) for k, v in self.tags if k != key)
        return self.replace(tags=tuple(sorted((*kept, (key, value)), key=lambda kv: kv[0])))

    def __str__(self) -> str:
        outs = ", ".join(f"{v}: {v.type}" for v in self.outputs) or "_"
        parts = [_fmt(a) for a in self.args] + [f"{k}={_fmt(v)}" for k, v in self.kwargs]
        text = f"{outs} = {self.name}({', '.join(parts)})"
        if not self.grad:
            text += "  [no_grad]"
        return text


def block_name(path: str) -> str:
    """The block a parameter belongs to, from its IR name (its pytree path): the path up to
    its first list index (`blocks.3.fc_w` -> `blocks.3`, `w[3]` named `arg3` -> `arg3`;
    `""` outside any list). ZeRO-3 gathers each such block's parameters as one collective
    (`pxform.runtime.prefetch`), and the search prices their memory so.

    Example:
        >>> block_name("model.layers.7.mlp.up_proj.weight")
        'model.layers.7'
    """
    parts = path.split(".")
    for k, part in enumerate(parts):
        # the trace names a list's element `arg<index>` when its index is unique
        if part.isdigit() or (k == 0 and part.startswith("arg") and part[3:].isdigit()):
            return ".".join(parts[:k + 1])
    return ""


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


def read_from_outside(ops: Sequence[Op]) -> list[Value]:
    """The values a run of `ops` reads that none of them makes, in the order first read
    (blocks of one kind read theirs in the same order).

    Example:
        >>> [v.name for v in read_from_outside(graph.ops[3:6])]
        ['2', 'params.w']
    """
    made = {v.name for op in ops for v in op.outputs}
    out: dict[str, Value] = {}
    for op in ops:
        for v in op.inputs:
            if v.name not in made and v.name not in out:
                out[v.name] = v
    return list(out.values())


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

    def fingerprint(self) -> str:
        """A short hash of the inputs and ops (op names, the values they read, the types
        they produce): equal for the same function traced with arguments of the same
        shapes and dtypes. A plan records it, so a plan is never run on another graph.

        Example:
            >>> pxform.trace(fn, *args).graph.fingerprint()
            '3f0c1d9a2b7e4c55'
        """
        h = hashlib.sha1()
        for v in self.inputs:
            h.update(f"{v.name}:{v.type};".encode())
        for op in self.ops:
            reads = ",".join(v.name for v in op.inputs)
            makes = ",".join(f"{v.name}:{v.type}" for v in op.outputs)
            h.update(f"{op.name}({reads})->{makes};".encode())
        return h.hexdigest()[:16]

    def values(self) -> Iterator[Value]:
        """Every value defined in the graph: inputs, constants, then op outputs."""
        yield from self.inputs
        for c in self.constants:
            yield c.value
        for op in self.ops:
            yield from op.outputs

    def pruned(self, keep: Sequence[bool]) -> Graph:
        """This graph returning only the outputs `keep` marks, without the ops none of them
        needs (a pipeline rank initialises only its stages' parameters). Ops keep their
        tags, so random ops keep the keys they had in the whole graph.

        Example:
            >>> graph.pruned([True, False])    # the first output only
        """
        outputs = tuple(o for o, k in zip(self.outputs, keep) if k)
        needed = {o.name for o in outputs if isinstance(o, Value)}
        ops = []
        for op in reversed(self.ops):
            if any(v.name in needed for v in op.outputs):
                ops.append(op)
                needed.update(v.name for v in op.inputs)
        return _dc_replace(self, ops=tuple(reversed(ops)), outputs=outputs)

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
