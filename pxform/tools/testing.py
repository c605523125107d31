"""Testing helpers for pxform and its users: a multi-process gloo world that starts once and
runs many functions.

Starting processes and a process group costs seconds (each worker imports torch), so a test
module starts one `World` and reuses it for every test:

    @pytest.fixture(scope="module")
    def world():
        with pxform.testing.World(2) as w:
            yield w

    def test_all_reduce(world):
        assert world.run(all_reduce_rank) == [1, 1]   # one result per rank

`run(fn, *args)` pickles `fn` and its arguments to every rank (so `fn` must be importable:
a module-level function), calls `fn(*args)` there with the default process group
initialised (gloo over localhost TCP), and returns the results in rank order. An exception
on any rank is re-raised here as `WorkerError` naming the rank, with its traceback. A rank
that dies (a segfault, glibc's abort on a corrupted heap) is named with the signal that
ended it and has printed every thread's Python stack to its stderr (`faulthandler`); one
that gives no answer within the world's timeout is made to print them too before the world
is shut down: a crash or hang in CI leaves where it happened.

`torchrun(script, *args)` runs a script the way users launch it, under
`python -m torch.distributed.run`, and kills torchrun *and its workers* on a timeout.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

_STOP = "__stop__"
# a worker dumps every thread's Python stack to stderr on it (POSIX only)
_STACKS_SIGNAL: signal.Signals | None = getattr(signal, "SIGUSR1", None)


class WorkerError(RuntimeError):
    """A function failed on one or more ranks of a `World`."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world_size: int, port: int, timeout: float, inbox: Any,
            outbox: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # 2-core machines: don't oversubscribe
    # a rank that crashes (a fatal signal: a segfault, glibc's abort on a corrupted heap)
    # prints its Python stacks, and one that hangs prints them when the parent gives up on
    # it (`_STACKS_SIGNAL`): otherwise either leaves nothing but a missing answer
    faulthandler.enable(all_threads=True)
    if _STACKS_SIGNAL is not None:
        faulthandler.register(_STACKS_SIGNAL, all_threads=True, chain=False)
    # meshes made in a test time out with the world, not after the default minute: four
    # ranks on two cores can compile a program for longer than that while a peer waits
    os.environ.setdefault("PXFORM_TIMEOUT_S", str(timeout))
    import torch

    from pxform.runtime import world

    torch.set_num_threads(1)
    try:
        # the group's timeout bounds a wait on a failed peer: a broken test fails, never
        # hangs CI
        world.init_gloo(rank, world_size, port, timeout)
        outbox.put((rank, "ready", None))
    except Exception:  # report start-up failures instead of hanging the parent
        outbox.put((rank, "error", traceback.format_exc()))
        return
    while True:
        job = inbox.get()
        if job == _STOP:
            break
        fn, args, kwargs = job
        try:
            outbox.put((rank, "ok", fn(*args, **kwargs)))
        except BaseException:
            outbox.put((rank, "error", traceback.format_exc()))
    world.destroy()


class World:
    """`num_ranks` worker processes in one gloo process group, started once.

    Args:
        num_ranks: processes to start (4 works on a 2-core machine, slowly).
        timeout: seconds to wait for any rank to answer before failing.

    Example:
        >>> with World(2) as world:
        ...     world.run(torch.distributed.get_rank)
        [0, 1]
    """

    def __init__(self, num_ranks: int, timeout: float = 300.0) -> None:
        if num_ranks < 1:
            raise ValueError(f"World: num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self.timeout = timeout
        self._ctx = mp.get_context("spawn")
        self._procs: list[Any] = []
        self._inboxes: list[Any] = []
        self._outbox: Any = None

    def __enter__(self) -> World:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        port = _free_port()
        self._outbox = self._ctx.Queue()
        for rank in range(self.num_ranks):
            inbox = self._ctx.Queue()
            proc = self._ctx.Process(target=_worker, daemon=True, name=f"pxform-rank{rank}",
                                     args=(rank, self.num_ranks, port, self.timeout, inbox,
                                           self._outbox))
            proc.start()
            self._procs.append(proc)
            self._inboxes.append(inbox)
        self._collect("start the process group")

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if not self._procs:
            raise RuntimeError("World.run: the world is not started (use `with World(n)`)")
        for inbox in self._inboxes:
            inbox.put((fn, args, kwargs))
        return self._collect(getattr(fn, "__name__", repr(fn)))

    def _collect(self, what: str) -> list[Any]:
        import queue

        results: dict[int, Any] = {}
        errors: dict[int, str] = {}
        waited = 0.0
        while len(results) + len(errors) < self.num_ranks:
            try:
                # poll, so a rank that died (not raised) is reported at once, not at timeout
                rank, status, payload = self._outbox.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                missing = sorted(set(range(self.num_ranks)) - set(results) - set(errors))
                dead = [p.name for r, p in enumerate(self._procs)
                        if r in missing and not p.is_alive()]
                if waited < self.timeout and not dead:
                    continue
                if dead:
                    why = "ranks died: " + ", ".join(
                        f"{p.name} ({_exit_text(p.exitcode)})" for r, p in
                        enumerate(self._procs) if r in missing and not p.is_alive())
                else:
                    why = f"no answer within {self.timeout:.0f} s"
                    self._dump_stacks(missing)
                self.close()
                raise WorkerError(f"World: {what} got no answer from ranks {missing} ({why}); "
                                  f"the world was shut down; the ranks' stderr has the Python "
                                  f"stacks of every thread of a rank that crashed or hung") \
                    from None
            if status == "error":
                errors[rank] = payload
            else:
                results[rank] = payload
        if errors:
            first = min(errors)
            raise WorkerError(f"World: {what} failed on rank(s) {sorted(errors)}; rank {first}:"
                              f"\n{errors[first]}")
        return [results[r] for r in range(self.num_ranks)]

    def _dump_stacks(self, ranks: list[int]) -> None:
        """Have the hung `ranks` print every thread's Python stack to their stderr (where
        a run waits: a collective, a transfer, which thread), before they are killed."""
        if _STACKS_SIGNAL is None:
            return
        for r in ranks:
            proc = self._procs[r]
            if proc.is_alive() and proc.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, _STACKS_SIGNAL)
        time.sleep(1.0)  # faulthandler writes from its signal handler: at once

    def close(self) -> None:
        for inbox, proc in zip(self._inboxes, self._procs):
            if proc.is_alive():
                inbox.put(_STOP)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._procs, self._inboxes = [], []


