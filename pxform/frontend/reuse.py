"""Repeated module calls traced once: the second and later calls of a layer that computes
the same ops are copied in the fx graph instead of being traced again.

Why: `make_fx` on fake tensors costs about a millisecond per op, so tracing GPT-3 175B's
96 identical blocks took 2-3 s, half of planning it. A model's layers are `nn.Module`s
called one after another with the same shapes: the ops of one call, with its inputs
renamed, are the ops of the next.

When a call is copied. While `pxform.trace` runs, every `nn.Module` call is keyed by what
can change the ops it records:

- the module tree: each submodule's class, each parameter's and buffer's name, shape,
  strides, dtype and `requires_grad`, and which of them (and of the tensor arguments) are
  the same tensor;
- the arguments: their pytree structure, each tensor's shape, strides, dtype, device and
  `requires_grad`; each other value by equality (None, numbers, strings, dtypes, tuples
  of them) or else by identity (a config object);
- grad mode, autocast state and the fx annotations open around the call (their keys);
- the instance attributes its forward *read*, in any module of the tree, with their
  values. Reads are recorded while the first call runs (`nn.Module.__getattribute__` is
  wrapped during the trace), so an attribute the forward never reads (`layer_idx` in a
  Hugging Face layer without a cache) does not stop the copy, and one it does read
  (`is_sliding`, `layer_idx` in GPT-2's scaled attention) must be equal.

A recorded call is copied only if it is a pure function of its arguments and its own
parameters: every op it recorded reads only its arguments, its parameters and buffers,
or ops it recorded; none writes in place; none is a higher-order op or a constant
(`get_attr`); it wrote no module attribute; no fx annotation opened inside it (a
`recompute` region of its own); its tensor outputs are new tensors, not views of an input
or of each other; and no module of the tree has hooks of its own. Anything else is traced
as before. Copied ops keep their source lines and take the module path of the call they
stand for, and the annotations open around it (a `recompute` or `coshard` region). The
IR is the same op for op: `tests/test_trace_reuse.py` compares the two on every model.

What it cannot see: Python side effects outside modules (a global counter the forward
bumps, a list it appends to) and attributes of non-module objects read through an
attribute whose value is the same object (a config mutated between layers). Pass
`reuse_layers=False` to `pxform.trace` for such code.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental.proxy_tensor import (
    PythonKeyTracer,
    disable_proxy_modes_tracing,
    get_proxy_slot,
    track_tensor_tree,
)
from torch.multiprocessing.reductions import StorageWeakRef

MAX_RECORDINGS = 8
"""Recordings kept per key (calls whose forwards read different attribute values)."""

# an nn.Module's own bookkeeping attributes: parameters, buffers and submodules are keyed
# by the module tree, hooks refuse the copy; `training` is an ordinary read
_INTERNAL = frozenset(vars(torch.nn.Module())) - {"training"}

_PRIMITIVE = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
              torch.layout, torch.memory_format, enum.Enum)

_object_getattribute = object.__getattribute__


class _Refuse(Exception):
    """This call cannot be copied (internal: the call is traced as before)."""


def _value_key(value: Any, keep: list[Any]) -> Any:
    """What a Python value is compared by: primitives and tuples of them by equality,
    anything else by identity (kept alive in `keep` so that its id is not reused)."""
    if isinstance(value, _PRIMITIVE):
        return (type(value), value)
    if isinstance(value, (tuple, list)) and len(value) <= 64:
        return (type(value), tuple(_value_key(v, keep) for v in value))
    if isinstance(value, torch.Tensor):
        raise _Refuse("a tensor outside the arguments and parameters")
    keep.append(value)
    return ("id", id(value))


@dataclass(slots=True)
class _Call:
    """One module call's inputs as the key sees them."""

    key: tuple[Any, ...]
    tensors: list[torch.Tensor]  # flat tensor arguments, then parameters, then buffers
    nodes: list[torch.fx.Node]  # their fx nodes when the call began
    modules: dict[str, torch.nn.Module]  # the tree by relative path
    keep: list[Any]


