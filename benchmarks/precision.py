"""The bf16 mixed-precision policy against float32, on gloo: time and memory.

`--ranks` processes (a `pxform.testing.World`, one torch thread each) train the example GPT
with the same plan twice, side by side:

    float32  pxform.shard(loss, mesh=Mesh({"dp": ranks}), in_specs=(specs, P("dp")))
    bf16     the same with precision=pxform.Precision() (bf16 compute, float32 master
             weights and gradient reductions)

`--mode zero3` (the default) stores every parameter split over `dp` (ZeRO-3: each block's
weights gathered at use, in bf16 under the policy); `--mode dp` replicates them (DDP).

Before timing, the bf16 loss and gradients are checked against float32 within bf16's
rounding (relative 2e-2 of each gradient's scale). Then each contender's memory is metered
for one step (`pxform.MemoryMeter`: peak bytes allocated during the step above what was
held before it, and the bytes autograd saved for backward), the bytes its all-gathers move
per step in forward (from the lowered program), and the two are timed in alternating blocks (a
barrier before each block; a block's time is its slowest rank's). Reported: per-step time
of each and the ratio float32 time / bf16 time (> 1: bf16 faster), and the memory ratios.

On a CPU, bf16 matmuls run at whatever rate the cores have for them (many have no bf16
units, so the casts are extra work): the time ratio here says what the policy costs on this
machine, not what it gains on a GPU. The memory ratios carry over.

    python benchmarks/precision.py                    # GPT "small", batch 16, ZeRO-3
    python benchmarks/precision.py --mode dp --batch 64
    python benchmarks/precision.py --quick            # a few seconds, smoke run
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def rank_main(cfg_name: str, batch_size: int, mode: str, reps: int, steps: int,
              warmup: int) -> dict[str, Any]:
    """On every rank: build both contenders, check they agree, meter and time them."""
    harness.add_paths()
    import optree
    import torch
    import torch.distributed as dist

    import pxform
    from pxform import P

    world = dist.get_world_size()
    cfg, params, batch, _, loss = harness.gpt_case(cfg_name, batch_size)
    if mode == "zero3":
        specs = optree.tree_map(lambda t: P("dp") if t.shape[0] % world == 0 else None,
                                params)
    else:
        specs = None
    mesh = pxform.Mesh({"dp": world})
    runs, first_call, results, programs = {}, {}, {}, {}
    for name, policy in (("float32", None), ("bf16", pxform.Precision())):
        step = pxform.shard(loss, mesh=mesh, in_specs=(specs, P("dp")), precision=policy)
        local, local_batch = step.distribute(params, batch)
        run = pxform.value_and_grad(step)
        start = time.perf_counter()
        results[name] = run(local, local_batch)
        first_call[name] = time.perf_counter() - start
        runs[name] = (run, local, local_batch)
        programs[name] = step.lower(params, batch)

    def leaves(grads: Any) -> list[torch.Tensor]:
        return [pxform.gather(g) for g in optree.tree_leaves(grads)]

    fl, fg = results["float32"]
    bl, bg = results["bf16"]
    rel = max(float((a - b).abs().max() / a.abs().max().clamp(min=1e-12))
              for a, b in zip(leaves(fg), leaves(bg)))
    check = {"loss_float32": float(fl), "loss_bf16": float(bl),
             "loss_abs_diff": abs(float(fl) - float(bl)),
             "grad_max_abs_diff": harness.max_abs_diff(leaves(fg), leaves(bg)),
             "grad_max_rel_diff": rel,
             "grad_dtypes": sorted({str(g.dtype) for g in optree.tree_leaves(bg)}),
             "ok": abs(float(fl) - float(bl)) < 2e-2 * abs(float(fl)) and rel < 2e-2}
    check["ok"] = check["ok"] and check["grad_dtypes"] == ["torch.float32"]
    if not check["ok"]:
        return {"check": check}
    memory = {}
    for name, (run, local, local_batch) in runs.items():
        with pxform.MemoryMeter() as meter:
            meter.track(local, local_batch)
            run(local, local_batch)
        memory[name] = {"peak_bytes": meter.stats.peak_bytes,
                        "saved_bytes": meter.stats.saved_bytes}
    gathered = {}
    for name, program in programs.items():
        moved = 0
        for instr in program.instrs:
            steps_ = getattr(instr, "forward", None)
            if steps_ is not None and any(s.kind == "all_gather" for s in steps_.steps):
                moved += instr.dst.type.numel * instr.dst.type.dtype.itemsize
        gathered[name] = moved
    for _ in range(warmup):
        for run, local, local_batch in runs.values():
            run(local, local_batch)
    times = harness.interleave(
        {name: (lambda r=r, a=a, b=b: r(a, b)) for name, (r, a, b) in runs.items()},
        reps, steps, sync=dist.barrier)
    return {"check": check, "times": times, "first_call_s": first_call, "memory": memory,
            "gathered_bytes": gathered, "threads": torch.get_num_threads()}


def main() -> None:
    parser = harness.parser(__doc__, batch=16, reps=20, steps=3, ranks=True)
    parser.add_argument("--mode", default="zero3", choices=["zero3", "dp"])
    args = harness.parse(parser)
    harness.add_paths()
    import gpt
    import precision  # this module by name, so that ranks can unpickle rank_main

    from pxform.core.units import format_bytes
    from pxform.tools.testing import World

    cfg = gpt.GPT_CONFIGS[args.config]
    harness.pin_malloc(args)  # --malloc pinned
    with World(args.ranks) as world:
        per_rank = world.run(precision.rank_main, args.config, args.batch, args.mode,
                             args.reps, args.steps, args.warmup)
    checks = [r["check"] for r in per_rank]
    print(f"GPT {args.config} ({cfg.num_params() / 1e6:.2f} M params), batch {args.batch} x "
          f"{cfg.seq_len} tokens, {args.mode} over {args.ranks} gloo ranks x "
          f"{per_rank[0].get('threads', 1)} thread; float32 against pxform.Precision() "
          f"(bf16 compute, float32 master weights and reductions); {args.reps} blocks of "
          f"{args.steps} steps each, interleaved")
    harness.report_checks(checks, "precision: bf16 and float32 disagree beyond bf16's "
                          "rounding", extra=f", max relative grad diff "
                          f"{max(c['grad_max_rel_diff'] for c in checks):.3g}")
    r0 = per_rank[0]
    memory = {name: {k: max(r["memory"][name][k] for r in per_rank)
                     for k in ("peak_bytes", "saved_bytes")} for name in r0["memory"]}
    for name, m in memory.items():
        print(f"  {name:8s} peak {format_bytes(int(m['peak_bytes']))}, saved for backward "
              f"{format_bytes(int(m['saved_bytes']))}, all-gathered in forward "
              f"{format_bytes(int(r0['gathered_bytes'][name]))}")
    ratios = {k: memory["float32"][k] / max(memory["bf16"][k], 1)
              for k in ("peak_bytes", "saved_bytes")}
    print(f"  memory float32 / bf16: peak {ratios['peak_bytes']:.2f}, saved "
          f"{ratios['saved_bytes']:.2f}")
    times = harness.slowest_rank([r["times"] for r in per_rank])
    summary = harness.summarise(times, "float32", "bf16")
    summary["ratio"]["what"] = "float32 time / bf16 time"
    harness.print_table(summary)
    if args.quick:
        return
    tag = harness.variant(args, parser, {"config": "", "batch": "batch", "ranks": "ranks",
                                         "mode": ""})
    path = harness.write_result("precision", {
        "config": {"model": args.config, "params": cfg.num_params(), "batch": args.batch,
                   "seq_len": cfg.seq_len, "mode": args.mode, "ranks": args.ranks,
                   "backend": "gloo", "threads_per_rank": r0["threads"], "reps": args.reps,
                   "steps": args.steps, "warmup": args.warmup},
        "check": checks, "memory": memory, "memory_ratio_float32_over_bf16": ratios,
        "gathered_bytes": r0["gathered_bytes"],
        "first_call_s": [r["first_call_s"] for r in per_rank],
        "per_rank_blocks_s": [r["times"] for r in per_rank],
        **summary,
    }, args.out, variant=tag)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
