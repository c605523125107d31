"""Tracing: a user's pure function of pytrees of tensors -> a `Traced` (the IR plus pytree
bookkeeping).

    traced = pxform.trace(loss_fn, params, batch)
    print(traced)                 # the IR
    loss = traced(params, batch)  # runs the IR on real tensors, differentiable by autograd

How: the arguments are flattened with optree; tensor leaves (real, `meta` or fake) become
fake CPU tensors of the same shape and dtype, so nothing is materialised; other leaves are
static and baked into the trace. `make_fx(pre_dispatch=True)` records high-level aten ops
(`linear`, `layer_norm`, `scaled_dot_product_attention`, ...) above autograd, so the IR is
the user's program, not its decomposition. While tracing, module forward hooks annotate
each op with the dotted path of the `nn.Module` that issued it, and a frame filter records
the user's source line. The fx graph is then converted to the IR: `getitem` nodes become
multiple outputs, `torch.no_grad()` regions become `Op.grad=False`, in-place ops become
their functional forms, device arguments become `DEVICE`, captured tensors become
constants. Every op must have a rule (see `pxform.ops`), or the trace fails naming the op
and the line that called it.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import linecache
import math
import operator
import os
import sys
import traceback
import warnings
import weakref
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.fx
import torch.fx.traceback as fx_traceback
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from pxform.core.errors import PxformError, PxformWarning, SignatureMismatchError, TraceError
from pxform.core.ir import DEVICE, Constant, Graph, Op, Renames, TensorType, Value, map_values
from pxform.core.precision import Precision
from pxform.core.rng import coordinates, draw_seeds, generator_of, sample
from pxform.core.units import format_bytes, format_table
from pxform.frontend.decompositions import decompositions
from pxform.frontend.precision import AUTOCAST, apply_precision
from pxform.frontend.reuse import reusing
from pxform.frontend.rng import INPLACE, PLAN_INDEPENDENT, RANDOM, tag_random
from pxform.frontend.rows import rows_indexed
from pxform.ops import FALLBACK_TAG, bind, has_rule, rule_info, unsupported_error
from pxform.ops.norm import BATCH_STATS
from pxform.ops.view import MAY_COPY, TRACED_VIEW

MODULE_KEY = "pxform.module"
"""Key under `node.meta["custom"]` that carries the issuing module's dotted path."""

# True while `trace` runs the user's function: transforms then annotate instead of running.
_TRACING: contextvars.ContextVar[bool] = contextvars.ContextVar("pxform_tracing", default=False)


def is_tracing() -> bool:
    """Is `pxform.trace` running the caller right now (on fake tensors)? Region transforms
    (`recompute`, `coshard`) annotate the trace then; called eagerly, they run."""
    return _TRACING.get()


# While `trace` runs the function: `module_fn` functions append the tensors they read as
# module buffers, so the trace knows which inputs are state (not differentiated; BatchNorm
# may write them). `value_and_grad` of a plain function collects them the same way.
_BUFFERS: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "pxform_buffers", default=None)


@contextlib.contextmanager
def collect_buffers() -> Iterator[list[torch.Tensor]]:
    """The tensors `module_fn` functions read as module buffers while the block runs.

    Example:
        >>> with collect_buffers() as seen:
        ...     fn(params, x)
        >>> any(t is params["bn.running_mean"] for t in seen)
        True
    """
    seen: list[torch.Tensor] = []
    token = _BUFFERS.set(seen)
    try:
        yield seen
    finally:
        _BUFFERS.reset(token)


# Modules named by `module_fn` (weakly held, so models are freed normally).
_MODULE_NAMES: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()

# Ops that only assert metadata; they compute nothing and are dropped from the IR.
_ASSERT_OPS = {
    getattr(torch.ops.aten, n).default
    for n in ("_assert_tensor_metadata", "_assert_async", "_assert_scalar",
              "sym_constrain_range", "sym_constrain_range_for_size")
    if hasattr(torch.ops.aten, n) and hasattr(getattr(torch.ops.aten, n), "default")
}


@dataclass(frozen=True, slots=True)
class Leaf:
    """One flattened argument leaf: its path for messages and, if static, its value."""

    path: str
    is_tensor: bool
    static: Any = None


