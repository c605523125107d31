"""The auto-search on abstract meshes: golden choices, the frontier DP against brute force,
plans as values, constraints and their errors. No processes: everything runs on fake
tensors (`test_auto.py` runs plans on gloo worlds)."""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import optree
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import pxform
from pxform.core.layout import LOCAL_STEPS
from pxform.lower.spmd import ConvertInstr
from pxform.passes.cuts import balance as linear_partition
from pxform.search import Pin, pin_of
from pxform.search.frontier import chain_frontier
from pxform.search.pipelines import ScheduleChoice
from pxform.search.space import Option

# ---------------------------------------------------------------- models

# this project's 2-rank CPU machine, as `pxform calibrate` measured it (tests/golden)
CPU_PROFILE = str(Path(__file__).parent / "golden" / "cpu-x2-profile.json")


def residual_mlp(params, x, y):
    h = x
    for p in params["layers"]:
        h = h + F.linear(F.gelu(F.linear(h, p["w1"])), p["w2"])
    return ((h - y) ** 2).mean()


def mlp_args(d: int = 2048, layers: int = 8, batch: int = 16384):
    """Big enough that compute dominates: 8 layers of 2 x 4d x d weights, on meta."""
    params = {"layers": [{"w1": torch.empty(4 * d, d, device="meta"),
                          "w2": torch.empty(d, 4 * d, device="meta")} for _ in range(layers)]}
    return params, torch.empty(batch, d, device="meta"), torch.empty(batch, d, device="meta")


MLP = mlp_args()


def plan_mlp(budget: str, **kw):
    step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(4), memory_budget=budget,
                       hardware="a100-80gb", **kw)
    return step.plan(*MLP)


def roles(plan) -> set[str]:
    return {r for b in plan.blocks for _, r in b.roles}


# ---------------------------------------------------------------- golden choices


def test_plenty_of_memory_gives_data_parallel():
    plan = plan_mlp("80GiB")
    assert plan.stages == 1
    assert roles(plan) == {"dp"}
    assert not any(b.recompute for b in plan.blocks)
    assert plan.peak_memory_bytes <= 80 * 2**30


def test_tight_memory_gives_zero3_or_tensor_parallel():
    plan = plan_mlp("4GiB")
    assert roles(plan) & {"sdp", "tp"}
    assert not any(b.recompute for b in plan.blocks)
    assert plan.peak_memory_bytes <= 4 * 2**30
    # and it costs time: the unconstrained plan is at least as fast
    assert plan_mlp("80GiB").step_time_s <= plan.step_time_s


def test_near_ties_take_the_simplest_plan():
    """Plans predicted within `tolerance` (5 % by default) of the fastest are ties, and the
    one with fewer pipeline stages, then fewer microbatches, wins: the model's error is
    larger than such gains, and near-ties flipped with each calibration. tolerance=0 takes
    the fastest; the plan's notes name it, and explain() marks the plan taken."""
    fastest = plan_mlp("2GiB", tolerance=0.0)
    simple = plan_mlp("2GiB")
    assert (fastest.stages, fastest.microbatches) == (4, 32), fastest.config_text()
    assert (simple.stages, simple.microbatches) == (2, 16), simple.config_text()
    assert fastest.step_time_s < simple.step_time_s <= 1.05 * fastest.step_time_s
    note = next(n for n in simple.notes if n.startswith("taken over the fastest plan found"))
    assert "pp=4 outer=1 inner=1 microbatches=32 schedule=zb at" in note
    assert "tolerance=0.05" in note and "pass tolerance=0 for the fastest" in note
    assert not any(n.startswith("taken over") for n in fastest.notes)
    assert "why this plan: the simplest near-tie of the fastest" in simple.explain()
    assert "why this plan: the fastest within the budget" in fastest.explain()
    why = simple.explain().split("why this plan:")[1]
    assert "\n*  " + simple.config_text() in why
    with pytest.raises(pxform.PxformError, match=r"tolerance=1; give a fraction of the "
                                                 r"fastest plan's step in \[0, 1\)"):
        plan_mlp("2GiB", tolerance=1)


def test_tighter_memory_recomputes():
    plan = plan_mlp("1.4GiB")
    assert any(b.recompute for b in plan.blocks)
    assert plan.peak_memory_bytes <= 1.4 * 2**30


def test_below_the_minimum_says_what_is_needed_and_what_fits():
    with pytest.raises(pxform.SearchError) as err:
        plan_mlp("0.9GiB", memory_margin=0.0)
    text = str(err.value)
    assert "no plan fits 922 MiB per device on 4 devices (a100-80gb) for global batch 16384" \
        in text
    need = re.search(r"the least memory any plan needs there is ([\d.]+) GiB", text)
    assert need and 1.0 < float(need.group(1)) < 1.2
    with pytest.raises(pxform.SearchError):  # and it is really needed
        plan_mlp(f"{float(need.group(1)) * 0.99}GiB", memory_margin=0.0)
    plan_mlp(f"{need.group(1)}GiB", memory_margin=0.0)  # and enough
    assert "8 devices fit it" in text
    assert "Fix: raise memory_budget (--memory on the command line) to at least" in text


def test_memory_margin_keeps_part_of_the_budget_free():
    """`auto`'s memory_margin (5 % by default): plans fit the budget less the margin, the
    error says so and what budget fits with it, and the plan reports its headroom."""
    with pytest.raises(pxform.SearchError) as err:
        plan_mlp("0.9GiB")
    text = str(err.value)
    assert ("no plan fits 876 MiB per device (922 MiB less a 5% safety margin, "
            "memory_margin=) on 4 devices") in text
    at_least = re.search(r"to at least ([\d.]+) GiB, lower memory_margin", text)
    assert at_least
    plan = plan_mlp(f"{at_least.group(1)}GiB")  # the budget it names is enough
    assert plan.peak_memory_bytes <= 0.95 * plan.memory_budget
    assert plan.headroom_bytes == plan.memory_budget - plan.peak_memory_bytes
    assert plan.headroom_bytes >= 0.05 * plan.memory_budget
    assert any("memory margin 5%" in n for n in plan.notes)
    assert "headroom" in plan.explain() and "of the budget" in plan.explain()
    # why it won: the frontier, fastest first, the chosen point marked
    why = plan.explain().split("why this plan:")[1]
    assert "\n*  " + plan.config_text().split(" schedule")[0] in why
    with pytest.raises(pxform.SearchError):  # without the margin it would not be
        plan_mlp(f"{float(at_least.group(1)) * 0.94}GiB")
    plan_mlp(f"{float(at_least.group(1)) * 0.96}GiB", memory_margin=0.0)
    with pytest.raises(pxform.PxformError, match=r"memory_margin=1.5; give a fraction of "
                                                 r"memory_budget in \[0, 1\)"):
        plan_mlp("80GiB", memory_margin=1.5)


def test_objectives_memory_and_devices():
    fast = plan_mlp("80GiB")
    small = plan_mlp("80GiB", objective="memory")
    assert small.peak_memory_bytes < fast.peak_memory_bytes
    assert small.step_time_s >= fast.step_time_s
    few = plan_mlp("16GiB", objective="devices")
    assert few.devices < 4  # the model fits on fewer devices than offered
    assert few.peak_memory_bytes <= 16 * 2**30


def test_megatron_pattern_comes_out_of_the_op_rules():
    """Pinned to tensor parallelism on every block of a GPT, the op-level search lays the
    weights out column-then-row, as Megatron does (nothing names linear layers)."""
    import dataclasses

    import gpt

    # GPT-1.3B's layer shape (d 2048, seq 2048), two layers: sizes where bandwidth, not
    # latency, decides (on tiny tensors fewer collectives can beat Megatron, rightly)
    cfg = dataclasses.replace(gpt.GPT_CONFIGS["1.3B"], num_layers=2)
    params = gpt.init_params(cfg, device="meta", dtype=torch.bfloat16)
    batch = gpt.make_batch(cfg, 8, device="meta")
    tp = Option((("inner", "tp"),), False)
    step = pxform.auto(gpt.loss_fn, mesh=4, hardware="a100-80gb",
                       plan=Pin(stages=1, outer=1, inner=4, microbatches=1,
                                block_options=(tp,) * 4))
    specs = dict(step.plan(params, batch, cfg).param_specs)
    for k in range(cfg.num_layers):
        assert specs[f"blocks.{k}.qkv_w"] == "P('inner')"   # column
        assert specs[f"blocks.{k}.proj_w"] == "P(None, 'inner')"  # row
        assert specs[f"blocks.{k}.fc_w"] == "P('inner')"    # column
        assert specs[f"blocks.{k}.out_w"] == "P(None, 'inner')"   # row
        assert specs[f"blocks.{k}.ln1_w"] == "P()"


# ---------------------------------------------------------------- plans as values


def test_save_load_diff_and_determinism(tmp_path):
    plan = plan_mlp("4GiB")
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = pxform.Plan.load(path)
    assert loaded == plan
    assert loaded.diff(plan) == ""
    again = plan_mlp("4GiB")  # a fresh search
    assert again.diff(plan) == "" and again.to_json()["blocks"] == plan.to_json()["blocks"]
    # a loaded plan passed back pins every choice and gives the same plan
    pinned = pxform.auto(residual_mlp, mesh=4, memory_budget="4GiB", hardware="a100-80gb",
                         plan=loaded).plan(*MLP)
    assert pinned.diff(plan) == ""


def test_diff_names_what_changed():
    a, b = plan_mlp("80GiB"), plan_mlp("1.4GiB")
    text = a.diff(b)
    assert "memory_budget: 85899345920 -> 1503238553" in text
    assert re.search(r"block layer \d+: stage \d .* -> stage \d .*\+recompute", text)


def test_explain_reports_blocks_stages_and_predictions():
    plan = plan_mlp("1.4GiB")
    text = plan.explain()
    assert text.startswith("plan for residual_mlp: 4 devices (a100-80gb), budget 1.4 GiB")
    assert "predicted step" in text and "peak memory" in text
    assert "+recompute" in text
    if plan.stages > 1:
        assert "F/microbatch" in text and "in flight" in text
    assert str(plan) == text


def test_frontier_is_pareto_and_contains_the_plan():
    """The frontier's points, least memory first, none dominated but the plan's own (a
    simpler plan taken within `tolerance` of a faster one is shown, to be marked)."""
    plan = plan_mlp("8GiB")
    points = plan.frontier()
    assert len(points) >= 2
    assert [p.memory_bytes for p in points] == sorted(p.memory_bytes for p in points)
    own = [p for p in points if p.config == plan.config_text().split(" schedule")[0]
           and abs(p.time_s - plan.step_time_s) <= 1e-12]
    assert own, (plan.config_text(), points)
    others = [p for p in points if p is not own[0]]
    times = [p.time_s for p in others]
    assert all(t1 > t2 for t1, t2 in zip(times, times[1:]))  # none dominated
    assert min(p.time_s for p in points) <= plan.step_time_s + 1e-12
    assert all(p.memory_bytes <= 8 * 2**30 for p in points)


def test_partial_pin_keeps_what_is_pinned():
    plan = plan_mlp("80GiB", plan=Pin(stages=2, microbatches=4))
    assert (plan.stages, plan.microbatches) == (2, 4)
    assert {b.stage for b in plan.blocks} == {0, 1}


def test_profile_gives_the_best_plan_per_device_count():
    prof = pxform.profile(residual_mlp, *MLP, devices=[1, 2, 4], memory_budget="4GiB",
                          hardware="a100-80gb")
    text = str(prof)
    assert text.splitlines()[0] == "profile of residual_mlp: best plan per device count"
    by = {n: p for n, p, _ in prof.plans}
    assert by[1] is None and "no plan fits" in dict((n, w) for n, _, w in prof.plans)[1] \
        or by[1] is not None
    assert by[4] is not None and by[4].devices == 4
    if by[2] is not None:
        assert by[4].step_time_s < by[2].step_time_s


def test_batch_range_searches_the_batch():
    plan = plan_mlp("80GiB", batch_range=(4096, 16384))
    assert plan.global_batch in (4096, 8192, 16384)


# ---------------------------------------------------------------- constraints and errors


def test_stage_boundaries_are_hard_constraints():
    def marked(params, x, y):
        h = x
        for k, p in enumerate(params["layers"]):
            if k == 2:
                h = pxform.stage_boundary(h)
            h = h + F.linear(F.gelu(F.linear(h, p["w1"])), p["w2"])
        return ((h - y) ** 2).mean()

    step = pxform.auto(marked, mesh=4, memory_budget="80GiB", hardware="a100-80gb")
    plan = step.plan(*MLP)
    assert plan.stages == 2
    first = [b.stage for b in plan.blocks]
    assert first == sorted(first) and first.count(0) == 2  # cut where the user marked it
    with pytest.raises(pxform.SearchError, match=r"marks 2 pipeline stages with "
                       r"pxform.stage_boundary, but the pinned plan has stages=4"):
        pxform.auto(marked, mesh=4, memory_budget="80GiB", hardware="a100-80gb",
                    plan=Pin(stages=4)).plan(*MLP)


def test_contradictory_or_bad_settings_are_refused(tmp_path):
    with pytest.raises(pxform.SearchError, match=r"3 pipeline stages do not divide 4 "
                       r"devices"):
        plan_mlp("80GiB", plan=Pin(stages=3))
    with pytest.raises(pxform.SearchError, match=r"objective='speed'; use one of"):
        plan_mlp("80GiB", objective="speed")
    plan = plan_mlp("80GiB")
    with pytest.raises(pxform.PxformError, match=r"the pinned plan is for 4 devices but "
                       r"mesh= gives 8"):
        pxform.auto(residual_mlp, mesh=8, hardware="a100-80gb", plan=plan)
    with pytest.raises(pxform.PxformError, match=r"memory_budget"):
        pxform.auto(residual_mlp, mesh=4, memory_budget="lots")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something else"}')
    with pytest.raises(pxform.PxformError, match=r"is not a pxform plan"):
        pxform.Plan.load(bad)
    bad.write_text("{not json")
    with pytest.raises(pxform.PxformError, match=r"bad.json is not JSON"):
        pxform.Plan.load(bad)
    with pytest.raises(pxform.SearchError, match=r"the pin gives 2 block options but the "
                       r"function has 9 blocks \(layer 0, layer 1, layer 2, layer 3, ...\)"):
        plan_mlp("80GiB", plan=Pin(block_options=(None, None)))
    # a pinned per-block option that the mesh cannot have
    tp = Option((("inner", "tp"),), False)
    with pytest.raises(pxform.SearchError, match=r"no plan exists on 4 devices \(a100-80gb\) "
                       r"for global batch 16384 at any memory budget: .*; pinned: stages=1, "
                       r"outer=4, inner=1"):
        plan_mlp("80GiB", plan=Pin(stages=1, outer=4, inner=1, block_options=(tp,) * 9))


# ---------------------------------------------------------------- the frontier DP


def _brute(times, mems, tt, tm, limit=math.inf):
    out = []
    for combo in itertools.product(*[range(len(t)) for t in times]):
        t = sum(times[k][c] for k, c in enumerate(combo))
        m = sum(mems[k][c] for k, c in enumerate(combo))
        for k in range(1, len(combo)):
            t += tt[k][combo[k - 1], combo[k]]
            m += tm[k][combo[k - 1], combo[k]]
        if m <= limit:
            out.append((t, m, combo))
    return out


@st.composite
def chains(draw):
    n = draw(st.integers(1, 4))
    sizes = [draw(st.integers(1, 3)) for _ in range(n)]
    num = st.integers(0, 20).map(float)
    times = [np.array([draw(num) for _ in range(s)]) for s in sizes]
    mems = [np.array([draw(num) for _ in range(s)]) for s in sizes]
    tt = [None] + [np.array([[draw(num) for _ in range(sizes[k])] for _ in range(sizes[k - 1])])
                   for k in range(1, n)]
    tm = [None] + [np.array([[draw(st.integers(0, 3).map(float)) for _ in range(sizes[k])]
                             for _ in range(sizes[k - 1])]) for k in range(1, n)]
    limit = draw(st.one_of(st.just(math.inf), st.integers(0, 60).map(float)))
    return times, mems, tt, tm, limit


@given(chains())
def test_frontier_dp_equals_brute_force(chain):
    times, mems, tt, tm, limit = chain
    pts = chain_frontier(times, mems, tt, tm, limit=limit)
    brute = _brute(times, mems, tt, tm, limit)
    if not brute:
        assert pts == []
        return
    # no point dominated by another; each is a real plan with the reported costs
    for p in pts:
        assert not any(q.time <= p.time and q.memory <= p.memory and
                       (q.time, q.memory) != (p.time, p.memory) for q in pts)
        real = _brute([t[[c]] for t, c in zip(times, p.choices)],
                      [m[[c]] for m, c in zip(mems, p.choices)],
                      [None] + [x[np.ix_([p.choices[k - 1]], [p.choices[k]])]
                                for k, x in enumerate(tt) if k > 0],
                      [None] + [x[np.ix_([p.choices[k - 1]], [p.choices[k]])]
                                for k, x in enumerate(tm) if k > 0])
        assert real[0][:2] == (p.time, p.memory)
    # it has brute force's fastest and smallest plans, and nothing brute force beats
    fastest = min(brute, key=lambda x: (x[0], x[1]))
    smallest = min(brute, key=lambda x: (x[1], x[0]))
    assert any((p.time, p.memory) == fastest[:2] for p in pts)
    assert any((p.time, p.memory) == smallest[:2] for p in pts)
    for t, m, _ in brute:
        assert any(p.time <= t and p.memory <= m for p in pts)


