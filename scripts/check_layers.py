"""Check pxform's floors with import-linter (the contracts in pyproject.toml).

import-linter finds a package's modules by walking its folder, but `transforms/` and
`schedules/` are installed as `pxform.transforms` and `pxform.schedules` from top-level
folders (pyproject's `package-dir`). So this lays the sources out as they are installed, in
a temporary folder, and runs `lint-imports` on that copy. Exit status: lint-imports'.

    python scripts/check_layers.py [--root DIR]    (DIR: a checkout; default this one)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def installed_layout(root: str, dest: str) -> None:
    """Copy every package of `root`'s pyproject setuptools list to where it is installed."""
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        setuptools = tomllib.load(f)["tool"]["setuptools"]
    package_dir = setuptools.get("package-dir", {})
    for package in setuptools["packages"]:
        src = os.path.join(root, package_dir.get(package, package.replace(".", os.sep)))
        target = os.path.join(dest, package.replace(".", os.sep))
        os.makedirs(target, exist_ok=True)
        for name in os.listdir(src):
            if name.endswith(".py"):
                shutil.copy(os.path.join(src, name), target)


def main(argv: list[str]) -> int:
    root = argv[argv.index("--root") + 1] if "--root" in argv else ROOT
    with tempfile.TemporaryDirectory() as tmp:
        installed_layout(root, tmp)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([tmp, os.environ.get("PYTHONPATH", "")]))
        lint = os.path.join(os.path.dirname(sys.executable), "lint-imports")
        cmd = [lint] if os.path.exists(lint) else ["lint-imports"]
        # cache off: the copy is new each time, and the cache folder would land in ROOT
        return subprocess.call([*cmd, "--config", os.path.join(root, "pyproject.toml"),
                                "--no-cache"], env=env, cwd=tmp)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
