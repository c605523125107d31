"""`pxform.recompute`, `pxform.checkpoint_name`, `pxform.coshard` and stage-aware recompute.

Equivalence: every policy and every coshard dim (batch, sequence, heads, and the loss head
along the batch) matches the plain GPT on one process, under data and tensor parallelism on
2 gloo ranks (1 rank too) and on a 2 x 2 mesh on 4 ranks, and inside pipelines (1F1B, zero
bubble, and Merak's shifted schedule with its early recompute). Memory, measured with the
meter: a recomputed block keeps only its input; "matmuls" keeps less than nothing-recomputed
and more than recompute-everything; coshard in k pieces cuts the region's peak to about 1/k;
stage-aware recompute keeps every stage of a 4-stage pipeline under the budget while
recomputing fewer blocks than uniform recompute. Errors name the op, dim and fix."""

from __future__ import annotations

import dataclasses
import re

import optree
import pytest
import region_workers as R
import torch
import torch.nn.functional as F

import pxform
from pxform.frontend.regions import RECOMPUTE, SAVE
from pxform.passes.expand import prepare
from pxform.tools.testing import World

TOL = 1e-12


def _value_and_grad_errors(fn, ref_fn, args, argnums=(0, 1)):
    v1, g1 = pxform.value_and_grad(fn, argnums)(*args)
    v2, g2 = pxform.value_and_grad(ref_fn, argnums)(*args)
    err = max(float((a - b).abs().max()) for a, b in
              zip(optree.tree_leaves(g1), optree.tree_leaves(g2)))
    return abs(float(v1) - float(v2)), err


# ---------------------------------------------------------------- one process


@pytest.mark.parametrize("variant", R.VARIANTS[1:])
def test_every_policy_and_coshard_matches_the_plain_model_on_one_process(variant):
    cfg, params, batch = R.setup()
    ref_loss, ref_grads = pxform.value_and_grad(R.make_loss("plain", cfg))(params, batch)
    loss, grads = pxform.value_and_grad(R.make_loss(variant, cfg))(params, batch)
    got = R.errors(loss, grads, ref_loss, ref_grads)
    assert got["loss_err"] < TOL and got["grad_err"] < TOL, got


def _block_setup():
    cfg, params, _ = R.setup(1)
    x = torch.randn(8, cfg.seq_len, cfg.d_model, dtype=torch.float64)
    return cfg, params["blocks"][0], x


def _measure(fn, *args, argnums=(0, 1)):
    step = pxform.value_and_grad(lambda *a: fn(*a).square().sum(), argnums)
    step(*args)  # trace and compile outside the measurement
    with pxform.MemoryMeter() as meter:
        meter.track(*args)
        step(*args)
    return meter.stats


def test_a_recomputed_block_keeps_only_its_input():
    import gpt

    cfg, p, x = _block_setup()

    def block(p, x):
        return gpt.block(p, x, cfg)

    plain = _measure(block, p, x)
    ckpt = _measure(pxform.recompute(block), p, x)
    x_bytes = x.numel() * x.element_size()
    assert plain.saved_bytes > 8 * x_bytes  # a block saves many activations...
    # ...recomputed, it keeps its input (and the 8-byte loss autograd starts from)
    assert ckpt.saved_bytes <= x_bytes + 64, (ckpt, x_bytes)
    assert ckpt.peak_bytes <= plain.peak_bytes  # one block: its recompute peaks as high


def test_policies_save_between_nothing_and_everything():
    import gpt

    cfg, p, x = _block_setup()

    def block(p, x):
        return gpt.block(p, x, cfg)

    def named(p, x):
        return R.named_block(p, x, cfg)

    plain = _measure(block, p, x).saved_bytes
    nothing = _measure(pxform.recompute(block), p, x).saved_bytes
    matmuls = _measure(pxform.recompute(block, policy="matmuls"), p, x).saved_bytes
    names = _measure(pxform.recompute(named, policy=["attn"]), p, x).saved_bytes
    x_bytes = x.numel() * x.element_size()
    assert nothing < names < matmuls < plain, (nothing, names, matmuls, plain)
    assert names - nothing == x_bytes  # exactly the attention output, one [8, 16, 32] f64


