"""Measured hardware profiles: time matmuls and collectives on the machine at hand.

`calibrate()` runs on every rank of the current torch.distributed world (like a collective)
and returns the same `pxform.hardware.Hardware` on every rank, with measured compute rates
(`compute_flops`), measured collective times (`comm_tables`) and links fitted to them. The
cost model then uses measured numbers instead of datasheet ones (the TensorOpt approach:
profile, then search). `pxform calibrate --out profile.json` (see `main`) runs it under
torchrun and writes the profile for `pxform.hardware.hardware("profile.json")`.

What is measured
----------------
* compute: square matmuls of a few sizes in float32 and bfloat16 (and float16 on CUDA);
  achieved FLOP/s = 2 n^3 / median time, the best over sizes. A dtype whose single matmul
  takes longer than `_COMPUTE_BUDGET_S` stops growing (slow CPU bfloat16): the sizes
  measured so far count.
* collectives: every kind over the whole world and, with 4 or more ranks, over groups of 2
  consecutive ranks (all pairs at once, as a mesh axis of size 2 would run them); p2p is a
  ping-pong between ranks 0 and 1 (half the round trip, timed on rank 0). Per message size:
  one warm-up, then `repeats` runs (15 at least: `_COMM_REPEATS`), each after a barrier,
  the sizes in turn within each repeat; the lower quartile (`lower_quartile`: a
  collective's time on a shared machine is bimodal, and the median flips between the
  modes). Message sizes are the bytes of the local float32 tensor, rounded up to a whole
  number of elements divisible by the group size. Times are stored against the bytes
  each rank sends (the ring volumes of `pxform.core.layout`) and made non-decreasing in
  size (a running maximum: noise must not make a larger message cheaper).
* sync wait (`Hardware.sync_wait`): what a blocking all-reduce costs more after a few
  milliseconds of compute than right after another one (`_measure_sync_wait`).
* links: per level, least squares of the all_reduce table(s), `time = 2(n-1) alpha +
  sent / bandwidth` with alpha, 1/bandwidth >= 0. When that leaves one parameter at zero
  (too few sizes, or noise), every kind measured at the level is fitted together (each
  with its own ring steps). A parameter still at zero is clamped to 1 ns per step or
  1 PB/s, so both stay finite and positive.

Only rank 0's measurements are kept; rank 0 broadcasts the finished profile.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from pxform.core.units import format_bytes, parse_bytes
from pxform.cost.hardware import (
    COLLECTIVE_KINDS,
    CommTable,
    Hardware,
    Link,
    OpCurve,
    median_profile,
    ring_steps,
)
from pxform.runtime import heap
from pxform.runtime.graph_module import synchronize
from pxform.runtime.world import barrier as world_barrier
from pxform.runtime.world import rank as world_rank
from pxform.runtime.world import torchrun_world

__all__ = ["add_arguments", "calibrate", "main", "lower_quartile", "sent_bytes", "summary"]

# A single matmul slower than this stops the size sweep of its dtype.
_COMPUTE_BUDGET_S = 0.25
# Placeholder link for a world of one rank, where no collective can be timed: the defaults
# of `pxform.core.layout.AxisCost` (10 us, 100 GB/s), so a profile without measured links makes
# the re-layout planner behave as it does without a profile.
_LOOPBACK = Link("loopback", latency_s=10e-6, bandwidth=100e9,
                 source="placeholder (1 rank: no collective measured); pxform.core.layout's "
                        "AxisCost defaults")


def sent_bytes(kind: str, local_bytes: float, n: int) -> float:
    """Bytes each rank sends in a ring collective on a local tensor of `local_bytes`
    (pxform.core.layout's volumes): what the comm tables are indexed by.

    Example:
        >>> sent_bytes("all_reduce", 1024, 2), sent_bytes("all_gather", 1024, 4)
        (1024.0, 3072)
    """
    if kind == "all_reduce":
        return 2 * (n - 1) / n * local_bytes
    if kind == "all_gather":
        return (n - 1) * local_bytes
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) / n * local_bytes
    return float(local_bytes)  # p2p


def calibrate(*, sizes: Sequence[int] = (2**10, 2**14, 2**18, 2**22), repeats: int = 5,
              kinds: Sequence[str] = COLLECTIVE_KINDS, name: str | None = None,
              devices_per_node: int | None = None,
              progress: Callable[[str], None] | None = None) -> Hardware:
    """Measure this machine's compute and collectives; every rank gets the same profile.

    Call it on every rank of the current torch.distributed world, like a collective.
    Without an initialised process group (or with one rank) it measures compute only: no
    comm tables, and one placeholder "loopback" link (the source string says so).

    Args:
        sizes: message sizes in bytes (of the local tensor), each timed per kind and group.
        repeats: timed runs per size (after one warm-up; 15 at least for collectives,
            `_COMM_REPEATS`). A collective's sizes are timed in turn within each repeat
            and count by their lower quartile
            (`lower_quartile`: on shared machines a collective's time is bimodal), ops
            by their median.
        kinds: collective kinds to time (all_reduce, all_gather, reduce_scatter,
            all_to_all, p2p).
        name: the profile's name (default: the device name and the world size).
        devices_per_node: ranks per node, which decides link levels (default:
            $LOCAL_WORLD_SIZE as torchrun sets it, else the CUDA device count on GPU, else
            the world size).
        progress: called on rank 0 with a line of text per measurement.

    Example (under `torchrun --nproc-per-node 8`):
        >>> hw = calibrate(sizes=(2**20, 2**26), repeats=10)
        >>> hw.comm_time("all_reduce", 2**26, 8, 0)
        0.00041...
    """
    sizes = [int(s) for s in sizes]
    if not sizes or any(s <= 0 for s in sizes):
        raise ValueError(f"calibrate: sizes must be a non-empty list of positive byte "
                         f"counts, got {list(sizes)}")
    if repeats < 1:
        raise ValueError(f"calibrate: repeats must be >= 1, got {repeats}")
    for kind in kinds:
        if kind not in COLLECTIVE_KINDS:
            raise ValueError(f"calibrate: unknown collective kind {kind!r}; expected some of "
                             f"{', '.join(COLLECTIVE_KINDS)}")
    distributed = dist.is_available() and dist.is_initialized()
    world = dist.get_world_size() if distributed else 1
    rank = dist.get_rank() if distributed else 0
    backend = str(dist.get_backend()) if distributed else "none"
    cuda = torch.cuda.is_available() and ("nccl" in backend or not distributed)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if devices_per_node is None:
        local = os.environ.get("LOCAL_WORLD_SIZE", "")
        devices_per_node = (int(local) if local.isdigit() and int(local) > 0
                            else torch.cuda.device_count() if cuda else world)
    if devices_per_node < 1:
        raise ValueError(f"calibrate: devices_per_node must be >= 1, got {devices_per_node}")
    say: Callable[[str], None] = progress if (progress is not None and rank == 0) \
        else (lambda _line: None)
    if device.type == "cpu":  # measured on the heap the runtime's steps run on (`heap`)
        heap.keep_pages()

    tables: list[CommTable] = []
    if world >= 2:
        tables = _measure_comms(sorted(set(sizes)), max(repeats, _COMM_REPEATS),
                                tuple(kinds), world, rank, devices_per_node, device, say)

    # every rank computes at once, as in training: ranks sharing cores and a memory bus
    # (CPU) share their rate; rank 0's figures are kept
    if distributed and world >= 2:
        world_barrier()
    bandwidth = _measure_bandwidth(device, say)
    overhead = _measure_op_overhead(say) if device.type == "cpu" else 0.0
    compute = _measure_compute(device, say)
    curves = _measure_op_curves(device, max(3, min(repeats, 9)), say)
    overlap = _measure_overlap(device, max(3, repeats // 3), say) if world >= 2 else 0.0
    # (more repeats than the others: the differences are a fraction of the noise)
    sync = _measure_sync_wait(device, min(21, max(9, 2 * repeats)), say) if world >= 2 else ()
    profile: dict[str, Any] | None = None
    if rank == 0:
        links, levels_note = _fit_links(tables, world)
        today = datetime.date.today().isoformat()
        if world >= 2:
            source = (f"measured by pxform calibrate on {today}, {world} ranks, {backend}"
                      f"{levels_note}")
        else:
            why = "no torch.distributed process group" if not distributed else "1 rank"
            source = (f"measured by pxform calibrate on {today}, compute only ({why}): the "
                      f"link is a placeholder, not a measurement")
        device_name = torch.cuda.get_device_name(device) if cuda else "cpu"
        hw = Hardware(
            name=name or f"{device_name.lower().replace(' ', '-')}-x{world}",
            devices_per_node=devices_per_node,
            memory_bytes=_memory_bytes(device, min(world, devices_per_node)),
            peak_flops=(), efficiency=1.0,  # compute_flops are achieved rates already
            links=links, comm_tables=tuple(tables), compute_flops=tuple(compute.items()),
            source=source, memory_bandwidth=bandwidth, op_overhead_s=overhead,
            op_curves=curves, overlap_slowdown=overlap, sync_wait=sync,
            host_overlaps=cuda)  # kernels run asynchronously to the host there
        profile = hw.to_json()
    if distributed and world >= 2:
        box = [profile]
        dist.broadcast_object_list(box, src=0)
        profile = box[0]
    assert profile is not None
    return Hardware.from_json(profile)  # the same float values on every rank


# ---------------------------------------------------------------------------- compute
def _measure_compute(device: torch.device, say: Callable[[str], None]) -> dict[str, float]:
    dims = (1024, 2048, 4096, 8192) if device.type == "cuda" else (128, 256, 512)
    dtypes = [("fp32", torch.float32), ("bf16", torch.bfloat16)]
    if device.type == "cuda":
        dtypes.append(("fp16", torch.float16))  # on CPUs fp16 matmul is often emulated
    gen = torch.Generator(device).manual_seed(0)  # leave the global RNG state alone
    rates: dict[str, float] = {}
    for label, dtype in dtypes:
        best = 0.0
        for n in dims:
            try:
                a = torch.randn(n, n, device=device, generator=gen).to(dtype)
                b = torch.randn(n, n, device=device, generator=gen).to(dtype)
                torch.mm(a, b)  # warm-up
                synchronize(device)
            except RuntimeError:  # dtype not supported for matmul on this device
                break
            times = []
            for _ in range(3):
                start = time.perf_counter()
                torch.mm(a, b)
                synchronize(device)
                times.append(time.perf_counter() - start)
            seconds = statistics.median(times)
            rate = 2 * n**3 / seconds
            best = max(best, rate)
            say(f"compute {label} {n}x{n}: {seconds * 1e3:.3g} ms, {rate / 1e9:.4g} GFLOP/s")
            if seconds > _COMPUTE_BUDGET_S:
                break
        if best > 0:
            rates[label] = best
    return rates


def _measure_bandwidth(device: torch.device, say: Callable[[str], None]) -> float:
    """Bytes/s of an elementwise add over tensors far larger than any cache (64 MiB on
    CPUs, 256 MiB on GPUs): two reads and a write per element; the median of 5."""
    n = 2**26 if device.type == "cuda" else 2**24
    a = torch.ones(n, device=device)
    b = torch.ones(n, device=device)
    out = torch.empty(n, device=device)
    torch.add(a, b, out=out)  # warm-up (first touch of the pages)
    synchronize(device)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        torch.add(a, b, out=out)
        synchronize(device)
        times.append(time.perf_counter() - start)
    rate = 3 * n * 4 / statistics.median(times)
    say(f"memory bandwidth: {rate / 1e9:.4g} GB/s (elementwise add, {format_bytes(n * 4)} "
        f"tensors)")
    return rate


def _measure_op_overhead(say: Callable[[str], None]) -> float:
    """Host seconds per op on the CPU: a chain of 256 elementwise ops on 8 elements,
    forward and backward under autograd, over the 3 op-equivalents the cost model counts
    per forward op (forward 1, backward 2); the median of 5. Only CPUs: on GPUs launches
    overlap with kernels."""
    x = torch.ones(8, requires_grad=True)
    ops = 256

    def chain() -> None:
        y = x
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    chain()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        chain()
        times.append(time.perf_counter() - start)
    per_op = statistics.median(times) / (3 * ops)
    say(f"per-op host time: {per_op * 1e6:.3g} us (autograd chain of {ops} small ops)")
    return per_op


def _timed_median(run: Callable[[], object], device: torch.device, repeats: int
                  ) -> tuple[float, float]:
    """(median seconds, relative interquartile range) of `repeats` runs after one."""
    run()
    synchronize(device)
    times = [_timed_once(run, device) for _ in range(repeats)]
    return statistics.median(times), _spread(times)


Case = tuple[float, Callable[..., torch.Tensor], tuple[tuple[int, ...], ...]]


def _op_cases(device: torch.device) -> list[tuple[str, list[Case]]]:
    """Per op class (`pxform.cost.hardware.OP_CLASSES`): (size, function, input shapes)
    per size. Sizes: FLOPs for matmul and attention (as pxform's rules count them), bytes
    read and written for the memory-bound classes."""
    import torch.nn.functional as F

    gpu = device.type == "cuda"
    cases: list[tuple[str, list[Case]]] = []
    dims = (256, 512, 1024, 2048, 4096) if gpu else (32, 64, 128, 256, 512)
    cases.append(("matmul", [(2.0 * n**3, torch.matmul, ((n, n), (n, n))) for n in dims]))
    heads, seq, dim = 4, 64, 32
    batches = (16, 64, 256, 1024, 4096) if gpu else (1, 4, 16, 64)
    cases.append(("attention", [
        (b * heads * (4.0 * seq * seq * dim + 5.0 * seq * seq),
         F.scaled_dot_product_attention, ((b, heads, seq, dim),) * 3) for b in batches]))
    sizes = [2**k for k in ((18, 20, 22, 24, 26) if gpu else (12, 14, 16, 18, 20))]  # floats
    width = 512

    def norm(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (width,), w, b)

    def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")

    def softmax(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=-1)

    for kind, fn in (("gelu", F.gelu), ("gelu_tanh", gelu_tanh), ("silu", F.silu),
                     ("transcendental", torch.sigmoid)):
        cases.append((kind, [(8.0 * n, fn, ((n,),)) for n in sizes]))
    cases.append(("softmax", [(8.0 * n, softmax, ((n // width, width),)) for n in sizes]))
    cases.append(("norm", [(8.0 * n + 8.0 * width, norm, ((n // width, width), (width,),
                                                          (width,))) for n in sizes]))
    cases.append(("elementwise", [(12.0 * n, torch.add, ((n,), (n,))) for n in sizes]))
    # (each function's first input is also its output's shape: `_runs` chains them)
    return cases


_CHAIN = (2, 10)  # ops per timed chain: the difference leaves out fixed per-call costs


def _runs(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], length: int
          ) -> tuple[Callable[[], None], Callable[[], None]]:
    """(forward, forward and backward) of a chain of `length` calls of `fn`, each on the
    previous one's output and the other `inputs`, as calls to time."""
    first, rest = inputs[0], inputs[1:]

    def chain() -> torch.Tensor:
        y = first
        for _ in range(length):
            y = fn(y, *rest)
        return y

    grad = torch.ones_like(chain())

    def forward() -> None:
        chain()

    def backward() -> None:
        for x in inputs:
            x.grad = None
        chain().backward(grad)

    return forward, backward


def _measure_op_curves(device: torch.device, repeats: int, say: Callable[[str], None]
                       ) -> tuple[OpCurve, ...]:
    """Forward and backward seconds of one op per class and size (`_op_cases`), under
    autograd as training runs them: chains of 2 and of 10 ops, timed in alternation (short
    forward, long forward, short forward and backward, long forward and backward) after a
    warm-up, `repeats` times; per repeat the differences over 8 ops, and their medians, so
    that what one backward call costs whatever its length (the engine's start, the first
    gradient's allocation) is not charged to every op, and a drift in the machine's load
    falls on both sides of each difference (timing the short chains first and the long
    ones after moved single points by 2-20x on this 2-core machine). Gradients of the
    inputs are set to None before each backward (allocated afresh, as in a training step).
    Times are made non-decreasing in size (running maxima), as the comm tables are."""
    gen = torch.Generator(device).manual_seed(0)  # leave the global RNG state alone
    short, long = _CHAIN
    curves = []
    for kind, points in _op_cases(device):
        rows = []
        worst = 0.0
        for size, fn, shapes in points:
            inputs = [torch.randn(*shape, device=device, generator=gen) for shape in shapes]
            if kind == "matmul":  # keep a chain of matmuls in range
                inputs[1] /= shapes[1][0] ** 0.5
            inputs = [x.requires_grad_(True) for x in inputs]
            runs = [_runs(fn, inputs, length) for length in (short, long)]
            calls = [runs[0][0], runs[1][0], runs[0][1], runs[1][1]]
            for call in calls:  # warm-up
                call()
            synchronize(device)
            fwds, bwds = [], []
            for _ in range(repeats):
                t = [_timed_once(call, device) for call in calls]
                fwd = (t[1] - t[0]) / (long - short)
                fwds.append(fwd)
                bwds.append((t[3] - t[2]) / (long - short) - fwd)
            fwd, bwd = max(statistics.median(fwds), 1e-9), max(statistics.median(bwds), 1e-9)
            worst = max(worst, _spread(fwds), _spread([f + b for f, b in zip(fwds, bwds)]))
            rows.append((size, fwd, bwd))
            say(f"op {kind} {size:.3g}: forward {fwd * 1e6:.1f} us, backward "
                f"{bwd * 1e6:.1f} us")
        f_max = b_max = 0.0
        monotone = []
        for size, fwd, bwd in rows:
            f_max, b_max = max(f_max, fwd), max(b_max, bwd)
            monotone.append((size, f_max, b_max))
        curves.append(OpCurve(kind, tuple(monotone), round(worst, 4)))
    return tuple(curves)


def _timed_once(run: Callable[[], object], device: torch.device) -> float:
    start = time.perf_counter()
    run()
    synchronize(device)
    return time.perf_counter() - start


def lower_quartile(values: Sequence[float]) -> float:
    """The lower quartile of `values` (the value a quarter of them are below).

    What a collective's transfer costs is timed this way, not by the median: on a virtual
    machine a gloo collective pays a wake-up of 2-3 ms in 30-60 % of calls (measured here
    on 2026-11-26: a 64 KiB all-reduce took 0.3 ms or 3.0 ms, a 4 MiB one 2.1 ms or 5
    ms), so its median jumps from one mode to the other between calibrations (2.2 ms and
    0.4 ms for 256 KiB). The lower quartile is the transfer's own time; what a step pays
    per collective on top of it (host work, waking up) is `runtime_costs`'s
    `collective_overhead_s`, timed on collectives inside a step, for every kind.

    Example:
        >>> lower_quartile([1.0, 1.1, 1.2, 3.0, 3.1, 3.2, 3.3, 3.4])
        1.2
    """
    xs = sorted(values)
    if not xs:
        raise ValueError("lower_quartile: no values")
    return xs[len(xs) // 4]


def _spread(values: Sequence[float]) -> float:
    """The relative interquartile range of `values` (0 for fewer than 2)."""
    if len(values) < 2:
        return 0.0
    xs = sorted(values)
    med = statistics.median(xs)
    q1, q3 = xs[len(xs) // 4], xs[(3 * len(xs)) // 4]
    return abs(q3 - q1) / abs(med) if med else 0.0


def _measure_overlap(device: torch.device, repeats: int, say: Callable[[str], None]
                     ) -> float:
    """Slowdown of a gradient all-reduce and compute run at once, every rank at once:
    `s` with both = max(c, g) + (s - 1) min(c, g) for compute alone `c` and the
    collective alone `g` (the cost model's `overlap`); 1.0 is perfect overlap, 2.0 none.
    Compute: matmuls of about the collective's time; the collective: a 4 MiB all-reduce
    launched asynchronously before them. The median of `repeats`, clamped to [1, 2]."""
    n = 2**20
    buf = torch.zeros(n, device=device)
    side = 512 if device.type == "cpu" else 4096
    a = torch.randn(side, side, device=device)

    def comm() -> None:
        dist.all_reduce(buf)

    def matmuls(count: int) -> None:
        for _ in range(count):
            torch.mm(a, a)

    comm()
    matmuls(1)
    synchronize(device)
    slowdowns = []
    for _ in range(repeats):
        world_barrier()
        g, _ = _timed_median(comm, device, 3)
        one, _ = _timed_median(lambda: matmuls(1), device, 3)
        count = max(1, round(g / one))
        c, _ = _timed_median(functools.partial(matmuls, count), device, 3)
        world_barrier()
        synchronize(device)
        start = time.perf_counter()
        work = dist.all_reduce(buf, async_op=True)
        matmuls(count)
        assert work is not None
        work.wait()
        synchronize(device)
        both = time.perf_counter() - start
        slowdowns.append(1.0 + (both - max(c, g)) / min(c, g))
    s = min(2.0, max(1.0, statistics.median(slowdowns)))
    say(f"overlap: a 4 MiB all_reduce and compute at once take {s:.2f}x the longer plus "
        f"the shorter's share (1: full overlap, 2: none)")
    return s


# Compute between two synchronous all-reduces (`_measure_sync_wait`): seconds, aimed at.
# (A point at 32 ms was tried on 2026-11-27: the wait kept growing there, 0.75-5.0 ms over
# five calibrations against 0.4-1.5 at 8 ms, but two calls a timing left it the noisiest
# point, and it priced the accuracy run's plans no closer: with the representative
# calibration 9 of 13 within 10 % against 10 of 13 without, on the same measurements,
# data parallelism +8.0 % against +1.4 %, the 2-microbatch pipeline +26.6 % and +18.8 %.)
_SYNC_GAPS = (2.5e-4, 2e-3, 8e-3)
_SYNC_BYTES = 2**18  # the all-reduce's message: a tensor-parallel activation's order
_SYNC_CALLS = 8  # loop iterations per timing


def _measure_sync_wait(device: torch.device, repeats: int, say: Callable[[str], None]
                       ) -> tuple[tuple[float, float], ...]:
    """`Hardware.sync_wait`: per gap g of `_SYNC_GAPS`, every rank runs matmuls for about g
    then a blocking all-reduce of `_SYNC_BYTES`, `_SYNC_CALLS` times, and the same matmuls
    alone as often, the two loops in alternation after a barrier, `repeats` times; the
    collective's cost at g is the median difference per iteration. What the curve keeps
    is that cost less its cost at the smallest gap (the transfer and the runtime's own
    time per collective are priced apart: `comm_tables`, `collective_overhead_s`), made
    non-decreasing by pooling adjacent violators (noise must not make a longer gap
    cheaper) and clamped at 0. Why it grows: ranks computing apart drift, and the first
    to arrive waits for the last and then has to be woken (on this 2-vCPU VM a 256 KiB
    gloo all-reduce cost 1.7 ms after 0.3 ms of compute and 2.3-3.0 ms after 8 ms; in a
    tensor-parallel GPT step, collectives after 4-9 ms of compute cost 1.5-2 ms more than
    those right after another)."""
    side = 256 if device.type == "cpu" else 4096
    gen = torch.Generator(device).manual_seed(0)  # leave the global RNG state alone
    a = torch.randn(side, side, device=device, generator=gen) / side ** 0.5
    buf = torch.zeros(_SYNC_BYTES // 4, device=device)

    def matmuls(count: int) -> None:
        for _ in range(count):
            torch.mm(a, a)

    matmuls(2)
    dist.all_reduce(buf)
    synchronize(device)
    one, _ = _timed_median(lambda: matmuls(1), device, 5)
    # every rank the same counts (rank 0's): a rank that computed more would wait less
    # (on the device: NCCL broadcasts no CPU tensor)
    counts = torch.tensor([max(1, round(g / one)) for g in _SYNC_GAPS], dtype=torch.int64,
                          device=device)
    dist.broadcast(counts, 0)
    gaps, costs = [], []
    for count in dict.fromkeys(counts.tolist()):  # (distinct, in order)

        def alone(count: int = count) -> None:
            for _ in range(_SYNC_CALLS):
                matmuls(count)

        def synced(count: int = count) -> None:
            for _ in range(_SYNC_CALLS):
                matmuls(count)
                dist.all_reduce(buf)

        diffs, spans = [], []
        for _ in range(repeats):
            world_barrier()
            t_alone = _timed_once(alone, device)
            world_barrier()
            t_synced = _timed_once(synced, device)
            diffs.append((t_synced - t_alone) / _SYNC_CALLS)
            spans.append(t_alone / _SYNC_CALLS)
        gaps.append(statistics.median(spans))
        costs.append(statistics.median(diffs))
    waits = _non_decreasing([c - costs[0] for c in costs])
    points = [(gaps[0], 0.0)]
    for g, w in zip(gaps[1:], waits[1:]):
        if g > points[-1][0]:
            points.append((g, max(0.0, w, points[-1][1])))
    say("sync wait: " + ", ".join(f"{w * 1e3:.2f} ms after {g * 1e3:.2g} ms of compute"
                                  for g, w in points)
        + f" (a {format_bytes(_SYNC_BYTES)} all-reduce, beyond its cost right after another)")
    return tuple(points)


def _non_decreasing(values: Sequence[float]) -> list[float]:
    """The non-decreasing sequence closest to `values` in least squares (adjacent
    violators pooled into their mean).

    Example:
        >>> _non_decreasing([0.0, 2.0, 1.0, 3.0])
        [0.0, 1.5, 1.5, 3.0]
    """
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    out: list[float] = []
    for total, n in blocks:
        out += [total / n] * int(n)
    return out


def _memory_bytes(device: torch.device, ranks_per_node: int) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        import psutil

        total = int(psutil.virtual_memory().total)
    except ImportError:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, total // max(1, ranks_per_node))  # ranks on one node share its RAM


# ---------------------------------------------------------------------------- collectives
def _level(span: int, devices_per_node: int) -> int:
    return 0 if span <= devices_per_node else 1  # as Hardware.level, before it exists


# Timed runs per collective and size, at least: a collective's time here is bimodal, its
# slow mode coming in spells, and over 5 runs (`pxform calibrate`'s default repeats) the
# lower quartile landed on it: a reduce-scatter of 256 KiB at 3.5 ms in one profile
# (2026-11-30), where 15 runs minutes later had it at 0.31 ms (lower quartile; median
# 0.47, slowest 5.2). That profile's table gave 3.6 ms for the sequence-parallel GPT's
# 512 KiB reduce-scatters, which took 1.7-2.4 ms in its steps, per-collective costs
# included. About a second more for the 4 default sizes and 5 kinds.
_COMM_REPEATS = 15


def _measure_comms(sizes: Sequence[int], repeats: int, kinds: tuple[str, ...], world: int,
                   rank: int, devices_per_node: int, device: torch.device,
                   say: Callable[[str], None]) -> list[CommTable]:
    # (is the whole world, this rank's group (None: the world), group size, member)
    configs: list[tuple[bool, Any, int, bool]] = [(True, None, world, True)]
    if world >= 4:
        # groups of 2 consecutive ranks; every rank creates every group, in the same order
        # (new_group is collective); all pairs run at once, each rank in its own pair
        mine = None
        for first in range(0, world - 1, 2):
            group = dist.new_group([first, first + 1])
            if rank in (first, first + 1):
                mine = group
        configs.append((False, mine, 2, mine is not None))  # odd rank out: no pair

    def timed(op: Callable[[], object]) -> float:
        world_barrier()  # (under NCCL on this rank's device, named)
        synchronize(device)
        start = time.perf_counter()
        op()
        synchronize(device)
        return time.perf_counter() - start

    tables: list[CommTable] = []
    for is_world, group, n, member in configs:
        for kind in kinds:
            if kind == "p2p" and not is_world:
                continue  # p2p: once, ranks 0 and 1 of the world
            size_n = 2 if kind == "p2p" else n
            level = _level(size_n, devices_per_node)
            numels = sorted({max(n, math.ceil(size / 4 / n) * n)  # float32, divisible by n
                             for size in sizes})
            ops = [_collective(kind, numel, group, n, rank, member, device)
                   for numel in numels]
            for op in ops:
                op()  # warm-up (also creates lazy communicators)
            synchronize(device)
            # the sizes in turn within each repeat: a slow spell of the machine falls on
            # every size alike instead of on the one timed then
            times: list[list[float]] = [[] for _ in numels]
            for _ in range(repeats):
                for k, op in enumerate(ops):
                    times[k].append(timed(op))
            points: list[tuple[float, float]] = []
            for numel, ts in zip(numels, times):
                seconds = lower_quartile(ts)
                if kind == "p2p":
                    seconds /= 2  # ping-pong: half the round trip
                sent = sent_bytes(kind, numel * 4, size_n)
                points.append((sent, seconds))
                say(f"{kind} n={size_n} level {level}: "
                    f"{format_bytes(numel * 4)} local, {format_bytes(sent)} sent: "
                    f"{seconds * 1e6:.1f} us (spread {_spread(ts):.2f})")
            running = 0.0
            monotone = []
            for sent, seconds in points:
                running = max(running, seconds)
                monotone.append((sent, running))
            tables.append(CommTable(kind, level, size_n, tuple(monotone)))
    # groups are not destroyed here: destroying subgroups is unsafe on some torch versions;
    # the process group's teardown frees them
    return tables


def _collective(kind: str, numel: int, group: Any, n: int, rank: int, member: bool,
                device: torch.device) -> Callable[[], object]:
    """One call of `kind` over `group` (n ranks) on preallocated zero tensors (zeros: sums
    never overflow); a no-op on ranks outside every group of this pass."""
    if not member:
        return lambda: None
    x = torch.zeros(numel, device=device)
    if kind == "all_reduce":
        return lambda: dist.all_reduce(x, group=group)
    if kind == "all_gather":
        out = torch.empty(numel * n, device=device)
        # all_gather_single replaces the deprecated all_gather_into_tensor in new torch
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: ag(out, x, group=group)
    if kind == "reduce_scatter":
        out = torch.empty(numel // n, device=device)
        # reduce_scatter_single replaces the deprecated reduce_scatter_tensor in new torch
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: rs(out, x, group=group)
    if kind == "all_to_all":
        out = torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(out, x, group=group)
    if kind == "p2p":
        def ping_pong() -> None:
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            elif rank == 1:
                dist.recv(x, 0)
                dist.send(x, 0)
        return ping_pong
    raise AssertionError(kind)


# Clamps of fitted links: 1 ns per step, 1 PB/s (seconds per byte 1e-15): keep both finite
# and positive when the data pins one of them at zero.
_MIN_ALPHA = 1e-9
_MIN_BETA = 1e-15


def _fit(samples: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Least squares of t = steps * alpha + sent * beta over (steps, sent, t) samples with
    alpha, beta >= 0: the unconstrained solution if both are positive, else the better of
    the two one-parameter fits."""
    scale = max(b for _, b, _ in samples) or 1.0  # bytes to O(1), for conditioning
    rows = [(s, b / scale, t) for s, b, t in samples]
    saa = sum(s * s for s, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sab = sum(s * b for s, b, _ in rows)
    sat = sum(s * t for s, _, t in rows)
    sbt = sum(b * t for _, b, t in rows)

    def residual(a: float, b: float) -> float:
        return sum((s * a + x * b - t) ** 2 for s, x, t in rows)

    candidates = []
    det = saa * sbb - sab * sab
    if det > 1e-12 * saa * sbb:
        a, b = (sat * sbb - sbt * sab) / det, (saa * sbt - sab * sat) / det
        if a > 0 and b > 0:
            candidates.append((a, b))
    if saa > 0:
        candidates.append((max(sat / saa, 0.0), 0.0))
    if sbb > 0:
        candidates.append((0.0, max(sbt / sbb, 0.0)))
    a, b = min(candidates, key=lambda ab: residual(*ab))
    return max(a, _MIN_ALPHA), max(b / scale, _MIN_BETA)


def _samples(tables: list[CommTable]) -> list[tuple[float, float, float]]:
    return [(float(ring_steps(t.kind, t.group_size)), b, s)
            for t in tables for b, s in t.points]


def _fit_links(tables: list[CommTable], world: int) -> tuple[tuple[Link, ...], str]:
    if not tables:
        return (_LOOPBACK,), ""
    top = max(t.level for t in tables)
    fitted: dict[int, Link] = {}
    today = datetime.date.today().isoformat()
    for level in range(top + 1):
        at_level = [t for t in tables if t.level == level]
        if not at_level:
            continue
        use = [t for t in at_level if t.kind == "all_reduce"] or at_level
        alpha, beta = _fit(_samples(use))
        if (alpha == _MIN_ALPHA or beta == _MIN_BETA) and use != at_level:
            # the all_reduce points alone pin down only one parameter (too few sizes, or
            # noise): fit every kind measured at this level together
            use = at_level
            alpha, beta = _fit(_samples(use))
        what = ", ".join(sorted({f"{t.kind} n={t.group_size}" for t in use}))
        fitted[level] = Link(("intra-node", "inter-node")[min(level, 1)], alpha, 1 / beta,
                             f"least-squares fit of {what}, measured by pxform calibrate on "
                             f"{today}, {world} ranks")
    note = ""
    links: list[Link] = []
    for level in range(top + 1):
        if level in fitted:
            links.append(fitted[level])
            continue
        # no group of this level was measured (e.g. 1 device per node: no level-0 group)
        nearest = min(fitted, key=lambda lv: abs(lv - level))
        src = fitted[nearest]
        links.append(Link(src.name, src.latency_s, src.bandwidth,
                          f"not measured: copied from level {nearest}"))
        note = "; level(s) without a measured group copy the nearest measured level"
    return tuple(links), note


# ---------------------------------------------------------------------------- CLI
def _size(text: str) -> int:
    try:
        return parse_bytes(text, what="--sizes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add `pxform calibrate`'s flags to `parser`.

    Example:
        >>> parser = argparse.ArgumentParser(prog="pxform calibrate")
        >>> add_arguments(parser)
        >>> parser.parse_args(["--out", "p.json", "--sizes", "1KiB", "4MiB"]).sizes
        [1024, 4194304]
    """
    parser.add_argument("--out", required=True, metavar="PATH",
                        help="where rank 0 writes the JSON profile")
    parser.add_argument("--sizes", nargs="+", type=_size, default=None, metavar="SIZE",
                        help="message sizes (bytes of the local tensor), e.g. 1KiB 1MiB "
                             "64MiB (default: 1KiB 16KiB 256KiB 4MiB)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="timed runs per size; the median counts (default: 5)")
    parser.add_argument("--name", default=None,
                        help="the profile's name (default: device name and world size)")
    parser.add_argument("--runs", type=int, default=1,
                        help="calibrations in a row; the profile written is the one whose "
                             "predictions sit in the middle of theirs, carrying all N: a "
                             "plan's step is predicted as the median of its prices under "
                             "them (default: 1)")


def main(args: argparse.Namespace,
         refine: Callable[[Hardware], Hardware] | None = None,
         combine: Callable[[Sequence[Hardware]], Hardware] = median_profile,
         advise: Callable[[Hardware], str] | None = None) -> int:
    """`pxform calibrate`: measure, print a summary on rank 0, write the profile there.
    `refine` (on every rank) adds what only higher floors can measure: the CLI passes
    `pxform.tools.runtime_costs`, the runtime's own fixed costs. With `--runs N` it
    calibrates N times in a row and writes one profile of them, `combine`'s (on every
    rank): by default the median of every number (`median_profile`); the CLI passes
    `pxform.tools.runtime_costs.representative_profile`, the calibration whose
    predictions sit in the middle, kept whole but for its per-run conversion cost (the
    fixed costs are measured against each calibration's own scale, and field-by-field
    medians mixed them). Either
    drops a fit that caught a short slow or fast spell of the machine. It does not help
    against a drift over minutes: on this project's CPU machine, profiles that were each
    the median of 3 calibrations in a row moved a pinned plan's prediction as much as
    single calibrations did (`docs/benchmarks/stability.md`). `advise` (rank 0, after the
    summary, with `--runs` above 1) says how far the calibrations were apart: the CLI
    passes `pxform.tools.profile_check.calibration_spread`'s text, a warning when their
    prices of the reference program spread more than 10 %.

    Under torchrun (WORLD_SIZE set) it initialises the process group itself if needed
    (nccl with CUDA, else gloo) and destroys it at the end; without torchrun it measures
    compute only.

    Example:
        $ torchrun --nproc-per-node 8 -m pxform calibrate --out h100.json
    """
    runs = getattr(args, "runs", 1)
    if runs < 1:  # before a process group exists: nothing to tear down
        raise ValueError(f"pxform calibrate: --runs {runs}; give 1 or more calibrations")
    with torchrun_world():
        rank = world_rank()
        kwargs: dict[str, Any] = {"repeats": args.repeats, "name": args.name}
        if args.sizes:
            kwargs["sizes"] = args.sizes
        profiles = []
        for _ in range(runs):
            hw = calibrate(**kwargs)
            if refine is not None:
                hw = refine(hw)
            profiles.append(hw)
        hw = combine(profiles)
        if rank == 0:
            print(summary(hw))
            if advise is not None and runs > 1:
                print(advise(hw))
            hw.save(args.out)
            print(f"wrote {args.out}")
    return 0


def summary(hw: Hardware) -> str:
    """A short table of a profile's measured numbers.

    Example:
        >>> print(summary(hardware("a100-80gb")).splitlines()[0])
        a100-80gb: 8 devices per node, 80 GiB each
    """
    lines = [f"{hw.name}: {hw.devices_per_node} devices per node, "
             f"{format_bytes(hw.memory_bytes)} each", f"  source: {hw.source}"]
    rates = hw.compute_flops or tuple((k, v * hw.efficiency) for k, v in hw.peak_flops)
    lines.append("  compute: " + ", ".join(f"{k} {v / 1e9:.4g} GFLOP/s" for k, v in rates))
    if hw.memory_bandwidth > 0:
        lines.append(f"  memory bandwidth: {hw.memory_bandwidth / 1e9:.4g} GB/s")
    if hw.op_overhead_s > 0:
        lines.append(f"  per-op host time: {hw.op_overhead_s * 1e6:.3g} us")
    for level, link in enumerate(hw.links):
        lines.append(f"  link {level} ({link.name}): latency {link.latency_s * 1e6:.3g} us, "
                     f"bandwidth {link.bandwidth / 1e9:.4g} GB/s")
    if hw.comm_tables:
        lines.append(f"  {'kind':<15}{'n':>4}{'level':>6}  sent bytes: time")
        for t in hw.comm_tables:
            cells = ", ".join(f"{format_bytes(b)}: {s * 1e6:.1f} us" for b, s in t.points)
            lines.append(f"  {t.kind:<15}{t.group_size:>4}{t.level:>6}  {cells}")
    if hw.op_curves:
        lines.append("  op class        size: forward / backward (spread)")
        for c in hw.op_curves:
            unit = "FLOP" if c.kind in ("matmul", "attention") else "B"
            cells = ", ".join(f"{size:.3g} {unit}: {f * 1e6:.3g} / {b * 1e6:.3g} us"
                              for size, f, b in c.points)
            lines.append(f"  {c.kind:<15} {cells} ({c.spread:.0%})")
    if hw.overlap_slowdown:
        lines.append(f"  overlap slowdown: {hw.overlap_slowdown:.2f} (1: full overlap, 2: none)")
    if hw.step_overhead_s or hw.param_overhead_s or hw.action_overhead_s or \
            hw.collective_overhead_s:
        lines.append(f"  runtime: {hw.step_overhead_s * 1e3:.3g} ms per step, "
                     f"{hw.param_overhead_s * 1e6:.3g} us per parameter, "
                     f"{hw.action_overhead_s * 1e6:.3g} us per pipeline action, "
                     f"{hw.collective_overhead_s * 1e6:.3g} us per collective, "
                     f"{hw.param_action_overhead_s * 1e6:.3g} us per parameter and "
                     f"pipeline action, {hw.op_action_overhead_s * 1e6:.3g} us per stage op "
                     f"and pipeline action, {hw.weight_op_overhead_s * 1e6:.3g} us per weight "
                     f"op of a zero-bubble W (and its split backward "
                     f"{hw.split_backward_share:.2f} of the fused one's time more), "
                     f"{hw.recompute_overhead_s * 1e6:.3g} us per "
                     f"recompute region and microbatch, "
                     f"{hw.relayout_overhead_s * 1e6:.3g} us and {hw.relayout_wait_share:.3g}"
                     f" of the compute before it per run of a conversion's collectives "
                     f"after compute, an all-to-all at {hw.all_to_all_share:.3g} of the "
                     f"per-collective cost, {hw.transfer_overhead_s * 1e6:.3g} us per "
                     f"pipeline transfer waited for, {hw.send_overhead_s * 1e6:.3g} us per "
                     f"send, {hw.receive_overhead_s * 1e6:.3g} us per receive and "
                     f"{hw.receive_stall_s * 1e6:.3g} us of a receiving rank's stall per "
                     f"transfer")
    if hw.autograd_op_overhead_s or hw.autograd_share:
        lines.append(f"  autograd: {hw.autograd_op_overhead_s * 1e6:.3g} us per op and "
                     f"{hw.autograd_share:.1%} of a forward's time (saved by a forward "
                     f"without gradients)")
    if hw.sync_wait:
        lines.append("  sync wait: " + ", ".join(f"{w * 1e3:.3g} ms after {g * 1e3:.3g} ms"
                                                 for g, w in hw.sync_wait)
                     + " of compute (per synchronous collective or pipeline transfer)")
    if hw.op_time_scale != 1.0:
        lines.append(f"  op time scale: {hw.op_time_scale:.3f} (a reference training step "
                     f"over its ops timed alone)")
    if (hw.forward_scale, hw.backward_scale) != (1.0, 1.0):
        lines.append(f"  forward and backward scales: {hw.forward_scale:.3f} and "
                     f"{hw.backward_scale:.3f} on the op time scale (the step's forward "
                     f"timed alone against the step)")
    if hw.host_overlaps:
        lines.append(f"  the host runs ahead of the device: a pass takes the longer of its "
                     f"device time and its host time ({hw.op_step_overhead_s * 1e6:.3g} us "
                     f"per op)")
    if hw.calibrations:
        scales = ", ".join(f"{c.op_time_scale:.3f}" for c in hw.calibrations)
        lines.append(f"  calibrations kept: {len(hw.calibrations)} (op time scales {scales}); "
                     f"a plan's step is the median of its prices under them")
    return "\n".join(lines)
