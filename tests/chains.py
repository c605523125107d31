"""Random op chains for the SPMD property tests: blocks that map x [B, S, D] to the same
shape, one per op family, and scalar losses. A case is data (names, specs, a mesh), so it
pickles to the worker ranks, which build the function and compare with the reference."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

B, S, D, V = 4, 4, 8, 8  # multiples of 4: every spec over a 4-device mesh divides them


def _linear(x, p, b):          # einsum family: matmul
    return x @ p["w"]


def _einsum(x, p, b):          # einsum family: explicit contraction with a bias
    return torch.einsum("bsd,ed->bse", x, p["w"]) + p["bias"]


def _gelu_mul(x, p, b):        # pointwise: nonlinear, multiplicative
    return F.gelu(x) * b["y"]


def _exp_sub(x, p, b):         # pointwise and reduction (amax)
    return torch.exp(x - x.amax(dim=-1, keepdim=True))


def _center(x, p, b):          # reduction: mean over the sequence
    return x - x.mean(dim=1, keepdim=True)


def _sum_scale(x, p, b):       # reduction: sum over features, broadcast back
    return x * torch.tanh(x.sum(dim=-1, keepdim=True))


def _layer_norm(x, p, b):      # norm family
    return F.layer_norm(x, (D,), p["ln_w"], p["ln_b"])


def _softmax(x, p, b):         # norm family: softmax
    return torch.softmax(x, dim=-1)


def _view_transpose(x, p, b):  # view family: reshape, transpose, reshape back
    return x.reshape(B, S, 2, D // 2).transpose(2, 3).reshape(B, S, D)


def _permute(x, p, b):         # view family: permute and contiguous
    return x.permute(1, 0, 2).contiguous().permute(1, 0, 2) * 1.5


def _flip_index(x, p, b):      # indexing + factory: index_select with arange
    return x.index_select(-1, torch.arange(D - 1, -1, -1, device=x.device))


def _slice_cat(x, p, b):       # indexing: slices and cat
    return torch.cat([x[..., : D // 2] * 2, x[..., D // 2:]], dim=-1)


def _embedding(x, p, b):       # indexing: embedding lookup of integer tokens
    return x + F.embedding(b["tok"], p["emb"])


def _attention(x, p, b):       # attention family
    h = x.unsqueeze(1)
    return F.scaled_dot_product_attention(h, h, h, is_causal=True).squeeze(1)


def _ones_like(x, p, b):       # factory family
    return x + torch.ones_like(x) * 0.5


BLOCKS = {f.__name__[1:]: f for f in [
    _linear, _einsum, _gelu_mul, _exp_sub, _center, _sum_scale, _layer_norm, _softmax,
    _view_transpose, _permute, _flip_index, _slice_cat, _embedding, _attention, _ones_like]}


def _mse(x, p, b):
    return ((x - b["y"]) ** 2).mean()


def _cross_entropy(x, p, b):   # mean over non-ignored targets (some are -100)
    return F.cross_entropy(x.reshape(B * S, D), b["labels"].reshape(-1))


def _sum(x, p, b):
    return x.sum() / math.sqrt(x.numel())


def _logsumexp(x, p, b):
    return torch.logsumexp(x, dim=-1).mean()


LOSSES = {f.__name__[1:]: f for f in [_mse, _cross_entropy, _sum, _logsumexp]}


def make_fn(blocks, loss):
    """The chain as a function `(params, batch) -> (loss, x)`."""
    def chain(params, batch):
        x = batch["x"]
        for name in blocks:
            x = BLOCKS[name](x, params, batch)
        return LOSSES[loss](x, params, batch), x

    return chain


def make_args(seed):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    params = {"w": r(D, D) / math.sqrt(D), "bias": r(D), "ln_w": 1 + 0.1 * r(D),
              "ln_b": r(D), "emb": r(V, D)}
    labels = torch.randint(0, D, (B, S), generator=g)
    labels[0, 0] = -100
    batch = {"x": r(B, S, D), "y": r(B, S, D),
             "tok": torch.randint(0, V, (B, S), generator=g), "labels": labels}
    return params, batch


SHAPES = {"w": (D, D), "bias": (D,), "ln_w": (D,), "ln_b": (D,), "emb": (V, D),
          "x": (B, S, D), "y": (B, S, D), "tok": (B, S), "labels": (B, S)}


_MESHES: dict = {}


def run_cases(cases):
    """On every rank: run each case through pxform.shard + value_and_grad and compare the
    loss, the returned x and every gradient with the single-process reference. Returns one
    (error, description) per case; error is None when everything matches."""
    import optree

    import pxform

    out = []
    for case in cases:
        axes, blocks, loss, pspecs, bspecs, out_spec = case
        desc = (f"mesh={axes} blocks={blocks} loss={loss} param_specs={pspecs} "
                f"batch_specs={bspecs} out_spec={out_spec}")
        try:
            key = tuple(axes.items())
            if key not in _MESHES:
                _MESHES[key] = pxform.Mesh(axes)
            fn = make_fn(blocks, loss)
            params, batch = make_args(len(blocks))
            step = pxform.shard(fn, mesh=_MESHES[key], in_specs=(pspecs, bspecs),
                                out_specs=(None, out_spec))
            (value, x), grads = pxform.value_and_grad(step, has_aux=True)(params, batch)
            ref_params = optree.tree_map(lambda t: t.clone().requires_grad_(), params)
            ref_value, ref_x = fn(ref_params, batch)
            ref_grads = (torch.autograd.grad(ref_value, list(ref_params.values()),
                                             allow_unused=True)
                         if ref_value.requires_grad else [None] * len(ref_params))
            errs = [abs(float(value) - float(ref_value)),
                    (pxform.gather(x) - ref_x).abs().max().item()]
            for g, rg in zip(pxform.gather(grads).values(), ref_grads):
                errs.append((g - (torch.zeros_like(g) if rg is None else rg)).abs().max().item())
            scale = max(1.0, abs(float(ref_value)))
            bad = max(errs) > 1e-9 * scale
            out.append((f"errors {errs}" if bad else None, desc))
        except Exception as exc:  # report, with the case, on the main process
            out.append((f"{type(exc).__name__}: {exc}", desc))
    return out
