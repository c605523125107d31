"""The floors hold: each imports only from the floors below it, deferred imports included,
and no two modules import each other (the import-linter contracts in pyproject.toml, run by
scripts/check_layers.py on the installed layout). A checkout with an import from a higher
floor hidden in a function body fails the check."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_layers.py")


def check(root: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, SCRIPT, "--root", root], capture_output=True,
                          text=True, timeout=300)


def test_the_floors_hold():
    out = check(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Contracts: 2 kept, 0 broken." in out.stdout


def test_an_upward_import_fails_the_check(tmp_path):
    for name in ("pyproject.toml", "pxform", "transforms", "schedules"):
        src = os.path.join(ROOT, name)
        if os.path.isdir(src):
            shutil.copytree(src, tmp_path / name,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, tmp_path / name)
    units = tmp_path / "pxform" / "core" / "units.py"
    # deferred, inside a function: still an import from the top floor into the bottom one
    units.write_text(units.read_text() + "\n\ndef _meter():\n"
                     "    from pxform.tools.memory import MemoryMeter\n\n"
                     "    return MemoryMeter\n")
    out = check(str(tmp_path))
    assert out.returncode != 0
    assert "floors: each imports only from the floors below it BROKEN" in out.stdout
    assert "pxform.core.units -> pxform.tools.memory" in out.stdout
