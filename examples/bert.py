"""A BERT-style encoder (masked language model) written as pure functions of a parameter pytree.

Same style as `gpt.py`: `init_params` builds a pytree of tensors, `bert` maps a batch to
logits, `loss_fn` is the masked-LM loss, `make_batch` makes a random batch. Sizes follow
Devlin et al. 2019 (BERT-base: 12 layers, 12 heads, hidden 768; BERT-large: 24 layers,
16 heads, hidden 1024; both 512 positions). Differences from the original: the model is the
encoder plus the masked-LM head only (no pooler and no next-sentence head, as in RoBERTa),
and the vocabulary is padded from 30522 to 30528 (see `BertConfig`).

BERT is post-LN: every sub-layer is `x = LN(x + sublayer(x))`, and the embeddings are
normalised too. Attention is bidirectional, with a padding mask from `attention_mask`.

Run (traces the model on the `meta` device and prints its IR summary and op table):

    python examples/bert.py --size large --batch 32
    python examples/bert.py --size base --batch 8 --ir   # also print the IR of the first ops
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # imported as examples.bert (the planner's factories) or run from examples/
    from . import gpt as _gpt
except ImportError:
    import gpt as _gpt  # type: ignore[no-redef]

PAD_ID = 0
"""Token id of padding (`attention_mask` 0); `make_batch` puts it at padded positions."""
MASK_ID = 3
"""Token id of `[MASK]`; `make_batch` puts it at most positions that carry a label."""


@dataclass(frozen=True)
class BertConfig:
    """Model shape. Frozen, so it can be a static argument of a traced function.

    `vocab_size` defaults to BERT's 30522 WordPiece tokens padded up to 30528, a multiple of
    64: the embedding and output-projection matmuls then tile evenly on GPUs (tensor cores
    want multiples of 8/64), and the vocabulary dim splits evenly across up to 64 tensor-
    parallel ranks. The padding tokens are never produced by the tokenizer.
    """

    vocab_size: int = 30528
    seq_len: int = 512
    num_layers: int = 12
    num_heads: int = 12
    d_model: int = 768
    type_vocab_size: int = 2
    dropout: float = 0.0
    layer_norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def d_ff(self) -> int:
        """Width of the MLP's hidden layer (BERT's intermediate size): 4 x d_model."""
        return 4 * self.d_model

    def num_params(self) -> int:
        """Parameter count of `init_params(self)` (the output projection is tied, so the
        token embedding is counted once)."""
        d, f = self.d_model, self.d_ff
        embed = (self.vocab_size + self.seq_len + self.type_vocab_size) * d + 2 * d
        per_layer = (3 * d * d + 3 * d) + (d * d + d) + 2 * d + (f * d + f) + (d * f + d) + 2 * d
        head = (d * d + d) + 2 * d + self.vocab_size
        return embed + self.num_layers * per_layer + head


BERT_CONFIGS: dict[str, BertConfig] = {
    "tiny": BertConfig(vocab_size=96, seq_len=16, num_layers=2, num_heads=2, d_model=32),
    "small": BertConfig(vocab_size=512, seq_len=64, num_layers=4, num_heads=4, d_model=128),
    "base": BertConfig(num_layers=12, num_heads=12, d_model=768),
    "large": BertConfig(num_layers=24, num_heads=16, d_model=1024),
}


def init_params(cfg: BertConfig, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Parameters as a pytree of tensors (BERT initialisation: normal(0, 0.02) weights, zero
    biases, unit layer norms). On `meta` nothing is allocated (shapes only)."""
    gen = None if torch.device(device).type == "meta" else torch.Generator().manual_seed(seed)
    d, f = cfg.d_model, cfg.d_ff
    std = 0.02

    def normal(*shape: int, s: float = std) -> torch.Tensor:
        if gen is None:
            return torch.empty(shape, device=device, dtype=dtype)
        return (torch.randn(shape, generator=gen) * s).to(device=device, dtype=dtype)

    def const(value: float, *shape: int) -> torch.Tensor:
        return torch.full(shape, value, device=device, dtype=dtype)

    layers = []
    for _ in range(cfg.num_layers):
        layers.append({
            "qkv_w": normal(3 * d, d), "qkv_b": const(0.0, 3 * d),
            "proj_w": normal(d, d), "proj_b": const(0.0, d),
            "ln1_w": const(1.0, d), "ln1_b": const(0.0, d),
            "fc_w": normal(f, d), "fc_b": const(0.0, f),
            "out_w": normal(d, f), "out_b": const(0.0, d),
            "ln2_w": const(1.0, d), "ln2_b": const(0.0, d),
        })
    return {
        "wte": normal(cfg.vocab_size, d),       # token embedding, tied to the MLM output
        "wpe": normal(cfg.seq_len, d),          # learned positions
        "wtt": normal(cfg.type_vocab_size, d),  # token types (segment A / B)
        "ln_emb_w": const(1.0, d), "ln_emb_b": const(0.0, d),
        "layers": layers,
        "mlm": {
            "dense_w": normal(d, d), "dense_b": const(0.0, d),
            "ln_w": const(1.0, d), "ln_b": const(0.0, d),
            "out_b": const(0.0, cfg.vocab_size),
        },
    }


def _ln(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, cfg: BertConfig) -> torch.Tensor:
    return F.layer_norm(x, (cfg.d_model,), w, b, cfg.layer_norm_eps)


