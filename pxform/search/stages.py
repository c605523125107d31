"""Stage assembly: a pipeline stage's frontier of (time, memory) plans over its chain of
blocks (`stage_frontier`, the frontier DP under the budget left after its workspace), and a
whole plan from one frontier point per stage (`assemble`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pxform.cost.hardware import Hardware
from pxform.cost.model import BACKWARD_RATIO, accumulation_bytes, backward_extra, weight_pool_bytes
from pxform.search.analysis import Analysis, BlockInfo
from pxform.search.context import OptionCost, OptionTable, SearchContext, StagePoint
from pxform.search.frontier import Point, chain_frontier
from pxform.search.options import transition
from pxform.search.pipelines import ONE_F_ONE_B, ScheduleChoice
from pxform.search.pipelines import step_time as pipeline_step
from pxform.search.space import INNER, OUTER, Config, Option

QUANTUM = 1 / 256
"""Frontier memory rounding, as a fraction of the budget (`frontier` module doc)."""


@dataclass(frozen=True)
class StageResult:
    stage: int
    blocks: tuple[int, ...]
    time: float            # per step, this stage alone (all microbatches)
    forward: float         # per microbatch
    backward: float        # per microbatch
    memory: float          # peak bytes per device
    in_flight: int
    param_bytes: float
    weight: float = 0.0    # per microbatch, of `backward`: the weight gradients (zb's W)
    recompute: float = 0.0  # per microbatch, an early recompute (the shifted schedule's R)
    forward_sync: float = 0.0  # per F or B that meets its input's arrival
    backward_sync: float = 0.0  # (`pipelines.step_time`)
    # per transfer from this stage to another rank, where the action needing it waits
    # (`Hardware.transfer_overhead_s`)
    transfer: float = 0.0
    # per step, the stage's own costs outside its actions (per parameter, its gradients'
    # reductions): its rank runs them after its last action, outside the schedule
    step_extra: float = 0.0


def after_schedule(extras: Sequence[float], p: int) -> float:
    """Seconds a pipeline step takes beyond its schedule: the ranks' per-step costs
    (stage `s` runs on rank `s % p`, `extras[s]` its costs per step), run by each rank after
    its last action, all at once; the largest rank's sum.

    Example (2 ranks, 2 chunks each):
        >>> after_schedule([1.0, 2.0, 0.5, 0.5], 2)
        2.5
    """
    return max((sum(extras[r::p]) for r in range(p)), default=0.0)


@dataclass(frozen=True)
class Candidate:
    """One complete plan the search found."""

    config: Config
    options: tuple[Option, ...]     # per block
    block_stage: tuple[int, ...]
    stages: tuple[StageResult, ...]
    step_time: float
    peak_memory: float
    block_time: tuple[float, ...]   # per block, per step
    block_memory: tuple[float, ...]  # per block, per device
    batch: int = 0                   # the global batch planned for
    schedule: ScheduleChoice = ONE_F_ONE_B



def borrowed(ctx: SearchContext, idx: list[int], tables: Sequence[OptionTable],
             chosen: Sequence[OptionCost | None] | None = None) -> float:
    """Bytes a pipeline stage holds for parameters an earlier stage's block owns (a tied
    embedding read again by the head): their weights, gradients and optimizer state live on
    every stage that reads them. Counted at the owner's share of its option's state bytes:
    the chosen option's when `chosen` gives it, else the least over its options (what the
    frontier DP can count before the owner's stage is chosen)."""
    total = 0.0
    for o, share in _borrowed_shares(ctx, idx):
        cost = chosen[o] if chosen is not None else None
        total += share * (cost.params if cost is not None
                          else min(c.params for c in tables[o].costs))
    return total


def _borrowed_shares(ctx: SearchContext, idx: list[int]) -> tuple[tuple[int, float], ...]:
    """Per parameter the stage `idx` reads but an outside block owns: the owner's index and
    the parameter's share of the owner's elements. Depends on the blocks only: computed
    once per stage (the search asks for every partition and frontier level)."""
    key = tuple(idx)
    hit = ctx.borrowed.get(key)
    if hit is not None:
        return hit
    a = ctx.analysis
    inside = set(idx)
    owned = {name for k in idx for name in a.blocks[k].params}
    owner = {name: j for j, b in enumerate(a.blocks) for name in b.params}
    reads = {v.name for k in idx for op in a.graph.ops[a.blocks[k].start:a.blocks[k].stop]
             for v in op.inputs if v.name in a.params}
    vals = a.values()
    out = []
    for name in sorted(reads - owned):
        o = owner.get(name)
        if o is None or o in inside:
            continue
        whole = sum(vals[n].type.numel for n in a.blocks[o].params)
        out.append((o, vals[name].type.numel / max(1, whole)))
    ctx.borrowed[key] = shares = tuple(out)
    return shares


