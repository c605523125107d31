"""Re-layout steps on real process groups, and the autograd function that converts a value
between layouts (DESIGN.md §7).

`run_steps` executes a `Relayout`'s steps with torch.distributed functional collectives,
one process group per mesh axis. `ConvertFunction` is the conversion rule: forward runs the steps
from the producer's layout L to the layout R the consumer needs; backward runs the steps
from the gradient's layout C (set by the consumer's strategy) to the value's canonical
gradient layout G(L). Megatron's f and g, data parallelism's gradient all-reduce, ZeRO-3's
all-gather / reduce-scatter pair and sequence parallelism are all instances of it.
"""

from __future__ import annotations

import functools
import math
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed._functional_collectives as fc
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pxform.core.errors import CollectiveError, PipelineError, PxformError
from pxform.core.layout import LOCAL_STEPS, Step


@dataclass(frozen=True)
class AxisGroups:
    """This rank's view of the mesh: a process group and this rank's index per axis."""

    groups: Mapping[str, Any]
    index: Mapping[str, int]
    sizes: Mapping[str, int]


@dataclass
class Microbatches:
    """The "group" of a pipeline's microbatch axis (`pxform.lower.mpmd`): its coordinates
    run one after another on this rank. A backward all-reduce over it is the accumulation
    of gradients over microbatches, which autograd does by summing into the same tensors,
    so it runs as the identity; the lowering refuses forward collectives over it. `counts`
    holds loss counts summed over all microbatches before the schedule starts."""

    counts: dict[str, torch.Tensor] = field(default_factory=dict)


def run_step(x: torch.Tensor, step: Step, axes: AxisGroups, wait: bool = True
             ) -> torch.Tensor:
    """Execute one step on this rank's local tensor. A collective that does not complete
    (a peer failed or runs another program, and the mesh's timeout passed) raises a
    `CollectiveError` naming this rank and the step. Without `wait`, an all-gather,
    reduce-scatter or all-reduce returns as soon as it is launched: the result is waited
    for where it is first used (`wait_async`, or any op reading it)."""
    try:
        return _run_step(x, step, axes, wait)
    except RuntimeError as exc:
        if isinstance(exc, PxformError) or step.kind in LOCAL_STEPS:
            raise
        raise collective_error(exc, str(step), step.axis, axes) from exc


def collective_error(exc: BaseException, what: str, axis: str, axes: AxisGroups
                     ) -> CollectiveError:
    """The error for a collective `what` over `axis` that did not complete (`exc`)."""
    return peer_error(exc, f"{what} over mesh axis {axis!r} ({axes.sizes[axis]} ranks, "
                           f"this one at index {axes.index[axis]})")


def peer_error(exc: BaseException, subject: str) -> CollectiveError:
    """The error for a transfer `subject` (a collective, a pipeline send or receive) that
    did not complete (`exc`): this rank, what waited, and the fix."""
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveError(
        f"pxform: rank {rank}: {subject} did not complete: "
        f"{str(exc).splitlines()[0] if str(exc) else type(exc).__name__}.\n  Another "
        f"rank failed or runs a different program (its own error says why), or the step "
        f"is slower than the mesh's timeout.\n  Fix: make every rank run the same "
        f"program on the same shapes; for a legitimately slow step raise the timeout: "
        f"pxform.Mesh(..., timeout=seconds) or PXFORM_TIMEOUT_S.")


