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
    python scripts/step_breakdown.py --fake --profile p.json  # no communication (below)

Per rank and case it prints the measured step (median), the time inside collectives
(median per step) and the rest ("compute": the ops, the runtime's glue between them),
against the model's compute and its collectives (prediction less `nocomm`); each kind and
size of collective (count per step, median and mean ms, the comm table's ms); and what
the collectives cost beyond the comm table, split by whether compute (more than
`pxform.search.blockcost.RELAYOUT_GAP_S`) or another collective came before each.
`--batch N` runs N sequences a step instead of 16. Then the same
steps under torch's profiler, split by profiled self time: aten ops, the collectives' ops
(their waits included), other events ("glue": autograd functions such as the
conversions', tensor-subclass dispatch), and the rest of the wall time (Python outside
any event). The profiler slows every op, so those figures are larger than the step's.

2026-11-27, one run on a saved profile (`--profile`), 10 steps, rank 0, ms:

| plan | step, model / measured | profiled: step / aten ops / collectives / glue / rest |
| --- | --- | --- |
| dp | 57.5 / 73.9 | 81.1 / 51.5 / 18.0 / 5.2 / 6.4 |
| zero3 | 82.5 / 82.7 | 113.4 / 63.9 / 27.9 / 12.9 / 8.7 |
| tp | 115.2 / 160.8 | 177.2 / 79.6 / 71.4 / 18.5 / 7.7 |
| sp | 146.9 / 181.3 | 188.0 / 69.9 / 84.4 / 25.2 / 8.6 |

Tensor parallelism's aten ops take 28 ms more than data parallelism's, and the model's
compute 8 ms more. The model does price what runs whole on every rank (attention and the
layer norms on the whole batch: about 6 ms of the 8, from the op curves). An earlier
profile (5 steps) put the measured difference at 16 ms by op: attention +6.7, the
re-layouts' copies, cats and fills +4.9, the log-softmax on the gathered logits +1.7,
the layer norms +1.2; the rest of the 28 is likely the profiler's own cost on the extra small
ops (narrows, slices, views). The larger part of the shortfall is the collectives: 29
per step take 71 ms profiled (2.5 ms each, their waits included) against the model's
0.7 ms transfer, 1.2 ms per-collective cost and 0.1 ms wait each, and the conversions'
autograd functions and subclass dispatch ("glue") 13 ms more than data parallelism's.

`--fake`: the same steps in one process, rank 0 of torch's fake process group (every
collective returns at once, moving nothing): compute and the runtime's host work alone.
2026-11-27 (ninth session), the median profile of a 5-calibration accuracy run, 10 rounds,
ms, measured / the model's compute / with its per-collective cost: dp 57.5 / 74.5 / 77.1,
zero3 68.0 / 74.3 / 98.1, tp 79.4 / 87.0 / 121.9, tp+recompute 104.1 / 117.6 / 164.2, sp
82.5 / 86.5 / 146.0. One process on two cores runs faster than the profile's two ranks side
by side, so the ratios count: against data parallelism's, tensor parallelism's compute and
host work come out 18 % over the model's (79.4 / 57.5 measured, 87.0 / 74.5 modelled),
and most of `collective_overhead_s` is not paid without a peer (it is waiting and waking,
not host work).
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
    import harness
    import torch
    import torch.distributed as dist

    import pxform
    import pxform.runtime.collectives as collectives
    from pxform.runtime.calibrate import sent_bytes
    from pxform.search import pin_of
    from pxform.search.blockcost import RELAYOUT_GAP_S

    measuring = False
    hw = harness.profile_or_calibrated(profile, "cpu-x2")
    timed: list[float] = []
    # (kind, bytes of the input on this rank) -> seconds of each such collective
    by_kind: dict[tuple[str, int], list[float]] = {}
    # "after compute" (more than `RELAYOUT_GAP_S` since the collective before ended) or
    # "after a collective" -> each one's seconds beyond its comm table's transfer
    by_gap: dict[str, list[float]] = {"after compute": [], "after a collective": []}
    last_end = [0.0]
    run_step = collectives._run_step

    def timed_step(x: Any, step: Any, axes: Any, wait: bool = True) -> Any:
        start = time.perf_counter()
        out = run_step(x, step, axes, wait)
        if step.kind not in LOCAL:
            end = time.perf_counter()
            took = end - start
            timed.append(took)
            if measuring:
                nbytes = x.numel() * x.element_size()
                by_kind.setdefault((step.kind, nbytes), []).append(took)
                n = axes.sizes[step.axis]
                table = hw.comm_time(step.kind, sent_bytes(step.kind, float(nbytes), n), n, 0)
                after = ("after compute" if start - last_end[0] > RELAYOUT_GAP_S
                         else "after a collective")
                by_gap[after].append(took - table)
            last_end[0] = end
        return out

    collectives._run_step = timed_step
    params, batch, gpt_loss = _gpt_case()
    variants = _variants(hw)
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
        by_kind.clear()
        for ts in by_gap.values():
            ts.clear()
        measuring = True
        for _ in range(steps):
            dist.barrier()
            timed.clear()
            start = last_end[0] = time.perf_counter()
            run(dparams, batch)
            walls.append(time.perf_counter() - start)
            inside.append(sum(timed))
            counts.append(len(timed))
        measuring = False
        wall, comm = statistics.median(walls), statistics.median(inside)
        n = dist.get_world_size()
        # each kind and size of collective: per step, its median time against the comm
        # table's transfer (`sent_bytes`: the ring volume of its input)
        kinds = {f"{kind} {nbytes // 1024} KiB": (
            len(ts) // steps, round(statistics.median(ts) * 1e3, 2),
            round(statistics.mean(ts) * 1e3, 2),
            round(hw.comm_time(kind, sent_bytes(kind, float(nbytes), n), n, 0) * 1e3, 2))
            for (kind, nbytes), ts in sorted(by_kind.items())}
        # the same steps under torch's profiler: where the step's wall time is spent by
        # kind of torch op (self times, so nothing counts twice); what no op's self time
        # holds is Python (the runtime's, autograd functions') and waiting for the GIL
        dist.barrier()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                run(dparams, batch)
            profiled = (time.perf_counter() - start) / steps
        split = _profiled_split(prof.key_averages(), steps)
        out[name] = {
            "profiled ms: step, ops, collectives, glue, rest": (
                round(profiled * 1e3, 1), *(round(split[k] * 1e3, 1) for k in
                                            ("ops", "collectives", "glue")),
                round((profiled - sum(split.values())) * 1e3, 1)),
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
            "collectives per step": max(counts),
            "per kind and size: count per step, median ms, mean ms, comm table ms": kinds,
            "beyond the comm table, by what came before: count per step, median ms, "
            "mean ms": {k: (len(ts) // steps, round(statistics.median(ts) * 1e3, 2),
                            round(statistics.mean(ts) * 1e3, 2))
                        for k, ts in by_gap.items() if ts}}
    return out


COLLECTIVE_OPS = ("c10d::", "_c10d_functional::", "c10d_functional::")


def _profiled_split(events: Any, steps: int) -> dict[str, float]:
    """Seconds per step of profiled self time: `ops` (aten ops: what the model's compute
    prices), `collectives` (the collectives' ops, their waits included) and `glue`
    (everything else a profiler event holds: autograd functions such as the conversions',
    tensor-subclass dispatch)."""
    split = {"ops": 0.0, "collectives": 0.0, "glue": 0.0}
    for e in events:
        if e.key.startswith(COLLECTIVE_OPS):
            kind = "collectives"
        elif e.key.startswith("aten::"):
            kind = "ops"
        else:
            kind = "glue"
        split[kind] += e.self_cpu_time_total / 1e6 / steps
    return split


def _gpt_case() -> tuple[Any, Any, Any]:
    """The example GPT "small", its parameters, a batch (16 sequences, or `--batch`'s
    count, passed to the ranks as `PXFORM_BREAKDOWN_BATCH`) and its loss."""
    import gpt
    import torch

    cfg = gpt.GPT_CONFIGS["small"]

    def gpt_loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    return (gpt.init_params(cfg, dtype=torch.float32),
            gpt.make_batch(cfg, int(os.environ.get("PXFORM_BREAKDOWN_BATCH", "16"))), gpt_loss)


def _variants(hw: Any) -> dict[str, Any]:
    """`hw` priced three ways (module doc): `nocomm` (comm tables at ~0, no per-collective
    cost, no waits), `transfer` (with the comm tables), `overhead` (and the per-collective
    cost; the plan's own prediction adds the waits)."""
    free = tuple(dataclasses.replace(t, points=tuple((b, 1e-9) for b, _ in t.points))
                 for t in hw.comm_tables)
    return {"nocomm": dataclasses.replace(hw, sync_wait=(), collective_overhead_s=0.0,
                                          comm_tables=free),
            "transfer": dataclasses.replace(hw, sync_wait=(), collective_overhead_s=0.0),
            "overhead": dataclasses.replace(hw, sync_wait=())}


def fake_main(cases: list[str], profile: str, steps: int) -> dict[str, Any]:
    """In this process, rank 0 of a fake 2-rank process group (torch's `fake_pg`: every
    collective returns at once, moving nothing): each case's step is its compute and the
    runtime's host work alone, against the model's compute (`nocomm`) plus its
    per-collective cost (`overhead` less `transfer`). The steps of all cases run in turn,
    `steps` rounds, medians."""
    for sub in ("benchmarks", "examples", ""):
        sys.path.insert(0, os.path.join(ROOT, sub))
    import accuracy
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import pxform
    from pxform.cost.hardware import hardware
    from pxform.search import pin_of

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    hw = hardware(profile)
    params, batch, gpt_loss = _gpt_case()
    variants = _variants(hw)
    # compute, and compute with the per-collective cost (no transfers, no waits)
    nocomm = variants["nocomm"]
    overhead = dataclasses.replace(variants["nocomm"],
                                   collective_overhead_s=hw.collective_overhead_s)
    pins = dict(accuracy.cases(2, 6))
    calls, modelled = {}, {}
    for name in cases:
        plan = pxform.auto(gpt_loss, mesh=2, hardware=hw, plan=pins[name]).plan(params, batch)
        priced = [pxform.auto(gpt_loss, mesh=pxform.Mesh.abstract(2), hardware=h,
                              plan=pin_of(plan)).plan(params, batch).step_time_s
                  for h in (nocomm, overhead)]
        step = pxform.auto(gpt_loss, mesh=2, hardware=hw, plan=pins[name])
        dparams, _ = step.distribute(params, batch)
        run = pxform.value_and_grad(step)
        calls[name] = (lambda run=run, dparams=dparams: run(dparams, batch))
        modelled[name] = priced
    for call in calls.values():
        call()
        call()
    walls: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(steps):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            walls[name].append(time.perf_counter() - start)
    dist.destroy_process_group()
    return {name: {"measured ms": round(statistics.median(walls[name]) * 1e3, 1),
                   "model compute ms": round(modelled[name][0] * 1e3, 1),
                   "model compute + per-collective cost ms": round(modelled[name][1] * 1e3, 1)}
            for name in cases}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="dp,zero3,tp,tp+recompute,sp",
                   help="names of benchmarks/accuracy.py's cases, comma-separated")
    p.add_argument("--profile", help="a saved pxform profile (JSON); default: calibrate")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (global)")
    p.add_argument("--fake", action="store_true",
                   help="one process on a fake process group (no communication): compute and "
                        "host work alone, against the model's (needs --profile)")
    args = p.parse_args()
    # read by `_gpt_case` here and on the spawned ranks (they inherit the environment)
    os.environ["PXFORM_BREAKDOWN_BATCH"] = str(args.batch)
    if args.fake:
        if not args.profile:
            p.error("--fake needs --profile (a saved profile of the machine)")
        for name, row in fake_main(args.cases.split(","), args.profile, args.steps).items():
            print(f"fake {name}: {row}")
        return
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
