"""Plan stability: the same machine calibrated again and again, and the plan each profile
gives, with and without `auto`'s tolerance.

`--ranks` gloo processes (a `pxform.testing.World`) make a profile `--runs` times in a
row, each as `pxform calibrate` and `benchmarks/accuracy.py` do: `pxform.runtime.calibrate`
and `pxform.tools.runtime_costs`, or the representative (`representative_profile`) of
`--calibrations` such runs. After each profile they plan the example GPT twice over
(searched, and with 2 pipeline stages pinned, the microbatch count and schedule
searched), once with `tolerance=0` (the
fastest predicted plan) and once with the default tolerance (the simplest plan within 5 %
of the fastest, `pxform.search.partition.simplicity`). The table counts the distinct plans
each way took over the runs: one means the machine gives the same plan run after run, the
issue's goal. Each calibration also prices two pinned plans (one stage over the data axis;
2 stages, 1F1B, 4 microbatches per rank): how far one plan's prediction moves with the
profile alone. The fitted per-op pipeline cost (`op_action_overhead_s`) and each profile
whole are recorded.

    source .venv/bin/activate
    python benchmarks/stability.py               # GPT "small", batch 16, 2 ranks, 6 runs
    python benchmarks/stability.py --calibrations 3   # each profile the representative of 3
    python benchmarks/stability.py --quick       # 2 profiles, nothing written
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def rank_main(config: str, batch_size: int, runs: int, calibrations: int = 1
              ) -> dict[str, Any]:
    """On every rank: `runs` profiles, and per profile the plans of each case."""
    harness.add_paths()
    import gpt
    import torch

    import pxform
    from pxform.search import Pin

    world = torch.distributed.get_world_size()
    cfg = gpt.GPT_CONFIGS[config]
    params = gpt.init_params(cfg, dtype=torch.float32)
    batch = gpt.make_batch(cfg, batch_size)

    def gpt_loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    from pxform.search.pipelines import ScheduleChoice

    fixed = {f"1 stage, outer={world}": Pin(stages=1, outer=world, inner=1, microbatches=1),
             f"pp2 m{4 * world} 1f1b": Pin(stages=2, microbatches=4 * world,
                                           schedule=ScheduleChoice())}
    out = []
    for _ in range(runs):
        start = time.perf_counter()
        hw = harness.calibrated(calibrations, f"cpu-x{world}")
        seconds = time.perf_counter() - start
        row: dict[str, Any] = {"calibrate_s": seconds,
                               "action_overhead_s": hw.action_overhead_s,
                               "collective_overhead_s": hw.collective_overhead_s,
                               "op_time_scale": hw.op_time_scale,
                               "op_step_overhead_s": hw.op_step_overhead_s,
                               "sync_wait": [list(p) for p in hw.sync_wait],
                               "op_action_overhead_s": hw.op_action_overhead_s,
                               "transfer_overhead_s": hw.transfer_overhead_s,
                               "send_overhead_s": hw.send_overhead_s,
                               "receive_overhead_s": hw.receive_overhead_s,
                               "receive_stall_s": hw.receive_stall_s,
                               "hardware": hw.to_json()}
        # what each calibration predicts for the same plans (a fixed plan's prediction
        # moves with the profile alone)
        row["pinned"] = {name: pxform.auto(gpt_loss, mesh=world, hardware=hw, plan=pin)
                         .plan(params, batch).step_time_s for name, pin in fixed.items()}
        for case, pin in (("searched", None), ("2 stages", Pin(stages=2))):
            for tolerance in (0.0, None):
                kw = {} if tolerance is None else {"tolerance": tolerance}
                plan = pxform.auto(gpt_loss, mesh=world, hardware=hw, plan=pin,
                                   **kw).plan(params, batch)
                row[f"{case}|{'default' if tolerance is None else 'fastest'}"] = {
                    "config": plan.config_text(), "predicted_s": plan.step_time_s,
                    "strategies": sorted({b.strategy for b in plan.blocks})}
        out.append(row)
    return {"runs": out}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="small", help="a key of gpt.GPT_CONFIGS")
    p.add_argument("--batch", type=int, default=16, help="global sequences per step")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--runs", type=int, default=6, help="profiles in a row")
    p.add_argument("--calibrations", type=int, default=1,
                   help="calibrations per profile, their median kept as `pxform calibrate "
                        "--runs` does (default 1)")
    p.add_argument("--quick", action="store_true", help="2 runs; writes nothing")
    p.add_argument("--out", default=harness.RESULTS)
    args = p.parse_args()
    if args.quick:
        args.runs = 2
    harness.add_paths()
    import stability  # this module by name, so that ranks can unpickle rank_main

    from pxform.core.units import format_table
    from pxform.tools.testing import World

    with World(args.ranks, timeout=300 + 120 * args.runs * args.calibrations) as world:
        runs = world.run(stability.rank_main, args.config, args.batch, args.runs,
                         args.calibrations)[0]["runs"]
    keys = [k for k in runs[0] if "|" in k]
    head = ("case", "tolerance", "distinct plans", "plans taken (runs)", "predicted (min-max)")
    table: list[tuple[str, ...]] = [head]
    summary = {}
    for key in keys:
        case, how = key.split("|")
        taken = Counter(f"{r[key]['config'].replace(' schedule=1f1b', '')} "
                        f"[{', '.join(r[key]['strategies'])}]" for r in runs)
        times = [r[key]["predicted_s"] * 1e3 for r in runs]
        summary[key] = {"distinct": len(taken), "taken": dict(taken)}
        table.append((case, "0" if how == "fastest" else "0.05 (default)", str(len(taken)),
                      "; ".join(f"{plan} ({n})" for plan, n in taken.most_common()),
                      f"{min(times):.1f}-{max(times):.1f} ms"))
    each = "one calibration" if args.calibrations == 1 else \
        f"the representative of {args.calibrations} calibrations"
    print(f"GPT {args.config}, global batch {args.batch}, {args.ranks} gloo ranks, "
          f"{args.runs} profiles in a row, each {each} "
          f"({sum(r['calibrate_s'] for r in runs) / len(runs):.1f} s each)")
    print("\n".join(format_table(table, align="lllrl", indent="  ")))
    print("  action overhead per run: " + ", ".join(f"{r['action_overhead_s'] * 1e3:.2f} ms"
                                                    for r in runs))
    print("  op time scale, time per op: " + ", ".join(
        f"{r['op_time_scale']:.2f} x, {r['op_step_overhead_s'] * 1e6:.0f} us" for r in runs))
    print("  per-op pipeline cost (op_action_overhead_s): " + ", ".join(
        f"{r['op_action_overhead_s'] * 1e6:.1f} us" for r in runs))
    print("  pipeline receive stall (receive_stall_s): " + ", ".join(
        f"{r.get('receive_stall_s', 0.0) * 1e3:.2f} ms" for r in runs))
    print("  pipeline send, receive (send_overhead_s, receive_overhead_s): " + ", ".join(
        f"{r.get('send_overhead_s', 0.0) * 1e3:.2f}, {r.get('receive_overhead_s', 0.0) * 1e3:.2f}"
        f" ms" for r in runs))
    for name in runs[0]["pinned"]:
        times = [r["pinned"][name] * 1e3 for r in runs]
        print(f"  predicted for the pinned plan {name}: "
              + ", ".join(f"{t:.1f}" for t in times)
              + f" ms (spread {max(times) / min(times) - 1:.0%})")
    print("  sync wait at the longest gap: " + ", ".join(
        f"{r['sync_wait'][-1][1] * 1e3:.2f} ms after {r['sync_wait'][-1][0] * 1e3:.1f} ms"
        for r in runs if r["sync_wait"]))
    if args.quick:
        return
    path = harness.write_result("stability", {
        "goal": "one plan over every calibration (the same machine, the same plan)",
        "config": {"model": args.config, "global_batch": args.batch, "ranks": args.ranks,
                   "runs": args.runs, "calibrations": args.calibrations,
                   "calibration_sizes": list(harness.CALIBRATION_SIZES)},
        "runs": runs, "summary": summary}, out_dir=args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
