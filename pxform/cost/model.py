"""The cost model of the search: time and memory of ops, re-layouts and pipeline stages.

Every number the search compares comes from here, from a `Hardware` profile (a preset or
one measured by `pxform calibrate`) and from the traced graph:

- **compute**: an op's FLOPs (its rule's count) over the device's effective FLOP/s for the
  op's dtype (peak x efficiency, or measured). Backward costs twice the forward (the
  standard 1:2 ratio of matmul-dominated models: one matmul for the input gradient, one for
  the weight gradient); a recomputed block runs its forward once more.
- **communication**: each collective a re-layout needs (`pxform.core.layout.plan_relayout`,
  the same planner the lowering uses) costs `Hardware.comm_time(kind, bytes sent, group
  size, link level)`: latency plus bytes over bandwidth, or the measured table. The link
  level of a mesh axis is the slowest link its groups cross (inside a node or across).
- **overlap**: parameter-gradient reductions (data parallel's all-reduce, ZeRO-3's
  reduce-scatter) run while backward computes, as DDP and pxform's buckets do. Both slow
  down when they overlap: Galvatron-BMW (Wang et al., TPDS 2024, §4.2) measured about 1.3x
  on A100 nodes, which is `OVERLAP_SLOWDOWN`. The backward of a block then takes
  `max(c, g) + (OVERLAP_SLOWDOWN - 1) x min(c, g)` for compute `c` and gradient
  communication `g`: no overlap benefit is claimed for the shorter one. Only transfers
  overlap: what a collective costs the rank's own thread (`collective_overhead_s`, the
  copy that packs a bucket) is added to the backward (`pxform.search.blockcost.walk`).
- **memory per device**: parameters, their gradients and the optimizer state
  (`state_bytes_per_param`), for the local shard a layout gives; plus the activations the
  ops save for backward, measured on fake tensors under saved-tensor hooks
  (`saved_bytes_per_op`), never guessed.

Example:
    >>> model = CostModel(pxform.hardware.hardware("a100-80gb"))
    >>> model.state_bytes_per_param(torch.bfloat16)
    16.0
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pxform.core.ir import Graph, Op, read_from_outside
from pxform.core.layout import LOCAL_STEPS, Relayout
from pxform.frontend.trace import run_graph

if TYPE_CHECKING:
    from pxform.cost.hardware import Hardware

OVERLAP_SLOWDOWN = 1.3
"""Slowdown of compute and communication running at the same time (Galvatron-BMW, measured
about 1.3x for data-parallel gradient all-reduce during backward on A100 nodes)."""

BACKWARD_RATIO = 2.0
"""Backward FLOPs per forward FLOP: input gradient and weight gradient are one matmul each.
Used where the profile has no measured curve for an op's class (`Hardware.op_curves`)."""

_MATMUL = frozenset({
    "linear", "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "einsum", "mv", "addmv",
    "dot", "vdot", "tensordot", "bilinear", "conv1d", "conv2d", "conv3d", "convolution",
    "_convolution", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"})
_ATTENTION = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math"})
_SOFTMAX = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax",
                      "cross_entropy_loss", "logsumexp", "_safe_softmax"})
_TRANSCENDENTAL = frozenset({
    "mish", "tanh", "sigmoid", "logsigmoid", "softplus", "elu", "selu",
    "celu", "exp", "exp2", "expm1", "log", "log1p", "log2", "log10", "erf", "erfc",
    "erfinv", "pow", "rsqrt", "sqrt", "sin", "cos", "tan", "asin", "acos", "atan",
    "sinh", "cosh", "asinh", "acosh", "atanh", "lgamma", "digamma", "glu", "hardswish",
    "hardsigmoid", "reciprocal"})
_NORM = frozenset({
    "layer_norm", "native_layer_norm", "batch_norm", "native_batch_norm",
    "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "group_norm", "native_group_norm",
    "instance_norm", "rms_norm", "_fused_rms_norm"})


def op_class(target: Any, view: bool = False, kwargs: Mapping[str, Any] | None = None
             ) -> str:
    """The class whose measured curve prices an op (`Hardware.op_curves`,
    `pxform.cost.hardware.OP_CLASSES`): "matmul", "attention", "gelu", "gelu_tanh" (GELU's
    tanh approximation, `kwargs` says), "silu", "softmax" (log-softmax and cross-entropy
    too), "transcendental" (other exponentials, logarithms, trigonometry, powers), "norm",
    or "elementwise" (anything else that moves bytes); or "view" (`view`: it aliases its
    input and costs the host time only).

    Example:
        >>> op_class(torch.ops.aten.gelu.default), op_class(torch.ops.aten.add.Tensor)
        ('gelu', 'elementwise')
    """
    if view:
        return "view"
    name = getattr(target, "__name__", str(target))
    name = name.split(".")[0] if "." in name else name
    if name == "gelu":
        return "gelu_tanh" if (kwargs or {}).get("approximate") == "tanh" else "gelu"
    if name in ("silu", "gelu_tanh"):
        return name
    for kind, names in (("matmul", _MATMUL), ("attention", _ATTENTION),
                        ("softmax", _SOFTMAX), ("transcendental", _TRANSCENDENTAL),
                        ("norm", _NORM)):
        if name in names:
            return kind
    return "elementwise"

