"""A nanoGPT-style GPT written as pure functions of a parameter pytree.

Used by the demo, the tests and the benchmarks. Sizes follow the GPT-3 paper (Brown et al.
2020, table 2.1); every model here ties the output head to the token embedding.

Run (traces the model on the `meta` device and prints its IR summary and op table):

    python examples/gpt.py --size 1.3B --batch 8
    python examples/gpt.py --size 175B --batch 1 --ir   # also print the IR of the first ops
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Model shape. Frozen, so it can be a static argument of a traced function."""

    vocab_size: int = 50304
    seq_len: int = 1024
    num_layers: int = 12
    num_heads: int = 12
    d_model: int = 768
    dropout: float = 0.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def num_params(self) -> int:
        d = self.d_model
        per_layer = 12 * d * d + 13 * d
        return self.vocab_size * d + self.seq_len * d + self.num_layers * per_layer + 2 * d


GPT_CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(vocab_size=96, seq_len=16, num_layers=2, num_heads=2, d_model=32),
    "small": GPTConfig(vocab_size=512, seq_len=64, num_layers=4, num_heads=4, d_model=128),
    "125M": GPTConfig(seq_len=2048, num_layers=12, num_heads=12, d_model=768),
    "350M": GPTConfig(seq_len=2048, num_layers=24, num_heads=16, d_model=1024),
    "760M": GPTConfig(seq_len=2048, num_layers=24, num_heads=16, d_model=1536),
    "1.3B": GPTConfig(seq_len=2048, num_layers=24, num_heads=32, d_model=2048),
    "2.7B": GPTConfig(seq_len=2048, num_layers=32, num_heads=32, d_model=2560),
    "6.7B": GPTConfig(seq_len=2048, num_layers=32, num_heads=32, d_model=4096),
    "13B": GPTConfig(seq_len=2048, num_layers=40, num_heads=40, d_model=5120),
    "175B": GPTConfig(seq_len=2048, num_layers=96, num_heads=96, d_model=12288),
}