def test_prepare_numbers_regions_and_tags_what_the_policy_saves():
    import gpt

    cfg, p, x = _block_setup()
    fn = pxform.recompute(lambda p, x: gpt.block(p, x, cfg), policy="matmuls")
    graph = prepare(pxform.trace(lambda p, x: fn(p, fn(p, x)), p, x).graph)
    regions = [op.tag(RECOMPUTE).region for op in graph.ops if op.tag(RECOMPUTE)]
    assert sorted(set(regions)) == [0, 1]  # two calls, two regions, numbered from 0
    saved = sorted({op.name for op in graph.ops if op.tag(SAVE)})
    assert saved == ["linear", "scaled_dot_product_attention"]
    assert not any(op.name == "mark" for op in graph.ops)


def test_coshard_cuts_the_regions_peak_to_about_one_over_chunks():
    torch.manual_seed(0)
    d, h = 64, 512
    p = {"fc_w": torch.randn(h, d, dtype=torch.float64) * 0.05,
         "out_w": torch.randn(d, h, dtype=torch.float64) * 0.05}
    x = torch.randn(8, 64, d, dtype=torch.float64)

    def mlp(p, x):
        return F.linear(F.gelu(F.linear(x, p["fc_w"])), p["out_w"])

    x_bytes = x.numel() * x.element_size()
    peaks, saved = {}, {}
    for k in (1, 2, 4, 8):
        fn = mlp if k == 1 else pxform.coshard(mlp, chunks=k, dim=(None, 0))
        stats = _measure(fn, p, x)
        peaks[k], saved[k] = stats.peak_bytes - stats.baseline_bytes, stats.saved_bytes
    # peak = fixed + activations / k: fit on k = 1 and 8, check k = 2 and 4
    scaling = (peaks[1] - peaks[8]) * 8 / 7
    fixed = peaks[1] - scaling
    assert scaling >= saved[1]  # what shrinks is (at least) the activations saved whole
    assert fixed <= 6 * x_bytes  # what stays: gradients of x and the weights, the output
    for k in (2, 4):
        assert abs(peaks[k] - (fixed + scaling / k)) <= 0.1 * peaks[k], (k, peaks)
    assert saved[2] == saved[8] <= x_bytes + 64  # pieces keep only the region's input


def test_checkpoint_name_is_the_identity_outside_a_trace():
    x = torch.randn(3)
    assert pxform.checkpoint_name(x, "a") is x


# ---------------------------------------------------------------- errors


def _attention_args():
    cfg, p, x = _block_setup()
    return cfg, p, x


def test_coshard_along_a_dim_an_op_reduces_names_the_op():
    import gpt

    cfg, p, x = _attention_args()
    att = pxform.coshard(lambda p, x: gpt.attention(p, x, cfg), chunks=2, dim=(None, 1))
    with pytest.raises(pxform.RegionError, match=r"(?s)pxform.coshard\(<lambda>\): "
                       r"scaled_dot_product_attention at .*gpt.py:\d+ in attention.* cannot "
                       r"run in 2 pieces: its input %\d+ \(f64\[8,2,16,16\]\) is split along "
                       r"dim 2, which scaled_dot_product_attention reduces or normalises "
                       r"over.*Fix: coshard along a dim that every op"):
        att(p, x)


def test_coshard_along_a_normalised_dim_names_layer_norm():
    def norm(w, x):
        return F.layer_norm(x, x.shape[-1:], w)

    x = torch.randn(4, 8)
    with pytest.raises(pxform.RegionError, match=r"layer_norm at .* its input %x \(f32\[4,8\]\)"
                       r" is split along dim 1, which layer_norm reduces or normalises over"):
        pxform.coshard(norm, chunks=2, dim=(0, 1))(torch.ones(8), x)


def test_coshard_chunks_must_divide_the_dim():
    x = torch.randn(6, 8)
    with pytest.raises(pxform.RegionError, match=r"(?s)coshard\(f\): x has shape \[6, 8\]; its "
                       r"dim 0 \(6\) does not divide into chunks=4 pieces.*Fix: choose chunks "
                       r"dividing 6"):
        def f(x):
            return x.sin()
        pxform.coshard(f, chunks=4, dim=0)(x)


def test_coshard_dim_must_match_the_arguments():
    with pytest.raises(pxform.RegionError, match=r"dim=\(0, 1, None\) gives 3 entries for 2 "
                       r"arguments"):
        pxform.coshard(lambda a, b: a + b, chunks=2, dim=(0, 1, None))(
            torch.randn(4), torch.randn(4))
    with pytest.raises(pxform.RegionError, match="splits no tensor argument"):
        pxform.coshard(lambda a: a.sin(), chunks=2, dim=None)(torch.randn(4))


