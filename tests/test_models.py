"""Whole models: the example GPT and small random-init HF models (GPT-2, BERT, Llama, ViT)
trace, pass `check`, and match eager in loss and every gradient; GPT-3 175B traces on meta;
the demo runs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import pxform
from pxform.ops import rule_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def compare(fn, params, *rest, rtol=1e-6, atol=1e-6):
    traced = pxform.trace(fn, params, *rest)
    pxform.check(traced.graph)
    assert not traced.fallbacks
    ref = fn(params, *rest)
    got = traced(params, *rest)
    torch.testing.assert_close(got, ref, rtol=rtol, atol=atol)
    names = [k for k, p in params.items() if p.requires_grad]
    leaves = [params[k] for k in names]
    g_ref = torch.autograd.grad(ref, leaves, allow_unused=True)
    g_got = torch.autograd.grad(got, leaves, allow_unused=True)
    for name, a, b in zip(names, g_got, g_ref):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=name)
    return traced


def test_example_gpt_matches_eager():
    import gpt

    cfg = gpt.GPT_CONFIGS["tiny"]
    params = gpt.init_params(cfg, dtype=torch.float64)
    flat = {f"p{i}": t.requires_grad_() for i, t in enumerate(_leaves(params))}

    def loss(flat, batch):
        return gpt.loss_fn(_rebuild(params, list(flat.values())), batch, cfg)

    batch = gpt.make_batch(cfg, 3)
    batch["targets"][0, :4] = -100  # ignored targets
    traced = compare(loss, flat, batch)
    names = {op.name for op in traced.graph.ops}
    assert {"linear", "layer_norm", "scaled_dot_product_attention", "cross_entropy_loss",
            "embedding"} <= names


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree)


def _rebuild(tree, leaves):
    import optree

    return optree.tree_unflatten(optree.tree_structure(tree), leaves)


def _hf_model(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    small = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128,
                 num_hidden_layers=2)
    ids = torch.randint(0, 128, (2, 16))
    if name == "gpt2":
        cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128,
                                      n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
        inputs = {"input_ids": ids, "labels": ids}
    elif name == "bert":
        cfg = transformers.BertConfig(vocab_size=128, max_position_embeddings=64, **small)
        model = transformers.BertForMaskedLM(cfg)
        labels = ids.clone()
        labels[:, ::3] = -100
        inputs = {"input_ids": ids, "labels": labels,
                  "attention_mask": torch.ones(2, 16, dtype=torch.long).tril(8)[:, :16]}
    elif name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=128, max_position_embeddings=64,
                                       num_key_value_heads=2, **small)
        model = transformers.LlamaForCausalLM(cfg)
        inputs = {"input_ids": ids, "labels": ids}
    else:
        cfg = transformers.ViTConfig(image_size=32, patch_size=8, num_labels=10, **small)
        model = transformers.ViTForImageClassification(cfg)
        inputs = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.randint(0, 10, (2,))}
    return model.eval(), inputs


@pytest.mark.parametrize("name", ["gpt2", "bert", "llama", "vit"])
def test_hf_model_matches_eager(name):
    model, inputs = _hf_model(name)
    fn, params = pxform.module_fn(model)

    def loss(params, inputs):
        return fn(params, **inputs).loss

    traced = compare(loss, params, inputs, rtol=1e-5, atol=1e-5)
    # module paths are recorded: ops are grouped by the module that issued them
    assert any(op.module.endswith(("attn", "attention", "self_attn", "self")) or
               ".attention" in op.module for op in traced.graph.ops)
    assert all(op.source for op in traced.graph.ops if op.name == "linear")


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hf_model_traces_on_meta(name):
    model, inputs = _hf_model(name)
    meta_model = model.to("meta")
    fn, params = pxform.module_fn(meta_model)
    traced = pxform.trace(lambda p, i: fn(p, **i).loss, params, inputs)
    assert traced.graph.outputs[0].type.shape == ()


def test_gpt3_175b_traces_on_meta():
    import gpt

    cfg = gpt.GPT_CONFIGS["175B"]
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.seq_len) == (96, 12288, 96, 2048)
    params = gpt.init_params(cfg, device="meta", dtype=torch.bfloat16)
    batch = gpt.make_batch(cfg, 1, device="meta")
    traced = pxform.trace(gpt.loss_fn, params, batch, cfg)
    n_params = sum(v.type.numel for v in traced.graph.inputs if v.type.dtype == torch.bfloat16)
    assert n_params == cfg.num_params()
    assert 174e9 < n_params < 176e9
    linears = [op for op in traced.graph.ops if op.name == "linear"]
    assert len(linears) == 4 * 96 + 1
    # forward FLOPs of the dense layers: 2 * tokens * (params in matmuls)
    tokens = cfg.seq_len
    matmul_params = 96 * 12 * cfg.d_model ** 2 + cfg.vocab_size * cfg.d_model
    dense = sum(rule_info(op).flops for op in linears)
    bias_flops = tokens * 96 * (3 + 1 + 4 + 1) * cfg.d_model
    assert dense == 2 * tokens * matmul_params + bias_flops


def test_demo_runs():
    env = dict(os.environ, PYTHONPATH=ROOT)
    result = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "gpt.py"),
                             "--size", "125M", "--batch", "2"], capture_output=True, text=True,
                            env=env, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "loss_fn: 150 tensor inputs" in out  # 12 x 12 per block + 4 + idx, targets
    assert "aten.linear.default" in out and "scaled_dot_product_attention" in out
    assert "total: " in out
