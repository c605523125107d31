"""Where a pipelined step's time goes against the model: the example GPT "small" (batch 16,
float32) in 2 stages on 2 gloo ranks, 1F1B at 2 and at 8 microbatches, each action timed as
it runs (`pxform.runtime.pipeline.recording`), beside the model's forward and backward per
microbatch without the ranks' waits (`Hardware.sync_wait` off; the per-action costs in).

    source .venv/bin/activate
    python scripts/pipeline_action_probe.py                 # calibrates first (~30 s)
    python scripts/pipeline_action_probe.py --profile p.json  # a saved profile instead

Per rank and case it prints the step (measured median, predicted), the model's F and B per
microbatch, and per action kind its count per step, median and total ms per step.

What it showed (2026-11-26, fifth session, on the profile of that session's accuracy run,
which predicts 74.7 ms at 2 microbatches and 69.5 ms at 8), in two runs minutes apart:

| | run 1 | run 2 |
| --- | --- | --- |
| step at 2 microbatches, measured | 76.1 ms | 71-72 ms |
| step at 8 microbatches, measured | 87.5 ms | 79.0 ms |
| F at 8 microbatches (model 2.76 / 2.88 ms) | 3.11 / 3.43 ms | 2.76 / 3.07 ms |
| B at 8 microbatches (model 4.36 / 4.63 ms) | 4.68 / 4.96 ms | 4.29 / 4.57 ms |
| receive waits at 8 microbatches, per step | 16.8 (RB) / 6.9 ms (RF) | 19.4 / 8.0 ms |

In run 2 the compute actions match the model (the machine's speed moves them by 10-15 %
between runs). What stays under-priced in both runs is the receives: 1.1-1.2 ms median per
gradient receive on the first stage in steady 1F1B. The model gives them the profile's sync
wait, 0.13 ms at a 2 ms gap, and the transfer.

`runtime_costs` fits `op_action_overhead_s` on a reference pipeline (its 2-stage
transformer, width 96, 1 sequence per microbatch). There the F and B actions measure at or
below the model. A fit on its compute actions alone came out 0 in 4 of 4 tries, so the
per-op pipeline cost is still the residual of two whole steps. That residual takes in the
receives' error too, and came out 0-8.7 us in 4 tries on one profile.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_main(profile: str | None, repeats: int) -> dict[str, Any]:
    """On every rank: plan, run and record each case."""
    for sub in ("benchmarks", "examples", ""):
        sys.path.insert(0, os.path.join(ROOT, sub))
    import accuracy
    import gpt
    import harness
    import torch
    import torch.distributed as dist

    import pxform
    from pxform.search import pin_of

    hw = harness.profile_or_calibrated(profile, "cpu-x2")
    cfg = gpt.GPT_CONFIGS["small"]
    params = gpt.init_params(cfg, dtype=torch.float32)
    batch = gpt.make_batch(cfg, 16)

    def gpt_loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    pins = dict(accuracy.cases(2, 6))
    no_waits = dataclasses.replace(hw, sync_wait=())
    out = {}
    for name in ("pp2 m2", "pp2 m8"):
        step = pxform.auto(gpt_loss, mesh=2, hardware=hw, plan=pins[name])
        plan = step.plan(params, batch)
        bare = pxform.auto(gpt_loss, mesh=pxform.Mesh.abstract(2), hardware=no_waits,
                           plan=pin_of(plan)).plan(params, batch)
        dparams, _ = step.distribute(params, batch)
        run = pxform.value_and_grad(step)
        for _ in range(2):
            run(dparams, batch)
        steps, per_step = harness.recorded_steps(functools.partial(run, dparams, batch),
                                                 repeats)
        kinds: dict[str, list[float]] = {}
        for action, began, ended in (e for events in per_step for e in events):
            kinds.setdefault(action.kind, []).append(ended - began)
        mine = bare.stage_plans[dist.get_rank()]
        out[name] = {
            "step measured ms": round(statistics.median(steps) * 1e3, 1),
            "step predicted ms": round(plan.step_time_s * 1e3, 1),
            "model F, B ms (no waits)": (round(mine.forward_s * 1e3, 2),
                                         round(mine.backward_s * 1e3, 2)),
            "kind: (per step, median ms, total ms per step)": {
                k: (len(v) // repeats, round(statistics.median(v) * 1e3, 2),
                    round(sum(v) / repeats * 1e3, 1)) for k, v in kinds.items()}}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--profile", help="a saved pxform profile (JSON); default: calibrate")
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    import pipeline_action_probe  # this module by name, so that ranks can unpickle it

    from pxform.tools.testing import World

    with World(2) as world:
        results = world.run(pipeline_action_probe.rank_main, args.profile, args.repeats)
    for rank, per_case in enumerate(results):
        for name, row in per_case.items():
            print(f"rank {rank} {name}: {row}")


if __name__ == "__main__":
    main()
