"""Memory meter: exact byte counts on CPU for chains of known sizes (saved activations,
peaks, gradients), checkpointing, views and in-place ops, baseline de-duplication, nesting,
no callbacks after exit, and `memory_report`."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from pxform.tools.memory import MemoryMeter, MemoryReport, MemoryStats, _human, memory_report

N = 4096  # elements; one float32 activation is 4 * N = 16 KiB
A = 4 * N
SCALAR = 4  # a float32 0-dim tensor (the loss, and the ones_like autograd seeds it with)


def chain(x: torch.Tensor, k: int = 6) -> torch.Tensor:
    # h_i = sin(h_{i-1}): each sin saves its input, sum saves nothing, so backward holds
    # h_1 .. h_{k-1}; h_k dies after the sum. x itself is baseline.
    h = x
    for _ in range(k):
        h = h.sin()
    return h.sum()


def leaf(n: int = N) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(0)).requires_grad_()


def test_chain_saved_peak_end_exact():
    x = leaf()
    with MemoryMeter() as meter:
        meter.track(x)
        (g,) = torch.autograd.grad(chain(x, k=6), [x])
    s = meter.stats
    assert s.rank == 0 and s.device == "cpu"
    assert s.baseline_bytes == A
    # saved: h1..h5, the loss and autograd's ones_like seed
    assert s.saved_bytes == 5 * A + 2 * SCALAR
    # peak in backward of the last sin: 5 saved + cos(h5) + the product, or the same count
    # one step later; never more than 7 activations besides the baseline
    assert s.baseline_bytes + s.saved_bytes <= s.peak_bytes <= s.baseline_bytes + 7 * A + 64
    assert s.end_bytes == A  # only the gradient is alive at exit
    del g


def test_saved_scales_with_chain_length():
    x = leaf()
    saved = []
    for k in (2, 4, 8):
        with MemoryMeter() as meter:
            meter.track(x)
            torch.autograd.grad(chain(x, k), [x])
        saved.append(meter.stats.saved_bytes)
    assert saved == [(k - 1) * A + 2 * SCALAR for k in (2, 4, 8)]


def test_untracked_input_is_not_baseline_and_not_allocated():
    x = leaf()
    with MemoryMeter() as meter:  # x not tracked: baseline 0, and x is never an allocation
        torch.autograd.grad(chain(x, 3), [x])
    assert meter.stats.baseline_bytes == 0
    assert meter.stats.saved_bytes == 2 * A + 2 * SCALAR


def test_temporary_counts_in_peak_not_end():
    with MemoryMeter() as meter:
        big = torch.empty(1 << 20)  # 4 MiB
        del big
        keep = torch.ones(10)
    s = meter.stats
    assert s.peak_bytes == 4 << 20
    assert s.end_bytes == 40
    assert s.saved_bytes == 0  # no backward ran
    del keep


def test_peak_is_simultaneous_not_cumulative():
    with MemoryMeter() as meter:
        for _ in range(10):
            t = torch.empty(N)
            del t
    assert meter.stats.peak_bytes == A  # ten allocations, never two alive at once


def test_views_inplace_and_shared_storages_not_counted():
    x = torch.zeros(N)
    other = torch.zeros(N)  # pre-existing, untracked
    with MemoryMeter() as meter:
        meter.track(x)
        v = x.view(64, -1)
        x.add_(1)
        w = v[:, :3].t()
        o = other[5:]
        other.mul_(2)
        torch.mul(x, 2, out=other)
    s = meter.stats
    assert (s.baseline_bytes, s.peak_bytes, s.end_bytes) == (A, A, 0)
    del v, w, o


def test_out_resize_is_counted():
    a = torch.ones(N)
    with MemoryMeter() as meter:
        out = torch.empty(0)  # allocated inside with 0 bytes, then resized by out=
        torch.add(a, a, out=out)
    assert meter.stats.end_bytes == A
    del out


def test_storage_resized_in_place_is_counted():
    # the runtime frees a collective's temporary by resizing its storage while the process
    # group's work object still holds the tensor (FSDP2 frees unsharded parameters so)
    resize = torch.ops.inductor.resize_storage_bytes_.default
    with MemoryMeter() as meter:
        held = torch.full((N,), 2.0)  # allocated inside: A bytes
        kept = [held]  # another holder, as the work object is
        resize(held, 0)
        assert meter.stats.end_bytes == 0
        resize(held, A)  # grown again (as FSDP2 does before gathering)
    assert (meter.stats.peak_bytes, meter.stats.end_bytes) == (A, A)
    del held, kept


def test_baseline_counts_each_storage_once():
    x = torch.zeros(N)
    lin = torch.nn.Linear(8, 4)  # 32 + 4 float32
    with MemoryMeter() as meter:
        meter.track({"x": x, "view": x[1:], "again": [x]}, lin, None, 3)
        meter.track(x)
    assert meter.stats.baseline_bytes == A + 4 * (32 + 4)


def test_checkpoint_keeps_only_the_input():
    x = leaf()

    def step(ckpt: bool) -> int:
        with MemoryMeter() as meter:
            meter.track(x)
            loss = checkpoint(chain, x, use_reentrant=False) if ckpt else chain(x)
            torch.autograd.grad(loss, [x])
        return meter.stats.saved_bytes

    plain, ckpt = step(False), step(True)
    assert plain == 5 * A + 2 * SCALAR
    assert ckpt < plain / 3
    assert ckpt <= 64  # x is baseline; only the loss and its seed remain


def test_only_the_first_backward_sets_saved():
    x = leaf()
    with MemoryMeter() as meter:
        meter.track(x)
        torch.autograd.grad(chain(x, 3), [x])
        # a second, larger forward/backward: saved stays from the first
        torch.autograd.grad(chain(x, 8), [x])
    assert meter.stats.saved_bytes == 2 * A + 2 * SCALAR


def test_stats_inside_region_are_current():
    with MemoryMeter() as meter:
        a = torch.ones(N)
        inside = meter.stats
        del a
        after_del = meter.stats
    assert inside.end_bytes == A and after_del.end_bytes == 0
    assert after_del.peak_bytes == A


def test_no_callbacks_after_exit():
    registry = len(weakref.finalize._registry)  # type: ignore[attr-defined]
    with MemoryMeter() as meter:
        kept = [torch.ones(N) for _ in range(3)]
        grow = torch.empty(0)
    final = meter.stats
    assert final.end_bytes == 3 * A
    # every finalizer was detached: none left registered, none fires when tensors die
    assert len(weakref.finalize._registry) == registry  # type: ignore[attr-defined]
    del kept
    grow.resize_(N)
    gc.collect()
    assert meter.stats == final
    assert meter._freed == [] and meter._allocs == {}


def test_nested_meters():
    with MemoryMeter() as outer:
        a = torch.ones(N)
        with MemoryMeter() as inner:
            b = torch.ones(2 * N)
        del b
    assert inner.stats.end_bytes == 2 * A and inner.stats.peak_bytes == 2 * A
    assert outer.stats.end_bytes == A and outer.stats.peak_bytes == 3 * A
    del a


def test_meter_misuse_and_reuse():
    meter = MemoryMeter()
    with pytest.raises(RuntimeError):
        meter.stats  # noqa: B018
    with pytest.raises(RuntimeError):
        meter.track(torch.ones(1))
    with meter:
        with pytest.raises(RuntimeError), meter:
            pass
        t = torch.ones(N)
    assert meter.stats.end_bytes == A
    with meter:  # a fresh measurement
        pass
    assert meter.stats.end_bytes == 0 and meter.stats.peak_bytes == 0
    with pytest.raises(ValueError):
        MemoryMeter("meta")
    del t


def test_memory_report_plain_function():
    x = leaf()
    report = memory_report(chain, x)
    assert isinstance(report, MemoryReport) and len(report.ranks) == 1
    (s,) = report.ranks
    assert s.rank == 0 and s.device == "cpu"
    assert s.baseline_bytes == A
    assert s.saved_bytes == 5 * A + 2 * SCALAR
    assert report.peak_bytes == s.peak_bytes and report.saved_bytes == s.saved_bytes
    assert s.end_bytes == A + SCALAR  # the gradient and the returned loss
    text = str(report)
    assert "peak" in text and "saved" in text and "cpu" in text
    assert len(text.splitlines()) == 2


def test_memory_report_argnums_and_no_grad():
    params, batch = {"w": leaf()}, torch.ones(N)

    def step(p, b):
        return chain(p["w"] * b, 3)

    report = memory_report(step, params, batch, argnums=0)
    # saved: p*b (input of the first sin), h1, h2, loss, seed; b is baseline
    assert report.ranks[0].baseline_bytes == 2 * A
    assert report.saved_bytes == 3 * A + 2 * SCALAR
    no_grad = memory_report(step, params, batch, grad=False)
    assert no_grad.saved_bytes == 0
    # without grad: chain's argument p*b stays referenced, plus an op's input and output
    assert no_grad.peak_bytes == 2 * A + 3 * A
    assert no_grad.ranks[0].end_bytes == SCALAR


def test_human_units_and_str():
    assert _human(0) == "0 B" and _human(1023) == "1023 B"
    assert _human(1536) == "1.50 KiB" and _human(3 << 30) == "3.00 GiB"
    s = MemoryStats(rank=1, device="cpu", baseline_bytes=1 << 20, peak_bytes=3 << 20,
                    saved_bytes=1 << 10, end_bytes=0)
    assert str(s) == "rank 1 cpu: baseline 1.00 MiB, peak 3.00 MiB, saved 1.00 KiB, end 0 B"
    assert "\n" not in str(s)
    two = MemoryReport(ranks=(s, MemoryStats(0, "cpu", 0, 5 << 20, 1 << 20, 0)))
    assert two.peak_bytes == 5 << 20 and two.saved_bytes == 1 << 20


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_chain():
    n = 1 << 20  # 4 MiB activations: far above the allocator's rounding
    x = torch.randn(n, device="cuda", requires_grad=True)
    with MemoryMeter("cuda") as meter:
        meter.track(x)
        (g,) = torch.autograd.grad(chain(x, 6), [x])
    s = meter.stats
    assert s.device == f"cuda:{torch.cuda.current_device()}"
    assert s.baseline_bytes >= 4 * n
    assert 5 * 4 * n <= s.saved_bytes <= 5 * 4 * n + (1 << 20)
    assert s.peak_bytes >= s.baseline_bytes + s.saved_bytes
    assert 4 * n <= s.end_bytes <= 4 * n + (1 << 20)
    del g


def _sharded_report() -> tuple[str, MemoryReport, MemoryReport]:
    # runs on every rank of a 2-rank gloo world; module-level so the workers can unpickle it
    import spmd_workers as W

    import pxform
    from pxform import P

    params, batch = W.big_mlp_args(batch=64)
    step = pxform.shard(W.mlp_loss, mesh=pxform.Mesh({"dp": 2}),
                        in_specs=(None, {"x": P("dp"), "y": P("dp")}))
    memory_report(step, params, batch)  # the first call traces (fake tensors: not counted)
    return (str(memory_report(step, params, batch)), memory_report(step, params, batch),
            memory_report(W.mlp_loss, params, batch))


def test_memory_report_gathers_every_rank():
    from pxform.tools.testing import World

    with World(2) as world:
        results = world.run(_sharded_report)
    text, sharded, single = results[0]
    assert results[1][0] == text  # every rank gets the same report
    assert [s.rank for s in sharded.ranks] == [0, 1]
    assert len(text.splitlines()) == 3 and "peak" in text
    params = 8 * (8 * 4 + 8 + 8 * 4)  # float64 w1, b1, w2
    for s in sharded.ranks:
        assert s.end_bytes == params + 8  # replicated gradients and the loss
    # data parallel: each rank holds the activations of half the batch
    assert 0 < sharded.saved_bytes < single.saved_bytes * 0.6