def _run_step(x: torch.Tensor, step: Step, axes: AxisGroups, wait: bool = True
              ) -> torch.Tensor:
    a = step.axis
    n = axes.sizes[a]
    if n == 1:
        return x  # a size-1 axis moves nothing
    group = axes.groups[a]
    if isinstance(group, Microbatches) and step.kind not in LOCAL_STEPS:
        if step.kind == "all_reduce":
            return x
        # a lowering gap, not a peer's failure: said as it is (not as a collective that
        # timed out)
        raise PipelineError(f"pxform: {step} over the microbatch axis cannot run: "
                            f"microbatches run one at a time")
    done = fc.wait_tensor if wait else _launched
    if step.kind == "all_gather":
        gather_dim = step.dim
        assert gather_dim is not None
        src = x.contiguous()
        if not _chunks_view(x, gather_dim):
            # the chunks must be copied into place: the gathered buffer is a temporary
            # (torch would wait here too, to concatenate)
            raw = settled(group, src, True, lambda: fc.wait_tensor(all_gather(src, 0, group)))
            out = torch.cat(raw.chunk(n), dim=gather_dim)
            free_now(raw)
            return out
        return settled(group, src, wait, lambda: done(all_gather(src, gather_dim, group)))
    if step.kind == "reduce_scatter":
        scatter_dim = step.dim
        assert scatter_dim is not None
        if scatter_dim == 0 or not wait:
            src = x.contiguous()
            return settled(group, src, wait, lambda: done(launch(group, functools.partial(
                fc.reduce_scatter_single, src, "sum", scatter_dim, group))))
        # every rank's piece made contiguous along dim 0: a temporary the collective reads
        send = torch.cat(x.chunk(n, dim=scatter_dim))
        out = fc.wait_tensor(launch(group, lambda: fc.reduce_scatter_single(send, "sum", 0,
                                                                              group)))
        free_now(send)
        return out
    if step.kind == "all_reduce":
        if not wait:
            return done(launch(group, lambda: fc.all_reduce(x.contiguous(), "sum", group)))
        # in place on a copy of our own (what the functional all-reduce does inside): its
        # work object holds the result, not the input, so the copy is what `settled`
        # waits for gloo to let go of
        buf = x.clone(memory_format=torch.contiguous_format)
        return settled(group, buf, True, lambda: fc.wait_tensor(launch(
            group, lambda: torch.ops._c10d_functional.all_reduce_(buf, "sum",
                                                                    group.group_name))))
    if step.kind == "all_to_all":
        assert step.dim is not None and step.to_dim is not None
        send = torch.stack(x.chunk(n, dim=step.to_dim), dim=0).contiguous()
        recv = fc.wait_tensor(launch(group, lambda: fc.all_to_all_single(send, None, None,
                                                                           group)))
        out = torch.cat(list(recv.unbind(0)), dim=step.dim)
        free_now(send)
        free_now(recv)
        return out
    if step.kind == "slice":
        assert step.dim is not None
        return x.chunk(n, dim=step.dim)[axes.index[a]].contiguous()
    if step.kind == "zero":
        return x if axes.index[a] == 0 else torch.zeros_like(x)
    if step.kind == "pad":  # this rank's piece in place, zeros for the others' pieces
        assert step.dim is not None
        size = x.shape[step.dim]
        shape = list(x.shape)
        shape[step.dim] = size * n
        out = x.new_zeros(shape)
        out.narrow(step.dim, axes.index[a] * size, size).copy_(x)
        return out
    raise ValueError(f"run_step: unknown step {step}")


def local_shard(full: torch.Tensor, layout: Any, axes: AxisGroups) -> torch.Tensor:
    """This rank's piece of a full tensor under a layout without partial axes (each axis of
    a dim takes successive contiguous chunks, outer axis first)."""
    out = full
    for d, dim_axes in enumerate(layout.dims):
        for a in dim_axes:
            out = out.chunk(axes.sizes[a], dim=d)[axes.index[a]]
    # a partial sum: the whole value on index 0 of each partial axis, zeros elsewhere
    if any(axes.index[a] != 0 for a in layout.partial):
        out = torch.zeros_like(out)
    return out.contiguous()


# The collective each gloo process group has in flight (`launch`), and per group whether
# it runs one at a time
_IN_FLIGHT: dict[Any, weakref.ref] = {}
_ONE_AT_A_TIME: dict[Any, bool] = {}


def launch(group: Any, start: Callable[[], torch.Tensor]) -> torch.Tensor:
    """Launch a collective on `group` (`start()` returns its pending result: waited for
    where it is used). Every collective a program runs goes through here (conversions,
    gradient buckets, prefetched gathers, loss counts). On gloo (torch
    2.13) collectives in flight together on one process group corrupt the heap or hang:
    3,000 rounds of 2 or 6 concurrent `all_gather_single` calls killed 3 of 4 runs; with
    all-reduces and reduce-scatters mixed in, 1 run in 3 hung; and on 2026-11-27 a
    tensor-parallel chain whose parameters are gathered at use (its gradient buckets'
    reduce-scatters in flight beside the next step's prefetched all-gather) hung within
    1,500 steps, one rank waiting for a reduce-scatter its peer had finished. So on gloo a
    collective first waits for the one before it on its group. Compute still overlaps the
    collective in flight (a gradient bucket's all-reduce runs under the next blocks'
    backward); only two collectives no longer overlap each other. NCCL runs a group's
    collectives in order on one stream and needs no gate."""
    if not _one_at_a_time(group):
        return start()
    before = _IN_FLIGHT.pop(group, None)
    pending = before() if before is not None else None
    if pending is not None:
        _wait_pending(pending)
    out = start()
    _IN_FLIGHT[group] = weakref.ref(out)
    return out


def _wait_pending(pending: torch.Tensor) -> None:
    """Wait for a launched collective (a functional collective's result, or the buffer of
    an in-place one); waiting again where it is used does nothing more."""
    if isinstance(pending, fc.AsyncCollectiveTensor):
        if not pending.completed:
            pending.trigger_wait()
    else:
        fc.wait_tensor(pending)


