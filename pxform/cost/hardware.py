"""Device and link profiles: how fast a device computes and how long a collective takes.

A `Hardware` profile is what pxform's cost model needs to compare parallel strategies:

* compute: achievable FLOP/s per dtype (`flops_per_second`, `compute_time`);
* communication: for each link level (0: devices in one node, 1: across nodes) a `Link` with
  the alpha-beta numbers of the standard ring model (Thakur et al. 2005; the same model as
  `pxform.core.layout`): one collective over `n` ranks takes

      steps(kind, n) * latency + sent_bytes / bandwidth

  where `sent_bytes` is what each rank sends (the ring volumes `pxform.core.layout` reports) and
  `steps` is the number of ring steps: all_reduce 2(n-1), all_gather, reduce_scatter and
  all_to_all n-1, p2p 1;
* optionally measured `CommTable`s (written by `pxform.runtime.calibrate`), which replace the
  alpha-beta formula for the kinds, levels and group sizes they cover.

Profiles come from three places: the `PRESETS` (datasheet numbers, see the comments next to
each constant), `pxform.runtime.calibrate.calibrate` (measured on the machine at hand) and
JSON files written by `Hardware.save` (`pxform calibrate --out PATH`). `hardware(spec)`
accepts any of them.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pxform.core.layout import AxisCost

__all__ = ["CommTable", "Hardware", "Link", "OP_CLASSES", "OpCurve", "PRESETS", "hardware"]

FORMAT = "pxform-hardware/1"

# Collective kinds a profile knows, and the ring steps of each over `n` ranks (Thakur,
# Rabenseifner and Gropp 2005, "Optimization of collective communication operations in
# MPICH": a ring all-reduce is a reduce-scatter then an all-gather, n-1 steps each).
COLLECTIVE_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


def ring_steps(kind: str, n: int) -> int:
    """Steps of a ring collective of `kind` over `n` ranks (the alpha-beta model's latency
    count).

    Example:
        >>> ring_steps("all_reduce", 8), ring_steps("all_gather", 8)
        (14, 7)
    """
    if kind == "all_reduce":
        return 2 * (n - 1)
    if kind == "p2p":
        return 1
    return n - 1


def _check_kind(kind: str, what: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(f"{what}: unknown collective kind {kind!r}; expected one of "
                         f"{', '.join(COLLECTIVE_KINDS)}")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass(frozen=True)
class Link:
    """One level of interconnect, in the alpha-beta model.

    Attributes:
        name: "nvlink", "infiniband", "loopback", "intra-node" ...
        latency_s: alpha, seconds per ring step of a collective.
        bandwidth: 1/beta, bytes per second each rank sends (the ring "bus bandwidth" that
            nccl-tests reports as busbw).
        source: where the numbers come from (datasheet, nccl-tests, measured).

    Example:
        >>> link = Link("nvlink", 10e-6, 230e9, "nccl-tests busbw on DGX A100")
        >>> round(4 * link.latency_s + 2**30 / link.bandwidth, 6)
        0.004708
    """

    name: str
    latency_s: float
    bandwidth: float
    source: str = ""

    def __post_init__(self) -> None:
        if not _number(self.latency_s) or self.latency_s < 0:
            raise ValueError(f"Link {self.name!r}: latency_s must be a finite number >= 0 "
                             f"seconds, got {self.latency_s!r}")
        if not _number(self.bandwidth) or self.bandwidth <= 0:
            raise ValueError(f"Link {self.name!r}: bandwidth must be a finite number > 0 "
                             f"bytes per second, got {self.bandwidth!r}")


@dataclass(frozen=True)
class CommTable:
    """Measured times of one collective kind on one link level and group size.

    `points` are (sent_bytes, seconds) pairs, sorted by bytes (they are sorted on
    construction), with sent bytes > 0 and distinct and seconds > 0 and non-decreasing (a
    larger message is never faster; `pxform.runtime.calibrate` takes a running maximum of its
    medians to guarantee it). `time(sent)`:

    * at a point: that point's time, exactly;
    * between two points: linear interpolation in log(bytes)-log(seconds), i.e. a power law
      through both points;
    * above the largest point: linear in bytes, with the slope (seconds per byte) of the
      last two points, or with the last point's own seconds per byte when there is only one
      point or the last two have equal times;
    * below the smallest point: the smallest point's time (small messages cost latency).

    So `time` is continuous and non-decreasing in bytes.

    Example:
        >>> t = CommTable("all_reduce", 0, 8, ((1e3, 1e-5), (1e6, 1e-3)))
        >>> t.time(1e3), round(t.time(1e9), 6), t.time(1.0)
        (1e-05, 0.991, 1e-05)
    """

    kind: str  # all_reduce | all_gather | reduce_scatter | all_to_all | p2p
    level: int  # link level (0: within a node, 1: across nodes)
    group_size: int
    points: tuple[tuple[float, float], ...]

    def __post_init__(self) -> None:
        what = f"CommTable({self.kind!r}, level {self.level}, group {self.group_size})"
        _check_kind(self.kind, what)
        if isinstance(self.level, bool) or not isinstance(self.level, int) or self.level < 0:
            raise ValueError(f"{what}: level must be an int >= 0, got {self.level!r}")
        if (isinstance(self.group_size, bool) or not isinstance(self.group_size, int)
                or self.group_size < 2):
            raise ValueError(f"{what}: group_size must be an int >= 2 (a group of one "
                             f"sends nothing), got {self.group_size!r}")
        try:
            points = [(p[0], p[1]) for p in self.points if len(p) == 2]
            ok = len(points) == len(self.points)
        except (TypeError, IndexError):
            ok = False
        if not ok or not points:
            raise ValueError(f"{what}: points must be a non-empty sequence of "
                             f"(sent_bytes, seconds) pairs, got {self.points!r}")
        for b, s in points:
            if not (_number(b) and _number(s) and b > 0 and s > 0):
                raise ValueError(f"{what}: point ({b!r}, {s!r}) must have sent_bytes > 0 "
                                 f"and seconds > 0, both finite numbers")
        points = sorted((float(b), float(s)) for b, s in points)
        for (b0, s0), (b1, s1) in zip(points, points[1:]):
            if b0 == b1:
                raise ValueError(f"{what}: two points for {b0:g} sent bytes; keep one "
                                 f"(e.g. the median)")
            if s1 < s0:
                raise ValueError(f"{what}: {b1:g} bytes take {s1:g} s but fewer bytes "
                                 f"({b0:g}) take {s0:g} s; times must not decrease with "
                                 f"size (take a running maximum of the measurements)")
        object.__setattr__(self, "points", tuple(points))

    def time(self, sent_bytes: float) -> float:
        """Seconds for one collective in which each rank sends `sent_bytes`.

        Example:
            >>> round(CommTable("p2p", 0, 2, ((100.0, 1.0), (1e4, 100.0))).time(1000.0), 9)
            10.0
        """
        return _power_law([b for b, _ in self.points], [s for _, s in self.points],
                          sent_bytes)


def _power_law(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """`ys` at `x` from increasing `xs` and non-decreasing `ys`: the first point's value
    below it, log-log interpolation between points, linear beyond the last with the last
    two points' slope (or the last point's own y per x). See `CommTable`."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        if len(xs) >= 2 and ys[-1] > ys[-2]:
            slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        else:
            slope = ys[-1] / xs[-1]
        return ys[-1] + slope * (x - xs[-1])
    i = bisect.bisect_right(xs, x) - 1
    if xs[i] == x:
        return ys[i]
    frac = (math.log(x) - math.log(xs[i])) / (math.log(xs[i + 1]) - math.log(xs[i]))
    t = math.exp(math.log(ys[i]) + frac * (math.log(ys[i + 1]) - math.log(ys[i])))
    return min(max(t, ys[i]), ys[i + 1])  # rounding must not break monotonicity


_FIXED_COSTS = ("step_overhead_s", "param_overhead_s", "action_overhead_s",
                "collective_overhead_s", "param_action_overhead_s", "weight_op_overhead_s",
                "op_step_overhead_s", "op_action_overhead_s", "recompute_overhead_s",
                "relayout_overhead_s", "autograd_op_overhead_s", "transfer_overhead_s",
                "send_overhead_s", "receive_overhead_s", "receive_stall_s", "relayout_gap_s")
"""The runtime's own fixed costs a profile may carry (`Hardware`)."""

OP_CLASSES = ("matmul", "attention", "gelu", "gelu_tanh", "silu", "softmax",
              "transcendental", "norm", "elementwise")
"""Op classes with their own measured time curve (`OpCurve`; `pxform.cost.model.op_class`
says which an op is): matmuls and attention by FLOPs; the others, memory-bound, by the
bytes an op reads and writes. The activations transformers use most have their own:
their costs per byte differ several-fold on CPUs (GELU's tanh form is 3x its erf form).
Views cost the per-op host time only."""


