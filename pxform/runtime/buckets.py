"""Gradient buckets: parameter-gradient collectives packed into few large ones, launched
while backward is still running, completed before gradients are returned (as DDP does).

A parameter's gradient reaches the conversion that read the parameter in the consumer's
layout C; the conversion's backward steps take it to G(L) (DP: `all_reduce(dp)`; ZeRO-3:
`reduce_scatter(dp, dim 0)`). For program inputs that need gradients, the conversion hands
its gradient and steps to `GradBuckets.add` instead of running them. Gradients whose steps
agree on kinds, axes and dtype share a bucket; when a bucket holds `bucket_bytes`, or when
the last gradient of its kind that the forward pass announced (`expect`) has arrived, its
first collective is launched (functional collectives return at once; the wait comes in
`finish`). So, as in DDP, the last bucket too is launched inside backward.

Packing one step over many tensors of different shapes:

    all_reduce(a)           concatenate flattened gradients; split back.
    reduce_scatter(a, d)    chunk each gradient into n pieces along its own d; lay the buffer
                            out rank-major (all tensors' piece 0, then piece 1, ...), so one
                            reduce-scatter of the buffer hands each rank its pieces.
    all_gather(a, d)        concatenate; gather rank-major; cut each tensor's segment out of
                            every rank's part and concatenate along d.
    others (local steps, all_to_all) run per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed._functional_collectives as fc

from pxform.core.errors import PxformError
from pxform.core.layout import Step
from pxform.runtime.collectives import AxisGroups, all_gather, collective_error, launch, run_step

DEFAULT_BUCKET_MB = 25.0


class GradSink(Protocol):
    """Where conversions send parameter gradients: `GradBuckets` or `GradAccumulator`."""

    def expect(self, steps: tuple[Step, ...], like: torch.Tensor) -> None: ...

    def add(self, key: int, grad: torch.Tensor, steps: tuple[Step, ...],
            dtype: torch.dtype | None = None) -> None: ...


# A bucket entry's key: a program input's index (a parameter gradient), or a tuple naming a
# value the forward pass deferred (`GradBuckets.add_value`: the loss, its target count).
Key = int | tuple[str, int]


@dataclass
class _Bucket:
    steps: tuple[tuple[str, str], ...]
    keys: list[Key] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    step_lists: list[tuple[Step, ...]] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Launched:
    """A bucket whose first step is in flight: `pending` is the collective's result."""

    bucket: _Bucket
    pending: torch.Tensor
    shapes: list[tuple[int, ...]]
    in_backward: bool


@dataclass
class BucketStats:
    """What the buckets did in one backward pass (read by tests and benchmarks)."""

    launched: int = 0
    launched_in_backward: int = 0
    tensors: int = 0
    bytes: int = 0