@dataclass(slots=True)
class _Recording:
    nodes: list[torch.fx.Node]  # the call's ops, in order
    free: dict[torch.fx.Node, int]  # node read from outside -> index into `_Call.tensors`
    rebound: dict[int, torch.fx.Node]  # input index -> the recorded op it was rebound to
    outputs: list[Any]  # per output leaf: (node, shape, stride, dtype, device, grad) or value
    spec: Any  # the outputs' pytree structure
    reads: list[tuple[Any, str, Any]]  # (relative path or module, attribute, value key)
    path: str  # the module path the recorded ops carry
    caller: str | None  # the source line of the call (that of ops in library modules)
    keep: list[Any]

    def reads_match(self, modules: dict[str, torch.nn.Module], keep: list[Any]) -> bool:
        for where, name, want in self.reads:
            owner = modules.get(where) if isinstance(where, str) else where
            if owner is None:
                return False
            value = _object_getattribute(owner, "__dict__").get(name, _MISSING)
            if value is _MISSING:
                return False
            try:
                if _value_key(value, keep) != want:
                    return False
            except _Refuse:
                return False
        return True


_MISSING = object()


class _Reuse:
    """The per-trace state: recordings by key, and the read and write logs."""

    def __init__(self, module_key: str, names: Mapping[torch.nn.Module, str],
                 caller: Callable[[], str | None]) -> None:
        self.module_key = module_key  # the annotation that carries an op's module path
        self.names = names  # module -> dotted path (`module_fn`'s names)
        self.caller = caller  # the user's source line at this point of the trace
        self.recordings: dict[tuple[Any, ...], list[_Recording]] = {}
        self.reads: list[tuple[torch.nn.Module, str, Any]] | None = None
        self.depth = 0
        self.writes: list[torch.nn.Module] = []  # modules written while recording
        self.copied = 0  # calls copied (for tests and the trace summary)

    # ------------------------------------------------------------- the module call
    def call(self, tracer: Any, module: torch.nn.Module, forward: Any,
             args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """`tracer.call_module`: copy a recorded call, or run `forward` and record it."""
        try:
            # metadata reads (shape, stride) skip make_fx's torch-function mode
            with torch._C.DisableTorchFunction():
                call = self._key(module, args, kwargs, tracer)
        except _Refuse:
            return forward(*args, **kwargs)
        for recording in self.recordings.get(call.key, ()):
            if recording.reads_match(call.modules, call.keep):
                return self._replay(recording, module, call, tracer)
        return self._record(forward, module, args, kwargs, call, tracer)

    def _key(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any],
             tracer: Any) -> _Call:
        keep: list[Any] = []
        modules: dict[str, torch.nn.Module] = {}
        tree = []
        for path, sub in module.named_modules(remove_duplicate=False):
            modules.setdefault(path, sub)
            hooks = (sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks
                     or sub._backward_pre_hooks)
            if hooks:
                raise _Refuse("hooks of its own")
            tree.append((path, type(sub)))
        leaves, spec = pytree.tree_flatten((args, kwargs))
        tensors: list[torch.Tensor] = []
        arg_keys = []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                arg_keys.append(_tensor_key(leaf))
                tensors.append(leaf)
            else:
                # an object argument (a KV cache) may be written by the forward: a copy
                # would skip that, so only plain values are compared
                value = _value_key(leaf, keep)
                if value[0] == "id":
                    raise _Refuse("an argument that is an object")
                arg_keys.append(value)
        params = []
        for named in (module.named_parameters(remove_duplicate=False),
                      module.named_buffers(remove_duplicate=False)):
            for name, t in named:
                params.append((name, _tensor_key(t)))
                tensors.append(t)
        first: dict[int, int] = {}
        same = tuple(first.setdefault(id(t), k) for k, t in enumerate(tensors))
        nodes = []
        for t in tensors:
            proxy = get_proxy_slot(t, tracer, None)
            if proxy is None:
                raise _Refuse("a tensor the trace does not track")
            nodes.append(proxy.proxy.node)
        custom = fx_traceback.get_current_meta().get("custom") or {}
        autocast = tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                         for d in ("cpu", "cuda"))
        key = (id(tracer), tuple(tree), spec, tuple(arg_keys), tuple(params), same,
               torch.is_grad_enabled(), autocast, tuple(sorted(custom)))
        keep.append(tracer)
        try:
            hash(key)
        except TypeError as exc:
            raise _Refuse("an unhashable argument") from exc
        return _Call(key, tensors, nodes, modules, keep)

    # ------------------------------------------------------------- recording
    def _record(self, forward: Any, module: torch.nn.Module, args: tuple[Any, ...],
                kwargs: dict[str, Any], call: _Call, tracer: Any) -> Any:
        graph = tracer.graph
        last = next(reversed(graph.nodes))
        if self.reads is None:
            self.reads = []
        first_read, first_write = len(self.reads), len(self.writes)
        custom = dict(fx_traceback.get_current_meta().get("custom") or {})
        caller = self.caller()
        self.depth += 1
        try:
            out = forward(*args, **kwargs)
        finally:
            self.depth -= 1
        try:
            # the tracer keeps the constants it lifts (`torch.tensor(0.5)`) on its root
            if any(m is not tracer.root for m in self.writes[first_write:]):
                raise _Refuse("it wrote a module attribute")
            nodes = []
            node = last.next
            while node.op != "root":
                nodes.append(node)
                node = node.next
            with torch._C.DisableTorchFunction():
                recording = self._analyse(module, call, tracer, nodes, out, custom, caller,
                                          self.reads[first_read:])
        except _Refuse:
            recording = None
        if self.depth == 0:
            self.reads = None
            self.writes.clear()
        if recording is not None:
            kept = self.recordings.setdefault(call.key, [])
            if len(kept) < MAX_RECORDINGS:
                kept.append(recording)
        return out

    def _analyse(self, module: torch.nn.Module, call: _Call, tracer: Any,
                 nodes: list[torch.fx.Node], out: Any, custom: dict[str, Any],
                 caller: str | None, reads: list[tuple[torch.nn.Module, str, Any]]) -> _Recording:
        mine = set(nodes)
        slot: dict[torch.fx.Node, int] = {}
        for k, node in enumerate(call.nodes):
            slot.setdefault(node, k)
        # an op that returns its input (`x.to(x.dtype)`) rebinds that tensor to its node:
        # later code reads the op's output, so a copy rebinds it too
        rebound = {}
        for k, t in enumerate(call.tensors):
            now = get_proxy_slot(t, tracer).proxy.node
            if now is not call.nodes[k]:
                if now not in mine:
                    raise _Refuse("an input rebound outside the call")
                rebound[k] = now
        outside = {k: v for k, v in custom.items() if k != self.module_key}
        path = self._path(module, custom)
        inputs = {StorageWeakRef(t.untyped_storage()) for t in call.tensors}
        free: dict[torch.fx.Node, int] = {}
        for node in nodes:
            if node.op == "get_attr":
                # a constant the tracer lifted (`torch.tensor(0.5)`): made from Python
                # values the key compares, so a copy reads the same one
                if not isinstance(getattr(tracer.root, str(node.target), None), torch.Tensor):
                    raise _Refuse("a get_attr node that is not a constant tensor")
                continue
            if node.op != "call_function" or isinstance(
                    node.target, torch._ops.HigherOrderOperator):
                raise _Refuse(f"a {node.op} node")
            target = node.target
            if isinstance(target, torch._ops.OpOverload) and target._schema.is_mutable:
                # an op that writes a tensor made inside the call (`torch.tensor(0.5)`'s
                # `detach_`) is part of the copy; one that writes an input or parameter, or
                # a view of one, is a side effect
                for written in _written(node):
                    if not isinstance(written, torch.fx.Node) or written not in mine or \
                            _storage(written) in inputs:
                        raise _Refuse("an in-place op on an input")
            node_custom = node.meta.get("custom") or {}
            if {k: v for k, v in node_custom.items() if k != self.module_key} != outside:
                raise _Refuse("an annotation opened inside")
            where = node_custom.get(self.module_key, "")
            if where != path and not where.startswith(path + "."):
                raise _Refuse("an op of another module")
            if any(isinstance(v, torch.SymInt) for v in pytree.tree_leaves(node.meta.get("val"))):
                raise _Refuse("a symbolic size")
            for source in node.all_input_nodes:
                if source not in mine:
                    if source not in slot:
                        raise _Refuse("an op reading a tensor from outside")
                    free[source] = slot[source]
        leaves, spec = pytree.tree_flatten(out)
        storages = {StorageWeakRef(t.untyped_storage()) for t in call.tensors}
        outputs: list[Any] = []
        seen: dict[int, Any] = {}
        keep: list[Any] = []
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor):
                key = _value_key(leaf, keep)
                if key[0] == "id":
                    raise _Refuse("an output that is not a tensor or a plain value")
                outputs.append(("value", leaf))
                continue
            if id(leaf) in seen:
                outputs.append(seen[id(leaf)])
                continue
            proxy = get_proxy_slot(leaf, tracer, None)
            if type(leaf) is not FakeTensor or proxy is None or proxy.proxy.node not in mine:
                raise _Refuse("an output that is an input")
            storage = StorageWeakRef(leaf.untyped_storage())
            if storage in storages:
                raise _Refuse("an output that views an input or another output")
            storages.add(storage)
            entry = ("tensor", proxy.proxy.node, tuple(leaf.shape), leaf.stride(), leaf.dtype,
                     leaf.device, leaf.requires_grad)
            seen[id(leaf)] = entry
            outputs.append(entry)
        where = {id(sub): p for p, sub in call.modules.items()}
        recorded = []
        done: set[tuple[int, str]] = set()
        for owner, name, value in reads:
            if (id(owner), name) in done or owner is tracer.root:  # the tracer's constants
                continue
            done.add((id(owner), name))
            at = where.get(id(owner))
            if at is None:
                keep.append(owner)
            recorded.append((owner if at is None else at, name, _value_key(value, keep)))
        return _Recording(nodes, free, rebound, outputs, spec, recorded, path, caller,
                          keep + call.keep)

    def _path(self, module: torch.nn.Module, custom: dict[str, Any]) -> str:
        """The path `trace` annotates the module's ops with (its `_record_modules` rule:
        `module_fn`'s name, or the parent's path and the class name)."""
        path = self.names.get(module)
        if path is None:
            parent = custom.get(self.module_key, "")
            path = (parent + "." if parent else "") + type(module).__name__
        return path

    # ------------------------------------------------------------- replaying
    def _replay(self, recording: _Recording, module: torch.nn.Module, call: _Call,
                tracer: Any) -> Any:
        graph = tracer.graph
        env = {node: call.nodes[k] for node, k in recording.free.items()}
        custom = dict(fx_traceback.get_current_meta().get("custom") or {})
        path = self._path(module, custom)
        outside = {k: v for k, v in custom.items() if k != self.module_key}
        cut = len(recording.path)
        caller = self.caller() if recording.caller is not None else None
        for node in recording.nodes:
            new = graph.node_copy(node, env.__getitem__)
            if caller is not None and node.meta.get("stack_trace") == recording.caller:
                new.meta["stack_trace"] = caller
            where = (node.meta.get("custom") or {}).get(self.module_key)
            if where is not None or outside:
                new.meta["custom"] = dict(outside)
                if where is not None:
                    new.meta["custom"][self.module_key] = path + where[cut:]
            env[node] = new
        for k, node in recording.rebound.items():
            track_tensor_tree(call.tensors[k], torch.fx.Proxy(env[node], tracer),
                              constant=None, tracer=tracer)
        leaves = []
        made: dict[int, torch.Tensor] = {}
        for entry in recording.outputs:
            if entry[0] == "value":
                leaves.append(entry[1])
                continue
            if id(entry) not in made:
                made[id(entry)] = _fresh(entry, env[entry[1]], tracer)
            leaves.append(made[id(entry)])
        if self.reads is not None:  # an enclosing call is recording: it read these too
            for where, name, _ in recording.reads:
                owner = call.modules[where] if isinstance(where, str) else where
                self.reads.append((owner, name, _object_getattribute(owner, "__dict__")[name]))
        self.copied += 1
        return pytree.tree_unflatten(leaves, recording.spec)


