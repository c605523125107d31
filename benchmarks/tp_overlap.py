"""Tensor parallelism with and without communication overlap (`coshard(overlap=True)`), on
gloo.

`--ranks` processes (a `pxform.testing.World`, one torch thread each) train the example GPT
with Megatron tensor parallelism of every MLP (`fc_w` column-parallel, `out_w`
row-parallel, over `tp`: one all-reduce per block in forward and one in backward), float32,
the same global batch on every rank:

    plain    pxform.shard(loss, mesh=Mesh({"tp": ranks}), in_specs=(megatron, None))
    overlap  the same, with the blocks run by
             pxform.coshard(trunk, chunks=--chunks, dim=(None, 0), recompute=False,
                            overlap=True)
             (all layers in one region of batch pieces: each piece's all-reduces run while
             the other pieces compute, in forward and in backward)
    pieces   the same pieces with overlap=False: run in turn, each collective waited for
             at once (so overlap against pieces is the overlap's own effect)

Loss and gradients are checked against each other before timing (the pieces compute the
same sums: equal to float32 rounding). The two are then timed in alternating blocks (a
barrier before each block; a block's time is its slowest rank's). Reported: per-step time
of each, the ratio plain time / overlap time (> 1: overlap faster), and pieces time /
overlap time.

    python benchmarks/tp_overlap.py                    # GPT "small", batch 16, 2 pieces
    python benchmarks/tp_overlap.py --batch 64 --chunks 4
    python benchmarks/tp_overlap.py --quick            # a few seconds, smoke run
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def losses(cfg: Any, chunks: int) -> dict[str, Any]:
    """The GPT loss with its blocks run plainly, as batch pieces in turn, and as overlapped
    batch pieces."""
    import gpt
    import torch

    import pxform

    def trunk(blocks: list, x: torch.Tensor) -> torch.Tensor:
        for p in blocks:
            x = gpt.block(p, x, cfg)
        return x

    def pieces(overlap: bool) -> Any:
        return pxform.coshard(trunk, chunks=chunks, dim=(None, 0), recompute=False,
                              overlap=overlap)

    def make(run: Any) -> Any:
        def loss(params: dict, batch: dict) -> torch.Tensor:
            return gpt.loss_fn(params, batch, cfg, run)
        return loss

    return {"plain": make(trunk), "pieces": make(pieces(False)),
            "overlap": make(pieces(True))}


def rank_main(cfg_name: str, batch_size: int, chunks: int, reps: int, steps: int,
              warmup: int) -> dict[str, Any]:
    """On every rank: build both contenders, check they agree, time them interleaved."""
    harness.add_paths()
    import optree
    import torch
    import torch.distributed as dist

    import pxform
    from pxform import P

    world = dist.get_world_size()
    cfg, params, batch, _, _ = harness.gpt_case(cfg_name, batch_size)
    megatron = {"fc_w": P("tp", None), "fc_b": P("tp"), "out_w": P(None, "tp")}
    specs = {k: ([{n: megatron.get(n) for n in b} for b in v] if k == "blocks" else None)
             for k, v in params.items()}
    mesh = pxform.Mesh({"tp": world})
    steps_by_name = {}
    first_call = {}
    results = {}
    for name, fn in losses(cfg, chunks).items():
        step = pxform.shard(fn, mesh=mesh, in_specs=(specs, None))
        run = pxform.value_and_grad(step)
        start = time.perf_counter()
        results[name] = run(params, batch)
        first_call[name] = time.perf_counter() - start
        steps_by_name[name] = (step, run)

    def leaves(grads: Any) -> list[torch.Tensor]:
        return [pxform.gather(g) for g in optree.tree_leaves(grads)]

    pl, pg = results["plain"]
    check = {"loss_plain": float(pl), "loss_abs_diff": 0.0, "grad_max_abs_diff": 0.0,
             "ok": True}
    for name in ("pieces", "overlap"):
        ol, og = results[name]
        check[f"loss_{name}"] = float(ol)
        check["loss_abs_diff"] = max(check["loss_abs_diff"], abs(float(pl) - float(ol)))
        check["grad_max_abs_diff"] = max(check["grad_max_abs_diff"],
                                         harness.max_abs_diff(leaves(pg), leaves(og)))
        check["ok"] = check["ok"] and bool(
            torch.allclose(pl, ol, rtol=1e-5, atol=1e-6)
            and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                    for a, b in zip(leaves(pg), leaves(og))))
    if not check["ok"]:
        return {"check": check}
    for _ in range(warmup):
        for _, run in steps_by_name.values():
            run(params, batch)
    times = harness.interleave(
        {name: (lambda run=run: run(params, batch)) for name, (_, run) in steps_by_name.items()},
        reps, steps, sync=dist.barrier)
    programs = {name: step.lower(params, batch) for name, (step, _) in steps_by_name.items()}
    asynchronous = sum(1 for i in programs["overlap"].instrs
                       if getattr(i, "asynchronous", False))
    return {"check": check, "times": times, "first_call_s": first_call,
            "collectives": {name: {"forward": p.collectives(),
                                   "backward": p.backward_collectives()}
                            for name, p in programs.items()},
            "async_conversions": asynchronous, "threads": torch.get_num_threads()}


def main() -> None:
    parser = harness.parser(__doc__, batch=16, reps=20, steps=3, ranks=True)
    parser.add_argument("--chunks", type=int, default=2, help="batch pieces per block")
    args = harness.parse(parser)
    harness.add_paths()
    import gpt
    import tp_overlap  # this module by name, so that ranks can unpickle rank_main

    from pxform.tools.testing import World

    cfg = gpt.GPT_CONFIGS[args.config]
    with World(args.ranks) as world:
        per_rank = world.run(tp_overlap.rank_main, args.config, args.batch, args.chunks,
                             args.reps, args.steps, args.warmup)
    checks = [r["check"] for r in per_rank]
    print(f"GPT {args.config} ({cfg.num_params() / 1e6:.2f} M params), batch {args.batch} x "
          f"{cfg.seq_len} tokens, float32, Megatron TP of the MLPs over {args.ranks} gloo "
          f"ranks x {per_rank[0].get('threads', 1)} thread; overlap: {args.chunks} batch "
          f"pieces; {args.reps} blocks of {args.steps} steps each, interleaved")
    harness.report_checks(checks, "tp_overlap: plain and overlapped TP disagree")
    r0 = per_rank[0]
    for name, c in r0["collectives"].items():
        print(f"  {name}: forward {harness.counts(c['forward'])}, backward "
              f"{harness.counts(c['backward'])}")
    print(f"  overlap: {r0['async_conversions']} asynchronous conversions")
    times = harness.slowest_rank([r["times"] for r in per_rank])
    summary = harness.summarise(times, "plain", "overlap")
    summary["ratio"]["what"] = "plain TP time / overlapped TP time"
    # the overlap itself: the same pieces, their collectives waited for at once
    own = harness.summarise(times, "pieces", "overlap")["ratio"]
    own["what"] = "pieces in turn time / overlapped pieces time"
    summary["ratio_overlap_alone"] = own
    harness.print_table(summary)
    print(f"  ratio {own['what']}: {own['of_medians']:.3f} (of medians), "
          f"{own['median_paired']:.3f} (median of paired blocks)")
    if args.quick:
        return
    tag = harness.variant(args, parser, {"config": "", "batch": "batch", "ranks": "ranks",
                                         "chunks": "chunks"})
    path = harness.write_result("tp_overlap", {
        "config": {"model": args.config, "params": cfg.num_params(), "batch": args.batch,
                   "seq_len": cfg.seq_len, "dtype": "float32", "ranks": args.ranks,
                   "backend": "gloo", "threads_per_rank": r0["threads"],
                   "chunks": args.chunks, "reps": args.reps, "steps": args.steps,
                   "warmup": args.warmup},
        "check": checks,
        "first_call_s": [r["first_call_s"] for r in per_rank],
        "collectives": r0["collectives"], "async_conversions": r0["async_conversions"],
        "per_rank_blocks_s": [r["times"] for r in per_rank],
        **summary,
    }, args.out, variant=tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