def test_a_policy_naming_a_missing_value():
    import gpt

    cfg, p, x = _block_setup()
    fn = pxform.recompute(lambda p, x: R.named_block(p, x, cfg), policy=["attn", "mlp_out"])
    with pytest.raises(pxform.RegionError, match=r"(?s)pxform.recompute\(<lambda>\): the policy "
                       r"saves 'mlp_out', but no value inside the region has that name \(names "
                       r"given in it: 'attn'\).*Fix: mark the value inside the function with "
                       r"pxform.checkpoint_name\(x, 'mlp_out'\)"):
        fn(p, x)
    with pytest.raises(pxform.RegionError, match=r"(?s)policy=.attn. is not a policy.*"
                       r"policy=\['attn'\]"):
        pxform.recompute(gpt.block, policy="attn")


def test_a_stage_boundary_inside_a_coshard_region():
    def f(x):
        return pxform.stage_boundary(x.sin()).cos()

    with pytest.raises(pxform.RegionError, match=r"(?s)coshard\(f\): pxform.stage_boundary at "
                       r".* is inside the cosharded function.*Fix: move the stage_boundary"):
        pxform.coshard(f, chunks=2, dim=0)(torch.randn(4, 2))


def test_coshard_overlap_needs_pieces_that_are_not_recomputed():
    def mlp(w, x):
        return x @ w

    with pytest.raises(pxform.RegionError) as err:
        pxform.coshard(mlp, chunks=2, dim=(None, 0), overlap=True)
    assert str(err.value) == (
        "pxform.coshard(mlp): overlap=True interleaves the pieces, so they are alive together "
        "and cannot each be recomputed on its own (recompute=True, the default).\n  Fix: pass "
        "recompute=False with overlap=True; to also save activation memory, wrap the "
        "cosharded call in pxform.recompute.")
    with pytest.raises(pxform.RegionError, match="overlap must be True or False, got 'yes'"):
        pxform.coshard(mlp, chunks=2, dim=(None, 0), recompute=False, overlap="yes")
    assert "overlap=True" in repr(pxform.coshard(mlp, chunks=2, dim=(None, 0),
                                                 recompute=False, overlap=True))


def test_coshard_regions_cannot_nest():
    inner = pxform.coshard(lambda x: x.sin(), chunks=2, dim=0)
    with pytest.raises(pxform.RegionError, match="coshard regions cannot nest"):
        pxform.coshard(lambda x: inner(x), chunks=2, dim=0)(torch.randn(4))


def test_coshard_of_a_loss_with_class_weights_is_refused():
    def loss(logits, t, w):
        return F.cross_entropy(logits, t, weight=w)

    with pytest.raises(pxform.RegionError, match="with class weights, which coshard cannot "
                       "count"):
        pxform.coshard(loss, chunks=2, dim=(0, 0, None))(
            torch.randn(4, 3), torch.tensor([0, 1, 2, 1]), torch.ones(3))


# ---------------------------------------------------------------- stage-aware plans


def test_stage_aware_recompute_recomputes_more_on_early_stages():
    cfg, params, batch = R.setup(8, 16)
    step = pxform.pipeline(R.make_loss("plain", cfg), stages=4, microbatches=8,
                           recompute="stage_aware", memory_budget="1.2MiB")
    plan = step.recompute_plan(params, batch)
    counts = plan.counts
    assert list(counts) == sorted(counts, reverse=True) and counts[0] > counts[-1] == 0
    assert all(s.estimate_bytes <= 1.2 * 2**20 for s in plan.stages)
    assert [s.in_flight for s in plan.stages] == [4, 3, 2, 1]  # 1F1B
    assert "budget 1.2 MiB per device" in str(plan)
    tight = pxform.pipeline(R.make_loss("plain", cfg), stages=4, microbatches=8,
                            recompute="stage_aware", memory_budget="200KiB")
    with pytest.raises(pxform.PipelineError, match=r"(?s)stage 0 needs about .* even "
                       r"recomputing all of its 3 blocks .* more than memory_budget=200 KiB.*"
                       r"Fix: use more stages or more microbatches"):
        tight.recompute_plan(params, batch)
    with pytest.raises(pxform.PipelineError, match="memory_budget: 'lots' is not a size"):
        pxform.pipeline(R.make_loss("plain", cfg), stages=4, microbatches=8,
                        recompute="stage_aware", memory_budget="lots")
    with pytest.raises(pxform.PipelineError, match="none was given"):
        pxform.pipeline(R.make_loss("plain", cfg), stages=4, microbatches=8,
                        recompute="stage_aware").recompute_plan(params, batch)