def balance(costs, num_stages):
    """The exact reference: dynamic programming over contiguous partitions (ties: the
    earliest cuts), O(stages x items^2)."""
    n = len(costs)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    # best[k][i]: the least max cost of splitting items [0, i) into k groups
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i] - 1e-9 * max(1.0, abs(value)):
                    best[k][i], cut[k][i] = value, j
    stages = [0] * n
    i = n
    for k in range(num_stages, 0, -1):
        j = cut[k][i]
        for t in range(j, i):
            stages[t] = k - 1
        i = j
    return tuple(stages)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=14), st.integers(1, 6))
def test_linear_partition_matches_the_dp_balance(costs, parts):
    parts = min(parts, len(costs))
    a = linear_partition(costs, parts)
    b = balance(costs, parts)
    assert sorted(set(a)) == list(range(parts)) and list(a) == sorted(a)

    def worst(part):
        return max(sum(c for c, q in zip(costs, part) if q == s) for s in range(parts))

    assert worst(a) == worst(b)


def test_pin_of_round_trips_a_plan():
    plan = plan_mlp("4GiB")
    p = pin_of(plan)
    assert p.stages == plan.stages and len(p.block_options) == len(plan.blocks)
    assert [o.text() for o in p.block_options] == [b.strategy for b in plan.blocks]


def test_plans_with_a_measured_profile(tmp_path):
    """A profile written by calibrate (here: this process, compute only) plans like a
    preset; its measured FLOP/s set the compute times."""
    import factories

    from pxform.runtime.calibrate import calibrate

    hw = calibrate(sizes=(1024,), repeats=1)
    path = tmp_path / "cpu.json"
    hw.save(path)
    fn, args = factories.gpt_tiny()
    plan = pxform.auto(fn, mesh=2, hardware=str(path), memory_budget="1GiB").plan(*args)
    assert plan.hardware == hw.name and plan.devices == 2
    assert sum(b.time_s for b in plan.blocks) > 0 and plan.step_time_s > 0


def test_a_function_needing_the_whole_batch_gets_no_pipeline():
    """Rows taken in reverse order by position (`x[arange(B).flip(0)]`): data parallelism
    gathers the batch, a pipeline's microbatches cannot. The search plans no pipeline for
    it, and a pinned one is refused with the op that needs the whole batch. (HF BERT's
    padding mask, indexed by `arange(B)` in order, was such a function until its row
    lookups were traced as per-row indexing: `pxform.frontend.rows`.)"""
    def reversed_rows(params, x):
        h = x[torch.arange(x.shape[0]).flip(0)]
        for w in params:
            h = torch.tanh(h @ w)
        return h.pow(2).mean()

    params = [torch.randn(64, 64) for _ in range(4)]
    x = torch.randn(32, 64)
    plan = pxform.auto(reversed_rows, mesh=4, memory_budget="1GiB", hardware="a100-40gb"
                       ).plan(params, x)
    assert plan.stages == 1 and plan.microbatches == 1
    with pytest.raises(pxform.SearchError, match=r"a pipeline cuts the batch into "
                       r"microbatches, but this function needs the whole batch at once: "
                       r".*index.* reads %x \(f32\[32,64\]\) across the whole batch"):
        pxform.auto(reversed_rows, mesh=4, memory_budget="1GiB", hardware="a100-40gb",
                    plan=Pin(stages=2)).plan(params, x)


def test_pipelined_plans_split_the_batch_over_the_same_data_axes_in_every_block():
    """The microbatch axis is the innermost split of the batch, so a block splitting it
    over other data axes than the block before could only regroup across microbatches:
    the search keeps one set of data axes per pipelined plan (found on GPT tiny, 4
    devices: tensor-parallel embedding on stage 0, data-parallel layers on stage 1), and
    lays each batch input out as its first reader wants it."""
    import gpt

    cfg = gpt.GPT_CONFIGS["tiny"]
    params = gpt.init_params(cfg, device="meta")
    batch = gpt.make_batch(cfg, 8, device="meta")
    for the_pin in (None, Pin(stages=2, microbatches=2), Pin(stages=2, microbatches=4)):
        plan = pxform.auto(gpt.loss_fn, mesh=4, memory_budget="40GiB", hardware="a100-40gb",
                           plan=the_pin).plan(params, batch, cfg)
        if plan.microbatches == 1:
            continue
        data = {tuple(ax for ax, r in b.roles if r in ("dp", "sdp")) for b in plan.blocks}
        assert len(data) == 1, plan.explain(per_block=True)
        axes = next(iter(data))
        want = repr(pxform.P(axes if len(axes) > 1 else axes[0])) if axes else "P()"
        assert len(plan.batch_specs) == 2  # idx and targets
        assert {spec for _, spec in plan.batch_specs} == {want}, plan.batch_specs


def test_the_memory_bound_prunes_without_changing_the_least_memory_plan(monkeypatch):
    """The least-memory search skips configurations whose memory lower bound exceeds the
    best plan so far (it made the infeasibility diagnosis for GPT-3 175B on 64 A100-40GB
    1.7x faster); the bound must hold for every plan it evaluates, and the plan must be the
    one the exhaustive search finds."""
    import pxform.search.partition as core

    evaluated: list[object] = []
    real_evaluate, real_bound = core.evaluate, core.memory_lower_bound

    def counting(ctx, config, objective="time", incumbent=math.inf, *rest):
        cand, more = real_evaluate(ctx, config, objective, incumbent, *rest)
        evaluated.append(config)
        for c in ([cand] if cand is not None else []) + list(more):
            assert real_bound(ctx, config) <= c.peak_memory * (1 + 1e-12), config
        return cand, more

    monkeypatch.setattr(core, "evaluate", counting)
    pruned = plan_mlp("80GiB", objective="memory")
    pruned_count = len(evaluated)
    evaluated.clear()
    monkeypatch.setattr(core, "memory_lower_bound", lambda ctx, config: 0.0)
    exhaustive = plan_mlp("80GiB", objective="memory")
    assert pruned_count < len(evaluated)
    assert pruned.peak_memory_bytes == exhaustive.peak_memory_bytes
    assert pin_of(pruned) == pin_of(exhaustive)


def test_the_time_bound_holds_with_per_step_costs_after_the_schedule(monkeypatch):
    """`bounds.lower_bound` spreads the least work over the stages with each schedule's
    warm-up and drain; the blocks' per-step costs (a data-parallel all-reduce beyond what
    overlaps, `OptionCost.step_extra`) run once after the schedule
    (`stages.after_schedule`), so the bound must not charge the warm-up's factor on them,
    or it passes plans it should bound (and branch and bound skips them). Checked on every
    plan the search evaluates, with a per-collective cost that makes those costs large."""
    import pxform.search.partition as core
    from pxform.cost.hardware import hardware
    from pxform.search.bounds import lower_bound

    seen = []
    real_evaluate = core.evaluate

    def checking(ctx, config, objective="time", incumbent=math.inf, *rest):
        cand, more = real_evaluate(ctx, config, objective, incumbent, *rest)
        for c in ([cand] if cand is not None else []) + list(more):
            if config.stages > 1 and any(st.step_extra > 0 for st in c.stages):
                seen.append(config)
            assert lower_bound(ctx, config) <= c.step_time * (1 + 1e-9), config
        return cand, more

    monkeypatch.setattr(core, "evaluate", checking)
    slow = dataclasses.replace(hardware("a100-80gb"), collective_overhead_s=2e-3)
    for pin in (Pin(stages=2, outer=2), Pin(stages=2, outer=4), Pin(stages=4, outer=2)):
        pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(8), memory_budget="80GiB",
                    hardware=slow, plan=pin).plan(*MLP)
    assert seen  # (pipelines with per-step costs were evaluated)


def test_saved_bytes_are_attributed_to_the_tensor_saved():
    """A sharded op counts each saved tensor at its own layout: so the fake-tensor run must
    say whose tensor each saved storage is (a linear saves its input x; relu its output;
    the weight, a parameter, is stored anyway and not counted, but named as saved: ZeRO-3
    keeping gathered parameters keeps it whole)."""
    from pxform.cost.model import SavedBytes, saved_bytes_per_op

    def fn(w, x):
        return F.linear(x, w).relu().sum()

    w, x = torch.randn(8, 4), torch.randn(16, 4)
    graph = pxform.trace(fn, w, x).graph
    saved = saved_bytes_per_op(graph, 0, len(graph.ops), {"w"})
    assert [str(op.target) for op in graph.ops] == ["aten.linear.default",
                                                    "aten.relu.default", "aten.sum.default"]
    assert [v.name for v in graph.ops[0].inputs] == ["x", "w"]
    # (the linear's output is saved by no op, relu's by relu: `outputs_saved`, what a
    # zero-bubble stage keeping weight-op outputs for its W adds)
    # (`packs`: whether the op saves anything, counted or not: torch's checkpoint
    # recomputes up to the last op that does)
    # (`inputs_saved`: which inputs' storages the op saves, counted here or not;
    # `outputs_alias`: the input whose storage each output is, -1 for a new one)
    assert saved[0] == SavedBytes(inputs=(16 * 4 * 4, 0), outputs=(0,), other=0,
                                  stored=("w",), outputs_saved=(False,), packs=True,
                                  inputs_saved=(True, True), outputs_alias=(-1,))
    assert saved[1] == SavedBytes(inputs=(0,), outputs=(16 * 8 * 4,), other=0,
                                  outputs_saved=(True,), packs=True, inputs_saved=(False,),
                                  outputs_alias=(-1,))
    assert saved[2].total == 0 and not saved[2].packs


def test_a_block_saves_no_activation_for_a_value_made_from_a_buffer():
    """A rotary embedding's cosines come from a module buffer and positions: they do not
    require grad when the step runs, so a layer's `q * cos` saves the cosines alone, not
    `q`. Each block's saves measured apart add up to what the whole step's autograd
    saves (HF Llama). When every floating value read from outside a block was taken to
    require grad, each layer was counted with its query and key twice over (rotated and
    not), and Llama's plans' peaks came out 8-16 % over the meter."""
    pytest.importorskip("transformers")
    import hf_zoo

    from pxform.cost.model import requiring_grad, saved_bytes_per_op
    from pxform.search.analysis import analyse

    model, inputs = hf_zoo.build("llama", dtype=torch.float32, batch=4)
    fn, params = pxform.module_fn(model)
    params = {k: v.detach() for k, v in params.items()}

    def loss(p, b):
        return fn(p, **b).loss

    graph, names, _ = pxform.auto(loss, mesh=2, hardware="a100-40gb")._graph((params, inputs))
    a = analyse(graph, names)
    per_block = sum(s.total for s in a.op_saved)
    whole = sum(s.total for s in saved_bytes_per_op(graph, 0, len(graph.ops),
                                                    set(a.params) | set(names),
                                                    requiring_grad(graph, a.params)))
    # eager autograd on the same step, parameters (stored anyway) left out
    leaves = {k: v.clone().requires_grad_(v.is_floating_point()) for k, v in params.items()}
    storages: dict[int, int] = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss(leaves, inputs)
    stored = {v.untyped_storage().data_ptr() for v in (*leaves.values(), *inputs.values())}
    eager = sum(n for ptr, n in storages.items() if ptr not in stored)
    assert whole == pytest.approx(eager, rel=0.01)
    # (blocks measured apart count the few small cosines each layer reads again)
    assert per_block == pytest.approx(eager, rel=0.02), (per_block, eager)
    # the cosines: read by every layer, required by none
    cos = next(v.name for op in graph.ops if op.name == "cos" for v in op.outputs)
    assert cos not in requiring_grad(graph, a.params)


def test_what_requires_grad_is_what_autograd_says():
    """`requiring_grad` against eager autograd, value by value, on a step with each way a
    value ends up not requiring grad: a buffer (detached), positions from `arange`, a
    `no_grad` region, a fill shaped like an activation (`zeros_like`, `new_ones`), an
    integer op; and the batch, which the step does not differentiate."""
    from pxform.cost.model import requiring_grad
    from pxform.frontend.trace import run_graph

    def step(params, x):
        freq = params["freq"].detach()
        pos = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * freq
        h = x @ params["w"]
        with torch.no_grad():
            scale = h.abs().amax()
        h = h * torch.cos(pos) + torch.zeros_like(h) * h.new_ones(h.shape)
        rows = h.argmax(-1)
        return (h / scale).sum() + (x * pos.sum()).sum() + rows.sum()

    params = {"w": torch.randn(4, 4), "freq": torch.randn(4)}
    x = torch.randn(2, 3, 4)
    graph = pxform.trace(step, params, x).graph
    trainable = {"w", "freq"}
    predicted = requiring_grad(graph, trainable)
    got: dict[str, bool] = {}
    assert [v.name for v in graph.inputs] == ["freq", "w", "x"]
    leaves = [t.clone().requires_grad_(v.name in trainable)
              for v, t in zip(graph.inputs, (params["freq"], params["w"], x))]

    def seen(op, args, results):
        for v, r in zip(op.outputs, results):
            got[v.name] = isinstance(r, torch.Tensor) and r.requires_grad

    with torch.enable_grad():
        run_graph(graph, leaves, on_op=seen)
    assert {k for k, req in got.items() if req} == predicted - set(trainable)
    assert not got[next(op.outputs[0].name for op in graph.ops if op.name == "cos")]


def test_a_storage_saved_twice_is_named_by_each_saver_and_views_name_their_input():
    """tanh saves its output; a matmul saves a reshaped view of that same storage, which is
    counted once (for tanh) but named as saved by both (`inputs_saved`); the reshape names
    the input it aliases (`outputs_alias`), and a reshape that must copy (of a transposed
    view) names none: what lets the search count the matmul's own copy when a re-layout
    sits between the two savers."""
    from pxform.cost.model import saved_bytes_per_op

    def fn(w, x):
        a = torch.tanh(x)
        copied = a.transpose(1, 2).reshape(4, 48)
        return (a.reshape(4, 48) @ w).sum() + copied.sum()

    w, x = torch.randn(48, 3), torch.randn(4, 6, 8)
    graph = pxform.trace(fn, w, x).graph
    saved = saved_bytes_per_op(graph, 0, len(graph.ops), {"w"})
    names = [str(op.target).split(".")[1] for op in graph.ops]
    tanh, transpose = names.index("tanh"), names.index("transpose")
    reshapes = {graph.ops[k].inputs[0].name: k for k, n in enumerate(names) if n == "reshape"}
    view = reshapes[graph.ops[tanh].outputs[0].name]
    copy = reshapes[graph.ops[transpose].outputs[0].name]
    matmul = next(k for k, n in enumerate(names) if n in ("matmul", "mm", "linear"))
    assert saved[tanh].outputs == (4 * 6 * 8 * 4,) and saved[tanh].outputs_alias == (-1,)
    assert saved[transpose].outputs_alias == (0,)
    assert saved[view].outputs_alias == (0,) and saved[copy].outputs_alias == (-1,)
    assert saved[matmul].inputs_saved[0] and saved[matmul].inputs[0] == 0


def test_an_embedding_lookup_of_the_token_ids_is_a_weight_op_as_the_runtime_finds_it():
    """A zero-bubble W asks autograd from every op that reads a weight and a value made
    from the batch (`pxform.lower.mpmd._weight_ops`): integer token ids count, so the
    token embedding's lookup, the sum with the positions' lookup and the matmul after
    are weight ops (the walk had taken the lookups for weights, made from parameters
    alone, and everything after them too: no weight op here at all). The stage keeps, from
    F to W, the outputs no op saves (the token lookup, the matmul's) and the position
    lookup its sum reads as a weight; B keeps each weight op's output gradient, the token
    lookup's being the sum's as the add hands it on (`GRAD_PASSTHROUGH`)."""
    from pxform.cost.model import CostModel
    from pxform.search.analysis import analyse
    from pxform.search.context import SearchContext
    from pxform.search.options import walk_cost
    from pxform.search.space import Config, options

    def lm(params, ids):
        wte, wpe, w = params
        x = F.embedding(ids, wte) + F.embedding(torch.arange(ids.shape[1]), wpe)
        return torch.tanh(x @ w).square().mean()

    b, s, d, v = 8, 16, 32, 64
    params = [torch.randn(v, d), torch.randn(s, d), torch.randn(d, d)]
    hw = pxform.hardware.hardware("a100-80gb")
    graph, names, _ = pxform.auto(lm, mesh=1, hardware=hw)._graph(
        (params, torch.randint(0, v, (b, s))))
    a = analyse(graph, names)
    config = Config(1, 1, 1, 1)
    (block,) = a.blocks
    w = walk_cost(SearchContext(a, CostModel(hw), math.inf, b), block, config,
                  options(config)[0])
    act, pos = b * s * d * 4, s * d * 4
    assert w.weight_ops == 3
    assert w.weight_out_bytes == 2 * act  # the sum's and the matmul's output gradients
    assert w.weight_held_bytes == act + pos + act  # token lookup, position lookup, matmul


