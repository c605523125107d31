"""`pxform.shard` and `value_and_grad` on real gloo process groups: data parallel, ZeRO-3,
Megatron tensor parallel and their combination match the single-process loss and gradients,
with the expected collectives; bad specs give messages that name the argument and a fix."""

from __future__ import annotations

import math

import pytest
import spmd_workers as W
import torch

import pxform
from pxform import P
from pxform.tools.testing import World


@pytest.fixture(scope="module")
def world2():
    with World(2) as w:
        yield w


def check(results, tol=1e-12, loss_tol=None, ignored_targets=False):
    for r in results:
        assert abs(r["loss"] - r["ref"]) < (loss_tol or tol), r["text"]
        assert r["grad_err"] < tol, r["text"]
        # a forward-only call divides by the reduced count at once: the same to the loss's
        # rounding when targets are ignored (a few ulps: bitwise on an AVX-512 machine, one
        # ulp apart on an AVX2 one, 2026-12-01), bitwise otherwise (loss_tol None)
        again_tol = loss_tol or (4 * math.ulp(r["loss"]) if ignored_targets else 0.0)
        assert abs(r["again"] - r["loss"]) <= again_tol and r["cached"] == 1
        assert abs(r["dtensor_loss"] - r["ref"]) < (loss_tol or tol)
        assert r["dtensor_grad_err"] < tol
    return results[0]


def test_data_parallel_mlp(world2):
    params, batch = W.big_mlp_args()
    r = check(world2.run(W.shard_value_and_grad, W.mlp_loss, (params, batch), {"dp": 2},
                         (None, {"x": P("dp"), "y": P("dp")})))
    assert r["fwd"] == ["all_reduce(dp)"]  # the loss: a partial mean over the batch
    # every parameter's gradient is all-reduced (replicated parameters, split batch)
    assert sorted(r["bwd"]) == ["all_reduce(dp)"] * 3
    assert r["grad_types"] == ["Tensor"]  # replicated gradients come back as full tensors
    # one 25 MiB bucket holds all three gradients and the loss (its all-reduce waits for
    # the bucket: one collective per step); it is launched inside backward, when the last
    # gradient the forward pass announced arrives
    assert r["buckets"] == {"launched": 1, "launched_in_backward": 1, "tensors": 4,
                            "bytes": 8 * (32 + 8 + 32) + 8}


def test_data_parallel_buckets_fill_and_launch_during_backward(world2):
    params, batch = W.big_mlp_args()
    # 100-byte buckets: w2's gradient (256 B) fills one alone, then b1+w1 fill the next
    r = check(world2.run(W.shard_value_and_grad, W.mlp_loss, (params, batch), {"dp": 2},
                         (None, {"x": P("dp"), "y": P("dp")}), None, 100 / 2**20))
    # the loss rides in the first bucket launched after it
    assert r["buckets"] == {"launched": 2, "launched_in_backward": 2, "tensors": 4,
                            "bytes": 8 * (32 + 8 + 32) + 8}


def test_collectives_on_one_gloo_group_never_run_together(world2):
    for r in world2.run(W.collectives_one_at_a_time):
        assert r["wrong"] == 0, r
        assert r["completed_before_next"] == r["launches"], r


def test_collective_temporaries_are_freed_when_the_step_returns(world2):
    # gloo's work objects keep their buffers until a worker thread lets go of them, so a
    # temporary dropped by reference alone lived on for a timing-dependent while (a rank's
    # peak moved by 2.7 MiB of 15 between identical steps); freed by resizing, the memory
    # is gone when the step returns, every time
    for r in world2.run(W.collective_temporaries_freed):
        for name in ("all_gather 1", "all_gather 2", "reduce_scatter 1",
                     "all_to_all 2 from 1"):
            assert r[name]["equal"], (name, r)
            assert r[name]["freed"] and all(size == 0 for _, size in r[name]["freed"]), r
            assert r[name]["alive_beyond_result"] == 0, (name, r)
        # along dim 0 the gathered buffer is the result itself: nothing to free
        assert r["all_gather 0"]["equal"] and r["all_gather 0"]["freed"] == [], r


def test_a_synchronous_collective_returns_once_gloo_has_let_go_of_it(world2):
    # gloo's worker thread drops the work object (its input and result) after it has woken
    # the caller: without waiting for it, 1-14 % of these all-gathers and all-reduces
    # returned with them still held (2026-11-28), and a tensor nothing else read outlived
    # the ops after it (a sequence-parallel GPT step's peak took in a 2 MiB all-reduce
    # result now and then)
    without = world2.run(W.collectives_let_go, 300, True)
    assert sum(r["held"][k] for r in without
               for k in ("all_gather 0", "all_gather 1", "all_reduce")) > 0
    for r in world2.run(W.collectives_let_go, 300):
        assert r["ran_out"] == 0 and set(r["held"].values()) == {0}, r
        assert r["chained"], r


