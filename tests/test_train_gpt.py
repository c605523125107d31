"""examples/train_gpt.py under real torchrun launches (2 gloo ranks): training matches one
process, predicted vs measured is reported, and a rank killed mid-run makes torchrun
restart the job from the last checkpoint with final parameters bitwise equal to an
uninterrupted run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from pxform.tools.testing import torchrun as run_torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "train_gpt.py")


def torchrun(*args: str, restarts: int = 0) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 [--max-restarts] examples/train_gpt.py args`."""
    return run_torchrun(SCRIPT, *args, restarts=restarts, env={"PYTHONPATH": ROOT}, cwd=ROOT)


def test_train_matches_one_process_and_reports_predictions(tmp_path):
    # --stages 1 keeps every rank on every block (the resume test below runs a pipeline)
    log = tmp_path / "losses.json"
    r = torchrun("--size", "tiny", "--steps", "4", "--dtype", "float64", "--stages", "1",
                 "--check", "--report-at", "2", "--log-json", str(log))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = r.stdout
    assert "check passed" in out
    assert "worst loss difference" in out
    # the report: a row per rank with predicted and measured time and memory
    assert "predicted vs measured" in out
    rows = [line.split() for line in out.splitlines()
            if line.strip().startswith(("0 ", "1 ")) and "ms" in line and "iB" in line]
    assert len(rows) == 2, out
    losses = json.loads(log.read_text())["losses"]
    assert [k for k, _ in losses] == [1, 2, 3, 4]


def test_bf16_precision_with_clipping_matches_float32_on_one_process():
    # --precision bf16: pxform.Precision() under the searched plan; --clip: global-norm
    # clipping over the DTensor gradients, the reference clips the same way
    r = torchrun("--size", "tiny", "--steps", "6", "--precision", "bf16", "--clip", "1.0",
                 "--stages", "1", "--check")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bf16 compute" in r.stdout and "precision: Precision(" in r.stdout
    assert "check passed" in r.stdout


def test_check_fails_when_training_differs(tmp_path):
    # the check is not vacuous: the reference's own curve passes, a loss off by 1e-6 or
    # a parameter off by 1e-3 fails (check() is a function of the logged run)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import train_gpt
    from gpt import GPT_CONFIGS

    args = train_gpt.parse_args(["--size", "tiny", "--steps", "2", "--dtype", "float64"])
    cfg = GPT_CONFIGS["tiny"]
    losses, params = train_gpt.reference(cfg, args, torch.float64, 2)
    logged = [(k + 1, v) for k, v in enumerate(losses)]
    assert train_gpt.check(cfg, args, torch.float64, logged, params) == 0
    bad = [(1, logged[0][1]), (2, logged[1][1] * (1 + 1e-6))]
    assert train_gpt.check(cfg, args, torch.float64, bad, params) == 1
    moved = {k: v.clone() for k, v in params.items()}
    moved["wte"][0, 0] += 1e-3
    assert train_gpt.check(cfg, args, torch.float64, logged, moved) == 1


@pytest.mark.heavy
def test_resume_after_a_rank_is_killed(tmp_path):
    # a 2-stage pipeline: each rank checkpoints only the stage it owns
    common = ["--size", "tiny", "--steps", "8", "--ckpt-every", "3", "--log-every", "100",
              "--stages", "2"]
    whole = torchrun(*common, "--ckpt-dir", str(tmp_path / "a"),
                     "--save-final", str(tmp_path / "a.pt"))
    assert whole.returncode == 0, whole.stdout[-3000:] + whole.stderr[-3000:]
    # the last rank dies (SIGKILL) after step 5; torchrun restarts both ranks, which
    # resume from the checkpoint of step 3 and train steps 4..8 again
    killed = torchrun(*common, "--ckpt-dir", str(tmp_path / "b"),
                      "--save-final", str(tmp_path / "b.pt"), "--fail-at-step", "5",
                      restarts=2)
    assert killed.returncode == 0, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert "simulated failure after step 5" in killed.stdout
    assert "resumed from" in killed.stdout and "at step 3 (attempt 1)" in killed.stdout
    assert "pp=2" in killed.stdout
    a = torch.load(tmp_path / "a.pt")
    b = torch.load(tmp_path / "b.pt")
    assert a.keys() == b.keys() and len(a) == 28
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, different
    # and training did move the parameters (the comparison is not of two initial states)
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from gpt import GPT_CONFIGS, init_params

    start = init_params(GPT_CONFIGS["tiny"], seed=0)
    assert not torch.equal(start["wte"], a["wte"])
