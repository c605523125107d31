"""Initialising where the parameters live (issue 17): `step.init` gives the step's
parameters laid out as it runs them, each rank computing only its pieces (a pipeline rank
only its stages' leaves, None for the rest), bitwise equal to the 1-process run of the
initialiser under every layout; `pxform.module_init` initialises an HF model built on
meta; meta tensors reaching a run are refused with the fix. Real gloo processes."""

from __future__ import annotations

import init_workers as W
import pytest

from pxform.tools.testing import World

TIMEOUT_S = 300
ALL = 28  # leaves of the tiny GPT


@pytest.fixture(scope="module")
def world4():
    with World(4, timeout=TIMEOUT_S) as w:
        yield w


@pytest.mark.parametrize("plan", ["dp", "zero3", "tp", "pp_dp", "pp_zero3"])
@pytest.mark.heavy
def test_init_is_bitwise_the_one_process_init_under_every_layout(world4, plan):
    results = world4.run(W.init_matches, plan, 4)
    for rank, r in enumerate(results):
        assert r["equal"] and r["same_state"], (plan, rank)
        assert r["types"] == ["DTensor"]
    held = [set(r["held"]) for r in results]
    if plan.startswith("pp"):
        # stage 0 (ranks 0, 1) and stage 1 (ranks 2, 3) hold their own leaves; the tied
        # embedding is read by both
        assert held[0] == held[1] and held[2] == held[3] and held[0] != held[2]
        assert "blocks.0.qkv_w" in held[0] and "blocks.0.qkv_w" not in held[2]
        assert "wte" in held[0] & held[2]
        assert len(held[0] | held[2]) == ALL
    else:
        assert all(len(h) == ALL for h in held)


def test_init_stays_within_its_shards(world4):
    for r in world4.run(W.init_memory, 4):
        assert r["held"] == r["total"] // 4
        # every rank's peak during init: its quarter of the model plus one shard
        assert r["peak"] <= r["total"] / 4 + r["largest_shard"], r


@pytest.mark.parametrize("plan", ["zero3", "pp_zero3"])
def test_training_from_init_matches_one_process(world4, plan):
    for r in world4.run(W.trains_after_init, plan, 4):
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) < 1e-5, r
        assert r["param_err"] < 1e-4, r


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout=TIMEOUT_S) as w:
        yield w


def test_meta_error_names_the_path_and_the_fix(world2):
    for r in world2.run(W.meta_error):
        for where, text in r.items():
            prefix = "pxform.shard(gpt_loss)" + (".distribute" if where == "distribute" else "")
            assert text.startswith(f"{prefix}: params['blocks'][0]['fc_b'] (f32[128]) is on "
                                   f"the meta device"), text
            assert "Mesh(dp=2)" in text and "Fix: initialise the parameters where they " \
                "live: params = step.init(init_fn)" in text


def test_hf_llama_from_meta_under_zero3(world2):
    for r in world2.run(W.llama_from_meta):
        assert abs(r["first_loss"] - r["ln_vocab"]) < 0.05 * r["ln_vocab"], r
        assert r["held"] == r["total"] // 2
        assert r["peak"] <= r["total"] / 2 + r["largest"], r  # about half the model
        assert r["rotary"] and r["rot_err"] == 0.0  # computed buffers: eager's values
        assert abs(r["std"] - r["init_range"]) < 0.002  # HF's _init_weights ran


def test_init_on_a_pipeline_alone_and_on_auto(world2):
    for r in world2.run(W.pipeline_and_auto_init):
        # a pipeline alone runs one device per stage: whole tensors, None for the others
        assert r["pipe_types"] == ["NoneType", "Tensor"], r
        assert r["pipe_equal"] and r["auto_equal"], r
        assert r["pipe_loss_err"] < 1e-5 and r["auto_loss_err"] < 1e-5, r
        assert r["before_plan"].startswith("pxform.auto(gpt_loss).init: the layout comes "
                                           "from the plan, and no plan was made yet.")
        assert "Fix: call step.plan(params, batch) first" in r["before_plan"]


@pytest.mark.parametrize("plan, ratio", [("zero3", 2.0), ("pp", 1.5)])
def test_a_model_larger_than_one_rank_trains_from_init(world4, plan, ratio):
    """The model's float32 training state (parameters, gradients, AdamW moments) is
    `ratio` times or more every rank's metered peak, init and steps included; losses and
    final parameters match one process. ZeRO-3 gathers per block, one block ahead (as
    FSDP2 does), so two of this model's four blocks are held whole at a time: the peak is
    about the shards plus two blocks (`tests/test_zero3_memory.py` checks that sum)."""
    for r in world4.run(W.too_large, plan, 4):
        assert r["state"] >= ratio * r["peak"], r
        for a, b in zip(r["losses"], r["ref_losses"]):
            assert abs(a - b) < 1e-5, r
        assert r["param_err"] < 1e-3, r


def test_shard_of_an_initialiser_computes_only_each_ranks_pieces(world2):
    for r in world2.run(W.shard_init_direct):
        assert r["equal"], r
        assert r["wte_type"] == "DTensor" and r["lnf_b_type"] == "Tensor"  # out_specs
        assert r["whole"] == [], r  # no op makes a whole tensor that is wanted split
