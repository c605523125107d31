"""`allow_fallback` on every transform (issue 20, part): an op without a sharding rule runs
replicated (inputs gathered, every rank computing the whole op), reported once per trace,
and the loss and gradients still equal one process's; without it the op is refused with
the fix. `auto` allows it by default. 2 gloo ranks, float64."""

from __future__ import annotations

import fallback_workers as W
import pytest

from pxform.tools.testing import World

TIMEOUT_S = 240


@pytest.fixture(scope="module")
def world():
    with World(2, timeout=TIMEOUT_S) as w:
        yield w


@pytest.mark.parametrize("kind", ["shard", "pipeline", "shard_pipeline", "auto"])
def test_fallback_ops_run_replicated_and_match_one_process(world, kind):
    results = world.run(W.run, kind)
    for rank, r in enumerate(results):
        assert r["loss"] < 1e-12 and r["grad"] < 1e-12, (kind, rank, r)
        assert r["warnings"] == 1 and r["names_op"], (kind, rank, r)
    # every parameter's gradient came back on some rank (a pipeline rank holds its stage's)
    assert set().union(*(r["held"] for r in results)) == {"v", "w1", "w2"}


def test_without_allow_fallback_the_op_is_refused_with_the_fix(world):
    for msg in world.run(W.refused):
        assert "op aten.linalg_cross.default (linalg_cross) has no sharding rule" in msg
        assert "allow_fallback=True" in msg
