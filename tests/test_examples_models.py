"""The example BERT and the model factories: tiny BERT traced == eager (loss and gradients),
BERT-large traces on meta with the right parameter count and one block per layer, and every
factory returns `(fn, args)` on the documented device and dtype."""

from __future__ import annotations

import bert
import factories
import optree
import pytest
import torch

import pxform
from pxform.passes.cuts import graph_blocks

BATCH_KEYS = {"input_ids", "token_type_ids", "attention_mask", "labels"}


def test_tiny_bert_matches_eager_loss_and_gradients():
    fn, (params, batch, cfg) = factories.bert_tiny(batch=4)
    assert fn is bert.loss_fn
    assert (batch["attention_mask"] == 0).any() and (batch["labels"] != -100).any()
    leaves = [p.requires_grad_() for p in optree.tree_leaves(params)]
    traced = pxform.trace(fn, params, batch, cfg)
    pxform.check(traced.graph)
    assert not traced.fallbacks
    names = {op.name for op in traced.graph.ops}
    assert {"scaled_dot_product_attention", "layer_norm", "gelu", "embedding",
            "cross_entropy_loss"} <= names
    ref = fn(params, batch, cfg)
    got = traced(params, batch, cfg)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    g_ref = torch.autograd.grad(ref, leaves)
    g_got = torch.autograd.grad(got, leaves)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    labels = [b.label for b in graph_blocks(traced.graph, BATCH_KEYS)]
    assert labels == ["embed", "layer 0", "layer 1", "head"]


def test_bert_padding_mask_hides_the_padded_keys():
    # a padded row's logits at its real positions equal those of the row cut to its real
    # tokens (positions are absolute, so the prefix keeps its position embeddings)
    _, (params, batch, cfg) = factories.bert_tiny(batch=4)
    logits = bert.bert(params, batch, cfg)
    for row in range(4):
        n = int(batch["attention_mask"][row].sum())
        cut = {k: v[row:row + 1, :n] for k, v in batch.items()}
        torch.testing.assert_close(logits[row:row + 1, :n], bert.bert(params, cut, cfg),
                                   rtol=1e-5, atol=1e-5)
    unmasked = dict(batch, attention_mask=torch.ones_like(batch["attention_mask"]))
    assert not torch.allclose(logits[3], bert.bert(params, unmasked, cfg)[3], atol=1e-5)


def test_bert_large_traces_on_meta_with_one_block_per_layer():
    fn, (params, batch, cfg) = factories.bert_large(batch=8, seq=512)
    assert cfg == bert.BERT_CONFIGS["large"]
    assert sum(p.numel() for p in optree.tree_leaves(params)) == cfg.num_params()
    assert 330e6 < cfg.num_params() < 340e6  # BERT-large: "340M" with the pooler/NSP head
    traced = pxform.trace(fn, params, batch, cfg)
    labels = [b.label for b in graph_blocks(traced.graph, set(batch))]
    assert labels == ["embed", *[f"layer {k}" for k in range(24)], "head"]


@pytest.mark.parametrize("name, kind, batch, seq, device, dtype", [
    ("gpt_tiny", "gpt", 8, 16, "cpu", torch.float32),
    ("gpt_small", "gpt", 8, 64, "cpu", torch.float32),
    ("bert_tiny", "bert", 8, 16, "cpu", torch.float32),
    ("bert_large", "bert", 128, 512, "meta", torch.bfloat16),
    ("gpt_6_7b", "gpt", 64, 2048, "meta", torch.bfloat16),
    ("gpt3_175b", "gpt", 1536, 2048, "meta", torch.bfloat16),
])
def test_factories_return_fn_and_args_on_the_documented_device(name, kind, batch, seq,
                                                                device, dtype):
    factory = getattr(factories, name)
    module = {"gpt": factories._gpt, "bert": factories._bert}[kind]
    assert factory.__doc__ and "Example" in factory.__doc__
    # the defaults, then batch and seq as the CLI passes them
    for (fn, args), b, s in [(factory(), batch, seq),
                             (factory(batch=2, seq=seq // 2), 2, seq // 2)]:
        assert fn is module.loss_fn
        params, data, cfg = args
        assert cfg.seq_len == s
        leaves = optree.tree_leaves(params)
        assert sum(p.numel() for p in leaves) == cfg.num_params()
        assert all(p.device.type == device and p.dtype == dtype for p in leaves)
        for t in data.values():
            assert t.device.type == device and t.dtype == torch.long and t.shape == (b, s)
        if device == "cpu":
            loss = fn(*args)
            assert loss.shape == () and torch.isfinite(loss)


def test_general_factories_and_seq_override():
    fn, (params, batch, cfg) = factories.gpt("1.3B", batch=2, seq=128)
    assert params["wpe"].shape == (128, 2048) and params["wte"].device.type == "meta"
    assert batch["idx"].shape == (2, 128)
    _, (params, batch, cfg) = factories.bert("small", batch=3)
    assert cfg.seq_len == 64 and params["wte"].dtype == torch.float32
    assert batch["input_ids"].device.type == "cpu"
    with pytest.raises(ValueError, match="unknown size"):
        factories.bert("huge")
