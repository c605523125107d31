"""Model factories for the planner CLI and the benchmarks.

A factory takes `batch` and `seq` keywords and returns `(fn, args)`: a pure function and the
example arguments to trace it with, `fn(*args)` being the scalar training loss. `args` is
`(params, batch, cfg)`: the parameter pytree, the batch dict and the model config (a frozen
dataclass, a static argument of `pxform.trace`). `seq` replaces the config's `seq_len` (so
the learned position table follows it).

- `gpt_tiny`, `gpt_small`, `bert_tiny`: float32 on "cpu" with real random values, small
  enough to run.
- `bert_large`, `gpt_6_7b`, `gpt3_175b`: bfloat16 parameters on the `meta` device (shapes
  only, nothing allocated), for tracing and planning.
- `gpt(size, ...)`, `bert(size, ...)`: any size of `gpt.GPT_CONFIGS` / `bert.BERT_CONFIGS`.

Import it as `examples.factories` (the repository root on `sys.path`) or as `factories`
(the `examples` folder on `sys.path`):

    pxform plan examples.factories:bert_large --batch 128 --seq 512

    >>> from examples.factories import gpt_tiny
    >>> fn, args = gpt_tiny(batch=8, seq=16)
    >>> loss = fn(*args)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

# Imported as `examples.factories`, take the models from the same package (so their config
# classes are `examples.gpt.GPTConfig` ...); imported as top-level `factories`, from the
# examples folder, which is then on sys.path.
if __package__:
    from . import bert as _bert
    from . import gpt as _gpt
else:
    import bert as _bert  # type: ignore[no-redef]
    import gpt as _gpt  # type: ignore[no-redef]

Factory = tuple[Callable[..., torch.Tensor], tuple[Any, ...]]

_SMALL = ("tiny", "small")  # sizes built on "cpu" in float32 with real values by default


def _placement(size: str, device: str | torch.device | None,
               dtype: torch.dtype | None) -> tuple[str | torch.device, torch.dtype]:
    if device is None:
        device = "cpu" if size in _SMALL else "meta"
    if dtype is None:
        dtype = torch.float32 if size in _SMALL else torch.bfloat16
    return device, dtype


def _lookup(configs: dict, size: str, kind: str):
    if size not in configs:
        raise ValueError(f"{kind}: unknown size {size!r}; choose one of {sorted(configs)}")
    return configs[size]


def gpt(size: str, batch: int = 8, seq: int | None = None, *,
        device: str | torch.device | None = None, dtype: torch.dtype | None = None,
        seed: int = 0) -> Factory:
    """The example GPT of `size` (a key of `gpt.GPT_CONFIGS`): `(gpt.loss_fn, (params,
    batch, cfg))`. `seq` (default: the config's) replaces `cfg.seq_len`. By default "tiny"
    and "small" are float32 on "cpu" with random values, other sizes bfloat16 on `meta`.

    Example:
        >>> fn, (params, batch, cfg) = gpt("1.3B", batch=8, seq=1024)
        >>> batch["idx"].shape, params["wte"].device
        (torch.Size([8, 1024]), device(type='meta'))
    """
    cfg = _lookup(_gpt.GPT_CONFIGS, size, "gpt")
    if seq is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq)
    device, dtype = _placement(size, device, dtype)
    params = _gpt.init_params(cfg, device=device, dtype=dtype, seed=seed)
    data = _gpt.make_batch(cfg, batch, device=device, seed=seed)
    return _gpt.loss_fn, (params, data, cfg)


def bert(size: str, batch: int = 8, seq: int | None = None, *,
         device: str | torch.device | None = None, dtype: torch.dtype | None = None,
         seed: int = 0) -> Factory:
    """The example BERT (masked LM) of `size` (a key of `bert.BERT_CONFIGS`):
    `(bert.loss_fn, (params, batch, cfg))`. `seq` (default: the config's) replaces
    `cfg.seq_len`. By default "tiny" and "small" are float32 on "cpu" with random values,
    other sizes bfloat16 on `meta`.

    Example:
        >>> fn, (params, batch, cfg) = bert("base", batch=32, seq=128)
        >>> sorted(batch)
        ['attention_mask', 'input_ids', 'labels', 'token_type_ids']
    """
    cfg = _lookup(_bert.BERT_CONFIGS, size, "bert")
    if seq is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq)
    device, dtype = _placement(size, device, dtype)
    params = _bert.init_params(cfg, device=device, dtype=dtype, seed=seed)
    data = _bert.make_batch(cfg, batch, device=device, seed=seed)
    return _bert.loss_fn, (params, data, cfg)


def gpt_tiny(batch: int = 8, seq: int = 16) -> Factory:
    """GPT "tiny" (2 layers, d_model 32, vocab 96), float32 on "cpu", runnable.

    Example:
        >>> fn, args = gpt_tiny(batch=8, seq=16)
        >>> fn(*args).shape
        torch.Size([])
    """
    return gpt("tiny", batch, seq)


def gpt_small(batch: int = 8, seq: int = 64) -> Factory:
    """GPT "small" (4 layers, d_model 128, vocab 512), float32 on "cpu", runnable.

    Example:
        >>> fn, args = gpt_small(batch=8, seq=64)
        >>> traced = pxform.trace(fn, *args)
    """
    return gpt("small", batch, seq)


def bert_tiny(batch: int = 8, seq: int = 16) -> Factory:
    """BERT "tiny" (2 layers, d_model 32, vocab 96), float32 on "cpu", runnable.

    Example:
        >>> fn, args = bert_tiny(batch=8, seq=16)
        >>> loss = fn(*args)
    """
    return bert("tiny", batch, seq)


def bert_large(batch: int = 128, seq: int = 512) -> Factory:
    """BERT-large (24 layers, 16 heads, hidden 1024; 335 M parameters), bfloat16 on `meta`.

    Example:
        pxform plan examples.factories:bert_large --batch 128 --seq 512
    """
    return bert("large", batch, seq)


def gpt_6_7b(batch: int = 64, seq: int = 2048) -> Factory:
    """GPT-3 6.7B (32 layers, 32 heads, d_model 4096), bfloat16 on `meta`.

    Example:
        pxform plan examples.factories:gpt_6_7b --batch 64 --seq 2048
    """
    return gpt("6.7B", batch, seq)


def gpt3_175b(batch: int = 1536, seq: int = 2048) -> Factory:
    """GPT-3 175B (96 layers, 96 heads, d_model 12288), bfloat16 on `meta`. The default
    batch is the paper's 1536 sequences of 2048 tokens (3.2 M tokens).

    Example:
        pxform plan examples.factories:gpt3_175b --batch 1536 --seq 2048
    """
    return gpt("175B", batch, seq)


# ---------------------------------------------------------------- nn.Modules

def gpt_module(size: str, batch: int = 8, seq: int | None = None, *,
               dtype: torch.dtype | None = None, seed: int = 0) -> Factory:
    """The example GPT as an `nn.Module` (`gpt.GPT`: blocks in a `ModuleList`), made a
    function by `pxform.module_fn`: `(loss, (params, batch))`. Sizes as `gpt`; "tiny" and
    "small" on "cpu" with `init_params`' values (the same loss as `gpt`'s), others on
    `meta`.

    Example:
        >>> fn, (params, batch) = gpt_module("175B", batch=1536, seq=2048)
    """
    import pxform

    cfg = _lookup(_gpt.GPT_CONFIGS, size, "gpt_module")
    if seq is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq)
    device, dtype = _placement(size, None, dtype)
    with torch.device(device):
        model = _gpt.GPT(cfg, dtype=dtype, seed=seed)
    forward, params = pxform.module_fn(model)

    def loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return forward(params, batch["idx"], batch["targets"])

    return loss, (params, _gpt.make_batch(cfg, batch, device=device, seed=seed))


def gpt3_175b_module(batch: int = 1536, seq: int = 2048) -> Factory:
    """GPT-3 175B as an `nn.Module` on `meta` (`gpt_module`).

    Example:
        pxform plan examples.factories:gpt3_175b_module --batch 1536 --seq 2048
    """
    return gpt_module("175B", batch, seq)


# ---------------------------------------------------------------- Hugging Face modules

def hf_gpt2(size: str, batch: int = 8, seq: int | None = None) -> Factory:
    """Hugging Face's `GPT2LMHeadModel` with the shape of `gpt.GPT_CONFIGS[size]` (GPT-3's
    architecture is GPT-2's), built on `meta` in bfloat16, as an unmodified `nn.Module`
    made a function by `pxform.module_fn`: `(loss, (params, batch))`, `loss(params,
    batch)` the model's own next-token loss. Needs `transformers`.

    Example:
        >>> fn, (params, batch) = hf_gpt2("175B", batch=1536, seq=2048)
        >>> len(params)  # wte, wpe, 12 per block, the final norm's 2
        1156
    """
    import transformers

    import pxform

    cfg = _lookup(_gpt.GPT_CONFIGS, size, "hf_gpt2")
    seq = cfg.seq_len if seq is None else seq
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=seq, n_embd=cfg.d_model, n_layer=cfg.num_layers,
        n_head=cfg.num_heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    forward, params = pxform.module_fn(model)

    def loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return forward(params, **batch).loss

    ids = torch.empty(batch, seq, dtype=torch.long, device="meta")
    return loss, (params, {"input_ids": ids, "labels": ids})


def hf_bert(size: str, batch: int = 8, seq: int | None = None) -> Factory:
    """Hugging Face's `BertForMaskedLM` with the shape of `bert.BERT_CONFIGS[size]`, built on
    `meta` in bfloat16 (as `hf_gpt2`): `(loss, (params, batch))`, the batch the example
    BERT's (`input_ids`, `token_type_ids`, `attention_mask`, `labels`). Needs
    `transformers`.

    Example:
        >>> fn, (params, batch) = hf_bert("large", batch=128, seq=512)
    """
    import transformers

    import pxform

    cfg = _lookup(_bert.BERT_CONFIGS, size, "hf_bert")
    if seq is not None:
        cfg = dataclasses.replace(cfg, seq_len=seq)
    transformers.logging.set_verbosity_error()
    config = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads, intermediate_size=4 * cfg.d_model,
        max_position_embeddings=cfg.seq_len, type_vocab_size=cfg.type_vocab_size,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(config).to(torch.bfloat16)
    forward, params = pxform.module_fn(model)

    def loss(params: dict[str, torch.Tensor], batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return forward(params, **batch).loss

    return loss, (params, _bert.make_batch(cfg, batch, device="meta"))


def hf_gpt3_175b(batch: int = 1536, seq: int = 2048) -> Factory:
    """GPT-3 175B as Hugging Face's `GPT2LMHeadModel` on `meta` (`hf_gpt2`).

    Example:
        pxform plan examples.factories:hf_gpt3_175b --batch 1536 --seq 2048
    """
    return hf_gpt2("175B", batch, seq)


def hf_bert_large(batch: int = 128, seq: int = 512) -> Factory:
    """BERT-large as Hugging Face's `BertForMaskedLM` on `meta` (`hf_bert`).

    Example:
        pxform plan examples.factories:hf_bert_large --batch 128 --seq 512
    """
    return hf_bert("large", batch, seq)