def test_a_reshape_that_is_a_view_only_by_its_inputs_strides_is_marked():
    """`SavedBytes.restrides`: a reshape that is a view of a transposed view (here of a
    transposed view: strides a kernel's output may have) is marked, since a sharded rank
    whose kernel returns its own layout copies there; a reshape of a value as its op made
    it is not, nor one that copies already."""
    from pxform.cost.model import saved_bytes_per_op

    def fn(x):
        a = torch.tanh(x)
        back = a.transpose(1, 2).transpose(1, 2).reshape(4, 48)  # a view: marked
        plain = a.reshape(4, 48)  # a view of tanh's own output: not marked
        copied = a.transpose(1, 2).reshape(4, 48)  # a copy already: not marked
        return (back * plain * copied).sum()

    x = torch.randn(4, 6, 8)
    graph = pxform.trace(fn, x).graph
    saved = saved_bytes_per_op(graph, 0, len(graph.ops), set())
    names = [str(op.target).split(".")[1] for op in graph.ops]
    reshapes = [k for k, n in enumerate(names) if n == "reshape"]
    assert len(reshapes) == 3
    assert [saved[k].restrides for k in reshapes] == [True, False, False]
    assert [saved[k].outputs_alias for k in reshapes] == [(0,), (0,), (-1,)]


def test_a_relayout_copies_storage_unless_it_is_a_slice_of_one_contiguous_run():
    """`relayout_copies_storage`: a collective's output is new; a slice along dim 0 (one
    contiguous run) is a view of its input, a slice along a later dim a copy; steps over
    an axis of one device run nothing."""
    from pxform.core.layout import Layout, plan_relayout
    from pxform.core.mesh import AbstractMesh
    from pxform.core.spec import P
    from pxform.cost.model import relayout_copies_storage

    mesh = AbstractMesh({"tp": 2})

    def own(src, dst, sizes=None):
        r = plan_relayout((64, 128), 4, Layout.of(src, 2), Layout.of(dst, 2), mesh)
        local = Layout.of(src, 2).local_shape((64, 128), mesh)
        return relayout_copies_storage(r, local, sizes or {"tp": 2})

    assert own(P(), P("tp")) is False                 # rows 0-31: a view
    assert own(P(), P(None, "tp")) is True            # columns 0-63 of each row: a copy
    assert own(P("tp"), P()) is True                  # an all-gather
    assert own(P(None, "tp"), P("tp")) is True        # an all-to-all
    assert own(P(), P(None, "tp"), {"tp": 1}) is False


def test_block_memory_counts_gradients_as_they_replace_activations():
    """`OptionCost.memory`: with every microbatch in flight before the first backward the
    block counts max(activations, gradients) on top of weights and optimizer state;
    otherwise gradients and the in-flight activations together. The workspace adds the
    block's activations when it is recomputed."""
    from pxform.search.context import OptionCost

    c = OptionCost(forward=0.0, backward=0.0, step_extra=0.0, saved=100.0, kept=10.0,
                   params=160.0, grads=40.0, transient=5.0)
    assert c.memory(1, False, 1) == 120 + 100           # one microbatch: no pipeline
    assert c.memory(2, False, 2) == 120 + 100 + 100     # an early stage, all in flight
    assert c.memory(1, False, 4) == 160 + 100           # accumulating over microbatches
    assert c.memory(1, True, 1) == 120 + 40             # recomputed: gradients dominate
    assert (c.workspace(False), c.workspace(True)) == (5.0, 105.0)
    # with the recomputed peak known op by op, it replaces the saved + transient bound
    redo = OptionCost(forward=0.0, backward=0.0, step_extra=0.0, saved=100.0, kept=10.0,
                      params=160.0, grads=40.0, transient=5.0, redo=70.0)
    assert (redo.workspace(False), redo.workspace(True)) == (5.0, 70.0)


def test_backward_extra_orders_workspaces_and_counts_the_packed_bucket():
    """`cost.model.backward_extra`: a late block's workspace comes before the early blocks'
    gradients exist (with every microbatch in flight), and after the last backward data
    parallel's bucket is packed on top of every gradient."""
    from pxform.cost.model import BUCKET_BYTES, backward_extra
    from pxform.runtime.buckets import DEFAULT_BUCKET_MB

    acts, grads = [10.0, 10.0, 10.0], [30.0, 30.0, 30.0]
    # the last block's workspace of 50 comes while blocks 0 and 1 hold 10, not 30, each
    assert backward_extra(acts, grads, [5.0, 5.0, 50.0], 1, 1, packed=0.0) == 10.0
    # the first block's workspace comes last, on every gradient
    assert backward_extra(acts, grads, [50.0, 5.0, 5.0], 1, 1, packed=0.0) == 50.0
    # accumulating over microbatches: gradients exist from the first backward on
    assert backward_extra(acts, grads, [5.0, 5.0, 50.0], 1, 4, packed=0.0) == 50.0
    # the packed bucket, once the activations are gone: 90 bytes of gradients, 0 freed
    assert backward_extra(acts, grads, [0.0] * 3, 1, 1, packed=90.0) == 90.0
    # ... with two microbatches in flight their other activations (30) are gone too
    assert backward_extra(acts, grads, [0.0] * 3, 2, 2, packed=90.0) == 60.0
    # at most one bucket is packed at once: the runtime's own bucket size
    assert backward_extra([0.0], [1e12], [0.0], 1, 1, packed=1e12) == BUCKET_BYTES
    # a recomputed block's recompute (40) peaks before its own gradients: what they add
    # beyond its activations (30 - 10) is not on top, unless an earlier microbatch made
    # them already (2 microbatches, 1 in flight: then on everything but the 10 the block
    # after it freed of the microbatch going back); its backward ends at its transient (25)
    assert backward_extra([10.0, 10.0], [30.0, 30.0], [40.0, 5.0], 1, 1, 0.0,
                          ends=[5.0, None]) == 20.0
    assert backward_extra([10.0, 10.0], [30.0, 30.0], [40.0, 5.0], 1, 1, 0.0,
                          ends=[25.0, None]) == 25.0
    assert backward_extra([10.0, 10.0], [30.0, 30.0], [40.0, 5.0], 1, 2, 0.0,
                          ends=[5.0, None]) == 30.0
    # fewer in flight than microbatches: the first block's workspace (50) comes after the
    # blocks after it freed the microbatch's 2 x 10, unless a split backward (zero-bubble)
    # keeps them for its W actions
    assert backward_extra(acts, grads, [50.0, 5.0, 5.0], 1, 4, packed=0.0) == 30.0
    assert backward_extra(acts, grads, [50.0, 5.0, 5.0], 1, 4, packed=0.0,
                          frees=False) == 50.0
    # summing a block's gradients over microbatches (60: its largest parameter's gradient
    # and the sum replacing it) is a workspace of its own, after the first microbatch only
    assert backward_extra(acts, grads, [5.0] * 3, 1, 4, packed=0.0,
                          accumulating=[60.0, 0.0, 0.0]) == 40.0
    assert backward_extra([30.0] * 3, [10.0] * 3, [5.0] * 3, 1, 1, packed=0.0,
                          accumulating=[60.0, 0.0, 0.0]) == 5.0
    assert BUCKET_BYTES == DEFAULT_BUCKET_MB * 2**20
    # blocks keeping more activations (30) than they have gradients (10): the first
    # block's workspace (50) comes once the later blocks hold their gradients alone, 2 x 20
    # below what the summed max(activations, gradients) counted
    assert backward_extra([30.0] * 3, [10.0] * 3, [50.0, 5.0, 5.0], 1, 1, 0.0) == 10.0
    # the extra may be negative: block 0 (10 kept, 30 of gradients) ends beside block 1's
    # 5 of gradients, not its 10 of activations: 35 in all, 5 under the max's 40
    assert backward_extra([10.0, 10.0], [30.0, 5.0], [0.0, 0.0], 1, 1, 0.0) == -5.0
    # a second microbatch in flight: its backward comes on every gradient
    assert backward_extra([30.0] * 3, [10.0] * 3, [50.0, 5.0, 5.0], 2, 2, 0.0) == 10.0


def _added_by_a_flat_collective(kind: str, role: str) -> float:
    """Seconds GPT small's step (2 ranks, every block pinned to `role` on the outer axis)
    gains when `kind` costs 50 ms whatever its size, against the a100-80gb preset."""
    import dataclasses

    import gpt

    from pxform.cost.hardware import CommTable

    base = pxform.hardware.hardware("a100-80gb")
    flat = CommTable(kind, 0, 2, ((1.0, 0.05), (1e9, 0.05)))
    slow = dataclasses.replace(base, comm_tables=(flat,))
    cfg = gpt.GPT_CONFIGS["small"]
    params, batch = gpt.init_params(cfg), gpt.make_batch(cfg, 16)
    option = Option((("outer", role),), False)

    def step_time(hw: object) -> float:
        step = pxform.auto(gpt.loss_fn, mesh=2, hardware=hw,
                           plan=Pin(stages=1, outer=2, inner=1, microbatches=1,
                                    block_options=(option,) * 6))
        return step.plan(params, batch, cfg).step_time_s

    return step_time(slow) - step_time(base)


def test_data_parallel_all_reduce_is_priced_per_bucket_not_per_block():
    """The runtime packs every data-parallel gradient into 25 MiB buckets, so a step pays
    the all-reduce's latency once per bucket: with a profile whose all-reduce costs 50 ms
    whatever its size, GPT small's 6 blocks (one 3.4 MB bucket) add 50 ms to the step, not
    6 x 50 ms, plus 50 ms for the loss's mean, which the model prices as a forward
    all-reduce of its own (the runtime sends it in the bucket: a known over-count of one
    latency). 2 ranks on a 2-rank data axis."""
    added = _added_by_a_flat_collective("all_reduce", "dp")
    assert added == pytest.approx(0.10, rel=0.02), added


def test_zero3_gathers_are_priced_per_block_not_per_parameter():
    """ZeRO-3's runtime gathers a block's parameters in one packed all-gather (and again
    for backward): with a profile whose all-gather costs 50 ms whatever its size, GPT
    small's 6 blocks add 2 x 6 x 50 ms of gathers, not 2 x 52 (one per parameter)."""
    added = _added_by_a_flat_collective("all_gather", "sdp")
    # (the embedding and the head hold 2 blocks' parameters: the tied embedding, read by
    # both, is gathered by each)
    assert 2 * 6 * 0.05 * 0.95 <= added <= 2 * 7 * 0.05 * 1.05, added


def test_zero3_gathers_pay_their_packing_copies(monkeypatch: pytest.MonkeyPatch):
    """A packed gather copies on the rank's own thread: the block's shards into one
    buffer, and each parameter out of the gathered one (`pxform.runtime.buckets`). With
    every copy priced at 1 ms per MB (against free), reshard after forward (a second
    gather per block, in backward) adds those copies once more than keeping the gathered
    parameters does: half the parameters' bytes packed and all of them cut out, the tied
    embedding twice (the head gathers it again), on GPT small's ZeRO-3 step on 2 ranks."""
    import gpt

    from pxform.cost.model import CostModel

    base = pxform.hardware.hardware("a100-80gb")
    cfg = gpt.GPT_CONFIGS["small"]
    params, batch = gpt.init_params(cfg), gpt.make_batch(cfg, 16)

    def step_time(reshard: bool) -> float:
        pin = Pin(stages=1, outer=2, inner=1, microbatches=1,
                  block_options=(Option((("outer", "sdp"),), False, reshard),) * 6)
        return pxform.auto(gpt.loss_fn, mesh=2, hardware=base, plan=pin).plan(
            params, batch, cfg).step_time_s

    def regathered(per_byte: float) -> float:
        monkeypatch.setattr(CostModel, "pack_time", lambda self, nbytes: nbytes * per_byte)
        return step_time(True) - step_time(False)

    plain, copied = regathered(0.0), regathered(1e-9)
    total = sum(t.numel() * t.element_size() for t in optree.tree_leaves(params))
    wte = params["wte"].numel() * params["wte"].element_size()
    assert copied - plain == pytest.approx(1.5 * (total + wte) * 1e-9, rel=0.02), \
        (copied - plain, total, wte)


def test_zero3_reduce_scatters_meet_the_peers_per_block():
    """A collective launched after compute waits for the ranks to meet
    (`Hardware.sync_wait`): data parallelism's gradients go in one bucket, waited for
    once as backward ends; ZeRO-3's reduce-scatter goes per block as its backward ends,
    and gloo's one collective at a time holds the next block's gather behind it, so
    ZeRO-3 pays the wait per block: with every gap waiting 10 ms, GPT small's step on 2
    ranks gains 10 ms per block with parameters more under ZeRO-3 than under data
    parallelism (its plans had come out 5-12 % under beside data parallelism's 0-5)."""
    import gpt

    wait = 0.01
    base = pxform.hardware.hardware("a100-80gb")
    # (a last point far beyond any gap: the wait is `wait` at every gap, where beyond
    # the last point it would grow with the gap)
    waiting = dataclasses.replace(base, sync_wait=((1e-12, 0.0), (2e-12, wait), (1e3, wait)))
    cfg = gpt.GPT_CONFIGS["small"]
    params, batch = gpt.init_params(cfg), gpt.make_batch(cfg, 16)

    def added(role: str) -> float:
        pin = Pin(stages=1, outer=2, inner=1, microbatches=1,
                  block_options=(Option((("outer", role),), False),) * 6)
        return (pxform.auto(gpt.loss_fn, mesh=2, hardware=waiting, plan=pin)
                .plan(params, batch, cfg).step_time_s
                - pxform.auto(gpt.loss_fn, mesh=2, hardware=base, plan=pin)
                .plan(params, batch, cfg).step_time_s)

    # (6 blocks, each with parameters; the loss's mean meets the peers under both)
    assert added("sdp") - added("dp") == pytest.approx(6 * wait - wait, rel=0.02)


def test_zero3_keeps_gathered_parameters_where_memory_allows():
    """Reshard after forward is searched per block (`Option.reshard`): under a budget
    that holds some but not all of them, ZeRO-3 blocks keep the parameters they gather
    for backward (no backward all-gather) and the rest free them; pinned to free them
    everywhere, the same plan is slower and lighter by exactly the kept layers' gathered
    weights (2 x 4d x d float32, whole: 128 MiB a layer)."""
    plan = plan_mlp("4.25GiB")
    sharded = [b for b in plan.blocks if any(r == "sdp" for _, r in b.roles)]
    kept = [b for b in sharded if not b.reshard]
    assert kept and len(kept) < len(sharded), [b.strategy for b in plan.blocks]
    assert all(b.strategy.endswith(" +keep-gathered") for b in kept)
    assert any(n.startswith(f"ZeRO-3 keeps the parameters it gathers from forward to "
                            f"backward in {len(kept)} of {len(sharded)} sharded-data blocks")
               for n in plan.notes), plan.notes
    pin = pin_of(plan)
    assert pin.block_options is not None
    freeing = dataclasses.replace(pin, block_options=tuple(
        Option(o.roles, o.recompute) for o in pin.block_options if o is not None))
    freed = plan_mlp("80GiB", plan=freeing)
    assert all(b.reshard for b in freed.blocks)
    assert freed.step_time_s > plan.step_time_s
    assert plan.peak_memory_bytes - freed.peak_memory_bytes == \
        pytest.approx(len(kept) * 128 * 2**20, rel=0.02)
    # keeping needs gathered parameters: no such option without sdp, or with recompute
    with pytest.raises(ValueError, match="keeping gathered parameters needs an sdp axis"):
        Option((("outer", "dp"),), False, False)
    with pytest.raises(ValueError, match="and no recompute"):
        Option((("outer", "sdp"),), True, False)


# ---------------------------------------------------------------- schedules (golden)


def attention_stack(params, x):
    """Layers dominated by weightless matmuls (scores and mixing over a long sequence),
    with one small weight each: little for a zero-bubble W to fill the drain with."""
    h = x
    for w in params:
        scores = torch.softmax(h @ h.transpose(1, 2) / h.shape[-1] ** 0.5, dim=-1)
        h = h + F.linear(scores @ h, w)
    return (h ** 2).mean()


