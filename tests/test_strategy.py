"""Op strategies from dim signatures, checked end to end on a simulated mesh: every op of a
traced function runs on local shards under a randomly chosen strategy, inputs are converted
between layouts by the re-layout planner's steps, and the final outputs equal the
single-process result. Forward values only; gradients come with the runtime (SPMD issue)."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from simworld import apply, coords, distribute

import pxform
from pxform.core.ir import DEVICE, Value, map_values
from pxform.core.layout import Layout, plan_relayout
from pxform.core.mesh import AbstractMesh
from pxform.ops.local import local_call
from pxform.ops.strategy import strategies

MESHES = [AbstractMesh({"x": 2}), AbstractMesh({"x": 4}), AbstractMesh({"x": 2, "y": 2}),
          AbstractMesh({"x": 2, "y": 1, "z": 2})]


def test_linear_strategies_are_megatron_and_dp():
    op = pxform.trace(F.linear, torch.randn(4, 6), torch.randn(8, 6), torch.randn(8)).graph.ops[0]
    found = {str(s): (s.inputs, s.outputs) for s in strategies(op, AbstractMesh({"tp": 2}))}
    rep = Layout.replicated
    # column parallel: weight and bias split on the output features
    assert found["tp: split c"] == ((rep(2), Layout((("tp",), ()), frozenset()),
                                     Layout((("tp",),))), (Layout(((), ("tp",))),))
    # row parallel: input and weight split on the contracted dim; the bias is added once
    # (partial) and the output is a partial sum
    assert found["tp: split b"] == ((Layout(((), ("tp",))), Layout(((), ("tp",))),
                                     Layout(((),), frozenset({"tp"}))),
                                    (Layout(((), ()), frozenset({"tp"})),))
    # data parallel: batch split, parameters replicated
    assert found["tp: split a"][1] == (Layout((("tp",), ())),)


def test_strategies_respect_divisibility_and_fixed_dims():
    op = pxform.trace(lambda x: F.softmax(x, -1), torch.randn(3, 8)).graph.ops[0]
    names = [str(s) for s in strategies(op, AbstractMesh({"tp": 2}))]
    assert names == ["tp: replicate"]  # dim 0 (3) does not divide by 2; dim 1 is ^
    names = [str(s) for s in strategies(op, AbstractMesh({"tp": 3}))]
    assert names == ["tp: replicate", "tp: split a"]


# ---------------------------------------------------------------- simulated execution

def run_sharded(traced, args, mesh, draw):
    """Run `traced` op by op on a simulated mesh with strategies chosen by `draw`."""
    import optree

    gen = torch.Generator().manual_seed(0)
    leaves = [x for x in optree.tree_leaves((args, {})) if isinstance(x, torch.Tensor)]
    env: dict[str, tuple[Layout, dict]] = {}
    for v, t in zip(traced.graph.inputs, leaves):
        options = [s.inputs[0] for s in strategies(_identity_sig(v), mesh)]
        if not t.dtype.is_floating_point:
            options = [lay for lay in options if not lay.partial]
        layout = draw(st.sampled_from(options))
        env[v.name] = (layout, distribute(t.detach(), layout, mesh, gen))
    for c in traced.graph.constants:
        lay = Layout.replicated(c.value.type.rank)
        env[c.value.name] = (lay, {r: c.data for r in coords(mesh)})
    for op in traced.graph.ops:
        choices = strategies(op, mesh)
        strategy = draw(st.sampled_from(choices))
        # convert each input to the layout the strategy needs
        locals_in = []
        for v, need in zip(op.inputs, strategy.inputs):
            have, local = env[v.name]
            plan = plan_relayout(v.type.shape, v.type.dtype.itemsize, have, need, mesh)
            for step in plan.steps:
                local = apply(step, local, mesh)
            locals_in.append(local)
        results = execute_locally(op, strategy, locals_in, mesh)
        for k, (v, lay) in enumerate(zip(op.outputs, strategy.outputs)):
            env[v.name] = (lay, {r: results[r][k] for r in results})
    outs = []
    for o in traced.graph.outputs:
        if not isinstance(o, Value):
            outs.append(o)
            continue
        have, local = env[o.name]
        plan = plan_relayout(o.type.shape, 8, have, Layout.replicated(o.type.rank), mesh)
        for step in plan.steps:
            local = apply(step, local, mesh)
        outs.append(local)
    return outs


def execute_locally(op, strategy, locals_in, mesh):
    """Run `op` on every simulated rank's local inputs as `local_call` says: rewritten
    arguments, then the scale, then division by an all-reduced count."""
    call = local_call(op, strategy.inputs, strategy.outputs, mesh)
    by_name = {v.name: i for i, v in enumerate(op.inputs)}
    results = {}
    for r in coords(mesh):
        def resolve(a, r=r):
            a = map_values(a, lambda v, r=r: locals_in[by_name[v.name]][r])
            return torch.device("cpu") if a is DEVICE else a

        out = call.target(*[resolve(a) for a in call.args],
                          **{k: resolve(a) for k, a in call.kwargs})
        outs = [o for o in (out if isinstance(out, (list, tuple)) else [out])
                if isinstance(o, torch.Tensor)]
        results[r] = [o * call.scale if call.scale != 1.0 else o for o in outs]
    if call.count is not None:
        _divide_by_global_count(op, call.count, locals_in, results, mesh)
    return results


def _identity_sig(v):
    labels = [chr(97 + i) for i in range(v.type.rank)]
    return pxform.Signature.make([[(lb,) for lb in labels]], [[(lb,) for lb in labels]],
                                 dict(zip(labels, v.type.shape)), linear=[{0}])


def _divide_by_global_count(op, count, locals_in, results, mesh):
    from pxform.ops import bind

    target_index = [i for i, v in enumerate(op.inputs) if v is bind(op)["target"]][0]
    weight = bind(op).get("weight")
    local_counts = {}
    for r in results:
        t = locals_in[target_index][r]
        keep = t != count.ignore_index
        if count.weighted:
            w = locals_in[[i for i, v in enumerate(op.inputs) if v is weight][0]][r]
            local_counts[r] = (w[t.clamp(min=0)] * keep).sum()
        else:
            local_counts[r] = keep.sum().to(results[r][0].dtype)
    ks = [mesh.names.index(a) for a in count.axes]
    for r in results:
        group = [g for g in results if all(g[i] == r[i] for i in range(len(r)) if i not in ks)]
        total = sum(local_counts[g] for g in group)
        results[r] = [o / total for o in results[r]]


def check_matches(fn, args, mesh, data, atol=1e-9):
    traced = pxform.trace(fn, *args)
    ref = fn(*args)
    ref = ref if isinstance(ref, tuple) else (ref,)
    outs = run_sharded(traced, args, mesh, data.draw)
    for expected, per_rank in zip(ref, outs):
        for r, got in per_rank.items():
            torch.testing.assert_close(got, expected, atol=atol, rtol=1e-7,
                                       msg=lambda m, r=r: f"rank {r}: {m}")


def f64(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def mlp(w1, b1, w2, x, y):
    h = F.gelu(F.linear(x, w1, b1))
    return ((h @ w2 - y) ** 2).mean(), h.sum(0)


def attention_block(ln_w, qkv_w, proj_w, x):
    b, t, d = x.shape
    h = F.layer_norm(x, (d,), ln_w)
    q, k, v = F.linear(h, qkv_w).split(d, dim=-1)
    q, k, v = (z.view(b, t, 2, d // 2).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return x + F.linear(y.transpose(1, 2).reshape(b, t, d), proj_w)


def classifier(emb, w, idx, targets, class_w):
    logits = F.embedding(idx, emb) @ w
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    weighted = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), weight=class_w)
    return loss, weighted, F.softmax(logits, -1).amax(-1)


def views_and_reductions(x, y):
    a = x.permute(2, 0, 1).reshape(4, -1).unsqueeze(0).expand(2, 4, 8)
    b = torch.cat([a, a * 2], dim=1).sum(0)
    c = x.mean(dim=(0, 2), keepdim=True) * y.var(-1, keepdim=True).unsqueeze(0)
    return b.mean(-1), c, torch.zeros(4, 2, dtype=x.dtype) + x[0], F.mse_loss(x[1], y[:, :2])


def conv_net(w, b, x):
    return F.relu(F.conv2d(x, w, b, padding=1)).flatten(1).sum(-1)


CASES = {
    "mlp": lambda: (mlp, (f64(8, 4, seed=1).requires_grad_(), f64(8, seed=2), f64(8, 4, seed=3),
                          f64(4, 4, seed=4), f64(4, 4, seed=5))),
    "attention": lambda: (attention_block, (f64(8, seed=1) + 1, f64(24, 8, seed=2),
                                            f64(8, 8, seed=3), f64(2, 4, 8, seed=4))),
    "classifier": lambda: (classifier, (
        f64(8, 4, seed=1), f64(4, 8, seed=2), torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]),
        torch.tensor([[1, -100, 3, 0], [7, 2, -100, -100]]), f64(8, seed=3).abs() + 0.5)),
    "views": lambda: (views_and_reductions, (f64(4, 4, 2, seed=1), f64(4, 8, seed=2))),
    "conv": lambda: (conv_net, (f64(4, 2, 3, 3, seed=1), f64(4, seed=2), f64(2, 2, 4, 4, seed=3))),
}


@settings(max_examples=40)
@given(st.data(), st.sampled_from(sorted(CASES)), st.sampled_from(MESHES))
def test_random_strategies_match_the_single_process_result(data, case, mesh):
    fn, args = CASES[case]()
    check_matches(fn, args, mesh, data)


@settings(max_examples=6)
@given(st.data(), st.sampled_from(MESHES))
def test_example_gpt_forward_under_random_strategies(data, mesh):
    sys.path.insert(0, "examples")
    import gpt

    cfg = gpt.GPTConfig(vocab_size=16, seq_len=4, num_layers=1, num_heads=2, d_model=8)
    params = gpt.init_params(cfg, dtype=torch.float64)
    batch = gpt.make_batch(cfg, 4)
    batch["targets"][0, 0] = -100
    check_matches(lambda p, b: gpt.loss_fn(p, b, cfg), (params, batch), mesh, data)


# ---------------------------------------------------------------- exhaustive, op by op

def every_strategy_of_every_op(fn, args, mesh):
    """For each op, feed it its true inputs laid out per each of its strategies, run it on
    local shards, and check the outputs are exactly its true outputs in the claimed layout."""
    import optree
    from simworld import assemble_check

    from pxform.frontend.trace import run_graph

    traced = pxform.trace(fn, *args)
    leaves = [x for x in optree.tree_leaves((args, {})) if isinstance(x, torch.Tensor)]
    values = {v.name: t.detach() for v, t in zip(traced.graph.inputs, leaves)}
    values.update({c.value.name: c.data for c in traced.graph.constants})

    def record(op, _args, results):
        values.update({v.name: r.detach() for v, r in zip(op.outputs, results)})

    run_graph(traced.graph, leaves, on_op=record)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for op in traced.graph.ops:
        for strategy in strategies(op, mesh):
            if any(lay.partial and not values[v.name].dtype.is_floating_point
                   for v, lay in zip(op.inputs, strategy.inputs)):
                continue  # partial sums of integers never arise: no float op makes them
            locals_in = [distribute(values[v.name], lay, mesh, gen)
                         for v, lay in zip(op.inputs, strategy.inputs)]
            results = execute_locally(op, strategy, locals_in, mesh)
            for k, (v, lay) in enumerate(zip(op.outputs, strategy.outputs)):
                try:
                    assemble_check(values[v.name], {r: results[r][k] for r in results}, lay,
                                   mesh)
                except AssertionError as exc:
                    raise AssertionError(f"{op} under [{strategy}]: {exc}") from None
            checked += 1
    return checked


def _gpt_case():
    sys.path.insert(0, "examples")
    import gpt

    cfg = gpt.GPTConfig(vocab_size=16, seq_len=4, num_layers=1, num_heads=2, d_model=8)
    params = gpt.init_params(cfg, dtype=torch.float64)
    batch = gpt.make_batch(cfg, 4)
    batch["targets"][0, 0] = -100
    return (lambda p, b: gpt.loss_fn(p, b, cfg)), (params, batch)


def test_every_strategy_of_every_op_is_correct():
    cases = {name: make() for name, make in CASES.items()}
    cases["gpt"] = _gpt_case()
    total = 0
    for fn, args in cases.values():
        for mesh in MESHES:
            total += every_strategy_of_every_op(fn, args, mesh)
    assert total > 10000  # op x strategy pairs checked (11,980 today): guards against none