@dataclass(frozen=True)
class CostModel:
    """Hardware plus the training set-up the memory count needs.

    Attributes:
        hardware: the device and link profile.
        optimizer: "adam" (two fp32 moments per parameter) or "sgd" (no state).
        overlap_slowdown: see `OVERLAP_SLOWDOWN`.
    """

    hardware: Hardware
    optimizer: str = "adam"
    overlap_slowdown: float = OVERLAP_SLOWDOWN

    def __post_init__(self) -> None:
        # a profile that measured the overlap (`pxform calibrate`) overrides the constant
        if self.overlap_slowdown == OVERLAP_SLOWDOWN and self.hardware.overlap_slowdown:
            object.__setattr__(self, "overlap_slowdown", self.hardware.overlap_slowdown)

    def state_bytes_per_param(self, dtype: torch.dtype) -> float:
        """Bytes per parameter for the parameter, its gradient and the optimizer state.

        Adam, fp32 training: 4 (weight) + 4 (gradient) + 8 (two fp32 moments) = 16.
        Adam, bf16 weights: 2 + 2 + 12 (fp32 master weight and two fp32 moments) = 16, the
        ZeRO paper's 16 bytes per parameter (Rajbhandari et al. 2020, §3.1). Under a
        `pxform.Precision` policy the parameters themselves are the float32 master
        weights, so they count 4 + 4 + 8: the same 16; the bf16 copies the ops read are
        values of the traced graph (a `_to_copy` per parameter), counted where they live:
        saved for backward, or gathered per block under ZeRO-3. SGD without momentum:
        weight and gradient only.

        Example:
            >>> CostModel(hw, optimizer="sgd").state_bytes_per_param(torch.float32)
            8.0
        """
        item = dtype.itemsize
        if self.optimizer == "sgd":
            return 2.0 * item
        if self.optimizer != "adam":
            raise ValueError(f"pxform.cost: optimizer={self.optimizer!r}; use 'adam' or 'sgd'")
        if item >= 4:
            return 2.0 * item + 8.0
        return 2.0 * item + 12.0

    def compute_time(self, flops: float, dtype: torch.dtype, nbytes: float = 0.0) -> float:
        """Seconds for one op of `flops` that reads and writes `nbytes` on one device: the
        longer of the two (a roofline; `Hardware.memory_bandwidth`), plus the host's per-op
        time (`Hardware.op_overhead_s`)."""
        compute = self.hardware.compute_time(flops, dtype) if flops > 0 else 0.0
        if nbytes > 0:
            compute = max(compute, self.hardware.memory_time(nbytes))
        return compute + self.hardware.op_overhead_s

    def fitted_backward_s(self) -> float:
        """The backward's share of `Hardware.op_step_overhead_s` that `op_times` adds to
        every op. The calibration fits that time per op over every op of its reference
        step (`pxform.tools.runtime_costs`), those without a backward among them, so the
        search charges it on an op whose backward never runs too (`blockcost.walk`).

        Example:
            >>> CostModel(dataclasses.replace(hw, op_step_overhead_s=3e-5)).fitted_backward_s()
            2e-05
        """
        return BACKWARD_RATIO * self.hardware.op_step_overhead_s / (1 + BACKWARD_RATIO)

    def op_times(self, flops: float, dtype: torch.dtype, nbytes: float, kind: str
                 ) -> tuple[float, float]:
        """(forward, backward) seconds of one op of class `kind` (`op_class`) doing
        `flops` and reading and writing `nbytes` on one device.

        With a measured curve for the class (`Hardware.op_curves`), the curve's times at
        the op's size: FLOPs for matmuls and attention (scaled by the dtype's rate against
        float32's, the curve's), bytes otherwise. Without one, the roofline
        (`compute_time`) forward and `BACKWARD_RATIO` times it backward. A view costs the
        per-op host time only (`Hardware.op_overhead_s`), forward and backward. Each is
        multiplied by `Hardware.op_time_scale` (what ops cost in a training step over
        what they cost alone; 1 unless measured), the forward also by
        `Hardware.forward_scale` and the backward by `Hardware.backward_scale` (the step's
        forward and backward measured apart; 1 unless measured), and
        `Hardware.op_step_overhead_s` is added (a third forward, two thirds backward; 0
        unless measured).

        Example:
            >>> model = CostModel(hardware("a100-80gb"))
            >>> f, b = model.op_times(2e12, torch.float32, 0.0, "matmul")
            >>> b == 2 * f
            True
        """
        f, b = self._op_times(flops, dtype, nbytes, kind)
        hw = self.hardware
        extra = hw.op_step_overhead_s / (1 + BACKWARD_RATIO)
        return (f * hw.op_time_scale * hw.forward_scale + extra,
                b * hw.op_time_scale * hw.backward_scale + BACKWARD_RATIO * extra)

    def _op_times(self, flops: float, dtype: torch.dtype, nbytes: float, kind: str
                  ) -> tuple[float, float]:
        host = self.hardware.op_overhead_s
        if kind == "view":
            return host, BACKWARD_RATIO * host
        curve = self.hardware.op_curve(kind)
        if curve is None:
            f = self.compute_time(flops, dtype, nbytes)
            return f, BACKWARD_RATIO * f
        if kind in ("matmul", "attention"):
            size = flops * (self.hardware.flops_per_second("fp32")
                            / self.hardware.flops_per_second(dtype))
        else:
            size = nbytes
        if size <= 0:
            return host, BACKWARD_RATIO * host
        return curve.times(size)

    def relayout_time(self, relayout: Relayout, axes: Mapping[str, tuple[int, int]],
                      scale: float = 1.0) -> float:
        """Seconds for one re-layout; `axes` maps each mesh axis to (size, link level);
        `scale` multiplies the bytes (a microbatch of another size than the traced one)."""
        return sum(self.step_time(kind, axis, sent * scale, axes)
                   for kind, axis, sent in relayout_steps(relayout))

    def step_time(self, kind: str, axis: str, sent: float,
                  axes: Mapping[str, tuple[int, int]]) -> float:
        size, level = axes[axis]
        if kind in LOCAL_STEPS or size <= 1:
            return 0.0
        # the transfer, and the runtime's own host time around it (`runtime_costs`); an
        # all-to-all's is its own share of it (`Hardware.all_to_all_share`)
        hw = self.hardware
        own = hw.collective_overhead_s * (hw.all_to_all_share if kind == "all_to_all" else 1.0)
        return hw.comm_time(kind, sent, size, level) + own

    def copies_time(self, relayout: Relayout, local: Sequence[int], dtype: torch.dtype,
                    axes: Mapping[str, tuple[int, int]], scale: float = 1.0) -> float:
        """Seconds of the copies the runtime makes on one rank running `relayout` on a value
        whose local shape under `relayout.src` is `local` (`relayout_copies`), each priced
        as an elementwise op over its bytes (`scale` multiplies them, as in
        `relayout_time`). The comm tables time collectives on contiguous buffers along dim
        0 and `collective_overhead_s` on 64 KiB all-reduces, so neither holds these: on
        this project's CPU machine a sequence-parallel GPT step ran 87 copies and 230
        slices, and its time outside the collectives was 12-24 ms over the model.

        Example:
            >>> r = plan_relayout((64, 128), 4, Layout.of(P(), 2), Layout.of(P(None, "tp"), 2),
            ...                   AbstractMesh({"tp": 2}))
            >>> model.copies_time(r, (64, 128), torch.float32, {"tp": (2, 0)}) > 0
            True
        """
        sizes = {a: n for a, (n, _) in axes.items()}
        return sum(self.op_times(0.0, dtype, nbytes * scale, "elementwise")[0]
                   for nbytes in relayout_copies(relayout, local, dtype.itemsize, sizes))

    def bucketed_all_reduce(self, sent: float, axis: str,
                            axes: Mapping[str, tuple[int, int]]) -> float:
        """Seconds a step's packed gradient all-reduce over `axis` adds to backward, for
        `sent` bytes sent per rank in all (ring volume): the runtime packs gradients into
        buckets of `BUCKET_BYTES` and launches each as it fills
        (`pxform.runtime.buckets`). The last bucket (the rest) is launched when backward
        ends and costs its whole time; each full bucket before it runs under the
        backward that follows and costs `overlap_slowdown - 1` of its time (`overlap`).
        Packing the gradients into the buckets (`torch.cat`, on the compute thread, so not
        overlapped) is a copy of their local bytes, priced as an elementwise op: on CPUs
        it is 2 ms of a 60 ms data-parallel step for 3.3 MiB of gradients (its output is
        fresh memory each step), which the model had left out.

        Example:
            >>> model.bucketed_all_reduce(0.0, "outer", axes)
            0.0
        """
        if sent <= 0:
            return 0.0
        n = axes[axis][0]
        if n <= 1:
            return 0.0
        bucket = BUCKET_BYTES * 2 * (n - 1) / n  # a full bucket's ring volume
        full, rest = divmod(sent, bucket)
        if rest == 0:
            full, rest = full - 1, bucket
        local = sent * n / (2 * (n - 1))  # the packed bytes (sent is the ring volume)
        pack = self.pack_time(local)
        # a full bucket's transfer runs under the backward that follows; its launch (the
        # per-collective cost) on the rank's own thread does not
        per_collective = self.hardware.collective_overhead_s
        return (pack + self.step_time("all_reduce", axis, rest, axes)
                + full * ((self.overlap_slowdown - 1)
                          * (self.step_time("all_reduce", axis, bucket, axes) - per_collective)
                          + per_collective))

    def pack_time(self, nbytes: float) -> float:
        """Seconds to copy `nbytes` of gradients into a bucket's buffer before its
        collective (`pxform.runtime.buckets`; on the rank's own thread, so never
        overlapped): an elementwise op over the bytes, read and written.

        Example:
            >>> model.pack_time(0.0)
            0.0
        """
        if nbytes <= 0:
            return 0.0
        return self.op_times(0.0, torch.float32, 2.0 * nbytes, "elementwise")[0]

    def overlap(self, compute: float, comm: float) -> float:
        """Backward time with gradient communication `comm` overlapping `compute`."""
        if comm <= 0:
            return compute
        return max(compute, comm) + (self.overlap_slowdown - 1.0) * min(compute, comm)


