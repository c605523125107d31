"""`plan.report(measured)`: predictions beside measurements, per rank (no processes:
a plan searched on fake tensors and a hand-made measurement)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

import pxform
from pxform.search import Pin
from pxform.tools.measure import Measured, RankMeasure

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))
import gpt  # noqa: E402

CFG = gpt.GPT_CONFIGS["tiny"]


def plan_for(the_pin: Pin) -> pxform.Plan:
    params = gpt.init_params(CFG, device="meta")
    batch = gpt.make_batch(CFG, 8, device="meta")
    return pxform.auto(gpt.loss_fn, mesh=4, hardware="a100-40gb", plan=the_pin).plan(
        params, batch, CFG)


def test_report_sets_each_rank_beside_its_stage():
    plan = plan_for(Pin(stages=2, microbatches=4))
    t = plan.step_time_s
    mems = {s.stage: s.memory_bytes for s in plan.stage_plans}
    ranks = tuple(RankMeasure(r, (t * 2, t * 2, t * 4), int(mems[r // 2] / 2), 0, 0, "cpu")
                  for r in range(4))
    report = plan.report(Measured("loss_fn", ranks))
    assert [(r.rank, r.stage) for r in report.ranks] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert report.measured_time_s == pytest.approx(2 * t)     # the slowest rank's median
    assert report.time_error == pytest.approx(-0.5)           # predicted half the measured
    assert report.memory_error == pytest.approx(1.0, rel=1e-4)  # predicted twice (int bytes)
    text = str(report)
    assert "predicted vs measured" in text and "-50.0%" in text and "+100.0%" in text
    assert text.count("\n") == 6  # title, header, a row per rank, the summary


def test_report_needs_a_measurement_of_the_plans_world():
    plan = plan_for(Pin(stages=1))
    one = Measured("loss_fn", (RankMeasure(0, (1.0,), 1, 0, 0, "cpu"),))
    with pytest.raises(pxform.PxformError, match=r"(?s)is for 4 devices but the measurement "
                                                 r"has 1 rank\(s\).*torchrun "
                                                 r"--nproc-per-node 4"):
        plan.report(one)


def test_measure_on_one_process_counts_the_optimizer_state():
    params = gpt.init_params(CFG, dtype=torch.float64)
    batch = gpt.make_batch(CFG, 4)
    flat = [params["wte"], params["wpe"]]
    opt = torch.optim.Adam(flat)
    for p in flat:
        p.grad = torch.zeros_like(p)
    opt.step()
    m = pxform.measure(lambda p, b: gpt.loss_fn(p, b, CFG), params, batch, optimizer=opt,
                       steps=2, warmup=0)
    (r,) = m.ranks
    state = sum(2 * p.numel() * 8 for p in flat)  # two float64 moments
    assert state <= r.state_bytes <= state + 64   # + the step counters
    assert r.peak_memory_bytes > r.state_bytes + params["wte"].numel() * 8
    assert len(r.step_times_s) == 2 and m.step_time_s > 0
    with pytest.raises(pxform.PxformError, match="steps=0"):
        pxform.measure(lambda p, b: gpt.loss_fn(p, b, CFG), params, batch, steps=0)
