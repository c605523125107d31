"""The example scripts, run as real processes: `examples/compose_by_hand.py` under torchrun
on 2 gloo ranks (recompute inside a 2-stage 1F1B pipeline inside `shard`) must match one
process in loss and gradients and train; `examples/plan_cluster.py --quick` must print a
plan and write it as JSON (and its pictures when matplotlib is installed). Plus the
scripts' argument checks and the recompute wrapper, in process.

Run alone: `python -m pytest tests/test_examples_scripts.py -q` (about 30 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import pxform
from pxform.tools.testing import torchrun

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 240  # far above the ~15 s these take, for a loaded CI machine


def _env() -> dict[str, str]:
    # one thread per process: the ranks share few cores
    return dict(os.environ, OMP_NUM_THREADS="1")


def _run(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=cwd,
                            timeout=TIMEOUT_S)
    assert result.returncode == 0, (f"{' '.join(cmd)} exited {result.returncode}\n"
                                    f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}")
    return result


# ---------------------------------------------------------------- compose_by_hand.py


@pytest.mark.slow
def test_compose_by_hand_on_two_ranks_matches_one_process(tmp_path):
    result = torchrun(EXAMPLES / "compose_by_hand.py", "--size", "tiny", "--steps", "2",
                      "--check", "--dtype", "float64", timeout=TIMEOUT_S, cwd=tmp_path)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    out = result.stdout
    # what was composed, and what the library made of it
    assert "layer = pxform.recompute(gpt.block, policy='nothing')" in out
    assert "pxform.pipeline(loss, stages=2, microbatches=4, schedule='1f1b')" in out
    assert "pxform.shard(step, mesh=Mesh(pp=2, dp=1)" in out
    assert "stage 0: ops" in out and "embed, layer 0" in out  # the stage cuts
    assert re.search(r"^rank 0: 0F0 0SF0 ", out, re.M)  # the 1F1B schedule with sends
    assert re.search(r"^stage 1 on Mesh\(dp=1, mb=4\): \d+ ops, 1 recompute region",
                     out, re.M)
    # the check: step 1's loss and gradients, then every step's loss, against one process
    assert "check step 1: loss and gradients match one process (atol 1e-10" in out
    assert "check PASSED: 2 step(s) agree with one process" in out
    losses = [float(x) for x in re.findall(r"^step \d: loss ([0-9.]+)", out, re.M)]
    assert len(losses) == 2 and losses[1] < losses[0]  # SGD lowers the loss
    assert "holds 14 of 28 gradients" in out  # rank 0 has its stage's, not the other's


def test_compose_by_hand_refuses_to_run_outside_torchrun(tmp_path):
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, str(EXAMPLES / "compose_by_hand.py")],
                            capture_output=True, text=True, env=env, cwd=tmp_path,
                            timeout=TIMEOUT_S)
    assert result.returncode == 2
    assert "torchrun --nproc-per-node 2" in result.stderr


@pytest.mark.parametrize("policy", ["nothing", "matmuls", "none"])
def test_recomputed_blocks_give_the_plain_loss_and_gradients(policy):
    import compose_by_hand
    import gpt

    cfg = gpt.GPT_CONFIGS["tiny"]
    params = gpt.init_params(cfg, dtype=torch.float64)
    batch = gpt.make_batch(cfg, 4)
    loss, grads = pxform.value_and_grad(compose_by_hand.make_loss(cfg, policy))(params, batch)
    ref_loss, ref_grads = pxform.value_and_grad(
        lambda p, b: gpt.loss_fn(p, b, cfg))(params, batch)
    assert compose_by_hand.compare(loss, grads, ref_loss, ref_grads, 1e-12, 0.0) == []
    # and the comparison does notice a difference
    worse = compose_by_hand.compare(loss + 1e-3, grads, ref_loss, ref_grads, 1e-12, 0.0)
    assert len(worse) == 1 and worse[0].startswith("loss ")


# ---------------------------------------------------------------- plan_cluster.py


@pytest.fixture(scope="module")
def quick_plan(tmp_path_factory):
    """`plan_cluster.py --quick` run once: (stdout, the output folder)."""
    out = tmp_path_factory.mktemp("plan_cluster") / "out"
    result = _run([sys.executable, str(EXAMPLES / "plan_cluster.py"), "--quick",
                   "--out", str(out)], out.parent)
    return result.stdout, out


@pytest.mark.slow
def test_plan_cluster_quick_prints_and_saves_the_plan(quick_plan):
    out, folder = quick_plan
    assert "== gpt-1.3b-h100x16: GPT-3 1.3B" in out and "on 16 x h100-80gb" in out
    for text in ("config: pp=", "predicted step", "samples/s", "peak memory", "search ",
                 "blocks: ", "frontier: "):
        assert text in out, text
    path = folder / "gpt-1.3b-h100x16" / "plan.json"
    assert path.is_file()
    plan = pxform.Plan.load(path)
    assert (plan.devices, plan.hardware, plan.global_batch) == (16, "h100-80gb", 64)
    assert f"config: {plan.config_text()}" in out
    assert f"predicted step {plan.step_time_s:.4g} s" in out
    assert plan.frontier() and re.search(r"^\*", out, re.M)  # the chosen frontier point
    explain = (folder / "gpt-1.3b-h100x16" / "explain.txt").read_text()
    assert plan.explain(per_block=True) in explain
    if importlib.util.find_spec("matplotlib") is None:
        assert "pictures are skipped" in out


@pytest.mark.slow
def test_plan_cluster_quick_draws_the_pictures(quick_plan):
    pytest.importorskip("matplotlib")
    _, folder = quick_plan
    for name in ("frontier.png", "timeline.png"):
        png = folder / "gpt-1.3b-h100x16" / name
        assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_plan_cluster_case_names_are_checked(capsys):
    import plan_cluster

    assert plan_cluster.parse_args(["--cases", "all"]).case_names == tuple(plan_cluster.CASES)
    assert plan_cluster.parse_args([]).case_names == plan_cluster.DEFAULT
    assert set(plan_cluster.DEFAULT) < set(plan_cluster.CASES)
    with pytest.raises(SystemExit):
        plan_cluster.parse_args(["--cases", "gpt3-175b-h100x256,nope"])
    assert "unknown case(s) nope" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        plan_cluster.parse_args(["--quick", "--cases", "all"])