@dataclass(frozen=True, eq=False)
class Traced:
    """A traced function: the IR and how to map pytrees in and out of it.

    Example:
        >>> traced = pxform.trace(loss_fn, params, batch)
        >>> traced.graph.ops[0].target
        <OpOverload(op='aten.linear', overload='default')>
        >>> loss = traced(params, batch)   # same value as loss_fn(params, batch)
    """

    graph: Graph
    in_tree: optree.PyTreeSpec
    out_tree: optree.PyTreeSpec
    leaves: tuple[Leaf, ...]
    fn_name: str
    fallbacks: tuple[Op, ...] = ()
    _last_use: dict[str, int] = field(default_factory=dict, repr=False)
    state: tuple[int, ...] = ()
    buffers: frozenset[int] = frozenset()
    copied_calls: int = 0

    # `copied_calls`: module calls whose ops were copied from an earlier identical call
    # instead of traced (`reuse_layers`, `pxform.frontend.reuse`).
    # `state`: the graph inputs (by index) a module writes in place, BatchNorm's running
    # statistics and batch count: the graph returns their new values after the function's
    # own outputs, and callers write them back into the tensors passed (`write_state`).
    # `buffers`: the graph inputs that are module buffers (`module_fn`): never differentiated.

    @property
    def num_outputs(self) -> int:
        """The function's own outputs (the graph's, less the state written back)."""
        return len(self.graph.outputs) - len(self.state)

    def __str__(self) -> str:
        return str(self.graph)

    def __repr__(self) -> str:
        return (f"Traced({self.fn_name}: {len(self.graph.inputs)} inputs, "
                f"{len(self.graph.ops)} ops)")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the IR on real tensors with the same pytree structure as the trace.

        Raises:
            SignatureMismatchError: the arguments' structure, shapes, dtypes or static
                leaves differ from the trace (trace again for a new signature).
        """
        tensors = self._check_args(args, kwargs)
        outs = run_graph(self.graph, tensors, self._last_use)
        n = self.num_outputs
        with torch.no_grad():  # module state (running statistics) is written as eager does
            for k, new in zip(self.state, outs[n:]):
                tensors[k].copy_(new)
        return optree.tree_unflatten(self.out_tree, outs[:n])

    def _check_args(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        paths, leaves, tree = optree.tree_flatten_with_path(  # type: ignore[var-annotated]
            (args, kwargs))  # type: ignore[arg-type]
        name = f"pxform.trace({self.fn_name})"
        if tree != self.in_tree:
            raise SignatureMismatchError(
                f"{name}: called with arguments of structure {tree}, but traced with "
                f"{self.in_tree}.\n  Fix: pass the same pytree structure, or trace again.")
        tensors = []
        inputs = iter(self.graph.inputs)
        for leaf, value in zip(self.leaves, leaves):
            if leaf.is_tensor:
                expected = next(inputs).type
                if not isinstance(value, torch.Tensor):
                    raise SignatureMismatchError(
                        f"{name}: argument {leaf.path} was a tensor {expected} when traced "
                        f"but is now {type(value).__name__} {value!r}.")
                got = TensorType.of(value)
                if got.shape != expected.shape or got.dtype != expected.dtype:
                    raise SignatureMismatchError(
                        f"{name}: argument {leaf.path} is {got} but was traced as {expected}."
                        f"\n  Fix: pass a tensor of shape {list(expected.shape)} and dtype "
                        f"{expected.dtype}, or trace again for the new shape.")
                tensors.append(value)
            elif not _static_equal(value, leaf.static):
                raise SignatureMismatchError(
                    f"{name}: non-tensor argument {leaf.path} is {value!r} but was {leaf.static!r} "
                    f"when traced; non-tensor leaves are static (baked into the trace).\n"
                    f"  Fix: trace again for the new value, or pass it as a tensor.")
        return tensors

    def op_table(self, by: str = "op", limit: int | None = None) -> str:
        """A text table of ops: dim signature, forward FLOPs and output bytes.

        Args:
            by: "op" for one row per op; "target" for one row per aten op with counts
                and totals (handy for large models).
            limit: show at most this many rows (the totals still count every op).

        Example:
            >>> print(traced.op_table(by="target"))
        """
        infos = [(op, rule_info(op)) for op in self.graph.ops]
        total_flops = sum(i.flops for _, i in infos)
        total_bytes = sum(_op_bytes(op, i.view) for op, i in infos)
        header: tuple[str, ...]
        rows: list[tuple[str, ...]]
        if by == "op":
            header = ("#", "op", "signature", "FLOPs", "out bytes", "module / source")
            rows = [(str(k), op.name, str(info.signature), si(info.flops),
                     format_bytes(_op_bytes(op, info.view)),
                     op.module or _short_source(op.source))
                    for k, (op, info) in enumerate(infos)]
        elif by == "target":
            header = ("op", "count", "FLOPs", "FLOPs %", "out bytes")
            agg: dict[str, list[int]] = {}
            for op, info in infos:
                row = agg.setdefault(str(op.target), [0, 0, 0])
                row[0] += 1
                row[1] += info.flops
                row[2] += _op_bytes(op, info.view)
            rows = [(t, str(c), si(f), f"{100 * f / max(total_flops, 1):.1f}", format_bytes(b))
                    for t, (c, f, b) in sorted(agg.items(), key=lambda kv: -kv[1][1])]
        else:
            raise ValueError(f"op_table: by must be 'op' or 'target', got {by!r}")
        shown = rows if limit is None else rows[:limit]
        lines = format_table([header, *shown], rule=True)
        if len(shown) < len(rows):
            lines.append(f"... {len(rows) - len(shown)} more rows")
        lines.append(f"total: {len(self.graph.ops)} ops, {si(total_flops)}FLOPs forward, "
                     f"{format_bytes(total_bytes)} written by non-view ops")
        return "\n".join(lines)

    def summary(self) -> str:
        """A few lines: inputs and their bytes, op count, forward FLOPs, fallbacks."""
        g = self.graph
        tensor_leaves = [lf for lf in self.leaves if lf.is_tensor]
        in_bytes = sum(v.type.nbytes for v in g.inputs)
        in_numel = sum(v.type.numel for v in g.inputs)
        counts = Counter(op.name for op in g.ops)
        flops = sum(rule_info(op).flops for op in g.ops)
        top = ", ".join(f"{n} x{c}" for n, c in counts.most_common(8))
        modules = {op.module.split(".")[0] for op in g.ops if op.module}
        lines = [
            f"{self.fn_name}: {len(tensor_leaves)} tensor inputs ({si(in_numel)} elements, "
            f"{format_bytes(in_bytes)}), {len(self.leaves) - len(tensor_leaves)} static, "
            f"{len(g.constants)} constants",
            f"  {len(g.ops)} ops ({len(counts)} kinds): {top}",
            f"  forward: {si(flops)}FLOPs; outputs: "
            + ", ".join(str(o.type) if isinstance(o, Value) else repr(o) for o in g.outputs),
        ]
        if modules:
            lines.append(f"  top-level modules: {', '.join(sorted(modules))}")
        if self.copied_calls:
            lines.append(f"  {self.copied_calls} module calls copied from an earlier call "
                         f"that records the same ops (traced once: reuse_layers)")
        if self.fallbacks:
            lines.append(f"  {len(self.fallbacks)} ops run replicated by the fallback: "
                         + ", ".join(sorted({op.name for op in self.fallbacks})))
        return "\n".join(lines)


def trace(fn: Callable[..., Any], *args: Any, allow_fallback: bool = False,
          report_fallbacks: bool = True, precision: Precision | None = None,
          param_argnums: Sequence[int] = (0,), sync_batch_norm: bool = False,
          reuse_layers: bool = True, **kwargs: Any) -> Traced:
    """Trace `fn(*args, **kwargs)` into the typed IR without running it on data.

    Args:
        fn: a pure function of pytrees (optree) of tensors and static Python values.
        *args, **kwargs: example arguments; tensor leaves may be real, `meta` or fake.
        allow_fallback: run ops that have no sharding rule replicated instead of failing;
            each one is reported in a `PxformWarning` and in `Traced.fallbacks`.
        report_fallbacks: warn about them (transforms that trace again what they already
            reported turn it off).
        precision: a mixed-precision policy (`pxform.Precision`): its casts become ops of
            the IR (`pxform.frontend.precision`). `torch.autocast` blocks inside `fn` are
            honoured with or without one.
        param_argnums: the positional arguments holding parameters (`param_dtype` casts
            their floating leaves).
        sync_batch_norm: training-mode BatchNorm normalises by the whole batch's
            statistics however the batch is split (synchronised BatchNorm: one process's
            result); by default each rank's rows are normalised by their own, as DDP does.
            The running statistics are the whole batch's either way (module buffers a
            function writes are returned as `Traced.state` and written back).
        reuse_layers: trace a repeated `nn.Module` call (a model's layers) once and copy
            its ops for the calls that would record the same ones
            (`pxform.frontend.reuse`); the IR is the same either way. False traces every
            call (for a forward with Python side effects outside its modules).

    Returns:
        A `Traced`: `.graph` is the IR, calling it runs the IR on real tensors.

    Raises:
        UnsupportedOpError: an op has no rule (the message names it and the source line).
        TraceError: the function cannot be traced (data-dependent control flow, in-place
            mutation of an argument, a non-tensor output...), or `fn` is an `nn.Module`
            (its weights would be constants: make it a function with `module_fn`).

    Example:
        >>> def mlp(params, x):
        ...     return torch.relu(x @ params["w1"]) @ params["w2"]
        >>> traced = pxform.trace(mlp, {"w1": torch.randn(4, 8), "w2": torch.randn(8, 4)},
        ...                       torch.randn(2, 4))
        >>> print(traced.graph.ops[0])
        %0: f32[2,8] = matmul(%x, %w1)
    """
    fn_name = getattr(fn, "__name__", type(fn).__name__)
    if isinstance(fn, torch.nn.Module):
        raise module_given(fn, "trace")
    paths, leaves, in_tree = optree.tree_flatten_with_path((args, kwargs))  # type: ignore[arg-type,var-annotated]
    names = arg_names(fn, len(args))
    leaf_infos = []
    for path, leaf in zip(paths, leaves):
        shown = path_text(path, names)
        if isinstance(leaf, torch.Tensor):
            leaf_infos.append(Leaf(shown, True))
        else:
            leaf_infos.append(Leaf(shown, False, leaf))
    tensor_pos = [i for i, lf in enumerate(leaf_infos) if lf.is_tensor]

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = [_to_fake(leaves[i], mode) for i in tensor_pos]
    out_tree_box: list[optree.PyTreeSpec] = []
    out_paths: list[str] = []
    buffer_pos: set[int] = set()  # tensor leaves `module_fn` read as module buffers

    def flat_fn(*tensors: torch.Tensor) -> list[Any]:
        full = list(leaves)
        for i, t in zip(tensor_pos, tensors):
            full[i] = t
        a, kw = optree.tree_unflatten(in_tree, full)
        with collect_buffers() as seen:
            result = fn(*a, **kw)
        position = {id(t): k for k, t in enumerate(tensors)}
        buffer_pos.update(position[id(t)] for t in seen if id(t) in position)
        opaths, out_leaves, out_tree = optree.tree_flatten_with_path(result)
        out_tree_box.append(out_tree)
        out_paths.extend(path_text(p, None, root="output") for p in opaths)
        for p, leaf in zip(out_paths, out_leaves):
            if not isinstance(leaf, (torch.Tensor, int, float, bool, str, type(None))):
                raise TraceError(
                    f"pxform.trace({fn_name}): {p} is a {type(leaf).__name__}, which pxform "
                    f"cannot flatten.\n  Fix: return tensors in tuples, lists, dicts or "
                    f"namedtuples (for an HF ModelOutput, return e.g. `out.loss`).")
        return out_leaves

    token = _TRACING.set(True)
    try:
        with mode, _record_modules(), _record_user_frames() as caller, _traceable_init(), \
                _compiling(), _attention_dropout_explicit(), fx_traceback.preserve_node_meta(), \
                reusing(MODULE_KEY, _MODULE_NAMES, caller, reuse_layers) as reuse, \
                _lazy_module():
            gm = make_fx(flat_fn, decomposition_table=decompositions(), pre_dispatch=True,
                         **_MAKE_FX_OPTIONS)(*fakes)
    except (TraceError, SignatureMismatchError, PxformError):
        raise
    except Exception as exc:
        raise _trace_failure(fn_name, exc) from exc
    finally:
        _TRACING.reset(token)

    input_names = _input_names([leaf_infos[i].path for i in tensor_pos])
    graph, fallbacks, state = _to_ir(gm, fn_name, input_names, allow_fallback,
                                     {input_names[k] for k in buffer_pos}, sync_batch_norm)
    params = {name for name, i in zip(input_names, tensor_pos)
              if len(paths[i]) > 1 and paths[i][0] == 0 and
              paths[i][1] in {n % max(len(args), 1) for n in param_argnums}}
    # (before the precision pass: a cast it inserts reads the rewritten values)
    graph = rows_indexed(graph)
    graph = apply_precision(graph, precision, params, fn_name)
    if fallbacks and report_fallbacks:
        warnings.warn(
            f"pxform.trace({fn_name}): {len(fallbacks)} ops have no sharding rule and will "
            f"run replicated: " + "; ".join(f"{op.name}{' at ' + op.source if op.source else ''}"
                                          for op in fallbacks), PxformWarning, stacklevel=2)
    index = {name: k for k, name in enumerate(input_names)}
    return Traced(graph, in_tree, out_tree_box[-1], tuple(leaf_infos), fn_name,
                  tuple(fallbacks), last_uses(graph), tuple(index[n] for n in state),
                  frozenset(buffer_pos), reuse.copied if reuse is not None else 0)


def cache_key(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What a trace depends on: pytree structure, tensor shapes and dtypes, static leaves.

    Transforms cache traces under this key, as `jax.jit` caches on abstract signatures.
    """
    leaves, tree = optree.tree_flatten((args, kwargs))  # type: ignore[arg-type,var-annotated]
    parts: list[Any] = [tree]
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("T", tuple(leaf.shape), leaf.dtype))
        else:
            parts.append(("S", type(leaf).__name__, repr(leaf)))
    return tuple(parts)


