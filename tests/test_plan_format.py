"""A plan is a complete, versioned value: its JSON is golden-tested, files of another
format are refused naming both versions, and lowering a loaded plan needs neither the
search nor the cost model (checked in a fresh process, through `sys.modules`)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import pxform
from pxform.search import Pin
from pxform.search.space import Option

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "golden", "plan_mlp.json")


def mlp(params, x, y):
    h = x
    for p in params["layers"]:
        h = h + F.linear(F.gelu(F.linear(h, p["w1"])), p["w2"])
    return ((h - y) ** 2).mean()


def mlp_args(device="meta"):
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(device)

    params = {"layers": [{"w1": t(32, 16), "w2": t(16, 32)} for _ in range(3)]}
    return params, t(8, 16), t(8, 16)


DP_TP = Option((("outer", "dp"), ("inner", "tp")), False)
DP_TP_RECOMPUTE = Option((("outer", "dp"), ("inner", "tp")), True)
SDP_TP = Option((("outer", "sdp"), ("inner", "tp")), False)
DP_DP = Option((("outer", "dp"), ("inner", "dp")), False)
# every kind of choice a plan stores: stages, data, tensor, ZeRO-3 and recompute roles
PIN = Pin(stages=2, outer=2, inner=2, microbatches=2,
          block_options=(DP_TP, DP_TP_RECOMPUTE, SDP_TP, DP_TP))


def small_plan():
    step = pxform.auto(mlp, mesh=8, memory_budget="1GiB", hardware="a100-80gb", plan=PIN)
    return step.plan(*mlp_args())


def test_plan_json_is_golden():
    # search_seconds is the one field that depends on the machine
    got = dataclasses.replace(small_plan(), search_seconds=0.0).to_json()
    if os.environ.get("PXFORM_REGEN_GOLDEN"):
        with open(GOLDEN, "w") as f:
            json.dump(got, f, indent=1)
            f.write("\n")
    with open(GOLDEN) as f:
        want = json.load(f)
    assert got == want, ("the plan's JSON changed; if on purpose, regenerate with "
                         "PXFORM_REGEN_GOLDEN=1 pytest tests/test_plan_format.py")
    plan = pxform.Plan.from_json(want)
    assert plan.format_version == 2 and want["format"] == "pxform-plan/2"
    # what the lowering reads is there, as data
    assert [b.stop - b.start for b in plan.blocks] == [len(b.ops) for b in plan.blocks]
    assert plan.blocks[1].recompute and plan.blocks[1].ops[0].startswith("s:")
    specs = dict(plan.parameter_specs)
    assert specs["layers.1.w1"] == pxform.P("inner")                  # column parallel
    assert specs["layers.2.w1"] == pxform.P("inner", "outer")         # and ZeRO-3
    assert dict(plan.batch_input_specs)["x"] == pxform.P("outer")


def test_round_trip_and_other_versions(tmp_path):
    plan = small_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    assert pxform.Plan.load(path) == plan
    old = json.loads(path.read_text())
    old["format"] = "pxform-plan/1"
    path.write_text(json.dumps(old))
    with pytest.raises(pxform.PxformError) as info:
        pxform.Plan.load(path)
    msg = str(info.value)
    assert "format pxform-plan/1" in msg and "reads pxform-plan/2" in msg
    assert "Fix: search the plan again" in msg


def test_a_plan_refuses_another_graph():
    plan = small_plan()
    params, x, y = mlp_args()
    step = pxform.auto(mlp, mesh=8, plan=plan)
    assert step.plan(params, x, y) is plan  # given plans are used as they are
    with pytest.raises(pxform.PxformError, match=r"the plan was made for other arguments "
                       r"or another function \(plan fingerprint"):
        step.plan(params, torch.empty(16, 16, device="meta"), torch.empty(16, 16,
                                                                        device="meta"))


# run in a fresh interpreter: the model functions are copied in by their source, so the
# script imports nothing of this test module (which imports the search for its Pin)
LOWER_LOADED = """
plan = pxform.Plan.load({path!r})
params, x, y = mlp_args("cpu")
with fake_world(8, rank=1):
    step = pxform.auto(mlp, mesh=8, plan=plan)
    program = step.executable(params, x, y).lower(params, x, y)
banned = sorted(m for m in sys.modules
                if m.startswith(("pxform.cost", "pxform.search."))
                and m not in ("pxform.search.plan", "pxform.search.report"))
print("STAGES", len(program.stages))
print("BANNED", banned)
"""


def test_lowering_a_loaded_plan_imports_neither_search_nor_cost_model(tmp_path):
    path = tmp_path / "plan.json"
    small_plan().save(path)
    script = "\n".join(["import sys", "import torch", "import torch.nn.functional as F",
                        "import pxform", "from pxform.tools.testing import fake_world",
                        inspect.getsource(mlp), inspect.getsource(mlp_args),
                        LOWER_LOADED.format(path=str(path))])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in out.stdout.splitlines() if " " in line)
    assert lines["STAGES"] == "2"
    assert lines["BANNED"] == "[]", lines["BANNED"]


def test_a_plan_missing_an_op_choice_is_refused_by_the_lowering():
    from pxform.core.mesh import AbstractMesh
    from pxform.lower.plan import PlanLowering
    from pxform.passes.expand import prepare

    plan = small_plan()
    tp_block = plan.blocks[1]
    broken = dataclasses.replace(tp_block, ops=tuple(t.split("/")[0] + "/-"
                                                     for t in tp_block.ops))
    bad = dataclasses.replace(plan, blocks=(plan.blocks[0], broken, *plan.blocks[2:]))
    graph = prepare(pxform.trace(mlp, *mlp_args()).graph)
    mesh = AbstractMesh({"outer": 2, "inner": 2, "mb": 2})
    with pytest.raises(pxform.PxformError, match=r"the plan's block layer 1 has a tensor role "
                       r"but op 0 has no tensor choice \('s:a/-'\)"):
        PlanLowering(bad, "auto(mlp)").strategies(graph, mesh, [])