def relayout_copies(relayout: Relayout, local: Sequence[int], itemsize: int,
                    sizes: Mapping[str, int]) -> list[float]:
    """Bytes read and written by each copy the runtime makes on one rank running
    `relayout` (`pxform.runtime.collectives`), from the value's local shape under
    `relayout.src`: an all-gather along a dim with a non-1 dim before it puts the gathered
    chunks in place (a concatenation), a reduce-scatter along a dim other than 0 first
    gathers each rank's piece along dim 0, an all-reduce (a functional collective) works
    on a copy of its input, an all-to-all stacks its pieces and concatenates what it
    receives, a slice along a dim with a non-1 dim before it copies its piece out, `zero`
    writes zeros (off index 0) and `pad` writes zeros around a copy of its input. Steps
    over an axis of one device run nothing.

    Example:
        >>> r = plan_relayout((64, 128), 4, Layout.of(P(), 2), Layout.of(P(None, "tp"), 2),
        ...                   AbstractMesh({"tp": 2}))
        >>> [str(s) for s in r.steps], relayout_copies(r, (64, 128), 4, {"tp": 2})
        (['slice(tp, dim 1)'], [32768.0])
    """
    shape = list(local)
    out: list[float] = []
    for s in relayout.steps:
        n = sizes.get(s.axis, 1)
        if n <= 1:
            continue
        nbytes = float(math.prod(shape) * itemsize)
        d = s.dim if s.dim is not None else 0
        lead = math.prod(shape[:d])  # 1: a piece along `d` is one contiguous run
        if s.kind == "all_gather":
            shape[d] *= n
            if lead != 1:
                out.append(2.0 * nbytes * n)
        elif s.kind == "reduce_scatter":
            if d != 0:
                out.append(2.0 * nbytes)
            shape[d] //= n
        elif s.kind == "all_reduce":
            out.append(2.0 * nbytes)
        elif s.kind == "all_to_all":
            assert s.to_dim is not None
            shape[d] *= n
            shape[s.to_dim] //= n
            out += [2.0 * nbytes, 2.0 * nbytes]
        elif s.kind == "slice":
            shape[d] //= n
            if lead != 1:
                out.append(2.0 * nbytes / n)
        elif s.kind == "zero":
            out.append(nbytes)
        elif s.kind == "pad":
            shape[d] *= n
            out.append(nbytes * n + 2.0 * nbytes)
    return out


