"""The runtime keeps the host heap's freed pages on CPU ranks (`pxform.runtime.heap`).

Each case runs in a new process: glibc's thresholds are per process and set once.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import textwrap

import pytest

from pxform.tools.testing import _free_port, run_process

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
    reason="the heap's thresholds are glibc's")

# A step that allocates three 8 MiB blocks, writes them and frees them, eight times: the
# minor page faults of each step. With glibc's adaptive thresholds the 24 MiB freed at the
# top of the heap is over its trim threshold (twice the 8 MiB it learned), so it goes back
# to the system and every step faults it in again; kept, only the first step does.
STEPS = textwrap.dedent("""
    import ctypes, json, sys
    import torch.distributed as dist
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def faults():
        with open("/proc/self/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[7])

    how = sys.argv[1]
    from pxform.runtime import heap
    if how == "mesh":  # as a user gets it: a CPU mesh
        import pxform
        from pxform.runtime.world import init_gloo
        init_gloo(0, 1, int(sys.argv[2]), 60.0)
        pxform.Mesh({"dp": 1})
        dist.destroy_process_group()
    elif how == "calibrate":
        from pxform.runtime.calibrate import calibrate
        calibrate(sizes=(2**10,), repeats=1)
    elif how == "call":
        heap.keep_pages()
    mib = []
    for _ in range(8):
        before = faults()
        blocks = [libc.malloc(8 << 20) for _ in range(3)]
        for b in blocks:
            ctypes.memset(b, 1, 8 << 20)
        for b in blocks:
            libc.free(b)
        mib.append((faults() - before) * 4096 / 2**20)
    state = heap.state()
    print(json.dumps({"mib": mib, "kept": state and state.kept,
                      "reason": state and state.reason}))
""")


def _run(how: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "PXFORM_KEEP_HEAP")}
    r = run_process([sys.executable, "-c", STEPS, how, str(_free_port())], timeout=120,
                    env={**clean, **env})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how", ["call", "mesh", "calibrate"])
@pytest.mark.heavy
def test_freed_pages_are_reused(how):
    got = _run(how)
    assert got["kept"] is True, got
    if how == "call":  # (after a calibration, the heap already holds the pages)
        assert got["mib"][0] > 20  # the first step faults its 24 MiB in
    assert max(got["mib"][1:]) < 1, got  # and later steps reuse them


@pytest.mark.timeout(120)
def test_without_it_every_step_faults_again():
    # the same steps with glibc's adaptive thresholds: what the runtime saves
    got = _run("none")
    assert got["kept"] is None
    assert min(got["mib"][2:]) > 16, got


@pytest.mark.timeout(120)
@pytest.mark.parametrize("env,says", [
    ({"PXFORM_KEEP_HEAP": "0"}, "PXFORM_KEEP_HEAP=0: left as the system has it"),
    ({"MALLOC_MMAP_THRESHOLD_": "131072"}, "MALLOC_MMAP_THRESHOLD_ set: glibc's heap left "
                                           "as chosen"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"}, "GLIBC_TUNABLES set"),
])
def test_the_user_choice_wins(env, says):
    got = _run("mesh", **env)
    assert got["kept"] is False
    assert says in got["reason"], got