def _one_at_a_time(group: Any) -> bool:
    known = _ONE_AT_A_TIME.get(group)
    if known is None:
        import torch.distributed as dist

        try:
            known = dist.get_backend(group) == "gloo"
        except (RuntimeError, ValueError, TypeError, AttributeError):  # not a process group
            known = False
        _ONE_AT_A_TIME[group] = known
    return known


def all_gather(x: torch.Tensor, dim: int, group: Any) -> torch.Tensor:
    """Launch an all-gather of `x` along `dim` over `group` (a functional collective: the
    result is waited for where it is used), one at a time on gloo (`launch`)."""
    return launch(group, lambda: fc.all_gather_single(x, dim, group))


def _chunks_view(x: torch.Tensor, dim: int) -> bool:
    """Whether all-gathering `x` along `dim` over n ranks can return a view of the gathered
    buffer (rank-major along dim 0): along dim 0, or when every dim before `dim` has size 1
    (`torch.distributed._functional_collectives.all_gather_single`'s own test)."""
    return dim == 0 or math.prod(x.shape[:dim]) == 1


_RESIZE_STORAGE = torch.ops.inductor.resize_storage_bytes_.default


def free_now(buffer: torch.Tensor) -> None:
    """Free the memory of `buffer`, a collective's temporary that nothing reads once the
    collective has been waited for (the gathered chunks before they are put in place, a
    reduce-scatter's or all-to-all's rearranged input). Dropping the last Python reference
    is not enough: the process group's work object holds its buffers until its worker
    thread lets go of the work, which on gloo can come well after the caller has gone on.
    Measured here (2026-11-26): the peak of one tensor-parallel GPT step, same program, same
    inputs, moved between 10.9 and 13.6 MiB from call to call on one rank, the 2 MiB
    gathered logits still alive beside their concatenation and its log-softmax. The
    storage is resized to nothing (as FSDP2 frees unsharded parameters), through the
    dispatcher so that `pxform.MemoryMeter` sees it."""
    _RESIZE_STORAGE(buffer, 0)


# How long a caller waits, after a collective on gloo has completed, for the process
# group's worker thread to let go of the collective's input and result (`settled`); per
# group, the waits that ran out (after `_RAN_OUT` of them it waits no more: something
# else holds them)
LET_GO_S = 0.05
_RAN_OUT = 3
_RUNS_OUT: dict[Any, int] = {}


def settled(group: Any, src: torch.Tensor, wait: bool, run: Callable[[], torch.Tensor]
            ) -> torch.Tensor:
    """`run()`, a collective on `group` that reads `src`; when `wait` (the collective is
    waited for in `run`), on gloo also until the group's worker thread has let go of the
    collective's input and result.

    The work object holds both until that thread drops it, after it has woken the caller.
    With 2 ranks on 2 cores, 1-10 % of the all-gathers and 4-14 % of the all-reduces of a
    loop returned while it still held them, for 0.1-0.4 ms (2026-11-28), and a tensor
    nothing else read outlived the ops after it: a sequence-parallel GPT step's peak took
    in a 2 MiB all-reduce result in one call of 30 on one rank, in 4 accuracy runs of 5
    (`docs/benchmarks/accuracy.md`, eighteenth session). The caller yields until what
    holds the input is back to what held it before the launch and the result is held by
    nothing but the caller, for at most `LET_GO_S` (after three waits that ran out, no
    more on that group: something else holds them). NCCL's work objects live on for its
    watchdog, so only gloo waits.

    Example:
        >>> src = x.contiguous()
        >>> out = settled(group, src, True, lambda: fc.wait_tensor(all_gather(src, 0, group)))
    """
    storage_count = getattr(torch._C, "_storage_Use_Count", None)
    # a wrapper (a collective's result still in flight, left by `run_step(wait=False)`)
    # has no memory of its own to watch: its collective reads what it wraps
    if (not wait or storage_count is None or is_traceable_wrapper_subclass(src)
            or not _one_at_a_time(group) or _RUNS_OUT.get(group, 0) >= _RAN_OUT):
        return run()
    # what holds the input: the work holds the tensor itself (its count), or views of its
    # memory (its storage's count, this handle of it included)
    storage = src.untyped_storage()

    def holders() -> tuple[int, int]:
        return _holders_of(src), storage_count(storage._cdata)

    held = holders()
    out = run()

    def let_go() -> bool:  # of the input and of the result (which only `out` holds)
        return (all(now <= then for now, then in zip(holders(), held))
                and _holders_of(out) <= 1)

    if not let_go():
        deadline = time.perf_counter() + LET_GO_S
        while not let_go():
            if time.perf_counter() > deadline:
                _RUNS_OUT[group] = _RUNS_OUT.get(group, 0) + 1
                break
            time.sleep(0)  # a core for the worker thread
    return out