def test_dtensor_gradients_share_their_parameters_specs(world2):
    """A DTensor parameter's gradient is built on the parameter's own spec (not by
    `DTensor.from_local`, 18 us a gradient here, a millisecond a step of GPT small), so
    it has the parameter's global shape, placements and strides, and the right values."""
    for r in world2.run(W.gradients_on_their_parameters_specs):
        assert r["w"]["local"] == [2, 3] and r["v"]["local"] == [3, 4]  # split, replicated
        for g in r.values():
            assert g["type"] == "DTensor" and g["shared"], r
            assert g["shape"] and g["placements"] and g["stride"] and g["err"] < 1e-6, r


def test_bucket_packing_matches_unbucketed_collectives(world2):
    for r in world2.run(W.bucket_packing):
        assert r[1] == 0.0 and r[10**9] == 0.0
        assert r["launched 1"] == 9  # each gradient fills a 1-byte bucket
        assert r["launched 1000000000"] == 6  # one per kind of step sequence


def test_zero3_mlp(world2):
    # a batch big enough (2 MiB per rank) that gathering parameters beats gathering
    # activations under the planner's default costs (10 us + bytes at 100 GB/s)
    params, batch = W.big_mlp_args(batch=65536)
    r = check(world2.run(W.shard_value_and_grad, W.mlp_loss, (params, batch), {"dp": 2},
                         ({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")},
                          {"x": P("dp"), "y": P("dp")})))
    # parameters stored sharded are gathered at use; their gradients reduce-scattered
    assert r["fwd"].count("all_gather(dp, dim 0)") == 3
    assert sorted(r["bwd"]) == ["reduce_scatter(dp, dim 0)"] * 3
    assert r["grad_types"] == ["DTensor"]
    # the three reduce-scatters of different shapes go out as one packed reduce-scatter; the
    # loss's all-reduce, deferred too, is launched when backward begins
    assert r["buckets"]["launched"] == 2 == r["buckets"]["launched_in_backward"]
    assert r["buckets"]["tensors"] == 4
    r = check(world2.run(W.shard_value_and_grad, W.mlp_loss, (params, batch), {"dp": 2},
                         ({"w1": P("dp"), "b1": P("dp"), "w2": P("dp")},
                          {"x": P("dp"), "y": P("dp")}), None, 1e-9))
    assert r["buckets"]["launched"] == 4 == r["buckets"]["launched_in_backward"]


def test_megatron_tensor_parallel_mlp(world2):
    params, batch = W.big_mlp_args(batch=4)
    r = check(world2.run(W.shard_value_and_grad, W.mlp_loss, (params, batch), {"tp": 2},
                         ({"w1": P("tp"), "b1": P("tp"), "w2": P("tp")}, None)))
    # column-parallel then row-parallel: exactly one all-reduce forward (Megatron's g) and
    # one backward for the replicated input (Megatron's f)
    assert r["fwd"] == ["all_reduce(tp)"]
    assert r["bwd"] == ["all_reduce(tp)"]


def test_gpt_data_parallel(world2):
    r = check(world2.run(W.gpt_shard, {"dp": 2}, {"idx": P("dp"), "targets": P("dp")}),
              ignored_targets=True)
    assert "all_reduce(dp)" in r["fwd"]
    assert "/ count(over dp)" in r["text"]  # mean over non-ignored targets across ranks


def test_sequence_parallel_block(world2):
    # activations split on the sequence dim over tp outside the tensor-parallel MLP:
    # all-gather into it, reduce-scatter out of it (Megatron-SP), from the specs alone
    r = check(world2.run(W.shard_value_and_grad, W.sp_block_loss, W.sp_block_args(),
                         {"tp": 2}, (W.SP_PARAMS, {"x": P(None, "tp"), "y": P(None, "tp")})))
    assert r["fwd"] == ["all_gather(tp, dim 1)", "reduce_scatter(tp, dim 1)", "all_reduce(tp)"]
    # backward mirrors it; the layer norm's replicated weights get partial gradients
    assert sorted(r["bwd"]) == ["all_gather(tp, dim 1)", "all_reduce(tp)", "all_reduce(tp)",
                                "reduce_scatter(tp, dim 1)"]


def test_gpt_sequence_parallel(world2):
    r = check(world2.run(W.gpt_shard, {"tp": 2}, {"idx": P(None, "tp"),
                                                  "targets": P(None, "tp")}, True),
              ignored_targets=True)
    # per layer: gather the sequence for attention (q, k, v) and for the column-parallel
    # MLP, reduce-scatter the row-parallel output back to sequence shards
    per_layer = ["all_gather(tp, dim 2)"] * 3 + ["all_gather(tp, dim 1)",
                                                 "reduce_scatter(tp, dim 1)"]
    assert r["fwd"][:10] == per_layer * 2
    assert "all_reduce(tp)" not in r["fwd"][:10]


GPT2_BATCH = {"input_ids": P("dp"), "labels": P("dp")}
# HF computes the loss in float32, and its shifted labels ignore the last position: the
# data-parallel loss is divided by the batch's target count before the count of those not
# ignored is known, and corrected after the buckets (`GlobalCount.final`), one float32
# rounding away from dividing at once
GPT2_TOL = {"tol": 1e-6, "loss_tol": 1e-5}


def test_gpt2_data_parallel(world2):
    r = check(world2.run(W.gpt2_shard, {"dp": 2}, "dp", GPT2_BATCH), **GPT2_TOL)
    assert r["fwd"] == ["all_reduce(dp)"]
    assert set(r["bwd"]) == {"all_reduce(dp)"}
    # every parameter gradient (28, wte tied to lm_head once; wpe's too: its partial
    # gradient is no longer all-reduced mid-backward, `pxform.lower.defer`), the loss and
    # its target count in one bucket: one collective per step
    assert r["buckets"]["tensors"] == 28 + 2 and r["buckets"]["launched"] == 1


def test_gpt2_zero3(world2):
    r = check(world2.run(W.gpt2_shard, {"dp": 2}, "zero3", GPT2_BATCH), **GPT2_TOL)
    assert r["fwd"].count("all_gather(dp, dim 0)") >= 10
    assert "reduce_scatter(dp, dim 0)" in r["bwd"]
    assert r["grad_types"] == ["DTensor"]  # every GPT-2 parameter has an even dim 0


def test_gpt2_tensor_parallel(world2):
    r = check(world2.run(W.gpt2_shard, {"tp": 2}, "tp", None), loss_tol=1e-5)
    # one all-reduce per layer forward (g after c_proj), one backward (f before c_fc)
    assert r["fwd"] == ["all_reduce(tp)"] * 2 and r["bwd"] == ["all_reduce(tp)"] * 2


def test_gpt2_sequence_parallel(world2):
    r = check(world2.run(W.gpt2_shard, {"tp": 2}, "tp",
                         {"input_ids": P(None, "tp"), "labels": P(None, "tp")}), loss_tol=1e-5)
    per_layer = ["all_gather(tp, dim 1)", "all_gather(tp, dim 1)", "reduce_scatter(tp, dim 1)"]
    assert r["fwd"][:6] == per_layer * 2


def test_value_and_grad_with_aux_on_a_sharded_function(world2):
    for r in world2.run(W.has_aux_case):
        assert r["loss_err"] < 1e-12 and r["aux_err"] == 0.0 and r["grad_err"] < 1e-12
        assert r["aux_type"] == "DTensor"  # laid out per out_specs: split over dp
        assert r["error"] == ("pxform.value_and_grad(shard(mlp_with_aux)): the function must "
                              "return a scalar tensor, got tuple; return (value, aux) with "
                              "has_aux=True")


def test_random_ops_on_replicated_values_draw_the_same_numbers_as_one_process(world2):
    for r in world2.run(W.dropout_replicated):
        assert r["err"] < 1e-12, r
        assert r["differs_from_eager"], r  # pxform's stream, not torch's (documented)


def test_spec_errors_name_function_path_shape_mesh_and_fix(world2):
    out = world2.run(W.spec_errors)[0]
    assert out["indivisible"] == (
        "shard(mlp_loss): batch['y'] (shape [16, 3], spec P(None, 'dp'), Mesh(dp=2)): dim 1 "
        "has size 3, which is not divisible by 2 (dp=2).\n  Fix: make dim 1 a multiple of 2, "
        "or shard it over fewer or smaller axes.")
    assert "mesh axis 'pp' (dim 0) is not in the mesh.\n  Fix: use one of ['dp']" in \
        out["unknown_axis"]
    assert "the spec has 3 entries but the tensor has rank 2" in out["too_long"]
    assert out["prefix"].startswith("pxform.shard(mlp_loss): in_specs is not a pytree prefix "
                                    "of the arguments")
    assert out["twice"] == (
        "shard(mlp_loss): batch['x'] (shape [16, 4], spec P('dp', 'dp'), Mesh(dp=2)): mesh "
        "axis 'dp' splits dims [0, 1]; an axis can split at most one dim of a tensor.\n  "
        "Fix: use it for one dim only, e.g. P('dp', None).")
    assert out["world"] == (
        "pxform.Mesh(dp=2, tp=2): the mesh has 4 devices but the torch.distributed world has 2 "
        "ranks.\n  Fix: make the axis sizes multiply to 2, or launch 4 processes.")


def test_checkpoint_saved_on_two_ranks_loads_on_four_with_another_layout(world2, tmp_path):
    import torch
    import torch.distributed.checkpoint as dcp

    path = str(tmp_path / "ckpt")
    saved = world2.run(W.save_checkpoint, path)[0]
    assert saved == ["[Shard(dim=0)]"]  # ZeRO-3 on dp=2: every parameter split
    with World(4) as w4:
        for r in w4.run(W.load_checkpoint, path):
            assert r["value_err"] == 0.0 and r["grad_err"] < 1e-12 and r["loss_err"] < 1e-12
            assert "[Replicate(), Shard(dim=0)]" in r["placements"]  # Megatron on tp
    # and in one process without torch.distributed, as plain full tensors
    _, params, _, _ = W._gpt_params_and_specs("tp")
    state = {"params": W._zeros_like(params)}
    with pytest.warns(UserWarning, match="assuming the intent is to load in a single process"):
        dcp.load(state, checkpoint_id=path, no_dist=True)
    for a, b in zip(W._leaves(state["params"]), W._leaves(params)):
        assert torch.equal(a, b)


@pytest.mark.heavy
def test_dp_by_tp_on_four_ranks():
    with World(4) as w4:
        params, batch = W.big_mlp_args(batch=8)
        check(w4.run(W.shard_value_and_grad, W.mlp_loss, (params, batch), {"dp": 2, "tp": 2},
                     ({"w1": P("tp"), "b1": P("tp"), "w2": P("tp")},
                      {"x": P("dp"), "y": P("dp")})))
        r = check(w4.run(W.gpt_shard, {"dp": 2, "tp": 2},
                         {"idx": P("dp"), "targets": P("dp")}, True), ignored_targets=True)
        assert "all_reduce(tp)" in r["fwd"] and "all_reduce(dp)" in r["bwd"]
        r = check(w4.run(W.gpt2_shard, {"dp": 2, "tp": 2}, "tp", GPT2_BATCH), **GPT2_TOL)
        assert r["fwd"].count("all_reduce(tp)") == 2 and r["fwd"].count("all_reduce(dp)") == 1


def test_a_spec_prefix_error_shows_the_arguments_types_not_their_values():
    def fn(p, b):
        return (b["x"] @ p["w"]).sum()

    params, batch = {"w": torch.randn(4, 3)}, {"x": torch.randn(8, 4)}
    step = pxform.shard(fn, mesh=pxform.AbstractMesh({"dp": 2}), in_specs=(None,))
    with pytest.raises(pxform.SpecError) as err:
        step.lower(params, batch)
    msg = str(err.value)
    assert msg.startswith("pxform.shard(fn): in_specs is not a pytree prefix of the arguments "
                          "(tuple arity mismatch): in_specs=(None,) for ({'w': f32[4,3]}, "
                          "{'x': f32[8,4]}).\n  Fix: give one spec per argument")
    assert "tensor(" not in msg


def test_data_parallel_runs_no_more_all_reduces_than_ddp(world2):
    # DDP: its buckets (1 MiB first, then 25 MiB: two all-reduces here; it also runs two
    # broadcasts). pxform: one all-reduce for every gradient, the loss and the target count
    # (the position embedding's partial gradient waits for its parameter's bucket; the loss
    # and count ride in it)
    for r in world2.run(W.collectives_against_ddp):
        assert r["pxform"] == ["gloo:all_reduce"], r
        assert r["pxform"].count("gloo:all_reduce") <= r["ddp"].count("gloo:all_reduce"), r
        assert r["loss_err"] < 1e-6 and r["grad_err"] < 1e-6, r
        # every replicated parameter's gradient is bucketed from a hook, with no autograd
        # Function of pxform's per parameter; ZeRO-3's gathered parameters keep theirs
        assert r["functions"] == 0, r
        assert r["hooked"]["dp"] == r["hooked"]["params"] and r["hooked"]["zero3"] == 0, r
