"""The README's flagship demo, `bash run.sh`, end to end (CI=true: the short training run):
plan GPT-3 175B for 1,024 H100s, calibrate this machine on 2 gloo ranks, train a GPT on
them under torchrun with a searched plan, report predicted vs measured, check against one
process."""

from __future__ import annotations

import os
import pathlib
import re

from pxform.tools.testing import run_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_run_sh(tmp_path):
    """The README's first command, under CI=true. `.ci/run` runs it just before the suite
    (in a fresh clone, without extras) and passes its output here (`PXFORM_RUN_SH_LOG`,
    the files in `PXFORM_DEMO_OUT`; it stops at once if run.sh fails): what it printed and
    wrote is checked instead of running the demo twice. Otherwise it runs here."""
    log = os.environ.get("PXFORM_RUN_SH_LOG")
    if log:
        with open(log) as f:
            out = f.read()
        tmp_path = pathlib.Path(os.environ["PXFORM_DEMO_OUT"])
    else:
        env = dict(os.environ, CI="true", PXFORM_DEMO_OUT=str(tmp_path))
        r = run_process(["bash", os.path.join(ROOT, "run.sh")], timeout=600, env=env,
                        cwd=ROOT)
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
        out = r.stdout
    # 1: the GPT-3 plan and its frontier, saved
    assert "1024 devices" in out and "frontier" in out.lower()
    assert (tmp_path / "gpt3-175b-1024xh100.json").exists()
    # 2: a measured profile of this machine
    assert "memory bandwidth" in out and (tmp_path / "cpu-profile.json").exists()
    # the profile fitted to the GPT's own step, and trained with
    assert "profile cpu-x2 on 2 ranks: loss_fn(" in out
    assert "check-profile" in (tmp_path / "cpu-profile-gpt.json").read_text()
    # 3: training with a plan searched against that profile, predictions checked
    assert "devices (cpu-x2)" in out
    assert re.search(r"step\s+8\s+loss", out)
    assert "predicted vs measured" in out and "check passed" in out
