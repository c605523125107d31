"""A lowered `Program` as a per-rank `torch.fx.GraphModule`.

Ops become `call_function` nodes on local tensors (with their rewrites: a `mul` for a
rescaled mean, a `div` by a `GlobalCount` submodule for counted losses); conversions become
`Convert` submodules holding their forward and backward steps, so the generated code shows
every collective:

    linear = torch.ops.aten.linear.default(x, w1_1, b1_1)
    ...
    mean_1 = self.convert_7(mean)      # Convert(fwd: all_reduce(dp) | bwd: identity)

The module is built once per program, without process groups: it runs inside `with_groups(axes,
buckets)`, which tells the conversions this rank's groups and where to send parameter
gradients (`GradBuckets`). So a program lowered for a fake or abstract mesh can be built and
printed as well.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from pxform.core import rng
from pxform.core.errors import CollectiveError
from pxform.core.ir import DEVICE, Op, Value, block_name
from pxform.core.layout import LOCAL_STEPS, Step
from pxform.core.rng import RandomTag
from pxform.frontend.regions import RECOMPUTE, SAVE, RecomputeTag
from pxform.frontend.rng import INPLACE, PLAN_INDEPENDENT, RANDOM
from pxform.lower.comm import gathers_only
from pxform.lower.mpmd import StageProgram
from pxform.lower.spmd import CallInstr, ConvertInstr, Instr, Program
from pxform.ops import bind as bind_args
from pxform.ops.local import CountSpec
from pxform.passes.propagate import layout_of
from pxform.runtime import collectives
from pxform.runtime.buckets import GradBuckets, GradSink
from pxform.runtime.collectives import AxisGroups, all_reduce_sum, convert
from pxform.runtime.prefetch import Prefetch, gather_plan
from pxform.runtime.reshard import note_gathered


@dataclass(frozen=True)
class Active:
    """What program modules read while they run: this rank's process groups, where
    parameter gradients go, and the call's random seed (`pxform.core.rng`)."""

    axes: AxisGroups
    buckets: GradSink | None = None
    seeds: rng.Seeds | None = None
    prefetch: Prefetch | None = None


_ACTIVE: contextvars.ContextVar[Active | None] = contextvars.ContextVar("pxform_runtime",
                                                                       default=None)


@contextlib.contextmanager
def with_groups(axes: AxisGroups, buckets: GradSink | None = None,
                seeds: rng.Seeds | None = None, prefetch: Prefetch | None = None
                ) -> Iterator[None]:
    """Run program modules on this rank's process groups (and gradient buckets); random
    ops draw under `seeds` (one set per call of a step, `rng.draw_seeds`); gathered
    parameters come from `prefetch` (grouped per block, one block ahead)."""
    token = _ACTIVE.set(Active(axes, buckets, seeds, prefetch))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# True while a recompute region re-runs its forward inside backward: conversions must not
# announce their parameter gradients to the buckets a second time.
_RECOMPUTING: contextvars.ContextVar[bool] = contextvars.ContextVar("pxform_recomputing",
                                                                   default=False)
# True while a pipeline stage's early recompute (the schedule's R action) re-runs the stage:
# it keeps every activation for the backward that follows, so regions run plainly.
_REGIONS_OFF: contextvars.ContextVar[bool] = contextvars.ContextVar("pxform_regions_off",
                                                                   default=False)
# True while an op whose outputs a recompute policy saves is running (read by the
# selective-checkpoint policy, below autograd, for every aten op the op dispatches).
_SAVING: contextvars.ContextVar[bool] = contextvars.ContextVar("pxform_saving", default=False)


@contextlib.contextmanager
def regions_off() -> Iterator[None]:
    """Run recompute regions without checkpointing (an early recompute keeps everything)."""
    token = _REGIONS_OFF.set(True)
    try:
        yield
    finally:
        _REGIONS_OFF.reset(token)


def _active() -> Active:
    active = _ACTIVE.get()
    if active is None:
        raise RuntimeError("pxform: a program module ran outside "
                           "pxform.runtime.graph_module.with_groups(...); call it through "
                           "pxform.shard or pxform.runtime.program.execute")
    return active


