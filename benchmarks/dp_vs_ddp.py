"""Data parallelism: pxform against `torch.nn.parallel.DistributedDataParallel`, on gloo.

`--ranks` processes (a `pxform.testing.World`, one torch thread each) train the example GPT
on the same global batch, float32, loss forward and backward producing every parameter's
gradient, both with 25 MiB gradient buckets (DDP's default; `--bucket-mb`):

    pxform  pxform.value_and_grad(pxform.shard(loss, mesh=Mesh({"dp": ranks}),
                in_specs=(None, {"idx": P("dp"), "targets": P("dp")})))(params, batch)
            (replicated full parameters, the global batch split over dp locally)
    DDP     DistributedDataParallel(module)(idx_half, targets_half).backward(), grads in
            .grad (set to None before each step); the module holds the same parameters and
            runs examples/gpt.py's functions (`harness.gpt_module`)

Loss and gradients are checked equal on every rank before timing. The two are then timed
in alternating blocks (a barrier before each block; a block's time is its slowest rank's).
Reported: per-step time of each and the ratio DDP time / pxform time (> 1: pxform faster;
goal >= 1.0).

    python benchmarks/dp_vs_ddp.py                    # GPT "small", global batch 16
    python benchmarks/dp_vs_ddp.py --batch 32 --reps 20
    python benchmarks/dp_vs_ddp.py --malloc pinned    # glibc's heap thresholds fixed
    python benchmarks/dp_vs_ddp.py --quick            # a few seconds, smoke run
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def rank_main(cfg_name: str, batch_size: int, bucket_mb: float, reps: int, steps: int,
              warmup: int) -> dict[str, Any]:
    """On every rank: build both contenders, check they agree, time them interleaved."""
    harness.add_paths()
    import optree
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    import pxform
    from pxform import P

    world = dist.get_world_size()
    cfg, params, batch, local, loss = harness.gpt_case(cfg_name, batch_size)

    step = pxform.shard(loss, mesh=pxform.Mesh({"dp": world}),
                        in_specs=(None, {"idx": P("dp"), "targets": P("dp")}),
                        bucket_mb=bucket_mb)
    px_step = pxform.value_and_grad(step)
    start = time.perf_counter()
    px_loss, px_grads = px_step(params, batch)
    first_call = time.perf_counter() - start

    module = harness.gpt_module(cfg, params)
    ddp = DistributedDataParallel(module, bucket_cap_mb=bucket_mb)

    def ddp_step() -> torch.Tensor:
        module.zero_grad(set_to_none=True)
        value = ddp(local["idx"], local["targets"])
        value.backward()
        return value

    ddp_loss = ddp_step().detach()
    dist.all_reduce(ddp_loss)  # each rank's loss is over its half: the global mean is
    ddp_loss /= world          # their mean (equal halves, no ignored targets)
    px_leaves = optree.tree_leaves(px_grads)
    ddp_leaves = optree.tree_leaves(module.grad_tree())
    check = {"loss_pxform": float(px_loss.detach()), "loss_ddp": float(ddp_loss),
             "loss_abs_diff": abs(float(px_loss.detach()) - float(ddp_loss)),
             "grad_max_abs_diff": harness.max_abs_diff(px_leaves, ddp_leaves),
             "ok": bool(torch.allclose(px_loss.detach(), ddp_loss, rtol=1e-5, atol=1e-6)
                        and all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
                                for a, b in zip(px_leaves, ddp_leaves)))}
    if not check["ok"]:
        return {"check": check}

    for _ in range(warmup):
        px_step(params, batch)
        ddp_step()
    held: list[Any] = []

    def px_call() -> None:
        # as DDP's side: the last step's gradients are dropped when the next step starts
        # and kept after it (a training loop keeps them for the optimizer)
        held.clear()
        held.append(px_step(params, batch))

    times = harness.interleave({"pxform": px_call, "ddp": ddp_step}, reps, steps,
                               sync=dist.barrier)
    program = step.lower(params, batch)
    ddp_log = ddp._get_ddp_logging_data()
    stats = step.bucket_stats
    return {"check": check, "times": times, "first_call_s": first_call,
            "pxform_forward_collectives": program.collectives(),
            "pxform_backward_collectives": program.backward_collectives(),
            "pxform_buckets": vars(stats) if stats is not None else None,
            "ddp_bucket_sizes": ddp_log.get("bucket_sizes"),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = harness.parser(__doc__, batch=16, reps=30, steps=5, ranks=True)
    args = harness.parse(parser)
    harness.add_paths()
    import dp_vs_ddp  # this module by name, so that ranks can unpickle rank_main
    import gpt

    from pxform.tools.testing import World

    cfg = gpt.GPT_CONFIGS[args.config]
    malloc = harness.pin_malloc(args)
    with World(args.ranks) as world:
        per_rank = world.run(dp_vs_ddp.rank_main, args.config, args.batch, args.bucket_mb,
                             args.reps, args.steps, args.warmup)
    checks = [r["check"] for r in per_rank]
    print(f"GPT {args.config} ({cfg.num_params() / 1e6:.2f} M params), global batch "
          f"{args.batch} x {cfg.seq_len} tokens, float32, {args.ranks} gloo ranks x "
          f"{per_rank[0].get('threads', 1)} thread; {args.reps} blocks of {args.steps} steps "
          f"each, interleaved")
    harness.report_checks(checks, "dp_vs_ddp: pxform and DDP disagree")
    times = harness.slowest_rank([r["times"] for r in per_rank])
    summary = harness.summarise(times, "ddp", "pxform")
    summary["ratio"]["what"] = "DDP time / pxform time"
    r0 = per_rank[0]
    print(f"  pxform first call {max(r['first_call_s'] for r in per_rank):.2f} s (trace + "
          f"lower + one step)")
    print(f"  pxform collectives: forward {harness.counts(r0['pxform_forward_collectives'])}, "
          f"backward {harness.counts(r0['pxform_backward_collectives'])}; buckets "
          f"{r0['pxform_buckets']}; DDP bucket sizes {r0['ddp_bucket_sizes']} B")
    harness.print_table(summary)
    print(f"  goal DDP/pxform >= 1.0: "
          f"{'met' if summary['ratio']['of_medians'] >= 1.0 else 'NOT met'} "
          f"({summary['ratio']['of_medians']:.4f})")
    if args.quick:
        return
    tag = harness.variant(args, parser, {"config": "", "batch": "batch", "ranks": "ranks",
                                         "malloc": "malloc-"})
    path = harness.write_result("dp_vs_ddp", {
        "goal": {"ddp_time_over_pxform_time": 1.0},
        "config": {"model": args.config, "params": cfg.num_params(), "global_batch":
                   args.batch, "seq_len": cfg.seq_len, "dtype": "float32", "ranks":
                   args.ranks, "backend": "gloo", "threads_per_rank": r0["threads"],
                   "bucket_mb": args.bucket_mb, "reps": args.reps, "steps": args.steps,
                   "warmup": args.warmup, "malloc_env": malloc},
        "check": checks,
        "first_call_s": [r["first_call_s"] for r in per_rank],
        "pxform_forward_collectives": r0["pxform_forward_collectives"],
        "pxform_backward_collectives": r0["pxform_backward_collectives"],
        "pxform_buckets": r0["pxform_buckets"], "ddp_bucket_sizes": r0["ddp_bucket_sizes"],
        "per_rank_blocks_s": [r["times"] for r in per_rank],
        **summary,
    }, args.out, variant=tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