def stage_frontier(ctx: SearchContext, config: Config, idx: list[int],
                   tables: Sequence[OptionTable], flight: int, waits: int = 0,
                   inputs: float = 0.0, during_backward: float = 0.0) -> list[StagePoint]:
    """The stage's frontier points within the budget, each with its peak memory including
    the workspace, and that workspace (`_extra`). `waits`: microbatches whose weight-op
    output gradients the stage keeps for zero-bubble W actions (`pipelines.awaiting`);
    `inputs`: bytes its transfers and a recompute of the whole stage keep at its peak,
    `during_backward`: bytes they add while a backward runs, on top of its workspace
    (`transfer_bytes`)."""
    a = ctx.analysis
    m = config.microbatches
    times = [np.array([c.step_time(m) for c in tables[k].costs]) for k in idx]
    mm = memory_microbatches(m, flight, waits)
    mems = [np.array([c.memory(flight, o.recompute, mm) + c.split_memory(flight, waits)
                      for c, o in zip(tables[k].costs, tables[k].options)]) for k in idx]
    trans_time: list[np.ndarray | None] = [None]
    for j in range(1, len(idx)):
        prev, cur = tables[idx[j - 1]], tables[idx[j]]
        key = (a.blocks[idx[j - 1]].kind, config, prev.key, cur.key)
        mat = ctx.matrices.get(key)
        if mat is None:
            mat = np.zeros((len(prev.options), len(cur.options)))
            for r, s in enumerate(prev.options):
                for c, s2 in enumerate(cur.options):
                    mat[r, c] = m * transition(ctx, a.blocks[idx[j - 1]], config, s, s2)
            ctx.matrices[key] = mat
        trans_time.append(mat)
    held = (borrowed(ctx, idx, tables) if config.stages > 1 else 0.0) + inputs
    budget = ctx.budget - held
    # a zero-bubble W also makes the gradients of the parameters the stage borrows (a
    # tied embedding's, read by the head): they wait in its pool beside its own
    lent = [share * min(c.grads for c in tables[o].costs)
            for o, share in _borrowed_shares(ctx, idx)] if waits and config.stages > 1 else []
    workspace = _least_extra(tables, idx, flight, mm, waits, lent) + during_backward
    for _ in range(3):
        limit = budget - workspace
        if limit <= 0:
            return []
        # without a budget (the least-memory search) round to the device's memory scale
        scale = budget if math.isfinite(budget) else ctx.hardware.memory_bytes
        pts = chain_frontier(times, mems, trans_time, None, quantum=QUANTUM * scale,
                             limit=limit)
        out = []
        worst = workspace
        for pt in pts:
            ws = _extra(tables, idx, pt.choices, flight, mm, waits, lent) + during_backward
            worst = max(worst, ws)
            if pt.memory + ws <= budget:
                out.append((pt, pt.memory + ws + held, ws))
        if out or worst == workspace:
            return out
        workspace = worst
    return []


def trains_nothing(a: Analysis, idx: Sequence[int]) -> bool:
    """Whether a pipeline stage of blocks `idx` lies wholly before the first block that
    trains (a frozen prefix): it runs its forward without autograd's graph, and its B, W
    and R do nothing (`pxform.runtime.pipeline.first_trained`).

    Example (a frozen embedding and first layer, then trained layers):
        >>> trains_nothing(analysis, [0, 1]), trains_nothing(analysis, [1, 2])
        (True, False)
    """
    return idx[-1] < a.first_trained


def memory_microbatches(m: int, flight: int, waits: int) -> int:
    """The microbatch count the memory model (`cost.model.peak_bytes`,
    `backward_extra`) is given: `m`, or, on a zero-bubble stage (`waits` > 0), more than
    are in flight. There the input-gradient pass keeps every graph for W, so the weight
    gradients appear beside all `flight` microbatches' activations instead of replacing
    the last one's as a plain backward frees it."""
    return max(m, flight + 1) if waits else m