def relayout_copies_storage(relayout: Relayout, local: Sequence[int],
                            sizes: Mapping[str, int]) -> bool:
    """Does running `relayout` (`pxform.runtime.collectives`) on a value whose local shape
    under `relayout.src` is `local` give a tensor of its own, not the input or a view of
    it? Every collective's output is new, as are `zero`'s (off index 0) and `pad`'s; a
    slice is a view when its piece is one contiguous run (no non-1 dim before its dim),
    a copy otherwise. Steps over an axis of one device run nothing.

    Example:
        >>> r = plan_relayout((64, 128), 4, Layout.of(P(), 2), Layout.of(P(None, "tp"), 2),
        ...                   AbstractMesh({"tp": 2}))
        >>> relayout_copies_storage(r, (64, 128), {"tp": 2})
        True
    """
    shape = list(local)
    for s in relayout.steps:
        n = sizes.get(s.axis, 1)
        if n <= 1:
            continue
        d = s.dim if s.dim is not None else 0
        if s.kind != "slice" or math.prod(shape[:d]) != 1:
            return True
        shape[d] //= n
    return False


def relayout_steps(relayout: Relayout) -> list[tuple[str, str, float]]:
    """(kind, axis, bytes sent per rank) per step; an axis's volume is shared by its steps."""
    per_axis: dict[str, int] = {}
    for s in relayout.steps:
        if s.kind not in LOCAL_STEPS:
            per_axis[s.axis] = per_axis.get(s.axis, 0) + 1
    out = []
    for s in relayout.steps:
        if s.kind in LOCAL_STEPS:
            continue
        out.append((s.kind, s.axis, relayout.volume_of(s.axis) / per_axis[s.axis]))
    return out


