"""Worker functions for tests/test_auto_hf.py: small random-init HF models (float64) under
`pxform.auto` on a gloo world, compared with plain autograd on one process."""

from __future__ import annotations

import pxform
from pxform.search import Pin


def run_hf(name: str, pin: Pin | None) -> dict:
    import torch.distributed as dist
    from test_models import _hf_model

    model, inputs = _hf_model(name)
    fn, params = pxform.module_fn(model.double())
    params = {k: v.detach() for k, v in params.items()}

    def loss(params, inputs):
        return fn(params, **inputs).loss

    loss.__name__ = f"{name}_loss"
    step = pxform.auto(loss, mesh=dist.get_world_size(), memory_budget="1GiB",
                       hardware="a100-40gb", plan=pin)
    plan = step.plan(params, inputs)
    value, grads = pxform.value_and_grad(step)(params, inputs)
    ref_value, ref_grads = pxform.value_and_grad(loss)(params, inputs)
    full = pxform.gather(grads)
    have = [k for k in ref_grads if full.get(k) is not None and ref_grads[k] is not None]
    err = max((float((full[k] - ref_grads[k]).abs().max()) for k in have), default=0.0)
    scale = max(float(g.abs().max()) for g in ref_grads.values() if g is not None)
    return {"config": plan.config_text(), "strategies": sorted({b.strategy for b in plan.blocks}),
            "loss_err": float((value - ref_value).abs()), "grad_err": err / scale,
            "have": have, "num": len(ref_grads), "dtype": str(next(iter(params.values())).dtype)}