def _extra(tables: Sequence[OptionTable], idx: list[int], choices: Sequence[int],
           flight: int, m: int, waits: int = 0, lent: Sequence[float] = ()) -> float:
    """Bytes on top of the chosen options' summed memory (`cost.model.backward_extra`);
    on a zero-bubble stage (`waits` > 0) at least what its W actions hold
    (`cost.model.weight_pool_bytes`), the gradients of the parameters it borrows
    (`lent`) among them: a W runs apart from any backward, with the
    microbatch's graph still kept, as the summed memory counts it (GPT small's 2-stage
    zero-bubble pipeline peaked there on both ranks, in the second W's accumulation,
    2026-11-30; the tied embedding's gradient left out, its last stage came out 1.3-2.6 %
    under the meter: the forty-sixth session)."""
    costs = [tables[k].costs[c] for k, c in zip(idx, choices)]
    redo = [tables[k].options[c].recompute for k, c in zip(idx, choices)]
    # (a zero-bubble stage sums its gradients in W actions, `weight_pool_bytes`, and its
    # B keeps the graphs for them)
    summing = None if waits else [accumulation_bytes(c.largest_grad, m) for c in costs]
    extra = backward_extra([c.kept if r else c.saved for c, r in zip(costs, redo)],
                           [c.grads for c in costs],
                           [c.workspace(r, not waits) for c, r in zip(costs, redo)],
                           flight, m,
                           sum(c.packed for c in costs),
                           [c.transient if r else None for c, r in zip(costs, redo)],
                           summing, frees=not waits,
                           firsts=[c.workspace(r, not waits, first=True)
                                   for c, r in zip(costs, redo)])
    if not waits:
        return extra
    return max(extra, weight_pool_bytes([c.grads for c in costs] + list(lent),
                                        max([c.largest_grad for c in costs] + list(lent))))


def _least_extra(tables: Sequence[OptionTable], idx: list[int], flight: int, m: int,
                 waits: int = 0, lent: Sequence[float] = ()) -> float:
    """A lower bound of `_extra` over every choice of options: each block's least
    workspace, less the most the blocks before it may not yet hold (with every
    microbatch in flight) and the most the blocks after it no longer hold
    (`backward_extra`; the bound may be negative, as the extra may)."""
    def over(c: OptionCost, o: Option) -> tuple[float, float]:
        act = c.kept if o.recompute else c.saved
        return max(c.grads - act, 0.0), max(act - c.grads, 0.0)

    pairs = [list(zip(tables[k].costs, tables[k].options)) for k in idx]
    # (a recomputed block's recompute may come before its gradients: its transient is
    # what `backward_extra` charges it at least)
    least_work = [min(c.transient - (0.0 if waits else c.freed) for c, _ in p)
                  for p in pairs]
    # a zero-bubble stage's W actions: what they hold with the fewest gradients
    pool = (weight_pool_bytes([min(c.grads for c, _ in p) for p in pairs] + list(lent),
                              max([min(c.largest_grad for c, _ in p) for p in pairs]
                                  + list(lent)))
            if waits and pairs else 0.0)
    if flight < m:
        # each block's least workspace, less the most the blocks after it may have freed
        # of the microbatch going back (none on a zero-bubble stage)
        most_act = [0.0 if waits else max(c.kept if o.recompute else c.saved for c, o in p)
                    for p in pairs]
        least, after = 0.0, sum(most_act)
        for work, act in zip(least_work, most_act):
            after -= act
            least = max(least, work - after)
        return max(least, pool)
    ahead = [max(over(c, o)[0] for c, o in p) for p in pairs]
    behind = [max(over(c, o)[1] for c, o in p) for p in pairs]
    least, before, after = -math.inf, 0.0, sum(behind)
    for k, work in enumerate(least_work):
        after -= behind[k]
        least = max(least, work - before - after)
        before += ahead[k]
    return max(least, pool) if pairs else 0.0


def assemble(ctx: SearchContext, config: Config, part: tuple[int, ...],
             stage_points: list[tuple[list[int], list[StagePoint]]],
             tables: Sequence[OptionTable], flights: list[int], limit: float,
             objective: str, schedule: ScheduleChoice = ONE_F_ONE_B,
             waits: Sequence[int] | None = None) -> Candidate | None:
    """A pipeline plan: per stage the frontier point that is best under `limit` (per
    rank, over its stages together, when a rank runs several), priced by `schedule`."""
    m = config.microbatches
    picked = _pick(config, stage_points, limit, objective)
    if picked is None:
        return None
    chosen: list[Option | None] = [None] * len(part)
    chosen_cost: list[OptionCost | None] = [None] * len(part)
    block_time = [0.0] * len(part)
    block_mem = [0.0] * len(part)
    stages = []
    fw, bw, wt, rc, fs, bs, extras = [], [], [], [], [], [], []
    # what a transfer to another rank adds where an action waits for it: the schedule's
    # timer charges it on those waits only (`pipelines.step_time`)
    transfer = ctx.hardware.transfer_overhead_s if config.stages > 1 else 0.0
    for s, ((idx, _), (pt, mem)) in enumerate(zip(stage_points, picked)):
        wait = waits[s] if waits else 0
        sums = _stage_sums(ctx, config, idx, pt, tables, flights[s], wait, schedule.split,
                           schedule.recomputes(s, config.stages))
        for k, o, oc, t, bm in zip(idx, sums.options, sums.costs, sums.block_time,
                                   sums.block_mem):
            chosen[k], chosen_cost[k], block_time[k], block_mem[k] = o, oc, t, bm
        pbytes = sums.param_bytes
        if config.stages > 1:  # the owner's chosen option, not the least the DP assumed
            exact = borrowed(ctx, idx, tables, chosen_cost)
            mem += exact - borrowed(ctx, idx, tables)
            pbytes += exact
            if mem > limit:
                return None
        fw.append(sums.forward)
        bw.append(sums.backward)
        wt.append(sums.weight)
        rc.append(sums.recompute)
        fs.append(sums.forward_sync)
        bs.append(sums.backward_sync)
        extras.append(sums.step_extra)
        stages.append(StageResult(s, tuple(idx), pt.time, sums.forward, sums.backward, mem,
                                  flights[s], pbytes, sums.weight, sums.recompute,
                                  sums.forward_sync, sums.backward_sync, transfer,
                                  sums.step_extra))
    if config.stages > 1:
        step = pipeline_step(schedule, config.stages, m, fw, bw, wt, rc, fs, bs,
                             [transfer] * len(fw))
        step += after_schedule(extras, config.stages)
    else:
        step = m * (fw[0] + bw[0])
    step += step_fixed(ctx.hardware, config)
    return Candidate(config, tuple(o for o in chosen if o is not None), part, tuple(stages),
                     step, max(st.memory for st in stages), tuple(block_time),
                     tuple(block_mem), ctx.global_batch, schedule)