def plan_schedule(fn, args, budget="80GiB", hardware="a100-80gb", **pin):
    """The plan on 4 pipeline ranks, 4 microbatches, a100-80gb's fixed profile."""
    pin = Pin(stages=4, outer=1, inner=1, microbatches=4, **pin)
    step = pxform.auto(fn, mesh=pxform.Mesh.abstract(4), memory_budget=budget,
                       hardware=hardware, plan=pin, memory_margin=0.0)
    return step.plan(*args)


def test_zero_bubble_pays_the_runtime_per_weight_op():
    """A W action asks autograd for each weight op's gradient apart: a profile's
    `weight_op_overhead_s` (measured by `runtime_costs`) adds to each stage's W per weight
    op (a layer's two linears; the head's loss has none), and to nothing under 1F1B."""
    from pxform.cost.hardware import hardware

    args = mlp_args(d=1024, layers=4, batch=4096)
    slow = dataclasses.replace(hardware("a100-80gb"), weight_op_overhead_s=1e-3)
    base, paid = (plan_schedule(residual_mlp, args, hardware=hw,
                                schedule=ScheduleChoice("zb")) for hw in ("a100-80gb", slow))
    for b, p in zip(base.stage_plans, paid.stage_plans):
        ops = 2 * sum(base.blocks[k].label.startswith("layer") for k in b.blocks)
        assert p.weight_s - b.weight_s == pytest.approx(ops * 1e-3, rel=1e-6), (b, p)
        assert p.backward_s - b.backward_s == pytest.approx(ops * 1e-3, rel=1e-6)
    assert paid.step_time_s > base.step_time_s
    one, one_paid = (plan_schedule(residual_mlp, args, hardware=hw, schedule=ScheduleChoice())
                     for hw in ("a100-80gb", slow))
    assert one.step_time_s == one_paid.step_time_s


def test_zero_bubble_pays_a_share_of_its_split_backward():
    """B and W together take longer than the fused backward, in proportion to it: a
    profile's `split_backward_share` (measured by `runtime_costs`) adds that share of each
    stage's backward to its B + W and of its weight gradients to its W, and nothing under
    1F1B."""
    from pxform.cost.hardware import hardware

    args = mlp_args(d=1024, layers=4, batch=4096)
    slow = dataclasses.replace(hardware("a100-80gb"), split_backward_share=0.25)
    base, paid = (plan_schedule(residual_mlp, args, hardware=hw, schedule=ScheduleChoice("zb"))
                  for hw in ("a100-80gb", slow))
    for b, p in zip(base.stage_plans, paid.stage_plans):
        assert b.weight_s > 0
        # (the runtime's fixed costs are 0 in the preset: the W is the weight gradients'
        # own time, the backward theirs and the stage's transfers', which take no share)
        assert p.weight_s == pytest.approx(1.25 * b.weight_s, rel=1e-6), (b, p)
        assert 0.24 * b.backward_s < p.backward_s - b.backward_s <= 0.25 * b.backward_s
    assert paid.step_time_s > base.step_time_s
    one, one_paid = (plan_schedule(residual_mlp, args, hardware=hw, schedule=ScheduleChoice())
                     for hw in ("a100-80gb", slow))
    assert one.step_time_s == one_paid.step_time_s


def test_a_pipeline_action_pays_the_runtime_per_op_of_its_stage():
    """The executor runs a stage's graph once per microbatch: a profile's
    `op_action_overhead_s` (measured by `runtime_costs`) adds to each stage's F and B per
    op of the stage, and nothing without a pipeline."""
    from pxform.cost.hardware import hardware

    args = mlp_args(d=1024, layers=4, batch=4096)
    slow = dataclasses.replace(hardware("a100-80gb"), op_action_overhead_s=1e-3)
    base, paid = (plan_schedule(residual_mlp, args, hardware=hw, schedule=ScheduleChoice())
                  for hw in ("a100-80gb", slow))
    for b, p in zip(base.stage_plans, paid.stage_plans):
        ops = sum(base.blocks[k].stop - base.blocks[k].start for k in b.blocks)
        assert p.forward_s - b.forward_s == pytest.approx(ops * 1e-3, rel=1e-6), (b, p)
        assert p.backward_s - b.backward_s == pytest.approx(ops * 1e-3, rel=1e-6)
    assert paid.step_time_s > base.step_time_s
    one, one_paid = (pxform.auto(residual_mlp, mesh=4, memory_budget="80GiB", hardware=hw,
                                 plan=Pin(stages=1)).plan(*args) for hw in ("a100-80gb", slow))
    assert one.step_time_s == one_paid.step_time_s


def test_a_pipeline_action_waits_for_the_stage_it_receives_from():
    """An action that starts from a transfer meets its peer there after its own compute
    (`Hardware.sync_wait`): with a profile whose wait is 1 ms whatever the gap, each
    stage's forward has a 1 ms sync unless it is the first (its input is the batch), and
    its backward unless it is the last (it starts from the loss); the schedule's timer
    charges them where a stage meets its input (the balanced stages do, every step).
    Without a pipeline, data parallelism waits once, for its last gradient bucket when
    backward ends."""
    from pxform.cost.hardware import hardware

    args = mlp_args(d=1024, layers=4, batch=4096)
    # (1 ms at every gap: the last point far beyond any, where the wait would grow)
    waits = dataclasses.replace(hardware("a100-80gb"),
                                sync_wait=((0.0, 0.0), (1e-9, 1e-3), (1e3, 1e-3)))
    base, paid = (plan_schedule(residual_mlp, args, hardware=hw, schedule=ScheduleChoice())
                  for hw in ("a100-80gb", waits))
    last = len(base.stage_plans) - 1
    for k, (b, p) in enumerate(zip(base.stage_plans, paid.stage_plans)):
        assert (p.forward_s, p.backward_s) == (b.forward_s, b.backward_s)
        assert p.forward_sync_s == pytest.approx(1e-3 if k > 0 else 0.0, abs=1e-12)
        assert p.backward_sync_s == pytest.approx(1e-3 if k < last else 0.0, abs=1e-12)
    # the plan's step gets them where stages meet their inputs: at most on every receive
    m, p = base.microbatches, base.stages
    assert base.step_time_s < paid.step_time_s <= base.step_time_s + 1e-3 * 2 * m * (p - 1)
    huge = dataclasses.replace(waits, sync_wait=((0.0, 0.0), (1e-9, 1.0), (1e3, 1.0)))
    met = plan_schedule(residual_mlp, args, hardware=huge, schedule=ScheduleChoice())
    assert met.step_time_s > base.step_time_s + 2 * (met.stages - 1)
    one, one_paid = (pxform.auto(residual_mlp, mesh=4, memory_budget="80GiB", hardware=hw,
                                 plan=Pin(stages=1, outer=4, inner=1,
                                          block_options=(Option((("outer", "dp"),), False),) * 5)
                                 ).plan(*args) for hw in ("a100-80gb", waits))
    assert one_paid.step_time_s - one.step_time_s == pytest.approx(1e-3, abs=1e-12)


def _tensor_parallel_waits(role: str, batch: int, sync_wait: tuple, base: Any = None
                           ) -> tuple[float, int]:
    """(seconds GPT small's step on 2 ranks, every block pinned to `role` on the inner
    axis, gains with `sync_wait` against `base` (the a100-80gb preset by default); the
    lowered program's collectives on activations, forward and backward)."""
    import gpt

    from pxform.cost.hardware import hardware

    base = hardware("a100-80gb") if base is None else base
    cfg = gpt.GPT_CONFIGS["small"]
    params, data = gpt.init_params(cfg, device="meta"), gpt.make_batch(cfg, batch,
                                                                       device="meta")
    option = Option((("inner", role),), False)
    pin = Pin(stages=1, outer=1, inner=2, microbatches=1, block_options=(option,) * 6)
    plans = []
    for hw in (base, dataclasses.replace(base, sync_wait=sync_wait)):
        step = pxform.auto(gpt.loss_fn, mesh=pxform.Mesh.abstract(2), hardware=hw, plan=pin)
        plans.append((step, step.plan(params, data, cfg)))
    (step, plan), (_, paid) = plans
    program = step._cache[("checked", id(plan))].lower(params, data, cfg)
    # (a parameter's conversions are the bucketed gradients' and the gathers': apart)
    names = {v.name for v in program.inputs[:len(optree.tree_leaves(params))]}
    count = sum(len([st for st in steps if st.kind not in LOCAL_STEPS])
                for instr in program.instrs if isinstance(instr, ConvertInstr)
                and instr.src not in names
                for steps in (instr.forward.steps, instr.backward.steps))
    return paid.step_time_s - plan.step_time_s, count


def test_tensor_parallel_collectives_wait_for_the_ranks_after_their_compute():
    """Ranks meet at every collective on activations (`Hardware.sync_wait`): with a wait of
    1 ms whatever the gap, a tensor- or sequence-parallel GPT step gains 1 ms per run of
    collectives with compute between them: at least two per layer and direction, at most
    one per collective the lowered program runs on activations (and one for a gradient
    bucket). With a wait that grows
    with the compute before it, a larger batch (more compute between the same
    collectives) waits longer; a flat one does not care."""
    flat = ((0.0, 0.0), (1e-12, 1e-3), (1e3, 1e-3))  # (beyond the last point it grows)
    for role in ("tp", "sp"):
        added, count = _tensor_parallel_waits(role, 16, flat)
        runs = added / 1e-3
        assert runs == pytest.approx(round(runs), abs=1e-6)
        # (+1: sequence parallelism all-reduces the norms' gradients in a bucket, waited
        # for when backward ends)
        assert 2 * 2 * 4 <= round(runs) <= count + (role == "sp"), (role, runs, count)
    growing = ((0.0, 0.0), (1e-3, 1e-3))  # 1 ms per ms of compute to 1 ms, then its root
    small, _ = _tensor_parallel_waits("tp", 2, growing)
    large, _ = _tensor_parallel_waits("tp", 64, growing)
    assert 0 < small < large
    assert _tensor_parallel_waits("tp", 2, flat)[0] == \
        pytest.approx(_tensor_parallel_waits("tp", 64, flat)[0])


def test_a_run_of_conversions_after_compute_pays_the_relayout_overhead():
    """`Hardware.relayout_overhead_s` (what `runtime_costs` measures a conversion's
    collectives to cost in a step beyond the model's transfers and per-collective cost):
    on a profile where the compute between a GPT layer's conversions takes milliseconds,
    1 ms of it adds a whole number of ms to a tensor- or sequence-parallel step, at least
    two per layer and direction and at most one per collective on activations; sequence
    parallelism's all-to-alls, a few views after its all-gathers, join their run; a
    recomputed block pays its forward's runs again. Data parallelism (but for its loss's
    mean over the ranks) and a pipeline of whole stages run no conversion between compute,
    and pay nothing."""
    import gpt

    from pxform.cost.hardware import hardware
    from pxform.search.blockcost import RELAYOUT_GAP_S

    # every op 1,000 times the preset's: the compute between conversions is milliseconds
    slow = dataclasses.replace(hardware("a100-80gb"), op_time_scale=1000.0)
    cfg = gpt.GPT_CONFIGS["small"]
    params, data = gpt.init_params(cfg, device="meta"), gpt.make_batch(cfg, 16,
                                                                       device="meta")

    def added(pin: Pin) -> float:
        times = [pxform.auto(gpt.loss_fn, mesh=pxform.Mesh.abstract(2), hardware=hw,
                             plan=pin).plan(params, data, cfg).step_time_s
                 for hw in (slow, dataclasses.replace(slow, relayout_overhead_s=1e-3))]
        return (times[1] - times[0]) / 1e-3

    runs = {}
    for role in ("tp", "sp"):
        runs[role] = added(Pin(stages=1, outer=1, inner=2, microbatches=1,
                               block_options=(Option((("inner", role),), False),) * 6))
        _, count = _tensor_parallel_waits(role, 16, (), slow)
        assert runs[role] == pytest.approx(round(runs[role]), abs=1e-6), (role, runs)
        assert 2 * 2 * 4 <= round(runs[role]) <= count, (role, runs, count)
        if role == "sp":
            assert round(runs[role]) < count - 8, (runs, count)  # the all-to-alls joined
    # recomputed, a block runs its forward's conversions again inside backward: more runs,
    # fewer than twice as many (backward's own are not replayed)
    again = added(Pin(stages=1, outer=1, inner=2, microbatches=1,
                      block_options=(Option((("inner", "tp"),), True),) * 6))
    assert runs["tp"] + 4 <= round(again) < 2 * runs["tp"], (again, runs)
    # data parallelism: at most its loss's all-reduce (the mean over the ranks)
    assert added(Pin(stages=1, outer=2, inner=1, microbatches=1,
                     block_options=(Option((("outer", "dp"),), False),) * 6)) in (
        pytest.approx(0.0, abs=1e-9), pytest.approx(1.0))
    assert added(Pin(stages=2, microbatches=4, schedule=ScheduleChoice())) == 0.0
    assert 0 < RELAYOUT_GAP_S < 1e-3


def test_conversions_pay_a_share_of_the_compute_before_them_and_all_to_alls_their_own():
    """`Hardware.relayout_wait_share`: each run of conversions after compute costs that
    share of the compute before it, so a tensor-parallel step grows by the share times
    the compute before its runs: less than the whole step's worth, and more at a larger
    batch (the compute apart grows, the runs do not). `Hardware.all_to_all_share`: an
    all-to-all's per-collective cost is that share of `collective_overhead_s`, so
    sequence parallelism's price moves by a whole number of all-to-alls, and data
    parallelism's (no conversions after compute, no all-to-all) by nothing."""
    import gpt

    from pxform.cost.hardware import hardware

    slow = dataclasses.replace(hardware("a100-80gb"), op_time_scale=1000.0,
                               collective_overhead_s=1e-3)
    cfg = gpt.GPT_CONFIGS["small"]
    params = gpt.init_params(cfg, device="meta")

    def price(pin: Pin, batch: int, **costs: float) -> Any:
        return pxform.auto(gpt.loss_fn, mesh=pxform.Mesh.abstract(2),
                           hardware=dataclasses.replace(slow, **costs), plan=pin).plan(
            params, gpt.make_batch(cfg, batch, device="meta"), cfg)

    def on(role: str) -> Pin:
        return Pin(stages=1, outer=1, inner=2, microbatches=1,
                   block_options=(Option((("inner", role),), False),) * 6)

    gaps = {}
    for batch in (8, 16):
        plan = price(on("tp"), batch)
        gaps[batch] = (price(on("tp"), batch, relayout_wait_share=1e-3).step_time_s
                       - plan.step_time_s) / 1e-3
        per_run = (price(on("tp"), batch, relayout_overhead_s=1e-3).step_time_s
                   - plan.step_time_s) / 1e-3
        # (seconds of compute before the runs: some of the step's, not more than all)
        assert round(per_run) >= 2 * 2 * 4, per_run
        assert 0.01 * plan.step_time_s < gaps[batch] < plan.step_time_s, (gaps, plan)
    assert gaps[16] > 1.5 * gaps[8]
    # all-to-alls: sequence parallelism has them, a whole number at 1 ms each
    sp = price(on("sp"), 16)
    cheaper = price(on("sp"), 16, all_to_all_share=0.5)
    removed = (sp.step_time_s - cheaper.step_time_s) / (0.5 * 1e-3)
    assert removed == pytest.approx(round(removed), abs=1e-6) and round(removed) >= 4
    dp = Pin(stages=1, outer=2, inner=1, microbatches=1,
             block_options=(Option((("outer", "dp"),), False),) * 6)
    assert price(dp, 16, all_to_all_share=0.5).step_time_s == price(dp, 16).step_time_s
    assert price(dp, 16, relayout_wait_share=0.5).step_time_s == pytest.approx(
        price(dp, 16).step_time_s, rel=0.02)


def test_sync_waits_pay_once_per_run_of_collectives_after_the_compute_before_it():
    from pxform.search.blockcost import sync_waits

    def wait(gap: float) -> float:
        return gap / 10

    assert sync_waits([(1.0, 0), (2.0, 0)], wait) == 0.0  # no collective, no wait
    # one run: after the whole block's compute (the previous block's, cyclically)
    assert sync_waits([(1.0, 0), (0.0, 2), (2.0, 0)], wait) == pytest.approx(0.3)
    # two runs: each after the compute since the one before
    assert sync_waits([(0.0, 1), (2.0, 0), (0.0, 1), (0.0, 3), (1.0, 0)], wait) == \
        pytest.approx(0.3)