class Convert(torch.nn.Module):
    """The conversion rule as a module: forward steps L -> R, backward steps C -> G(L).
    `param` is the program input index when the source is an input: its gradient goes to
    the active `GradBuckets` (if any) instead of running the backward steps in place."""

    def __init__(self, forward_steps: tuple[Step, ...], backward_steps: tuple[Step, ...],
                 param: int | None, where: str = "", output: int | None = None,
                 site: int | None = None, block: tuple[str, str] = ("", ""),
                 asynchronous: bool = False,
                 cast: torch.dtype | None = None, grad_dtype: torch.dtype | None = None
                 ) -> None:
        super().__init__()
        # mixed precision: the input is cast before the steps, its gradient reduced in
        # `grad_dtype` (`pxform.lower.spmd.ConvertInstr`)
        self.cast = cast
        self.grad_dtype = grad_dtype
        self.forward_steps = forward_steps
        self.backward_steps = backward_steps
        self.param = param
        self.where = where  # the instruction, for errors: "%w1.1 = convert(%w1)"
        # the program output this conversion makes, when it only all-reduces a value nothing
        # else reads (a data-parallel loss): under `GradBuckets` the reduction is deferred
        # into a gradient bucket, and the partial value goes on (its gradient is the same)
        self.output = output
        self.site = site  # its place among the program's parameter gathers (`prefetch`)
        # its parameter's (block, path): `reshard_after_forward` per block or parameter
        self.block = block
        # its last collective (each direction) is left running (`pxform.lower.overlap`)
        self.asynchronous = asynchronous

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            return self._forward(x)
        except CollectiveError as exc:  # say where in the program it stopped
            raise CollectiveError(f"{exc}\n  In the program: {self.where}") from exc.__cause__

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        active = _active()
        axes, buckets = active.axes, active.buckets
        if self.output is not None and isinstance(buckets, GradBuckets) and \
                torch.is_grad_enabled():
            buckets.add_value(("output", self.output), x, self.forward_steps)
            return x.view_as(x)  # backward: identity, as the steps' own backward
        given = None
        if self.site is not None and active.prefetch is not None and not _RECOMPUTING.get():
            given = active.prefetch.take(self.site)
        if (buckets is not None and self.param is not None and x.requires_grad
                and torch.is_grad_enabled()
                and any(s.kind not in LOCAL_STEPS for s in self.backward_steps)):
            y = _BucketedConvert.apply(x, self.forward_steps, self.backward_steps, axes,
                                       buckets, self.param, given, self.cast, self.grad_dtype)
        else:
            # a recompute may stop as soon as it has what backward needs: a collective
            # it left running would never be waited for
            y = convert(x, self.forward_steps, self.backward_steps, axes, given,
                        not self.asynchronous or _RECOMPUTING.get(), self.cast,
                        self.grad_dtype)
        if self.param is not None and self.gathers:  # ZeRO-3: may be freed after forward
            group = (active.prefetch.plan.group_of[self.site]
                     if given is not None and active.prefetch is not None
                     and self.site is not None else None)
            note_gathered(y, x, self.forward_steps, axes, group, self.block, self.cast)
        return y

    @property
    def gathers(self) -> bool:
        """Does the forward gather a parameter (ZeRO-3), with nothing but gathers?"""
        return gathers_only(self.forward_steps)

    def extra_repr(self) -> str:
        fwd = "; ".join(map(str, self.forward_steps)) or "identity"
        bwd = "; ".join(map(str, self.backward_steps)) or "identity"
        if self.cast is not None:
            fwd = f"cast {self.cast}; {fwd}"
            bwd = f"cast {self.grad_dtype}; {bwd}"
        return (f"fwd: {fwd} | bwd: {bwd}"
                + (f", param={self.param}" if self.param is not None else "")
                + (", async" if self.asynchronous else ""))


