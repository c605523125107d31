"""HF coverage under `pxform.auto`: GPT-2, BERT and Llama (small random-init configs, no
downloads) are traced, planned for 2 and 4 gloo ranks, lowered, run, and match the
single-process loss and every gradient. HF computes the loss in float32 even for a float64
model, so values agree to float32 precision."""

from __future__ import annotations

import hf_workers as H
import pytest

from pxform.search import Pin
from pxform.tools.testing import World

pytest.importorskip("transformers")

MODELS = ["gpt2", "bert", "llama"]


@pytest.fixture(scope="module")
def world2():
    with World(2) as w:
        yield w


@pytest.fixture(scope="module")
def world4():
    with World(4) as w:
        yield w


def _check(results: list[dict]) -> dict:
    first = results[0]
    for r in results:
        assert r["config"] == first["config"]
        assert r["loss_err"] < 1e-5, r
        assert r["grad_err"] < 1e-5, r
    assert len(set().union(*(set(r["have"]) for r in results))) >= first["num"] - 2
    return first


@pytest.mark.parametrize("name", MODELS)
def test_searched_plan_on_2_ranks(world2, name):
    r = _check(world2.run(H.run_hf, name, None))
    if name == "bert":
        # its padding mask indexes the whole batch: no pipeline can cut it
        assert r["config"].startswith("pp=1")


@pytest.mark.parametrize("name", MODELS)
def test_tensor_parallel_on_2_ranks(world2, name):
    # every block pinned to tensor parallelism: the search, which prices data
    # parallelism's all-reduce per bucket, may prefer data roles on the inner axis
    r = _check(world2.run(H.run_hf, name, Pin(stages=1, outer=1, inner=2, microbatches=1),
                          (("inner", "tp"),)))
    assert r["strategies"] == ["inner=tp"]


@pytest.mark.parametrize("name", MODELS)
def test_searched_plan_on_4_ranks(world4, name):
    _check(world4.run(H.run_hf, name, None))


def test_zero3_by_tensor_on_4_ranks(world4):
    r = _check(world4.run(H.run_hf, "llama", Pin(stages=1, outer=2, inner=2, microbatches=1)))
    assert r["config"].startswith("pp=1 outer=2 inner=2")