# ---------------------------------------------------------------- running the IR

def run_graph(graph: Graph, inputs: Sequence[torch.Tensor],
              last_use: dict[str, int] | None = None,
              on_op: Callable[[Op, list[Any], list[torch.Tensor]], None] | None = None,
              ) -> list[Any]:
    """Evaluate `graph` on real tensors, op by op, with autograd.

    Values are dropped after their last use, so peak memory is that of eager execution.
    Device arguments (`DEVICE`) take the device of the first input. `on_op(op, args,
    results)` is called after each op (for meters and tests).
    """
    device = inputs[0].device if inputs else torch.device("cpu")
    env: dict[str, Any] = {v.name: t for v, t in zip(graph.inputs, inputs)}
    for c in graph.constants:
        if isinstance(c.data, FakeTensor) or c.data.device.type == "meta":
            raise TraceError(
                f"pxform: the traced function captured a tensor without data ({c.value}: "
                f"{c.value.type}, on {c.data.device}) and cannot run.\n  Fix: pass it as an "
                f"argument (e.g. keep buffers in the params dict that module_fn returns).")
        env[c.value.name] = c.data.to(device)
    last_use = last_use if last_use is not None else last_uses(graph)

    def resolve(a: Any) -> Any:
        a = map_values(a, lambda v: env[v.name])
        return device if a is DEVICE else a

    # random ops draw from pxform's counter-based stream, as every plan's program does
    seeds = draw_seeds([(op.target, op.args, dict(op.kwargs)) for op in graph.ops
                        if op.tag(RANDOM) is not None])
    for k, op in enumerate(graph.ops):
        args = [resolve(a) for a in op.args]
        kw = {name: resolve(a) for name, a in op.kwargs}
        with torch.set_grad_enabled(op.grad and torch.is_grad_enabled()):
            tag = op.tag(RANDOM)
            if tag is not None and op.name in PLAN_INDEPENDENT:
                assert seeds is not None
                shape = op.outputs[0].type.shape
                coords = coordinates(tag, [()] * len(shape), shape, {}, {}, device)
                seed = seeds.of(generator_of(op.target, args, kw))
                result = sample(op.name, op.target, args, kw, coords, tag, seed,
                                op.outputs[0].type.dtype, device)
            else:
                result = op.target(*args, **kw)
        results = [r for r in (result if isinstance(result, (list, tuple)) else [result])
                   if isinstance(r, torch.Tensor)]
        for v, r in zip(op.outputs, results):
            env[v.name] = r
        if on_op is not None:
            on_op(op, args, results)
        for v in op.inputs:
            if last_use.get(v.name) == k:
                env.pop(v.name, None)
    return [env[o.name] if isinstance(o, Value) else o for o in graph.outputs]