def test_recompute_under_zero_bubble_warns_that_it_costs_more():
    """Zero-bubble's W runs a recompute region's forward again for each weight op's
    gradient, and keeps what B recomputed until the W: more memory and time than no
    recompute (`pxform.auto` never pairs them). A pipeline asked for both says so; 1F1B
    with recompute does not."""
    import warnings

    cfg, params, batch = R.setup(8, 16)
    step = pxform.pipeline(R.make_loss("plain", cfg), stages=2, microbatches=4,
                           schedule="zb", recompute="all")
    with pytest.warns(pxform.PxformWarning) as got:
        step.recompute_plan(params, batch)
    (text,) = [str(w.message) for w in got if "zero-bubble" in str(w.message)]
    assert text.startswith("pxform.pipeline(gpt_plain): stages [0, 1] of its zero-bubble "
                           "schedule run recompute regions (pipeline(gpt_plain) embed, "
                           "pipeline(gpt_plain) layer 0, "), text
    assert "Fix: recompute under schedule='1f1b' or 'shifted'" in text
    plain = pxform.pipeline(R.make_loss("plain", cfg), stages=2, microbatches=4,
                            schedule="1f1b", recompute="all")
    with warnings.catch_warnings():
        warnings.simplefilter("error", pxform.PxformWarning)
        plain.recompute_plan(params, batch)


# ---------------------------------------------------------------- gloo ranks


@pytest.fixture(scope="module")
def world2():
    with World(2) as world:
        yield world


@pytest.mark.timeout(300)
def test_the_predicted_peak_of_a_recomputed_plan_matches_the_measured(world2):
    """A recomputed block's backward peaks as its recompute ends, before its own parameter
    gradients exist (`cost.model.backward_extra`'s `ends`): counted on top, they put this
    recomputed GPT's predicted peak 6.5 % above the measured one (2.1 % without them; the
    plain plan's is within 0.1 %). Under tensor parallelism a recomputed block keeps more
    input than it has gradients, and the blocks whose backward is done hold their
    gradients alone (`backward_extra`'s `behind`): counted at max(kept, gradients), the
    peak came out 9.0 % over (4.3 % with it: the loss block's recompute is priced above
    what it reaches, within the issue's 5 %); the cross-entropy's backward makes a gradient
    of its log-softmax beside its input's (`blockcost.walk`): without it, the
    tensor-parallel plan came out 3.5 % under (0.4 % with it)."""
    for got in world2.run(R.searched_memory):
        for case, (predicted, measured) in got.items():
            within = 0.05 if case == ("tp", True) else 0.025
            assert abs(predicted / measured - 1) < within, (case, predicted, measured)


def test_one_rank_data_parallel_mesh():
    with World(1) as world:
        (got,) = world.run(R.run_sharded, R.VARIANTS, {"dp": 1}, "dp")
    for v, e in got.items():
        assert e["loss_err"] < TOL and e["grad_err"] < TOL, (v, e)


@pytest.mark.parametrize("axes, batch_axis, tp", [({"dp": 2}, "dp", False),
                                                   ({"tp": 2}, None, True)])
def test_every_variant_under_shard_on_two_ranks(world2, axes, batch_axis, tp):
    for got in world2.run(R.run_sharded, R.VARIANTS, axes, batch_axis, tp):
        for v, e in got.items():
            assert e["loss_err"] < TOL and e["grad_err"] < TOL, (v, e)
        # one checkpointed module per region: per layer, or per coshard piece
        assert got["plain"]["recompute_modules"] == 0
        assert got["nothing"]["recompute_modules"] == 2
        assert got["trunk"]["recompute_modules"] == 1
        assert got["coshard_batch"]["recompute_modules"] == 4  # 2 layers x 2 pieces


