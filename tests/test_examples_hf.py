"""`examples/hf_models.py` runs as users run it: under `torchrun` on 2 gloo ranks, it plans,
trains 3 steps of a small HF model (GPT-2, BERT, Llama; float64) under `pxform.auto`, and its
`--check` agrees with the same training on one process (loss curve, first-step gradients,
parameter updates). Real subprocesses, so the launcher, the process group and the exit code
are the ones a user gets. The check itself is tested in-process: it fails on each kind of
divergence (loss, gradient scale, a missed update, a missing gradient)."""

from __future__ import annotations

import os
import re
import subprocess
from typing import Any

import pytest
import torch

from pxform.tools.testing import torchrun

pytest.importorskip("transformers")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "hf_models.py")
STEPS = 3


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    """Run the example under torchrun on 2 ranks (`pxform.testing.torchrun`)."""
    return torchrun(SCRIPT, *args, env={"PYTHONPATH": ROOT}, cwd=ROOT)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["gpt2", "bert", "llama"])
@pytest.mark.heavy
def test_example_trains_and_matches_one_process(model):
    result = _torchrun("--model", model, "--steps", str(STEPS), "--check",
                       "--dtype", "float64")
    out = result.stdout
    assert result.returncode == 0, out[-4000:] + result.stderr[-4000:]
    assert f"plan for {model}_loss: 2 devices" in out
    # rank 0 logged every step, then printed both curves side by side and the verdict
    logged = re.findall(r"^step +(\d+) +loss (\S+) +[\d.]+ ms$", out, re.MULTILINE)
    assert [int(i) for i, _ in logged] == list(range(STEPS))
    rows = re.findall(r"^ +(\d+) +(\S+) +(\S+) +(\S+)$", out, re.MULTILINE)
    assert [int(r[0]) for r in rows] == list(range(STEPS))
    for (_, dist_loss), (_, a, b, rel) in zip(logged, rows):
        assert abs(float(a) - float(dist_loss)) < 1e-5
        assert abs(float(a) - float(b)) <= 1e-5 * abs(float(b)) and float(rel) <= 1e-5
    assert "first-step gradients: max |difference|" in out
    assert "final parameters: |update difference| / |update|" in out
    assert "MISMATCH" not in out
    assert out.rstrip().endswith("check passed")


def _runs(lr: float) -> tuple[dict[str, torch.Tensor], Any]:
    """Initial parameters and a reference run of one step from them (Adam's first step
    moves every element by lr against its gradient's sign)."""
    import hf_models

    f64 = torch.float64
    initial = {"w": torch.zeros(4, 3, dtype=f64), "b": torch.zeros(3, dtype=f64)}
    grads = {"w": torch.full((4, 3), 0.5, dtype=f64), "b": torch.full((3,), -0.25, dtype=f64)}
    final = {k: v - lr * grads[k].sign() for k, v in initial.items()}
    return initial, hf_models.Run([4.0], grads, final)


@pytest.mark.parametrize("fault", ["none", "loss", "gradient scale", "missed update",
                                   "missing gradient"])
def test_check_compares_curves_gradients_and_updates(fault, capsys):
    # the verdict the smoke tests rely on: it fails on each kind of divergence, fast and
    # in-process (a fault cannot be injected into the torchrun subprocess from here)
    import hf_models

    args = hf_models.parse_args(["--dtype", "float64", "--lr", "0.01", "--check"])
    initial, ref = _runs(args.lr)
    curve, grads, final = list(ref.curve), dict(ref.first_grads), dict(ref.final)
    if fault == "loss":
        curve[0] += 1e-3
    elif fault == "gradient scale":  # invisible to Adam's updates: the gradients tell
        grads = {k: 2 * g for k, g in grads.items()}
    elif fault == "missed update":  # a parameter the optimizer never stepped
        final["b"] = initial["b"]
    elif fault == "missing gradient":
        del grads["b"]
    ok = hf_models.compare(args, hf_models.Run(curve, grads, final), ref, initial, {"w", "b"})
    out = capsys.readouterr().out
    assert ok == (fault == "none"), out
    assert out.rstrip().endswith("check passed" if ok else "check FAILED")
    assert ("MISMATCH" in out or "missing" in out) == (fault != "none")
