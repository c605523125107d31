"""Pipeline schedules on gloo: measured step time and bubble against the simulator.

`--ranks` processes (one torch thread each) train the example GPT as
`pxform.pipeline(loss, stages=ranks, microbatches=M, schedule=S)` for each schedule (GPipe,
1F1B, interleaved with 2 virtual stages per rank, ZB-H1, Merak's shifted schedule with its
early recompute). Every action's wall-clock start
and end is recorded on every rank (`pxform.runtime.pipeline.recording`). From those:

    costs      per stage, the mean time of its F, B, W and R actions over the timed steps,
               F and B with the mean time of the sends after them and the mean time of
               the receives before them that began after their send was posted (the
               executor's transfer actions hold their rank too, and such a receive still
               waits for data in flight)
    predicted  `pxform.schedules.simulate(schedule, costs)`, a transfer's latency the mean
               over the receives that began before their send was posted of the time
               from the send action's end to the receive's end
    measured   the span of the actions of one step (first start to last end, all ranks),
               and the whole step as the caller sees it (slicing the batch, counting
               targets, the final gradient reduction and output broadcast included)
    bubble     1 - busy compute time / (ranks x span), measured and simulated

Reported per schedule: the ratios measured span / predicted step time (goal: within 10%)
and measured / simulated bubble, plus a timeline picture of the measured run
(`benchmarks/results/pipeline-<schedule>.png`) beside the simulated one.

With `--posting N` it also times each schedule's step N times with the executor's
receives posted ahead of their actions (the default on gloo,
`pxform.runtime.pipeline._posted_ahead`) and N times posted at their actions (as before
2026-11-27), alternately, and reports the slowest rank's median of each and their ratio.

    python benchmarks/pipeline.py                 # GPT "small", 2 ranks, batch 16, 8 microbatches
    python benchmarks/pipeline.py --quick         # a few seconds, smoke run
    python benchmarks/pipeline.py --posting 40    # + receives posted ahead against at the action
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

SCHEDULES = [("gpipe", {}), ("1f1b", {}), ("interleaved", {"virtual_stages": 2}), ("zb", {}),
             ("shifted", {})]


def rank_main(cfg_name: str, batch_size: int, microbatches: int, reps: int,
              warmup: int, posting: int = 0) -> dict[str, Any]:
    harness.add_paths()
    import torch.distributed as dist

    import pxform
    import pxform.runtime.pipeline as executor

    ranks = dist.get_world_size()
    cfg, params, batch, _, loss = harness.gpt_case(cfg_name, batch_size)
    ref_loss, _ = pxform.value_and_grad(loss)(params, batch)
    out: dict[str, Any] = {}
    for name, options in SCHEDULES:
        step = pxform.value_and_grad(pxform.pipeline(
            loss, stages=ranks, microbatches=microbatches, schedule=name, **options))
        for _ in range(warmup):
            value, _ = step(params, batch)
        assert abs(float(value) - float(ref_loss)) < 1e-4, (name, float(value), float(ref_loss))
        steps, events = harness.recorded_steps(functools.partial(step, params, batch), reps)
        posted: dict[str, list[float]] = {"ahead": [], "at_action": []}
        ahead = executor._posted_ahead
        try:
            for _ in range(posting):  # the two alternately: a drift falls on both
                for key, rule in (("ahead", ahead), ("at_action", lambda place: False)):
                    executor._posted_ahead = rule
                    dist.barrier()
                    start = time.perf_counter()
                    step(params, batch)
                    posted[key].append(time.perf_counter() - start)
        finally:
            executor._posted_ahead = ahead
        gathered: list[Any] = [None] * ranks
        dist.all_gather_object(gathered, {"steps": steps, "events": [
            [(str(a), s, e) for a, s, e in rec] for rec in events], "posting": posted})
        out[name] = gathered
    return out


def analyse(name: str, options: dict[str, Any], per_rank: list[dict[str, Any]], ranks: int,
            microbatches: int, picture: str | None) -> dict[str, Any]:
    from pxform import schedules
    from pxform.schedules import Action, Costs, Event, Timeline

    reps = len(per_rank[0]["steps"])
    compute = schedules.resolve(name, ranks, microbatches, **options)
    num_stages = 1 + max(a.stage for acts in compute.values() for a in acts if a is not None)
    durations: dict[tuple[int, str], list[float]] = {}
    late: dict[tuple[int, str], list[float]] = {}
    spans, bubbles, whole, hops = [], [], [], []
    for rep in range(reps):
        events = []
        for rank, data in enumerate(per_rank):
            for text, s, e in data["events"][rep]:
                a = Action.parse(text)
                events.append(Event(rank, a, s, e))
                durations.setdefault((a.stage, a.kind), []).append(e - s)
        early, after = _receives(events)
        hops += early
        for key, seconds in after.items():
            late.setdefault(key, []).extend(seconds)
        t0 = min(ev.start for ev in events)
        span = max(ev.end for ev in events) - t0
        busy = sum(ev.end - ev.start for ev in events if ev.action.is_compute)
        spans.append(span)
        bubbles.append(1 - busy / (ranks * span))
        whole.append(max(data["steps"][rep] for data in per_rank))
        if rep == reps - 1 and picture:
            shifted = tuple(Event(ev.rank, ev.action, ev.start - t0, ev.end - t0)
                            for ev in events if ev.action.is_compute)
            per = [sum(ev.end - ev.start for ev in shifted if ev.rank == r)
                   for r in range(ranks)]
            measured = Timeline(shifted, span, 1 - busy / (ranks * span), {}, tuple(per), ranks)
            schedules.plot(measured, picture, title=f"{name}: measured on gloo")

    def med(stage: int, kind: str) -> float:
        # the mean, not the median: a step is a sum of actions, and their times skew
        # long (the other rank's work on the shared cores and memory)
        got = durations.get((stage, kind))
        return statistics.fmean(got) if got else 0.0

    def received(stage: int, kind: str) -> float:
        # a receive's own time where its send had been posted: their mean, as for the
        # actions (a step is their sum). Until the thirty-ninth session (2026-12-01) the
        # lower quartile of all of a stage's receives, as if such a receive never waited;
        # but the data can still be in flight then (the sending rank's communication
        # thread behind its compute on shared cores): on that day's host a quarter of
        # interleaved's such receives waited past twice the quartile, 8 ms a rank and
        # step, and interleaved came out 1.11-1.20x its simulation. Replayed in its
        # recorded action order, each receive charged its whole time, that run's spans
        # came back at 0.996-0.999; with this mean its five schedules came out at
        # 0.96-1.00 (interleaved 1.16 with the quartile).
        # (none such: each of the stage's receives waited for its send, and its hop, to
        # the receive's end, holds all of its time)
        got = late.get((stage, kind))
        return statistics.fmean(got) if got else 0.0

    # a transfer's latency (the simulator's `p2p`: a receive blocks its rank until the
    # send's time plus it): from the end of the send action (the `isend` posted) to the end
    # of its receive, over the receives that were waiting before the send was posted, their
    # mean (the step is a sum of the hops on its critical path). It has a long tail here:
    # 2026-11-27, interleaved, quartiles 0.13 / 0.22 / 1.2 ms, p90 3.4 ms (the receiving
    # rank's communication thread woken behind its compute). Until then it was the lower
    # quartile of all receive times (0.13 ms), and interleaved, whose critical path crosses
    # ranks most, came out 1.10-1.15x its simulation in every run.
    recv = sorted(e - s for data in per_rank for rec in data["events"] for text, s, e in rec
                  if "RF" in text or "RB" in text)
    p2p = statistics.fmean(hops) if hops else (recv[len(recv) // 4] if recv else 0.0)
    # the executor's own transfer actions keep their rank busy too: a send's host time
    # (mean) after the action that made its tensor, and a receive's whose send had been
    # posted (`received`) before the action that reads it
    costs = Costs(forward=[med(s, "F") + med(s, "SF") + received(s, "RF")
                           for s in range(num_stages)],
                  backward=[med(s, "B") + med(s, "SB") + received(s, "RB")
                            for s in range(num_stages)],
                  weight=[med(s, "W") for s in range(num_stages)],
                  recompute=[med(s, "R") for s in range(num_stages)], p2p=p2p)
    predicted = schedules.simulate(compute, costs)
    # the cost model's transfers (`Hardware.receive_stall_s`, `transfer_overhead_s`): a
    # stall on every receiving action and a delay on the waits instead of the measured
    # latency, their size fitted on 1F1B's span (`_with_stall`)
    plain = dataclasses.replace(costs, p2p=0.0)
    if picture:
        schedules.plot(predicted, picture.replace(".png", "-simulated.png"),
                       title=f"{name}: simulated from measured action times")
    span = statistics.median(spans)
    bubble = statistics.median(bubbles)
    return {"span_s": span, "step_s": statistics.median(whole),
            "predicted_s": predicted.step_time, "span_over_predicted": span / predicted.step_time,
            "step_over_predicted": statistics.median(whole) / predicted.step_time,
            "bubble": bubble, "predicted_bubble": predicted.bubble_fraction,
            "p2p_ms": 1e3 * p2p,
            # (for `main`'s stall column; dropped before the JSON is written)
            "_compute": compute, "_plain": plain, "_stages": num_stages,
            # the costs are tuples (per stage) or one number: milliseconds either way
            "costs_ms": {k: [round(1e3 * x, 3) for x in v] if isinstance(v, (list, tuple))
                         else round(1e3 * v, 3)
                         for k, v in (("F", costs.forward), ("B", costs.backward),
                                      ("W", costs.weight))}}


def _with_stall(rows: dict[str, dict[str, Any]]) -> tuple[float, float]:
    """The transfers as the cost model prices them (`Hardware.receive_stall_s` and
    `transfer_overhead_s`: one cost per transfer, `runtime_costs.transfer_costs` splits it
    into a stall on every receiving action and a delay where that action waits for its
    input, the simulator's `p2p`): the cost per transfer at which 1F1B's simulation gives
    its measured span (`runtime_costs.fit_to_call`), then every schedule simulated with it
    (a held-out check for the others: the cost was not fitted on them). Sets each row's
    `stall_predicted_s` and `span_over_stall_predicted`, drops the row's working objects;
    returns (the stall, the delay).

    Until the twenty-eighth session (2026-11-30) the whole cost was a stall on every
    receiving action, as the cost model priced transfers until the twenty-seventh; its
    split into a stall and a delay (`docs/search.md`) had not reached this column."""
    from pxform import schedules
    from pxform.search.pipelines import ScheduleChoice
    from pxform.tools.runtime_costs import fit_to_call, transfer_costs

    def simulated(r: dict[str, Any], name: str, level: float) -> float:
        plain, stages, compute = r["_plain"], r["_stages"], r["_compute"]
        stall, delay = transfer_costs(level)
        # a forward receives unless its stage is the first, a backward unless the last or
        # its stage recomputes early (the shifted schedule: the gradient moves while its R
        # runs; `pxform.search.stages.assemble`)
        redo = [ScheduleChoice(name).recomputes(s, stages) for s in range(stages)]
        return schedules.simulate(compute, dataclasses.replace(
            plain,
            forward=[plain.at("forward", s, stages) + (stall if s > 0 else 0.0)
                     for s in range(stages)],
            backward=[plain.at("backward", s, stages)
                      + (stall if s < stages - 1 and not redo[s] else 0.0)
                      for s in range(stages)],
            p2p=delay)).step_time

    base = rows["1f1b"]
    level = fit_to_call(lambda c: simulated(base, "1f1b", c), base["span_s"], tolerance=1e-9)
    stall, delay = transfer_costs(level)
    for name, r in rows.items():
        sim = simulated(r, name, level)
        for key in ("_plain", "_stages", "_compute"):
            r.pop(key)
        r["stall_predicted_s"] = sim
        r["span_over_stall_predicted"] = r["span_s"] / sim
        r["stall_ms"] = 1e3 * stall
        r["delay_ms"] = 1e3 * delay
    return stall, delay


def _receives(events: list[Any]) -> tuple[list[float], dict[tuple[int, str], list[float]]]:
    """Over one step's `Event`s: (seconds from each send action's end to its receive's
    end, for the receives that began before their send ended, so waited for it to be
    posted; per (stage, kind) the seconds of the other receives, those that began after
    their send was posted: their own cost and any wait for data still in flight)."""
    sent = {(ev.action.kind, ev.action.stage, ev.action.microbatch): ev.end for ev in events
            if ev.action.kind in ("SF", "SB")}
    hops: list[float] = []
    after: dict[tuple[int, str], list[float]] = {}
    for ev in events:
        a = ev.action
        if a.kind not in ("RF", "RB"):
            continue
        key = ("SF", a.stage - 1, a.microbatch) if a.kind == "RF" else \
            ("SB", a.stage + 1, a.microbatch)
        if key in sent and ev.start < sent[key]:
            # the send action ends once its `isend` is posted, which can come after the
            # data has landed: no latency then, not a negative one
            hops.append(max(0.0, ev.end - sent[key]))
        else:
            after.setdefault((a.stage, a.kind), []).append(ev.end - ev.start)
    return hops, after


def main() -> None:
    p = harness.parser(__doc__, batch=16, reps=15, steps=1, ranks=True)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--posting", type=int, default=0,
                   help="also time each step this many times with receives posted ahead "
                        "and as many posted at their actions (module doc)")
    args = harness.parse(p)
    from pxform.tools.testing import World

    reps = 2 if args.quick else args.reps
    harness.pin_malloc(args)  # --malloc pinned
    with World(args.ranks) as world:
        results = world.run(rank_main, args.config, args.batch, args.microbatches, reps,
                            1 if args.quick else args.warmup, args.posting)[0]
    rows = {}
    for name, options in SCHEDULES:
        # (matplotlib is the `plot` extra: without it the figures come, the pictures not)
        picture = None if args.quick or importlib.util.find_spec("matplotlib") is None \
            else os.path.join(harness.RESULTS, f"pipeline-{name}.png")
        rows[name] = analyse(name, options, results[name], args.ranks, args.microbatches,
                             picture)
        if args.posting:
            # per variant the slowest rank's median step
            med = {k: max(statistics.median(r["posting"][k]) for r in results[name])
                   for k in ("ahead", "at_action")}
            rows[name]["posting"] = {"ahead_s": med["ahead"], "at_action_s": med["at_action"],
                                     "ahead_over_at_action": med["ahead"] / med["at_action"],
                                     "calls": args.posting}
    stall, delay = _with_stall(rows)
    print(f"GPT {args.config}, {args.ranks} gloo ranks, batch {args.batch}, "
          f"{args.microbatches} microbatches, {reps} timed steps per schedule")
    print(f"{'schedule':12} {'span ms':>8} {'sim ms':>8} {'span/sim':>9} {'step/sim':>9} "
          f"{'bubble':>7} {'sim bubble':>10} {'span/model sim':>15}")
    for name, r in rows.items():
        print(f"{name:12} {1e3 * r['span_s']:8.1f} {1e3 * r['predicted_s']:8.1f} "
              f"{r['span_over_predicted']:9.3f} {r['step_over_predicted']:9.3f} "
              f"{r['bubble']:7.3f} {r['predicted_bubble']:10.3f} "
              f"{r['span_over_stall_predicted']:15.3f}")
    print(f"sim: a latency per hop measured on each schedule's own run; model sim: "
          f"transfers as the cost model prices them, a stall of {1e3 * stall:.2f} ms on "
          f"every receiving action and a delay of {1e3 * delay:.2f} ms where it waits for "
          f"its input (`Hardware.receive_stall_s`, `transfer_overhead_s`), their sum "
          f"fitted on 1F1B's span alone")
    if args.posting:
        print(f"\nreceives posted ahead of their actions against at them, {args.posting} "
              f"steps each, alternately (slowest rank's median)")
        print(f"{'schedule':12} {'ahead ms':>9} {'at action ms':>13} {'ratio':>7}")
        for name, r in rows.items():
            q = r["posting"]
            print(f"{name:12} {1e3 * q['ahead_s']:9.1f} {1e3 * q['at_action_s']:13.1f} "
                  f"{q['ahead_over_at_action']:7.3f}")
    if not args.quick:
        harness.write_result("pipeline", {"config": args.config, "ranks": args.ranks,
                                          "batch": args.batch,
                                          "microbatches": args.microbatches,
                                          "schedules": rows}, args.out)


if __name__ == "__main__":
    main()