@dataclass(frozen=True)
class SavedBytes:
    """What one op saves for backward, by whose tensor it is: per op input, per op output,
    and `other` (intermediates of the op itself). The split lets a sharded op count each
    saved tensor at its own layout's local size (a column-parallel matmul saves its whole
    replicated input, not a shard of it)."""

    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    other: int
    # values stored anyway (`skip`: parameters) that the op saves, or a view of: not
    # counted, but a ZeRO-3 program that keeps gathered parameters keeps these whole
    stored: tuple[str, ...] = ()
    # per op output, whether an op of the range (this one or a later one) saves its
    # storage or a view of it: what a zero-bubble stage keeping the output for its W
    # adds beyond the saved bytes is the outputs saved by none (empty: not known)
    outputs_saved: tuple[bool, ...] = ()
    # whether the op saves any tensor at all (also one counted for an earlier op, or a
    # parameter): torch's checkpoint recomputes up to the last op that does
    packs: bool = False
    # per op input, whether the op saves its storage (or a view of it), counted here or
    # for an earlier op: a re-layout between the two makes the saved tensor a copy of its
    # own in the sharded program (`blockcost.walk`; empty: not known)
    inputs_saved: tuple[bool, ...] = ()
    # per op output, the input whose storage it is (a view, an alias), or -1: a view of a
    # re-laid-out copy is that copy (empty: not known)
    outputs_alias: tuple[int, ...] = ()
    # a reshape (or flatten) that is a view here of a transposed view of another op's
    # output: a view only because of that op's output strides. A sharded rank may run
    # that op on re-laid-out copies, whose output comes out in the kernel's own layout,
    # and the reshape then copies (`blockcost.walk`)
    restrides: bool = False

    @property
    def total(self) -> int:
        return sum(self.inputs) + sum(self.outputs) + self.other

    @functools.cached_property
    def asks(self) -> tuple[bool, ...] | None:
        """Per op input, whether the op saves it or an output is a view of it (what
        `blockcost.walk` asks a re-layout about); None for an op with neither, the most
        (the walk is the search's inner loop: it asks this per op per option)."""
        asks = list(self.inputs_saved)
        for i in self.outputs_alias:
            if 0 <= i < len(asks):
                asks[i] = True
        return tuple(asks) if any(asks) else None


RESHAPES = (torch.ops.aten.reshape.default, torch.ops.aten.flatten.using_ints)
"""Ops that return a view where their input's strides allow, a copy elsewhere."""
PERMUTES = (torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
            torch.ops.aten.t.default)
"""Views that reorder their input's dims (`SavedBytes.restrides`)."""

GRAD_PASSTHROUGH = (torch.ops.aten.add.Tensor,)
"""Ops whose backward hands their output's gradient to an input of the output's shape and
dtype as it is, the same tensor (autograd's `AddBackward` with alpha 1)."""


