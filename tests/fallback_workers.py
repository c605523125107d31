"""Worker functions for tests/test_fallback.py (run on every rank of a gloo World)."""

from __future__ import annotations

import warnings

import torch

import pxform
from pxform import P


def setup():
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    params = {"w1": t(6, 3), "w2": t(3, 3), "v": t(3)}
    batch = {"x": t(8, 6), "y": t(8, 3)}
    return params, batch


def on_activations(params, batch):
    h = batch["x"] @ params["w1"]
    # linalg_cross has no sharding rule: under allow_fallback it runs replicated, so the
    # batch-split activation is gathered first (its gradient split again in backward)
    c = torch.linalg.cross(h, params["v"][None, :]) @ params["w2"]
    return ((c - batch["y"]) ** 2).mean()


def on_parameters(params, batch):
    h = batch["x"] @ params["w1"]
    h = pxform.stage_boundary(h)
    # in a pipeline a fallback op must not need the whole batch (microbatches run one at a
    # time): here it reads parameters only, on the second stage
    c = h @ torch.linalg.cross(params["w2"], params["v"][None, :])
    return ((c - batch["y"]) ** 2).mean()


def errors(loss, grads, ref_loss, ref_grads):
    """Loss and gradient errors; a pipeline rank gets None for parameters its stages do
    not read (`held` lists those it has)."""
    grads = pxform.gather(grads)
    held = sorted(k for k in ref_grads if grads[k] is not None)
    return {"loss": abs(float(loss) - float(ref_loss)), "held": held,
            "grad": max((float((grads[k] - ref_grads[k]).abs().max()) for k in held),
                        default=0.0)}


def run(kind: str) -> dict:
    params, batch = setup()
    loss_fn = on_parameters if "pipeline" in kind else on_activations
    ref_loss, ref_grads = pxform.value_and_grad(loss_fn)(params, batch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if kind == "shard":
            step = pxform.shard(loss_fn, mesh=pxform.Mesh({"dp": 2}),
                                in_specs=(None, P("dp")), allow_fallback=True)
        elif kind == "pipeline":
            step = pxform.pipeline(loss_fn, stages=2, microbatches=2, allow_fallback=True)
        elif kind == "shard_pipeline":
            step = pxform.shard(pxform.pipeline(loss_fn, stages=2, microbatches=2),
                                mesh=pxform.Mesh({"pp": 2}), in_specs=(None, None),
                                allow_fallback=True)
        else:
            step = pxform.auto(loss_fn, mesh=2, hardware="a100-80gb")
        loss, grads = pxform.value_and_grad(step)(params, batch)
        loss, grads = pxform.value_and_grad(step)(params, batch)  # cached: no new warning
    out = errors(loss, grads, ref_loss, ref_grads)
    fallback = [str(w.message) for w in caught if "no sharding rule" in str(w.message)]
    out["warnings"] = len(fallback)
    out["names_op"] = all("linalg_cross" in m for m in fallback)
    return out


def refused() -> str:
    params, batch = setup()
    step = pxform.shard(on_activations, mesh=pxform.Mesh({"dp": 2}),
                        in_specs=(None, P("dp")))
    try:
        pxform.value_and_grad(step)(params, batch)
    except pxform.UnsupportedOpError as exc:
        return str(exc)
    return "not refused"
