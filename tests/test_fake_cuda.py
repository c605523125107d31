"""Device placement without a GPU: one training step of each parallel form with every input
a fake CUDA tensor (`FakeTensorMode`) over a fake process group, on this CPU-only build.

A tensor the runtime made on the CPU and mixed with the inputs raises
`FakeTensorDeviceMismatchError`. Backward needs the autograd engine to accept CUDA
tensors, which a CPU-only build cannot: `tests/fakecuda` compiles a small shim that
registers PyTorch's own fake device guard for CUDA (no kernels, no memory) and loads it
before torch, in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import fakecuda  # noqa: E402

FORMS = ("dp", "zero3", "tp", "sp", "pp", "tp_overlap", "zero3_bf16")
NEGATIVE = ("dp:cpu-leak", "pp:runtime-cpu")


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    why = fakecuda.available()
    if why is not None:
        pytest.skip(f"fake CUDA shim cannot be built: {why}")
    fakecuda.library()  # build once, outside the timed run
    proc = subprocess.run([sys.executable, os.path.join(HERE, "fakecuda", "step.py"),
                           *FORMS, *NEGATIVE], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(FORMS) + len(NEGATIVE), proc.stdout + proc.stderr[-4000:]
    return {r["case"]: r for r in lines}


@pytest.mark.parametrize("form", FORMS)
def test_a_training_step_keeps_every_tensor_on_the_inputs_device(results, form):
    r = results[form]
    assert "error" not in r, r.get("where", r)
    assert r["loss_device"] == "cuda:0"
    assert r["grad_devices"] == ["cuda:0"]  # every gradient, DTensors' local pieces too
    assert r["num_grads"] == (14 if form == "pp" else 28)  # pp: rank 0 holds stage 0
    assert r["grad_dtypes"] == ["torch.float32"]  # zero3_bf16 too: master weights' dtype


def test_a_cpu_tensor_among_cuda_inputs_is_caught(results):
    r = results["dp:cpu-leak"]
    assert r["error_type"] == "FakeTensorDeviceMismatchError", r
    assert "cuda:0 and cpu" in r["error"]


def test_pipeline_buffers_made_on_the_cpu_are_caught(results):
    # the executor as it was before it took its device from the inputs: receive buffers
    # and zero gradients on the CPU
    r = results["pp:runtime-cpu"]
    assert r["error_type"] == "FakeTensorDeviceMismatchError", r