def saved_bytes_per_op(graph: Graph, start: int, stop: int, skip: set[str],
                       grads: Collection[str] | None = None) -> list[SavedBytes]:
    """Bytes each op of `graph.ops[start:stop]` saves for backward, by input and output,
    measured by running those ops on fake tensors under saved-tensor hooks (no memory, no
    device).

    Values read from outside the range are fake inputs that require grad where named in
    `grads` (None: `requiring_grad(graph)`, made with autograd from a floating graph
    input). A storage is counted once, for the first op that saves it; storages of
    values named in `skip` (parameters, batch inputs: stored anyway) are not counted, but
    named in `SavedBytes.stored` of every op saving them.

    Example:
        >>> [s.total for s in saved_bytes_per_op(traced.graph, 0, 3, {"params.w"})]
        [0, 4096, 4096]
    """
    ops = graph.ops[start:stop]
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    outside = {v.name: v for v in read_from_outside(ops)}
    consts = {c.value.name for c in graph.constants}
    inputs = [v for v in outside.values() if v.name not in consts]
    sub = Graph(tuple(inputs), ops, (), tuple(c for c in graph.constants
                                              if c.value.name in outside),
                f"{graph.name}[{start}:{stop}]")
    # a value made without autograd (under no_grad, from a module buffer, from nothing)
    # does not require grad: an op refusing gradients for it (BatchNorm's running
    # statistics) fails here, and an op reading it beside an activation saves only
    # what the activation's gradient needs
    if grads is None:
        grads = requiring_grad(graph)
    with mode:
        tensors = [torch.empty(v.type.shape, dtype=v.type.dtype).requires_grad_(
                   v.name in grads) for v in inputs]
    skipped = {id(t.untyped_storage()): v.name for v, t in zip(inputs, tensors)
               if v.name in skip}
    # our own value -> tensor map (run_graph drops dead values; fake tensors cost nothing)
    env: dict[str, torch.Tensor] = {v.name: t for v, t in zip(inputs, tensors)}
    seen: dict[int, object] = {}  # storage id -> storage (kept alive so ids stay unique)
    pending: list[tuple[int, int]] = []  # (storage id, bytes) saved by the running op
    stored: dict[str, None] = {}  # skipped values the running op saves, in order
    saved: list[SavedBytes] = []
    packed: set[int] = set()  # every storage any op saved (ids of `made`'s storages)
    packs = [0]  # tensors the running op saved, counted or not
    made: list[tuple[object | None, ...]] = []  # per op its outputs' storages (kept alive)

    packed_now: set[int] = set()  # storages the running op saved, counted or not
    permuted: set[str] = set()  # values that are transposed views (`SavedBytes.restrides`)

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = id(storage)
        packed.add(key)
        packed_now.add(key)
        packs[0] += 1
        if key in skipped:
            stored[skipped[key]] = None
        elif key not in seen:
            seen[key] = storage
            pending.append((key, storage.nbytes()))
        return t

    def storage_id(t: Any) -> int | None:
        return id(t.untyped_storage()) if isinstance(t, torch.Tensor) else None

    def on_op(op: Any, args: object, results: list[torch.Tensor]) -> None:
        for v, r in zip(op.outputs, results):
            env[v.name] = r
        ins = [storage_id(env.get(v.name)) for v in op.inputs]
        outs = [storage_id(r) for r in results][:len(op.outputs)]
        by_in, by_out, other = [0] * len(ins), [0] * len(op.outputs), 0
        for key, nbytes in pending:
            if key in ins:
                by_in[ins.index(key)] += nbytes
            elif key in outs:
                by_out[outs.index(key)] += nbytes
            else:
                other += nbytes
        alias = tuple(ins.index(key) if key is not None and key in ins else -1
                      for key in outs)
        # a transposed view, and views of one, until an op makes a storage of its own
        turned = op.target in PERMUTES or any(
            src >= 0 and op.inputs[src].name in permuted for src in alias)
        if turned:
            permuted.update(v.name for v, src in zip(op.outputs, alias) if src >= 0)
        restrides = (op.target in RESHAPES and alias[:1] == (0,)
                     and op.inputs[0].name in permuted)
        saved.append(SavedBytes(tuple(by_in), tuple(by_out), other, tuple(stored),
                                packs=packs[0] > 0,
                                inputs_saved=tuple(key is not None and key in packed_now
                                                   for key in ins),
                                outputs_alias=alias, restrides=restrides))
        packs[0] = 0
        packed_now.clear()
        made.append(tuple(r.untyped_storage() if isinstance(r, torch.Tensor) else None
                          for r in results[:len(op.outputs)]))
        pending.clear()
        stored.clear()

    with mode, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_graph(sub, tensors, on_op=on_op)
    # a later op may save an output (or a view of it): known only once the range has run
    return [dataclasses.replace(s, outputs_saved=tuple(st is not None and id(st) in packed
                                                       for st in outs))
            for s, outs in zip(saved, made)]


def requiring_grad(graph: Graph, trainable: Collection[str] | None = None) -> set[str]:
    """The values of `graph` that require grad when the step runs: the `trainable` graph
    inputs (None: every floating one), and each floating output of an op run with
    autograd (`Op.grad`, not a `detach`) that reads one of them. What autograd decides
    in eager: a rotary embedding's cosines, made from a module buffer and positions, do
    not require grad, so a layer's `q * cos` saves the cosines alone, not `q`. (Taken
    to require grad as every floating value read from outside a block, HF Llama's
    layers were counted 1.5 MiB each over at 512 tokens of width 256, its plans' peaks
    8-16 % over the meter: the forty-seventh session.)

    Example:
        >>> g = pxform.trace(lambda w, x: (x @ w).sum(), w, x).graph
        >>> sorted(requiring_grad(g, {"w"}))  # w and what is made from it; not x
        ['0', '1', 'w']
    """
    needs = {v.name for v in graph.inputs if v.type.dtype.is_floating_point
             and (trainable is None or v.name in trainable)}
    return grad_flow(graph.ops, needs)


def grad_flow(ops: Sequence[Op], needs: set[str]) -> set[str]:
    """`needs` (values that require grad) with what `ops`, run in order, make from them
    that requires grad too (`requiring_grad`'s rule). Updated in place and returned.

    Example:
        >>> sorted(grad_flow(g.ops, {"w"}))   # g: x @ w, summed
        ['0', '1', 'w']
    """
    for op in ops:
        # (a fill shaped like its template, `zeros_like(x)`, `x.new_ones(...)`, takes no
        # gradient from it)
        made_anew = op.name.endswith("_like") or op.name.startswith("new_")
        if op.grad and op.name != "detach" and not made_anew \
                and any(v.name in needs for v in op.inputs):
            needs.update(v.name for v in op.outputs if v.type.dtype.is_floating_point)
    return needs