def init_params(cfg: GPTConfig, *, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """Parameters as a pytree of tensors (GPT-2 initialisation). On `meta` nothing is
    allocated, so 175B fits on a laptop for tracing and planning."""
    gen = None if torch.device(device).type == "meta" else torch.Generator().manual_seed(seed)
    d = cfg.d_model
    std = 0.02
    proj_std = 0.02 / math.sqrt(2 * cfg.num_layers)

    def normal(*shape: int, s: float = std) -> torch.Tensor:
        if gen is None:
            return torch.empty(shape, device=device, dtype=dtype)
        return (torch.randn(shape, generator=gen) * s).to(device=device, dtype=dtype)

    def const(value: float, *shape: int) -> torch.Tensor:
        return torch.full(shape, value, device=device, dtype=dtype)

    blocks = []
    for _ in range(cfg.num_layers):
        blocks.append({
            "ln1_w": const(1.0, d), "ln1_b": const(0.0, d),
            "qkv_w": normal(3 * d, d), "qkv_b": const(0.0, 3 * d),
            "proj_w": normal(d, d, s=proj_std), "proj_b": const(0.0, d),
            "ln2_w": const(1.0, d), "ln2_b": const(0.0, d),
            "fc_w": normal(4 * d, d), "fc_b": const(0.0, 4 * d),
            "out_w": normal(d, 4 * d, s=proj_std), "out_b": const(0.0, d),
        })
    return {
        "wte": normal(cfg.vocab_size, d),
        "wpe": normal(cfg.seq_len, d, s=0.01),
        "blocks": blocks,
        "lnf_w": const(1.0, d), "lnf_b": const(0.0, d),
    }


def attention(p: dict, x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    """Causal multi-head self-attention."""
    b, t, d = x.shape
    qkv = F.linear(x, p["qkv_w"], p["qkv_b"])
    q, k, v = qkv.split(d, dim=-1)
    q = q.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    k = k.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    v = v.view(b, t, cfg.num_heads, cfg.head_dim).transpose(1, 2)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=cfg.dropout)
    y = y.transpose(1, 2).reshape(b, t, d)
    return F.dropout(F.linear(y, p["proj_w"], p["proj_b"]), cfg.dropout)


def mlp(p: dict, x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    h = F.gelu(F.linear(x, p["fc_w"], p["fc_b"]), approximate="tanh")
    return F.dropout(F.linear(h, p["out_w"], p["out_b"]), cfg.dropout)


def block(p: dict, x: torch.Tensor, cfg: GPTConfig) -> torch.Tensor:
    d = cfg.d_model
    x = x + attention(p, F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"]), cfg)
    return x + mlp(p, F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"]), cfg)


def gpt(params: dict, idx: torch.Tensor, cfg: GPTConfig, trunk: Any = None) -> torch.Tensor:
    """Token ids [batch, seq] -> logits [batch, seq, vocab]. `trunk(blocks, x)` runs the
    transformer blocks (default: each `block` in turn); pass one wrapped in a transform
    (`pxform.coshard`, `pxform.recompute`) to change how they run, not what they compute."""
    t = idx.shape[1]
    pos = torch.arange(t, device=idx.device)
    x = F.embedding(idx, params["wte"]) + F.embedding(pos, params["wpe"])
    x = F.dropout(x, cfg.dropout)
    if trunk is None:
        for p in params["blocks"]:
            x = block(p, x, cfg)
    else:
        x = trunk(params["blocks"], x)
    x = F.layer_norm(x, (cfg.d_model,), params["lnf_w"], params["lnf_b"])
    return F.linear(x, params["wte"])  # output head tied to the token embedding


def loss_fn(params: dict, batch: dict, cfg: GPTConfig, trunk: Any = None) -> torch.Tensor:
    """Mean next-token cross-entropy; targets equal to -100 are ignored. `trunk`: as for
    `gpt`."""
    logits = gpt(params, batch["idx"], cfg, trunk)
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)


class Block(torch.nn.Module):
    """One transformer block as an `nn.Module`: the parameters of an `init_params` block
    (same names), and `block` as its forward."""

    def __init__(self, cfg: GPTConfig, params: dict) -> None:
        super().__init__()
        self.cfg = cfg
        for name, t in params.items():
            self.register_parameter(name, torch.nn.Parameter(t))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return block(dict(self.named_parameters()), x, self.cfg)


class GPT(torch.nn.Module):
    """The GPT as an `nn.Module` (what a user's model looks like): an `init_params` pytree
    as parameters, blocks in a `ModuleList`; `forward(idx, targets)` is `loss_fn`'s loss.

    Example:
        >>> with torch.device("meta"):
        ...     model = GPT(GPT_CONFIGS["175B"], dtype=torch.bfloat16)
        >>> fn, params = pxform.module_fn(model)
    """

    def __init__(self, cfg: GPTConfig, *, dtype: torch.dtype = torch.float32,
                 seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        device = torch.empty(0).device  # the `torch.device` context, if any
        params = init_params(cfg, device=device, dtype=dtype, seed=seed)
        self.blocks = torch.nn.ModuleList(Block(cfg, p) for p in params.pop("blocks"))
        for name, t in params.items():
            self.register_parameter(name, torch.nn.Parameter(t))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        params = {name: t for name, t in self.named_parameters() if "." not in name}
        params["blocks"] = list(self.blocks)

        def trunk(blocks: list[Block], x: torch.Tensor) -> torch.Tensor:
            for b in blocks:
                x = b(x)
            return x

        return loss_fn(params, {"idx": idx, "targets": targets}, self.cfg, trunk)


def make_batch(cfg: GPTConfig, batch_size: int, *, device: str | torch.device = "cpu",
               seed: int = 0) -> dict:
    """Random token ids and next-token targets (`meta` gives shapes only)."""
    shape = (batch_size, cfg.seq_len)
    if torch.device(device).type == "meta":
        return {"idx": torch.empty(shape, dtype=torch.long, device="meta"),
                "targets": torch.empty(shape, dtype=torch.long, device="meta")}
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1), generator=gen)
    return {"idx": tokens[:, :-1].clone().to(device),
            "targets": tokens[:, 1:].clone().to(device)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="1.3B", choices=sorted(GPT_CONFIGS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--ir", action="store_true", help="print the first ops of the IR")
    args = parser.parse_args()
    cfg = GPT_CONFIGS[args.size]
    params = init_params(cfg, device="meta", dtype=torch.bfloat16)
    batch = make_batch(cfg, args.batch, device="meta")
    print(f"GPT {args.size}: {cfg}")
    print(f"{cfg.num_params() / 1e9:.2f} B parameters, batch {args.batch} x {cfg.seq_len} "
          f"tokens, bf16, on the meta device (nothing allocated)\n")
    report(loss_fn, params, batch, cfg, limit=36, ir=args.ir)


def report(fn, params: dict, batch: dict, cfg, *, limit: int, ir: bool) -> None:  # type: ignore[no-untyped-def]
    """Trace `fn(params, batch, cfg)` and print the time, summary and op tables (the
    examples' `main`s share it)."""
    import pxform

    start = time.perf_counter()
    traced = pxform.trace(fn, params, batch, cfg)
    elapsed = time.perf_counter() - start
    print(f"traced in {elapsed:.2f} s\n")
    print(traced.summary())
    print("\nops by aten target:")
    print(traced.op_table(by="target"))
    print("\nthe first ops (embeddings and the first layer), one row each:")
    print(traced.op_table(limit=limit))
    if ir:
        print("\nthe IR, first lines:")
        print("\n".join(str(traced).splitlines()[:40]))


if __name__ == "__main__":
    main()
