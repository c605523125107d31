"""Op rules: for random shapes, every op's dim signature predicts the input and output shapes
the op really has (run on real tensors), `check` agrees, and FLOPs follow the formulas.
A few signatures are pinned as text: they are the sharding behaviour later issues build on.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import pxform
from pxform.frontend.trace import run_graph
from pxform.ops import rule_info

dims = st.integers(1, 5)


def shapes(min_rank=1, max_rank=4):
    return st.lists(dims, min_size=min_rank, max_size=max_rank).map(tuple)


def assert_rules_predict(fn, *args):
    """Trace `fn`, then run it op by op on real tensors and compare every op's signature
    with the shapes the op actually reads and produces."""
    traced = pxform.trace(fn, *args)
    pxform.check(traced.graph)
    seen = []

    def on_op(op, op_args, results):
        sig = rule_info(op).signature
        actual_out = tuple(tuple(r.shape) for r in results)
        assert sig.output_shapes() == actual_out, (str(op), str(sig), actual_out)
        ins = [v for v in op.inputs]
        assert sig.input_shapes() == tuple(v.type.shape for v in ins), (str(op), str(sig))
        seen.append(op.name)

    leaves = [a for a in _tensor_leaves(args)]
    run_graph(traced.graph, leaves, on_op=on_op)
    assert len(seen) == len(traced.graph.ops)
    return traced


def _tensor_leaves(args):
    import optree

    return [x for x in optree.tree_leaves((args, {})) if isinstance(x, torch.Tensor)]


def broadcastable(shape, draw):
    """A shape that broadcasts against `shape`: some dims set to 1, some leading dims dropped."""
    drop = draw(st.integers(0, len(shape)))
    out = [1 if draw(st.booleans()) else s for s in shape[drop:]]
    return tuple(out)


# ---------------------------------------------------------------- pointwise

UNARY = [torch.relu, torch.tanh, torch.sigmoid, torch.exp, torch.neg, torch.rsqrt,
         torch.abs, F.gelu, F.silu, torch.sin, torch.cos, lambda x: x.float().to(torch.float16),
         lambda x: F.dropout(x, 0.0), lambda x: x ** 2, lambda x: torch.clamp(x, -1, 1),
         lambda x: torch.tril(x) if x.dim() >= 2 else x, lambda x: x.to(torch.bfloat16)]
BINARY = [torch.add, torch.sub, torch.mul, torch.div, torch.maximum, torch.pow,
          lambda a, b: torch.where(a > b, a, b), lambda a, b: a.masked_fill(b > 0, 0.0),
          lambda a, b: (a > b) & (b < 1), lambda a, b: a.type_as(b)]


@given(st.data(), shapes(0, 4), st.integers(0, len(UNARY) - 1))
def test_pointwise_unary(data, shape, which):
    assert_rules_predict(UNARY[which], torch.rand(shape) + 0.5)


@given(st.data(), shapes(1, 4), st.integers(0, len(BINARY) - 1))
def test_pointwise_binary_broadcasting(data, shape, which):
    other = broadcastable(shape, data.draw)
    a, b = torch.rand(shape) + 0.5, torch.rand(other) + 0.5
    if data.draw(st.booleans()):
        a, b = b, a
    fn = BINARY[which]
    if which == 7:  # masked_fill needs a mask broadcastable to the first operand
        a, b = (a, b) if len(a.shape) >= len(b.shape) and all(
            y in (1, x) for x, y in zip(a.shape[::-1], b.shape[::-1])) else (b, a)
    assert_rules_predict(fn, a, b)


# ---------------------------------------------------------------- einsum-like

@given(shapes(0, 2), dims, dims, st.booleans())
def test_linear(batch, k, n, bias):
    x, w = torch.randn(*batch, k), torch.randn(n, k)
    args = (x, w, torch.randn(n)) if bias else (x, w)
    traced = assert_rules_predict(lambda *a: F.linear(*a), *args)
    info = rule_info(traced.graph.ops[0])
    m = math.prod(batch)
    assert info.flops == 2 * m * n * k + (m * n if bias else 0)
    assert info.signature.contracted() == frozenset({info.signature.inputs[1][1][0]})


@given(shapes(1, 4), shapes(1, 4), dims)
def test_matmul_shapes_and_flops(a_shape, b_shape, k):
    a = torch.randn(*a_shape[:-1], k) if len(a_shape) > 1 else torch.randn(k)
    n = b_shape[-1]
    if len(b_shape) > 1:
        # batch dims of b: broadcastable against a's batch dims
        b_batch = tuple(1 if s == 1 else a.shape[-3 - i] if i < a.dim() - 2 else s
                        for i, s in enumerate(reversed(b_shape[:-2])))[::-1]
        b_batch = b_batch[-max(0, a.dim() - 2):] if a.dim() > 2 else ()
        b = torch.randn(*b_batch, k, n)
    else:
        b = torch.randn(k)
    traced = assert_rules_predict(torch.matmul, a, b)
    out = torch.matmul(a, b)
    m = a.shape[-2] if a.dim() > 1 else 1
    nn = b.shape[-1] if b.dim() > 1 else 1
    batch = out.numel() // (m * nn)
    assert rule_info(traced.graph.ops[0]).flops == 2 * batch * m * nn * k


@given(dims, dims, dims, dims)
def test_bmm_addmm_baddbmm_einsum(b, m, k, n):
    x, y = torch.randn(b, m, k), torch.randn(b, k, n)
    t = assert_rules_predict(torch.bmm, x, y)
    assert rule_info(t.graph.ops[0]).flops == 2 * b * m * n * k
    assert_rules_predict(torch.addmm, torch.randn(n), torch.randn(m, k), torch.randn(k, n))
    assert_rules_predict(torch.baddbmm, torch.randn(1, m, n), x, y)
    t = assert_rules_predict(lambda p, q: torch.einsum("bmk,bkn->bmn", p, q), x, y)
    assert rule_info(t.graph.ops[-1]).flops == 2 * b * m * n * k
    assert_rules_predict(lambda p, q: torch.einsum("...k,nk->...n", p, q), x, torch.randn(n, k))


@given(dims, st.sampled_from([1, 2]), dims, st.integers(4, 7), st.integers(1, 3),
       st.integers(1, 2), st.integers(0, 1), st.booleans())
def test_conv2d(n, groups, cmul, size, ksize, stride, pad, bias):
    cin, cout = groups * cmul, groups * 2
    x = torch.randn(n, cin, size, size + 1)
    w = torch.randn(cout, cin // groups, ksize, ksize)
    b = torch.randn(cout) if bias else None
    t = assert_rules_predict(
        lambda x, w: F.conv2d(x, w, b, stride=stride, padding=pad, groups=groups), x, w)
    out = F.conv2d(x, w, b, stride=stride, padding=pad, groups=groups)
    expected = 2 * out.numel() * (cin // groups) * ksize * ksize + (out.numel() if bias else 0)
    assert rule_info(t.graph.ops[0]).flops == expected


# ---------------------------------------------------------------- reductions

@given(st.data(), shapes(1, 4), st.sampled_from(["sum", "mean", "amax", "var", "argmax",
                                                  "logsumexp", "cumsum", "max"]),
       st.booleans())
def test_reductions(data, shape, name, keepdim):
    x = torch.randn(shape)
    dim = data.draw(st.integers(-len(shape), len(shape) - 1))
    fns = {
        "sum": lambda x: x.sum(dim=[dim], keepdim=keepdim),
        "mean": lambda x: x.mean(dim=dim, keepdim=keepdim) + x.mean(),
        "amax": lambda x: x.amax(dim=dim, keepdim=keepdim),
        "var": lambda x: x.var(dim=dim, keepdim=keepdim, unbiased=False),
        "argmax": lambda x: x.argmax(dim=dim, keepdim=keepdim),
        "logsumexp": lambda x: torch.logsumexp(x, dim=dim, keepdim=keepdim),
        "cumsum": lambda x: x.cumsum(dim),
        "max": lambda x: x.max(dim=dim, keepdim=keepdim)[0] + x.max(),
    }
    traced = assert_rules_predict(fns[name], x)
    sig = rule_info(traced.graph.ops[0]).signature
    reduced = sig.inputs[0][dim % len(shape)][0]
    if name in ("sum", "mean"):
        assert reduced in sig.contracted()  # splitting a summed dim gives a partial sum
    else:
        assert reduced in sig.fixed


# ---------------------------------------------------------------- views and data movement

def factorizations(n, draw):
    out = []
    while n > 1:
        divs = [d for d in range(2, n + 1) if n % d == 0]
        d = draw(st.sampled_from(divs))
        out.append(d)
        n //= d
    if draw(st.booleans()):
        out.insert(draw(st.integers(0, len(out))), 1)
    return tuple(out) or (1,)


@given(st.data(), shapes(1, 4))
def test_reshape_to_random_factorization(data, shape):
    x = torch.randn(shape)
    target = data.draw(st.permutations(factorizations(x.numel(), data.draw)))
    assert_rules_predict(lambda x: x.reshape(tuple(target)) * 2, x)
    assert_rules_predict(lambda x: x.view(-1), x)


@given(st.data(), shapes(2, 4))
def test_views(data, shape):
    rank = len(shape)
    x = torch.randn(shape)
    perm = data.draw(st.permutations(range(rank)))
    d0 = data.draw(st.integers(0, rank - 1))
    d1 = data.draw(st.integers(d0, rank - 1))
    assert_rules_predict(lambda x: x.permute(*perm).contiguous(), x)
    assert_rules_predict(lambda x: x.transpose(d0, d1).flatten(d0 if d0 < rank - 1 else 0), x)
    assert_rules_predict(lambda x: x.unsqueeze(d0).squeeze(d0).unsqueeze(-1), x)
    assert_rules_predict(lambda x: x.flatten(d0, d1).unflatten(d0, shape[d0:d1 + 1]), x)
    assert_rules_predict(lambda x: x[..., :1].expand(*shape).clone(), x)
    assert_rules_predict(lambda x: x.unsqueeze(0).expand(3, *shape).sum(0), x)
    assert_rules_predict(lambda x: torch.squeeze(x), x)


@given(st.data(), shapes(1, 4))
def test_split_cat_slice_select(data, shape):
    rank = len(shape)
    x = torch.randn(shape)
    d = data.draw(st.integers(-rank, rank - 1))
    size = data.draw(st.integers(1, shape[d]))
    start = data.draw(st.integers(0, shape[d] - 1))
    assert_rules_predict(lambda x: torch.cat(x.split(size, dim=d)[::-1], dim=d), x)
    assert_rules_predict(lambda x: torch.stack(x.chunk(2, dim=d)[:1] * 2, dim=d), x)
    assert_rules_predict(lambda x: x.narrow(d, start, shape[d] - start), x)
    assert_rules_predict(lambda x: x.select(d, start), x)
    assert_rules_predict(lambda x: torch.stack(x.unbind(d), -1), x)
    idx = [slice(None)] * rank
    idx[d] = slice(start, None, 2)
    assert_rules_predict(lambda x: x[tuple(idx)], x)
    assert_rules_predict(lambda x: F.pad(x, (1, 2)), x)
    assert_rules_predict(lambda x: x.repeat(*([2] + [1] * (rank - 1))), x)


# ---------------------------------------------------------------- indexing

@given(dims, dims, shapes(1, 3))
def test_embedding_and_indexing(vocab, d, idx_shape):
    w = torch.randn(vocab, d)
    idx = torch.randint(0, vocab, idx_shape)
    t = assert_rules_predict(F.embedding, idx, w)
    sig = rule_info(t.graph.ops[0]).signature
    assert sig.inputs[0][0][0] in sig.fixed  # the vocabulary dim is not split (yet)
    assert_rules_predict(lambda w, i: w[i], w, idx)
    assert_rules_predict(lambda w, i: w[:, i.flatten() % d], w, idx)
    assert_rules_predict(lambda w, i: w.index_select(0, i.flatten()), w, idx)
    g_idx = torch.randint(0, d, (vocab, 1))
    assert_rules_predict(lambda w, i: w.gather(1, i), w, g_idx)


# ---------------------------------------------------------------- norms, softmax, attention

@given(st.data(), shapes(1, 4))
def test_norms_and_softmax(data, shape):
    rank = len(shape)
    k = data.draw(st.integers(1, rank))
    x = torch.randn(shape)
    norm_shape = shape[rank - k:]
    t = assert_rules_predict(lambda x, w, b: F.layer_norm(x, norm_shape, w, b), x,
                             torch.randn(norm_shape), torch.randn(norm_shape))
    sig = rule_info(t.graph.ops[0]).signature
    assert {t[0] for t in sig.inputs[0][rank - k:]} <= sig.fixed
    assert_rules_predict(lambda x, w: F.rms_norm(x, norm_shape, w), x, torch.randn(norm_shape))
    d = data.draw(st.integers(-rank, rank - 1))
    t = assert_rules_predict(lambda x: F.softmax(x, d) + F.log_softmax(x, d), x)
    assert rule_info(t.graph.ops[0]).signature.inputs[0][d][0] in \
        rule_info(t.graph.ops[0]).signature.fixed


@given(dims, dims, st.integers(1, 6), st.integers(1, 6), dims, dims,
       st.sampled_from(["none", "causal", "mask", "bcast_mask"]))
def test_scaled_dot_product_attention(b, h, lq, s, e, f, masking):
    q, k, v = torch.randn(b, h, lq, e), torch.randn(b, h, s, e), torch.randn(b, h, s, f)
    kwargs = {}
    if masking == "causal":
        kwargs["is_causal"] = True
    elif masking == "mask":
        kwargs["attn_mask"] = torch.randn(b, h, lq, s)
    elif masking == "bcast_mask":
        kwargs["attn_mask"] = torch.randn(lq, s)
    t = assert_rules_predict(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, **kwargs),
                             q, k, v)
    sig = rule_info(t.graph.ops[0]).signature
    l_label = sig.inputs[0][2][0]
    assert (l_label in sig.fixed) == (masking == "causal")
    assert rule_info(t.graph.ops[0]).flops == b * h * (2 * lq * s * (e + f) + 5 * lq * s)


# ---------------------------------------------------------------- losses and factories

@given(dims, st.integers(2, 6), shapes(0, 2), st.sampled_from(["mean", "sum", "none"]),
       st.booleans())
def test_cross_entropy(n, c, extra, reduction, probs):
    x = torch.randn(n, c, *extra)
    target = (torch.softmax(torch.randn(n, c, *extra), 1) if probs
              else torch.randint(0, c, (n, *extra)))
    assert_rules_predict(lambda x, t: F.cross_entropy(x, t, reduction=reduction,
                                                      ignore_index=-100), x, target)
    assert_rules_predict(lambda x, t: F.mse_loss(x, t.float(), reduction=reduction), x,
                         torch.randn(n, c, *extra))


@given(shapes(1, 3), st.integers(1, 8))
def test_factories(shape, n):
    assert_rules_predict(lambda x: x + torch.zeros(shape) + torch.ones_like(x) +
                         torch.full(shape, 2.0) + x.new_ones(shape), torch.randn(shape))
    assert_rules_predict(lambda x: x[: n] + torch.arange(min(n, x.shape[0])).float()[:, None],
                         torch.randn(n + 1, 2))


# ---------------------------------------------------------------- pinned signatures

def sig_text(fn, *args, index=0):
    op = pxform.trace(fn, *args).graph.ops[index]
    return str(rule_info(op).signature)


def test_pinned_signatures():
    x3 = torch.randn(2, 4, 6)
    assert sig_text(F.linear, x3, torch.randn(5, 6), torch.randn(5)) == \
        "a b c, d c, d -> a b d"
    assert sig_text(lambda x: F.softmax(x, -1), x3) == "a b ^c -> a b ^c"
    assert sig_text(lambda x: x.view(2, 4, 2, 3), x3) == "a b (c d) -> a b c d"
    assert sig_text(lambda x: x.reshape(8, 6), x3) == "a b c -> (a b) c"
    assert sig_text(lambda x: x.reshape(2, 6, 4), x3) == "a ^b ^c -> a ^d ^e"
    assert sig_text(lambda a, b: a + b, x3, torch.randn(4, 1)) == "a b c, b 1 -> a b c"
    assert sig_text(lambda x: x.sum(-1), x3) == "a b c -> a b"
    assert sig_text(lambda x, t: F.cross_entropy(x, t), torch.randn(4, 7),
                    torch.randint(0, 7, (4,))) == "a ^b, a -> ()"
    q = torch.randn(2, 3, 4, 5)
    assert sig_text(lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), q) == \
        "a b ^c ^e, a b ^d ^e, a b ^d f -> a b ^c f"


def test_a_cast_like_another_tensor_takes_that_tensors_leading_dims_as_its_own():
    """`x.type_as(other)` reads only other's dtype: other's leading dims of x's sizes share
    x's labels, so a batch split of both needs no gather (all `^` before, other was
    gathered whole, and a pipeline refused Gemma's RMSNorm, `out.type_as(x)`, for reading
    the whole batch); dims past the shared ones stay `^`."""
    x3 = torch.randn(2, 4, 6)
    assert sig_text(lambda x, o: x.type_as(o), x3, x3.double()) == "a b c, a b c -> a b c"
    assert sig_text(lambda m, o: m.type_as(o), torch.randn(2, 4), x3.double()) == \
        "a b, a b ^c -> a b"
    assert sig_text(lambda x, o: x.type_as(o), x3, torch.randn(3).double()) == \
        "a b c, ^d -> a b c"


def test_megatron_patterns_fall_out_of_the_linear_signature():
    """Splitting n shards the output (column parallel); splitting k makes it partial (row
    parallel). The signature says so without any Megatron-specific code."""
    op = pxform.trace(F.linear, torch.randn(4, 6), torch.randn(8, 6)).graph.ops[0]
    sig = rule_info(op).signature
    (b, k), (n, _) = [tuple(t[0] for t in ts) for ts in sig.inputs]
    assert sig.splittable() == {b, k, n}
    assert sig.contracted() == {k}
    assert sig.linear == (frozenset({0}), frozenset({1}))


def test_signature_parse_round_trip():
    sig = pxform.Signature.parse("b ^k, n ^k -> b n", b=2, k=3, n=4)
    assert str(sig) == "b ^k, n ^k -> b n"
    assert sig.output_shapes() == ((2, 4),)
    merged = pxform.Signature.parse("a (h e) -> a h e", a=2, h=3, e=4)
    assert merged.input_shapes() == ((2, 12),)
    assert merged.splittable() == {"a", "h"}  # e is a minor factor of a merged dim