def peak_bytes(state: float, grads: float, activations: float, in_flight: int,
               microbatches: int) -> float:
    """Peak bytes of a device holding `state` (parameters and optimizer state),
    `grads` (parameter gradients) and `activations` per microbatch, with `in_flight`
    microbatches' activations alive at most; the workspace (`workspace_bytes`) comes on top.

    When every microbatch is in flight before the first backward (`in_flight >=
    microbatches`: no pipeline and one microbatch, or an early 1F1B stage with few
    microbatches), the peak comes during that backward, as activations are freed block by
    block and gradients appear: at most (in_flight - 1) x activations + max(activations,
    gradients). Otherwise gradients exist from the first backward on, while the device
    again holds `in_flight` microbatches. The search sums this per block; stage-aware
    recompute over a stage.

    Example:
        >>> peak_bytes(100, 50, 10, in_flight=4, microbatches=8)
        190
    """
    if in_flight >= microbatches:
        return state + (in_flight - 1) * activations + max(activations, grads)
    return state + grads + in_flight * activations


BUCKET_BYTES = 25 * 2**20
"""The gradient bucket `auto`'s plans run with (`pxform.runtime.buckets.DEFAULT_BUCKET_MB`,
DDP's default)."""


def weight_pool_bytes(grads: Sequence[float], largest: float) -> float:
    """Bytes a zero-bubble W action holds on top of its stage's memory: the weight
    gradients it has asked autograd for and not yet accumulated into the parameters, a
    bucket's worth at most (`pxform.runtime.pipeline` accumulates them in one call per
    bucket), and meanwhile the sum over microbatches of the largest parameter's gradient
    that the accumulation makes (`pxform.runtime.buckets.GradAccumulator`). `grads`: the
    stage's blocks' parameter gradient bytes; `largest`: its largest parameter's.

    Example:
        >>> weight_pool_bytes([1e6, 2e6], 1e6), weight_pool_bytes([1e9], 0) == BUCKET_BYTES
        (4000000.0, True)
    """
    return float(min(sum(grads), BUCKET_BYTES) + largest)


def accumulation_bytes(largest_grad: float, microbatches: int) -> float:
    """Bytes summing one block's parameter gradients over `microbatches` holds beside the
    gradients of the microbatches before, at most: a parameter's gradient as autograd
    makes it, and at the second microbatch also the sum that replaces the first one
    (`pxform.runtime.buckets.GradAccumulator` adds in place only into a sum of its own);
    the block's largest parameter counts. Nothing with one microbatch.

    Example:
        >>> accumulation_bytes(1.5e6, 8), accumulation_bytes(1.5e6, 1)
        (3000000.0, 0.0)
    """
    return 2.0 * largest_grad if microbatches > 1 else 0.0