class GradBuckets:
    """Collects parameter gradients during one backward pass.

    Example:
        >>> buckets = GradBuckets(axes, bucket_bytes=25 * 2**20)
        >>> # conversions call buckets.add(index, grad, steps) from their backward
        >>> grads = buckets.finish()          # {input index: reduced gradient}
    """

    def __init__(self, axes: AxisGroups, bucket_bytes: int,
                 blocks: Mapping[int, str] | None = None) -> None:
        self.axes = axes
        self.bucket_bytes = bucket_bytes
        # the block of each parameter (`pxform.core.ir.block_name`): reduce-scatters
        # (ZeRO-3) go out per block, as FSDP's do, so a block's whole gradients are freed
        # as soon as its backward is done instead of waiting for a full bucket
        self.blocks = blocks or {}
        self.open: dict[tuple, _Bucket] = {}
        self.launched: list[_Launched] = []
        self.stats = BucketStats()
        self.expected: dict[tuple, int] = {}
        self.arrived: dict[tuple, int] = {}
        self._finishing = False
        self.values: dict[tuple[str, int], torch.Tensor] = {}  # deferred values, reduced
        self.value_dtypes: dict[tuple[str, int], torch.dtype] = {}  # those sent wider
        # what the loss was divided by before its count was known (`GlobalCount.final`)
        self.count_scale: float | None = None
        self.out_dtypes: dict[int, torch.dtype] = {}  # gradients reduced in another dtype
        # inputs whose gradients came from a tensor hook (`graph_module.hook_gradients`):
        # what autograd returns for them is an expanded zero, not a part of the gradient
        self.hooked: set[int] = set()
        self._zeros: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def zero(self, like: torch.Tensor) -> torch.Tensor:
        """A zero scalar of `like`'s dtype and device, made once per step (what a
        gradient hook gives autograd back, expanded)."""
        key = (like.dtype, like.device)
        zero = self._zeros.get(key)
        if zero is None:
            zero = self._zeros[key] = like.new_zeros(())
        return zero

    @staticmethod
    def _signature(steps: tuple[Step, ...], like: torch.Tensor) -> tuple:
        return (tuple((s.kind, s.axis) for s in steps), like.dtype, like.device)

    def expect(self, steps: tuple[Step, ...], like: torch.Tensor) -> None:
        """Announce (from forward) a gradient that backward will `add`."""
        sig = self._signature(steps, like)
        self.expected[sig] = self.expected.get(sig, 0) + 1

    def add_value(self, key: tuple[str, int], value: torch.Tensor,
                  steps: tuple[Step, ...]) -> None:
        """Queue a forward value whose reduction (`steps`, all-reduces) can wait for a
        bucket: it rides in the first bucket of its kind launched after it, instead of a
        collective of its own (a data-parallel loss). `finish` leaves it in `values`."""
        sig = self._signature(steps, value)
        if sig not in self.expected:
            # no gradient of its dtype: ride with gradients of a wider floating dtype
            # (a float32 loss of float64 parameters), cast back in `finish`, exactly
            wider = [k for k in self.expected if k[0] == sig[0] and k[2] == sig[2]
                     and k[1].is_floating_point and k[1].itemsize > value.dtype.itemsize]
            if wider:
                sig = wider[0]
                self.value_dtypes[key] = value.dtype
                value = value.to(sig[1])
        self._put(self._bucket(sig), key, value.detach(), steps)

    def add(self, key: int, grad: torch.Tensor, steps: tuple[Step, ...],
            dtype: torch.dtype | None = None) -> None:
        """Queue the gradient of program input `key`, to be taken through `steps` and
        returned in `dtype` (the parameter's, when it is reduced in another: mixed
        precision; None: as it came)."""
        if dtype is not None and dtype != grad.dtype:
            self.out_dtypes[key] = dtype
        if not self.arrived:  # backward has begun: deferred values no gradient will join
            for lone in [sig for sig in self.open if not self.expected.get(sig)]:
                self._launch(self.open.pop(lone))
        sig = self._signature(steps, grad)
        bucket = self.open.get(sig)
        if bucket is not None and steps[0].kind == "reduce_scatter" and bucket.keys and \
                self.blocks.get(key) != self.blocks.get(bucket.keys[-1]):  # type: ignore[arg-type]
            del self.open[sig]  # the previous block's gradients are all in: send them
            self._launch(bucket)
        bucket = self._bucket(sig)
        self._put(bucket, key, grad, steps)
        self.arrived[sig] = self.arrived.get(sig, 0) + 1
        if bucket.nbytes >= self.bucket_bytes or self.arrived[sig] == self.expected.get(sig):
            del self.open[sig]
            self._launch(bucket)

    def _bucket(self, sig: tuple) -> _Bucket:
        """The open bucket for signature `sig`, opened if there is none."""
        bucket = self.open.get(sig)
        if bucket is None:
            bucket = self.open[sig] = _Bucket(sig[0])
        return bucket

    @staticmethod
    def _put(bucket: _Bucket, key: Key, grad: torch.Tensor, steps: tuple[Step, ...]) -> None:
        bucket.keys.append(key)
        bucket.grads.append(grad.contiguous())
        bucket.step_lists.append(steps)
        bucket.nbytes += grad.numel() * grad.element_size()

    def _launch(self, bucket: _Bucket) -> None:
        first = [steps[0] for steps in bucket.step_lists]
        shapes = [tuple(g.shape) for g in bucket.grads]
        pending = _start(bucket.grads, first, self.axes)
        bucket.grads = []  # packed into `pending`: the whole gradients can be freed now
        self.launched.append(_Launched(bucket, pending, shapes, not self._finishing))
        self.stats.launched += 1
        self.stats.launched_in_backward += not self._finishing
        self.stats.tensors += len(shapes)
        self.stats.bytes += bucket.nbytes

    def finish(self) -> dict[int, torch.Tensor]:
        """Launch what is left, wait for everything and return the gradients, summed per
        input (an input read in two layouts gets two contributions)."""
        self._finishing = True
        for bucket in list(self.open.values()):
            self._launch(bucket)
        self.open.clear()
        out: dict[int, torch.Tensor] = {}
        for item in self.launched:
            bucket = item.bucket
            first = [steps[0] for steps in bucket.step_lists]
            try:
                done = fc.wait_tensor(item.pending)
            except RuntimeError as exc:
                raise _packed_error(exc, first, len(item.shapes), self.axes) from exc
            grads = _end(done, first, item.shapes, self.axes)
            for key, g, steps in zip(bucket.keys, grads, bucket.step_lists):
                for step in steps[1:]:
                    g = run_step(g, step, self.axes)
                if isinstance(key, tuple):
                    self.values[key] = g.to(self.value_dtypes.get(key, g.dtype))
                else:
                    out[key] = g if key not in out else out[key] + g
        self.launched.clear()
        for key, dtype in self.out_dtypes.items():
            if key in out:
                out[key] = out[key].to(dtype)
        return out