def _written(node: torch.fx.Node) -> list[Any]:
    """The arguments a mutable op writes (`Tensor(a!)` in its schema)."""
    out = []
    target: Any = node.target
    for k, arg in enumerate(target._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            out.append(node.kwargs[arg.name] if arg.name in node.kwargs else
                       node.args[k] if k < len(node.args) else None)
    return out


def _storage(node: torch.fx.Node) -> Any:
    val = node.meta.get("val")
    return StorageWeakRef(val.untyped_storage()) if isinstance(val, torch.Tensor) else None


def _tensor_key(t: torch.Tensor) -> tuple[Any, ...]:
    if isinstance(t, FakeTensor) and t.constant is not None:
        raise _Refuse("a tensor with a known value")
    return (type(t), tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad)


def _fresh(entry: tuple[Any, ...], node: torch.fx.Node, tracer: Any) -> torch.Tensor:
    """A new fake tensor for a copied output, tracked as the copied node's value. One that
    requires grad is made by an op (not a leaf), as the traced output was: an in-place
    op on it later must not trip autograd's leaf check."""
    _, _, shape, stride, dtype, device, grad = entry
    with disable_proxy_modes_tracing():
        t = torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if grad:
            with torch.enable_grad():
                t = t.requires_grad_().clone()
    track_tensor_tree(t, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)
    return t


# the innermost trace's state (None: a trace with `reuse_layers=False`); the hooks are
# installed while the stack is not empty and always consult its top, so a trace nested in
# another neither copies with nor logs into the outer one's recordings
_STATE: list[_Reuse | None] = []
_ORIGINAL: dict[str, Any] = {}


def _current() -> _Reuse | None:
    return _STATE[-1] if _STATE else None


def _call_module(tracer: Any, module: torch.nn.Module, forward: Any,
                 args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    state = _current()
    if state is None:
        return forward(*args, **kwargs)
    return state.call(tracer, module, forward, args, kwargs)


def _getattribute(self: torch.nn.Module, name: str) -> Any:
    value = _object_getattribute(self, name)
    state = _current()
    if state is not None and state.reads is not None and name not in _INTERNAL \
            and name in _object_getattribute(self, "__dict__"):
        state.reads.append((self, name, value))
    return value


def _setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    state = _current()
    if state is not None and state.depth:
        state.writes.append(self)
    _ORIGINAL["__setattr__"](self, name, value)


def _install() -> None:
    # make_fx's tracer sees every module call (fx's `Tracer.trace` routes
    # `nn.Module.__call__` to `call_module`, which only runs `forward`)
    _ORIGINAL["call_module"] = PythonKeyTracer.__dict__["call_module"]
    _ORIGINAL["__setattr__"] = torch.nn.Module.__dict__["__setattr__"]
    PythonKeyTracer.call_module = _call_module  # type: ignore[method-assign,assignment]
    torch.nn.Module.__setattr__ = _setattr  # type: ignore[method-assign]
    if "__getattribute__" not in torch.nn.Module.__dict__:
        torch.nn.Module.__getattribute__ = _getattribute  # type: ignore[method-assign,assignment]


def _uninstall() -> None:
    PythonKeyTracer.call_module = _ORIGINAL.pop("call_module")  # type: ignore[method-assign]
    torch.nn.Module.__setattr__ = _ORIGINAL.pop("__setattr__")  # type: ignore[method-assign]
    if torch.nn.Module.__dict__.get("__getattribute__") is _getattribute:
        del torch.nn.Module.__getattribute__


@contextlib.contextmanager
def reusing(module_key: str, names: Mapping[torch.nn.Module, str],
            caller: Callable[[], str | None], enabled: bool = True) -> Iterator[_Reuse | None]:
    """While the block traces, repeated module calls are recorded once and copied
    (module doc). `module_key` is the fx annotation that carries an op's module path,
    `names` the paths of named modules, `caller()` the stack trace `trace` gives an op
    made here (copied ops get the path and the call's line of the call they stand for).
    Yields the state (its `copied` count), or None when disabled.

    Example:
        >>> with reusing("pxform.module", {}, lambda: None) as reuse:
        ...     gm = make_fx(fn, pre_dispatch=True)(*fakes)
        >>> reuse.copied
        95
    """
    if not enabled and not _STATE:
        yield None
        return
    state = _Reuse(module_key, names, caller) if enabled else None
    if not _STATE:
        _install()
    _STATE.append(state)
    try:
        yield state
    finally:
        _STATE.pop()
        if not _STATE:
            _uninstall()
