"""The search: a traced graph -> the best `Plan` within a memory budget (`search`).

`search` is deterministic: the same graph, hardware and settings give the same plan.

Example:
    >>> plan = search(graph, {"batch.x"}, devices=8, budget=40 * 2**30,
    ...               hardware=pxform.hardware.hardware("a100-40gb"))
    >>> print(plan.explain())
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import Counter
from collections.abc import Callable, Collection, Sequence

from pxform.core.errors import PxformError
from pxform.core.ir import Graph
from pxform.core.layout import Layout
from pxform.core.spec import P
from pxform.core.units import format_bytes
from pxform.cost.hardware import Hardware
from pxform.cost.model import CostModel
from pxform.ops.strategy import choice_text
from pxform.schedules import Costs, resolve, simulate
from pxform.search.analysis import Analysis, BlockInfo, analyse
from pxform.search.context import Pin, SearchContext, tensor_choice_key
from pxform.search.options import block_strategies, canonical, param_layouts, walk_cost
from pxform.search.partition import pareto, search_configs
from pxform.search.pipelines import NAMES, ScheduleChoice
from pxform.search.plan import BlockPlan, FrontierPoint, Plan, StagePlan
from pxform.search.space import Config, Option, configs
from pxform.search.stages import Candidate, after_schedule, step_fixed

OBJECTIVES = ("time", "memory", "devices")


class SearchError(PxformError):
    """No plan satisfies the budget and constraints."""


def search(graph: Graph, batch_inputs: set[str], *, devices: int, budget: int,
           hardware: Hardware, objective: str = "time", global_batch: int | None = None,
           batch_range: tuple[int, int] | None = None, pin: Pin | None = None,
           batch_dim: int = 0, optimizer: str = "adam", fn: str = "auto",
           function: str | None = None,
           progress: Callable[[int, int], None] | None = None, margin: float = 0.0,
           tolerance: float = 0.0, trainable: Collection[str] | None = None) -> Plan:
    """The best plan for `graph` on `devices` devices of `hardware` within `budget` bytes
    per device (module doc).

    Args:
        batch_inputs: names of the graph inputs carrying the batch (dim `batch_dim`).
        objective: "time" (fastest within the budget), "memory" (least memory),
            "devices" (fewest devices, powers of two up to `devices`, that fit).
        global_batch: the batch size to plan for (default: the traced one).
        batch_range: (low, high): also search the batch size, powers of two times `low`
            up to `high`, for the most samples per second.
        pin: choices fixed in advance (a plan passed back, or user constraints).
        fn: how messages name the caller ("auto(loss_fn)"); function: the plan's name
            for the user's function (default `fn`).
        margin: a safety margin, a fraction of `budget`: plans must fit `budget x (1 -
            margin)` (the plan's `notes` say so). The plan's `headroom_bytes` is what is
            left of the whole budget at its predicted peak.
        tolerance: objective "time": configurations predicted within this fraction of
            the fastest count as tied, and the simplest is taken (fewer stages, then
            fewer microbatches: `partition.simplicity`); the plan's notes name the faster
            one it passed over. 0: always the fastest.
        trainable: names of the graph inputs the step differentiates (None: every
            floating input that is not the batch). The others are frozen parameters:
            held, but without gradients, optimizer state, gradient reductions or weight
            gradients, and ops that nothing trained flows into run no backward (the
            plan's notes count them).

    Raises:
        SearchError: nothing fits; the message states the least memory per device any
            plan needs and a device count that fits the budget.
    """
    if objective not in OBJECTIVES:
        raise SearchError(f"pxform.{fn}: objective={objective!r}; use one of {OBJECTIVES}.")
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or \
            not 0 <= margin < 1:
        raise SearchError(f"pxform.{fn}: memory_margin={margin!r}; give a fraction of the "
                          f"budget in [0, 1), e.g. 0.05 to plan within 95 % of it.")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or \
            not 0 <= tolerance < 1:
        raise SearchError(f"pxform.{fn}: tolerance={tolerance!r}; give a fraction in [0, 1), "
                          f"e.g. 0.05 to take the simplest plan within 5 % of the fastest.")
    usable = float(budget) * (1.0 - margin)
    analysis = analyse(graph, batch_inputs, batch_dim, fn, trainable)
    model = CostModel(hardware, optimizer)
    pin = pin or Pin()
    for name, what in (("block_options", "block options"), ("block_stage", "block stages")):
        given = getattr(pin, name)
        if given is not None and len(given) != len(analysis.blocks):
            raise SearchError(
                f"pxform.{fn}: the pin gives {len(given)} {what} but the "
                f"function has {len(analysis.blocks)} blocks "
                f"({', '.join(b.label for b in analysis.blocks[:4])}"
                f"{', ...' if len(analysis.blocks) > 4 else ''}).\n  Fix: give one per "
                f"block, or pin a plan searched for these arguments.")
    _check_schedule(pin, analysis, fn)
    traced = analysis.traced_batch
    batches = [global_batch or traced]
    if batch_range is not None:
        lo, hi = batch_range
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise SearchError(f"pxform.{fn}: batch_range={batch_range!r}; give (low, high) "
                              f"with 1 <= low <= high.")
        batches = []
        b = lo
        while b <= hi:
            batches.append(b)
            b *= 2
    counts = [devices]
    if objective == "devices":
        counts = sorted({*powers_of_two_upto(devices), devices})
    best: tuple[Candidate, SearchContext, list[Candidate], float] | None = None
    for n in counts:
        for batch in batches:
            ctx = SearchContext(analysis, model, usable, batch, pin)
            cands = _configs(analysis, n, hardware, batch, pin, fn)
            goal = "memory" if objective == "memory" else "time"
            cand, found, secs = search_configs(ctx, cands, goal, progress,
                                               tolerance=tolerance)
            if cand is None:
                continue
            if best is None or _better(cand, best[0], objective, batch_range is not None):
                best = (cand, ctx, found, secs)
        if best is not None and objective == "devices":
            break
    if best is None:
        raise _infeasible(analysis, model, devices, budget, batches[0], pin, hardware, fn,
                          margin)
    cand, ctx, found, secs = best
    plan = _make_plan(cand, ctx, found, secs, function or fn, hardware, budget, objective)
    # (a faster schedule of the chosen configuration lost to `SCHEDULE_GAIN`, not here)
    fastest = min((c for c in found if c.config != cand.config), key=lambda c: c.step_time,
                  default=cand)
    if objective == "time" and fastest.step_time < cand.step_time:
        plan = dataclasses.replace(plan, notes=(*plan.notes, (
            f"taken over the fastest plan found, {_config_text(fastest)} at "
            f"{fastest.step_time:.4g} s ({1 - fastest.step_time / cand.step_time:.1%} "
            f"faster): within tolerance={tolerance:g} of it the simplest plan wins (fewer "
            f"pipeline stages, then fewer microbatches, then fewer tensor-parallel "
            f"blocks), the model's error being larger than that gain; pass tolerance=0 "
            f"for the fastest")))
    frozen = sorted(analysis.params - analysis.trainable)
    if frozen:
        vals = analysis.values()
        plan = dataclasses.replace(plan, notes=(*plan.notes, (
            f"{len(frozen)} of {len(analysis.params)} parameters frozen "
            f"({format_bytes(sum(vals[n].type.nbytes for n in frozen))}: "
            f"{', '.join(frozen[:3])}{', ...' if len(frozen) > 3 else ''}): held without "
            f"gradients or optimizer state, and planned so")))
    if margin:
        plan = dataclasses.replace(plan, notes=(
            f"memory margin {margin:.0%}: searched within {format_bytes(int(usable))} of the "
            f"{format_bytes(budget)} budget (the memory model's error on measured plans is "
            f"within about 5-10 %: docs/benchmarks/accuracy.md)", *plan.notes))
    if hardware.calibrations:
        plan = _priced_by_calibrations(plan, analysis, hardware, optimizer, fn)
    return plan


def _priced_by_calibrations(plan: Plan, analysis: Analysis, hardware: Hardware,
                            optimizer: str, fn: str) -> Plan:
    """`plan` with its step priced under each of `hardware.calibrations` (its choices
    pinned): `step_time_s` their median, `calibration_step_times_s` each.

    One calibration prices a plan a few points off another's minutes apart on a shared
    machine (its op time scale, per-collective cost and waits each caught in a different
    spell); the median of several prices moves less than any one calibration's, the
    representative's included, which is kept for the choice (the search compares plans
    under one set of numbers) and for the per-block and per-stage figures."""
    pin = pin_of(plan)
    prices: list[float] = []
    for member in hardware.calibrations:
        ctx = SearchContext(analysis, CostModel(member, optimizer), float(plan.memory_budget),
                            plan.global_batch, pin)
        cands = _configs(analysis, plan.devices, member, plan.global_batch, pin, fn)
        cand, _, _ = search_configs(ctx, cands, "time")
        if cand is None:  # (memory is priced alike under every calibration of a machine)
            raise SearchError(
                f"pxform.{fn}: the plan found ({plan.config_text()}) does not fit its "
                f"{format_bytes(plan.memory_budget)} budget under calibration "
                f"{len(prices) + 1} of the profile's {len(hardware.calibrations)}.\n  Fix: "
                f"give calibrations of one machine only (Hardware.calibrations), or a "
                f"profile of one calibration.")
        prices.append(_simulated_step(cand, step_fixed(member, cand.config)))
    step = statistics.median(prices)
    return dataclasses.replace(plan, step_time_s=step, calibration_step_times_s=tuple(prices),
                               notes=(*plan.notes, (
                                   f"predicted step {step:.4g} s: the median of the plan's "
                                   f"prices under the profile's {len(prices)} calibrations "
                                   f"({min(prices):.4g}-{max(prices):.4g} s); the stage and "
                                   f"block times are the representative calibration's "
                                   f"(hardware {hardware.name!r}), which chose the plan")))


def _check_schedule(pin: Pin, a: Analysis, fn: str) -> None:
    """A pinned schedule the search can price (`pxform.search.pipelines`), with enough
    blocks for its stages, and without pinned recompute where it takes none."""
    choice = pin.schedule
    if choice is None:
        return
    num_blocks = len(a.blocks)
    if not isinstance(choice, ScheduleChoice) or choice.name not in NAMES or \
            not isinstance(choice.virtual_stages, int) or choice.virtual_stages < 1 or \
            (choice.virtual_stages > 1) != (choice.name == "interleaved"):
        raise SearchError(
            f"pxform.{fn}: the pinned schedule {choice!r} is not one the search prices: "
            f"ScheduleChoice(name, virtual_stages) with name one of {NAMES}, and "
            f"virtual_stages > 1 for 'interleaved' only.\n  Fix: pin e.g. "
            f"ScheduleChoice('zb') or ScheduleChoice('interleaved', 2); run other schedules "
            f"with pxform.pipeline(..., schedule=...).")
    if pin.stages is not None and pin.stages * choice.virtual_stages > num_blocks:
        raise SearchError(
            f"pxform.{fn}: the pinned schedule {choice.text()} on {pin.stages} pipeline "
            f"ranks needs {pin.stages * choice.virtual_stages} stages, but the function has "
            f"{num_blocks} blocks (a stage holds at least one).\n  Fix: pin fewer stages or "
            f"virtual stages, or leave the schedule to the search.")
    redone = [b.label for b, o in zip(a.blocks, pin.block_options or ())
              if o is not None and o.recompute]
    if choice.split and redone:
        raise SearchError(
            f"pxform.{fn}: the pin recomputes {len(redone)} block(s) ({', '.join(redone[:4])}"
            f"{', ...' if len(redone) > 4 else ''}) under the zero-bubble schedule 'zb', "
            f"which takes no recompute: its W actions ask for each weight gradient apart, "
            f"and torch's checkpoint runs a recomputed block's forward again for each of them "
            f"as well as for B, and keeps what B recomputed until the W (GPT small on 2 "
            f"ranks: 1.8x the memory and 3.7x the step of 'zb' without recompute).\n  Fix: "
            f"pin ScheduleChoice('1f1b') or ScheduleChoice('shifted') (stage-aware recompute) "
            f"to save memory by recomputing, or block options without recompute for 'zb'.")


def powers_of_two_upto(n: int) -> list[int]:
    out, k = [], 1
    while k <= n:
        out.append(k)
        k *= 2
    return out


def _better(a: Candidate, b: Candidate, objective: str, per_sample: bool) -> bool:
    if objective == "memory":
        return (a.peak_memory, a.step_time) < (b.peak_memory, b.step_time)
    if objective == "devices" and a.config.devices != b.config.devices:
        return a.config.devices < b.config.devices
    if per_sample:
        ta = a.step_time / a.batch
        tb = b.step_time / b.batch
        return ta < tb
    return a.step_time < b.step_time


def _configs(a: Analysis, devices: int, hw: Hardware, batch: int, pin: Pin, fn: str
             ) -> list[Config]:
    stages = pin.stages
    if a.marked:
        marked = len(a.marked) + 1
        if stages is not None and stages != marked:
            raise SearchError(
                f"pxform.{fn}: the function marks {marked} pipeline stages with "
                f"pxform.stage_boundary, but the pinned plan has stages={stages}.\n  Fix: "
                f"remove the markers or pin stages={marked}.")
        stages = marked
    if stages is not None and devices % stages:
        raise SearchError(f"pxform.{fn}: {stages} pipeline stages do not divide {devices} "
                          f"devices.\n  Fix: use a device count that is a multiple of "
                          f"{stages}.")
    if a.whole_batch is not None and ((stages or 1) > 1 or (pin.microbatches or 1) > 1):
        raise SearchError(
            f"pxform.{fn}: a pipeline cuts the batch into microbatches, but this function "
            f"needs the whole batch at once: {a.whole_batch}.\n  Fix: compute that value "
            f"per example (masks from each row's own data), or plan without a pipeline "
            f"(no stage_boundary markers, stages and microbatches 1).")
    out = configs(devices, hw.devices_per_node, len(a.blocks), batch, stages,
                  pin.microbatches, microbatching=a.whole_batch is None)
    if pin.outer is not None:
        out = [c for c in out if c.outer == pin.outer]
    if pin.inner is not None:
        out = [c for c in out if c.inner == pin.inner]
    return out


def _infeasible(a: Analysis, model: CostModel, devices: int, budget: int, batch: int,
                pin: Pin, hw: Hardware, fn: str, margin: float = 0.0) -> SearchError:
    """The error for a budget nothing fits: the least memory any plan needs here, and the
    smallest device count (doubling, up to 64x) whose best plan fits. With a safety
    `margin`, plans must fit `budget x (1 - margin)`."""
    usable = budget * (1.0 - margin)
    ctx = SearchContext(a, model, math.inf, batch, pin)
    cands = _configs(a, devices, hw, batch, pin, fn)
    least, _, _ = search_configs(ctx, cands, "memory")
    if least is None:
        pinned = ", ".join(f"{f}={getattr(pin, f)}" for f in ("stages", "outer", "inner",
                                                                 "microbatches")
                           if getattr(pin, f) is not None)
        return SearchError(
            f"pxform.{fn}: no plan exists on {devices} devices ({hw.name}) for global batch "
            f"{batch} at any memory budget: every configuration leaves some block without a "
            f"valid option (a microbatch's samples must split evenly over the data-parallel "
            f"axes, and pinned per-block options must exist on the configuration's mesh)"
            f"{'; pinned: ' + pinned if pinned else ''}.\n  Fix: pin fewer choices, or use a "
            f"batch and microbatch count that the devices divide.")
    need = format_bytes(_round_up(least.peak_memory)) if least is not None else "unknown"
    fits = None
    n = devices * 2
    while n <= devices * 64 and least is not None:
        ctx = SearchContext(a, model, usable, batch, pin)
        cand, _, _ = search_configs(ctx, _configs(a, n, hw, batch, pin, fn), "memory",
                                    first_fit=True)
        if cand is not None:
            fits = n
            break
        n *= 2
    where = (f"{fits} devices fit it" if fits else
             f"no device count up to {devices * 64} fits it")
    kept = (f" ({format_bytes(budget)} less a {margin:.0%} safety margin, memory_margin=)"
            if margin else "")
    need_budget = (format_bytes(_round_up(least.peak_memory / (1.0 - margin)))
                   if least is not None else "unknown")
    return SearchError(
        f"pxform.{fn}: no plan fits {format_bytes(int(usable))} per device{kept} on "
        f"{devices} devices ({hw.name}) for global batch {batch}: the least memory any plan "
        f"needs there is {need} per device (with ZeRO-3, tensor parallelism and recompute "
        f"everywhere); {where}.\n  Fix: raise memory_budget (--memory on the command line) "
        f"to at least {need_budget}{', lower memory_margin' if margin else ''}, use more "
        f"devices, or a smaller batch.")


def _round_up(n: float) -> int:
    """`n` rounded up at its third significant digit of its binary unit, so that the
    printed minimum is never below what is needed (1.0004 GiB prints as 1.01 GiB)."""
    unit = 1
    while n >= 1024 * unit and unit < 2**40:
        unit *= 1024
    digits = 2 - int(math.floor(math.log10(max(n / unit, 1e-9))))
    step = unit / 10**digits
    return int(math.ceil(n / step) * step)


def _spec(layout: Layout) -> P:
    """The layout's spec with trailing whole dims dropped: `P('inner')`, `P()`."""
    entries = list(layout.to_spec().entries)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


def _op_texts(ctx: SearchContext, block: BlockInfo, config: Config, option: Option
              ) -> tuple[str, ...]:
    """Per op of `block`, "<data>/<tensor>": the choices `block_strategies` combines (the
    lowering rebuilds each op's strategy from them on its own mesh)."""
    a = ctx.analysis
    picks = ctx.tensor_picks(block.kind, config, option.sequence_parallel) \
        if option.tensor_axis else None
    out = []
    for k in range(block.start, block.stop):
        data = choice_text(a.data_strategies[k].choices[0][1])
        tensor = choice_text(picks[k - block.start].choices[0][1]) if picks else "-"
        out.append(f"{data}/{tensor}")
    return tuple(out)


def _make_plan(c: Candidate, ctx: SearchContext, found: Sequence[Candidate], secs: float, fn: str,
          hw: Hardware, budget: int, objective: str) -> Plan:
    a = ctx.analysis
    cfg = c.config
    blocks = tuple(BlockPlan(b.index, b.label, b.kind, c.block_stage[b.index],
                             c.options[b.index].roles, c.options[b.index].recompute,
                             c.block_time[b.index], c.block_memory[b.index], b.start, b.stop,
                             _op_texts(ctx, b, cfg, c.options[b.index]),
                             c.options[b.index].reshard)
                   for b in a.blocks)
    stages = tuple(StagePlan(s.stage, s.blocks, s.forward, s.backward, s.memory, s.in_flight,
                             s.param_bytes, s.weight, s.recompute, s.forward_sync,
                             s.backward_sync, s.transfer, s.step_extra) for s in c.stages)
    tensor: dict[int, tuple] = {}
    specs: dict[str, P] = {}
    mesh = cfg.stage_mesh
    for b in a.blocks:
        o = c.options[b.index]
        key = tensor_choice_key(b.kind, o.sequence_parallel)
        if o.tensor_axis and key not in tensor:
            picks = ctx.tensor_picks(b.kind, cfg, o.sequence_parallel)
            tensor[key] = tuple(_json_choice(s.choices[0][1]) for s in picks)
        strats = block_strategies(ctx, b, cfg, o)
        for name, lay in param_layouts(ctx, b, cfg, o, strats, mesh).items():
            specs.setdefault(name, _spec(lay))
    for v in a.graph.inputs:
        if v.name in a.params:
            specs.setdefault(v.name, P())
    batch: dict[str, P] = {}
    for b in a.blocks:
        for k in range(b.start, b.stop):
            for v in a.graph.ops[k].inputs:
                if v.name in a.batch_inputs and v.name not in batch:
                    batch[v.name] = _spec(canonical(ctx, v.name, v.type.rank,
                                                         c.options[b.index]))
    step = _simulated_step(c, step_fixed(hw, c.config))
    notes = _reshard_notes(c, ctx) + _recompute_notes(c)
    # the frontier, and the chosen plan where a faster one dominates it (a simpler plan
    # taken within `tolerance`): explain() and the CLI mark it among the points
    shown = pareto(found)
    if all(p is not c for p in shown):
        shown = sorted([*shown, c], key=lambda p: (p.peak_memory, p.step_time))
    points = tuple(FrontierPoint(p.step_time, p.peak_memory, _config_text(p),
                                 _summary(p.options)) for p in shown)
    return Plan(fn, cfg.devices, hw.name, int(budget), objective, ctx.global_batch,
                cfg.stages, cfg.outer, cfg.inner, cfg.microbatches, c.schedule.name, blocks,
                stages,
                step, c.peak_memory, tuple(sorted(tensor.items())),
                tuple((v.name, specs[v.name]) for v in a.graph.inputs if v.name in specs),
                points, secs, a.graph.fingerprint(),
                batch_input_specs=tuple((v.name, batch[v.name]) for v in a.graph.inputs
                                        if v.name in batch),
                virtual_stages=c.schedule.virtual_stages,
                schedule_times=tuple((choice.text(), t) for choice, t in
                                     ctx.schedules.get(cfg, {}).items()
                                     if cfg.stages > 1 and len(ctx.schedules[cfg]) > 1),
                notes=notes)


def _reshard_notes(c: Candidate, ctx: SearchContext) -> tuple[str, ...]:
    """Why blocks keep ZeRO-3's gathered parameters (`Option.reshard`): the backward
    gathers it saves per step against the bytes it holds at the stage's peak."""
    a = ctx.analysis
    sharded = [b for b in a.blocks if c.options[b.index].sdp_axes]
    kept = [b for b in sharded if not c.options[b.index].reshard]
    if not kept:
        return ()
    flight = {s.stage: s.in_flight for s in c.stages}
    walks = [(b, walk_cost(ctx, b, c.config, c.options[b.index])) for b in kept]
    saved = sum(w.gather_s for _, w in walks) * c.config.microbatches
    held = sum(w.gathered_saved_bytes * flight.get(c.block_stage[b.index], 1)
               for b, w in walks)
    labels = ", ".join(b.label for b in kept[:4]) + (", ..." if len(kept) > 4 else "")
    return (f"ZeRO-3 keeps the parameters it gathers from forward to backward in "
            f"{len(kept)} of {len(sharded)} sharded-data blocks ({labels}): "
            f"{saved:.4g} s of backward all-gathers saved per step for "
            f"{format_bytes(int(held))} held per device; the others free them after forward "
            f"and gather them again (reshard after forward, the default)",)


def _recompute_notes(c: Candidate) -> tuple[str, ...]:
    """Which stages recompute themselves whole under the shifted schedule."""
    p = c.config.stages
    redone = [s.stage for s in c.stages if c.schedule.recomputes(s.stage, p)]
    if not redone:
        return ()
    which = f"stage {redone[0]}" if len(redone) == 1 else f"stages {redone[0]}-{redone[-1]}"
    return (f"{which} of {p} recompute their whole forward once before each backward "
            f"(Merak's shifted schedule, stage-aware recompute: the recompute runs while the "
            f"rank waits for the gradient): each keeps its inputs for the microbatches in "
            f"flight and one microbatch's activations; stage {p - 1} keeps its activations",)


def _config_text(c: Candidate) -> str:
    """As `Plan.config_text` prints it (the schedule named for pipelines only)."""
    text = c.config.text()
    return text + f" schedule={c.schedule.text()}" if c.config.stages > 1 else text


SIMULATE_UP_TO = 2048
"""Schedules with at most this many (stage, microbatch) pairs are simulated for the chosen
plan's step time (`pxform.schedules.simulate`, exact for unequal stages); bigger ones keep
1F1B's closed form, which the simulation equals when stages are equal (a 64 x 256 schedule
takes 1.6 s to simulate on this machine)."""


def _simulated_step(c: Candidate, fixed: float) -> float:
    cfg = c.config
    choice = c.schedule
    if cfg.stages == 1 or \
            cfg.stages * cfg.microbatches * choice.virtual_stages > SIMULATE_UP_TO:
        return c.step_time
    schedule = resolve(choice.name, cfg.stages, cfg.microbatches, **dict(choice.options))
    split = choice.split
    timeline = simulate(schedule, Costs(
        forward=[s.forward for s in c.stages],
        backward=[s.backward - (s.weight if split else 0.0) for s in c.stages],
        weight=[s.weight if split else 0.0 for s in c.stages],
        recompute=[s.recompute for s in c.stages],
        forward_sync=[s.forward_sync for s in c.stages],
        backward_sync=[s.backward_sync for s in c.stages],
        p2p=[s.transfer for s in c.stages]))
    # the ranks' per-step costs after their last actions, and the step's fixed costs
    # (`stages.step_fixed`), which `assemble` adds to the schedule's time
    extra = after_schedule([s.step_extra for s in c.stages], cfg.stages)
    return timeline.step_time + extra + fixed


def _json_choice(choice: tuple) -> tuple:
    if choice[0] == "partial":
        return ("partial", tuple(sorted(choice[1])))
    return tuple(choice)


def _summary(options: Sequence[Option]) -> str:
    counts = Counter(o.text() for o in options)
    return ", ".join(f"{n}x {t}" for t, n in counts.most_common())


def pin_of(plan: Plan) -> Pin:
    """Every choice of `plan` as constraints for the search."""
    return Pin(plan.stages, plan.outer, plan.inner, plan.microbatches,
               tuple(Option(b.roles, b.recompute, b.reshard) for b in plan.blocks),
               tuple(b.stage for b in plan.blocks),
               {k: tuple(cs) for k, cs in plan.tensor_choices},
               ScheduleChoice(plan.schedule, plan.virtual_stages) if plan.stages > 1
               else None)


__all__ = ["OBJECTIVES", "Pin", "SearchError", "configs", "pin_of", "search"]
