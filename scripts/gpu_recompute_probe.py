"""Why a recomputed step costs about twice a plain one on a GPU: the example GPT (batch 8 x
1,024 tokens, bfloat16, one CUDA device) run four ways, each the median of 10 steps after 3,
with one profiled step's host time and kernel time:

    eager               torch.autograd.grad of the plain function
    eager+checkpoint    each block under torch.utils.checkpoint (non-reentrant)
    pxform              pxform.auto on one device, nothing recomputed
    pxform+recompute    the same, every block recomputed

    python scripts/gpu_recompute_probe.py 125M     # needs a CUDA GPU

On an H100 (2026-11-26), 125M: 20.7 / 43.3 / 29.4 / 62.7 ms (a draft of it, on another
machine: 20.2 / 53.0 / 42.2 / 87.2); 760M, the draft: 81.6 / 112.5 / 90.8 / 150.5 ms
(`docs/benchmarks/accuracy.md`, "On a GPU").
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable

import optree
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import gpt  # noqa: E402

import pxform  # noqa: E402
from pxform.search import Pin  # noqa: E402
from pxform.search.space import Option  # noqa: E402


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("gpu_recompute_probe.py: needs a CUDA GPU")
    size = sys.argv[1] if len(sys.argv) > 1 else "125M"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29544")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    cfg = dataclasses.replace(gpt.GPT_CONFIGS[size], seq_len=1024)
    params = gpt.init_params(cfg, device="cuda", dtype=torch.bfloat16)
    data = gpt.make_batch(cfg, 8, device="cuda")
    leaves = [p.requires_grad_(True) for p in optree.tree_leaves(params)]

    def checkpointed(blocks: list, x: torch.Tensor) -> torch.Tensor:
        for p in blocks:
            x = checkpoint(gpt.block, p, x, cfg, use_reentrant=False)
        return x

    def eager(trunk: Callable | None) -> Callable[[], object]:
        return lambda: torch.autograd.grad(gpt.loss_fn(params, data, cfg, trunk), leaves)

    def loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    blocks = len(pxform.auto(loss, mesh=1, hardware="h100-80gb").plan(params, data).blocks)

    def planned(redo: bool) -> Callable[[], object]:
        pin = Pin(stages=1, outer=1, inner=1, microbatches=1,
                  block_options=(Option((), redo),) * blocks)
        step = pxform.auto(loss, mesh=1, hardware="h100-80gb", plan=pin)
        step.plan(params, data)
        run = pxform.value_and_grad(step)
        return lambda: run(params, data)

    variants = {"eager": eager(None), "eager+checkpoint": eager(checkpointed),
                "pxform": planned(False), "pxform+recompute": planned(True)}
    try:
        for name, run in variants.items():
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            times = []
            for _ in range(10):
                start = time.perf_counter()
                run()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                run()
                torch.cuda.synchronize()
            events = prof.key_averages()
            host = sum(e.self_cpu_time_total for e in events) / 1e3
            kernels = sum(getattr(e, "self_device_time_total", 0) for e in events) / 1e3
            print(f"{name:18} {statistics.median(times) * 1e3:8.2f} ms  (profiled: host "
                  f"{host:.1f} ms, kernels {kernels:.1f} ms)", flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