def test_zero_bubble_is_chosen_where_its_simulated_bubble_wins():
    """An MLP's weight gradients are a third of its work: ZB-H1's W actions fill most of
    1F1B's drain, and the search prices both through the schedule simulator."""
    args = mlp_args(d=1024, layers=4, batch=4096)  # 5 blocks: too few to interleave
    free = plan_schedule(residual_mlp, args)
    one_f_one_b = plan_schedule(residual_mlp, args, schedule=ScheduleChoice())
    assert free.schedule == "zb" and free.virtual_stages == 1, free.config_text()
    assert free.step_time_s < 0.8 * one_f_one_b.step_time_s
    # the memory it costs: every stage keeps 4 graphs (F to W), 1F1B's last keeps 1
    assert [s.in_flight for s in free.stage_plans] == [4, 4, 4, 4]
    assert [s.in_flight for s in one_f_one_b.stage_plans] == [4, 3, 2, 1]
    assert free.peak_memory_bytes >= one_f_one_b.peak_memory_bytes
    assert "schedule=zb" in free.explain()
    # explain() says what each schedule was priced at for this configuration
    times = dict(free.schedule_times)
    assert times["1f1b"] == pytest.approx(one_f_one_b.step_time_s)
    assert times["zb"] == pytest.approx(free.step_time_s)
    assert "schedules priced for this configuration" in free.explain()
    assert "zb " + f"{free.step_time_s:.4g} s (chosen)" in free.explain()


def test_a_schedule_within_the_tolerance_of_1f1b_leaves_it_1f1b():
    """`auto`'s tolerance makes plans within it ties that the simplest wins, 1F1B before
    the other schedules (`simplicity`), within a configuration too: zero-bubble priced 2 %
    under 1F1B (its split backward made slower by `split_backward_share`) is taken at
    tolerance 0 (past `SCHEDULE_GAIN`), and at the default 5 % 1F1B is kept; 5 % under
    and more, zero-bubble again."""
    from pxform.cost.hardware import hardware
    from pxform.search.partition import SCHEDULE_GAIN

    args = mlp_args(d=1024, layers=4, batch=4096)

    def chosen(share: float, tolerance: float):
        hw = dataclasses.replace(hardware("a100-80gb"), split_backward_share=share)
        step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(4), memory_budget="80GiB",
                           hardware=hw, memory_margin=0.0, tolerance=tolerance,
                           plan=Pin(stages=4, outer=1, inner=1, microbatches=4))
        plan = step.plan(*args)
        return plan.schedule, dict(plan.schedule_times)

    schedule, times = chosen(0.5, 0.0)
    assert schedule == "zb" and SCHEDULE_GAIN < 1 - times["zb"] / times["1f1b"] < 0.05, times
    assert chosen(0.5, 0.05)[0] == "1f1b"
    schedule, times = chosen(0.3, 0.05)
    assert schedule == "zb" and times["zb"] < 0.95 * times["1f1b"], times


def test_interleaved_is_chosen_where_weight_gradients_are_few():
    """With little weight-gradient work ZB has nothing to fill its drain with, and two
    chunks per rank halve the warm-up and drain: interleaved wins; its plan has 8
    stages, stage s on rank s % 4."""
    params = [torch.empty(256, 256, device="meta") for _ in range(8)]
    args = (params, torch.empty(64, 1024, 256, device="meta"))
    plan = plan_schedule(attention_stack, args)
    assert (plan.schedule, plan.virtual_stages) == ("interleaved", 2), plan.config_text()
    assert plan.num_stages == 8 and len(plan.stage_plans) == 8
    assert sorted({b.stage for b in plan.blocks}) == list(range(8))
    others = [plan_schedule(attention_stack, args, schedule=ScheduleChoice(name))
              for name in ("1f1b", "zb")]
    assert all(plan.step_time_s < 0.95 * o.step_time_s for o in others)
    # the plan pins itself back (schedule and stages included) and survives JSON
    pinned = pin_of(plan)
    again = plan_schedule(attention_stack, args, schedule=pinned.schedule,
                          block_stage=pinned.block_stage)
    assert again.config_text() == plan.config_text()
    assert [b.stage for b in again.blocks] == [b.stage for b in plan.blocks]
    assert pxform.Plan.from_json(plan.to_json()) == plan


def test_1f1b_is_kept_where_memory_is_tight():
    """Zero-bubble keeps every microbatch's graph from F to W on every stage, and its
    weight ops' output gradients from B to W (the executor's retention, which the memory
    model counts): with a budget 1F1B just fits, zero-bubble does not fit even with
    recompute where 1F1B's later stages had room, and the search keeps 1F1B."""
    args = mlp_args(d=1024, layers=4, batch=4096)
    one_f_one_b = plan_schedule(residual_mlp, args, schedule=ScheduleChoice())
    zero_bubble = plan_schedule(residual_mlp, args, schedule=ScheduleChoice("zb"))
    assert zero_bubble.peak_memory_bytes > 1.2 * one_f_one_b.peak_memory_bytes
    budget = int(one_f_one_b.peak_memory_bytes * 1.01)
    plan = plan_schedule(residual_mlp, args, budget=budget)
    assert plan.schedule == "1f1b", plan.config_text()
    assert plan.peak_memory_bytes <= budget


def test_shifted_schedule_is_chosen_where_recompute_is_needed():
    """Merak's shifted schedule recomputes every stage but the last whole, early (its R
    runs while the rank waits for the gradient): such a stage keeps its inputs per
    microbatch in flight and one microbatch's activations. With room, 1F1B wins (no
    recompute); under a budget that makes 1F1B recompute blocks, the shifted
    schedule is faster than 1F1B's recompute and the search takes it. (Five blocks on four
    ranks: too few to interleave.)"""
    args = mlp_args(d=1024, layers=4, batch=4096)
    one_f_one_b = plan_schedule(residual_mlp, args, schedule=ScheduleChoice())
    shifted = plan_schedule(residual_mlp, args, schedule=ScheduleChoice("shifted"))
    assert not any(b.recompute for b in one_f_one_b.blocks + shifted.blocks)
    assert [s.in_flight for s in shifted.stage_plans] == [1, 1, 1, 1]
    assert shifted.peak_memory_bytes < 0.85 * one_f_one_b.peak_memory_bytes
    # (room for 1F1B but not for zero-bubble's graphs kept to W)
    roomy = plan_schedule(residual_mlp, args, budget=int(1.001 * one_f_one_b.peak_memory_bytes))
    assert roomy.schedule == "1f1b" and roomy.step_time_s < shifted.step_time_s
    budget = int(0.9 * one_f_one_b.peak_memory_bytes)
    tight = plan_schedule(residual_mlp, args, budget=budget)
    assert tight.schedule == "shifted", tight.config_text()
    assert tight.peak_memory_bytes <= budget
    assert not any(b.recompute for b in tight.blocks)  # the stages recompute, not blocks
    times = dict(tight.schedule_times)
    assert times["shifted"] == pytest.approx(tight.step_time_s)
    assert times["1f1b"] > tight.step_time_s  # 1F1B had to recompute blocks to fit
    assert "stages 0-2 of 4 recompute their whole forward" in tight.explain()
    # its step is the simulator's, R actions included, and the step's fixed costs (the
    # pipeline ranks' agreement on the first stage that trains)
    from pxform.cost.hardware import hardware
    from pxform.schedules import Costs, shifted_critical_path, simulate
    from pxform.search.space import Config
    from pxform.search.stages import step_fixed
    sim = simulate(shifted_critical_path(4, 4), Costs(
        forward=[s.forward_s for s in tight.stage_plans],
        backward=[s.backward_s for s in tight.stage_plans],
        recompute=[s.recompute_s for s in tight.stage_plans]))
    fixed = step_fixed(hardware("a100-80gb"), Config(4, 1, 1, 4))
    assert 0 < fixed < 1e-3
    assert tight.step_time_s == pytest.approx(sim.step_time + fixed, rel=1e-6)
    # R has no transfer to wait for: less than a forward, which has one
    assert all(0 < s.recompute_s < s.forward_s for s in tight.stage_plans[:3])
    # a block pinned to recompute rules the shifted schedule out
    redo = (Option((), True),) * len(tight.blocks)
    assert plan_schedule(residual_mlp, args, block_options=redo).schedule != "shifted"


def test_a_stage_that_recomputes_early_forwards_without_autograd():
    """The shifted schedule's stages but the last run each F without autograd's graph
    (their R records it: `pxform.runtime.pipeline`), which on this CPU is 20-25 % faster:
    a profile's `autograd_op_overhead_s` makes those Fs cheaper by that much per op of
    the stage, its `autograd_share` by that share of their forward at most; the last
    stage, every R and B, and 1F1B's Fs stay as they were, and the step is the
    simulator's with the cheaper Fs."""
    from pxform.cost.hardware import hardware
    from pxform.schedules import Costs, shifted_critical_path, simulate
    from pxform.search.space import Config
    from pxform.search.stages import step_fixed

    args = mlp_args(d=1024, layers=4, batch=4096)
    shifted = ScheduleChoice("shifted")
    base = plan_schedule(residual_mlp, args, schedule=shifted)
    where = pin_of(base).block_stage
    per_op = dataclasses.replace(hardware("a100-80gb"), autograd_op_overhead_s=1e-5)
    share = dataclasses.replace(hardware("a100-80gb"), autograd_share=0.2)
    for hw in (per_op, share):
        plan = plan_schedule(residual_mlp, args, hardware=hw, schedule=shifted,
                             block_stage=where)
        for s, (b, p) in enumerate(zip(base.stage_plans, plan.stage_plans)):
            assert (p.backward_s, p.recompute_s) == (b.backward_s, b.recompute_s)
            saved = b.forward_s - p.forward_s
            if s == len(base.stage_plans) - 1:  # no R: its F records the graph
                assert saved == 0
            elif hw is per_op:
                ops = sum(base.blocks[k].stop - base.blocks[k].start for k in b.blocks)
                assert saved == pytest.approx(ops * 1e-5, rel=1e-9), (s, b, p)
            else:
                assert 0 < saved <= 0.2 * b.forward_s * (1 + 1e-9), (s, b, p)
        assert plan.step_time_s < base.step_time_s
        sim = simulate(shifted_critical_path(4, 4), Costs(
            forward=[s.forward_s for s in plan.stage_plans],
            backward=[s.backward_s for s in plan.stage_plans],
            recompute=[s.recompute_s for s in plan.stage_plans]))
        # (and the pipeline ranks' agreement on the first stage that trains)
        fixed = step_fixed(hw, Config(4, 1, 1, 4))
        assert plan.step_time_s == pytest.approx(sim.step_time + fixed, rel=1e-6)
        one, one_hw = (plan_schedule(residual_mlp, args, hardware=h, schedule=ScheduleChoice())
                       for h in ("a100-80gb", hw))
        assert one.step_time_s == one_hw.step_time_s


def test_zero_bubble_moves_the_gradient_accumulation_to_w_and_pays_one_more_action():
    """A zero-bubble stage runs a W per microbatch beside its B: one more action
    (`action_overhead_s`), and the stage's parameter gradients accumulate in W, not in B
    (which makes input gradients only): `param_action_overhead_s` per parameter is in W,
    and the stage's B + W together carry it once, as 1F1B's B does."""
    from pxform.cost.hardware import hardware

    args = mlp_args(d=1024, layers=4, batch=4096)
    cost = dataclasses.replace(hardware("a100-80gb"), action_overhead_s=3e-4,
                               param_action_overhead_s=1e-4)
    zb = plan_schedule(residual_mlp, args, hardware=cost, schedule=ScheduleChoice("zb"))
    where = pin_of(zb).block_stage
    one = plan_schedule(residual_mlp, args, hardware=cost, schedule=ScheduleChoice(),
                        block_stage=where)
    zb_bare, one_bare = (plan_schedule(residual_mlp, args, schedule=choice, block_stage=where)
                         for choice in (ScheduleChoice("zb"), ScheduleChoice()))
    for s, (z, o, zb0, o0) in enumerate(zip(zb.stage_plans, one.stage_plans,
                                            zb_bare.stage_plans, one_bare.stage_plans)):
        # B (input gradients) and W (weight gradients) of zero-bubble over 1F1B's B
        assert z.backward_s - o.backward_s == pytest.approx(
            zb0.backward_s - o0.backward_s + 3e-4, rel=1e-6, abs=1e-12), s
        # W: one more action, and the stage's parameters' accumulation
        moved = (z.weight_s - zb0.weight_s) - 3e-4
        assert moved > 0, s
        assert (o.backward_s - o0.backward_s) == pytest.approx(3e-4 + moved, rel=1e-6), s


def test_sends_and_receives_are_charged_to_the_actions_that_make_them():
    """`Hardware.send_overhead_s` and `receive_overhead_s` (a pipeline transfer's cost to
    each end's thread, read off recorded 1F1B pipelines by `runtime_costs`): a stage's
    forward pays a send unless it is the last stage and a receive unless it is the first,
    its backward the other way round; so a middle stage pays two per action, an end one
    one, and an interleaved schedule's chunks (virtual stages) count as stages: with 2
    ranks and 2 chunks each, 6 of its 8 actions per microbatch pay both (GPT small's
    interleaved pipeline made three sends and three receives per microbatch on each
    rank). A zero-bubble W and the shifted schedule's early recompute make none."""
    from pxform.cost.hardware import hardware

    args = mlp_args(d=1024, layers=4, batch=4096)
    send, receive = 3e-4, 5e-4
    slow = dataclasses.replace(hardware("a100-80gb"), send_overhead_s=send,
                               receive_overhead_s=receive)
    for choice in (ScheduleChoice(), ScheduleChoice("zb"), ScheduleChoice("shifted")):
        base = plan_schedule(residual_mlp, args, schedule=choice)
        plan = plan_schedule(residual_mlp, args, hardware=slow, schedule=choice,
                             block_stage=pin_of(base).block_stage)
        last = len(plan.stage_plans) - 1
        for s, (b, p) in enumerate(zip(base.stage_plans, plan.stage_plans)):
            fwd = (send if s < last else 0.0) + (receive if s > 0 else 0.0)
            bwd = (send if s > 0 else 0.0) + (receive if s < last else 0.0)
            assert p.forward_s - b.forward_s == pytest.approx(fwd, rel=1e-6), (choice, s)
            assert p.backward_s - b.backward_s == pytest.approx(bwd, rel=1e-6), (choice, s)
            assert (p.weight_s, p.recompute_s) == (b.weight_s, b.recompute_s)
        assert plan.step_time_s > base.step_time_s
    # interleaved on 2 ranks, 2 chunks each: 4 stages as the simulator sees them, the two
    # in the middle paying a send and a receive per action
    pin = Pin(stages=2, outer=1, inner=1, microbatches=4,
              schedule=ScheduleChoice("interleaved", 2))
    base, plan = (pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(2), hardware=hw,
                              plan=pin, memory_margin=0.0).plan(*args)
                  for hw in ("a100-80gb", slow))
    grown = [d for b, p in zip(base.stage_plans, plan.stage_plans)
             for d in (p.forward_s - b.forward_s, p.backward_s - b.backward_s)]
    both = send + receive
    assert grown == pytest.approx([send, receive, both, both, both, both, receive, send])


def test_a_receive_stall_is_charged_to_every_action_that_receives_whatever_the_slack():
    """`Hardware.receive_stall_s` (what a pipeline transfer stalls its receiver while it
    moves, where the schedule would have had the data there in time: `runtime_costs`
    fits it on recorded 1F1B and zero-bubble spans) is the receiving action's time: a
    stage's forward pays it unless the stage is the first, its backward unless it is the
    last, or recomputes early (the shifted schedule: its B's gradient moves while its R
    runs); sends, W and the early recompute pay nothing. Unlike a delay on the waits
    (`transfer_overhead_s`), a schedule with slack does not hide it: zero-bubble's and the
    shifted schedule's steps grow by as much as charging it on every receiving action
    of the simulated schedule gives, and the plan's step is that simulation's."""
    from pxform.cost.hardware import hardware
    from pxform.schedules import Costs, resolve, simulate
    from pxform.search.space import Config
    from pxform.search.stages import step_fixed

    args = mlp_args(d=1024, layers=4, batch=4096)
    stall = 4e-4
    slow = dataclasses.replace(hardware("a100-80gb"), receive_stall_s=stall)
    for choice in (ScheduleChoice(), ScheduleChoice("zb"), ScheduleChoice("shifted")):
        base = plan_schedule(residual_mlp, args, schedule=choice)
        plan = plan_schedule(residual_mlp, args, hardware=slow, schedule=choice,
                             block_stage=pin_of(base).block_stage)
        assert plan.microbatches == base.microbatches
        last = len(plan.stage_plans) - 1
        for s, (b, p) in enumerate(zip(base.stage_plans, plan.stage_plans)):
            fwd = stall if s > 0 else 0.0
            bwd = stall if s < last and not choice.recomputes(s, last + 1) else 0.0
            assert p.forward_s - b.forward_s == pytest.approx(fwd, rel=1e-6), (choice, s)
            assert p.backward_s - b.backward_s == pytest.approx(bwd, rel=1e-6), (choice, s)
            assert (p.weight_s, p.recompute_s, p.transfer_s) == \
                (b.weight_s, b.recompute_s, b.transfer_s)
        split = choice.split
        stages = plan.stage_plans
        sim = simulate(resolve(choice.name, plan.stages, plan.microbatches,
                               **plan.schedule_options), Costs(
            forward=[s.forward_s for s in stages],
            backward=[s.backward_s - (s.weight_s if split else 0.0) for s in stages],
            weight=[s.weight_s if split else 0.0 for s in stages],
            recompute=[s.recompute_s for s in stages],
            forward_sync=[s.forward_sync_s for s in stages],
            backward_sync=[s.backward_sync_s for s in stages]))
        # (the step's fixed costs: the pipeline ranks' agreement on the first stage that
        # trains, `step_fixed`)
        fixed = step_fixed(slow, Config(plan.stages, plan.outer, plan.inner, plan.microbatches))
        assert plan.step_time_s == pytest.approx(sim.step_time + fixed, rel=1e-6), choice
        assert plan.step_time_s > base.step_time_s, choice