def step_fixed(hw: Hardware, config: Config) -> float:
    """Seconds a step costs beyond its actions and its ranks' per-step costs: the runtime's
    own per-step host time (`Hardware.step_overhead_s`), and, in a pipeline, the ranks'
    agreement on the first stage that trains before its first action (one all-reduce of
    one int64 over the pipeline ranks, `pxform.runtime.pipeline.first_trained`). That
    message is tiny: it goes in `ceil(log2 p)` rounds of exchange between pairs of ranks
    (recursive doubling), each a small transfer there and one back, at the profile's
    p2p latency: 0.25 ms for 2 ranks on the golden CPU profile, where 300 of them took a
    median 0.21 ms each (the forty-ninth session). The profile's all-reduce table, a ring
    of `2 (p - 1)` steps measured through the runtime's wrapped collectives, priced it at
    0.48 ms for 2 ranks and 7.3 ms for 16.

    Example:
        >>> step_fixed(hardware("a100-40gb"), Config(stages=2, outer=4, inner=1,
        ...                                          microbatches=8)) > 0
        True
    """
    out = hw.step_overhead_s
    if config.stages > 1:
        p = config.stages
        rounds = math.ceil(math.log2(p))
        out += 2 * rounds * hw.comm_time("p2p", 8.0, 2,
                                         hw.level(p * config.outer * config.inner))
    return out


def host_overlapped(hw: Hardware, blocks: Sequence[BlockInfo], options: Sequence[Option],
                    forward: float, backward: float, host_saved: float = 0.0
                    ) -> tuple[float, float]:
    """A stage's (forward, backward) per microbatch on a device that runs kernels
    asynchronously to the host (`Hardware.host_overlaps`): `forward` and `backward` are
    the sums over its ops of the device's time and the host's time per op
    (`CostModel.op_times` adds `op_step_overhead_s` to every op, a third forward, two
    thirds backward); there the host enqueues while the device computes, and each pass
    takes the longer of its two parts. A recomputed block's backward runs its forward's
    ops again, and the checkpoint's own host time (`recompute_overhead_s`), on the host.
    `host_saved`: seconds less of the forward's host time (a forward without autograd's
    graph: `Hardware.autograd_op_overhead_s` per op).

    Example (one block of 400 ops, 30 us of host time each: 4 ms forward, 8 backward):
        >>> hw = dataclasses.replace(hardware("h100-80gb"), host_overlaps=True,
        ...                          op_step_overhead_s=3e-5)
        >>> f, b = host_overlapped(hw, [block], [Option((("outer", "dp"),))], 0.03, 0.05)
        >>> round(f, 6), round(b, 6)
        (0.026, 0.042)
    """
    host_f = host_b = 0.0
    for block, option in zip(blocks, options):
        f, b = host_seconds(hw, block, option)
        host_f += f
        host_b += b
    return (max(forward - host_f, max(0.0, host_f - host_saved)),
            max(backward - host_b, host_b))


def host_seconds(hw: Hardware, block: BlockInfo, option: Option) -> tuple[float, float]:
    """The host's part of the block's forward and backward per microbatch under `option`,
    as `host_overlapped` counts it: `op_step_overhead_s` per op, a third in forward, two
    thirds in backward, and a recompute's forward and checkpoint again in backward."""
    per_op = hw.op_step_overhead_s / (1 + BACKWARD_RATIO)  # the forward's share
    ops = block.stop - block.start
    backward = ops * per_op * BACKWARD_RATIO
    if option.recompute:
        backward += ops * per_op + hw.recompute_overhead_s
    return ops * per_op, backward