def let_go_timeouts() -> int:
    """How many of this process's waits for gloo's worker thread to let go of a
    collective's buffers ran out (`settled`, after `LET_GO_S`), over all groups. After
    `_RAN_OUT` of them on a group it waits no more there, and a step's peak may then take
    in a buffer the thread still holds (benchmarks report it beside their peaks).

    Example:
        >>> let_go_timeouts()
        0
    """
    return sum(_RUNS_OUT.values())


def _holders_of(t: torch.Tensor) -> int:
    """How many references hold the tensor `t` itself (its views aside)."""
    return int(t._use_count())  # type: ignore[attr-defined]


def _launched(x: torch.Tensor) -> torch.Tensor:
    return x  # an AsyncCollectiveTensor: the first op that reads it waits


def run_steps(x: torch.Tensor, steps: Sequence[Step], axes: AxisGroups, wait: bool = True
              ) -> torch.Tensor:
    """Execute `steps` in turn; without `wait`, the last one's collective is left running
    (`run_step`)."""
    for k, step in enumerate(steps):
        x = run_step(x, step, axes, wait or k < len(steps) - 1)
    return x


def wait_async(x: Any, step: Step, axes: AxisGroups) -> Any:
    """`x` once the collective `step` that makes it (left running by `run_step`) has
    completed; the identity for autograd (torch registers `wait_tensor`'s backward as the
    identity). A collective that fails here raises the `CollectiveError` `run_step` would
    have raised."""
    if not isinstance(x, fc.AsyncCollectiveTensor):
        return x
    try:
        return fc.wait_tensor(x)
    except RuntimeError as exc:
        if isinstance(exc, PxformError):
            raise
        raise collective_error(exc, str(step), step.axis, axes) from exc


class ConvertFunction(torch.autograd.Function):
    """Forward: `forward_steps` (L -> R). Backward: `backward_steps` (C -> G(L)). With
    `cast`, forward casts first (a parameter used in the compute dtype: ZeRO-3 gathers the
    cast shard) and backward casts the gradient to `grad_dtype` before its steps (the reduce
    dtype) and returns it in the input's dtype."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_steps: tuple[Step, ...],  # type: ignore[override]
                backward_steps: tuple[Step, ...], axes: AxisGroups,
                given: torch.Tensor | None = None, wait: bool = True,
                cast: torch.dtype | None = None, grad_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
        ctx.backward_steps = backward_steps
        ctx.axes = axes
        ctx.wait = wait
        ctx.dtype = x.dtype
        ctx.grad_dtype = grad_dtype
        # `given`: the forward steps' result, computed already (a prefetched gather)
        if given is None:
            given = run_steps(x if cast is None else x.to(cast), forward_steps, axes, wait)
        # autograd needs a new tensor object even when no step ran (identity forward)
        return given.view_as(given) if given is x else given

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        if grad is None:
            return (None,) * 8
        if ctx.grad_dtype is not None:
            grad = grad.to(ctx.grad_dtype)
        # not waiting: autograd goes on with other work (another coshard piece's backward)
        # and the op that reads this gradient waits for it
        out = run_steps(grad, ctx.backward_steps, ctx.axes, ctx.wait)
        return (out.to(ctx.dtype),) + (None,) * 7


def convert(x: torch.Tensor, forward_steps: tuple[Step, ...], backward_steps: tuple[Step, ...],
            axes: AxisGroups, given: torch.Tensor | None = None, wait: bool = True,
            cast: torch.dtype | None = None, grad_dtype: torch.dtype | None = None
            ) -> torch.Tensor:
    """Apply the conversion rule to one local tensor (autograd-aware when x needs grad).
    `given` is the forward steps' result when it was computed ahead (prefetched). Without
    `wait`, the last collective of each direction is left running (`run_step`). `cast`
    and `grad_dtype`: see `ConvertFunction`."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        if given is not None:
            return given
        return run_steps(x if cast is None else x.to(cast), forward_steps, axes, wait)
    return ConvertFunction.apply(x, forward_steps, backward_steps, axes, given, wait, cast,
                                 grad_dtype)


def all_reduce_sum(x: torch.Tensor, axes: Sequence[str], groups: AxisGroups) -> torch.Tensor:
    """Sum `x` over the given mesh axes (no autograd: used for counts)."""
    for a in axes:
        if groups.sizes[a] > 1:
            x = fc.wait_tensor(launch(groups.groups[a],
                                      functools.partial(fc.all_reduce, x.contiguous(), "sum",
                                                        groups.groups[a])))
    return x