def test_a_pipeline_stages_per_step_costs_run_after_the_schedule_on_its_rank():
    """A stage's per-step costs (`Hardware.param_overhead_s` per parameter tensor: its
    piece laid out, its gradient's hook and bucket slot) run once per step on its rank
    after its last action, not in its backwards: the stages' F and B stay as they were,
    each stage shows them in `StagePlan.step_extra_s` (per step, a whole number of
    parameters' worth), and the step is the schedule's simulation plus the largest
    rank's sum of them (`after_schedule`; an interleaved rank runs two chunks). Spread
    over the backwards (until the twenty-seventh session) they were on both ranks'
    critical path, and the fewer the microbatches, the more of them."""
    from pxform.cost.hardware import hardware
    from pxform.schedules import Costs, resolve, simulate
    from pxform.search.space import Config
    from pxform.search.stages import after_schedule, step_fixed

    per = 1e-3
    slow = dataclasses.replace(hardware("a100-80gb"), param_overhead_s=per)
    for choice, layers in ((ScheduleChoice(), 4), (ScheduleChoice("interleaved", 2), 8)):
        args = mlp_args(d=1024, layers=layers, batch=4096)
        base = plan_schedule(residual_mlp, args, schedule=choice)
        plan = plan_schedule(residual_mlp, args, hardware=slow, schedule=choice,
                             block_stage=pin_of(base).block_stage)
        assert plan.microbatches == base.microbatches
        extras = []
        for b, p in zip(base.stage_plans, plan.stage_plans):
            assert (p.forward_s, p.backward_s) == pytest.approx((b.forward_s, b.backward_s),
                                                                rel=1e-9), choice
            count = (p.step_extra_s - b.step_extra_s) / per
            assert count >= 1 and count == pytest.approx(round(count), abs=1e-6), (choice, p)
            extras.append(p.step_extra_s)
        stages = plan.stage_plans
        sim = simulate(resolve(choice.name, plan.stages, plan.microbatches,
                               **plan.schedule_options), Costs(
            forward=[s.forward_s for s in stages],
            backward=[s.backward_s for s in stages],
            weight=[0.0] * len(stages),
            forward_sync=[s.forward_sync_s for s in stages],
            backward_sync=[s.backward_sync_s for s in stages]))
        fixed = step_fixed(slow, Config(plan.stages, plan.outer, plan.inner, plan.microbatches))
        assert plan.step_time_s == pytest.approx(
            sim.step_time + after_schedule(extras, plan.stages) + fixed, rel=1e-6), choice
        assert plan.step_time_s - base.step_time_s == pytest.approx(
            after_schedule(extras, plan.stages)
            - after_schedule([s.step_extra_s for s in base.stage_plans], plan.stages),
            rel=1e-6), choice
    assert after_schedule([1.0, 2.0, 0.5, 0.5], 2) == 2.5


def test_a_transfer_delay_is_charged_only_where_an_action_waits_for_it():
    """`Hardware.transfer_overhead_s` (what a pipeline transfer adds where the action
    needing it waits: `pxform.tools.runtime_costs` fits it on 1F1B pipelines) leaves every
    action's price as it was and goes to the schedule simulator as `Costs.p2p`: the
    plan's step is the simulation's with it, every schedule's step grows by at least the
    first microbatch's way there and back and by less than charging it on every F and B
    of the `m + p - 1` slots would (only the waits pay it); the closed forms past
    `TIMED_UP_TO` charge it on every F and B of a stage that receives."""
    from pxform.cost.hardware import hardware
    from pxform.schedules import Costs, resolve, simulate
    from pxform.search import pipelines
    from pxform.search.space import Config
    from pxform.search.stages import step_fixed

    args = mlp_args(d=1024, layers=4, batch=4096)
    delay = 2e-4
    slow = dataclasses.replace(hardware("a100-80gb"), transfer_overhead_s=delay)
    for choice in (ScheduleChoice(), ScheduleChoice("zb"), ScheduleChoice("shifted")):
        base = plan_schedule(residual_mlp, args, schedule=choice)
        plan = plan_schedule(residual_mlp, args, hardware=slow, schedule=choice,
                             block_stage=pin_of(base).block_stage)
        assert plan.microbatches == base.microbatches
        for b, p in zip(base.stage_plans, plan.stage_plans):
            assert (p.forward_s, p.backward_s, p.weight_s, p.recompute_s) == \
                (b.forward_s, b.backward_s, b.weight_s, b.recompute_s)
            assert (b.transfer_s, p.transfer_s) == (0.0, delay)
        split = choice.split
        stages = plan.stage_plans
        sim = simulate(resolve(choice.name, plan.stages, plan.microbatches), Costs(
            forward=[s.forward_s for s in stages],
            backward=[s.backward_s - (s.weight_s if split else 0.0) for s in stages],
            weight=[s.weight_s if split else 0.0 for s in stages],
            recompute=[s.recompute_s for s in stages],
            p2p=[s.transfer_s for s in stages]))
        fixed = step_fixed(slow, Config(plan.stages, plan.outer, plan.inner, plan.microbatches))
        assert plan.step_time_s == pytest.approx(sim.step_time + fixed, rel=1e-6)
        p, m = plan.stages, plan.microbatches
        # at least the first microbatch's way there and back (2 (p - 1) transfers in a
        # chain); less than charged on every F and B of the m + p - 1 slots
        grown = plan.step_time_s - base.step_time_s
        assert 2 * (p - 1) * delay * (1 - 1e-6) <= grown < 2 * delay * (m + p - 1), choice
    # past the simulated sizes: every F of a stage after the first and every B of a stage
    # before the last carries it
    big = 4 * pipelines.TIMED_UP_TO
    fw, bw, wt = [1.0] * 4, [2.0] * 4, [0.0] * 4
    plain = pipelines.step_time(ScheduleChoice(), 4, big, fw, bw, wt)
    delayed = pipelines.step_time(ScheduleChoice(), 4, big, fw, bw, wt, p2p=[0.5] * 4)
    assert delayed == pytest.approx(pipelines.step_time(
        ScheduleChoice(), 4, big, fw, bw, wt, forward_sync=[0.0, 0.5, 0.5, 0.5],
        backward_sync=[0.5, 0.5, 0.5, 0.0]))
    assert delayed > plain


def test_zero_bubble_later_stages_peak_with_their_last_two_input_gradients_sending():
    """A zero-bubble stage after the first sends its last two B's input gradients, which
    no later receive shows arrived, with both graphs still held for their W: that moment,
    a send's, is its peak (`schedules.at_peak` had looked only after compute actions and
    counted one gradient there)."""
    from pxform import schedules
    from pxform.search import pipelines

    assert schedules.at_peak(schedules.zero_bubble(2, 8)) == [(2, 2, 0), (2, 2, 2)]
    assert pipelines.sent(ScheduleChoice("zb"), 4, 8) == ((4, 0), (4, 2), (4, 2), (4, 2))
    assert pipelines.sent(ScheduleChoice(), 4, 8) == ((4, 0), (3, 1), (2, 1), (1, 1))


@pytest.mark.parametrize("name", ["1f1b", "zb", "shifted"])
def test_closed_form_counts_equal_the_walk_of_the_schedule(name):
    """The counts the search takes from closed forms (`pipelines.COUNTED`) are what the
    executor's schedule holds: the walk of the generator's schedule with its transfers
    (`schedules.at_peak`, `awaiting_weights`, `most_between`), at every size tried."""
    from pxform import schedules
    from pxform.search import pipelines

    assert name in pipelines.COUNTED
    choice = ScheduleChoice(name)
    for p in (2, 3, 4, 5, 8, 12, 16):
        for m in sorted({p, p + 1, 2 * p, 3 * p, 4 * p, 8 * p, 96}):
            schedule = schedules.NAMES[name](p, m)
            peak = schedules.at_peak(schedule)
            walked = (tuple(h for h, _, _ in peak),
                      schedules.awaiting_weights(schedule),
                      tuple(n if choice.recomputes(s, p) else 0
                            for s, n in enumerate(schedules.most_between(schedule, "F", "B"))),
                      tuple((f, b) for _, f, b in peak))
            counted = (pipelines.in_flight(choice, p, m), pipelines.awaiting(choice, p, m),
                       pipelines.inputs_held(choice, p, m), pipelines.sent(choice, p, m))
            assert counted == walked, (p, m)


@pytest.mark.parametrize("name", ["1f1b", "zb", "interleaved", "shifted"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 32)])
def test_closed_forms_equal_the_simulation_for_equal_stages(monkeypatch, name, p, m):
    """Schedules too big to simulate per candidate are priced by closed forms
    (`pipelines.TIMED_UP_TO`): with equal stages they give the simulated step and the
    executor's held counts."""
    from pxform.search import pipelines

    choice = ScheduleChoice(name, 2 if name == "interleaved" else 1)
    n = choice.num_stages(p)
    fw, bw, wt = [1.0] * n, [2.0] * n, [0.8] * n
    exact = (pipelines.step_time(choice, p, m, fw, bw, wt),
             pipelines.in_flight(choice, p, m), pipelines.inputs_held(choice, p, m),
             pipelines.sent(choice, p, m))
    monkeypatch.setattr(pipelines, "TIMED_UP_TO", 0)
    pipelines._clear_caches()
    try:
        closed = (pipelines.step_time(choice, p, m, fw, bw, wt),
                  pipelines.in_flight(choice, p, m), pipelines.inputs_held(choice, p, m),
                  pipelines.sent(choice, p, m))
    finally:
        pipelines._clear_caches()
    assert closed[0] == pytest.approx(exact[0], rel=0.02), (closed, exact)
    if name != "interleaved":  # (interleaved's closed form spreads a rank's count evenly)
        assert closed[1:] == exact[1:]
    else:  # a rank's counts spread evenly over its chunks: per rank, at least the
        # microbatches held (and their outputs kept), one more at most (the simulation
        # peaks a forward earlier on some ranks), and at least the gradients still sending
        held = [(sum(closed[1][r::p]), sum(exact[1][r::p])) for r in range(p)]
        outputs = [(sum(f for f, _ in closed[3][r::p]), sum(f for f, _ in exact[3][r::p]))
                   for r in range(p)]
        grads = [(sum(b for _, b in closed[3][r::p]), sum(b for _, b in exact[3][r::p]))
                 for r in range(p)]
        assert all(e <= c <= e + 1 for c, e in held + outputs), (held, outputs)
        assert all(e <= c <= e + 2 for c, e in grads), grads


# ---------------------------------------------------------------- sequence parallelism


def norm_mlp_stack(params, x):
    # an input projection first: the stack's blocks all read an activation, which sequence
    # parallelism keeps split between them (a first block reading the replicated batch
    # input itself would be priced for every block of its kind)
    h = F.linear(x, params[0]["w_in"])
    for p in params[1:]:
        y = F.layer_norm(h, h.shape[-1:])
        h = h + F.linear(F.gelu(F.linear(y, p["w1"])), p["w2"])
    return (h ** 2).mean()


def plan_tensor(seq: int, budget="80GiB", role=None):
    """One sample of `seq` tokens on 4 devices of one tensor axis (a single sample
    leaves the data roles nothing to split), a100-80gb's fixed profile; `role` pins every
    block to "tp" or "sp", or gives each block its own."""
    d = 256
    params = [{"w_in": torch.empty(d, d, device="meta")}] + [
        {"w1": torch.empty(4 * d, d, device="meta"), "w2": torch.empty(d, 4 * d, device="meta")}
        for _ in range(4)]
    x = torch.empty(1, seq, d, device="meta")
    roles = (role,) * 6 if isinstance(role, str) else role
    options = tuple(Option((("inner", r),), False) for r in roles) if role else None
    pin = Pin(stages=1, outer=1, inner=4, microbatches=1, block_options=options)
    step = pxform.auto(norm_mlp_stack, mesh=pxform.Mesh.abstract(4), memory_budget=budget,
                       hardware="a100-80gb", plan=pin, memory_margin=0.0)
    return step.plan(params, x)


def test_sequence_parallelism_is_chosen_where_activations_dominate():
    """Sequence parallelism keeps the values between blocks split along the tokens: the
    norms and residual adds run on a quarter of them and save a quarter of their inputs,
    for an all-gather and a reduce-scatter in place of each all-reduce (one more latency).
    With 256 tokens plain tensor parallelism is faster and sequence parallelism needs less
    memory; under a budget tensor parallelism does not fit, the search finds a plan that
    fits and is no slower than sequence parallelism (here: one block recomputed, cheaper
    on this profile); from 1,024 tokens on the norms' work outweighs the latencies and every
    block is sequence parallel."""
    tp, sp = plan_tensor(256, role="tp"), plan_tensor(256, role="sp")
    assert sp.peak_memory_bytes < tp.peak_memory_bytes
    assert tp.step_time_s < sp.step_time_s
    assert [b.strategy for b in plan_tensor(256).blocks] == ["inner=tp"] * 6
    budget = int((sp.peak_memory_bytes + tp.peak_memory_bytes) / 2)
    tight = plan_tensor(256, budget=budget)
    assert tight.peak_memory_bytes <= budget
    assert tight.step_time_s <= sp.step_time_s
    for seq in (1024, 4096):
        assert [b.strategy for b in plan_tensor(seq).blocks] == ["inner=sp"] * 6
    # a plan keeps the sequence-parallel choices apart from the tensor-parallel ones
    mixed = plan_tensor(256, role=("tp",) * 3 + ("sp",) * 3)
    assert [b.strategy for b in mixed.blocks] == ["inner=tp"] * 3 + ["inner=sp"] * 3
    keys = {k for k, _ in mixed.tensor_choices}
    assert any(k < 0 for k in keys) and any(k >= 0 for k in keys), keys
    assert pxform.Plan.from_json(mixed.to_json()) == mixed


@pytest.mark.parametrize("schedule, message", [
    (ScheduleChoice("gpipe"), r"the pinned schedule .*gpipe.* is not one the search prices"),
    (ScheduleChoice("zb", 2), r"virtual_stages > 1 for 'interleaved' only"),
    (ScheduleChoice("interleaved", 4), r"interleaved\(virtual_stages=4\) on 4 pipeline "
                                       r"ranks needs 16 stages, but the function has 5"),
])
def test_a_pinned_schedule_the_search_cannot_price_is_refused(schedule, message):
    args = mlp_args(d=1024, layers=4, batch=4096)
    with pytest.raises(pxform.PxformError, match=message):
        plan_schedule(residual_mlp, args, schedule=schedule)


def test_zero_bubble_takes_no_recompute():
    """Zero-bubble's W asks autograd for each weight op's gradient apart, and torch's
    checkpoint runs a recomputed block's forward again for each such call as well as for
    B, keeping what B recomputed until the W: on GPT small (2 gloo ranks) 1.8 times the
    memory and 3.7 times the step of zero-bubble without recompute, where the model had
    priced the recompute as saving 30 % (the fifty-third session). The search gives a
    zero-bubble pipeline no recompute, and refuses a pin that asks for both."""
    budget = 5 * 2**30  # zero-bubble fits only by recomputing here (`zb` below)

    def plan(schedule=None, recompute=None):
        options = None if recompute is None else (Option((), recompute),) * 9
        step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(2), memory_budget=budget,
                           hardware="a100-80gb", plan=Pin(stages=2, microbatches=4,
                                                         schedule=schedule,
                                                         block_options=options))
        return step.plan(*MLP)

    searched = plan()
    assert dict(searched.schedule_times)["zb"] == math.inf, searched.schedule_times
    with pytest.raises(pxform.SearchError, match="no plan fits"):
        plan(ScheduleChoice("zb"))
    assert {*dict(plan(recompute=True).schedule_times)} == {"1f1b",
                                                            "interleaved(virtual_stages=2)"}
    with pytest.raises(pxform.SearchError) as err:
        plan(ScheduleChoice("zb"), recompute=True)
    assert str(err.value).startswith(
        "pxform.auto(residual_mlp): the pin recomputes 9 block(s) (layer 0, layer 1, layer 2, "
        "layer 3, ...) under the zero-bubble schedule 'zb', which takes no recompute")
    assert "Fix: pin ScheduleChoice('1f1b') or ScheduleChoice('shifted')" in str(err.value)


