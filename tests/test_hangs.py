"""No hangs (issue 18, part): the mesh's collectives time out (pxform.Mesh(timeout=...),
default a minute on CPU), and a rank whose peer failed before a collective ends with a
`CollectiveError` naming itself, the collective and the program position, within the
timeout. Its own World: a timed-out gloo group is not reused."""

from __future__ import annotations

import hang_workers as W

from pxform.runtime.mesh import default_timeout
from pxform.tools.testing import World

TIMEOUT_S = 3.0


def test_an_error_on_one_rank_ends_its_peers_within_the_timeout():
    with World(2, timeout=120) as world:
        results = world.run(W.asymmetric, TIMEOUT_S)
    waiting = results[0]
    assert results[1]["error"] == "rank 1 failed before its step"
    assert waiting["type"] == "CollectiveError", waiting
    assert waiting["seconds"] < TIMEOUT_S + 20, waiting
    text = waiting["error"]
    assert text.startswith("pxform: rank 0: all_gather(dp") or text.startswith(
        "pxform: rank 0: all_to_all(dp") or text.startswith("pxform: rank 0: all_reduce(dp"), text
    assert "over mesh axis 'dp' (2 ranks, this one at index 0) did not complete" in text
    assert "Another rank failed or runs a different program" in text
    assert "Fix: make every rank run the same program" in text
    assert "In the program: loss: %" in text and "convert(%" in text


def test_the_default_timeout_is_a_minute_on_cpu(monkeypatch):
    monkeypatch.delenv("PXFORM_TIMEOUT_S", raising=False)
    assert default_timeout("gloo") == 60.0
    monkeypatch.setenv("PXFORM_TIMEOUT_S", "5")
    assert default_timeout("gloo") == 5.0


def test_a_pipeline_transfer_to_a_failed_rank_ends_within_the_timeout():
    with World(2, timeout=120) as world:
        results = world.run(W.asymmetric_pipeline, TIMEOUT_S)
    waiting = results[0]
    assert waiting["type"] == "CollectiveError", waiting
    assert waiting["seconds"] < TIMEOUT_S + 20, waiting
    text = waiting["error"]
    assert text.startswith("pxform: rank 0: "), text
    assert "pipeline rank 0 of 2, did not complete" in text, text
    assert "Fix: make every rank run the same program" in text