@dataclass(frozen=True)
class _StageSums:
    """A stage's share of `assemble` that depends on its own blocks and point only."""

    options: tuple[Option, ...]
    costs: tuple[OptionCost, ...]
    block_time: tuple[float, ...]
    block_mem: tuple[float, ...]
    forward: float   # per microbatch, its actions' and transfers' fixed costs in
    backward: float  # (with the step's extra costs spread over the microbatches)
    weight: float
    param_bytes: float  # without parameters borrowed from other stages
    recompute: float  # an early recompute (R) of a microbatch: no transfer, no wait
    forward_sync: float  # an F's wait where its input arrives just as it is ready
    backward_sync: float  # a B's likewise (`pipelines.step_time`)
    step_extra: float = 0.0  # a pipeline stage's per-step costs, outside its actions


def _stage_sums(ctx: SearchContext, config: Config, idx: list[int], pt: Point,
                tables: Sequence[OptionTable], flight: int, wait: int, split: bool,
                redo: bool) -> _StageSums:
    """Per stage and frontier point, what `assemble` adds up, once: the search assembles
    each partition at every level of `FRONTIER_LEVELS` (the frontier), and most stages
    keep their point from one level to the next. `redo`: the stage recomputes early (the
    shifted schedule's R actions, `ScheduleChoice.recomputes`)."""
    a = ctx.analysis
    key = (config, split, redo, tuple(idx), tuple(tables[k].key for k in idx), pt, flight,
           wait)
    hit = ctx.stage_sums.get(key)
    if hit is not None:
        return hit
    m = config.microbatches
    f = b = w = extra = pbytes = outer = inner = 0.0
    weight_ops = 0
    options, costs, times, mems = [], [], [], []
    for k, c in zip(idx, pt.choices):
        o = tables[k].options[c]
        oc = tables[k].costs[c]
        options.append(o)
        costs.append(oc)
        times.append(oc.step_time(m))
        mems.append(oc.memory(flight, o.recompute, memory_microbatches(m, flight, wait))
                    + oc.split_memory(flight, wait))
        f += oc.forward
        b += oc.backward
        w += oc.weight
        weight_ops += oc.weight_ops
        extra += oc.step_extra
        pbytes += oc.params
        outer += oc.packed_outer
        inner += oc.packed_inner
    hw = ctx.hardware
    # a pipeline stage before the first block that trains (a frozen prefix) runs its
    # forward without autograd's graph and its B and W do nothing: nothing of it requires
    # grad (`pxform.runtime.pipeline.first_trained`); its gradient messages are tokens
    frozen = config.stages > 1 and trains_nothing(a, idx)
    if frozen:
        b = w = 0.0
    computed_b, computed_w = b, w  # (the passes' own time, before the runtime's costs)
    num_ops = sum(a.blocks[k].stop - a.blocks[k].start for k in idx)
    # of the forward, the blocks before the first that trains (a frozen prefix): nothing
    # they read requires grad, so they record no graph in any stage
    prefix_share = sum(c.forward for k, c in zip(idx, costs) if k < a.first_trained) / f \
        if f > 0 else 0.0
    # the forward without autograd's graph (the shifted schedule's first forward of a
    # stage that recomputes early: its R records the graph, `pxform.runtime.pipeline`):
    # a share of its time and a time per op less (`Hardware.autograd_share`,
    # `autograd_op_overhead_s`); in GPT pipelines here 20-25 % of the stage's forward
    # measured, about half of that priced (`docs/search.md`)
    if hw.host_overlaps:
        blocks = [a.blocks[k] for k in idx]
        # the host's part less by the time per op; the share is the allocator's on a
        # CPU, where one thread runs both (a device's kernels do not record autograd)
        plain, _ = host_overlapped(hw, blocks, options, f, b,
                                   host_saved=hw.autograd_op_overhead_s * num_ops)
        f, b = host_overlapped(hw, blocks, options, f, b)
    else:
        plain = max(0.0, f * (1.0 - hw.autograd_share) - hw.autograd_op_overhead_s * num_ops)
    no_grad_saving = max(0.0, f - plain)
    # the stage's packed all-reduces priced whole (its buckets, the last one exposed)
    # instead of as the blocks' shares (`SearchContext.packed_rate`)
    axes = ctx.axes(config)
    for axis, sent in ((OUTER, outer), (INNER, inner)):
        if sent > 0:
            extra += (ctx.model.bucketed_all_reduce(sent, axis, axes)
                      - ctx.packed_rate(config, axis) * sent)
    if outer > 0 or inner > 0:
        # the last bucket is waited for when backward ends: the ranks meet there after the
        # backward's compute (`Hardware.sync_wait`)
        extra += ctx.hardware.sync_wait_s(b)
    # the runtime's own host time (`pxform.tools.runtime_costs`): per parameter tensor
    # per step, and per pipeline action, with its parameters and ops (a zero-bubble W is
    # one more, and asks autograd for each weight op's gradient apart)
    num_params = sum(len(a.blocks[k].params) for k in idx)
    extra += hw.param_overhead_s * num_params
    # an early recompute (R, the shifted schedule) runs the stage's forward again from the
    # inputs it kept: no receive to wait for, no send; of the per-action costs only those
    # per parameter and per op (GPT small's R, recorded, 2026-11-28: 2.9 ms, priced 3.2
    # without `action_overhead_s`)
    r = f
    f_sync = b_sync = 0.0
    if config.stages > 1:
        # an action that starts from a transfer meets the stage that sends it there, after
        # its own compute since the last (`Hardware.sync_wait`): a forward unless the
        # stage is the first (its input is the batch), a backward unless it is the last
        # (it starts from the loss). Sends do not wait (`isend`). The schedule's timer
        # charges it where the two meet (`pipelines.step_time`), not on every action: a
        # stage whose inputs arrive before it asks for them does not wait for them.
        if idx[0] > 0:
            f_sync = hw.sync_wait_s(f)
        if idx[-1] < len(a.blocks) - 1:
            b_sync = hw.sync_wait_s(b)
        action = (hw.action_overhead_s + hw.param_action_overhead_s * num_params
                  + hw.op_action_overhead_s * num_ops)
        # a backward walks the graph of what trains alone: not the ops of the blocks
        # before the first that trains (a frozen prefix: autograd never reaches them) nor
        # a frozen parameter's conversion (GPT small's zero-bubble stage of its frozen
        # embeddings and two frozen layers and one trained one: B + W priced 2.6 ms a
        # microbatch beyond its receive, 2.35 ms measured)
        trained_params = sum(n in a.trainable for k in idx for n in a.blocks[k].params)
        walked_ops = sum(a.blocks[k].stop - a.blocks[k].start for k in idx
                         if k >= a.first_trained)
        b_action = (hw.action_overhead_s + hw.param_action_overhead_s * trained_params
                    + hw.op_action_overhead_s * walked_ops)
        # and each transfer the action makes, on its own rank's thread: a forward sends
        # unless the stage is the last and receives unless it is the first, a backward
        # the other way round (an interleaved schedule's chunks in the middle make two
        # per action, a 2-stage pipeline's one: GPT small's interleaved pipeline, every
        # action recorded, 2026-11-28: three sends of 0.36-0.54 ms and three receives
        # per microbatch on each rank, where the per-action cost fitted to 1F1B carried
        # one of each per two actions, and interleaved plans came out 8-13 % under)
        first, last = idx[0] == 0, idx[-1] == len(a.blocks) - 1
        # (a receive also stalls its rank while the transfer moves, where the schedule
        # would have had the data there in time: `Hardware.receive_stall_s`). A stage
        # that recomputes early does not stall on its B's receive: the output gradient
        # moves while its R runs (the executor posts the receive ahead). In GPT small's
        # 2-stage pipelines, every action recorded (2026-11-29), stage 0 waited 0.22 ms
        # (median) in each receive before a B under the shifted schedule, against 2.74
        # under 1F1B; with the same 0.77 ms stall charged on both, the shifted schedule
        # came out 5.0-11.5 points over 1F1B in all 11 runs of `benchmarks/accuracy.py`
        send, receive = hw.send_overhead_s, hw.receive_overhead_s + hw.receive_stall_s
        b_receive = hw.receive_overhead_s + (0.0 if redo else hw.receive_stall_s)
        f += action + (0.0 if last else send) + (0.0 if first else receive)
        b += b_action + (0.0 if first else send) + (0.0 if last else b_receive)
        r += action - hw.action_overhead_s
        if split and not frozen:
            # a W is one more action (the executor's own cost), asks autograd for each
            # weight op's gradient apart, and accumulates the stage's parameter gradients,
            # which its B (input gradients only) then does not: the per-parameter cost
            # moves from B to W, it is not paid twice (GPT small's 2-stage zero-bubble
            # pipelines, every action recorded, 2026-11-28: B + W took 1.3 ms more than
            # 1F1B's B per microbatch, priced 2.1 ms more with it paid twice, and
            # zero-bubble plans came out 5-7 points further over than 1F1B)
            # And the two passes take longer than the fused backward in proportion to its
            # time (`Hardware.split_backward_share`: each weight gradient made from
            # operands the B left cold; GPT small's B + W ran 1.27-1.42 times 1F1B's B,
            # the same stages, 2026-11-30), each pass its own part of it.
            moved = hw.param_action_overhead_s * trained_params
            own = hw.action_overhead_s + hw.weight_op_overhead_s * weight_ops
            b += own + hw.split_backward_share * computed_b
            w += own + moved + hw.split_backward_share * computed_w
    # transitions are in the point's time; spread them over forward and backward
    trans = (pt.time - sum(times)) / m
    p2p = _p2p(ctx, config, idx) if config.stages > 1 else 0.0
    f += trans / 2 + p2p
    if frozen:  # (no gradients to re-lay out; the one it receives is a token's)
        f += trans / 2
        b += _p2p_token(ctx, config) if idx[-1] < len(a.blocks) - 1 else 0.0
    else:
        b += trans / 2 + p2p
    r += trans / 2
    # the step's own costs (per parameter, the gradients' reductions): one stage runs them
    # within its backwards; a pipeline stage's rank after its last action, outside the
    # schedule (`assemble`)
    backward = max(0.0, b + (extra / m if config.stages == 1 else 0.0))
    step_extra = extra if config.stages > 1 else 0.0
    # a W is a part of its stage's backward (zero-bubble splits it into the input gradients,
    # B, and the weight gradients, W), so never more than it: a profile whose fixed costs
    # and op curves came out so that the weight ops' share (each op's `min(forward,
    # backward)`) passed the whole stage's backward made B negative, and the schedule
    # simulator refused the plan (the median of 5 calibrations, 2026-11-27: B -0.4 ms)
    w = max(0.0, min(w, backward))
    if redo or frozen:  # its first F runs without autograd's graph (its R records it)
        f -= no_grad_saving
    else:  # (its frozen prefix's part of the saving, as its share of the forward)
        f -= no_grad_saving * prefix_share
    if frozen:  # its R does nothing: it has no backward to recompute for
        r = 0.0
    sums = _StageSums(tuple(options), tuple(costs), tuple(times), tuple(mems), f,
                      backward, w, pbytes, r, f_sync, b_sync, step_extra)
    ctx.stage_sums[key] = sums
    return sums


