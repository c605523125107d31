"""Fake CUDA on a CPU-only build, for the device-placement tests (`test_fake_cuda.py`).

`library()` compiles `fakecuda.cpp` (once per torch version, into the temp dir) with the
machine's g++ against the headers torch ships; `load()` must run before `import torch`.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "fakecuda.cpp")


def available() -> str | None:
    """None when the shim can be built here, else why not."""
    if shutil.which("g++") is None:
        return "no g++ on this machine"
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "torch is not installed"
    if not os.path.isdir(os.path.join(os.path.dirname(spec.origin), "include")):
        return "this torch ships no C++ headers"
    return None


def library() -> str:
    """The compiled shim's path (built on first use)."""
    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.origin is not None
    root = os.path.dirname(spec.origin)
    with open(SOURCE, "rb") as f:
        key = hashlib.sha256(f.read() + root.encode()).hexdigest()[:16]
    path = os.path.join(tempfile.gettempdir(), f"pxform-fakecuda-{key}.so")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}"
        subprocess.run(["g++", "-O1", "-shared", "-fPIC", "-std=c++20",
                        "-D_GLIBCXX_USE_CXX11_ABI=1", f"-I{root}/include", SOURCE,
                        f"-L{root}/lib", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{root}/lib",
                        "-o", tmp], check=True, capture_output=True, timeout=300)
        os.replace(tmp, path)  # atomic: concurrent builders do not see half a file
    return path


def load() -> None:
    """Load the shim; call before `import torch`."""
    assert "torch" not in sys.modules, "load the fake-CUDA shim before importing torch"
    ctypes.CDLL(library(), mode=ctypes.RTLD_GLOBAL)