def test_overlapped_pieces_run_their_collectives_under_the_other_pieces_compute(world2):
    """coshard(overlap=True) under Megatron TP of the MLPs: each piece's all-reduce (forward)
    and its column-parallel input's gradient all-reduce (backward) are launched and waited
    for only after a matmul of another piece ran; the same pieces without overlap, and the
    model without pieces, overlap only their gradient buckets."""
    got = {v: world2.run(R.overlap_order, v) for v in ("overlap", "pieces", "plain")}
    for overlap, pieces, plain in zip(got["overlap"], got["pieces"], got["plain"]):
        assert pieces["overlapped"] == plain["overlapped"], (pieces, plain)
        # 2 layers x 2 pieces x (forward all-reduce + backward all-reduce) = 8 collectives;
        # the last piece's forward all-reduce of each layer overlaps no matmul (only its
        # partner's residual add): 6 of them at least
        assert overlap["overlapped"] >= plain["overlapped"] + 6, (overlap, plain)
        text = overlap["text"]
        assert text.count("convert_async") == 8, text
        # piece 1 of the first layer starts before piece 0 reads its all-reduced output
        lines = text.splitlines()
        first = next(k for k, line in enumerate(lines) if "fwd: all_reduce(tp)" in line)
        name = lines[first].split(":")[0].strip()
        reader = next(k for k, line in enumerate(lines)
                      if k > first and re.search(re.escape(name) + r"[,)]", line))
        assert any(".c1" in line for line in lines[first + 1:reader]), text
        assert "convert_async" not in pieces["text"]


def test_overlapped_pieces_recomputed_together_match_the_plain_model(world2):
    """recompute(coshard(..., recompute=False, overlap=True)): one checkpointed region per
    layer holding both interleaved pieces; exact, and no collective is left unwaited when
    the recompute stops early (it runs its collectives synchronously)."""
    for got in world2.run(R.run_sharded, ["overlap_recomputed"], {"tp": 2}, None, True):
        e = got["overlap_recomputed"]
        assert e["loss_err"] < TOL and e["grad_err"] < TOL, e
        assert e["recompute_modules"] == 2, e
        assert e["unwaited"] == 0, e


def test_collectives_inside_a_region_run_again_on_recompute(world2):
    for got in world2.run(R.count_collectives, ["plain", "trunk"]):
        assert got["trunk"] > got["plain"], got


@pytest.mark.parametrize("variant, schedule", [("nothing", "1f1b"), ("coshard_batch", "zb"),
                                               ("plain", "shifted"), ("matmuls", "shifted"),
                                               ("overlap", "1f1b")])
def test_recompute_inside_pipelines_on_two_ranks(world2, variant, schedule):
    for got in world2.run(R.run_pipeline, variant, schedule, 2, 4):
        assert got["loss_err"] < TOL and got["grad_err"] < TOL and got["forward_only"] < TOL, got


@pytest.fixture(scope="module")
def world4():
    with World(4) as world:
        yield world


@pytest.mark.heavy
def test_variants_on_a_two_by_two_mesh(world4):
    variants = ["nothing", "matmuls", "coshard_heads", "coshard_loss", "overlap"]
    for got in world4.run(R.run_sharded, variants, {"dp": 2, "tp": 2}, "dp", True):
        for v, e in got.items():
            assert e["loss_err"] < TOL and e["grad_err"] < TOL, (v, e)


def test_shifted_schedule_on_four_stages(world4):
    for got in world4.run(R.run_pipeline, "plain", "shifted", 4, 8, num_layers=4):
        assert got["loss_err"] < TOL and got["grad_err"] < TOL, got


def test_stage_aware_recompute_fits_the_budget_measured(world4):
    budget = int(1.2 * 2**20)
    got = world4.run(R.pipeline_memory, "stage_aware", "1.2MiB")
    counts = got[0]["counts"]
    # uniform recompute: every stage recomputes what the first stage needs
    uniform = sum(min(counts[0], len(s)) for s in ([0] * 3, [0] * 2, [0] * 2, [0] * 3))
    assert sum(counts) < uniform, counts
    for rank, r in enumerate(got):
        assert r["grad_err"] < TOL, r
        assert r["measured"] <= budget, (rank, r["measured"], r["text"])
    none = world4.run(R.pipeline_memory, (0, 0, 0, 0))
    assert none[0]["measured"] > budget  # without recompute the first stage does not fit


def test_coshard_pieces_are_pieces_of_each_ranks_shard():
    """Along a dim the mesh splits (the batch under data parallelism, microbatches), piece c
    takes its share of every shard: the program moves no more data than without coshard."""
    from pxform import P

    cfg, params, batch = R.setup()
    texts = {}
    for v in ("plain", "coshard_batch"):
        step = pxform.shard(R.make_loss(v, cfg), mesh=pxform.AbstractMesh({"dp": 2}),
                            in_specs=(None, {"idx": P("dp"), "targets": P("dp")}))
        program = step.lower(params, batch)
        texts[v] = (program.collectives(), program.backward_collectives())
    assert texts["coshard_batch"] == texts["plain"]