@given(st.lists(st.lists(st.tuples(st.floats(0.1, 10), st.floats(1, 100), st.booleans()),
                         min_size=1, max_size=4), min_size=1, max_size=4),
       st.integers(1, 4), st.floats(5, 400))
def test_least_work_bounds_every_choice_of_options_that_fits(blocks, stages, per_stage):
    """`bounds.least_work` is at most the total time of any one-option-per-block choice
    whose memories each fit a stage and together fit the stages (brute force), and at
    least the blocks' fastest options summed; inf when no choice fits."""
    import itertools

    from pxform.search.bounds import least_work
    from pxform.search.context import OptionCost, OptionTable
    from pxform.search.space import Option

    m = 2
    tables = []
    for k, opts in enumerate(blocks):
        options, costs = [], []
        for j, (seconds, saved, recompute) in enumerate(opts):
            options.append(Option(((f"a{j}", "dp"),), recompute))
            costs.append(OptionCost(forward=seconds, backward=seconds, step_extra=0.0,
                                    saved=saved, kept=saved / 4, params=1.0, grads=0.5,
                                    transient=0.0))
        tables.append(OptionTable(k, tuple(options), tuple(costs)))
    bound = least_work(tables, m, stages, per_stage)
    fits = []
    for pick in itertools.product(*(range(len(t.costs)) for t in tables)):
        mems = [t.costs[j].memory(1, t.options[j].recompute, m) for t, j in zip(tables, pick)]
        if max(mems) <= per_stage and sum(mems) <= stages * per_stage:
            fits.append(sum(t.costs[j].step_time(m) for t, j in zip(tables, pick)))
    if not fits:
        return  # (the relaxation may still find a fraction that fits: any bound is valid)
    assert bound <= min(fits) * (1 + 1e-9)
    fastest = sum(min(c.step_time(m) for c in t.costs) for t in tables)
    assert bound >= fastest * (1 - 1e-9)


def test_least_work_charges_the_memory_that_forces_a_slower_option():
    from pxform.search.bounds import least_work
    from pxform.search.context import OptionCost, OptionTable
    from pxform.search.space import Option

    fast = OptionCost(1.0, 1.0, 0.0, saved=60.0, kept=6.0, params=10.0, grads=5.0,
                      transient=0.0)
    slow = OptionCost(1.5, 1.5, 0.0, saved=60.0, kept=6.0, params=10.0, grads=5.0,
                      transient=0.0)
    table = OptionTable(0, (Option((("x", "dp"),), False), Option((("x", "dp"),), True)),
                        (fast, slow))
    # four blocks of 65 bytes at the fast option (2 s), 11 recomputed (3 s), on 2 stages
    # of 100: from 4 x 11 = 44 bytes, 156 more buy 156 / 54 of a block's second
    got = least_work([table] * 4, 1, 2, 100.0)
    assert got == pytest.approx(4 * 3.0 - 156 / 54, rel=1e-9)
    assert least_work([table] * 4, 1, 8, 100.0) == pytest.approx(4 * 2.0)
    assert least_work([table] * 4, 1, 1, 10.0) == float("inf")


def test_a_weight_share_past_the_backward_is_capped_not_refused(monkeypatch):
    """A zero-bubble W is a part of its stage's backward. A profile whose op curves put the
    weight ops' share (each op's `min(forward, backward)`) past a stage's whole backward
    (the median of 5 calibrations did, 2026-11-27) made B negative, and the schedule
    simulator refused the plan: `pxform.auto` raised. The share is capped at the backward."""
    import pxform.search.options as options

    real = options.option_cost

    def heavy(*args, **kwargs):
        cost = real(*args, **kwargs)
        return dataclasses.replace(cost, weight=3.0 * cost.backward + 1e-3)

    monkeypatch.setattr(options, "option_cost", heavy)
    args = mlp_args(d=256, layers=4, batch=512)
    plan = plan_schedule(residual_mlp, args, schedule=ScheduleChoice("zb"))
    assert plan.schedule == "zb" and plan.step_time_s > 0
    for s in plan.stage_plans:
        assert 0.0 <= s.weight_s <= s.backward_s + 1e-12, s


def test_zero3_reduce_scatters_cost_the_compute_thread_their_launch():
    """ZeRO-3's per-block gradient reduce-scatters overlap the backward that follows with
    their transfers only: what each costs the rank's own thread (`collective_overhead_s`:
    wrapping and launching it, and on gloo waiting for the group's previous collective)
    joins the backward, as the forward's gathers' does. On a profile whose compute hides
    every transfer (overlap slowdown 1: a shorter collective under compute is free), 1 ms
    more per collective adds about 1 ms per gather and per reduce-scatter to a ZeRO-3
    step that keeps what forward gathered (6 blocks: 6 gathers, 6 reduce-scatters, and the
    loss's all-reduce); overlapped, the reduce-scatters had added nothing (6, not 12)."""
    import gpt

    from pxform.cost.hardware import hardware

    slow = dataclasses.replace(hardware("a100-80gb"), op_time_scale=1000.0,
                               overlap_slowdown=1.0)
    cfg = gpt.GPT_CONFIGS["small"]
    params, data = gpt.init_params(cfg, device="meta"), gpt.make_batch(cfg, 16,
                                                                       device="meta")
    pin = Pin(stages=1, outer=2, inner=1, microbatches=1,
              block_options=(Option((("outer", "sdp"),), False, False),) * 6)
    times = [pxform.auto(gpt.loss_fn, mesh=pxform.Mesh.abstract(2), hardware=hw,
                         plan=pin).plan(params, data, cfg).step_time_s
             for hw in (slow, dataclasses.replace(slow, collective_overhead_s=1e-3))]
    added = (times[1] - times[0]) / 1e-3
    assert 12 <= added <= 14, added


def test_a_small_microbatch_is_priced_by_its_own_walk_not_a_line_from_larger_ones():
    """Op curves with a knee between half the traced batch and all of it: a line through
    those two walks carried down to a sixteenth went below zero (the balance of stages
    then failed); the walk at a power of two of the batch is the walk of a batch that
    size, and between two such sizes it lies between their walks."""
    from pxform.cost.hardware import OP_CLASSES, OpCurve
    from pxform.cost.model import CostModel
    from pxform.search.analysis import analyse
    from pxform.search.context import SearchContext
    from pxform.search.options import walk_cost
    from pxform.search.space import Config, options

    def mlp(params, x):
        for w in params:
            x = torch.tanh(x @ w)
        return x.square().mean()

    params = [torch.randn(64, 64) for _ in range(2)]
    # every op: 10 us up to 64 KiB (FLOPs or bytes), 10x that at 4x the size (a knee),
    # then linear
    curves = tuple(OpCurve(kind, ((2.0**16, 1e-5, 2e-5), (2.0**18, 1e-4, 2e-4)))
                   for kind in OP_CLASSES)
    hw = dataclasses.replace(pxform.hardware.hardware("a100-80gb"), op_curves=curves)

    def costs(batch: int, microbatches: int) -> list[Any]:
        step = pxform.auto(mlp, mesh=1, hardware=hw)
        graph, names, _ = step._graph((params, torch.randn(batch, 64)))
        a = analyse(graph, names)
        ctx = SearchContext(a, CostModel(hw), math.inf, batch)
        config = Config(1, 1, 1, microbatches)
        option = options(config)[0]
        return [walk_cost(ctx, block, config, option) for block in a.blocks]

    whole = costs(512, 1)
    # a batch of one microbatch's size, walked whole: on the ladder (1/2, 1/8, 1/32)
    alone = {m: costs(512 // m, 1) for m in (2, 8, 32)}
    for m, (above, below) in ((2, (2, 2)), (4, (2, 8)), (16, (8, 32)), (32, (32, 32))):
        split = costs(512, m)
        for k, (s, w) in enumerate(zip(split, whole)):
            assert s.fwd_compute > 0 and s.bwd_compute > 0
            for field in ("fwd_compute", "bwd_compute"):
                hi, lo = getattr(alone[above][k], field), getattr(alone[below][k], field)
                assert lo * (1 - 1e-3) <= getattr(s, field) <= hi * (1 + 1e-3), (m, field)
            assert s.fwd_compute <= w.fwd_compute
            assert s.saved_bytes == pytest.approx(w.saved_bytes / m)


def test_interleaved_stages_are_counted_at_their_ranks_heaviest_moment():
    """`partition.stage_weights` weighs each stage by its blocks' activations under their
    fastest options; `pipelines.in_flight` with them picks the rank's moment holding the
    most bytes (`schedules.at_peak`), and caches per weights."""
    from types import SimpleNamespace as NS

    from pxform.search.partition import stage_weights
    from pxform.search.pipelines import ScheduleChoice, in_flight

    def table(saved: float, kept: float = 0.0) -> NS:
        # two options: the faster keeps its activations, the slower recomputes
        return NS(options=[NS(recompute=False), NS(recompute=True)],
                  costs=[NS(saved=saved, kept=kept, step_time=lambda m: 1.0),
                         NS(saved=saved, kept=kept, step_time=lambda m: 2.0)])

    # 4 layers of 10 and a head of 1, cut into 4 stages (2 chunks on each of 2 ranks)
    tables = [table(10.0)] * 4 + [table(1.0)]
    assert stage_weights(tables, (0, 1, 2, 3, 3), 4) == (0.9, 0.9, 0.9, 1.0)
    assert stage_weights(tables, (0, 1, 2, 3, 4), 5) == (1.0, 1.0, 1.0, 1.0, 0.1)
    chunks = ScheduleChoice("interleaved", 2)
    assert in_flight(chunks, 2, 8) == (4, 2, 1, 1)
    assert in_flight(chunks, 2, 8, (1.0, 1.0, 1.0, 0.1)) == (4, 3, 1, 0)


# ---------------------------------------------------------------- frozen parameters

def _frozen_mlp(frozen: set[int], d: int = 256, layers: int = 4, batch: int = 64):
    """`residual_mlp`'s arguments with the layers in `frozen` marked requires_grad=False
    and the others True (as `module_fn` gives a model with some parameters frozen)."""
    params = {"layers": [{"w1": torch.randn(4 * d, d).requires_grad_(k not in frozen),
                          "w2": torch.randn(d, 4 * d).requires_grad_(k not in frozen)}
                         for k in range(layers)]}
    return params, torch.randn(batch, d), torch.randn(batch, d)


def _dp_costs(args, recompute: bool = False) -> tuple[Any, list]:
    """The analysis of `residual_mlp` on `args` and, per block, its data-parallel option's
    cost on 2 devices (a100-80gb), recomputed or not."""
    from pxform.cost.model import CostModel
    from pxform.search.analysis import analyse
    from pxform.search.context import SearchContext
    from pxform.search.options import block_tables
    from pxform.search.space import configs

    step = pxform.auto(residual_mlp, mesh=2, memory_budget="80GiB", hardware="a100-80gb")
    graph, names, _ = step._graph(args)
    a = analyse(graph, names, trainable=step._cache["trainable"])
    hw = pxform.hardware.hardware("a100-80gb")
    ctx = SearchContext(a, CostModel(hw), 80 * 2**30, 64, Pin())
    config = next(c for c in configs(2, hw.devices_per_node, len(a.blocks), 64, 1, 1)
                  if c.outer == 2)
    costs = []
    for t in block_tables(ctx, config):
        k = next(i for i, o in enumerate(t.options)
                 if o.roles == (("outer", "dp"),) and o.recompute == recompute)
        costs.append(t.costs[k])
    return a, costs


def test_a_frozen_parameter_holds_no_gradient_or_optimizer_state():
    """A parameter marked requires_grad=False gets no gradient (`value_and_grad`): the
    search holds its bytes alone, with no gradient, optimizer state or gradient
    reduction, and a layer of frozen parameters is a block kind of its own. Counted as
    trained, HF Llama with a frozen prefix was predicted 59-63 % over the meter (the
    forty-eighth session; `test_auto_hf` meters it)."""
    a, costs = _dp_costs(_frozen_mlp({0, 1}))
    assert sorted(a.params - a.trainable) == ["layers.0.w1", "layers.0.w2", "layers.1.w1",
                                              "layers.1.w2"]
    kinds = a.kind_of_block
    assert kinds[0] == kinds[1] != kinds[2] == kinds[3]
    assert [b.label for b in a.blocks[:4]] == ["layer 0", "layer 1", "layer 2", "layer 3"]
    weights = 2 * 4 * 256 * 256 * 4  # w1 and w2, float32
    assert costs[0].params == weights and costs[0].grads == 0  # the bytes alone
    assert costs[2].params == 4 * weights and costs[2].grads == weights  # + grads, Adam's
    # nothing trained before or in them: no backward, nothing saved for one
    assert costs[0].backward == costs[1].backward == 0 and costs[0].saved == 0
    assert costs[2].backward > 0 and costs[2].saved > 0
    # the same layers trained: as the last two
    _, trained = _dp_costs(_frozen_mlp(set()))
    assert trained[0].params == costs[2].params and trained[0].backward == costs[2].backward


def test_a_frozen_layer_after_a_trained_one_runs_its_input_gradients_alone():
    """A frozen layer that a trained one feeds still runs backward, for its input's
    gradient (`dy w`), but not its weights' (`x^T dy`): about half a trained layer's
    backward, and its matmuls save their weights for it, not their inputs."""
    _, costs = _dp_costs(_frozen_mlp({1}))
    trained, frozen = costs[0], costs[1]
    assert 0.3 < frozen.backward / trained.backward < 0.7
    assert frozen.saved < trained.saved and frozen.grads == 0


def test_the_search_plans_for_what_is_frozen():
    """With 6 of 8 layers frozen, a 4 GiB budget that the trained model fits only with
    ZeRO-3 on some blocks is fitted by plain data parallelism, at half the step time (the
    frozen layers run no backward); the plan's notes count the frozen parameters."""
    params, x, y = mlp_args()
    step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(4), memory_budget="4GiB",
                       hardware="a100-80gb")
    trained = step.plan(params, x, y)
    assert "sdp" in roles(trained)
    frozen = {"layers": [{k: v.requires_grad_(i >= 6) for k, v in layer.items()}
                         for i, layer in enumerate(mlp_args()[0]["layers"])]}
    plan = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(4), memory_budget="4GiB",
                       hardware="a100-80gb").plan(frozen, x, y)
    assert roles(plan) == {"dp"}
    assert plan.peak_memory_bytes < 0.7 * trained.peak_memory_bytes
    assert plan.step_time_s == pytest.approx(trained.step_time_s / 2, rel=0.1)
    assert any(n.startswith("12 of 16 parameters frozen (768 MiB: layers.0.w1")
               for n in plan.notes), plan.notes


def test_a_pipeline_stage_that_trains_nothing_has_no_backward():
    """A 2-stage pipeline whose first stage is a frozen prefix: that stage runs its
    forward without autograd's graph and its B does nothing, and no gradient is sent back
    to it (the runtime sends a token: `pxform.runtime.pipeline.first_trained`), so neither
    stage holds a buffer for one. Before, the frozen stage's forward was priced with
    autograd's graph, and both stages with the gradient's buffers."""
    from pxform.search.pipelines import ONE_F_ONE_B

    def plan_of(frozen: set[int]) -> Any:
        step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(2),
                           memory_budget="80GiB", hardware=CPU_PROFILE,
                           plan=Pin(stages=2, microbatches=4, schedule=ONE_F_ONE_B,
                                    block_stage=(0, 0, 1, 1, 1)))
        return step.plan(*_frozen_mlp(frozen, d=1024, batch=4096))

    trained, frozen = plan_of(set()), plan_of({0, 1})  # (4 layers, then the loss)
    first, second = frozen.stage_plans
    assert first.backward_s < 0.01 * trained.stage_plans[0].backward_s, first
    assert first.forward_s < 0.97 * trained.stage_plans[0].forward_s  # (no graph)
    assert second.backward_s == pytest.approx(trained.stage_plans[1].backward_s, rel=0.01)
    # the boundary's gradient, one microbatch's 1024 x 1024 float32 values: the second
    # stage no longer sends it back
    boundary = 1024 * 1024 * 4
    assert trained.stage_plans[1].memory_bytes - second.memory_bytes == \
        pytest.approx(boundary, rel=0.01)


def relu_stack(params, x, y):
    """Layers that end in a ReLU (which saves its output) before a layer that begins with
    a matmul (which saves its input): a CNN's conv, norm, ReLU pattern, as linears."""
    h = x
    for p in params["layers"]:
        h = torch.relu(F.linear(h, p["w"]))
    return ((h - y) ** 2).mean()