def _pick(config: Config, stage_points: list[tuple[list[int], list[StagePoint]]],
          limit: float, objective: str) -> list[tuple[Point, float]] | None:
    """Per stage, its frontier point and the peak memory of its rank. One stage per rank:
    its best point within `limit`. Several (interleaved): the rank's stages share `limit`,
    their workspaces do not add (one backward runs at a time): from each stage's best
    point, the stage whose next point saves the most bytes per second lost steps down
    until the rank fits."""
    p = config.stages
    n = len(stage_points)
    key = (lambda x: (x[1], x[0].time)) if objective == "memory" else \
        (lambda x: (x[0].time, x[1]))
    if n == p:
        out = []
        for _, pts in stage_points:
            fit = [x for x in pts if x[1] <= limit]
            if not fit:
                return None
            pt, mem, _ = min(fit, key=key)
            out.append((pt, mem))
        return out
    picked: list[tuple[Point, float] | None] = [None] * n
    for r in range(p):
        mine = list(range(r, n, p))
        # per stage its points best first, each with its workspace (`_extra`)
        ranked: list[list[StagePoint]] = []
        for s in mine:
            fit = sorted((x for x in stage_points[s][1] if x[1] <= limit), key=key)
            if not fit:
                return None
            ranked.append(fit)
        at = [0] * len(mine)
        while _rank_memory(ranked, at) > limit:
            step = None
            for j in range(len(mine)):
                cur = ranked[j][at[j]]
                for nxt in range(at[j] + 1, len(ranked[j])):
                    cand = ranked[j][nxt]
                    if cand[1] < cur[1]:
                        gain = (cur[1] - cand[1]) / max(cand[0].time - cur[0].time, 1e-12)
                        if step is None or gain > step[0]:
                            step = (gain, j, nxt)
                        break
            if step is None:
                return None
            at[step[1]] = step[2]
        total = _rank_memory(ranked, at)
        for j, s in enumerate(mine):
            picked[s] = (ranked[j][at[j]][0], total)
    return [x for x in picked if x is not None]