def last_uses(graph: Graph) -> dict[str, int]:
    """The index of the last op reading each value (outputs: `len(graph.ops)`)."""
    out: dict[str, int] = {}
    for k, op in enumerate(graph.ops):
        for v in op.inputs:
            out[v.name] = k
    for o in graph.outputs:
        if isinstance(o, Value):
            out[o.name] = len(graph.ops)  # never freed
    return out


# ---------------------------------------------------------------- fx graph -> IR

def _to_ir(gm: torch.fx.GraphModule, fn_name: str, input_names: list[str],
           allow_fallback: bool, buffers: Collection[str] = (),
           sync_batch_norm: bool = False) -> tuple[Graph, list[Op], list[str]]:
    env: dict[torch.fx.Node, Any] = {}
    inputs: list[Value] = []
    constants: list[Constant] = []
    ops: list[Op] = []
    fallbacks: list[Op] = []
    grad = True
    autocast: list[tuple[str, torch.dtype, bool]] = []  # open torch.autocast blocks
    counter = iter(range(sys.maxsize))
    input_ids = set()
    views = _Views()  # which values view which (in-place writes through views)
    placeholders = iter(input_names)
    outputs: list[Any] = []
    state: dict[str, Value] = {}  # buffer input -> its value after the writes so far

    def new_value(val: torch.Tensor) -> Value:
        return Value(str(next(counter)), TensorType.of(val))

    def fresh(t: TensorType) -> Value:
        return Value(str(next(counter)), t)

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            v = Value(next(placeholders), TensorType.of(node.meta["val"]))
            inputs.append(v)
            input_ids.add(v.name)
            env[node] = v
        elif node.op == "get_attr":
            data = getattr(gm, node.target)
            if not isinstance(data, torch.Tensor):  # a torch.Generator: a static argument
                env[node] = data
                continue
            v = Value(f"c{len(constants)}", TensorType.of(data))
            constants.append(Constant(v, data))
            env[node] = v
        elif node.op == "output":
            (flat,) = node.args
            outputs = [views.renames.resolve(env[a]) if isinstance(a, torch.fx.Node) else a
                       for a in flat]
        elif node.target is torch._C._set_grad_enabled:
            grad = bool(node.args[0])
        elif node.target is torch.amp.autocast_mode._enter_autocast:
            device, dtype, enabled = node.args[0], node.args[1], node.args[2]
            if dtype is None:
                dtype = torch.get_autocast_dtype(device)
            autocast.append((str(device), dtype, bool(enabled)))
            env[node] = None
        elif node.target is torch.amp.autocast_mode._exit_autocast:
            autocast.pop()
        elif node.target is operator.getitem:
            env[node] = env[node.args[0]][node.args[1]]
        elif node.target in _ASSERT_OPS:
            continue
        else:
            op = views.renames.rewire(_convert_call(node, env, new_value, grad))
            viewed = op.name in MAY_COPY and _aliases_its_input(node)
            if viewed:
                # a view when traced, so a view when it runs: priced as one (`TRACED_VIEW`)
                op = op.with_tag(TRACED_VIEW, True)
            if autocast:  # the innermost block decides (`pxform.frontend.precision`)
                op = op.with_tag(AUTOCAST, autocast[-1])
            retaken = views.refresh(op, fresh)  # views taken before a write into their base
            op = views.renames.rewire(op)
            emitted = list(retaken)
            for one in _batch_norm_train(op, fresh, sync_batch_norm):
                emitted += _functionalize(one, input_ids, views, fn_name, fresh, buffers,
                                          state)
            op = emitted[len(retaken)]
            # a reshape is a view only where its input's strides allowed one when traced
            # (as they will when it runs); one that copied makes a fresh tensor
            if isinstance(op.target, torch._ops.OpOverload) and op.inputs \
                    and op.name in _VIEW_NAMES \
                    and (op.name != "reshape" or viewed):
                views.add(op)
            for new in emitted:
                if not has_rule(new.target):
                    if not allow_fallback:
                        raise unsupported_error(new)
                    new = new.replace(tags=new.tags + ((FALLBACK_TAG, True),))
                    fallbacks.append(new)
                rule_info(new)  # a rule that cannot handle this call fails now, named
                ops.append(new)
            val = node.meta.get("val")
            env[node] = op.outputs if isinstance(val, (list, tuple)) else (
                op.outputs[0] if op.outputs else None)
    # buffers written in place (BatchNorm's running statistics) come back after the
    # function's outputs, in the order of their first write
    outputs += list(state.values())
    # random ops get their key and traced shape now, before any pass rewrites them
    graph = Graph(tuple(inputs), tuple(tag_random(ops)), tuple(outputs), tuple(constants),
                  fn_name)
    return graph, fallbacks, list(state)


_VIEW_NAMES = {"view", "reshape", "_unsafe_view", "transpose", "permute", "t", "expand",
               "squeeze", "unsqueeze", "slice", "select", "split", "chunk", "unbind",
               "narrow", "alias", "detach", "flatten", "unflatten", "as_strided", "diagonal",
               "view_as", "expand_as", "unfold"}