def test_a_value_two_blocks_save_is_counted_once():
    """A block's saved bytes are measured on its own, so an output it saves (a ReLU's)
    that the next block saves too (a matmul's input) was counted by both: HF RegNet's
    saved bytes came out 17 % over the meter (the fifty-third session). The model's saved
    bytes are now the meter's, one process (the whole batch, nothing sharded)."""
    from pxform.search.analysis import analyse

    torch.manual_seed(0)
    params = {"layers": [{"w": torch.randn(64, 64) * 0.1} for _ in range(4)]}
    args = (params, torch.randn(32, 64), torch.randn(32, 64))
    step = pxform.auto(relu_stack, mesh=1, memory_budget="80GiB", hardware="a100-80gb")
    graph, names, _ = step._graph(args)
    a = analyse(graph, names, trainable=step._cache["trainable"])
    assert len(a.blocks) >= 4
    predicted = sum(s.total for s in a.op_saved)
    with pxform.MemoryMeter() as meter:
        meter.track(args)
        pxform.value_and_grad(relu_stack)(*args)
    assert predicted == pytest.approx(meter.stats.saved_bytes, rel=0.01), \
        (predicted, meter.stats.saved_bytes)


def test_what_runs_before_anything_trains_keeps_nothing_to_recompute():
    """A recomputed block before the first that trains records no graph, so torch's
    checkpoint keeps none of its inputs; a pipeline stage before the first that trains
    runs no early recompute (the shifted schedule's R does nothing there,
    `pxform.runtime.pipeline`), so it keeps no input for one and its R takes no time.
    Before, both were counted as for a trained block: GPT small with its embeddings and
    first two layers frozen came out 3.8 % (data parallel) and 7.4 % (tensor parallel)
    over the meter with recompute, and 4.8 % on the shifted schedule's first stage."""
    import gpt

    from pxform.cost.model import CostModel
    from pxform.search.analysis import analyse
    from pxform.search.context import SearchContext
    from pxform.search.options import walk_cost
    from pxform.search.pipelines import ONE_F_ONE_B, ScheduleChoice
    from pxform.search.space import Config, Option

    cfg = gpt.GPT_CONFIGS["small"]  # (the embeddings, 4 layers, the head)
    hw = pxform.hardware.hardware("a100-80gb")

    def kept(frozen: set[str]) -> list[float]:
        params = gpt.init_params(cfg, device="meta")
        for k, leaf in zip(*optree.tree_flatten_with_path(params)[:2]):
            name = ".".join(map(str, k))
            leaf.requires_grad_(not any(name.startswith(f) for f in frozen))
        step = pxform.auto(gpt.loss_fn, mesh=2, hardware=hw)
        graph, names, _ = step._graph((params, gpt.make_batch(cfg, 8, device="meta"), cfg))
        a = analyse(graph, names, trainable=step._cache["trainable"])
        ctx = SearchContext(a, CostModel(hw), math.inf, 8)
        return [walk_cost(ctx, b, Config(1, 2, 1, 1), Option((("outer", "dp"),), True))
                .kept_bytes for b in a.blocks]

    # each layer keeps its input (4 sequences of 64 x 128 float32 on each device) unless
    # nothing before it trains
    rows = 4 * 64 * 128 * 4
    assert kept(set())[1:5] == [rows] * 4
    assert kept({"wte", "wpe", "blocks.0.", "blocks.1."})[1:5] == [0, 0, rows, rows]

    def pipelined(frozen: set[int], schedule: ScheduleChoice) -> Any:
        step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(2),
                           memory_budget="80GiB", hardware=CPU_PROFILE,
                           plan=Pin(stages=2, microbatches=8, schedule=schedule,
                                    block_stage=(0, 0, 1, 1, 1)))
        return step.plan(*_frozen_mlp(frozen, d=512, batch=2048))

    shifted = ScheduleChoice("shifted")
    first = pipelined({0, 1}, shifted).stage_plans[0]
    assert first.recompute_s == 0.0
    assert pipelined(set(), shifted).stage_plans[0].recompute_s > 0
    # its memory is 1F1B's but for the boundary values of the one more forward the
    # schedule runs before its first B (F0 F1 F2 R0 B0): no microbatch made again by an
    # R beside those sent
    boundary = 256 * 512 * 4  # (a microbatch of 256 rows per stage)
    assert first.memory_bytes - pipelined({0, 1}, ONE_F_ONE_B).stage_plans[0].memory_bytes \
        == pytest.approx(boundary, rel=1e-6)


def test_a_frozen_prefix_costs_no_backward_in_a_stage_that_trains():
    """Autograd's backward never reaches the blocks before the first that trains, and
    their forward records no graph, in whatever stage they run. Before, a stage that ran
    them beside a trained layer paid the calibrated per-op backward time on each of their
    ops, and per pipeline action the per-parameter and per-op costs of their parameters
    and ops in its B: GPT small's zero-bubble plan with its embeddings and first two
    layers frozen, whose first stage held them and one trained layer, was priced 18.7 %
    over its measured step (B + W priced 5.8 ms a microbatch, 2.35 ms measured)."""
    from pxform.search.pipelines import ScheduleChoice

    base = dataclasses.replace(pxform.hardware.hardware(CPU_PROFILE),
                               param_action_overhead_s=0.0, op_action_overhead_s=0.0)
    assert base.op_step_overhead_s > 0  # (the per-op time the backward no longer pays)
    args = _frozen_mlp({0, 1}, d=256, batch=512)

    def stage0(hw: Any) -> Any:
        step = pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(2), memory_budget="80GiB",
                           hardware=hw, plan=Pin(stages=2, microbatches=4,
                                                 schedule=ScheduleChoice("zb"),
                                                 block_stage=(0, 0, 0, 1, 1)))
        return step.plan(*args).stage_plans[0]

    # the per-action costs: every parameter's and op's in forward, the trained layer's
    # alone in backward (2 of 6 parameters, a third of the ops)
    plain = stage0(base)
    per_param = stage0(dataclasses.replace(base, param_action_overhead_s=1e-3))
    per_op = stage0(dataclasses.replace(base, op_action_overhead_s=1e-4))
    assert per_param.forward_s - plain.forward_s == pytest.approx(6e-3, rel=1e-6)
    assert per_param.backward_s - plain.backward_s == pytest.approx(2e-3, rel=1e-6)
    ops = (per_op.forward_s - plain.forward_s) / 1e-4
    assert per_op.backward_s - plain.backward_s == pytest.approx(ops / 3 * 1e-4, rel=1e-6)
    # and the frozen layers' blocks no backward time at all: the stage's backward is the
    # trained layer's, whatever the per-op time
    slow = stage0(dataclasses.replace(base, op_step_overhead_s=base.op_step_overhead_s * 3))
    layer_ops = ops / 3
    fitted = 2 / 3 * base.op_step_overhead_s * 2  # (two thirds of the added per-op time)
    assert slow.backward_s - plain.backward_s < (layer_ops + 1) * fitted * 1.5


def test_a_frozen_matrix_beside_a_trained_bias_costs_no_weight_gradient():
    """A linear with a frozen matrix and a trained bias (BitFit-style fine-tuning) sums the
    bias's gradient alone: no `x^T dy`. Before, an op with any trained weight was charged
    its whole weight gradient: GPT small with every matrix frozen and its biases and norms
    trained was priced 5-14 % over its measured step in every plan (the fifty-second
    session)."""
    import gpt

    from pxform.cost.model import CostModel
    from pxform.search.analysis import analyse
    from pxform.search.context import SearchContext
    from pxform.search.options import walk_cost
    from pxform.search.space import Config, Option

    cfg = gpt.GPT_CONFIGS["small"]
    hw = pxform.hardware.hardware("a100-80gb")

    def layer(frozen_matrices: bool) -> Any:
        params = gpt.init_params(cfg, device="meta")
        for leaf in optree.tree_leaves(params):
            leaf.requires_grad_(not (frozen_matrices and leaf.dim() == 2))
        step = pxform.auto(gpt.loss_fn, mesh=2, hardware=hw)
        graph, names, _ = step._graph((params, gpt.make_batch(cfg, 8, device="meta"), cfg))
        a = analyse(graph, names, trainable=step._cache["trainable"])
        ctx = SearchContext(a, CostModel(hw), math.inf, 8)
        return walk_cost(ctx, a.blocks[2], Config(1, 2, 1, 1),
                         Option((("outer", "dp"),), False))

    trained, frozen = layer(False), layer(True)
    assert frozen.weight_compute < 0.2 * trained.weight_compute
    # what the backward saves is those weight gradients
    saved = trained.weight_compute - frozen.weight_compute
    assert trained.bwd_compute - frozen.bwd_compute == pytest.approx(saved, rel=0.2)


def test_trainable_names_that_are_not_parameters_are_refused():
    from pxform.search import search

    args = _frozen_mlp(set())
    step = pxform.auto(residual_mlp, mesh=2, memory_budget="80GiB", hardware="a100-80gb")
    graph, names, _ = step._graph(args)
    with pytest.raises(pxform.PxformError) as info:
        search(graph, names, devices=2, budget=80 * 2**30,
               hardware=pxform.hardware.hardware("a100-80gb"),
               trainable={"layers.0.w1", "layers.9.w1"})
    text = str(info.value)
    assert "trainable names ['layers.9.w1'] are not floating inputs" in text
    assert "Fix: give names of graph inputs" in text


# ---------------------------------------------------------------- the busiest-rank bound


def _odd_mlp(layers: int, d: int = 512, batch: int = 1536,
             frozen: frozenset[int] = frozenset()):
    """`residual_mlp`'s arguments with `layers` layers, on real tensors (the layers in
    `frozen` marked requires_grad=False): an odd count is blocks that no cut into an even
    number of pipeline stages balances."""
    params = {"layers": [
        {"w1": torch.randn(4 * d, d).requires_grad_(k not in frozen),
         "w2": torch.randn(d, 4 * d).requires_grad_(k not in frozen)}
        for k in range(layers)]}
    return params, torch.randn(batch, d), torch.randn(batch, d)


def test_the_time_bound_holds_for_every_schedule_on_uneven_blocks(monkeypatch):
    """`bounds.lower_bound` also bounds a pipeline by its busiest rank: m times the least
    busiest stage of any cut of the blocks (one stage per rank), or of any assignment of
    them to ranks (an interleaved pipeline's chunks); `bounds.quick_bound` does so from
    the blocks' compute alone. Checked, per schedule, against every plan the search
    evaluates, on blocks that no cut balances, on hardware whose device
    overlaps the host's time per op (where a stage's F and B are less than its blocks'
    sums), on the CPU profile with its per-action costs, and with a frozen prefix (whose
    stage runs no backward)."""
    import pxform.search.partition as core
    from pxform.cost.hardware import hardware
    from pxform.search.bounds import lower_bound, quick_bound

    checked = []
    real_evaluate = core.evaluate

    def checking(ctx, config, objective="time", incumbent=math.inf, *rest):
        cand, more = real_evaluate(ctx, config, objective, incumbent, *rest)
        quick = quick_bound(ctx, config)
        for c in ([cand] if cand is not None else []) + list(more):
            bound = lower_bound(ctx, config, None, (c.schedule,))
            assert bound <= c.step_time * (1 + 1e-9), (config, c.schedule, bound, c.step_time)
            assert quick <= c.step_time * (1 + 1e-9), (config, c.schedule, quick, c.step_time)
            checked.append((config.stages, c.schedule.name))
        return cand, more

    monkeypatch.setattr(core, "evaluate", checking)
    overlapped = dataclasses.replace(hardware("a100-80gb"), host_overlaps=True,
                                     op_step_overhead_s=2e-4, recompute_overhead_s=1e-4)
    pins = [Pin(stages=2, microbatches=4, schedule=ScheduleChoice(name))
            for name in ("1f1b", "zb", "shifted")]
    pins += [Pin(stages=3, microbatches=6), Pin(stages=2, microbatches=8,
                                                schedule=ScheduleChoice("interleaved", 2))]
    for hw in (hardware("a100-80gb"), overlapped, hardware(CPU_PROFILE)):
        for frozen in (frozenset(), frozenset({0, 1})):
            args = _odd_mlp(5, frozen=frozen)
            for pin in pins:
                pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(6 if pin.stages == 3
                                                                    else 4),
                            memory_budget="80GiB", hardware=hw, plan=pin,
                            tolerance=0.0).plan(*args)
        # and the search over everything, twice the traced batch among its batch sizes
        # (a microbatch above the traced batch: the walks' line beyond it)
        pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(4), memory_budget="80GiB",
                    hardware=hw, tolerance=0.0, batch_range=(768, 3072)).plan(*args)
    assert {s for _, s in checked} >= {"1f1b", "zb", "shifted", "interleaved"}
    assert {p for p, _ in checked} >= {1, 2, 3}


def test_blocks_that_no_stage_cut_balances_bound_their_pipelines_out(monkeypatch):
    """Pipelines of blocks that cannot be cut evenly (three layers on 2 stages: one holds
    two) are bounded by their busiest stage, so branch and bound evaluates fewer
    configurations; the plan is the one it found with the even-spread bound alone.
    Without the busiest-stage bound, three pipelines of BERT-large's 26 blocks on 8
    devices were evaluated before the data-parallel plan won (0.1 s of a process's first
    search: their schedules compiled)."""
    import pxform.search.bounds as bounds
    import pxform.search.partition as core

    evaluated: list[object] = []
    real_evaluate = core.evaluate

    def counting(ctx, config, *rest):
        evaluated.append(config)
        return real_evaluate(ctx, config, *rest)

    monkeypatch.setattr(core, "evaluate", counting)
    args = _odd_mlp(3, d=1024, batch=8192)

    def plan() -> Any:
        return pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(4), memory_budget="80GiB",
                           hardware="a100-80gb", tolerance=0.0).plan(*args)

    bounded = plan()
    with_bound = [c for c in evaluated if c.stages > 1]
    evaluated.clear()
    monkeypatch.setattr(bounds, "least_bottleneck", lambda times, parts: 0.0)
    monkeypatch.setattr(bounds, "least_busiest", lambda times, ranks: 0.0)
    spread = plan()
    without = [c for c in evaluated if c.stages > 1]
    assert len(with_bound) < len(without), (with_bound, without)
    assert pin_of(bounded) == pin_of(spread)
    assert bounded.step_time_s == spread.step_time_s


@given(st.lists(st.floats(0.0, 10.0), min_size=1, max_size=8), st.integers(1, 4))
def test_the_busiest_stage_and_rank_bounds_against_brute_force(times, parts):
    """`least_bottleneck` is the least largest run over every cut of the times in order
    into `parts` runs (to 1e-7, never above); `least_busiest` is at most the least
    busiest rank over every assignment of them to `parts` ranks."""
    from pxform.search.bounds import least_bottleneck, least_busiest

    n = len(times)
    cuts = [min(max(sum(times[a:b]) for a, b in zip((0, *c), (*c, n)))
                for c in itertools.combinations_with_replacement(range(n + 1), parts - 1))]
    best_cut = min(cuts)
    got = least_bottleneck(times, parts)
    assert got <= best_cut
    assert got >= best_cut * (1 - 1e-6) - 1e-12
    best_any = min(max(sum(t for t, r in zip(times, ranks) if r == k) for k in range(parts))
                   for ranks in itertools.product(range(parts), repeat=n))
    assert least_busiest(times, parts) <= best_any + 1e-9
    assert least_busiest(times, parts) <= best_cut + 1e-9


def test_configurations_the_quick_bound_rules_out_get_no_tables(monkeypatch):
    """The search orders configurations by their full lower bounds, but makes one (which
    builds the configuration's option tables: its walks) only when its quick bound
    (`bounds.quick_bound`, from the blocks' compute) is not already enough to skip it.
    Five layers on 8 devices: pipelines of 2 and 4 stages are ruled out so, and the
    configurations evaluated, in their order, and the plan are those of the search that
    builds every table first."""
    import pxform.search.bounds as bounds
    import pxform.search.partition as core
    from pxform.search.options import block_tables

    built: list[object] = []
    evaluated: list[object] = []
    real_evaluate, real_tables = core.evaluate, block_tables

    def counting(ctx, config, *rest):
        evaluated.append(config)
        return real_evaluate(ctx, config, *rest)

    def tables(ctx, config):
        if config not in ctx.tables:
            built.append(config)
        return real_tables(ctx, config)

    monkeypatch.setattr(core, "evaluate", counting)
    monkeypatch.setattr(bounds, "block_tables", tables)
    monkeypatch.setattr(core, "block_tables", tables)
    args = _odd_mlp(5, d=1024, batch=8192)

    def plan() -> Any:
        return pxform.auto(residual_mlp, mesh=pxform.Mesh.abstract(8), memory_budget="80GiB",
                           hardware="a100-80gb").plan(*args)

    quick = plan()
    quick_built, quick_evaluated = list(built), list(evaluated)
    built.clear()
    evaluated.clear()
    monkeypatch.setattr(bounds, "quick_bound", lambda ctx, config: 0.0)
    monkeypatch.setattr(core, "quick_bound", lambda ctx, config: 0.0)
    every = plan()
    assert quick_evaluated == evaluated
    assert set(quick_built) < set(built)
    assert {c.stages for c in set(built) - set(quick_built)} >= {2, 4}
    assert pin_of(quick) == pin_of(every)
    assert quick.step_time_s == every.step_time_s
