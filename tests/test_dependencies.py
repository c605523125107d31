"""Every package pxform imports is declared in pyproject.toml.

`bash test.sh` installs the test extra, whose packages (transformers) bring numpy and more
along; a package pxform imports but does not declare is then present in the test
environment and missing for a user who runs `pip install pxform`. These checks catch that
without building a fresh virtual environment:

- `test_every_module_imports_with_only_declared_packages`: a subprocess imports every module
  of the installed pxform under an import hook that refuses, for imports made by pxform's
  own modules, any third-party top-level package that `[project] dependencies` does not
  declare (the standard library and the declared packages pass).
- `test_deferred_imports_are_declared_or_optional`: imports inside functions run only when
  called, so the hook above cannot see them; the source is read instead. A deferred import
  of an undeclared package must name an optional extra that declares it and be guarded by
  `except ImportError`, so the feature can say which extra to install.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from importlib import metadata

import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pyproject() -> dict:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)


def _dist_name(requirement: str) -> str:
    # PEP 508: the name comes first, before any extras, version or marker
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    assert name, requirement
    return re.sub(r"[-_.]+", "-", name.group(1)).lower()


def _top_level_names(requirements: list[str]) -> set[str]:
    """The importable top-level names the distributions in `requirements` provide: read
    from the installed distributions' metadata, and for one not installed here (an extra
    this environment lacks, such as plot's matplotlib) its own name as a module name."""
    wanted = {_dist_name(r) for r in requirements}
    names = {w.replace("-", "_") for w in wanted}
    for module, dists in metadata.packages_distributions().items():
        if any(re.sub(r"[-_.]+", "-", d).lower() in wanted for d in dists):
            names.add(module)
    return names


def _source_files() -> list[tuple[str, str]]:
    """(module name, path) for every source file of the installed packages."""
    config = _pyproject()["tool"]["setuptools"]
    package_dir = config.get("package-dir", {})
    files = []
    for package in config["packages"]:
        folder = package_dir.get(package, package.replace(".", os.sep))
        for entry in sorted(os.listdir(os.path.join(ROOT, folder))):
            if entry.endswith(".py"):
                stem = entry[:-3]
                name = package if stem == "__init__" else f"{package}.{stem}"
                files.append((name, os.path.join(ROOT, folder, entry)))
    return files


_HOOK = r"""
import builtins, importlib, json, sys, traceback
allowed = set(json.loads(sys.argv[1]))
modules = json.loads(sys.argv[2])
refused = set()
original = builtins.__import__

def guarded(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__", "")
    top = name.split(".")[0]
    if (level == 0 and (importer == "pxform" or importer.startswith("pxform."))
            and top not in allowed and top not in sys.stdlib_module_names):
        refused.add(f"{importer} imports {name}")
        raise ModuleNotFoundError(f"No module named {top!r} (refused: not declared)", name=top)
    return original(name, globals, locals, fromlist, level)

builtins.__import__ = guarded
failed = []
for module in modules:
    try:
        importlib.import_module(module)
    except Exception:
        failed.append(module + ":\n" + traceback.format_exc(limit=-3))
print(json.dumps({"refused": sorted(refused), "failed": failed}))
"""


def test_every_module_imports_with_only_declared_packages():
    allowed = _top_level_names(_pyproject()["project"]["dependencies"]) | {"pxform"}
    # pxform.__main__ runs the CLI when imported
    modules = [name for name, _ in _source_files() if name != "pxform.__main__"]
    assert "pxform.search.partition" in modules and "pxform.transforms.auto" in modules
    out = subprocess.run([sys.executable, "-c", _HOOK, json.dumps(sorted(allowed)),
                          json.dumps(modules)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert not result["refused"], (
        "pxform imports packages that pyproject.toml's [project] dependencies do not declare "
        "(a plain `pip install pxform` lacks them): " + "; ".join(result["refused"]))
    assert not result["failed"], "\n".join(result["failed"])


def _guarded_by_import_error(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            for handler in parent.handlers:
                names = ([handler.type] if not isinstance(handler.type, ast.Tuple)
                         else handler.type.elts)
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
                       for n in names):
                    return True
        node = parent
    return False


def test_deferred_imports_are_declared_or_optional():
    project = _pyproject()["project"]
    declared = _top_level_names(project["dependencies"]) | {"pxform"}
    optional = {extra: _top_level_names(reqs)
                for extra, reqs in project.get("optional-dependencies", {}).items()}
    problems = []
    for module, path in _source_files():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top in declared or top in sys.stdlib_module_names:
                    continue
                extras = [extra for extra, tops in optional.items() if top in tops]
                where = f"{module} (line {node.lineno}) imports {name}"
                if not extras:
                    problems.append(f"{where}: declared neither in dependencies nor in an extra")
                elif not _guarded_by_import_error(node, parents):
                    problems.append(f"{where} (extra {extras[0]!r}) without `except ImportError`"
                                    " that names the extra to install")
    assert not problems, "\n".join(problems)