class Wait(torch.nn.Module):
    """Waits for the collective of an asynchronous conversion (its last step `step`) where
    the program first reads its result (`collectives.wait_async`)."""

    def __init__(self, step: Step) -> None:
        super().__init__()
        self.step = step

    def forward(self, x: Any) -> Any:
        return collectives.wait_async(x, self.step, _active().axes)

    def extra_repr(self) -> str:
        return str(self.step)


class _BucketedConvert(torch.autograd.Function):
    """Forward as `Convert`; backward hands the gradient to the buckets and returns none:
    the reduced gradient comes back from `GradBuckets.finish`."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_steps: tuple[Step, ...],  # type: ignore[override]
                backward_steps: tuple[Step, ...], axes: AxisGroups, buckets: GradSink,
                param: int, given: torch.Tensor | None = None,
                cast: torch.dtype | None = None, grad_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        ctx.buckets, ctx.param = buckets, param
        if not _RECOMPUTING.get():  # announced once, by the first forward
            buckets.expect(backward_steps, x if grad_dtype is None or grad_dtype == x.dtype
                           else x.new_empty((), dtype=grad_dtype))
        return collectives.ConvertFunction.forward(ctx, x, forward_steps, backward_steps, axes,
                                                   given, True, cast, grad_dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is not None:
            # mixed precision: reduced in the reduce dtype, returned in the parameter's
            if ctx.grad_dtype is not None:
                grad = grad.to(ctx.grad_dtype)
            ctx.buckets.add(ctx.param, grad, ctx.backward_steps, ctx.dtype)
        return (None,) * 9


class Recompute(torch.nn.Module):
    """A recompute region: `body` runs under activation checkpointing (torch's
    non-reentrant checkpoint), so its activations are dropped after forward and recomputed
    when backward needs them. Ops the policy saves run inside `saved_call`, and a selective
    checkpoint policy keeps every tensor they produce. The recompute re-enters the
    process groups and buckets the forward ran with (backward runs outside `with_groups`), and
    collectives inside the region run again."""

    def __init__(self, body: torch.fx.GraphModule, saves: bool, label: str) -> None:
        super().__init__()
        self.body = body
        self.saves = saves
        self.label = label

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled() or _REGIONS_OFF.get():
            return self.body(*inputs)  # nothing is saved without grad: run it plainly
        active = _ACTIVE.get()
        calls = 0

        def run(*xs: Any) -> Any:
            nonlocal calls
            calls += 1
            if calls == 1:
                return self.body(*xs)
            t1, t2 = _ACTIVE.set(active), _RECOMPUTING.set(True)
            try:
                return self.body(*xs)
            finally:
                _RECOMPUTING.reset(t2)
                _ACTIVE.reset(t1)

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        context = (functools.partial(create_selective_checkpoint_contexts, _save_policy)
                   if self.saves else _no_context)
        return checkpoint(run, *inputs, use_reentrant=False, context_fn=context,
                          preserve_rng_state=True)

    def extra_repr(self) -> str:
        return self.label


def _save_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    from torch.utils.checkpoint import CheckpointPolicy

    # ops returning views of their inputs (linear's `t` and `view`) are not kept: a saved
    # view would keep its base, the input the policy means to recompute
    if _SAVING.get() and not any(r.alias_info is not None for r in func._schema.returns):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _no_context() -> tuple[Any, Any]:
    return contextlib.nullcontext(), contextlib.nullcontext()


def saved_call(target: Any, *args: Any, **kwargs: Any) -> Any:
    """Run an op whose outputs the region's recompute policy keeps."""
    token = _SAVING.set(True)
    try:
        return target(*args, **kwargs)
    finally:
        _SAVING.reset(token)