# ---------------------------------------------------------------- packing

def _start(grads: Sequence[torch.Tensor], steps: Sequence[Step], axes: AxisGroups
           ) -> torch.Tensor:
    """Pack `grads` and launch their (common-kind) first step; returns the pending result."""
    kind, axis = steps[0].kind, steps[0].axis
    n = axes.sizes[axis]
    if n == 1 or kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        return torch.cat([g.reshape(-1) for g in grads])  # run per tensor in _end
    group = axes.groups[axis]
    if kind == "all_reduce":
        # in place on the packed buffer: the functional `all_reduce` would copy it first
        # (measured: 1.5 ms of a 55 ms data-parallel step for 3.3 MiB of gradients)
        flat = torch.cat([g.reshape(-1) for g in grads])
        return launch(group, lambda: torch.ops._c10d_functional.all_reduce_(
            flat, "sum", group.group_name))
    if kind == "all_gather":
        return all_gather(torch.cat([g.reshape(-1) for g in grads]), 0, group)
    pieces = [g.chunk(n, dim=_dim(s)) for g, s in zip(grads, steps)]
    flat = torch.cat([p[r].reshape(-1) for r in range(n) for p in pieces])
    return launch(group, lambda: fc.reduce_scatter_single(flat, "sum", 0, group))


def _end(buffer: torch.Tensor, steps: Sequence[Step], shapes: Sequence[tuple[int, ...]],
         axes: AxisGroups) -> list[torch.Tensor]:
    """Unpack the finished first step into one tensor per gradient."""
    kind, axis = steps[0].kind, steps[0].axis
    n = axes.sizes[axis]
    sizes = [math.prod(s) for s in shapes]
    if n == 1 or kind not in ("all_reduce", "reduce_scatter", "all_gather"):
        return [run_step(b.view(s), step, axes)
                for b, s, step in zip(buffer.split(sizes), shapes, steps)]
    if kind == "all_reduce":
        return [b.view(s) for b, s in zip(buffer.split(sizes), shapes)]
    if kind == "reduce_scatter":
        local = []
        for shape, step in zip(shapes, steps):
            assert step.dim is not None
            piece = list(shape)
            piece[step.dim] //= n
            local.append(tuple(piece))
        return [b.view(s) for b, s in zip(buffer.split([math.prod(p) for p in local]), local)]
    per_rank = buffer.view(n, -1)
    out = []
    offset = 0
    for size, shape, step in zip(sizes, shapes, steps):
        parts = [per_rank[r, offset:offset + size].view(shape) for r in range(n)]
        out.append(torch.cat(parts, dim=_dim(step)))
        offset += size
    return out


def start_gather(shards: Sequence[torch.Tensor], steps: Sequence[Step], axes: AxisGroups
                 ) -> torch.Tensor:
    """Launch one packed all-gather of `shards` (each gathered by its `steps`, all
    `all_gather` on one axis); returns the pending result for `finish_gather`."""
    try:
        return _start(shards, steps, axes)
    except RuntimeError as exc:
        raise _packed_error(exc, steps, len(shards), axes) from exc