def _convert_call(node: torch.fx.Node, env: dict[torch.fx.Node, Any],
                  new_value: Callable[[torch.Tensor], Value], grad: bool) -> Op:
    def conv(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return env[a]
        if isinstance(a, torch.device):
            return DEVICE
        if isinstance(a, (list, tuple)):
            return type(a)(conv(x) for x in a)
        return a

    args = tuple(conv(a) for a in node.args)
    kwargs = tuple((k, conv(v)) for k, v in node.kwargs.items())
    val = node.meta.get("val")
    flat = val if isinstance(val, (list, tuple)) else [val]
    outputs = tuple(new_value(t) for t in flat if isinstance(t, torch.Tensor))
    custom = node.meta.get("custom") or {}
    module = custom.get(MODULE_KEY, "")
    tags = tuple(sorted((k, v) for k, v in custom.items() if k != MODULE_KEY))
    return Op(node.target, args, outputs, kwargs, tags, module,
              _source_line(node.meta.get("stack_trace")), grad)


class _Views:
    """Which values are views of which, while a trace is converted: an in-place write
    through a view (`x[0].zero_()`, `y[:, 0] = 5`) is written back into the viewed value
    (`select_scatter`, `slice_scatter`, ...), and readers of the old value read the new one
    (`renames`). Views of a value taken before a write through another of its views are
    stale: a reader of one gets the view taken again from the new value."""

    def __init__(self) -> None:
        self.parent: dict[str, Op] = {}  # view value -> the view op that made it
        self.children: dict[str, set[str]] = {}  # root -> its views
        self.renames = Renames()
        self.stale: dict[str, str] = {}  # stale view -> its root

    def root(self, name: str) -> str:
        while name in self.parent:
            name = self.parent[name].inputs[0].name
        return name

    def add(self, op: Op) -> None:
        root = self.root(op.inputs[0].name)
        for o in op.outputs:
            self.parent[o.name] = op
            self.children.setdefault(root, set()).add(o.name)

    def chain(self, name: str) -> list[Op]:
        """The view ops from the root to `name`, outermost first."""
        out = []
        while name in self.parent:
            out.append(self.parent[name])
            name = self.parent[name].inputs[0].name
        return out[::-1]

    def written(self, root: str, through: set[str]) -> None:
        """`root` was written through the views `through`: its other views are stale."""
        for v in self.children.get(root, set()) - through:
            self.stale[v] = root

    def refresh(self, op: Op, fresh: Callable[[TensorType], Value]) -> list[Op]:
        """Ops taking again, from the written value, the stale views `op` reads (as
        functionalization regenerates views from their base); readers are rewired."""
        out: list[Op] = []
        for v in op.inputs:
            root = self.stale.pop(v.name, None)
            if root is None:
                continue
            base = self.renames.resolve(Value(root, v.type))
            for vop in self.chain(v.name):
                if len(vop.outputs) != 1:
                    raise TraceError(
                        f"pxform.trace: {op.name}{' at ' + op.source if op.source else ''} "
                        f"reads a piece of %{root} ({vop.name}) taken before an in-place write "
                        f"into %{root}.\n  Fix: take the piece again after the write.")
                new = fresh(vop.outputs[0].type)
                out.append(vop.replace(args=(base, *vop.args[1:]), outputs=(new,)))
                base = new
            self.renames.add(v, base)
        return out


# in-place ops whose functional form has another name (the random fills `torch.nn.init` uses)
_FUNCTIONAL_NAMES = {("normal_", "default"): ("normal_functional", "default"),
                     ("bernoulli_", "float"): ("bernoulli", "p"),
                     ("bernoulli_", "Tensor"): ("bernoulli", "Tensor")}
# view ops an in-place write can be carried back through (a reshape is one only where it
# was a view when traced: `_aliases_its_input`)
_WRITE_BACK = {"select", "slice", "narrow", "alias", "detach", "view", "_unsafe_view", "reshape",
               "view_as", "squeeze", "unsqueeze", "flatten", "unflatten", "t", "transpose",
               "permute"}


def _functionalize(op: Op, input_ids: set[str], views: _Views, fn_name: str,
                   fresh: Callable[[TensorType], Value], buffers: Collection[str] = (),
                   state: dict[str, Value] | None = None) -> list[Op]:
    """An in-place aten op as its functional form, and, when it wrote into a view, the
    ops writing the new values back into the viewed tensor (DESIGN.md: the IR is SSA). make_fx
    already routes later uses of the mutated tensor to this op's output; readers of the
    viewed tensor are rewired through `views.renames`. A function input (the caller's
    state) must not be written, except a module buffer (`buffers`, from `module_fn`):
    its new value is recorded in `state`, and the graph returns it to be written back."""
    target = op.target
    if not isinstance(target, torch._ops.OpOverload):
        return [op]
    schema = target._schema
    if not schema.arguments or not schema.is_mutable or not target._opname.endswith("_"):
        return [op]
    mutated = op.args[0] if op.args else None
    where = f" at {op.source}" if op.source else ""
    name, overload = _FUNCTIONAL_NAMES.get((target._opname, target._overloadname),
                                           (target._opname[:-1], target._overloadname))
    functional = getattr(getattr(torch.ops.aten, name, None), overload, None)
    if not isinstance(mutated, Value):
        return [op.replace(target=functional)] if functional is not None else [op]
    root = views.root(mutated.name)
    writes_buffer = root in input_ids and root in buffers and state is not None
    if root in input_ids and not writes_buffer:
        raise TraceError(
            f"pxform.trace({fn_name}): {target} mutates the function's argument "
            f"%{root} in place{where}.\n  Fix: pure functions must not modify their "
            f"inputs; use the out-of-place op (e.g. `x = x + 1` instead of `x += 1`).")
    if functional is None:
        raise TraceError(f"pxform.trace({fn_name}): in-place op {target} has no functional "
                         f"form{where}.")
    chain = views.chain(mutated.name)
    blocked = next((v for v in chain if v.name not in _WRITE_BACK), None)
    if blocked is not None:
        raise TraceError(
            f"pxform.trace({fn_name}): {target} mutates a view of %{root} made by "
            f"{blocked.name}{where}; pxform cannot write {blocked.name} views back.\n  Fix: "
            f"build the new tensor out of place (e.g. torch.where or torch.cat).")
    # the value written is dead after this op (later readers read the new one): the
    # runtime may write the result into it (`INPLACE`), as the user's in-place op did; never
    # into a buffer: that is the caller's tensor, written back after the step
    new = op.replace(target=functional,
                     tags=op.tags + (() if writes_buffer else ((INPLACE, True),)))
    out = [new]
    child = new.outputs[0]
    for vop in reversed(chain):  # write each level back into its parent
        base = views.renames.resolve(vop.inputs[0])
        value = fresh(base.type)
        out.append(_write_back(vop, base, child, value, op.grad))
        views.renames.add(vop.outputs[0], child)
        views.renames.add(vop.inputs[0], value)
        child = value
    views.written(root, {v.outputs[0].name for v in chain})
    if writes_buffer:
        assert state is not None
        if not chain:  # later readers of the buffer read the new value
            views.renames.add(mutated, child)
        state[root] = child
    return out


def _aliases_its_input(node: torch.fx.Node) -> bool:
    """Did this node (`MAY_COPY`) return a view of its input when traced? It did where the
    input's strides allow one (`_view_possible` to the output's shape; for `contiguous`,
    the input is contiguous), as they will when it runs. Asked of the sizes and strides
    alone: comparing storages missed the views in a layer copied by
    `pxform.frontend.reuse` (its input's node holds another storage: Mixtral's experts'
    output, 2026-11-30), and running `Tensor.view` on the traced value fails under a
    caller's own fake mode (`tests/test_fake_cuda.py`)."""
    source = node.args[0] if node.args else None
    out, inp = node.meta.get("val"), getattr(source, "meta", {}).get("val")
    if not (isinstance(out, torch.Tensor) and isinstance(inp, torch.Tensor)):
        return False
    try:
        sizes, strides = [int(x) for x in inp.shape], [int(x) for x in inp.stride()]
        wanted = [int(x) for x in out.shape]
    except (TypeError, RuntimeError):  # (symbolic sizes: no answer, priced as a copy)
        return False
    if node.target is torch.ops.aten.contiguous.default:
        fmt = node.kwargs.get("memory_format", node.args[1] if len(node.args) > 1 else None)
        return fmt in (None, torch.contiguous_format) and _contiguous(sizes, strides)
    return _view_possible(sizes, strides, wanted)


def _contiguous(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Is a tensor of `sizes` and `strides` laid out row-major without gaps (dims of size 1
    aside), so that `contiguous()` returns it itself?

    Example:
        >>> _contiguous([4, 3], [3, 1]), _contiguous([4, 3], [6, 2])  # (every other column)
        (True, False)
    """
    expected = 1
    for size, stride in zip(reversed(sizes), reversed(strides)):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _view_possible(sizes: Sequence[int], strides: Sequence[int],
                   wanted: Sequence[int]) -> bool:
    """Can a tensor of `sizes` and `strides` be viewed as `wanted` (same element count)
    without a copy? Its dims fall into runs that are laid out one after another in memory
    (dim d and d + 1 are, where stride[d] == stride[d + 1] x size[d + 1]); a view may
    regroup the dims inside a run, not across two. Dims of size 1 do not count.

    Example:
        >>> _view_possible([4, 6], [6, 1], [24]), _view_possible([4, 6], [1, 4], [24])
        (True, False)
        >>> _view_possible([2, 3, 4], [24, 4, 1], [2, 12])  # (dims 1 and 2 are one run)
        True
    """
    if math.prod(sizes) != math.prod(wanted):
        return False
    if math.prod(sizes) == 0:
        return True
    runs: list[int] = []  # the element count of each run of dims laid out together
    previous = 0
    for size, stride in zip(sizes, strides):
        if size == 1:
            continue
        if runs and previous == stride * size:
            runs[-1] *= size
        else:
            runs.append(size)
        previous = stride
    rest = [n for n in wanted if n != 1]
    k = 0
    for run in runs:
        covered = 1
        while covered < run and k < len(rest):
            covered *= rest[k]
            k += 1
        if covered != run:
            return False
    return k == len(rest)


def _batch_norm_train(op: Op, fresh: Callable[[TensorType], Value], sync: bool) -> list[Op]:
    """A training-mode `batch_norm` as pure ops (any other op: itself). `aten.batch_norm`
    updates its running statistics in place, out of the IR's sight. Here it normalises by
    the batch's statistics alone, tagged `BATCH_STATS` ("rank": each shard of the batch by
    its own, as DDP; "global": the whole batch's), and the running statistics are written
    by explicit ops, `copy_` into the buffers (functionalised into `state` by the caller):
    mean and unbiased variance of the whole batch, from sums over the batch, which shard
    as partial sums, so they are one process's statistics under every plan."""
    aten = torch.ops.aten
    if op.target is not aten.batch_norm.default:
        return [op]
    b = bind(op)
    if not b.get("training"):
        return [op]
    x, rm, rv = b["input"], b.get("running_mean"), b.get("running_var")
    args = list(op.args)
    if isinstance(rm, Value) and isinstance(rv, Value):
        args[3] = args[4] = None
    tag = (BATCH_STATS, "global" if sync else "rank")
    out = [op.replace(args=tuple(args), tags=tuple(sorted((*op.tags, tag))))]
    if not (isinstance(rm, Value) and isinstance(rv, Value)):
        return out
    # momentum=None (cumulative averaging) never gets here: nn.BatchNorm turns it into a
    # factor from `float(num_batches_tracked)`, which the trace refuses as data-dependent
    momentum = float(b.get("momentum") or 0.0)
    channels = x.type.shape[1]
    dims = [0, *range(2, x.type.rank)]
    count = x.type.numel // max(channels, 1)
    per_channel = TensorType((channels,), x.type.dtype)
    broadcast = [1, channels] + [1] * (x.type.rank - 2)

    def emit(target: Any, *a: Any, shape: TensorType | None = None) -> Value:
        value = fresh(shape or per_channel)
        out.append(Op(target, a, (value,), module=op.module, source=op.source, grad=False))
        return value

    mean = emit(aten.div.Tensor, emit(aten.sum.dim_IntList, x, dims), count)
    centred = emit(aten.sub.Tensor, x, emit(aten.reshape.default, mean, broadcast,
                                            shape=TensorType(tuple(broadcast), x.type.dtype)),
                   shape=TensorType(x.type.shape, x.type.dtype))
    square = emit(aten.mul.Tensor, centred, centred, shape=centred.type)
    var = emit(aten.div.Tensor, emit(aten.sum.dim_IntList, square, dims), max(count - 1, 1))
    for buffer, stat in ((rm, mean), (rv, var)):
        new = emit(aten.add.Tensor, emit(aten.mul.Tensor, buffer, 1.0 - momentum,
                                         shape=buffer.type),
                   emit(aten.mul.Tensor, stat, momentum), shape=buffer.type)
        done = fresh(buffer.type)
        out.append(Op(aten.copy_.default, (buffer, new), (done,), module=op.module,
                      source=op.source, grad=False))
    return out


def _write_back(view: Op, base: Value, child: Value, out: Value, grad: bool) -> Op:
    """The op making `out`: `base` with the part `view` selects replaced by `child`."""
    aten = torch.ops.aten
    b = bind(view)

    def make(target: Any, args: tuple[Any, ...]) -> Op:
        return Op(target, args, (out,), module=view.module, source=view.source, grad=grad)

    if view.name == "select":
        return make(aten.select_scatter.default, (base, child, b["dim"], b["index"]))
    if view.name in ("slice", "narrow"):
        start = b.get("start") or 0
        end = start + b["length"] if view.name == "narrow" else b.get("end")
        step = b.get("step") or 1
        return make(aten.slice_scatter.default, (base, child, b["dim"], start, end, step))
    if view.name in ("t", "transpose"):
        dims = (0, 1) if view.name == "t" else (b["dim0"], b["dim1"])
        return make(aten.transpose.int, (child, *dims))
    if view.name == "permute":
        order = [d % base.type.rank for d in b["dims"]]
        inverse = [order.index(d) for d in range(len(order))]
        return make(aten.permute.default, (child, inverse))
    # alias, detach, view, squeeze, unsqueeze, flatten...: every element, in order
    return make(aten.reshape.default, (child, list(base.type.shape)))


# ---------------------------------------------------------------- tracing helpers

# make_fx's torch-function metadata mode records, per node, the torch function that made
# it (for torch.export); the IR takes nothing from it, and the extra mode on every torch
# call was 5 % of tracing GPT-3 175B. Torches without the option trace as before.
_MAKE_FX_OPTIONS: dict[str, Any] = (
    {"_disable_torch_fn_metadata_mode": True}
    if "_disable_torch_fn_metadata_mode" in inspect.signature(make_fx).parameters else {})


@contextlib.contextmanager
def _attention_dropout_explicit() -> Iterator[None]:
    """While tracing, `F.scaled_dot_product_attention` with `dropout_p > 0` is written out
    (scores, softmax, dropout, weighted sum), so its dropout is an ordinary dropout op that
    draws from pxform's plan-independent stream at each (batch, head, query, key) position;
    the fused kernel would draw from each rank's own generator. Without dropout the fused
    op is kept. The scores are materialised: O(queries x keys) memory per head."""
    functional = torch.nn.functional
    fused = functional.scaled_dot_product_attention

    def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                  is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
        if not dropout_p:
            return fused(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                         is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        import math

        if enable_gqa and key.shape[-3] != query.shape[-3]:
            groups = query.shape[-3] // key.shape[-3]
            key = key.repeat_interleave(groups, dim=-3)
            value = value.repeat_interleave(groups, dim=-3)
        factor = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
        scores = torch.matmul(query, key.transpose(-2, -1)) * factor
        if is_causal:
            keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool,
                              device=query.device).tril()
            scores = scores.masked_fill(~keep, float("-inf"))
        if attn_mask is not None:
            scores = (scores.masked_fill(~attn_mask, float("-inf"))
                      if attn_mask.dtype == torch.bool else scores + attn_mask)
        probs = functional.dropout(torch.softmax(scores, dim=-1), dropout_p, training=True)
        return torch.matmul(probs, value)

    functional.scaled_dot_product_attention = attention  # type: ignore[assignment]
    try:
        yield
    finally:
        functional.scaled_dot_product_attention = fused


@contextlib.contextmanager
def _lazy_module() -> Iterator[None]:
    """make_fx returns a `_LazyGraphModule`, which writes its Python code only when
    called: the IR is read from the graph and the module is never called, and writing the
    code was a tenth of tracing a 96-layer model. Torches without it trace as before."""
    try:
        from torch.fx._lazy_graph_module import _use_lazy_graph_module
    except ImportError:
        yield
        return
    with _use_lazy_graph_module(True):
        yield


@contextlib.contextmanager
def _compiling() -> Iterator[None]:
    """While tracing, `torch.compiler.is_compiling()` is True, as under torch.export's
    non-strict tracing (also make_fx on fake tensors): libraries then take their
    trace-friendly paths. Above all they skip their caches of tensors (HF's
    `compile_compatible_method_lru_cache`: BEiT's relative-position index), which would
    otherwise keep one trace's fake tensors and hand them, without data, to the next trace
    or to an eager call."""
    old = getattr(torch.compiler, "_is_compiling_flag", None)
    if old is None:  # a torch without the flag: nothing to set
        yield
        return
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = old


@contextlib.contextmanager
def _traceable_init() -> Iterator[None]:
    """While tracing, `torch.nn.init.trunc_normal_` samples by the inverse CDF (uniform,
    erfinv, scale, clamp: what torch did before 2.6) instead of by rejection, whose loop
    stops on the drawn values and cannot be traced. Same distribution; every caller of
    `trunc_normal_` goes through the patched module global."""
    init = torch.nn.init
    original = getattr(init, "_no_grad_trunc_normal_", None)
    if original is None:
        yield
        return

    def trunc_normal(tensor: torch.Tensor, mean: float, std: float, a: float, b: float,
                     generator: Any = None) -> torch.Tensor:
        import math

        def cdf(x: float) -> float:
            return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

        with torch.no_grad():
            lo, hi = cdf((a - mean) / std), cdf((b - mean) / std)
            tensor.uniform_(2 * lo - 1, 2 * hi - 1)
            # uniform_ can return its lower bound: erfinv(-1) is -inf (a value at `a`)
            eps = torch.finfo(tensor.dtype).eps
            tensor.clamp_(min=max(2 * lo - 1, -1 + eps), max=min(2 * hi - 1, 1 - eps))
            tensor.erfinv_()
            tensor.mul_(std * math.sqrt(2.0))
            tensor.add_(mean)
            tensor.clamp_(min=a, max=b)
        return tensor

    init._no_grad_trunc_normal_ = trunc_normal  # type: ignore[attr-defined]
    try:
        yield
    finally:
        init._no_grad_trunc_normal_ = original  # type: ignore[attr-defined]


def _to_fake(t: torch.Tensor, mode: FakeTensorMode) -> torch.Tensor:
    """A fake CPU tensor with `t`'s shape, dtype and requires_grad, from any tensor."""
    with mode:
        fake = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    if t.requires_grad and (t.dtype.is_floating_point or t.dtype.is_complex):
        fake.requires_grad_(True)
    return fake


@contextlib.contextmanager
def _record_modules() -> Iterator[None]:
    """Annotate ops with the dotted path of the innermost module running them."""
    stack: list[Any] = []

    def pre(module: torch.nn.Module, args: Any) -> None:
        path = _MODULE_NAMES.get(module)
        if path is None:
            parent = stack[-1][1] if stack else ""
            path = (parent + "." if parent else "") + type(module).__name__
        cm = fx_traceback.annotate({MODULE_KEY: path}) if path else contextlib.nullcontext()
        cm.__enter__()
        stack.append((cm, path))

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        if stack:
            stack.pop()[0].__exit__(None, None, None)

    h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
    h2 = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)
    try:
        yield
    finally:
        h1.remove()
        h2.remove()
        while stack:
            stack.pop()[0].__exit__(None, None, None)


# torch, optree and the standard library (contextlib's folder) are never the user's code.
_SKIP_DIRS = tuple(os.path.dirname(str(m.__file__)) + os.sep for m in (torch, optree, contextlib)
                   if getattr(m, "__file__", None))


def _internal_dirs() -> tuple[str, ...]:
    """Folders whose frames are not the user's: torch, optree, stdlib and pxform's own
    packages (transforms/ and schedules/ live outside pxform/ in an editable install)."""
    dirs = list(_SKIP_DIRS)
    for name in ("pxform", "pxform.transforms", "pxform.schedules"):
        mod = sys.modules.get(name)
        if mod is not None and getattr(mod, "__file__", None):
            dirs.append(os.path.dirname(os.path.abspath(str(mod.__file__))) + os.sep)
    return tuple(dirs)


@contextlib.contextmanager
def _record_user_frames() -> Iterator[Callable[[], str | None]]:
    """Give every fx node the user's line: the innermost frame outside torch and pxform
    (fx's own stack traces keep only frames named `forward`, which loses every line of a
    pure function). The frame is found by walking the interpreter's frames from the node's
    creation, not by fx's `record_stack_traces`, which formats the whole stack per node
    (a fifth of tracing GPT-3 175B). Yields the function that finds the line for the
    current point of the trace (`pxform.frontend.reuse` gives it to copied ops)."""
    internal = _internal_dirs()
    user: dict[str, bool] = {}  # filename -> is it the user's

    def caller() -> str | None:
        frame: Any = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            mine = user.get(name)
            if mine is None:
                mine = user[name] = _is_user_frame(name, internal)
            if mine:
                code = linecache.getline(name, frame.f_lineno).strip()
                return (f'File "{name}", line {frame.f_lineno}, in '
                        f"{frame.f_code.co_name}\n    {code}")
            frame = frame.f_back
        return None

    tracer_base = torch.fx.proxy.TracerBase
    original = tracer_base.__dict__.get("create_node")
    if original is None:  # torch changed its internals: trace still works, without lines
        yield caller
        return

    def create_node(self: Any, *args: Any, **kwargs: Any) -> torch.fx.Node:
        node = original(self, *args, **kwargs)
        if not node.stack_trace:
            node.stack_trace = caller()
        return node

    setattr(tracer_base, "create_node", create_node)  # noqa: B010
    try:
        yield caller
    finally:
        setattr(tracer_base, "create_node", original)  # noqa: B010


def _is_user_frame(filename: str, internal: tuple[str, ...]) -> bool:
    if filename.startswith(internal):
        return False
    # generated code (<eval_with_key>, <frozen ...>) is not the user's; a REPL or -c is
    return not filename.startswith("<") or filename in ("<stdin>", "<string>") or \
        filename.startswith("<ipython")


@functools.lru_cache(maxsize=4096)
def _source_line(stack_trace: str | None) -> str:
    """`file.py:12 in fn: code` from an fx stack-trace string (its last frame). Cached:
    a model's layers repeat the same few lines."""
    if not stack_trace:
        return ""
    lines = stack_trace.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i].strip()
        if line.startswith('File "'):
            try:
                file_part, rest = line[6:].split('", line ', 1)
                lineno, _, func = rest.partition(", in ")
            except ValueError:
                return line
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return f"{_short_path(file_part)}:{lineno} in {func}" + (f": {code}" if code else "")
    return ""


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return rel if not rel.startswith("..") else path


