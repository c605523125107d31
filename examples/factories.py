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
