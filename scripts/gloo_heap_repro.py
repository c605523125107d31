"""Reproduce the heap corruption gloo collectives cause on this machine (torch 2.13, CPU).

Now and then a pxform run on gloo ranks dies with glibc's "malloc(): unaligned tcache chunk
detected": a calibration (`benchmarks/stability.py`, 2 of about 14 calibrations on
2026-11-26), a tensor-parallel diagnostic (2 of about 42 runs the session before). It is
not pxform's: plain torch.distributed collectives in a loop do it, with no pxform code
running. Measured on 2026-11-26, 2 ranks, 8,000 rounds per run, runs that died:

    all_gather        dist.all_gather_into_tensor, fresh output each round   3 of 6
    fc_all_gather     functional all_gather_single, waited each round        2 of 6
    padded_reduce     a fresh zero-padded buffer, functional all_reduce      4 of 18
    all_reduce        functional all_reduces of one persistent tensor       0 of 18
                      (two per round in those runs; 16-128 KiB)

and with an all-gather and a reduce-scatter in flight together 4 of 6, in turn 0 of 6.
On padded_reduce, glibc's MALLOC_MMAP_THRESHOLD_ fixed at 128 KiB or at 1 GiB did not stop
it (2 of its 4 deaths were with them). That suggests something in torch's gloo path
writes into memory after it was freed (the corruption shows where a fresh allocation
reuses it); which call, and whether a newer torch fixes it, is not established. pxform
does not work around it.

    torchrun --nproc-per-node 2 scripts/gloo_heap_repro.py all_gather
    for k in 1 2 3 4 5 6; do torchrun --nproc-per-node 2 scripts/gloo_heap_repro.py all_gather; done
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

ROUNDS = 8000
NUMEL = 16384  # 64 KiB of float32


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else "all_gather"
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    n, rank = dist.get_world_size(), dist.get_rank()
    x = torch.randn(NUMEL)
    for _ in range(ROUNDS):
        if mode == "all_gather":
            out = torch.empty(n * NUMEL)
            dist.all_gather_into_tensor(out, x)
        elif mode == "fc_all_gather":
            fc.wait_tensor(fc.all_gather_single(x, 0, group))
        elif mode == "padded_reduce":
            buf = x.new_zeros(n * NUMEL)
            buf.narrow(0, rank * NUMEL, NUMEL).copy_(x)
            fc.wait_tensor(fc.all_reduce(buf, "sum", group))
        elif mode == "all_reduce":
            fc.wait_tensor(fc.all_reduce(x, "sum", group))
        else:
            raise SystemExit(f"unknown mode {mode!r}: all_gather, fc_all_gather, "
                             f"padded_reduce or all_reduce")
    if rank == 0:
        print(f"{mode}: {ROUNDS} rounds, no crash")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
