"""The partition loop: for each configuration (`space.configs`) the blocks are split into
stages balancing their fastest time (`pxform.passes.cuts.balance`), then each stage's chain
of blocks is solved by the frontier DP (`stages.stage_frontier`) under the memory budget
left after its workspace; a stage that does not fit gives a block to its neighbour towards
the end of the pipeline (later stages hold fewer microbatches in flight under 1F1B), up to
`stages` moves (Galvatron-BMW's bi-objective balance: time first, memory as the constraint
that moves the cuts). The step time of a pipeline is 1F1B's closed form over the stages'
times (`pxform.cost.model.one_f_one_b_time`); the chosen plan is simulated exactly
afterwards. Configurations are tried best bound first (`bounds`), branch and bound.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Iterator, Sequence

from pxform.passes.cuts import balance
from pxform.search.bounds import lower_bound, memory_lower_bound, quick_bound
from pxform.search.context import OptionTable, SearchContext
from pxform.search.options import block_tables
from pxform.search.pipelines import (
    ONE_F_ONE_B,
    ScheduleChoice,
    awaiting,
    choices,
    in_flight,
    inputs_held,
    sent,
)
from pxform.search.space import Config
from pxform.search.stages import (
    Candidate,
    assemble,
    batch_bytes,
    borrowed,
    stage_frontier,
    trains_nothing,
    transfer_bytes,
)

SCHEDULE_GAIN = 0.01
"""A schedule other than 1F1B is chosen only when it is predicted this much faster than the
best so far: zero-bubble and interleaved run more actions per step and hold more
activations, for gains the cost model cannot resolve below its own error."""

FRONTIER_LEVELS = (1.0, 0.8, 0.65, 0.5, 0.4, 0.3, 0.22, 0.15, 0.1)
"""Memory limits, as fractions of the budget, at which each configuration's fastest plan
is read off the stage frontiers for `Plan.frontier()`."""


def evaluate(ctx: SearchContext, config: Config, objective: str = "time",
             incumbent: float = math.inf, schedule_gain: float = SCHEDULE_GAIN
             ) -> tuple[Candidate | None, list[Candidate]]:
    """The best plan of `config` under the budget (None if nothing fits), and the fastest
    plans at lower memory limits (for the frontier). Option groups (`_data_groups`) whose
    lower bound cannot beat `incumbent` (the best step time so far) are skipped. A
    schedule other than 1F1B wins only `schedule_gain` faster than the best before it
    (`SCHEDULE_GAIN`; `search_configs` passes its tolerance where that is larger)."""
    tables = block_tables(ctx, config)
    if tables is None:
        return None, []
    best: Candidate | None = None
    extra: list[Candidate] = []
    groups = sorted(_data_groups(ctx, config, tables),
                    key=lambda g: lower_bound(ctx, config, g))
    for group in groups:
        if objective == "time" and len(groups) > 1:
            beat = min(incumbent, best.step_time if best is not None else math.inf)
            if lower_bound(ctx, config, group) >= beat:
                continue
        cand, more = _evaluate(ctx, config, objective, group,
                               min(incumbent, best.step_time if best is not None
                                   else math.inf), schedule_gain)
        extra += more
        if cand is not None and (best is None or _key(cand, objective) < _key(best, objective)):
            best = cand
    return best, extra


def _data_groups(ctx: SearchContext, config: Config, tables: list[OptionTable]
                 ) -> list[list[OptionTable]]:
    """The option tables to search: with microbatches, one per set of data axes that every
    block has options for. The microbatch axis is the innermost split of the batch
    (`pxform.lower.mpmd`), so a batch value split over other data axes than the block
    before it would have to be regrouped across microbatches, which no microbatch can
    do: all blocks of a pipelined plan split the batch over the same data axes."""
    sets = sorted({o.data_axes for t in tables for o in t.options})
    if config.microbatches == 1 or len(sets) <= 1:
        return [tables]
    hit = ctx.groups.get(config)
    if hit is not None:
        return hit
    out = []
    for axes in sets:
        # blocks that shared a table share the filtered one. A table's key names its
        # options, not its costs: blocks of different kinds share keys, so the kind is
        # part of the key (without it, every layer was costed as the embedding before it)
        filtered: dict[tuple[int, int], OptionTable] = {}
        group: list[OptionTable] = []
        for blk, t in zip(ctx.analysis.blocks, tables):
            sub = filtered.get((blk.kind, t.key))
            if sub is None:
                keep = [j for j, o in enumerate(t.options) if o.data_axes == axes]
                opts = tuple(t.options[j] for j in keep)
                sub = filtered[blk.kind, t.key] = OptionTable(
                    ctx.table_key(opts), opts, tuple(t.costs[j] for j in keep))
            if not sub.options:
                break
            group.append(sub)
        else:
            out.append(group)
    ctx.groups[config] = out
    return out


def _evaluate(ctx: SearchContext, config: Config, objective: str,
              tables: list[OptionTable], incumbent: float = math.inf,
              schedule_gain: float = SCHEDULE_GAIN
              ) -> tuple[Candidate | None, list[Candidate]]:
    """The best plan of `config` over the schedules `pipelines.choices` offers, each with
    its own stage partition (interleaving cuts twice as many stages); a schedule whose
    bound cannot beat `incumbent` (or this configuration's best so far) is skipped."""
    best: Candidate | None = None
    extra: list[Candidate] = []
    offered = choices(config, len(ctx.analysis.blocks), ctx.pin.schedule)
    priced = ctx.schedules.setdefault(config, {})
    for choice in offered:
        if (choice.name == "shifted" or choice.split) and \
                _without_recompute(ctx, tables) is None:
            continue  # a block pinned to recompute: its stages cannot recompute whole, and
            # zero-bubble's recompute is not worth having (`_evaluate_schedule`)
        if objective == "time" and len(offered) > 1:
            beat = min(incumbent, best.step_time if best is not None else math.inf)
            if lower_bound(ctx, config, tables, (choice,)) >= beat:
                priced.setdefault(choice, None)  # (bounded out: not better)
                continue
        cand, more = _evaluate_schedule(ctx, config, objective, tables, choice)
        extra += more
        known = priced.get(choice)
        if cand is not None and (known is None or cand.step_time < known):
            priced[choice] = cand.step_time
        elif choice not in priced:
            priced[choice] = math.inf
        if cand is None:
            continue
        if best is not None and choice != ONE_F_ONE_B and objective == "time" and \
                cand.step_time > best.step_time * (1 - schedule_gain):
            continue  # not worth the extra actions and memory
        if best is None or _key(cand, objective) < _key(best, objective):
            best = cand
    return best, extra


def _evaluate_schedule(ctx: SearchContext, config: Config, objective: str,
                       tables: list[OptionTable], choice: ScheduleChoice
                       ) -> tuple[Candidate | None, list[Candidate]]:
    a = ctx.analysis
    blocks = a.blocks
    p, m = config.stages, config.microbatches
    n = choice.num_stages(p)  # stages, virtual ones counted
    flights = list(in_flight(choice, p, m))
    waits = awaiting(choice, p, m)
    inputs = inputs_held(choice, p, m)
    sends = sent(choice, p, m)
    plain: Sequence[OptionTable] = tables
    # zero-bubble's stages take no recompute: its W asks autograd for each weight op's
    # gradient apart, and torch's checkpoint runs a recomputed block's forward again for
    # each such call as well as for B, and keeps what B recomputed until the W. GPT small
    # on 2 gloo ranks, every block recomputed: 1.8 times the memory and 3.7 times the step
    # of zero-bubble without recompute, and 2.6 times the memory the model had predicted
    # (the fifty-third session)
    if any(inputs) or choice.split:
        # a stage that recomputes itself whole runs its blocks without their own recompute
        without = _without_recompute(ctx, tables)
        if without is None:
            return None, []  # a block is pinned to recompute
        plain = without
    fastest = [min(c.step_time(m) for c in t.costs) for t in tables]
    if ctx.pin.block_stage is not None:
        if max(ctx.pin.block_stage, default=0) >= n:
            return None, []
        partitions = [tuple(ctx.pin.block_stage)]
    elif a.marked:
        if n != p:
            return None, []  # the user's markers cut one stage per rank
        starts = set(a.marked)
        stage, out = 0, []
        for k in range(len(blocks)):
            if k in starts and k > 0:
                stage += 1
            out.append(stage)
        partitions = [tuple(out)]
    else:
        partitions = [balance(fastest, n)] if n > 1 else [(0,) * len(blocks)]
    best: Candidate | None = None
    extra: list[Candidate] = []
    tried: set[tuple[int, ...]] = set()
    moves = 0
    while partitions:
        part = partitions.pop(0)
        if part in tried:
            continue
        tried.add(part)
        if n > p:
            # a rank runs several stages: its peak is where their activations held weigh
            # most, which depends on the partition
            weights = stage_weights(tables, part, n)
            flights = list(in_flight(choice, p, m, weights))
            sends = sent(choice, p, m, weights)
        stage_points = []
        used = list(tables)  # per block, its stage's table (`_without_recompute`)
        failed = None
        for s in range(n):
            idx = [k for k in range(len(blocks)) if part[k] == s]
            if not idx:  # (a cut that left a stage nothing: not a pipeline of n stages)
                failed = -1
                break
            mine = plain if inputs[s] or choice.split else tables
            for k in idx:
                used[k] = mine[k]
            # the inputs it keeps for its recompute, and the tensors its sends keep; a
            # stage before the first that trains keeps none for its R, which does nothing
            # (`pxform.runtime.pipeline.first_trained`: GPT small's frozen first stage
            # under the shifted schedule came out 4.8 % over the meter)
            redo = choice.recomputes(s, p) and not trains_nothing(a, idx)
            kept, received = transfer_bytes(ctx, config, idx, s == n - 1,
                                            inputs[s] if redo else 0, sends[s], redo) \
                if n > 1 else (0.0, 0.0)
            kept += batch_bytes(ctx, idx)
            # stages with the same kinds, options and flight have the same frontier
            key = (config, tuple((a.blocks[k].kind, mine[k].key) for k in idx),
                   flights[s], borrowed(ctx, idx, tables) if p > 1 else 0.0, waits[s], kept,
                   received)
            pts = ctx.frontiers.get(key)
            if pts is None:
                pts = stage_frontier(ctx, config, idx, mine, flights[s], waits[s], kept,
                                     received)
                ctx.frontiers[key] = pts
            if not pts:
                failed = s
                break
            stage_points.append((idx, pts))
        if failed is not None:
            if failed >= 0 and ctx.pin.block_stage is None and not a.marked and moves < n and n > 1:
                moved = _shift(part, failed, n)
                if moved is not None:
                    partitions.append(moved)
                    moves += 1
            continue
        for level in FRONTIER_LEVELS:
            cand = assemble(ctx, config, part, stage_points, used, flights,
                            level * ctx.budget, objective if level == 1.0 else "time",
                            choice, waits)
            if cand is None:
                continue
            if level == 1.0 and (best is None or _key(cand, objective) < _key(best, objective)):
                best = cand
            extra.append(cand)
        # try handing a block of the worst stage (slowest; fullest for "memory") on
        if n > 1 and best is not None and moves < n and ctx.pin.block_stage is None \
                and not a.marked:
            top = best
            # (a stage that recomputes itself runs its forward twice)
            worst = max(range(n), key=lambda s: top.stages[s].memory if objective == "memory"
                        else top.stages[s].time + (m * top.stages[s].forward
                                                   if choice.recomputes(s, p) else 0.0))
            moved = _shift(part, worst, n)
            if moved is not None and moved not in tried:
                partitions.append(moved)
                moves += 1
    return best, extra


def stage_weights(tables: Sequence[OptionTable], part: Sequence[int], n: int
                  ) -> tuple[float, ...]:
    """Per stage of `part` (each block's stage, `n` stages), one microbatch's activation
    bytes under each block's fastest option, relative to the largest stage's and rounded
    to a twentieth (the counts they weigh are cached per value:
    `pipelines.in_flight`).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> t = lambda saved: NS(options=[NS(recompute=False)],
        ...                      costs=[NS(saved=saved, kept=0.0, step_time=lambda m: 1.0)])
        >>> stage_weights([t(4.0), t(4.0), t(1.0)], (0, 1, 1), 2)
        (0.8, 1.0)
    """
    acts = [0.0] * n
    for t, s in zip(tables, part):
        k = min(range(len(t.costs)), key=lambda i: t.costs[i].step_time(1))
        c = t.costs[k]
        acts[s] += c.kept if t.options[k].recompute else c.saved
    top = max(acts)
    if top <= 0:
        return (1.0,) * n
    return tuple(round(20 * a / top) / 20 for a in acts)


def _without_recompute(ctx: SearchContext, tables: Sequence[OptionTable]
                       ) -> list[OptionTable] | None:
    """Per block, its table without the options that recompute it (None: a block has
    only those)."""
    out: list[OptionTable] = []
    made: dict[int, OptionTable] = {}
    for t in tables:
        hit = made.get(id(t))
        if hit is None:
            kept = [(o, c) for o, c in zip(t.options, t.costs) if not o.recompute]
            if not kept:
                return None
            opts = tuple(o for o, _ in kept)
            hit = made[id(t)] = OptionTable(ctx.table_key(opts), opts,
                                            tuple(c for _, c in kept))
        out.append(hit)
    return out


def _key(c: Candidate, objective: str) -> tuple[float, float]:
    if objective == "memory":
        return (c.peak_memory, c.step_time)
    return (c.step_time, c.peak_memory)



def _shift(part: tuple[int, ...], stage: int, p: int) -> tuple[int, ...] | None:
    """Move one block off `stage`: its last to the next stage, or (last stage) its first
    to the previous one; None when the stage has a single block."""
    idx = [k for k, s in enumerate(part) if s == stage]
    if len(idx) <= 1:
        return None
    out = list(part)
    if stage < p - 1:
        out[idx[-1]] = stage + 1
    else:
        out[idx[0]] = stage - 1
    return tuple(out)



SIMPLER_WITHIN = 0.05
"""`auto`'s default `tolerance`: configurations predicted within this fraction of the
fastest count as tied, and the simplest of them is taken (`simplicity`). The model's error
on measured steps is larger than that (docs/benchmarks/accuracy.md), and a calibration
run minutes later moves predictions by as much: without it, plans flipped between 2 and 16
microbatches from one calibration to the next, and the many-microbatch plan ran twice as
long as predicted."""


def simplicity(c: Candidate) -> tuple[int, int, int, bool, int, int, int, int, float]:
    """Simplest first: fewer pipeline stages, fewer chunks per rank, fewer microbatches
    (each adds per-microbatch costs the model prices least well), 1F1B, then fewer
    blocks split inside their ops (tensor parallelism: collectives in every layer), a
    smaller inner axis (without tensor parallelism, `outer=2` and `inner=2` are the same
    data parallelism: one spelling), fewer recomputed, fewer with sharded data, then
    faster."""
    return (c.config.stages, c.schedule.virtual_stages, c.config.microbatches,
            c.schedule.name != "1f1b", sum(o.tensor_axis is not None for o in c.options),
            c.config.inner, sum(o.recompute for o in c.options),
            sum(bool(o.sdp_axes) for o in c.options), c.step_time)


def search_configs(ctx: SearchContext, configs: Sequence[Config], objective: str,
                   progress: Callable[[int, int], None] | None = None, *,
                   first_fit: bool = False, tolerance: float = 0.0
                   ) -> tuple[Candidate | None, list[Candidate], float]:
    """Evaluate every configuration; the best plan, every plan found (for the frontier;
    each configuration's best among them), and the seconds it took. `first_fit`: stop at
    the first plan that fits (to ask whether any does). `tolerance` (objective "time"):
    configurations within that fraction of the fastest are ties, and the simplest wins
    (`SIMPLER_WITHIN`)."""
    start = time.perf_counter()
    best: Candidate | None = None
    found: list[Candidate] = []
    slack = 1.0 + (tolerance if objective == "time" else 0.0)
    # branch and bound: the most promising configurations first, and none whose lower
    # bound (step time, or peak memory for the memory objective) cannot beat the best
    # plan so far. Memory ties are kept: step time breaks them.
    bests: list[Candidate] = []
    simplest: Candidate | None = None  # the simplest within `tolerance` of `best` so far
    done = 0  # configurations evaluated or skipped (`progress`)

    def hopeless(config: Config, bound: float) -> bool:
        # would the loop below skip the configuration at its turn, whatever it finds
        # before? The best only gets faster, so its beat is at most the best's time with
        # the slack. With more stages than the simplest tie so far, it gets no slack at its
        # turn (the simplest then has no more stages than this one: `simplicity` ranks
        # stages first), unless that tie has left the window by then, when the slack's
        # beat is under that tie's time
        if best is None:
            return False
        if simplest is not None and config.stages > simplest.config.stages:
            return bound >= simplest.step_time
        return bound >= best.step_time * slack

    bounds: dict[Config, float] = {}
    for config, bound in _in_bound_order(ctx, configs, objective, hopeless):
        if bound is None:  # (skipped on its quick bound)
            done += 1
            if progress is not None:
                progress(done, len(configs))
            continue
        bounds[config] = bound
        done += 1
        beat = math.inf
        if best is not None:
            beat = best.step_time
            # a configuration that cannot beat the fastest may still be a simpler tie
            if simplest is not None and _config_order(config) < _config_order(simplest.config):
                beat *= slack
        if best is not None and (bounds[config] >= beat if objective == "time"
                                 else bounds[config] > best.peak_memory):
            if progress is not None:
                progress(done, len(configs))
            continue
        # the tolerance's ties go to 1F1B within a configuration too, as `simplicity`
        # ranks it: with 1 % there, GPT small's 2-stage pin took zero-bubble (priced 1-5 %
        # under 1F1B, measured 0.98-1.00 times it) in 5 of 6 calibrations and interleaved
        # in the sixth (2026-11-30)
        cand, extra = evaluate(ctx, config, objective, beat,
                               max(SCHEDULE_GAIN, tolerance) if objective == "time"
                               else SCHEDULE_GAIN)
        found.extend(extra)
        if cand is not None:
            bests.append(cand)
            if best is None or _key(cand, objective) < _key(best, objective):
                best = cand
            fastest = best.step_time
            simplest = min((c for c in bests if c.step_time <= fastest * slack),
                           key=simplicity)
        if progress is not None:
            progress(done, len(configs))
        if first_fit and best is not None:
            break
    seen = {id(c) for c in found}
    found.extend(c for c in bests if id(c) not in seen)
    if slack > 1.0 and simplest is not None:
        best = simplest
    return best, found, time.perf_counter() - start


def _in_bound_order(ctx: SearchContext, configs: Sequence[Config], objective: str,
                    hopeless: Callable[[Config, float], bool]
                    ) -> Iterator[tuple[Config, float | None]]:
    """The configurations by their lower bounds, least first (then fewer stages, a
    smaller outer axis, fewer microbatches), each with its bound, or with None where it
    was skipped on its quick bound. For the time objective the full bound
    (`lower_bound`, which builds the configuration's option tables) is made only when
    its quick bound (`quick_bound`, no tables) comes first and is not `hopeless` (the
    caller's: would it skip the configuration at its turn, whatever it finds before?):
    the order of those whose full bounds are made is the full bounds' (the larger of
    the two bounds), as each quick bound is at most that. BERT-large's pipelines of 4
    and 8 stages on 8 devices are skipped so, their tables never built."""
    if objective != "time":
        bounds = {c: memory_lower_bound(ctx, c) for c in configs}
        for c in sorted(configs, key=lambda c: (bounds[c], c.stages, c.outer,
                                                c.microbatches)):
            yield c, bounds[c]
        return
    # (bound, stages, outer, microbatches, 0 quick / 1 full, index)
    heap = [(quick_bound(ctx, c), c.stages, c.outer, c.microbatches, 0, i)
            for i, c in enumerate(configs)]
    heapq.heapify(heap)
    while heap:
        bound, stages, outer, microbatches, full, i = heapq.heappop(heap)
        config = configs[i]
        if full:
            yield config, bound
        elif hopeless(config, bound):
            yield config, None
        else:
            heapq.heappush(heap, (max(bound, lower_bound(ctx, config)), stages, outer,
                                  microbatches, 1, i))


def _config_order(config: Config) -> tuple[int, int, int]:
    """`simplicity`'s order as far as a configuration alone tells it."""
    return (config.stages, config.microbatches, config.inner)


def pareto(cands: Sequence[Candidate]) -> list[Candidate]:
    """The candidates no other beats in both step time and peak memory, by memory."""
    out: list[Candidate] = []
    for c in sorted(cands, key=lambda c: (c.peak_memory, c.step_time)):
        if not out or c.step_time < out[-1].step_time - 1e-15:
            out.append(c)
    return out

