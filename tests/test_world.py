"""The multi-process gloo harness: started once per module, real collectives, errors that
name the rank."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from pxform.tools.testing import WorkerError, World


@pytest.fixture(scope="module")
def world():
    with World(2) as w:
        yield w


def rank_and_pid():
    return dist.get_rank(), dist.get_world_size(), os.getpid()


def all_reduce_rank_plus(offset):
    t = torch.tensor([float(dist.get_rank() + offset)])
    dist.all_reduce(t)
    return t.item()


def fail_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("rank one refuses")
    return "fine"


def test_ranks_answer_in_order_and_processes_are_reused(world):
    first = world.run(rank_and_pid)
    assert [(r, n) for r, n, _ in first] == [(0, 2), (1, 2)]
    again = world.run(rank_and_pid)
    assert [p for *_, p in again] == [p for *_, p in first]  # same processes
    assert os.getpid() not in [p for *_, p in first]


def test_real_collectives_run(world):
    assert world.run(all_reduce_rank_plus, 10) == [21.0, 21.0]  # (0+10) + (1+10)


def test_errors_name_the_rank_and_keep_the_world_usable(world):
    with pytest.raises(WorkerError, match=r"(?s)fail_on_rank_one failed on rank\(s\) \[1\]; "
                                          r"rank 1:.*ValueError: rank one refuses"):
        world.run(fail_on_rank_one)
    assert world.run(all_reduce_rank_plus, 0) == [1.0, 1.0]


def meshes_made_again():
    """Meshes over the same ranks made again and again (as `runtime_costs` and every
    `auto(mesh=n)` do): (the threads of this process after the first and after ten more,
    whether the same axis shares a group and another timeout does not, a sum over the
    shared group)."""
    import pxform

    first = pxform.Mesh({"dp": 2})
    threads = len(os.listdir("/proc/self/task"))
    for _ in range(10):
        again = pxform.Mesh({"dp": 2})
    after = len(os.listdir("/proc/self/task"))
    other = pxform.Mesh({"dp": 2}, timeout=30)
    t = torch.ones(1)
    dist.all_reduce(t, group=again.group("dp"))
    return (threads, after,
            first.group("dp") is again.group("dp"), other.group("dp") is first.group("dp"),
            t.item())


def test_meshes_over_the_same_ranks_share_their_process_groups(world):
    """A gloo process group holds threads and sockets until destroyed: `Mesh` reuses the
    group of an earlier mesh over the same ranks and timeout (`runtime_costs` had left 81
    more threads per rank after each call)."""
    for before, after, shared, other_shared, total in world.run(meshes_made_again):
        assert after == before and shared and not other_shared and total == 2.0


def test_world_must_be_started():
    with pytest.raises(RuntimeError, match="the world is not started"):
        World(2).run(rank_and_pid)


def test_four_ranks_on_two_cores():
    with World(4) as w4:
        assert w4.run(all_reduce_rank_plus, 0) == [6.0] * 4


def abort_on_rank_one():
    if dist.get_rank() == 1:
        os.abort()  # what glibc does on a corrupted heap
    return "fine"


def sleep_on_rank_one(seconds):
    if dist.get_rank() == 1:
        time.sleep(seconds)
    return "fine"


@pytest.mark.timeout(120)
def test_a_crashed_rank_is_named_with_its_signal_and_prints_its_stack(capfd):
    died = (r"abort_on_rank_one got no answer from ranks \[1\] \(ranks died: pxform-rank1 "
            r"\(killed by SIGABRT\)\).*Python stacks")
    with World(2) as w, pytest.raises(WorkerError, match=died):
        w.run(abort_on_rank_one)
    err = capfd.readouterr().err
    assert "Fatal Python error: Aborted" in err
    assert "abort_on_rank_one" in err  # the frame the rank died in


@pytest.mark.timeout(120)
@pytest.mark.heavy
def test_a_hung_rank_prints_every_threads_stack_before_it_is_killed(capfd):
    with World(2) as w:
        w.timeout = 5  # started with the default (the process group's rendezvous)
        start = time.monotonic()
        # (rank 0 answers at once; on a loaded machine it may be late too)
        with pytest.raises(WorkerError, match=r"sleep_on_rank_one got no answer from ranks "
                                              r"\[(0, )?1\] \(no answer within 5 s\)"):
            w.run(sleep_on_rank_one, 60)
        assert time.monotonic() - start < 30  # not the minute the rank sleeps
    err = capfd.readouterr().err
    assert "most recent call first" in err and "sleep_on_rank_one" in err  # where it hung