def _sync_points(value: Any, what: str) -> tuple[tuple[float, float], ...]:
    """`Hardware.sync_wait` checked: (gap, wait) pairs of finite numbers >= 0, gaps
    increasing, waits non-decreasing and the first 0."""
    try:
        points = tuple((float(g), float(w)) for g, w in value)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: sync_wait must be (gap_s, wait_s) pairs, got "
                         f"{value!r}") from None
    ok = all(math.isfinite(g) and math.isfinite(w) and g >= 0 and w >= 0
             for g, w in points)
    ok = ok and all(g0 < g1 and w0 <= w1 for (g0, w0), (g1, w1) in zip(points, points[1:]))
    if not ok or (points and points[0][1] != 0.0):
        raise ValueError(f"{what}: sync_wait must be (gap_s, wait_s) pairs of numbers >= 0 "
                         f"with increasing gaps, non-decreasing waits and a first wait of "
                         f"0, got {value!r}")
    return points


@dataclass(frozen=True)
class OpCurve:
    """Measured forward and backward seconds of one op class (`OP_CLASSES`) by size: FLOPs
    for "matmul" and "attention" (in float32), else bytes read and written. `points` are
    (size, forward_s, backward_s), sorted by size, sizes distinct, times > 0 and
    non-decreasing (`pxform.runtime.calibrate` takes running maxima of medians). Times
    include the eager op's own dispatch and autograd bookkeeping. `spread`: the largest
    relative interquartile range of a point's repeats (how noisy the measurement was).
    Interpolation as `CommTable.time`: the first point's time below it, log-log between
    points, linear beyond the last.

    Example:
        >>> c = OpCurve("transcendental", ((1e4, 1e-6, 2e-6), (1e6, 1e-4, 2e-4)))
        >>> [round(t, 9) for t in c.times(1e5)]   # a power law between the points
        [1e-05, 2e-05]
    """

    kind: str
    points: tuple[tuple[float, float, float], ...]
    spread: float = 0.0

    def __post_init__(self) -> None:
        what = f"OpCurve({self.kind!r})"
        if self.kind not in OP_CLASSES:
            raise ValueError(f"{what}: kind must be one of {', '.join(OP_CLASSES)}")
        try:
            points = sorted((float(p[0]), float(p[1]), float(p[2])) for p in self.points
                            if len(p) == 3)
            ok = len(points) == len(self.points) and bool(points)
        except (TypeError, IndexError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{what}: points must be a non-empty sequence of (size, "
                             f"forward_s, backward_s), got {self.points!r}")
        for p in points:
            if not all(math.isfinite(x) and x > 0 for x in p):
                raise ValueError(f"{what}: point {p!r} must have size and times > 0, finite")
        for a, b in zip(points, points[1:]):
            if a[0] == b[0] or b[1] < a[1] or b[2] < a[2]:
                raise ValueError(f"{what}: points {a!r} and {b!r}: sizes must be distinct "
                                 f"and times must not decrease with size")
        if not _number(self.spread) or self.spread < 0:
            raise ValueError(f"{what}: spread must be a number >= 0, got {self.spread!r}")
        object.__setattr__(self, "points", tuple(points))

    def times(self, size: float) -> tuple[float, float]:
        """(forward, backward) seconds of one op of `size` FLOPs or bytes."""
        xs = [p[0] for p in self.points]
        return (_power_law(xs, [p[1] for p in self.points], size),
                _power_law(xs, [p[2] for p in self.points], size))


# dtype names used in `peak_flops` / `compute_flops`, and the aliases users write.
_DTYPE_ALIASES = {
    "bf16": "bf16", "bfloat16": "bf16",
    "fp16": "fp16", "float16": "fp16", "half": "fp16",
    "fp32": "fp32", "float32": "fp32", "float": "fp32",
    "fp64": "fp64", "float64": "fp64", "double": "fp64",
    "tf32": "tf32",
}

# Where to look when a profile has no number for a dtype: (name, factor) in order, fp32
# always last. fp16 and bf16 run on the same tensor cores at the same rate on A100/H100, so
# each stands in for the other. fp64 without a number: half the fp32 rate (twice the bytes
# per SIMD lane; true of CPUs and of GPU vector units, e.g. H100 SXM 34 vs 67 TFLOP/s).
_FALLBACKS: dict[str, tuple[tuple[str, float], ...]] = {
    "bf16": (("bf16", 1.0), ("fp16", 1.0)),
    "fp16": (("fp16", 1.0), ("bf16", 1.0)),
    "fp64": (("fp64", 1.0), ("fp32", 0.5)),
}


def _dtype_name(dtype: torch.dtype | str) -> str:
    text = str(dtype).lower().strip()
    text = text.removeprefix("torch.")
    return _DTYPE_ALIASES.get(text, text)


def _pairs(value: Any, what: str) -> tuple[tuple[str, float], ...]:
    items = value.items() if isinstance(value, Mapping) else value
    try:
        out = tuple((str(k), float(v)) for k, v in items)
    except (TypeError, ValueError):
        raise ValueError(f"{what}: expected (dtype name, FLOP/s) pairs, got {value!r}") from None
    for k, v in out:
        if not math.isfinite(v) or v <= 0:
            raise ValueError(f"{what}: {k!r} must be a finite number > 0 FLOP/s, got {v!r}")
    return out


@dataclass(frozen=True)
class Hardware:
    """A device type and its interconnect: compute rates, memory and link levels.

    Attributes:
        name: e.g. "a100-80gb" or the name given to `calibrate`.
        devices_per_node: devices that share the fastest link (level 0).
        memory_bytes: memory per device.
        peak_flops: (dtype name, FLOP/s) pairs: datasheet peaks ("bf16", "fp16", "tf32",
            "fp32", "fp64"). A dict is accepted and stored as pairs.
        efficiency: achievable fraction of peak for large matmul-heavy work.
        links: link per level: 0 within a node (fastest), 1 across nodes.
        comm_tables: measured `CommTable`s (from calibrate); empty for presets.
        compute_flops: measured achieved FLOP/s per dtype (from calibrate); where present
            they override peak * efficiency.
        memory_bandwidth: bytes/s an elementwise op streams through device memory (0:
            unknown, and ops are costed by their FLOPs alone). Ops cost the longer of their
            FLOPs at `flops_per_second` and their bytes (inputs and outputs) at this rate: a
            roofline, so layer norms, activations and softmax cost something too.
        op_overhead_s: seconds of host time every op costs on top (dispatch, autograd
            bookkeeping, the runtime's interpreter). It is on the critical path where the
            host runs the ops itself (CPUs), and what makes many small microbatches slow
            there. 0 for the GPU presets: kernel launches overlap with the GPU's work.
        op_curves: measured forward and backward times per op class (`OpCurve`, from
            calibrate); an op of a class with a curve costs the curve's times instead of
            the roofline (they include the eager op's dispatch and autograd bookkeeping).
        overlap_slowdown: measured slowdown of a collective and compute running at once
            (`pxform.cost.model.OVERLAP_SLOWDOWN`'s meaning); 0: not measured.
        step_overhead_s, param_overhead_s, action_overhead_s, collective_overhead_s,
            param_action_overhead_s: pxform's own host time per training step, per
            parameter tensor per step, per pipeline action (one stage's forward or
            backward of one microbatch), per collective the program runs, and per
            parameter tensor of a stage per pipeline action, beyond the ops and the
            collectives' transfer (`pxform.tools.runtime_costs` measures them; 0: not
            measured).
        weight_op_overhead_s: the same, per weight op of a zero-bubble W action (the
            executor's autograd calls for that op's weight gradient, one op at a time).
        split_backward_share: what a backward split into zero-bubble's B and W costs
            beyond the fused backward, as a share of its time (0: not measured; about
            0.2-0.3 on this project's CPU, where each weight gradient is made from
            operands the input gradients' pass left cold).
        op_time_scale: a factor on every op's time (`CostModel.op_times`): a reference
            training step's measured time over the time the op model gives it
            (`pxform.tools.runtime_costs`). Ops timed alone in chains run faster than in a
            training step, where their inputs come cold from memory, the allocator
            churns and autograd's engine walks a larger graph; 1: not measured.
        forward_scale, backward_scale: factors on `op_time_scale` for an op's forward
            and its backward time apart: the reference step's forward (autograd's graph
            recorded) timed alone against the step, each against the op model
            (`pxform.tools.runtime_costs`). Op curves time forward and backward in chains;
            in a step the forward ran relatively slower (the reference transformer on
            this project's CPU: its forward priced 29 % under, its backward 11 %), and a
            recomputed forward, priced as one more forward, came out a quarter under;
            1: not measured (a preset, a device whose kernels run asynchronously).
        op_step_overhead_s: seconds every op costs in a training step on top of that,
            forward and backward together (a third forward, two thirds backward): the
            same reference step at two batch sizes separates the part that grows with
            the work (`op_time_scale`) from the part per op; 0: not measured.
        op_action_overhead_s: seconds each op of a pipeline stage costs per pipeline
            action on top of that (the executor runs a stage's graph once per microbatch,
            building its autograd graph anew): a reference transformer's 2-stage pipeline
            at 2 and 16 microbatches, against the model without it; 0: not measured.
        sync_wait: (gap seconds, wait seconds) points: what a synchronous collective
            (a tensor-parallel re-layout) or pipeline transfer costs beyond
            `collective_overhead_s` when each rank computed `gap` seconds since its
            previous one. Ranks computing apart drift (noise, preemption, a waiting
            thread put to sleep), and the collective waits for the slowest and wakes the
            waiters; the longer they computed, the longer that takes (on 2 gloo ranks
            here 0-0.85 ms after 2 ms of compute and 0-2.4 ms after 8 ms, from one
            calibration to the next). Piecewise linear in the gap, 0 at and below the
            first point, beyond the last growing as the square root of the gap (a drift
            of independent noise); non-decreasing (`sync_wait_s`; `pxform.runtime.
            calibrate` measures it on chains of matmuls up to 8 ms of compute, and
            `pxform.tools.runtime_costs` adds a point where a data-parallel step's last
            gradient bucket meets its peers after its backward; empty: not measured).
        recompute_overhead_s: seconds each recompute region costs per microbatch beyond
            the ops it runs again (torch's non-reentrant checkpoint: its frame, the saved
            tensors' hooks, the RNG state, the stop of the recompute, and the region's
            entry into pxform's process groups): a chain of tiny recomputed layers
            against the same without recompute; 0: not measured.
        relayout_overhead_s: seconds each run of re-layout collectives that follows
            compute (a synchronous conversion inside a block: tensor or sequence
            parallelism's) costs in a training step beyond its transfers,
            `collective_overhead_s` and `sync_wait`: the conversions' autograd functions
            and tensor wrapping between the collectives, the communication threads' CPU
            time taken from the ranks' compute, and the wake-ups of a rank that waited.
            `pxform.tools.runtime_costs` measures it on the reference transformer under
            tensor parallelism, against the model; pipeline transfers and ZeRO-3's
            prefetched gathers do not pay it; 0: not measured.
        relayout_wait_share: what such a run costs more per second of compute since the
            rank's previous collectives (seconds per second), on top of
            `relayout_overhead_s`: the run's cost grows with the compute before it well
            beyond `sync_wait` (on this project's 2-core machine, the reference
            transformer's tensor-parallel step at 8, 16, 32 and 64 sequences: 0.5-0.8,
            1.3-1.4, 1.6-2.7 and 3.8-4.5 ms per run, 2026-11-29), and a step whose
            conversions follow short compute pays less per run than one whose follow long
            (sequence parallelism's against tensor parallelism's). `pxform.tools.
            runtime_costs` measures it on the reference transformer under tensor and
            sequence parallelism; 0: not measured.
        relayout_gap_s: the mean compute before a run of those collectives in the steps
            `relayout_wait_share` was fitted on; beyond it a run's cost grows as the
            square root of its compute (`relayout_wait_s`); 0: in proportion to any
            compute (profiles before the forty-second session).
        all_to_all_share: an all-to-all's cost per collective as a share of
            `collective_overhead_s` (1: not measured): in a sequence-parallel GPT step
            on 2 gloo ranks the all-to-alls cost 0.5-0.6 ms beyond the comm table against
            1.5-2.7 ms for its all-reduces (2026-11-29). `pxform.tools.runtime_costs`
            sets it to an all-to-all's latency over an all-reduce's in the comm tables
            (one exchange against a ring's two rounds between 2 ranks).
        autograd_op_overhead_s, autograd_share: what recording autograd's graph costs a
            forward beyond the same forward without it (the shifted schedule's first
            forward of a stage that recomputes early runs without: `pxform.search.
            stages`): seconds per op (a node per op, its saved tensors' bookkeeping) and
            a share of the forward's time (the saved tensors keep their buffers, so the
            allocator hands out cold memory). The reference transformer's forward with
            and without gradients at each of its sizes, the differences fitted against
            the model's forward (`pxform.tools.runtime_costs`); on this CPU 5-7.5 us per
            op and 0-2 % on 2 ranks; 0: not measured.
        transfer_overhead_s: seconds a pipeline transfer between ranks delays the action
            that waits for it, beyond its bytes' time (the comm tables' p2p, in the
            sending and receiving actions) and `sync_wait`: the receiving rank woken, the
            transfer's thread scheduled, a peer's slow spell passed on. The schedule
            simulator charges it on a cross-rank dependency (`pxform.schedules.Costs.p2p`),
            so only where an action waits for its input: a schedule with slack there (the
            shifted schedule's early recompute, zero-bubble's W) hides it.
            `pxform.tools.runtime_costs` fits it with `receive_stall_s`, as one cost per
            transfer split 3 : 1 between the two, so that 2-stage 1F1B and interleaved
            pipelines' whole calls are priced at their measured shares of a
            data-parallel step (the twenty-seventh session, 2026-11-29). Earlier on
            2026-11-29 it wrote 0 and fitted the stall alone (interleaved plans came
            out 6 points over 1F1B's); before, this alone, fitted on 1F1B pipelines
            (0.6-1.85 ms here; zero-bubble, interleaved and shifted plans came out 4-7
            points under 1F1B's).
        send_overhead_s, receive_overhead_s: seconds a pipeline send costs the sending
            rank's thread (posting it, packing the boundary values), and a receive whose
            data has come the receiving rank's (waiting on it, unpacking), beyond the
            bytes' time: charged to every action per transfer it makes (a stage's F sends
            unless the stage is the last, receives unless it is the first; its B the other
            way round), so a stage in the middle (an interleaved schedule's chunks, a
            pipeline of more than 2 stages) pays two per action where a 2-stage pipeline's
            pay one. `pxform.tools.runtime_costs` reads both off the recorded sends and
            receives (`SF`, `SB`: their mean; `RF`, `RB`: their lower quartile) of a
            2-stage 1F1B pipeline; 0: not measured.
        receive_stall_s: seconds each pipeline transfer costs the receiving rank beyond
            `receive_overhead_s` and the bytes' time, charged like it, to every action
            per transfer it receives: the receive stalls by this much even where the
            schedule has the data there in time, so no schedule's slack hides it. GPT
            small's 2-stage pipelines at 8 microbatches on 2 CPU ranks, every action
            recorded and simulated with the recorded means (2026-11-29, three runs): the
            stall that matches each measured span was 0.60-1.30 ms, within 0.4 ms of one
            value for 1F1B, zero-bubble, interleaved and shifted in two runs, where a
            delay charged only on the waits (`transfer_overhead_s`) had to be 0.83-1.42
            ms for 1F1B and 1.7-3.0 ms for the others (they have slack to hide it in).
            `pxform.tools.runtime_costs` fits it with `transfer_overhead_s` (a quarter
            of one cost per transfer, module doc there); until the twenty-seventh
            session alone, so that recorded 1F1B and zero-bubble actions simulated gave
            the recorded spans; 0: not measured.
        host_overlaps: the device runs kernels asynchronously to the host (CUDA): the
            host's time per op (`op_step_overhead_s`) runs while the device computes,
            so a stage's forward or backward pass takes the longer of the two, not their
            sum (`pxform.search.stages`), and `pxform.tools.runtime_costs` fits the
            reference step that way. On an H200, GPT 125M-760M steps priced as the sum
            came out 37-74 % over: they are host-bound there. False (CPUs, where one
            thread does both): they add. `pxform.runtime.calibrate` sets it from the
            device it measured.
        calibrations: the calibrations of this machine the profile was chosen among,
            each whole (`pxform.tools.runtime_costs.representative_profile`, which `pxform
            calibrate --runs N` writes); () for one calibration or a preset. The search
            chooses with this profile's numbers and then prices the chosen plan with each
            calibration: the plan's `step_time_s` is the median of those prices and
            `calibration_step_times_s` holds them all, the prediction's spread from
            calibration to calibration. One calibration's prices of a plan moved about 5
            points against another's minutes apart on 2 CPU ranks (standard deviation,
            relative to data parallelism's, 50 runs of `benchmarks/accuracy.py`).
        source: where the numbers come from.

    Example:
        >>> hw = hardware("a100-80gb")
        >>> hw.compute_time(156e12, torch.bfloat16)
        1.0
        >>> hw.level(8), hw.level(16)
        (0, 1)
    """

    name: str
    devices_per_node: int
    memory_bytes: int
    peak_flops: tuple[tuple[str, float], ...]
    efficiency: float
    links: tuple[Link, ...]
    comm_tables: tuple[CommTable, ...] = ()
    compute_flops: tuple[tuple[str, float], ...] = ()
    source: str = ""
    memory_bandwidth: float = 0.0
    op_overhead_s: float = 0.0
    op_curves: tuple[OpCurve, ...] = ()
    overlap_slowdown: float = 0.0
    step_overhead_s: float = 0.0
    param_overhead_s: float = 0.0
    action_overhead_s: float = 0.0
    collective_overhead_s: float = 0.0
    param_action_overhead_s: float = 0.0
    weight_op_overhead_s: float = 0.0
    split_backward_share: float = 0.0
    op_time_scale: float = 1.0
    forward_scale: float = 1.0
    backward_scale: float = 1.0
    op_step_overhead_s: float = 0.0
    op_action_overhead_s: float = 0.0
    recompute_overhead_s: float = 0.0
    relayout_overhead_s: float = 0.0
    relayout_wait_share: float = 0.0
    relayout_gap_s: float = 0.0
    all_to_all_share: float = 1.0
    autograd_op_overhead_s: float = 0.0
    autograd_share: float = 0.0
    transfer_overhead_s: float = 0.0
    send_overhead_s: float = 0.0
    receive_overhead_s: float = 0.0
    receive_stall_s: float = 0.0
    host_overlaps: bool = False
    sync_wait: tuple[tuple[float, float], ...] = ()
    calibrations: tuple[Hardware, ...] = ()

    def __post_init__(self) -> None:
        what = f"Hardware {self.name!r}"
        if (isinstance(self.devices_per_node, bool) or not isinstance(self.devices_per_node, int)
                or self.devices_per_node < 1):
            raise ValueError(f"{what}: devices_per_node must be an int >= 1, got "
                             f"{self.devices_per_node!r}")
        if (isinstance(self.memory_bytes, bool) or not isinstance(self.memory_bytes, int)
                or self.memory_bytes <= 0):
            raise ValueError(f"{what}: memory_bytes must be an int > 0, got "
                             f"{self.memory_bytes!r}")
        if not _number(self.efficiency) or not 0 < self.efficiency <= 1:
            raise ValueError(f"{what}: efficiency must be in (0, 1], got {self.efficiency!r}")
        object.__setattr__(self, "peak_flops", _pairs(self.peak_flops, f"{what}: peak_flops"))
        object.__setattr__(self, "compute_flops",
                           _pairs(self.compute_flops, f"{what}: compute_flops"))
        object.__setattr__(self, "links", tuple(self.links))
        object.__setattr__(self, "comm_tables", tuple(self.comm_tables))
        if not self.links or not all(isinstance(x, Link) for x in self.links):
            raise ValueError(f"{what}: links must be a non-empty sequence of Link (level 0 "
                             f"first), got {self.links!r}")
        if not all(isinstance(t, CommTable) for t in self.comm_tables):
            raise ValueError(f"{what}: comm_tables must hold CommTable objects")
        for t in self.comm_tables:
            if t.level >= len(self.links):
                raise ValueError(f"{what}: a {t.kind} table is for link level {t.level} but "
                                 f"there are only {len(self.links)} links")
        if not _number(self.memory_bandwidth) or self.memory_bandwidth < 0:
            raise ValueError(f"{what}: memory_bandwidth must be a number >= 0 (bytes/s; 0 "
                             f"for unknown), got {self.memory_bandwidth!r}")
        if not _number(self.op_overhead_s) or self.op_overhead_s < 0:
            raise ValueError(f"{what}: op_overhead_s must be a number >= 0 (seconds), got "
                             f"{self.op_overhead_s!r}")
        object.__setattr__(self, "op_curves", tuple(self.op_curves))
        if not all(isinstance(c, OpCurve) for c in self.op_curves) or \
                len({c.kind for c in self.op_curves}) != len(self.op_curves):
            raise ValueError(f"{what}: op_curves must hold OpCurve objects, one per kind")
        if not _number(self.overlap_slowdown) or not (self.overlap_slowdown == 0
                                                      or self.overlap_slowdown >= 1):
            raise ValueError(f"{what}: overlap_slowdown must be 0 (not measured) or >= 1, "
                             f"got {self.overlap_slowdown!r}")
        if not isinstance(self.host_overlaps, bool):
            raise ValueError(f"{what}: host_overlaps must be True or False, got "
                             f"{self.host_overlaps!r}")
        if not _number(self.op_time_scale) or self.op_time_scale <= 0:
            raise ValueError(f"{what}: op_time_scale must be a number > 0 (1: not measured), "
                             f"got {self.op_time_scale!r}")
        for key in ("forward_scale", "backward_scale"):
            if not _number(getattr(self, key)) or getattr(self, key) <= 0:
                raise ValueError(f"{what}: {key} must be a number > 0 (a factor on "
                                 f"op_time_scale; 1: not measured), got "
                                 f"{getattr(self, key)!r}")
        for key in _FIXED_COSTS:
            value = getattr(self, key)
            if not _number(value) or value < 0:
                raise ValueError(f"{what}: {key} must be a number >= 0 (seconds), got "
                                 f"{value!r}")
        if not _number(self.split_backward_share) or self.split_backward_share < 0:
            raise ValueError(f"{what}: split_backward_share must be a number >= 0 (a share of "
                             f"a split backward's time; 0: not measured), got "
                             f"{self.split_backward_share!r}")
        if not _number(self.relayout_wait_share) or self.relayout_wait_share < 0:
            raise ValueError(f"{what}: relayout_wait_share must be a number >= 0 (seconds per "
                             f"second of compute; 0: not measured), got "
                             f"{self.relayout_wait_share!r}")
        if not _number(self.all_to_all_share) or self.all_to_all_share < 0:
            raise ValueError(f"{what}: all_to_all_share must be a number >= 0 (a share of "
                             f"collective_overhead_s; 1: not measured), got "
                             f"{self.all_to_all_share!r}")
        if not _number(self.autograd_share) or not 0 <= self.autograd_share < 1:
            raise ValueError(f"{what}: autograd_share must be a number in [0, 1) (a share "
                             f"of a forward's time; 0: not measured), got "
                             f"{self.autograd_share!r}")
        object.__setattr__(self, "sync_wait", _sync_points(self.sync_wait, what))
        object.__setattr__(self, "calibrations", tuple(self.calibrations))
        for i, c in enumerate(self.calibrations):
            if not isinstance(c, Hardware) or c.calibrations:
                raise ValueError(f"{what}: calibrations[{i}] must be a Hardware profile of "
                                 f"one calibration (no calibrations of its own), got "
                                 f"{type(c).__name__}")
            # (memory is not priced from them: a profile given another memory size
            # keeps its calibrations)
            if c.devices_per_node != self.devices_per_node:
                raise ValueError(f"{what}: calibrations[{i}] ({c.name!r}) has "
                                 f"{c.devices_per_node} devices per node, the profile "
                                 f"{self.devices_per_node}; keep calibrations of this machine "
                                 f"and world only, or pass calibrations=() with a changed "
                                 f"devices_per_node")
        if "fp32" not in dict(self.peak_flops) and "fp32" not in dict(self.compute_flops):
            raise ValueError(f"{what}: needs an 'fp32' entry in peak_flops or "
                             f"compute_flops (the fallback for dtypes without a number)")

    # ------------------------------------------------------------------------ compute
    def _achieved(self, name: str) -> float | None:
        measured = dict(self.compute_flops)
        if name in measured:
            return measured[name]
        peak = dict(self.peak_flops)
        if name in peak:
            return peak[name] * self.efficiency
        return None

    def flops_per_second(self, dtype: torch.dtype | str) -> float:
        """Achievable FLOP/s for matmul-heavy work in `dtype`.

        The measured number (`compute_flops`) if there is one, else peak * efficiency.
        `dtype` is a torch dtype or a name: "bf16", "fp16", "tf32", "fp32", "fp64" (also
        "bfloat16", "float16", "half", "float32", "float", "float64", "double"). A dtype
        the profile has no number for falls back: fp16 <-> bf16 (same tensor-core rate on
        A100/H100), fp64 -> half of fp32, anything else (other names, integer dtypes) ->
        fp32.

        Example:
            >>> hardware("h100-80gb").flops_per_second(torch.bfloat16)
            494500000000000.0
            >>> hardware("h100-80gb").flops_per_second("int8") == \\
            ...     hardware("h100-80gb").flops_per_second("fp32")
            True
        """
        name = _dtype_name(dtype)
        chain = _FALLBACKS.get(name, ((name, 1.0),)) + (("fp32", 1.0),)
        for candidate, factor in chain:
            value = self._achieved(candidate)
            if value is not None:
                return value * factor
        raise AssertionError("unreachable: __post_init__ requires an fp32 number")

    def compute_time(self, flops: float, dtype: torch.dtype | str) -> float:
        """Seconds to do `flops` floating-point operations in `dtype`.

        Example:
            >>> hardware("a100-40gb").compute_time(312e12, "bf16")
            2.0
        """
        if flops < 0:
            raise ValueError(f"Hardware.compute_time: flops must be >= 0, got {flops!r}")
        return flops / self.flops_per_second(dtype)

    def op_curve(self, kind: str) -> OpCurve | None:
        """The measured curve of op class `kind`, if the profile has one."""
        for c in self.op_curves:
            if c.kind == kind:
                return c
        return None

    def memory_time(self, nbytes: float) -> float:
        """Seconds to stream `nbytes` through device memory (0 when the bandwidth is
        unknown).

        Example:
            >>> hardware("h100-80gb").memory_time(2.68e12)  # (the preset's achieved rate)
            1.0
        """
        return nbytes / self.memory_bandwidth if self.memory_bandwidth > 0 else 0.0

    # ------------------------------------------------------------------------ comms
    def level(self, span: int) -> int:
        """The link level a group uses whose ranks lie within `span` consecutive ranks: 0
        if they fit in one node (`span <= devices_per_node`), else 1; clamped to the levels
        this profile has.

        Example:
            >>> hw = hardware("h100-80gb")
            >>> [hw.level(s) for s in (1, 8, 9, 1024)]
            [0, 0, 1, 1]
        """
        if span < 1:
            raise ValueError(f"Hardware.level: span must be >= 1, got {span!r}")
        return min(0 if span <= self.devices_per_node else 1, len(self.links) - 1)

    def comm_time(self, kind: str, sent_bytes: float, group_size: int, level: int) -> float:
        """Seconds for one collective of `kind` over `group_size` ranks on link `level`,
        where each rank sends `sent_bytes` (the ring volumes `pxform.core.layout` reports:
        all_gather (n-1) x local, reduce_scatter (n-1)/n, all_reduce 2(n-1)/n, all_to_all
        (n-1)/n; p2p: the message).

        0.0 for a group of one, and for zero bytes except p2p (an empty message still
        costs one latency).

        With a measured `CommTable` of this kind and level: the table of the same group
        size if there is one; otherwise the table of the nearest group size (ties: the
        larger), corrected for the different number of ring steps:
        `table.time(sent) + (steps(n) - steps(m)) * latency`, with the level's fitted
        latency, and never below `sent / bandwidth`. (The bandwidth term needs no
        correction: the caller's `sent_bytes` already counts the volume for `n` ranks.)

        Otherwise the alpha-beta formula: `steps(kind, n) * latency + sent / bandwidth`,
        steps: all_reduce 2(n-1); all_gather, reduce_scatter, all_to_all n-1; p2p 1.

        Example:
            >>> hw = hardware("a100-80gb")
            >>> round(hw.comm_time("all_gather", 7 * 2**20, 8, 0) * 1e6, 1)  # 70 us + 31.9 us
            101.9
        """
        _check_kind(kind, "Hardware.comm_time")
        if not _number(sent_bytes) or sent_bytes < 0:
            raise ValueError(f"Hardware.comm_time: sent_bytes must be a finite number >= 0, "
                             f"got {sent_bytes!r}")
        if not 0 <= level < len(self.links):
            raise ValueError(f"Hardware.comm_time: level {level!r} is not one of this "
                             f"profile's link levels 0..{len(self.links) - 1}; use "
                             f"Hardware.level(span) to pick one")
        if group_size <= 1 or (sent_bytes == 0 and kind != "p2p"):
            return 0.0
        link = self.links[level]
        steps = ring_steps(kind, group_size)
        tables = [t for t in self.comm_tables if t.kind == kind and t.level == level]
        if tables:
            table = min(tables, key=lambda t: (abs(t.group_size - group_size), -t.group_size))
            t = table.time(sent_bytes)
            if table.group_size == group_size:
                return t
            t += (steps - ring_steps(kind, table.group_size)) * link.latency_s
            return max(t, sent_bytes / link.bandwidth)
        return steps * link.latency_s + sent_bytes / link.bandwidth

    def sync_wait_s(self, gap_s: float) -> float:
        """Seconds a synchronous collective or pipeline transfer waits beyond
        `collective_overhead_s` after `gap_s` seconds of compute since the rank's previous
        one (`sync_wait`): 0 without a measurement, at or below the first point's gap;
        linear between points; beyond the last, its wait times the square root of the
        gap over its gap.

        Beyond the last point (8 ms on CPUs) the ranks' drift keeps growing: a sum of
        independent delays on each rank, so its spread grows as the square root of the
        time (measured on 2 gloo ranks, 2026-11-27: 0.6-1.7 ms at 6-8 ms, 1.6-1.7 at
        24-32, 1.6-3.0 at 48-65; GPT small's data-parallel ranks met at their last
        gradient bucket 2.3 ms apart after a 35 ms backward, 2026-12-01). A fourth point
        measured at 32 ms was too noisy to keep (0.75-5.0 ms over five calibrations,
        `docs/search.md`), so the curve is extended, not measured, there. Until the
        fortieth session (2026-12-01) the last point's wait held flat beyond it: the 32
        saved accuracy runs since the twenty-ninth session priced again, 282 of 384
        plans within 10 % flat and 288 with the square root (data parallelism's mean
        error -5.2 -> -3.6 %, sequence parallelism's -3.7 -> -2.0); a wait in
        proportion to the gap gave 294, but twice the measured waits at 24-32 ms and
        more beyond. Over a longer gap the wait's share of it only shrinks.

        Example:
            >>> hw = dataclasses.replace(hardware("a100-80gb"),
            ...                          sync_wait=((1e-3, 0.0), (5e-3, 4e-4)))
            >>> hw.sync_wait_s(5e-4), round(hw.sync_wait_s(3e-3), 6)
            (0.0, 0.0002)
            >>> round(hw.sync_wait_s(2e-2), 6)  # 4 times the last gap: twice its wait
            0.0008
        """
        points = self.sync_wait
        if not points or gap_s <= points[0][0]:
            return 0.0
        if gap_s >= points[-1][0]:
            return points[-1][1] * math.sqrt(gap_s / points[-1][0])
        i = bisect.bisect_right([g for g, _ in points], gap_s) - 1
        (g0, w0), (g1, w1) = points[i], points[i + 1]
        return w0 + (w1 - w0) * (gap_s - g0) / (g1 - g0)

    def relayout_wait_s(self, gap_s: float) -> float:
        """Seconds a run of a conversion's collectives costs for the `gap_s` seconds of
        compute before it, beyond `sync_wait` and `relayout_overhead_s`:
        `relayout_wait_share` per second of it up to `relayout_gap_s` (the compute the
        share was fitted at), and beyond, that times the square root of the gap over it
        (all in proportion where `relayout_gap_s` is 0).

        The share is fitted on the reference transformer, whose runs follow 1-2 ms of
        compute on this project's 2-core machine; a GPT's follow 5-20. There the cost per
        run grew far less than in proportion: fitted on a held-out GPT's own
        tensor-parallel steps (2 layers of width 256, 128 tokens) at 4, 8 and 16
        sequences, the share came out 0.51, 0.68 and 0.20 (0.44, 0.43 and 0.31 with
        sequence parallelism) where the reference's was 0.65, and in proportion the
        tensor-parallel plans of five accuracy runs on four GPT shapes came out 9-24 %
        over, the conversions' cost 1.5-4.5 times what the steps left for it (the
        forty-second session, `docs/benchmarks/accuracy.md`).

        Example:
            >>> hw = dataclasses.replace(hardware("a100-80gb"), relayout_wait_share=0.5,
            ...                          relayout_gap_s=2e-3)
            >>> round(hw.relayout_wait_s(1e-3), 6), round(hw.relayout_wait_s(8e-3), 6)
            (0.0005, 0.002)
        """
        share, anchor = self.relayout_wait_share, self.relayout_gap_s
        if anchor <= 0 or gap_s <= anchor:
            return share * gap_s
        return share * anchor * math.sqrt(gap_s / anchor)

    def axis_cost(self, level: int) -> AxisCost:
        """The re-layout planner's cost of a mesh axis on link `level`: the link's latency
        (per ring step) and seconds per byte.

        Example:
            >>> hardware("a100-80gb").axis_cost(1)
            AxisCost(latency=2e-05, seconds_per_byte=4e-11)
        """
        link = self.links[level]
        return AxisCost(latency=link.latency_s, seconds_per_byte=1 / link.bandwidth)

    # ------------------------------------------------------------------------ JSON
    def to_json(self) -> dict[str, Any]:
        """The profile as a JSON-ready dict (format "pxform-hardware/1").

        Example:
            >>> d = hardware("a100-80gb").to_json()
            >>> d["format"], d["peak_flops"]["bf16"]
            ('pxform-hardware/1', 312000000000000.0)
        """
        return {
            "format": FORMAT,
            "name": self.name,
            "devices_per_node": self.devices_per_node,
            "memory_bytes": self.memory_bytes,
            "peak_flops": dict(self.peak_flops),
            "efficiency": self.efficiency,
            "links": [{"name": x.name, "latency_s": x.latency_s, "bandwidth": x.bandwidth,
                       "source": x.source} for x in self.links],
            "comm_tables": [{"kind": t.kind, "level": t.level, "group_size": t.group_size,
                             "points": [list(p) for p in t.points]} for t in self.comm_tables],
            "compute_flops": dict(self.compute_flops),
            "memory_bandwidth": self.memory_bandwidth,
            "op_overhead_s": self.op_overhead_s,
            "op_curves": [{"kind": c.kind, "points": [list(p) for p in c.points],
                           "spread": c.spread} for c in self.op_curves],
            "overlap_slowdown": self.overlap_slowdown,
            **{key: getattr(self, key) for key in _FIXED_COSTS},
            "op_time_scale": self.op_time_scale,
            "forward_scale": self.forward_scale,
            "backward_scale": self.backward_scale,
            "autograd_share": self.autograd_share,
            "split_backward_share": self.split_backward_share,
            "relayout_wait_share": self.relayout_wait_share,
            "all_to_all_share": self.all_to_all_share,
            "host_overlaps": self.host_overlaps,
            "sync_wait": [list(p) for p in self.sync_wait],
            "source": self.source,
            # (only where there are some: profiles of one calibration read as before)
            **({"calibrations": [c.to_json() for c in self.calibrations]}
               if self.calibrations else {}),
        }

    @staticmethod
    def from_json(d: Mapping[str, Any]) -> Hardware:
        """The profile `to_json` wrote (validated: a bad key raises ValueError naming it).

        Example:
            >>> hw = hardware("h100-80gb")
            >>> Hardware.from_json(hw.to_json()) == hw
            True
        """
        return _from_json(d, "the profile dict")

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the profile as JSON to `path` (never pickle).

        Example:
            >>> hardware("a100-80gb").save("a100.json")
            >>> Hardware.load("a100.json").name
            'a100-80gb'
        """
        text = json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n"
        tmp = f"{os.fspath(path)}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)  # never leave a half-written profile behind

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Hardware:
        """Read a profile written by `save` or `pxform calibrate --out PATH`.

        Raises:
            ValueError: the file is not valid JSON or not a pxform hardware profile; the
                message names the file, the key, what was wrong and how to fix it.

        Example:
            >>> hardware("a100-80gb").save("a100.json")
            >>> Hardware.load("a100.json").links[0].bandwidth
            230000000000.0
        """
        where = os.fspath(path)
        with open(where, encoding="utf-8") as f:
            text = f.read()
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"Hardware.load: {where} is not valid JSON ({e.msg} at line "
                             f"{e.lineno} column {e.colno}); {_FIX}") from None
        return _from_json(data, str(where))


_FIX = ("write the profile again with `pxform calibrate --out PATH` or Hardware.save, or "
        "correct the file by hand")


def _from_json(d: Any, where: str) -> Hardware:
    def bad(key: str, problem: str) -> ValueError:
        return ValueError(f"Hardware.load: {where}: key {key!r} {problem}; {_FIX}")

    if not isinstance(d, Mapping):
        raise ValueError(f"Hardware.load: {where}: expected a JSON object with a 'format' "
                         f"key, got {type(d).__name__}; {_FIX}")
    if d.get("format") != FORMAT:
        got = "is missing" if "format" not in d else f"is {d['format']!r}"
        raise bad("format", f"{got}, expected {FORMAT!r} (not a pxform hardware profile, or "
                            f"one from another pxform version)")
    known = {"format", "name", "devices_per_node", "memory_bytes", "peak_flops",
             "efficiency", "links", "comm_tables", "compute_flops", "source",
             "memory_bandwidth", "op_overhead_s", "op_curves", "overlap_slowdown",
             "op_time_scale", "forward_scale", "backward_scale", "autograd_share",
             "split_backward_share", "relayout_wait_share", "all_to_all_share",
             "host_overlaps", "sync_wait", "calibrations", *_FIXED_COSTS}
    for key in d:
        if key not in known:
            raise bad(key, f"is not a profile key (known: {', '.join(sorted(known))})")

    def get(key: str, kind: str, default: Any = None, required: bool = True) -> Any:
        if key not in d:
            if required:
                raise bad(key, f"is missing (expected {kind})")
            return default
        value = d[key]
        checks = {
            "a string": lambda v: isinstance(v, str),
            "an integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
            "a number": _number,
            "an object of dtype name -> FLOP/s": lambda v: isinstance(v, Mapping)
            and all(isinstance(k, str) and _number(x) for k, x in v.items()),
            "a list": lambda v: isinstance(v, list),
            "true or false": lambda v: isinstance(v, bool),
        }
        if not checks[kind](value):
            raise bad(key, f"must be {kind}, got {value!r}")
        return value

    name = get("name", "a string")
    devices_per_node = get("devices_per_node", "an integer")
    memory_bytes = get("memory_bytes", "an integer")
    peak = get("peak_flops", "an object of dtype name -> FLOP/s")
    efficiency = get("efficiency", "a number")
    links_json = get("links", "a list")
    tables_json = get("comm_tables", "a list", [], required=False)
    compute = get("compute_flops", "an object of dtype name -> FLOP/s", {}, required=False)
    source = get("source", "a string", "", required=False)
    bandwidth = get("memory_bandwidth", "a number", 0.0, required=False)
    overhead = get("op_overhead_s", "a number", 0.0, required=False)
    curves_json = get("op_curves", "a list", [], required=False)
    overlap = get("overlap_slowdown", "a number", 0.0, required=False)
    scale = get("op_time_scale", "a number", 1.0, required=False)
    forward_scale = get("forward_scale", "a number", 1.0, required=False)
    backward_scale = get("backward_scale", "a number", 1.0, required=False)
    autograd_share = get("autograd_share", "a number", 0.0, required=False)
    split_share = get("split_backward_share", "a number", 0.0, required=False)
    wait_share = get("relayout_wait_share", "a number", 0.0, required=False)
    a2a_share = get("all_to_all_share", "a number", 1.0, required=False)
    host_overlaps = get("host_overlaps", "true or false", False, required=False)
    fixed = {key: float(get(key, "a number", 0.0, required=False))
             for key in _FIXED_COSTS}
    sync_json = get("sync_wait", "a list", [], required=False)
    if not all(isinstance(p, list) and len(p) == 2 and all(map(_number, p))
               for p in sync_json):
        raise bad("sync_wait", f"must be a list of [gap_s, wait_s] pairs, got {sync_json!r}")
    members = [_from_json(c, f"{where}: calibrations[{i}]")
               for i, c in enumerate(get("calibrations", "a list", [], required=False))]

    links: list[Link] = []
    for i, x in enumerate(links_json):
        if not (isinstance(x, Mapping) and set(x) <= {"name", "latency_s", "bandwidth", "source"}
                and isinstance(x.get("name"), str) and _number(x.get("latency_s"))
                and _number(x.get("bandwidth")) and isinstance(x.get("source", ""), str)):
            raise bad("links", f"entry {i} must be an object with name (string), latency_s "
                               f"and bandwidth (numbers) and optional source, got {x!r}")
        try:
            links.append(Link(x["name"], float(x["latency_s"]), float(x["bandwidth"]),
                              x.get("source", "")))
        except ValueError as e:
            raise bad("links", f"entry {i}: {e}") from None
    tables: list[CommTable] = []
    for i, t in enumerate(tables_json):
        if not (isinstance(t, Mapping) and set(t) == {"kind", "level", "group_size", "points"}
                and isinstance(t["points"], list)
                and all(isinstance(p, list) and len(p) == 2 and all(map(_number, p))
                        for p in t["points"])):
            raise bad("comm_tables", f"entry {i} must be an object with kind, level, "
                                     f"group_size and points (a list of [sent_bytes, "
                                     f"seconds] pairs), got {t!r}")
        try:
            tables.append(CommTable(t["kind"], t["level"], t["group_size"],
                                    tuple((float(b), float(s)) for b, s in t["points"])))
        except ValueError as e:
            raise bad("comm_tables", f"entry {i}: {e}") from None
    curves: list[OpCurve] = []
    for i, c in enumerate(curves_json):
        if not (isinstance(c, Mapping) and set(c) <= {"kind", "points", "spread"}
                and {"kind", "points"} <= set(c) and isinstance(c["points"], list)
                and all(isinstance(p, list) and len(p) == 3 and all(map(_number, p))
                        for p in c["points"]) and _number(c.get("spread", 0.0))):
            raise bad("op_curves", f"entry {i} must be an object with kind, points (a list "
                                   f"of [size, forward_s, backward_s]) and optional spread, "
                                   f"got {c!r}")
        try:
            curves.append(OpCurve(c["kind"], tuple((float(p[0]), float(p[1]), float(p[2]))
                                                   for p in c["points"]),
                                  float(c.get("spread", 0.0))))
        except ValueError as e:
            raise bad("op_curves", f"entry {i}: {e}") from None
    try:
        return Hardware(name=name, devices_per_node=devices_per_node,
                        memory_bytes=memory_bytes, peak_flops=tuple(peak.items()),
                        efficiency=float(efficiency), links=tuple(links),
                        comm_tables=tuple(tables), compute_flops=tuple(compute.items()),
                        source=source, memory_bandwidth=float(bandwidth),
                        op_overhead_s=float(overhead), op_curves=tuple(curves),
                        overlap_slowdown=float(overlap), op_time_scale=float(scale),
                        forward_scale=float(forward_scale),
                        backward_scale=float(backward_scale),
                        autograd_share=float(autograd_share),
                        split_backward_share=float(split_share),
                        relayout_wait_share=float(wait_share),
                        all_to_all_share=float(a2a_share), host_overlaps=host_overlaps,
                        sync_wait=tuple((float(g), float(w)) for g, w in sync_json),
                        calibrations=tuple(members), **fixed)
    except ValueError as e:
        raise ValueError(f"Hardware.load: {where}: {e}; {_FIX}") from None


# ---------------------------------------------------------------------------- presets
# Sources:
# [A100] NVIDIA A100 Tensor Core GPU datasheet (SXM column): BF16/FP16 tensor core 312
#   TFLOP/s dense (624 with sparsity), TF32 156 dense, FP32 19.5, FP64 tensor core 19.5;
#   NVLink 3: 600 GB/s total (both directions) per GPU.
# [H100] NVIDIA H100 Tensor Core GPU datasheet (SXM column): BF16/FP16 1,979 TFLOP/s with
#   sparsity = 989 dense, TF32 989 with sparsity = 494.5 dense, FP32 67, FP64 tensor core
#   67; NVLink 4: 900 GB/s total per GPU.
# [DGX] NVIDIA DGX A100 / DGX H100 user guides: 8 GPUs per node, 8 single-port compute
#   HCAs, one per GPU: ConnectX-6 InfiniBand HDR 200 Gb/s (A100), ConnectX-7 NDR 400 Gb/s
#   (H100).
# [NCCL-A100] nccl-tests all_reduce_perf busbw on 8 A100 SXM (NVSwitch) reaches ~230 GB/s:
#   S. Jeaugey (NCCL), github.com/NVIDIA/nccl-tests/issues/149 ("should reach 230 GB/s");
#   also 232.5 GB/s measured in nccl-tests/issues/175.
# [NCCL-H100] nccl-tests busbw on 8 H100 SXM: ~370 GB/s effective NVLink bandwidth for ring
#   algorithms (450 GB/s line rate minus ~20% protocol overhead), ~480 GB/s for all_reduce
#   with NVLink SHARP: S. Jeaugey, github.com/NVIDIA/nccl-tests/issues/212. We use the ring
#   number, rounded down: the alpha-beta model here is a ring model.
# [MFU] Efficiency 0.5 = model FLOPs utilisation of large training runs: Narayanan et al.
#   2021 ("Efficient Large-Scale Language Model Training on GPU Clusters Using
#   Megatron-LM", SC'21) report 163 TFLOP/s per A100 = 52% of peak for GPT-3 175B and 40-55%
#   across their model sizes; Dubey et al. 2024 (Llama 3) report 38-43% BF16 MFU on H100,
#   so 0.5 is on the optimistic side there.
# [LAT] Latencies are typical orders of magnitude, not datasheet numbers: ~10 us per ring
#   step within an NVLink node and ~20 us across InfiniBand (NCCL's small-message
#   all_reduce times on 8 GPUs are tens of microseconds). Run `pxform calibrate` for real
#   numbers: the ring model overestimates small messages that NCCL sends with tree or
#   low-latency protocols.
#
# fp32 is plain FP32 (19.5 / 67 TFLOP/s), not TF32: PyTorch runs fp32 matmuls in TF32 only
# when torch.backends.cuda.matmul.allow_tf32 (or set_float32_matmul_precision("high")) is
# set, which is off by default. Ask for "tf32" to get the TF32 rate.
#
# Memory: the datasheets' "40GB" / "80GB" are the device's HBM in binary units: 40 GiB and
# 80 GiB (nvidia-smi shows about 40960 / 81920 MiB; the driver reserves a little of it).

_NVLINK3 = Link("nvlink3", latency_s=10e-6,  # [LAT]
                bandwidth=230e9,  # [NCCL-A100] all_reduce busbw, 8x A100 SXM
                source="nccl-tests busbw ~230 GB/s on 8x A100 SXM (nccl-tests#149); "
                       "latency: typical order of magnitude")
_HDR = Link("infiniband-hdr", latency_s=20e-6,  # [LAT]
            bandwidth=25e9,  # [DGX] one HDR 200 Gb/s HCA per GPU = 25 GB/s
            source="DGX A100: one InfiniBand HDR 200 Gb/s HCA per GPU; latency: typical")
_NVLINK4 = Link("nvlink4", latency_s=10e-6,  # [LAT]
                bandwidth=360e9,  # [NCCL-H100] ring busbw ~370 GB/s, 8x H100 SXM
                source="nccl-tests ring busbw ~370 GB/s on 8x H100 SXM (nccl-tests#212); "
                       "latency: typical order of magnitude")
_NDR = Link("infiniband-ndr", latency_s=20e-6,  # [LAT]
            bandwidth=50e9,  # [DGX] one NDR 400 Gb/s HCA per GPU = 50 GB/s
            source="DGX H100: one InfiniBand NDR 400 Gb/s HCA per GPU; latency: typical")

_A100_FLOPS = (
    ("bf16", 312e12),  # [A100] BF16 tensor core, dense
    ("fp16", 312e12),  # [A100] FP16 tensor core, dense
    ("tf32", 156e12),  # [A100] TF32 tensor core, dense (only when TF32 is enabled)
    ("fp32", 19.5e12),  # [A100] FP32 (no tensor cores; PyTorch's default for fp32 matmul)
    ("fp64", 19.5e12),  # [A100] FP64 tensor core (cuBLAS DGEMM uses it)
)
_H100_FLOPS = (
    ("bf16", 989e12),  # [H100] BF16 tensor core: 1,979 with sparsity / 2
    ("fp16", 989e12),  # [H100] FP16 tensor core: 1,979 with sparsity / 2
    ("tf32", 494.5e12),  # [H100] TF32 tensor core: 989 with sparsity / 2
    ("fp32", 67e12),  # [H100] FP32 (SXM)
    ("fp64", 67e12),  # [H100] FP64 tensor core (SXM)
)
_EFFICIENCY = 0.5  # [MFU]
# Achieved share of datasheet HBM bandwidth for streaming elementwise kernels: STREAM-like
# copies reach about 90% on A100/H100 (NVIDIA's published babelstream/STREAM figures are
# 1.3-1.4 TB/s of A100-40GB's 1.555); 0.8 leaves room for the less regular ops.
_BANDWIDTH_EFFICIENCY = 0.8

PRESETS: dict[str, Hardware] = {
    "a100-40gb": Hardware(
        name="a100-40gb", devices_per_node=8,  # [DGX] DGX A100: 8 GPUs
        memory_bytes=40 * 2**30,  # [A100] "40GB" HBM2 = 40 GiB
        peak_flops=_A100_FLOPS, efficiency=_EFFICIENCY, links=(_NVLINK3, _HDR),
        memory_bandwidth=1.555e12 * _BANDWIDTH_EFFICIENCY,  # [A100] HBM2 1,555 GB/s
        source="NVIDIA A100 SXM datasheet, DGX A100 user guide, nccl-tests busbw; "
               "efficiency 0.5 after Narayanan et al. 2021"),
    "a100-80gb": Hardware(
        name="a100-80gb", devices_per_node=8,  # [DGX] DGX A100: 8 GPUs
        memory_bytes=80 * 2**30,  # [A100] "80GB" HBM2e = 80 GiB
        peak_flops=_A100_FLOPS, efficiency=_EFFICIENCY, links=(_NVLINK3, _HDR),
        memory_bandwidth=2.039e12 * _BANDWIDTH_EFFICIENCY,  # [A100] HBM2e 2,039 GB/s
        source="NVIDIA A100 SXM datasheet, DGX A100 user guide, nccl-tests busbw; "
               "efficiency 0.5 after Narayanan et al. 2021"),
    "h100-80gb": Hardware(
        name="h100-80gb", devices_per_node=8,  # [DGX] DGX H100: 8 GPUs
        memory_bytes=80 * 2**30,  # [H100] "80GB" HBM3 = 80 GiB
        peak_flops=_H100_FLOPS, efficiency=_EFFICIENCY, links=(_NVLINK4, _NDR),
        memory_bandwidth=3.35e12 * _BANDWIDTH_EFFICIENCY,  # [H100] HBM3 3.35 TB/s (SXM)
        source="NVIDIA H100 SXM datasheet, DGX H100 user guide, nccl-tests busbw; "
               "efficiency 0.5 after Narayanan et al. 2021"),
}


def hardware(spec: str | Hardware | os.PathLike[str] | None) -> Hardware:
    """A `Hardware` profile from a preset name (case-insensitive: "a100-40gb",
    "a100-80gb", "h100-80gb"), a `Hardware` (returned as is) or the path of a JSON profile
    written by `pxform calibrate --out PATH` or `Hardware.save`.

    Raises:
        ValueError: `spec` is None, or a string that is neither a preset nor an existing
            file (the message lists the presets), or the file is not a valid profile.

    Example:
        >>> hardware("H100-80GB").devices_per_node
        8
        >>> PRESETS["h100-80gb"].save("h100.json")
        >>> hardware("h100.json") == PRESETS["h100-80gb"]
        True
    """
    if isinstance(spec, Hardware):
        return spec
    names = ", ".join(PRESETS)
    if spec is None:
        raise ValueError(f"hardware: no hardware given; pass a preset name ({names}), a "
                         f"Hardware, or a path to a JSON profile written by "
                         f"`pxform calibrate --out PATH`")
    if isinstance(spec, str) and spec.strip().lower() in PRESETS:
        return PRESETS[spec.strip().lower()]
    if isinstance(spec, (str, os.PathLike)):
        if os.path.isfile(spec):
            return Hardware.load(spec)
        raise ValueError(f"hardware: {os.fspath(spec)!r} is neither a preset ({names}) nor "
                         f"an existing file; pass a preset name, or a path to a JSON profile "
                         f"written by `pxform calibrate --out PATH` or Hardware.save")
    raise TypeError(f"hardware: expected a preset name, a Hardware or a path, got "
                    f"{type(spec).__name__}")


# the measured numbers a profile holds one of; `median_profile` takes their median
_MEDIAN_FIELDS = ("efficiency", "memory_bandwidth", "op_overhead_s", "overlap_slowdown",
                  "step_overhead_s", "param_overhead_s", "action_overhead_s",
                  "collective_overhead_s", "param_action_overhead_s", "weight_op_overhead_s",
                  "split_backward_share", "op_time_scale", "forward_scale", "backward_scale",
                  "op_step_overhead_s", "op_action_overhead_s",
                  "recompute_overhead_s", "relayout_overhead_s", "relayout_wait_share",
                  "relayout_gap_s",
                  "all_to_all_share", "autograd_op_overhead_s", "autograd_share",
                  "transfer_overhead_s", "send_overhead_s", "receive_overhead_s",
                  "receive_stall_s")


def check_one_machine(profiles: Sequence[Hardware], what: str) -> None:
    """Raise ValueError, naming `what`, unless every profile has the first's devices per
    node and memory: calibrations of one machine and world (`median_profile`,
    `pxform.tools.runtime_costs.representative_profile`).

    Example:
        >>> check_one_machine([hardware("a100-80gb")] * 2, "merge")
    """
    first = profiles[0]
    for p in profiles[1:]:
        if (p.devices_per_node, p.memory_bytes) != (first.devices_per_node, first.memory_bytes):
            raise ValueError(
                f"{what}: they are not of one machine ({p.name!r} has {p.devices_per_node} "
                f"devices per node and {p.memory_bytes} bytes, {first.name!r} "
                f"{first.devices_per_node} and {first.memory_bytes}); pass calibrations of "
                f"the same machine and world only")


def median_profile(profiles: Sequence[Hardware]) -> Hardware:
    """One profile from several calibrations of the same machine: every measured number
    the median of the profiles' (the comm tables' and op curves' times point by point, the
    sync wait at the gaps of the first profile that has the most points; medians of
    non-decreasing series are non-decreasing, so a larger message or op is never faster
    and a longer gap never waits less, as in each profile).

    On a shared machine one calibration can catch a slow or a fast spell in one of its
    dozen fits. Measured here on 2026-11-26: 43 us per op where the others gave 11-17 us
    (that profile's predictions 9-35 % high), and 0.29 ms per collective against 0.8-1.2
    ms (tensor parallelism 37 % low). The median of three keeps such a fit only when two
    of the three caught it: over 10 calibrations spread over 90 minutes, single profiles
    put five pinned plans' predictions 28-71 % apart, medians of three of them 14-25 %.
    Three calibrations in a row share the machine's state, and their median moved as much
    as single calibrations did (`docs/benchmarks/stability.md`).

    Raises:
        ValueError: no profiles, or profiles of different machines (devices per node,
            memory), or measured at different sizes (comm tables, op curves).

    Example:
        >>> a = dataclasses.replace(hardware("a100-80gb"), collective_overhead_s=1e-3)
        >>> b = dataclasses.replace(a, collective_overhead_s=3e-4)
        >>> c = dataclasses.replace(a, collective_overhead_s=9e-4)
        >>> median_profile([a, b, c]).collective_overhead_s
        0.0009
    """
    if not profiles:
        raise ValueError("median_profile: no profiles given")
    first = profiles[0]
    if len(profiles) == 1:
        return first
    what = f"median_profile of {len(profiles)} profiles of {first.name!r}"
    check_one_machine(profiles, what)
    med = statistics.median
    fields: dict[str, Any] = {f: med([getattr(p, f) for p in profiles]) for f in _MEDIAN_FIELDS}
    for name in ("peak_flops", "compute_flops"):
        keys = [k for k, _ in getattr(first, name)]
        per = [dict(getattr(p, name)) for p in profiles]
        fields[name] = tuple((k, med([d[k] for d in per])) for k in keys
                             if all(k in d for d in per))
    if all(len(p.links) == len(first.links) for p in profiles):
        fields["links"] = tuple(
            dataclasses.replace(link, latency_s=med([p.links[i].latency_s for p in profiles]),
                                bandwidth=med([p.links[i].bandwidth for p in profiles]))
            for i, link in enumerate(first.links))

    def same_sizes(rows: Sequence[Sequence[tuple[float, ...]]], kind: str) -> None:
        sizes = [tuple(r[0] for r in points) for points in rows]
        if any(s != sizes[0] for s in sizes):
            raise ValueError(f"{what}: the {kind} were measured at different sizes "
                             f"({list(sizes[0])} and others); calibrate with the same "
                             f"--sizes every time")

    tables = []
    for t in first.comm_tables:
        rows = [next((u.points for u in p.comm_tables
                      if (u.kind, u.level, u.group_size) == (t.kind, t.level, t.group_size)),
                     None) for p in profiles]
        if any(r is None for r in rows):
            continue  # not measured in every calibration
        same_sizes(rows, f"{t.kind} tables")  # type: ignore[arg-type]
        points = tuple((sent, med([r[i][1] for r in rows]))  # type: ignore[index]
                       for i, (sent, _) in enumerate(t.points))
        tables.append(CommTable(t.kind, t.level, t.group_size, points))
    fields["comm_tables"] = tuple(tables)
    curves = []
    for c in first.op_curves:
        found = [next((u for u in p.op_curves if u.kind == c.kind), None) for p in profiles]
        if any(u is None for u in found):
            continue
        same_sizes([u.points for u in found], f"{c.kind} op curves")  # type: ignore[union-attr]
        points3 = tuple((size, med([u.points[i][1] for u in found]),  # type: ignore[union-attr]
                         med([u.points[i][2] for u in found]))  # type: ignore[union-attr]
                        for i, (size, _, _) in enumerate(c.points))
        curves.append(OpCurve(c.kind, points3,
                              med([u.spread for u in found])))  # type: ignore[union-attr]
    fields["op_curves"] = tuple(curves)
    grid = max(profiles, key=lambda p: len(p.sync_wait)).sync_wait
    if grid:
        # (the wait is counted from the shortest gap on: 0 there)
        fields["sync_wait"] = ((grid[0][0], 0.0), *(
            (gap, med([p.sync_wait_s(gap) for p in profiles])) for gap, _ in grid[1:]))
    fields["source"] = f"median of {len(profiles)} calibrations; {first.source}"
    fields["calibrations"] = ()
    return dataclasses.replace(first, **fields)