def _short_source(source: str) -> str:
    return source.split(": ", 1)[0] if source else ""


def arg_names(fn: Callable[..., Any], n: int) -> list[str] | None:
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    names = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names.extend(f"{p.name}[{i}]" for i in range(n - len(names)))
            break
    return names if len(names) >= n else None


def path_text(path: tuple[Any, ...], names: list[str] | None, root: str | None = None) -> str:
    """`params['w1']`-style text for a pytree path of ((args), kwargs)."""
    if root is not None:
        return root + "".join(f"[{k!r}]" for k in path)
    if not path:
        return "args"
    if path[0] == 0 and len(path) >= 2:
        i = path[1]
        head = names[i] if names and i < len(names) else f"args[{i}]"
        rest = path[2:]
    else:
        head = str(path[1]) if len(path) >= 2 else "kwargs"
        rest = path[2:]
    return head + "".join(f"[{k!r}]" for k in rest)


def _input_names(paths: list[str]) -> list[str]:
    """IR names for inputs: the leaf's last key where that is unique (`w1`), else its path
    below the argument (`blocks.0.fc_w`), else its whole path (`params.blocks.0.fc_w`)."""
    def keys(text: str) -> list[str]:
        return [c.strip("'\"") for c in text.replace("]", "").split("[") if c.strip("'\"")]

    def dotted(parts: list[str]) -> str:
        text = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in ".".join(parts))
        # op outputs are numbered %0, %1, ...: an input must never look like one
        return "arg" + text if not text or text[0].isdigit() else text

    split = [keys(p) for p in paths]
    candidates = [
        [dotted(k[-1:]) for k in split],
        [dotted(k[1:] or k) for k in split],
        [dotted(k) for k in split],
    ]
    counts = [Counter(cand) for cand in candidates]
    names = []
    for i in range(len(paths)):
        for cand, count in zip(candidates, counts):
            if count[cand[i]] == 1:
                names.append(cand[i])
                break
        else:
            names.append(f"{candidates[-1][i]}.{i}")
    return names


