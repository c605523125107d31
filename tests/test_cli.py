"""The `pxform` console script (`pxform.cli`): `plan` end to end on the tiny GPT, its
error messages and exit codes, `--version`, `calibrate` wiring, and the installed entry
point in a subprocess."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import pxform
from pxform.runtime import calibrate
from pxform.tools.cli import _ProgressBar, build_parser, main

ROOT = Path(__file__).resolve().parents[1]
TINY = "examples.factories:gpt_tiny"
SMALL_RUN = ["--devices", "2", "--batch", "8", "--hardware", "a100-40gb", "--memory", "40GiB"]


@pytest.fixture
def at_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository root; undo what the CLI adds to sys.path."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "path", list(sys.path))
    return ROOT


def test_plan_prints_and_saves_the_plan(at_root, tmp_path, capsys):
    out = tmp_path / "new" / "plan.json"  # folders are created
    assert main(["plan", TINY, *SMALL_RUN, "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "predicted step" in captured.out
    assert "frontier:" in captured.out
    assert any(line.startswith("*") for line in captured.out.splitlines())  # chosen marked
    assert "searching 2 devices" in captured.err and "searched in" in captured.err
    loaded = pxform.Plan.load(out)
    assert loaded.config_text() in captured.out
    assert loaded.explain() in captured.out
    assert (loaded.devices, loaded.hardware, loaded.memory_budget) == (2, "a100-40gb", 40 * 2**30)


def test_plan_writes_plots(at_root, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    plots = tmp_path / "plots"
    args = ["plan", TINY, *SMALL_RUN, "--out", str(tmp_path / "plan.json"),
            "--plots", str(plots), "--quiet"]
    assert main(args) == 0
    captured = capsys.readouterr()
    assert "predicted step" in captured.out and captured.err == ""
    for name in ("frontier.png", "timeline.png"):
        png = plots / name
        assert png.is_file() and png.stat().st_size > 0
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_from_a_file_path(at_root, capsys):
    spec = os.path.join("examples", "factories.py") + ":gpt_tiny"
    assert main(["plan", spec, "--devices", "1", "--batch", "4", "--seq", "8",
                 "--per-block", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "1 devices" in out and "global batch 4" in out and "layer 1" in out


BAD_FACTORIES = '''
def boom(batch, seq=None):
    raise RuntimeError("no weights here")

def wrong(batch):
    return 42

NOT_A_FUNCTION = 3
'''


@pytest.mark.parametrize("spec, expected", [
    ("examples.factories", "is not MODULE:FACTORY"),
    (":gpt_tiny", "is not MODULE:FACTORY"),
    ("no_such_module_xyz:f", "no module named 'no_such_module_xyz'"),
    ("examples.factories:gpt_huge", "has no attribute 'gpt_huge'"),
    ("examples/missing_file.py:f", "no file 'examples/missing_file.py'"),
    ("{bad}:boom", "raised RuntimeError: no weights here"),
    ("{bad}:wrong", "returned int, not (fn, args)"),
    ("{bad}:NOT_A_FUNCTION", "is a int, not a function"),
    ("{bad}:missing", "has no attribute 'missing'"),
])
def test_bad_factory_spec_exits_2(at_root, tmp_path, capsys, spec, expected):
    bad = tmp_path / "bad_factories.py"
    bad.write_text(BAD_FACTORIES)
    spec = spec.format(bad=bad)
    assert main(["plan", spec, "--devices", "2", "--batch", "8"]) == 2
    err = capsys.readouterr().err
    assert expected in err
    assert spec in err and "Fix:" in err


def test_missing_attribute_lists_the_factories(at_root, capsys):
    assert main(["plan", "examples.factories:gpt_huge", "--devices", "2", "--batch", "8"]) == 2
    assert "gpt_tiny" in capsys.readouterr().err


def test_budget_too_small_exits_1(at_root, capsys):
    assert main(["plan", TINY, "--devices", "2", "--batch", "8", "--memory", "1KiB",
                 "--quiet"]) == 1
    captured = capsys.readouterr()
    assert "no plan fits" in captured.err and "1 KiB" in captured.err
    assert captured.out == ""


@pytest.mark.parametrize("argv, expected", [
    (["--devices", "0", "--batch", "8"], "must be at least 1"),
    (["--devices", "2", "--batch", "8", "--memory", "lots"], "is not a size"),
    (["--devices", "2", "--batch", "8", "--objective", "speed"], "invalid choice"),
    (["--batch", "8"], "--devices"),
])
def test_bad_arguments_exit_2(capsys, argv, expected):
    assert main(["plan", TINY, *argv]) == 2
    assert expected in capsys.readouterr().err


def test_unknown_hardware_exits_2(at_root, capsys):
    assert main(["plan", TINY, "--devices", "2", "--batch", "8", "--hardware", "tpu9"]) == 2
    err = capsys.readouterr().err
    assert "--hardware tpu9" in err and "a100-40gb" in err


def test_plots_without_matplotlib_exit_2(at_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    assert main(["plan", TINY, *SMALL_RUN, "--plots", str(tmp_path)]) == 2
    assert "needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "frontier.png").exists()


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"pxform {pxform.__version__}"


def test_no_command_exits_2(capsys):
    assert main([]) == 2
    assert "usage: pxform" in capsys.readouterr().err


def test_calibrate_is_wired(capsys):
    args = build_parser().parse_args(["calibrate", "--out", "p.json", "--sizes", "1KiB"])
    # the hardware, then the runtime's own fixed costs (`pxform.tools.runtime_costs`)
    assert args.run.func is calibrate.main and args.sizes == [1024] and args.out == "p.json"
    assert args.run.keywords["refine"].__name__ == "runtime_costs"
    assert main(["calibrate", "--help"]) == 0
    assert "--repeats" in capsys.readouterr().out


def test_progress_bar():
    stream = io.StringIO()
    bar = _ProgressBar(stream, live=True, width=10)
    bar(6, 12)
    bar(12, 12)
    bar.close()
    text = stream.getvalue()
    assert "\r[#####-----] 6/12 configurations" in text
    assert text.endswith("\r[##########] 12/12 configurations\n")
    quiet = io.StringIO()
    off = _ProgressBar(quiet)  # a StringIO is no terminal: nothing drawn
    off(1, 2)
    off.close()
    assert quiet.getvalue() == ""


def test_console_script_entry_point():
    scripts = {e.name: e.value for e in metadata.entry_points(group="console_scripts")}
    assert scripts.get("pxform") == "pxform.tools.cli:entry"
    script = Path(sys.executable).parent / "pxform"
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "pxform"]
    result = subprocess.run([*command, "plan", TINY, *SMALL_RUN, "--quiet"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "predicted step" in result.stdout
    assert result.stderr == ""