def attention(p: dict, x: torch.Tensor, mask: torch.Tensor, cfg: BertConfig) -> torch.Tensor:
    """Bidirectional multi-head self-attention; `mask` [b, 1, 1, s] is True where a key
    may be attended to (not padding)."""
    b, t, d = x.shape
    qkv = F.linear(x, p["qkv_w"], p["qkv_b"])
    q, k, v = qkv.split(d, dim=-1)
    q = q.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k = k.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    v = v.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=cfg.dropout)
    y = y.transpose(1, 2).reshape(b, t, d)
    return F.dropout(F.linear(y, p["proj_w"], p["proj_b"]), cfg.dropout)


def mlp(p: dict, x: torch.Tensor, cfg: BertConfig) -> torch.Tensor:
    h = F.gelu(F.linear(x, p["fc_w"], p["fc_b"]))  # exact (erf) GELU, as in BERT
    return F.dropout(F.linear(h, p["out_w"], p["out_b"]), cfg.dropout)


def layer(p: dict, x: torch.Tensor, mask: torch.Tensor, cfg: BertConfig) -> torch.Tensor:
    """One post-LN encoder layer."""
    x = _ln(x + attention(p, x, mask, cfg), p["ln1_w"], p["ln1_b"], cfg)
    return _ln(x + mlp(p, x, cfg), p["ln2_w"], p["ln2_b"], cfg)


def bert(params: dict, batch: dict, cfg: BertConfig) -> torch.Tensor:
    """A batch (`input_ids`, `token_type_ids`, `attention_mask`, each [batch, seq]) ->
    masked-LM logits [batch, seq, vocab]."""
    ids = batch["input_ids"]
    b, t = ids.shape
    # True where the key is a real token; [b, 1, 1, s] broadcasts over heads and queries.
    mask = (batch["attention_mask"] != 0).view(b, 1, 1, t)
    pos = torch.arange(t, device=ids.device)
    x = (F.embedding(ids, params["wte"]) + F.embedding(pos, params["wpe"])
         + F.embedding(batch["token_type_ids"], params["wtt"]))
    x = F.dropout(_ln(x, params["ln_emb_w"], params["ln_emb_b"], cfg), cfg.dropout)
    for p in params["layers"]:
        x = layer(p, x, mask, cfg)
    h = params["mlm"]
    x = F.gelu(F.linear(x, h["dense_w"], h["dense_b"]))
    x = _ln(x, h["ln_w"], h["ln_b"], cfg)
    return F.linear(x, params["wte"], h["out_b"])  # output projection tied to the embedding


def loss_fn(params: dict, batch: dict, cfg: BertConfig) -> torch.Tensor:
    """Mean masked-LM cross-entropy over the positions whose label is not -100."""
    logits = bert(params, batch, cfg)
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def make_batch(cfg: BertConfig, batch_size: int, *, device: str | torch.device = "cpu",
               seed: int = 0) -> dict:
    """A random masked-LM batch of int64 tensors [batch_size, cfg.seq_len] (`meta` gives
    shapes only):

    - `attention_mask`: 1 for real tokens, 0 for padding; row i ends with
      (i % 4) * seq_len // 8 padded positions, so some rows exercise the mask.
    - `labels`: -100 except at ~15% of the real positions (at least one per row), where
      it is the original token.
    - `input_ids`: random tokens; `MASK_ID` at 80% of the labelled positions, a random
      token at 10%, unchanged at 10% (BERT's recipe); `PAD_ID` at padded positions.
    - `token_type_ids`: zeros (a single segment).
    """
    shape = (batch_size, cfg.seq_len)
    keys = ("input_ids", "token_type_ids", "attention_mask", "labels")
    if torch.device(device).type == "meta":
        return {k: torch.empty(shape, dtype=torch.long, device="meta") for k in keys}
    gen = torch.Generator().manual_seed(seed)
    t = cfg.seq_len
    first = min(4, cfg.vocab_size - 1)  # ids below 4 stand for special tokens
    tokens = torch.randint(first, cfg.vocab_size, shape, generator=gen)
    pad = torch.tensor([(i % 4) * t // 8 for i in range(batch_size)])
    attention_mask = (torch.arange(t)[None, :] < (t - pad)[:, None]).long()
    real = attention_mask.bool()
    chosen = (torch.rand(shape, generator=gen) < 0.15) & real
    chosen[:, 0] |= ~chosen.any(dim=1)  # at least one label per row (position 0 is real)
    labels = torch.where(chosen, tokens, torch.full_like(tokens, -100))
    roll = torch.rand(shape, generator=gen)
    random_tokens = torch.randint(first, cfg.vocab_size, shape, generator=gen)
    input_ids = torch.where(chosen & (roll < 0.8), torch.full_like(tokens, MASK_ID), tokens)
    input_ids = torch.where(chosen & (roll >= 0.8) & (roll < 0.9), random_tokens, input_ids)
    input_ids = torch.where(real, input_ids, torch.full_like(tokens, PAD_ID))
    out = {"input_ids": input_ids, "token_type_ids": torch.zeros(shape, dtype=torch.long),
           "attention_mask": attention_mask, "labels": labels}
    return {k: out[k].to(device) for k in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="large", choices=sorted(BERT_CONFIGS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ir", action="store_true", help="print the first ops of the IR")
    args = parser.parse_args()
    cfg = BERT_CONFIGS[args.size]
    params = init_params(cfg, device="meta", dtype=torch.bfloat16)
    batch = make_batch(cfg, args.batch, device="meta")
    print(f"BERT {args.size}: {cfg}")
    print(f"{cfg.num_params() / 1e6:.1f} M parameters, batch {args.batch} x {cfg.seq_len} "
          f"tokens, bf16, on the meta device (nothing allocated)\n")
    _gpt.report(loss_fn, params, batch, cfg, limit=40, ir=args.ir)


if __name__ == "__main__":
    main()
