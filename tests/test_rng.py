"""Plan-independent random numbers (issue 17): every random op draws from a counter-based
stream keyed by the call's seed, the op and the global element index, so dropout and noise
give the same loss and gradients under every plan as pxform's 1-rank run, in float64, on
real gloo processes; the masks are real (right rate, different on every shard)."""

from __future__ import annotations

import pytest
import rng_workers as W
import torch

import pxform
from pxform.core.rng import PieceMap, RandomTag, coordinates, field, philox, uniform
from pxform.tools.testing import World

TIMEOUT_S = 300


def test_philox_matches_the_published_known_answers():
    # Random123's kat_vectors for philox4x32-10
    def hexes(counter, key):
        return [f"{int(w):08x}" for w in philox([torch.tensor(c) for c in counter], key)]

    assert hexes([0, 0, 0, 0], (0, 0)) == ["6627e8d5", "e169c58d", "bc57ac4c", "9b00dbd8"]
    assert hexes([0xFFFFFFFF] * 4, (0xFFFFFFFF, 0xFFFFFFFF)) == [
        "408f276d", "41c83b0e", "a20bc7c6", "6d5451fd"]
    assert hexes([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], (0xA4093822, 0x299F31D0)) \
        == ["d16cfe09", "94fdcceb", "5001e420", "24126ea1"]


def test_uniform_never_rounds_to_one():
    top = torch.full((4,), 0xFFFFFFFF, dtype=torch.int64)
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        assert float(uniform(top, top, dtype).max()) < 1.0, dtype


def linear_index(coords, shape):
    """The traced linear index of every element of the grid `coords` (what `field` draws
    at), via `field` itself."""
    return field(coords, shape, torch.int64, lambda linear, start, stop: linear)


def test_positions_of_shards_and_coshard_pieces_are_the_traced_ones():
    tag = RandomTag(0, (8, 6))
    whole = linear_index(coordinates(tag, [(), ()], (8, 6), {}, {}, torch.device("cpu")),
                         tag.shape)
    assert torch.equal(whole, torch.arange(48).view(8, 6))
    # rank (a=1, b=0) of a 2 x 3 mesh splitting dim 0 over a and dim 1 over b
    mine = linear_index(coordinates(tag, [("a",), ("b",)], (8, 6), {"a": 1, "b": 0},
                                    {"a": 2, "b": 3}, torch.device("cpu")), tag.shape)
    assert torch.equal(mine, whole[4:8, 0:2])
    # coshard piece 1 of 2 of a dim the mesh splits 2 ways: from each shard, its 2nd run
    piece = tag.with_piece((PieceMap(block=2, stride=4, offset=2), None))
    on_rank1 = linear_index(coordinates(piece, [("dp",), ()], (4, 6), {"dp": 1}, {"dp": 2},
                                        torch.device("cpu")), tag.shape)
    assert torch.equal(on_rank1, whole[6:8])


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout=TIMEOUT_S) as w:
        yield w


@pytest.fixture(scope="module")
def world4():
    with World(4, timeout=TIMEOUT_S) as w:
        yield w


TWO_RANK_PLANS = ["dp", "zero3", "tp", "sp", "pipeline", "recompute", "coshard"]


@pytest.mark.parametrize("plan", TWO_RANK_PLANS)
def test_dropout_and_noise_equal_the_one_rank_run_on_2_ranks(world2, plan):
    results = world2.run(W.run, plan, 2)
    for rank, r in enumerate(results):
        assert r["loss"] < 1e-12 and r["grad"] < 1e-12, (plan, rank, r)
        assert r["losses"][0] != r["losses"][1]  # each call draws new numbers


@pytest.mark.parametrize("plan", ["dp_tp", "pp_dp", "zero3", "tp", "sp", "coshard", "recompute"])
def test_dropout_and_noise_equal_the_one_rank_run_on_4_ranks(world4, plan):
    results = world4.run(W.run, plan, 4)
    for rank, r in enumerate(results):
        assert r["loss"] < 1e-12 and r["grad"] < 1e-12, (plan, rank, r)


def test_masks_are_real_rate_p_and_different_on_every_shard(world4):
    masks = world4.run(W.masks, 4)
    for m in masks:
        assert m.numel() == 10**5
        assert abs(float(m.float().mean()) - W.P_DROP) < 0.01
    for i in range(4):
        for j in range(i + 1, 4):
            assert not torch.equal(masks[i], masks[j])
            # independent masks agree where both keep or both drop: about p^2 + (1-p)^2
            agree = float((masks[i] == masks[j]).float().mean())
            assert abs(agree - (W.P_DROP**2 + (1 - W.P_DROP) ** 2)) < 0.01


@pytest.mark.parametrize("plan", ["tp", "zero3"])
def test_attention_dropout_is_plan_independent(world2, plan):
    for r in world2.run(W.attention_dropout, plan, 2):
        # 2 layers x (attention probabilities, attention output, MLP output) + embeddings
        assert r["dropouts"] == 7, r
        assert r["loss"] < 1e-12 and r["grad"] < 1e-12, r


def test_dropout_that_drops_nothing_draws_nothing():
    # eval-mode dropout and p = 0 (GPT configs' default) are the identity, as in torch:
    # no bits are drawn (before, eval-mode dropout still dropped)
    import torch.nn.functional as F

    def fn(x):
        return F.dropout(x, 0.5, training=False) + F.dropout(x, 0.0) + F.dropout(x * 2, 0.0)

    x = torch.randn(4, 8)
    traced = pxform.trace(fn, x)
    assert torch.equal(traced(x), x + x + x * 2)
