"""Where a sharded step's time goes against the model: the example GPT "small" (batch 16,
float32) on 2 gloo ranks under the pinned plans of `benchmarks/accuracy.py`, each
collective the runtime runs timed as it runs (`pxform.runtime.collectives._run_step`:
the collective, waiting for it, and its rearranging copies), beside the plan priced
three ways by the same profile:

* `nocomm`: the comm tables at ~0, no per-collective cost, no waits: the model's compute
  (ops, per-op and per-step host costs);
* `transfer`: with the comm tables (what `nocomm` leaves out is the transfers);
* `overhead`: with `collective_overhead_s` too; the plan's own prediction adds the waits.

    source .venv/bin/activate
    python scripts/step_breakdown.py                         # calibrates first (~30 s)
    python scripts/step_breakdown.py --cases tp,sp --profile p.json

Per rank and case it prints the measured step (median), the time inside collectives
(median per step) and the rest ("compute": the ops, the runtime's glue between them),
against the model's compute and its collectives (prediction less `nocomm`).

What it showed (2026-11-26, sixth session; one calibration, 10 steps per case):

| plan | step, model / measured | compute, model / measured | collectives, model / measured |
| --- | --- | --- | --- |
| tp (29 collectives) | 110.1 / 130.3 ms | 54.0 / 62.6 ms | 56.1 / 67.7 ms |
| tp + recompute (40) | 145.7 / 163.6 ms | 73.9 / 89.0 ms | 71.8 / 74.6 ms |
| sp (45) | 134.8 / 160.9 ms | 53.3 / 77.1 ms | 81.5 / 83.9 ms |

Tensor parallelism's shortfall is half compute, half collectives; sequence parallelism's
is all compute (its many small conversions: narrows, cats, the functional collectives'
wrapping). In an earlier run the same day sequence parallelism measured 130.7 ms against
129.2 predicted: its compute was 20 ms under and its collectives about as much over.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL = ("slice", "zero", "pad")  # steps that move nothing between ranks


def rank_main(cases: list[str], profile: str | None, steps: int) -> dict[str, Any]:
    """On every rank: plan, price three ways, run and time each case's collectives."""
    for sub in ("benchmarks", "examples", ""):
        sys.path.insert(0, os.path.join(ROOT, sub))
    import accuracy
    import gpt
    import harness
    import torch
    import torch.distributed as dist

    import pxform
    import pxform.runtime.collectives as collectives
    from pxform.search import pin_of

    hw = harness.profile_or_calibrated(profile, "cpu-x2")
    timed: list[float] = []
    run_step = collectives._run_step

    def timed_step(x: Any, step: Any, axes: Any, wait: bool = True) -> Any:
        start = time.perf_counter()
        out = run_step(x, step, axes, wait)
        if step.kind not in LOCAL:
            timed.append(time.perf_counter() - start)
        return out

    collectives._run_step = timed_step
    cfg = gpt.GPT_CONFIGS["small"]
    params = gpt.init_params(cfg, dtype=torch.float32)
    batch = gpt.make_batch(cfg, 16)

    def gpt_loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    free = tuple(dataclasses.replace(t, points=tuple((b, 1e-9) for b, _ in t.points))
                 for t in hw.comm_tables)
    variants = {"nocomm": dataclasses.replace(hw, sync_wait=(), collective_overhead_s=0.0,
                                              comm_tables=free),
                "transfer": dataclasses.replace(hw, sync_wait=(), collective_overhead_s=0.0),
                "overhead": dataclasses.replace(hw, sync_wait=())}
    pins = dict(accuracy.cases(2, 6))
    out = {}
    for name in cases:
        step = pxform.auto(gpt_loss, mesh=2, hardware=hw, plan=pins[name])
        plan = step.plan(params, batch)
        priced = {k: pxform.auto(gpt_loss, mesh=pxform.Mesh.abstract(2), hardware=h,
                                 plan=pin_of(plan)).plan(params, batch).step_time_s
                  for k, h in variants.items()}
        dparams, _ = step.distribute(params, batch)
        run = pxform.value_and_grad(step)
        for _ in range(2):
            run(dparams, batch)
        walls, inside, counts = [], [], []
        for _ in range(steps):
            dist.barrier()
            timed.clear()
            start = time.perf_counter()
            run(dparams, batch)
            walls.append(time.perf_counter() - start)
            inside.append(sum(timed))
            counts.append(len(timed))
        wall, comm = statistics.median(walls), statistics.median(inside)
        out[name] = {
            "step ms (model, measured)": (round(plan.step_time_s * 1e3, 1),
                                         round(wall * 1e3, 1)),
            "compute ms (model, measured)": (round(priced["nocomm"] * 1e3, 1),
                                             round((wall - comm) * 1e3, 1)),
            "collectives ms (model, measured)": (
                round((plan.step_time_s - priced["nocomm"]) * 1e3, 1), round(comm * 1e3, 1)),
            "of the model's: transfers, overhead, waits ms": (
                round((priced["transfer"] - priced["nocomm"]) * 1e3, 1),
                round((priced["overhead"] - priced["transfer"]) * 1e3, 1),
                round((plan.step_time_s - priced["overhead"]) * 1e3, 1)),
            "collectives per step": max(counts)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="dp,zero3,tp,tp+recompute,sp",
                   help="names of benchmarks/accuracy.py's cases, comma-separated")
    p.add_argument("--profile", help="a saved pxform profile (JSON); default: calibrate")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import step_breakdown  # this module by name, so that ranks can unpickle it

    from pxform.tools.testing import World

    with World(2) as world:
        results = world.run(step_breakdown.rank_main, args.cases.split(","), args.profile,
                            args.steps)
    for rank, per_case in enumerate(results):
        for name, row in per_case.items():
            print(f"rank {rank} {name}: {row}")


if __name__ == "__main__":
    main()