class RandomDraw(torch.nn.Module):
    """A random op evaluated at this rank's global element positions with the call's seed
    (`pxform.core.rng`): the same numbers at each position under every plan. `dims`
    are the mesh axes splitting each dim of the output (its layout), `shape` its shape in
    the lowered graph."""

    def __init__(self, op: Op, dims: tuple[tuple[str, ...], ...],
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.generator = generator  # the op's `generator=`: its seed is drawn from it
        self.target = op.target
        self.op_name = op.name
        self.tag: RandomTag = op.tag(RANDOM)
        self.dims = dims
        self.shape = op.outputs[0].type.shape
        self.dtype = op.outputs[0].type.dtype
        self.grad = op.grad
        self.inplace = bool(op.tag(INPLACE))  # its first input is dead: write into it

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        active = _active()
        if active.seeds is None:
            raise RuntimeError(f"pxform: random op {self.op_name} ran without a seed; run "
                               f"programs through pxform.runtime.program.execute")
        seed = active.seeds.of(self.generator)
        device = next((a.device for a in (*args, *kwargs.values())
                       if isinstance(a, torch.Tensor)), None) or kwargs.get("device") or \
            torch.device("cpu")
        axes = active.axes
        coords = rng.coordinates(self.tag, self.dims, self.shape, axes.index, axes.sizes,
                                 torch.device(device))
        with torch.set_grad_enabled(self.grad and torch.is_grad_enabled()):
            into = args[0] if self.inplace and args and isinstance(args[0], torch.Tensor) \
                else None
            return rng.sample(self.op_name, self.target, args, kwargs, coords, self.tag, seed,
                              self.dtype, torch.device(device), into)

    def extra_repr(self) -> str:
        return f"{self.op_name}, key={self.tag.key}, traced {list(self.tag.shape)}"


def draw_seeds(programs: Sequence[Program | StageProgram]) -> rng.Seeds | None:
    """One call's seeds for the random ops of `programs` (all of a pipeline's stages, so
    every rank draws alike), or None without random ops."""
    calls: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []
    for program in programs:
        inner = program.program if isinstance(program, StageProgram) else program
        found = inner.__dict__.get("_random_calls")  # found once per program, not per call
        if found is None:
            found = [(i.op.target, i.op.args, dict(i.op.kwargs)) for i in inner.instrs
                     if isinstance(i, CallInstr) and i.op.tag(RANDOM) is not None]
            inner.__dict__["_random_calls"] = found  # frozen dataclass: no __setattr__
        calls += found
    return rng.draw_seeds(calls)


class GlobalCount(torch.nn.Module):
    """Divides a counted loss (`cross_entropy(ignore_index=...)`, a sum on each rank) by
    the number of counted targets, summed over the axes splitting the batch.

    With `final` (the loss is the program's first output and nothing else reads it) and
    under `GradBuckets`, no collective runs here: the local count rides in the gradient
    bucket with the loss (`GradBuckets.add_value`). The loss is divided by M, the number of
    targets of the whole batch, known from the shapes; once the buckets finish, the step
    multiplies the loss and every gradient by M / N, N the reduced count (gradients are
    linear in the loss). Without ignored targets the factor is exactly 1.0, which changes
    no bit: the gradients are those of dividing by N at once; otherwise they differ from
    them by a rounding of the loss's dtype. So data parallelism needs no collective outside the
    buckets, as DDP (which returns each rank's own loss) does.
    """

    def __init__(self, spec: CountSpec, key: str = "", final: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.key = key  # the loss value's name: where a pipeline's precomputed count is
        self.final = final

    def forward(self, loss: torch.Tensor, target: torch.Tensor,
                weight: torch.Tensor | None) -> torch.Tensor:
        active = _active()
        axes = active.axes
        for a in self.spec.axes:
            group = axes.groups.get(a)
            if isinstance(group, collectives.Microbatches):
                return loss / group.counts[self.key].to(loss.dtype)  # over all microbatches
        count = local_count(target, weight, self.spec)
        if self.final and isinstance(active.buckets, GradBuckets) and torch.is_grad_enabled():
            if not _RECOMPUTING.get():  # a recompute runs the same count again: once
                # in the loss's dtype, to share its bucket (exact below 2**24 targets in
                # float32); half-precision losses count in float32
                dtype = loss.dtype if loss.dtype in (torch.float32, torch.float64) \
                    else torch.float32
                active.buckets.add_value(("count", 0), count.to(dtype).reshape(()),
                                         tuple(Step("all_reduce", a) for a in self.spec.axes))
            whole = float(target.numel() * math.prod(axes.sizes[a] for a in self.spec.axes))
            active.buckets.count_scale = whole
            return loss / whole
        with torch.no_grad():
            count = all_reduce_sum(count.reshape(1), self.spec.axes, axes).reshape(())
        return loss / count.to(loss.dtype)

    def extra_repr(self) -> str:
        return (f"over {', '.join(self.spec.axes)}, ignore_index={self.spec.ignore_index}"
                + (", final" if self.final else ""))


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


def default_device() -> torch.device:
    """Where a program with no tensor inputs (an initialiser) creates its tensors: this
    rank's GPU under NCCL, the CPU under gloo or without torch.distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a CUDA step returns before its kernels ran;
    nothing to wait for on the CPU): what every timing of a step ends with."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def runtime_device(tensors: Iterable[Any]) -> torch.device:
    """Where the runtime makes the tensors of a step (buffers, zeros, counts): the device
    of its first tensor input, else `default_device()`."""
    for t in tensors:
        if isinstance(t, torch.Tensor):
            return t.device
    return default_device()


def _single_tensor(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    return schema is not None and len(schema.returns) == 1 and \
        str(schema.returns[0].type) == "Tensor"


def module_of(program: Program | StageProgram, hooked: bool = False) -> torch.fx.GraphModule:
    """`program` (an SPMD program, or one pipeline stage's, whose parameter gradients are
    keyed by graph input index) as its per-rank fx GraphModule, built on first use and
    kept with the program (programs are immutable; lowering caches them per signature).
    With `hooked` (an SPMD program run under `GradBuckets`), the module leaves out the
    conversions of `hooked_inputs` and lists them in its `hooked` attribute: the caller
    sends those inputs' gradients to the buckets with tensor hooks (`hook_gradients`).

    Example:
        >>> print(module_of(step.lower(params, batch)).code)
    """
    key = "_graph_module_hooked" if hooked else "_graph_module"
    module = program.__dict__.get(key)
    if module is None:
        if isinstance(program, StageProgram):
            assert not hooked, "pipeline stages send gradients through their conversions"
            module = build(program.program, program.graph_inputs)
        elif hooked:
            hooks = hooked_inputs(program)
            # nothing to hook (ZeRO-3, tensor parallelism): the plain module serves
            module = build(program, hooks=hooks) if hooks else module_of(program)
        else:
            module = build(program)
        program.__dict__[key] = module  # frozen dataclass: no __setattr__
    return module


def hooked_inputs(program: Program) -> dict[str, tuple[Step, ...]]:
    """The program inputs whose gradient needs nothing but a bucketed reduction, and its
    steps: every read of the input is a conversion that is the identity in forward
    (no cast, no gather, not left running, not a deferred output) with the same backward
    steps, some of them collectives (a replicated parameter under data parallelism:
    `all_reduce(dp)`). Such a conversion needs no autograd node of its own: a hook on the
    input's gradient, which autograd has already summed over its reads, hands it to the
    buckets (sum then reduce equals reduce then sum). What DDP does with its C++ hooks;
    it saves an autograd Function per parameter, forward and backward, in Python."""
    deferred, _ = deferred_outputs(program)
    sites = gather_plan(program).site_of()
    inputs = {v.name for v in program.inputs}
    steps: dict[str, tuple[Step, ...] | None] = {}
    for instr in program.instrs:
        if isinstance(instr, ConvertInstr):
            if instr.src not in inputs:
                continue
            ok = (not instr.forward.steps and instr.cast is None and instr.grad_dtype is None
                  and not instr.asynchronous and instr.dst.name not in deferred
                  and instr.dst.name not in sites
                  and any(s.kind not in LOCAL_STEPS for s in instr.backward.steps))
            mine = instr.backward.steps if ok else None
            steps[instr.src] = mine if steps.get(instr.src, mine) == mine else None
        else:
            for name in _reads([instr]):
                if name in inputs:
                    steps[name] = None  # read by an op: its gradient is not all partial
    for o in program.outputs:
        if isinstance(o, Value) and o.name in steps:
            steps[o.name] = None
    return {name: s for name, s in steps.items() if s is not None}


def hook_gradients(module: torch.fx.GraphModule, inputs: Sequence[torch.Tensor],
                   buckets: GradBuckets) -> None:
    """Send the gradients of the inputs `module` (`module_of(..., hooked=True)`) lists in
    `hooked` to `buckets`, from tensor hooks: each hook hands over the gradient as autograd
    computes it and gives autograd back an expanded zero (no memory), which the caller
    ignores for those inputs (`GradBuckets.hooked`).

    Example:
        >>> module = module_of(program, hooked=True)
        >>> hook_gradients(module, local_inputs, buckets)
    """
    hooked: tuple[tuple[int, int, tuple[Step, ...]], ...] = module.__dict__["hooked"]
    for position, key, steps in hooked:
        x = inputs[position]
        if x.requires_grad:
            buckets.expect(steps, x)
            x.register_hook(functools.partial(_to_buckets, buckets, key, steps))


def _to_buckets(buckets: GradBuckets, key: int, steps: tuple[Step, ...],
                grad: torch.Tensor) -> torch.Tensor:
    buckets.hooked.add(key)
    buckets.add(key, grad, steps)
    return buckets.zero(grad).expand(grad.shape)


def build(program: Program, input_ids: Sequence[int] | None = None,
          hooks: Mapping[str, tuple[Step, ...]] | None = None) -> torch.fx.GraphModule:
    """The program as an fx GraphModule taking this rank's local inputs, in order.
    Gradients of input i go to the buckets under key i, or `input_ids[i]` when given (a
    pipeline stage's program reads some of the function's inputs; later inputs, values
    received from another stage, are not bucketed). The instructions of each recompute
    region become one `Recompute` submodule (activation checkpointing). The conversions of
    the inputs in `hooks` (`hooked_inputs`: input name -> backward steps) are left out, and
    the module's `hooked` attribute lists those inputs (see `module_of`).

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
    hooks = hooks or {}
    main = _Emitter(program, graph, root, env, index, set(hooks))
    runs = _region_runs(program.instrs)
    last_run: dict[str, int] = {}
    for r, (_, instrs) in enumerate(runs):
        for name in _reads(instrs):
            last_run[name] = r
    for o in program.outputs:
        if isinstance(o, Value):
            last_run[o.name] = len(runs)
    for r, (region, instrs) in enumerate(runs):
        if region is None:
            main.emit(instrs)
            continue
        defined = [n for i in instrs for n in _defines(i)]
        inner = set(defined)
        ins = [n for n in dict.fromkeys(_reads(instrs)) if n not in inner]
        outs = [n for n in defined if last_run.get(n, -1) > r]
        body = _body(program, instrs, ins, outs, index, set(hooks))
        name = f"recompute_{region.region}"
        while hasattr(root, name):
            name += "_"
        saves = any(isinstance(i, CallInstr) and i.op.tag(SAVE) for i in instrs)
        root.add_module(name, Recompute(body, saves, str(region)))
        node = graph.call_module(name, tuple(env[n] for n in ins))
        for j, n in enumerate(outs):
            env[n] = graph.call_function(operator.getitem, (node, j))
    results = [env[o.name] if isinstance(o, Value) else o for o in program.outputs]
    graph.output(tuple(results))
    gm = torch.fx.GraphModule(root, graph, class_name=f"Rank_{_ident(program.name)}")
    # (position, bucket key, backward steps) of each hooked input; a plain attribute
    gm.__dict__["hooked"] = tuple((k, index[v.name], hooks[v.name])
                                  for k, v in enumerate(program.inputs) if v.name in hooks)
    return gm


def _body(program: Program, instrs: list[Instr], ins: list[str], outs: list[str],
          index: dict[str, int], hooked: set[str]) -> torch.fx.GraphModule:
    """One recompute region's instructions as a module of its inputs, returning its
    outputs (the values read after it)."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    env = {n: graph.placeholder(_ident(n)) for n in ins}
    _Emitter(program, graph, root, env, index, hooked).emit(instrs)
    graph.output(tuple(env[n] for n in outs))
    return torch.fx.GraphModule(root, graph, class_name="Region")


class _Emitter:
    """Appends instructions to an fx graph as nodes (ops) and submodules (conversions,
    counts), reading and defining values in `env`."""

    def __init__(self, program: Program, graph: torch.fx.Graph, root: torch.nn.Module,
                 env: dict[str, torch.fx.Node], index: dict[str, int],
                 hooked: set[str] | frozenset[str] = frozenset()) -> None:
        self.program, self.graph, self.root, self.env, self.index = \
            program, graph, root, env, index
        self.hooked = hooked  # inputs whose conversions are left out (`hooked_inputs`)
        self.device: Any = None
        self.num = 0
        self.deferred, self.final = deferred_outputs(program)
        self.sites = gather_plan(program).site_of()
        # asynchronous conversions not yet waited for: value -> its last forward step
        self.running: dict[str, Step] = {}

    def get_device(self) -> Any:
        if self.device is None:
            first = next((n for n in self.graph.nodes if n.op == "placeholder"), None)
            self.device = (self.graph.call_function(device_of, (first,)) if first is not None
                           else self.graph.call_function(default_device, ()))
        return self.device

    def emit(self, instrs: Sequence[Instr]) -> None:
        program, graph, root, env = self.program, self.graph, self.root, self.env
        for instr in instrs:
            self.num += 1
            num = self.num
            for name in dict.fromkeys(_reads([instr])):  # its inputs' collectives end here
                if name in self.running:
                    wait = f"wait_{_ident(name)}"
                    root.add_module(wait, Wait(self.running.pop(name)))
                    env[name] = graph.call_module(wait, (env[name],))
            if isinstance(instr, ConvertInstr) and instr.src in self.hooked:
                env[instr.dst.name] = env[instr.src]  # identity: its gradient is hooked
                continue
            if isinstance(instr, ConvertInstr):
                name = f"convert_{num}"
                root.add_module(name, Convert(instr.forward.steps, instr.backward.steps,
                                              self.index.get(instr.src),
                                              f"{program.name}: %{instr.dst.name} = "
                                              f"convert(%{instr.src}) [{name}]",
                                              self.deferred.get(instr.dst.name),
                                              self.sites.get(instr.dst.name),
                                              (block_name(instr.src), instr.src),
                                              instr.asynchronous,
                                              instr.cast, instr.grad_dtype))
                node = graph.call_module(name, (env[instr.src],))
                if instr.asynchronous and instr.forward.steps:
                    self.running[instr.dst.name] = instr.forward.steps[-1]
                node.meta["local_shape"] = program.local_shape(instr.dst)
                env[instr.dst.name] = node
                continue
            call = instr.call
            args, kwargs = instr.local_args(lambda name: env[name])
            args = tuple(self.get_device() if a is DEVICE else a for a in args)
            kwargs = {k: self.get_device() if a is DEVICE else a for k, a in kwargs.items()}
            if instr.op.tag(RANDOM) is not None and instr.op.name in PLAN_INDEPENDENT:
                name = f"random_{num}"
                # a generator cannot be written into the module's code: the module holds it
                generator = rng.generator_of(call.target, args, kwargs)
                args = tuple(None if isinstance(a, torch.Generator) else a for a in args)
                kwargs = {k: a for k, a in kwargs.items() if not isinstance(a, torch.Generator)}
                root.add_module(name, RandomDraw(instr.op,
                                                 layout_of(instr.outputs[0].type).dims,
                                                 generator))
                node = graph.call_module(name, args, kwargs)
                if len(instr.outputs) == 1:
                    outs = [node]
                else:
                    outs = [graph.call_function(operator.getitem, (node, i))
                            for i in range(len(instr.outputs))]
                for v, o in zip(instr.outputs, outs):
                    o.meta["local_shape"] = program.local_shape(v)
                    env[v.name] = o
                continue
            target: Any = call.target
            if not instr.op.grad:
                args, target = (target, *args), call_no_grad
            if instr.op.tag(SAVE):
                args, target = (target, *args), saved_call
            node = graph.call_function(target, args, kwargs)
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
                root.add_module(name, GlobalCount(call.count, instr.outputs[0].name,
                                                  final=instr is self.final))
                b = _bound_inputs(instr)
                outs = [graph.call_module(name, (o, env[b["target"]],
                                                 env[b["weight"]] if "weight" in b else None))
                        for o in outs]
            for v, o in zip(instr.outputs, outs):
                o.meta["local_shape"] = program.local_shape(v)
                env[v.name] = o


def deferred_outputs(program: Program) -> tuple[dict[str, int], CallInstr | None]:
    """Which outputs' reductions may wait for a gradient bucket: {local name: output
    index} of outputs made by a conversion that only all-reduces (backward: identity) and
    that nothing else reads; and the counted loss op (`GlobalCount(final=True)`) whose sum
    is output 0 that way, or None."""
    found = program.__dict__.get("_deferred")
    if found is not None:
        return found
    read = set(_reads(program.instrs))
    names = [o.name for o in program.outputs if isinstance(o, Value)]
    made = {i.dst.name: i for i in program.instrs if isinstance(i, ConvertInstr)}
    deferred: dict[str, int] = {}
    for k, o in enumerate(program.outputs):
        c = made.get(o.name) if isinstance(o, Value) else None
        if c is None or o.name in read or names.count(o.name) != 1 or c.backward.steps \
                or not c.forward.steps \
                or any(s.kind != "all_reduce" for s in c.forward.steps):
            continue
        deferred[o.name] = k
    final = None
    first = program.outputs[0] if program.outputs else None
    if isinstance(first, Value) and deferred.get(first.name) == 0:
        src = made[first.name].src
        producers = [i for i in program.instrs if isinstance(i, CallInstr)
                     and any(v.name == src for v in i.outputs)]
        readers = [r for r in _reads(program.instrs) if r == src]
        if len(producers) == 1 and len(readers) == 1 and src not in names:
            p = producers[0]
            if p.call.count is not None and p.call.scale == 1.0 and len(p.outputs) == 1 \
                    and set(p.call.count.axes) == {s.axis for s in made[first.name].forward.steps}:
                final = p
    program.__dict__["_deferred"] = (deferred, final)  # frozen dataclass: no __setattr__
    return deferred, final


def _region_runs(instrs: Sequence[Instr]) -> list[tuple[RecomputeTag | None, list[Instr]]]:
    """Maximal runs of instructions in the same recompute region (None: outside any). A
    conversion belongs to the region of the op after it (the lowering emits conversions
    right before the op that reads them)."""
    regions: list[RecomputeTag | None] = [None] * len(instrs)
    following: RecomputeTag | None = None
    for k in range(len(instrs) - 1, -1, -1):
        instr = instrs[k]
        if isinstance(instr, CallInstr):
            following = instr.op.tag(RECOMPUTE)
        regions[k] = following
    runs: list[tuple[RecomputeTag | None, list[Instr]]] = []
    for instr, region in zip(instrs, regions):
        key = region.region if region is not None else None
        if runs and (runs[-1][0].region if runs[-1][0] is not None else None) == key:
            runs[-1][1].append(instr)
        else:
            runs.append((region, [instr]))
    return runs


def _reads(instrs: Sequence[Instr]) -> list[str]:
    out: list[str] = []
    for i in instrs:
        if isinstance(i, ConvertInstr):
            out.append(i.src)
        else:
            out += [local for _, local in i.inputs]
    return out


def _defines(instr: Instr) -> list[str]:
    if isinstance(instr, ConvertInstr):
        return [instr.dst.name]
    return [v.name for v in instr.outputs]


def _bound_inputs(instr: CallInstr) -> dict[str, str]:
    """The op's tensor arguments by schema name (`self`, `target`, `weight`) -> the local
    value the call reads for them."""
    return {k: instr.local_input(v) for k, v in bind_args(instr.op).items()
            if isinstance(v, Value)}


def _ident(name: str) -> str:
    out = "".join(c if c.isalnum() else "_" for c in name)
    return out if out and not out[0].isdigit() else f"v_{out}"