def _exit_text(code: int | None) -> str:
    """A dead worker's exit, in words: `exit 1`, or the signal that ended it (`SIGABRT`:
    glibc aborts on a corrupted heap; `SIGKILL`: killed, e.g. out of memory)."""
    if code is None:
        return "running"
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-code).name}"
        return f"killed by signal {-code}"
    return f"exit {code}"


@contextlib.contextmanager
def fake_world(num_ranks: int, rank: int = 0) -> Iterator[None]:
    """Make this process rank `rank` of a `num_ranks` world whose collectives do nothing
    (torch's fake process group): enough to build a `pxform.Mesh` of any size and lower
    programs for it on a laptop, never to run them.

    Example:
        >>> with fake_world(1024):
        ...     mesh = pxform.Mesh({"dp": 16, "sdp": 8, "tp": 8})
        ...     pxform.check(pxform.shard(fn, mesh=mesh, in_specs=specs).lower(*args))
    """
    from pxform.runtime import world

    world.init_fake(rank, num_ranks)
    try:
        yield
    finally:
        world.destroy()


# ---------------------------------------------------------------- hypothesis strategies
# Built on first use, so pxform.testing imports without hypothesis installed.

def _strategies() -> Any:
    try:
        from hypothesis import strategies
    except ImportError as missing:
        raise ImportError("pxform.testing's hypothesis strategies need hypothesis: "
                          "pip install 'pxform[test]' (or pip install hypothesis)") from missing
    return strategies


def meshes(num_devices: int, max_axes: int = 3, names: tuple[str, ...] = ("a", "b", "c")
           ) -> Any:
    """Hypothesis strategy: `AbstractMesh`es of 1 to `max_axes` axes whose sizes multiply to
    `num_devices` (size-1 axes included).

    Example:
        >>> @given(mesh=meshes(4))
        ... def test_something(mesh): ...
    """
    st = _strategies()
    from pxform.core.mesh import AbstractMesh

    def factorings(n: int, k: int) -> list[tuple[int, ...]]:
        if k == 1:
            return [(n,)]
        return [(d, *rest) for d in range(1, n + 1) if n % d == 0
                for rest in factorings(n // d, k - 1)]

    choices = [AbstractMesh(dict(zip(names, sizes)))
               for k in range(1, max_axes + 1) for sizes in factorings(num_devices, k)]
    return st.sampled_from(choices)


def divisible_shapes(mesh: Any, rank: int, max_multiple: int = 2) -> Any:
    """Hypothesis strategy: shapes of `rank` dims, each a multiple of the mesh's size, so
    that every spec over the mesh divides them."""
    st = _strategies()
    return st.tuples(*[st.integers(1, max_multiple).map(lambda k: k * mesh.size)
                       for _ in range(rank)])


def specs(mesh: Any, rank: int) -> Any:
    """Hypothesis strategy: `P` specs for a tensor of `rank` dims over `mesh`: each axis
    splits one dim or none; several axes on one dim appear in mesh order."""
    st = _strategies()
    from pxform.core.spec import P

    def build(where: tuple[int | None, ...]) -> P:
        dims: list[list[str]] = [[] for _ in range(rank)]
        for axis, d in zip(mesh.names, where):
            if d is not None:
                dims[d].append(axis)
        return P(*[None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims])

    if rank == 0:
        return st.just(P())
    choice = st.one_of(st.none(), st.integers(0, rank - 1))
    return st.tuples(*[choice for _ in mesh.names]).map(build)


def run_process(cmd: list[str], *, timeout: float, env: dict[str, str] | None = None,
                cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run `cmd` in a session of its own, capturing its output. On a timeout the whole
    session is killed (a launcher's children too: killing only torchrun would leave its
    workers running, maybe hung in a collective) and AssertionError says so with the
    output's tail.

    Example:
        >>> run_process(["bash", "run.sh"], timeout=600).returncode
        0
    """
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          env=env, cwd=cwd, start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"{' '.join(cmd)}: timed out after {timeout} s\n"
                                 f"stdout:\n{out[-3000:]}\nstderr:\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(script: str | os.PathLike[str], *args: str, ranks: int = 2, restarts: int = 0,
             timeout: float = 240.0, env: dict[str, str] | None = None,
             cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess[str]:
    """`torchrun --standalone --nproc-per-node ranks --max-restarts restarts script args`
    (`--standalone` picks a free port, so runs may go side by side), one torch thread per
    rank (the ranks share few cores), through `run_process`.

    Example:
        >>> r = torchrun("examples/train_gpt.py", "--size", "tiny", "--steps", "2")
        >>> r.returncode, "loss" in r.stdout
        (0, True)
    """
    full_env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(ranks), "--max-restarts", str(restarts), os.fspath(script),
           *args]
    return run_process(cmd, timeout=timeout, env=full_env, cwd=cwd)
