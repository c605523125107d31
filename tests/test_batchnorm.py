"""BatchNorm and module buffers (issue 20, items 3 and 4). Buffers are state: never
differentiated; BatchNorm's running-statistics updates in training mode are functionalised
into step outputs that pxform writes back into the buffers passed, as eager does. Under data
parallel each rank normalises its own rows by default (DDP's result, checked against real
DDP on 2 gloo ranks); `sync_batch_norm=True` gives one process's full-batch result."""

from __future__ import annotations

import bn_workers as B
import pytest
import torch

import pxform
from pxform.tools.testing import World

TOL = 1e-12


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout=240) as w:
        yield w


def _check(r: dict) -> None:
    assert r["loss"] < TOL and r["grad"] < TOL, r
    # running statistics: the whole batch's statistics of each BatchNorm's input
    assert r["buffers"] < TOL, r
    assert r["buffer_grads"] == [], r  # buffers are never differentiated
    assert r["count"] == 1, r  # num_batches_tracked counted the step once


@pytest.mark.timeout(300)
def test_per_rank_statistics_equal_ddp(world2):
    for r in world2.run(B.run, "rank"):
        _check(r)
        assert r["dtensor_buffers"] < TOL


@pytest.mark.timeout(300)
def test_sync_batch_norm_equals_one_process(world2):
    for r in world2.run(B.run, "sync"):
        _check(r)
        assert r["dtensor_buffers"] < TOL


@pytest.mark.timeout(300)
def test_auto_plans_no_pipeline_and_writes_the_statistics(world2):
    for r in world2.run(B.run, "auto"):
        _check(r)
        assert r["config"].startswith("pp=1 "), r


@pytest.mark.timeout(300)
def test_a_pipeline_refuses_running_statistics(world2):
    for r in world2.run(B.run, "pipeline"):
        assert r["error"] is not None
        assert "updates module buffers in place" in r["error"]
        assert "bn1.running_mean" in r["error"]
        assert "Fix: run it under pxform.shard" in r["error"]


def test_the_statistics_differ_between_modes():
    """The per-rank default is not the one-process result (so the tests above can tell the
    modes apart): DDP's loss on this batch differs from the whole batch's."""
    model, x, y = B.setup()
    with torch.no_grad():
        whole = float(model(x, y))
        halves = (float(model(x[:4], y[:4])) + float(model(x[4:], y[4:]))) / 2
    assert abs(whole - halves) > 1e-3


def test_traced_step_writes_running_statistics_as_eager():
    model, x, y = B.setup()
    fn, params = pxform.module_fn(model)
    traced = pxform.trace(fn, params, x, y)
    assert len(traced.state) == 6  # 2 x (running_mean, running_var, num_batches_tracked)
    mine = {k: v.clone() for k, v in params.items()}
    eager = {k: v.clone() for k, v in params.items()}
    torch.testing.assert_close(traced(mine, x, y), fn(eager, x, y), rtol=0, atol=1e-14)
    for k in params:
        torch.testing.assert_close(mine[k], eager[k], rtol=0, atol=1e-14, msg=k)
    assert int(mine["bn2.num_batches_tracked"]) == 1
    assert not torch.equal(mine["bn2.running_mean"], params["bn2.running_mean"])


def test_buffers_and_frozen_parameters_get_no_gradient():
    model, x, y = B.setup()
    model.eval()  # running statistics are read, and torch refuses gradients for them
    fn, params = pxform.module_fn(model)
    params = {k: v.detach() for k, v in params.items()}  # no requires_grad marks at all
    _, grads = pxform.value_and_grad(fn)(params, x, y)
    assert grads["bn1.running_mean"] is None and grads["bn1.num_batches_tracked"] is None
    assert grads["conv1.weight"] is not None
    # requires_grad marks the trainable leaves: a frozen parameter gets None
    params = {k: v.detach().requires_grad_(v.is_floating_point() and k != "fc.weight"
                                           and "running" not in k)
              for k, v in params.items()}
    _, grads = pxform.value_and_grad(fn)(params, x, y)
    assert grads["fc.weight"] is None and grads["fc.bias"] is not None


def test_momentum_none_is_refused_with_the_line_and_a_fix():
    """Cumulative averaging (momentum=None) divides by `float(num_batches_tracked)` in
    Python: a value the trace cannot know. The error names the op, the line and a fix."""
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(4, momentum=None)).train()
    fn, params = pxform.module_fn(model)

    def loss(p, x):
        return fn(p, x).sum()

    with pytest.raises(pxform.PxformError, match="_local_scalar_dense") as info:
        pxform.trace(loss, params, torch.randn(3, 4))
    assert "test_batchnorm.py" in str(info.value) and "return fn(p, x).sum()" in str(info.value)
    assert "Fix: control flow or shapes that depend on tensor values" in str(info.value)


def test_data_dependent_shapes_name_the_op_and_the_line():
    def loss(x):
        return x[x > 0].sum()

    with pytest.raises(pxform.PxformError, match="aten.nonzero") as info:
        pxform.trace(loss, torch.randn(3, 4))
    assert "return x[x > 0].sum()" in str(info.value)
    assert "torch.where(mask, x, 0) instead of x[mask]" in str(info.value)