def _rank_memory(ranked: list[list[StagePoint]], at: list[int]) -> float:
    """A rank's peak over its stages' chosen points: their bytes, one workspace (a stage's
    point memory includes its own workspace)."""
    here = [ranked[j][at[j]] for j in range(len(ranked))]
    return sum(mem - ws for _, mem, ws in here) + max(ws for _, _, ws in here)


def _p2p(ctx: SearchContext, config: Config, idx: list[int]) -> float:
    """Seconds to send one microbatch's boundary activations to the next stage."""
    key = (config, idx[-1])
    hit = ctx.p2p.get(key)
    if hit is not None:
        return hit
    ctx.p2p[key] = t = _p2p_time(ctx, config, idx)
    return t


def boundary_bytes(ctx: SearchContext, config: Config, k: int,
                   floating: bool = False) -> float:
    """Bytes per device of one microbatch's values that block `k` hands to later blocks
    (what a stage ending with it sends on); with `floating`, of those that have a
    gradient (what the next stage sends back)."""
    key = (config, k, floating)
    hit = ctx.boundaries.get(key)
    if hit is not None:
        return hit
    a = ctx.analysis
    if floating and k < a.first_trained:
        # nothing before the first block that trains requires grad: the executor sends
        # back a one-element token (`pxform.runtime.pipeline.NO_GRADIENT`)
        ctx.boundaries[key] = 0.0
        return 0.0
    vals = a.values()
    scale = (ctx.global_batch // config.microbatches) / a.traced_batch
    data = config.outer * config.inner
    ctx.boundaries[key] = out = sum(vals[n].type.nbytes * scale / data
                                    for n in a.blocks[k].crossing
                                    if not floating or vals[n].type.dtype.is_floating_point)
    return out


def batch_bytes(ctx: SearchContext, idx: Sequence[int]) -> float:
    """Bytes of the batch inputs that blocks `idx` read, whole: the training loop hands
    every rank the global batch (`examples/train_gpt.py`; `pxform.auto` takes each rank's
    piece, views of it), held for the whole step on each rank whose stage reads them. An
    image model's pixels were in no block's memory: tiny HF vision models (ViT, ResNet,
    ConvNeXt, Swin at 32x32, batch 16) on 2 gloo ranks came out 9-30 % under the meter on
    one stage and 25-53 % on a pipeline's first (the fifty-third session). A batch laid out
    by `step.distribute` holds only its share: this over-counts it by the rest.

    The first layer of a stack on the input counts its batch input already, as the
    others count their input from the layer before (`Analysis.kind_reads`), at its
    share: it is left out here (counted twice, a recomputed tensor-parallel residual MLP
    came out 5.5 % over the meter)."""
    a = ctx.analysis
    reads = ctx.batch_reads
    names: set[str] = set()
    for k in idx:
        got = reads.get(k)
        if got is None:
            b = a.blocks[k]
            kind = a.kind_of_block[k]
            counted = set(a.kind_reads[kind]) if a.kind_of_block.index(kind) == k else set()
            got = reads[k] = frozenset(v.name for op in a.graph.ops[b.start:b.stop]
                                       for v in op.inputs
                                       if v.name in a.batch_inputs and v.name not in counted)
        names |= got
    vals = a.values()
    return sum(vals[n].type.nbytes for n in names) * ctx.global_batch / a.traced_batch


def transfer_bytes(ctx: SearchContext, config: Config, idx: Sequence[int], last: bool,
                   inputs: int, sent: tuple[int, int], recomputes: bool) -> tuple[float, float]:
    """Bytes a pipeline stage (blocks `idx`; `last`: the pipeline's last stage) holds for
    its transfers and recompute, as `pxform.runtime.pipeline` runs it: (held at its peak,
    alive only while a backward runs).

    Held: the stage inputs it keeps for a whole-stage recompute (`inputs` microbatches,
    `pipelines.inputs_held`), and its transfers at its peak (`sent`, `pipelines.sent`):
    the boundary outputs of the microbatches in flight (kept for their backward) or sent
    and not yet known to have arrived (a send keeps its tensor until the executor waits
    for it, `pxform.schedules.send_releases`), and the gradients of its boundary inputs
    sent and not yet known to have arrived. A stage that recomputes itself makes its
    outputs again (R): the sent ones stay beside them, one microbatch's (`held` is 1
    there). While a backward runs: the gradients of its boundary outputs, received for
    it.

    Each rank posts its next receive of either kind while the actions before it run
    (`pxform.runtime.pipeline._posted_ahead`): one more microbatch's boundary inputs are
    held, and the next boundary gradients' buffer waits beside the ones a backward reads.
    (The executor does that on gloo only; under NCCL these two buffers are an
    overestimate of one microbatch's boundary values each.)"""
    out = 0.0 if last else boundary_bytes(ctx, config, idx[-1])
    inp = boundary_bytes(ctx, config, idx[0] - 1) if idx[0] > 0 else 0.0
    grad_in = boundary_bytes(ctx, config, idx[0] - 1, floating=True) if idx[0] > 0 else 0.0
    grad_out = 0.0 if last else boundary_bytes(ctx, config, idx[-1], floating=True)
    forwards, backwards = sent
    held = inputs * inp + forwards * out + backwards * grad_in + (out if recomputes else 0.0)
    return held + inp, 2 * grad_out


def _p2p_token(ctx: SearchContext, config: Config) -> float:
    """Seconds of a gradient message that is a token (`boundary_bytes`): a transfer's
    latency."""
    hw = ctx.hardware
    return hw.comm_time("p2p", 4.0, 2, hw.level(2 * config.outer * config.inner))


def _p2p_time(ctx: SearchContext, config: Config, idx: list[int]) -> float:
    sent = boundary_bytes(ctx, config, idx[-1])
    hw = ctx.hardware
    level = hw.level(2 * config.outer * config.inner)
    return hw.comm_time("p2p", sent, 2, level) if sent else 0.0