def _static_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # values whose == is not a bool (arrays): compare identity
        return a is b


def _trace_failure(fn_name: str, exc: Exception) -> TraceError:
    text = f"{type(exc).__name__}: {exc}".strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    hint = ""
    where = _raising_line(exc)
    if where:
        first += f" (at {where})"
    if any(k in text for k in ("nonzero", "masked_select", "DynamicOutputShape", "unique")):
        hint = ("\n  Fix: an op whose output shape depends on tensor values (nonzero, "
                "masked_select, unique, boolean indexing) cannot be traced; keep shapes "
                "static: torch.where(mask, x, 0) instead of x[mask], torch.nonzero_static "
                "with a size bound, or a dense formulation (for HF mixture-of-experts, the "
                "default experts implementation).")
    elif any(k in text for k in ("data-dependent", "DataDependent", "_local_scalar_dense",
                                 "item()")):
        hint = ("\n  Fix: control flow or shapes that depend on tensor values (`.item()`, "
                "`float(t)`, `if t.any():`) cannot be traced; make them depend on shapes or "
                "static arguments instead.")
    elif "meta" in text and "device" in text:
        hint = ("\n  Fix: the function uses a tensor on the meta device that it did not get as an "
                "argument (a captured global or module attribute); pass it as an argument, "
                "e.g. keep buffers in the params dict that pxform.module_fn returns.")
    return TraceError(f"pxform.trace({fn_name}): tracing failed: {first}{hint}")