def test_recompute_runs_up_to_the_last_op_that_saves_a_tensor():
    """A recomputed residual MLP block redoes both linears and the GELU but not the
    residual add: autograd saves an op's inputs after its kernel ran, so torch's
    checkpoint stops only once the second linear has run (it saves the GELU's output),
    and skips what follows. Counted with the profiler: a TorchDispatchMode changes what
    the recompute runs (under one it stopped before the second linear). The search
    prices a recompute that way (`WalkCost.redo_fwd`)."""
    from torch.profiler import profile

    def block(p, x):
        return x + F.linear(F.gelu(F.linear(x, p["w1"])), p["w2"])

    g = torch.Generator().manual_seed(0)
    p = {"w1": torch.randn(32, 8, generator=g, dtype=torch.float64),
         "w2": torch.randn(8, 32, generator=g, dtype=torch.float64)}
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    counts = {}
    for name, fn in (("plain", block), ("recomputed", pxform.recompute(block))):
        step = pxform.value_and_grad(lambda p, x, fn=fn: fn(p, x).square().sum())
        step(p, x)  # traced and lowered outside the count
        with profile() as prof:
            step(p, x)
        events = {e.key: e.count for e in prof.key_averages()}
        counts[name] = tuple(events.get(f"aten::{op}", 0) for op in ("mm", "gelu", "add"))
    # plain: 2 matmuls forward, 3 backward (both weight gradients, the GELU's input
    # gradient; x takes none), one GELU, one add; recomputed: both matmuls and the GELU
    # again, the add not
    assert counts["plain"][:2] == (5, 1), counts
    assert counts["recomputed"] == (7, 2, counts["plain"][2]), counts


def test_the_search_prices_a_recompute_up_to_the_last_op_that_saves():
    """The same stops in the cost model: recomputing every residual MLP block adds to
    backward its linears and GELU, not its residual add (nor the loss's mean): nearly
    the whole forward, but less (before 2026-11-26 the model stopped before the second
    linear and priced half the forward, and measured recomputes cost twice that)."""
    from test_search import mlp_args, residual_mlp

    from pxform.search import Pin
    from pxform.search.space import Option

    params, x, y = mlp_args(layers=4)

    def planned(pin):
        return pxform.auto(residual_mlp, mesh=1, memory_budget="1TiB", hardware="a100-80gb",
                           plan=pin).plan(params, x, y)

    blocks = len(planned(Pin(stages=1)).blocks)
    plans = {redo: planned(Pin(stages=1, outer=1, inner=1,
                               block_options=(Option((), redo),) * blocks))
             for redo in (False, True)}
    plain, redone = plans[False].stage_plans[0], plans[True].stage_plans[0]
    extra = redone.backward_s - plain.backward_s
    assert plain.forward_s == pytest.approx(redone.forward_s)
    assert 0.9 * plain.forward_s < extra < plain.forward_s, (extra, plain.forward_s)


def test_a_recompute_region_pays_the_checkpoint_per_microbatch():
    """torch's checkpoint costs per region (its frame, hooks, RNG state: 0.1-0.4 ms here,
    `runtime_costs` measures it as `recompute_overhead_s`): the search adds it to the
    backward of every recomputed block, once per microbatch, and nothing to the blocks it
    does not recompute."""
    from test_search import mlp_args, residual_mlp

    from pxform.cost.hardware import hardware
    from pxform.search import Pin
    from pxform.search.space import Option

    params, x, y = mlp_args(layers=4)
    slow = dataclasses.replace(hardware("a100-80gb"), recompute_overhead_s=1e-3)

    def planned(hw, redo, microbatches):
        blocks = len(pxform.auto(residual_mlp, mesh=1, memory_budget="1TiB",
                                 hardware=hw).plan(params, x, y).blocks)
        options = tuple(Option((), redo and k % 2 == 0) for k in range(blocks))
        return pxform.auto(residual_mlp, mesh=1, memory_budget="1TiB", hardware=hw,
                           plan=Pin(stages=1, outer=1, inner=1, microbatches=microbatches,
                                    block_options=options)).plan(params, x, y)

    for m in (1, 4):
        base, paid = planned("a100-80gb", True, m), planned(slow, True, m)
        regions = sum(b.recompute for b in base.blocks)
        assert regions >= 2
        assert paid.step_time_s - base.step_time_s == pytest.approx(regions * m * 1e-3,
                                                                    rel=1e-6)
        # without a recompute the profile's figure changes nothing
        assert planned(slow, False, m).step_time_s == planned("a100-80gb", False, m).step_time_s