def finish_gather(pending: torch.Tensor, step_lists: Sequence[tuple[Step, ...]],
                  shapes: Sequence[tuple[int, ...]], axes: AxisGroups) -> list[torch.Tensor]:
    """Wait for a `start_gather` (of the first step of each of `step_lists`), cut the
    gathered tensors out of its buffer and run each one's remaining steps. A gather that
    does not complete raises `CollectiveError` naming this rank."""
    steps = [s[0] for s in step_lists]
    try:
        done = fc.wait_tensor(pending)
    except RuntimeError as exc:
        raise _packed_error(exc, steps, len(shapes), axes) from exc
    out = []
    for full, rest in zip(_end(done, steps, shapes, axes), step_lists):
        for step in rest[1:]:
            full = run_step(full, step, axes)
        out.append(full)
    return out


def _packed_error(exc: RuntimeError, steps: Sequence[Step], num: int,
                  axes: AxisGroups) -> Exception:
    if isinstance(exc, PxformError):
        return exc
    return collective_error(exc, f"{steps[0]} (one packed collective for {num} tensor(s))",
                            steps[0].axis, axes)


def _dim(step: Step) -> int:
    assert step.dim is not None, step
    return step.dim


class GradAccumulator:
    """`GradBuckets` for a pipeline: parameter gradients arrive once per microbatch; they
    are summed per input and layout (the accumulation over microbatches is the all-reduce
    over the microbatch axis, so those steps are dropped), and the remaining collectives
    run once, bucketed, in `finish` after the last microbatch.

    Example:
        >>> acc = GradAccumulator(axes, 25 * 2**20, microbatch_axis="mb")
        >>> grads = acc.finish()          # {input index: reduced gradient}
    """

    def __init__(self, axes: AxisGroups, bucket_bytes: int, microbatch_axis: str) -> None:
        self.axes = axes
        self.bucket_bytes = bucket_bytes
        self.microbatch_axis = microbatch_axis
        self.sums: dict[tuple[int, tuple[Step, ...]], torch.Tensor] = {}
        # the sums this accumulator allocated: added to in place, without a second buffer
        # of the parameter's size for a moment (a zero-bubble W's accumulation, with its
        # stage's weight gradients held, took its peak there)
        self.owned: set[tuple[int, tuple[Step, ...]]] = set()
        self.stats = BucketStats()
        self.out_dtypes: dict[int, torch.dtype] = {}

    def expect(self, steps: tuple[Step, ...], like: torch.Tensor) -> None:
        """Nothing to announce: every collective runs after the last microbatch."""

    def add(self, key: int, grad: torch.Tensor, steps: tuple[Step, ...],
            dtype: torch.dtype | None = None) -> None:
        # mixed precision: microbatch gradients are summed in the reduce dtype (Megatron's
        # float32 accumulation buffers) and returned in the parameter's
        if dtype is not None and dtype != grad.dtype:
            self.out_dtypes[key] = dtype
        slot = (key, steps)
        if slot in self.owned:
            self.sums[slot].add_(grad)
        elif slot in self.sums:
            # a sum of its own from the second microbatch on, added to in place after:
            # the first gradient is autograd's, which may share its memory
            self.sums[slot] = self.sums[slot] + grad
            self.owned.add(slot)
        else:
            self.sums[slot] = grad

    def finish(self) -> dict[int, torch.Tensor]:
        buckets = GradBuckets(self.axes, self.bucket_bytes)
        out: dict[int, torch.Tensor] = {}
        for (key, steps), grad in self.sums.items():
            rest = tuple(s for s in steps
                         if not (s.axis == self.microbatch_axis and s.kind == "all_reduce"))
            if rest:
                buckets.add(key, grad, rest)
            else:
                out[key] = grad if key not in out else out[key] + grad
        for key, grad in buckets.finish().items():
            out[key] = grad if key not in out else out[key] + grad
        for key, dtype in self.out_dtypes.items():
            if key in out:
                out[key] = out[key].to(dtype)
        self.stats = buckets.stats
        self.sums.clear()
        return out
