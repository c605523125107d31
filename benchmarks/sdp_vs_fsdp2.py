"""ZeRO-3 (sharded data parallelism): pxform against FSDP2 (`fully_shard`), on gloo.

`--ranks` processes (a `pxform.testing.World`, one torch thread each) train the example GPT
on the same global batch, float32, loss forward and backward producing every parameter's
gradient, every parameter stored sharded on dim 0 over the ranks:

    pxform  pxform.value_and_grad(pxform.shard(loss, mesh=Mesh({"dp": ranks}),
                in_specs=(P("dp"), {"idx": P("dp"), "targets": P("dp")})))(params, batch)
            with params and batch as DTensors from `step.distribute` (25 MiB buckets,
            `--bucket-mb`); gradients come back as DTensors sharded on dim 0
    FSDP2   `fully_shard` on each transformer block, then on the root (`--wrap root`: on
            the root only), on a CPU `DeviceMesh`; loss over the rank's half of the batch,
            `.backward()`, gradients in `.grad` as DTensors sharded on dim 0 (set to None
            before each step). The module holds the same parameters and runs
            examples/gpt.py's functions (`harness.gpt_module`).

Loss and gradients (`.full_tensor()`) are checked equal on every rank before timing. The
two are then timed in alternating blocks (a barrier before each block; a block's time is
its slowest rank's). Reported: per-step time of each and the ratio FSDP2 time / pxform
time (> 1: pxform faster; goal >= 1.0).

    python benchmarks/sdp_vs_fsdp2.py                 # GPT "small", global batch 16
    python benchmarks/sdp_vs_fsdp2.py --wrap root --batch 32
    python benchmarks/sdp_vs_fsdp2.py --malloc pinned # glibc's heap thresholds fixed
    python benchmarks/sdp_vs_fsdp2.py --quick         # a few seconds, smoke run
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def rank_main(cfg_name: str, batch_size: int, bucket_mb: float, wrap: str, reps: int,
              steps: int, warmup: int) -> dict[str, Any]:
    """On every rank: build both contenders, check they agree, time them interleaved."""
    harness.add_paths()
    import optree
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import pxform
    from pxform import P

    world = dist.get_world_size()
    cfg, params, batch, local, loss = harness.gpt_case(cfg_name, batch_size)
    for path, t in zip(*optree.tree_flatten_with_path(params)[:2]):
        if t.shape[0] % world:
            raise ValueError(f"parameter {path} has dim 0 of size {t.shape[0]}, not "
                             f"divisible by {world} ranks")

    step = pxform.shard(loss, mesh=pxform.Mesh({"dp": world}),
                        in_specs=(P("dp"), {"idx": P("dp"), "targets": P("dp")}),
                        bucket_mb=bucket_mb)
    px_step = pxform.value_and_grad(step)
    start = time.perf_counter()
    dparams, dbatch = step.distribute(params, batch)
    px_loss, px_grads = px_step(dparams, dbatch)
    first_call = time.perf_counter() - start

    module = harness.gpt_module(cfg, params)
    mesh = init_device_mesh("cpu", (world,))
    if wrap == "blocks":
        for blk in module.blocks:
            fully_shard(blk, mesh=mesh)
    fully_shard(module, mesh=mesh)

    def fsdp_step() -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        value = module(local["idx"], local["targets"])
        value.backward()
        return value

    fsdp_loss = fsdp_step().detach()
    dist.all_reduce(fsdp_loss)  # each rank's loss is over its half: the global mean is
    fsdp_loss /= world          # their mean (equal halves, no ignored targets)
    px_leaves = [g.full_tensor() for g in optree.tree_leaves(px_grads)]
    fsdp_tree = module.grad_tree()
    fsdp_leaves = [g.full_tensor() for g in optree.tree_leaves(fsdp_tree)]
    grad_types = sorted({f"pxform {type(g).__name__}{tuple(g.placements)}"
                         for g in optree.tree_leaves(px_grads)}
                        | {f"FSDP2 {type(g).__name__}{tuple(g.placements)}"
                           for g in optree.tree_leaves(fsdp_tree)})
    check = {"loss_pxform": float(px_loss.detach()), "loss_fsdp2": float(fsdp_loss),
             "loss_abs_diff": abs(float(px_loss.detach()) - float(fsdp_loss)),
             "grad_max_abs_diff": harness.max_abs_diff(px_leaves, fsdp_leaves),
             "grad_types": grad_types,
             "ok": bool(torch.allclose(px_loss.detach(), fsdp_loss, rtol=1e-5, atol=1e-6)
                        and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                                for a, b in zip(px_leaves, fsdp_leaves)))}
    if not check["ok"]:
        return {"check": check}

    for _ in range(warmup):
        px_step(dparams, dbatch)
        fsdp_step()
    times = harness.interleave({"pxform": lambda: px_step(dparams, dbatch),
                                "fsdp2": fsdp_step}, reps, steps, sync=dist.barrier)
    program = step.lower(dparams, dbatch)
    stats = step.bucket_stats

    # one step of each under the same meter (pxform.MemoryMeter counts tensor storages
    # below autograd, FSDP2's all-gather buffers too); each side's parameters and batch
    # are its baseline
    def metered(run: Any, *held: Any) -> dict[str, int]:
        with pxform.MemoryMeter() as meter:
            meter.track(*held)
            run()
        return {"peak": meter.stats.peak_bytes, "saved": meter.stats.saved_bytes,
                "baseline": meter.stats.baseline_bytes}

    memory = {"pxform": metered(lambda: px_step(dparams, dbatch), dparams, dbatch),
              "fsdp2": metered(fsdp_step, module, local)}
    # parameter bytes this rank holds: the shards, 1/ranks of the model on both sides
    param_bytes = {
        "pxform": sum(g.to_local().numel() * g.element_size()
                      for g in optree.tree_leaves(dparams)),
        "fsdp2": sum(p.to_local().numel() * p.element_size() for p in module.parameters()),
        "whole_model": sum(t.numel() * t.element_size() for t in optree.tree_leaves(params))}
    return {"check": check, "times": times, "first_call_s": first_call,
            "memory": memory, "param_bytes": param_bytes,
            "pxform_forward_collectives": program.collectives(),
            "pxform_backward_collectives": program.backward_collectives(),
            "pxform_buckets": vars(stats) if stats is not None else None,
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = harness.parser(__doc__, batch=16, reps=30, steps=5, ranks=True)
    parser.add_argument("--wrap", choices=["blocks", "root"], default="blocks",
                        help="fully_shard each block and the root, or the root only")
    args = harness.parse(parser)
    harness.add_paths()
    import gpt
    import sdp_vs_fsdp2  # this module by name, so that ranks can unpickle rank_main

    from pxform.tools.testing import World

    cfg = gpt.GPT_CONFIGS[args.config]
    malloc = harness.pin_malloc(args)
    with World(args.ranks) as world:
        per_rank = world.run(sdp_vs_fsdp2.rank_main, args.config, args.batch, args.bucket_mb,
                             args.wrap, args.reps, args.steps, args.warmup)
    checks = [r["check"] for r in per_rank]
    print(f"GPT {args.config} ({cfg.num_params() / 1e6:.2f} M params), global batch "
          f"{args.batch} x {cfg.seq_len} tokens, float32, {args.ranks} gloo ranks x "
          f"{per_rank[0].get('threads', 1)} thread, FSDP2 wrap: {args.wrap}; {args.reps} "
          f"blocks of {args.steps} steps each, interleaved")
    harness.report_checks(checks, "sdp_vs_fsdp2: pxform and FSDP2 disagree",
                          f"; gradients: {', '.join(checks[0]['grad_types'])}")
    times = harness.slowest_rank([r["times"] for r in per_rank])
    summary = harness.summarise(times, "fsdp2", "pxform")
    summary["ratio"]["what"] = "FSDP2 time / pxform time"
    r0 = per_rank[0]
    print(f"  pxform first call {max(r['first_call_s'] for r in per_rank):.2f} s (distribute "
          f"+ trace + lower + one step)")
    print(f"  pxform collectives: forward {harness.counts(r0['pxform_forward_collectives'])}; "
          f"backward {harness.counts(r0['pxform_backward_collectives'])}; buckets "
          f"{r0['pxform_buckets']}")
    harness.print_table(summary)
    print(f"  goal FSDP2/pxform >= 1.0: "
          f"{'met' if summary['ratio']['of_medians'] >= 1.0 else 'NOT met'} "
          f"({summary['ratio']['of_medians']:.4f})")
    peaks = {k: max(r["memory"][k]["peak"] for r in per_rank) for k in ("pxform", "fsdp2")}
    mem_ratio = peaks["pxform"] / peaks["fsdp2"]
    pb = r0["param_bytes"]
    print(f"  peak memory (MemoryMeter, worst rank): pxform {peaks['pxform'] / 2**20:.2f} MiB, "
          f"FSDP2 {peaks['fsdp2'] / 2**20:.2f} MiB, pxform/FSDP2 {mem_ratio:.3f} (goal <= "
          f"1.05: {'met' if mem_ratio <= 1.05 else 'NOT met'})")
    print(f"  parameters per rank: pxform {pb['pxform'] / 2**20:.3f} MiB, FSDP2 "
          f"{pb['fsdp2'] / 2**20:.3f} MiB, of {pb['whole_model'] / 2**20:.3f} MiB "
          f"({pb['whole_model'] / pb['pxform']:.2f} ranks' worth)")
    summary["memory"] = {"peak_bytes": peaks, "pxform_over_fsdp2": mem_ratio,
                         "goal_pxform_over_fsdp2": 1.05,
                         "per_rank": [r["memory"] for r in per_rank],
                         "param_bytes_per_rank": pb}
    if args.quick:
        return
    tag = harness.variant(args, parser, {"config": "", "wrap": "wrap-", "batch": "batch",
                                         "ranks": "ranks", "malloc": "malloc-"})
    path = harness.write_result("sdp_vs_fsdp2", {
        "goal": {"fsdp2_time_over_pxform_time": 1.0},
        "config": {"model": args.config, "params": cfg.num_params(), "global_batch":
                   args.batch, "seq_len": cfg.seq_len, "dtype": "float32", "ranks":
                   args.ranks, "backend": "gloo", "threads_per_rank": r0["threads"],
                   "bucket_mb": args.bucket_mb, "fsdp2_wrap": args.wrap, "reps": args.reps,
                   "steps": args.steps, "warmup": args.warmup, "malloc_env": malloc},
        "check": checks,
        "first_call_s": [r["first_call_s"] for r in per_rank],
        "pxform_forward_collectives": r0["pxform_forward_collectives"],
        "pxform_backward_collectives": r0["pxform_backward_collectives"],
        "pxform_buckets": r0["pxform_buckets"],
        "per_rank_blocks_s": [r["times"] for r in per_rank],
        **summary,
    }, args.out, variant=tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