def _raising_line(exc: BaseException) -> str:
    """The innermost line outside torch and pxform that led to `exc` (the user's code, or
    the library it called, such as a transformers model), as `file:line in fn: code`."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = ""
    for frame in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(frame.filename)
        if path.startswith(here) or f"{os.sep}torch{os.sep}" in path:
            continue
        found = f"{_short_path(path)}:{frame.lineno} in {frame.name}: {(frame.line or '').strip()}"
    return found


def si(n: float) -> str:
    """`n` with an SI prefix, e.g. `3.56 M`."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g} "


def _op_bytes(op: Op, view: bool) -> int:
    return 0 if view else sum(v.type.nbytes for v in op.outputs)


def module_given(module: torch.nn.Module, where: str) -> TraceError:
    """The error for an `nn.Module` given where pxform wants a pure function: traced as it
    is, its parameters would be constants (no gradients, not sharded)."""
    name = type(module).__name__
    return TraceError(
        f"pxform.{where}({name}): got an nn.Module ({name}), not a function of its "
        f"parameters; traced as it is, its weights would be constants: never sharded, and "
        f"gradients would come back for the inputs only.\n  Fix: fn, params = "
        f"pxform.module_fn(model), then pass fn and give params as its first argument "
        f"(e.g. pxform.{where}(fn, ...) and step(params, batch)).")


def module_fn(module: torch.nn.Module) -> tuple[Callable[..., Any], dict[str, torch.Tensor]]:
    """An `nn.Module` as a pure function `fn(params, *args, **kwargs)` and its params.

    `params` maps qualified names to the module's parameters and buffers (buffers are
    carried as non-trainable state: they keep `requires_grad=False`, are never
    differentiated, and a module that updates them, such as BatchNorm in training mode,
    updates the tensors passed, under every transform); tied parameters
    appear once. `fn` calls the module with `torch.func.functional_call`, so the module's
    own tensors are never used and a model built on the `meta` device traces.

    Example:
        >>> with torch.device("meta"):
        ...     model = MyModel()
        >>> fn, params = pxform.module_fn(model)
        >>> traced = pxform.trace(fn, params, batch)
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"pxform.module_fn: expected an nn.Module, got {type(module).__name__}")
    for name, sub in module.named_modules():
        if name:
            _MODULE_NAMES[sub] = name
    params: dict[str, torch.Tensor] = dict(module.named_parameters())
    buffer_names = [name for name, _ in module.named_buffers() if name not in params]
    params.update(module.named_buffers())

    def fn(params: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        # buffers are state, not trainable: read through `detach` (same storage, so an
        # in-place update still reaches the caller's tensor, as in eager), and reported
        # to a trace or `value_and_grad` that is collecting them
        seen = _BUFFERS.get()
        params = dict(params)
        for name in buffer_names:
            t = params.get(name)
            if isinstance(t, torch.Tensor):
                if seen is not None:
                    seen.append(t)
                if t.is_floating_point():  # the IR shows it: `detach` of the buffer
                    params[name] = t.detach()
        return torch.func.functional_call(module, params, args, kwargs, tie_weights=True,
                                          strict=False)

    fn.__name__ = type(module).__name__
    fn.__qualname__ = fn.__name__
    return fn, params