def backward_extra(activations: Sequence[float], grads: Sequence[float],
                   workspaces: Sequence[float], in_flight: int, microbatches: int,
                   packed: float, ends: Sequence[float | None] | None = None,
                   accumulating: Sequence[float] | None = None,
                   frees: bool = True,
                   firsts: Sequence[float] | None = None) -> float:
    """Bytes a stage needs on top of its blocks' summed `peak_bytes` while backward runs,
    per block (in forward order) its activations, parameter gradients and workspace.

    Block k's backward holds its workspace (`workspace_bytes`) while the blocks before it
    have not run theirs: when every microbatch is in flight, those hold their activations
    where `peak_bytes` counted max(activations, gradients), so their gradients beyond their
    activations are not there yet; and the blocks after it have run theirs, so they hold
    their gradients, their activations beyond those freed. The extra is then negative where
    no moment holds every block's larger part. After the last backward, data parallel's
    last gradient bucket is packed into one buffer (`packed`: the all-reduced gradient
    bytes, at most one bucket) while the activations are gone.

    `ends`, per block: where given, its workspace peaks before the block's own gradients
    exist and its backward ends holding this much beside all of them. A recomputed block
    peaks as its recompute ends, before the first op's backward made a gradient, and ends
    with its last op's transient: when every microbatch is in flight (its gradients are
    made by this backward), its own gradients beyond its activations do not add to the
    recompute's peak either. (Counted, they put a recomputed GPT's predicted peak 4-7 %
    above the measured one: `docs/benchmarks/accuracy.md`.)

    `accumulating`, per block: what summing its parameter gradients over microbatches
    holds beside the gradients while its backward runs (`accumulation_bytes`), a
    workspace of its own. `frees`: a block's backward of one microbatch comes after the
    blocks after it in the stage freed that microbatch's activations (False where a split
    backward keeps every graph for its W actions, zero-bubble). `firsts`, per block: its
    workspace in the first microbatch's backward where that differs (a recomputed block
    there also holds the gradients of its parameters made so far, which later microbatches
    find among all the gradients); counted where every microbatch is in flight.

    Example:
        >>> # the last block's large workspace comes before the first block's gradients
        >>> backward_extra([10, 10], [30, 30], [5, 25], 1, 1, packed=0)
        5.0
        >>> # a recomputed first block: its 40 bytes of recompute before its own gradients
        >>> backward_extra([10, 10], [30, 30], [40, 5], 1, 1, packed=0, ends=[5, None])
        20.0
        >>> # ... which in the first microbatch also holds 8 bytes of its own gradients
        >>> backward_extra([10, 10], [30, 30], [40, 5], 1, 1, packed=0, ends=[5, None],
        ...                firsts=[48, 5])
        28.0
        >>> # 2 of 8 microbatches in flight: the first block's 25 bytes come after the
        >>> # second freed its 10 of the microbatch going back
        >>> backward_extra([10, 10], [30, 30], [25, 5], 2, 8, packed=0)
        15.0
    """
    every = in_flight >= microbatches
    # a backward after the first microbatch's also sums the gradients it makes
    later = list(workspaces) if accumulating is None else \
        [max(w, s) for w, s in zip(workspaces, accumulating)]
    if not every:
        # gradients exist from the first backward on, and each block's activations are
        # counted beside them for every microbatch in flight; block k's workspace comes
        # on top of everything but the activations the blocks after it freed for the
        # microbatch going back (charged whole, the embedding's workspace put a
        # 2-stage GPT pipeline's first stage 6 % over, and the head's its last stage 9 %
        # over, its logits freed before the last block's backward: the forty-second
        # session, `docs/benchmarks/accuracy.md`)
        after = sum(activations) if frees else 0.0
        extra = 0.0
        for act, work in zip(activations, later):
            if frees:
                after -= act
            extra = max(extra, float(work - after))
        gone = sum(in_flight * a for a in activations)
        return max(extra, min(packed, BUCKET_BYTES) - gone)
    # every microbatch in flight: `peak_bytes` counted each block at max(activations,
    # gradients). While block k's backward runs on the first microbatch, the blocks before
    # it still hold their activations (`ahead`: what the max counted beyond them) and the
    # blocks after it hold their gradients alone, their activations freed (`behind`: what
    # the max counted beyond those; a recomputed block keeps more input than it has
    # gradients, and was counted 4-7 % over, `docs/benchmarks/accuracy.md`)
    over_act = [max(a, g) - a for a, g in zip(activations, grads)]
    over_grad = [max(a, g) - g for a, g in zip(activations, grads)]
    extra = 0.0 if not activations else -math.inf
    freed = sum(over_grad)  # what the max counted beyond every block's gradients
    ahead, behind = 0.0, freed
    for k, work in enumerate(workspaces if firsts is None else firsts):
        behind -= over_grad[k]
        end = ends[k] if ends is not None else None
        first = work if end is None else max(work - over_act[k], end)
        extra = max(extra, first - ahead - behind)
        ahead += over_act[k]
    if in_flight >= 2:
        # a later microbatch's backward of block k: every gradient exists, the blocks
        # after k have freed this microbatch's activations, block k holds both
        after = sum(activations)
        for act, work in zip(activations, later):
            after -= act
            extra = max(extra, work - after - freed)
    gone = sum((in_flight - 1) * a + max(a, g) - g for a, g in zip(activations, grads))
    return max(extra, min(packed, BUCKET_BYTES) - gone)


def workspace_bytes(transient: float, saved: float, recompute: bool,
                    redo: float | None = None) -> float:
    """Bytes alive only while one block's backward runs: its largest op's inputs and
    outputs (`transient`, their gradients), and when it is recomputed the activations it
    saves (`saved`), made again. `redo`, where known, is that recomputed peak op by op:
    the op at work's transient plus what it and the ops before it saved, since torch's
    checkpoint frees each recomputed tensor once backward has used it; `saved + transient`
    bounds it.

    Example:
        >>> workspace_bytes(4.0, 10.0, recompute=True), workspace_bytes(4.0, 10.0, True, 11.0)
        (14.0, 11.0)
    """
    if not recompute:
        return transient
    return redo if redo is not None else transient + saved


def one_f_one_b_time(forward: Sequence[float], backward: Sequence[float],
                     microbatches: int) -> float:
    """Step time of 1F1B with per-stage forward and backward times per microbatch, in
    closed form: the slowest stage's `(microbatches - 1)` steady steps plus one microbatch
    through every stage (warm-up and drain). Equals `schedules.simulate` when stages are
    equal; the search's final plan is simulated exactly.

    Example:
        >>> one_f_one_b_time([1.0] * 4, [2.0] * 4, 8)
        33.0
    """
    per = [f + b for f, b in zip(forward, backward)]
    return (microbatches - 1) * max(per) + sum(per)


def one_f_one_b_in_flight(stages: int, microbatches: int) -> list[int]:
    """Microbatches whose activations stage s holds at most under 1F1B."""
    return [min(stages - s, microbatches) for s in range(stages)]
