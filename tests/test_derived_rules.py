"""Rules without hand-writing, and the pooling / along-a-dim families (issue 20, part):

- every overload torch tags `torch.Tag.pointwise` gets the broadcasting rule
  (`pxform.ops.pointwise`, `register_family`): `min.other` and `max.other` (clamping,
  relative-position buckets), `isfinite`, special functions...;
- pooling (max, average, adaptive; 1-3 spatial dims) splits batch and channels;
- topk, sort, argsort and kthvalue split every dim but the one they work along.

Each rule is checked exhaustively: every strategy of every op on several meshes, fed its
true inputs laid out per the strategy, must give exactly the true outputs in the layout it
claims (`test_strategy.every_strategy_of_every_op`); hypothesis draws the shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_strategy import MESHES, every_strategy_of_every_op, f64

import pxform
from pxform.ops.registry import has_rule

aten = torch.ops.aten


def derived_pointwise(x, y):
    clamped = torch.min(torch.max(x, y - 0.5), y + 0.5)         # max.other, min.other
    special = torch.special.zeta(x.abs() + 2, 2.0) + torch.i0(y)
    return clamped * special + torch.isfinite(x / y).to(x.dtype)


def pooled(x):
    h = F.max_pool2d(x, 2)
    a = F.avg_pool2d(x, 2)
    g = F.adaptive_avg_pool2d(x, (1, 2)) + F.adaptive_max_pool2d(x, (1, 2))
    flat = (h + a).flatten(2)                                     # n c (h w)
    p1 = F.adaptive_avg_pool1d(flat, 2) + F.max_pool1d(flat, 2, 2)[..., :2]
    return g.flatten(1), p1


def along_a_dim(x):
    values, indices = torch.topk(x, 2, dim=-1)
    ordered, _ = torch.sort(x, dim=0, descending=True)
    ranks = torch.argsort(x, dim=-1)
    kth, _ = torch.kthvalue(x, 2, dim=-1)
    return values, indices, ordered, ranks, kth


def model_family_ops(x, grid, counts, points):
    """Ops the coverage models emit (or torch's core opset holds) that have rules of their
    own: interpolation (BEiT), coordinate grids, histograms (MoE routing), pads of every
    kind, the diagonal view, grid sampling, pairwise distances, and the native norm forms
    with their saved statistics; eval-mode batch norm; Python-API aliases of pointwise ops
    (`torch.multiply`), FFTs and their real part, and `unfold`."""
    up = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)
    near = F.interpolate(x, size=(6, 6), mode="nearest")
    rows, cols = torch.meshgrid(torch.arange(3.0), torch.arange(4.0), indexing="ij")
    hist = torch.histc(counts, bins=4, min=0, max=3)
    padded = (aten.reflection_pad2d(x, [1, 1, 1, 1]) + aten.replication_pad2d(x, [1, 1, 1, 1]))
    padded3 = aten.replication_pad3d(x[None], [1, 1, 1, 1, 0, 0])
    diag = torch.diagonal(x, dim1=-2, dim2=-1)
    sampled = F.grid_sample(x, grid, align_corners=False)
    dist = torch.cdist(points, points + 1)
    bn, mean, rstd = aten._native_batch_norm_legit.no_stats(x, None, None, True, 0.1, 1e-5)
    gn, gmean, grstd = aten.native_group_norm(x, None, None, x.shape[0], x.shape[1],
                                              x.shape[2] * x.shape[3], 2, 1e-5)
    evaluated = F.batch_norm(x, counts[:4], counts[4:] + 1, training=False)  # every dim splits
    aliases = torch.multiply(x, 2.0) + torch.greater(x, 0).to(x.dtype) - torch.negative(x)
    mixed = torch.fft.fftn(x, dim=(1, 2)).real                 # FNet's token mixing
    patches = F.unfold(x, kernel_size=2)                        # ConvBERT's span convolution
    return (up.sum((2, 3)) + near.sum((2, 3)), rows + cols, hist, padded.sum((2, 3)),
            padded3.sum(), diag, sampled, dist, bn, mean, rstd, gn, gmean, grstd, evaluated,
            aliases, mixed, patches)


@settings(max_examples=4, deadline=None)
@given(st.sampled_from([(4, 4, 4, 4), (8, 4, 4, 8)]))
@pytest.mark.heavy
def test_model_family_rules_are_exact_under_every_strategy(shape):
    x = f64(*shape, seed=7)
    grid = torch.tanh(f64(shape[0], 4, 2, 2, seed=8))
    counts = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(9)).double()
    points = f64(4, 8, 3, seed=10)
    for name in ("upsample_bilinear2d", "meshgrid", "histc", "reflection_pad2d",
                 "replication_pad3d", "diagonal", "grid_sampler_2d", "_cdist_forward",
                 "_native_batch_norm_legit", "native_group_norm", "multiply", "fft_fftn",
                 "real", "im2col"):
        packet = getattr(aten, name)
        assert all(has_rule(getattr(packet, o)) for o in packet.overloads()), name
    assert sum(every_strategy_of_every_op(model_family_ops, (x, grid, counts, points), m)
               for m in MESHES)


def test_tagged_pointwise_overloads_have_derived_rules():
    for target in (aten.min.other, aten.max.other, aten.isfinite.default,
                   aten.special_zeta.other_scalar, aten.i0.default):
        assert has_rule(target), target
    # lists of tensors (_foreach) and in-place overloads are not pointwise in pxform's sense
    assert not has_rule(aten._foreach_add.List)
    assert not has_rule(aten.add_.Tensor)


@settings(max_examples=8, deadline=None)
@given(st.sampled_from([(4, 4), (8, 4), (4, 8)]), st.booleans())
def test_derived_pointwise_rules_are_exact_under_every_strategy(shape, broadcast):
    x = f64(*shape, seed=1)
    y = f64(1, shape[1], seed=2) if broadcast else f64(*shape, seed=2)
    y = y.abs() + 0.5
    assert sum(every_strategy_of_every_op(derived_pointwise, (x, y), m) for m in MESHES)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(4, 4, 4, 8), (8, 4, 8, 8), (4, 8, 4, 4)]))
def test_pooling_rules_are_exact_under_every_strategy(shape):
    x = f64(*shape, seed=3)
    assert sum(every_strategy_of_every_op(pooled, (x,), m) for m in MESHES)


@settings(max_examples=6, deadline=None)
@given(st.sampled_from([(4, 4), (8, 4), (4, 8, 4)]))
def test_along_a_dim_rules_are_exact_under_every_strategy(shape):
    x = f64(*shape, seed=4)
    assert sum(every_strategy_of_every_op(along_a_dim, (x,), m) for m in MESHES)


def test_pooling_and_topk_keep_the_window_and_the_sorted_dim_whole():
    x = f64(4, 4, 8, 8)
    ops = {op.name: op for op in pxform.trace(pooled, x).graph.ops}
    sig = pxform.ops.rule_info(ops["max_pool2d"]).signature
    assert str(sig) == "a b ^c ^d -> a b ^e ^f"
    ops = {op.name: op for op in pxform.trace(along_a_dim, f64(4, 8)).graph.ops}
    assert str(pxform.ops.rule_info(ops["topk"]).signature) == "a ^b -> a ^c, a ^c"


@pytest.mark.parametrize("fn", [derived_pointwise])
def test_derived_ops_trace_and_check(fn):
    x, y = f64(4, 6, seed=5), f64(4, 6, seed=6).abs() + 0.5
    traced = pxform.trace(fn, x, y)
    pxform.check(traced.graph)
    torch.testing.assert_close(traced(x, y), fn(x, y))


@pytest.mark.parametrize("where", ["trace", "shard", "pipeline", "auto"])
def test_a_module_instead_of_a_function_is_refused_with_the_fix(where):
    model = torch.nn.Linear(4, 2)
    x = torch.randn(3, 4)
    with pytest.raises(pxform.TraceError) as err:
        if where == "trace":
            pxform.trace(model, x)
        elif where == "shard":
            pxform.shard(model, mesh=pxform.AbstractMesh({"dp": 2}), in_specs=None)
        elif where == "pipeline":
            pxform.pipeline(model, stages=2, microbatches=2)
        else:
            pxform.auto(model, mesh=2)
    msg = str(err.value)
    assert msg.startswith(f"pxform.{where}(Linear): got an nn.Module (Linear), not a "
                          f"function of its parameters")
    assert "its weights would be constants" in msg
    assert "Fix: fn, params = pxform.module_fn(model)" in msg
