"""Worker functions for tests/test_auto_hf.py: small random-init HF models (float64) under
`pxform.auto` on a gloo world, compared with plain autograd on one process."""

from __future__ import annotations

import pxform
from pxform.search import Pin


def run_hf(name: str, pin: Pin | None, every_block: tuple | None = None) -> dict:
    """Plan `name` under `pin` (with `every_block`, roles pinned on every block), run
    value_and_grad, compare with one process."""
    import torch.distributed as dist
    from test_models import _hf_model

    model, inputs = _hf_model(name)
    fn, params = pxform.module_fn(model.double())
    params = {k: v.detach() for k, v in params.items()}

    def loss(params, inputs):
        return fn(params, **inputs).loss

    loss.__name__ = f"{name}_loss"
    if every_block is not None:
        import dataclasses

        from pxform.search.space import Option

        blocks = len(pxform.auto(loss, mesh=dist.get_world_size(), memory_budget="1GiB",
                                 hardware="a100-40gb", plan=pin).plan(params, inputs).blocks)
        pin = dataclasses.replace(pin or Pin(),
                                  block_options=(Option(every_block, False),) * blocks)
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


def zoo_dtype(name: str) -> str:
    """float64 where the model allows; HF's mixture-of-experts kernels take float32."""
    import hf_zoo

    return "float32" if hf_zoo.ZOO[name][0] == "moe" else "float64"


def run_zoo(name: str, mode: str, dtype: str = "float64") -> dict:
    """One coverage case (`tests/test_coverage.py`, `benchmarks/coverage.py`): the zoo model
    `name` under data parallel (`mode="dp"`: the batch split over every rank), `auto`, or
    `auto` with one pipeline stage per rank (`"pipeline"`; `"padded pipeline"`: with a
    padding mask that differs from row to row added to a batch without one), on this
    world, against `pxform.value_and_grad` of the plain function on one process. Failures
    are returned, not raised, so one model's failure does not stop a sweep."""
    import time
    import traceback
    import warnings

    import hf_zoo
    import torch
    import torch.distributed as dist

    start = time.perf_counter()
    out: dict = {"name": name, "mode": mode, "ok": False}
    try:
        model, inputs = hf_zoo.build(name, dtype=getattr(torch, dtype))
        if mode == "padded pipeline":
            if "input_ids" in inputs:
                rows, seq = inputs["input_ids"].shape
                inputs.setdefault("attention_mask", torch.ones(rows, seq, dtype=torch.long)
                                  .tril(seq // 2))
            mode = "pipeline"
        fn, params = pxform.module_fn(model)
        params = {k: v.detach() for k, v in params.items()}

        def loss(params, inputs):
            return fn(params, **inputs).loss

        loss.__name__ = f"{name}_loss"
        ref_value, ref_grads = pxform.value_and_grad(loss)(params, inputs)
        world = dist.get_world_size()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if mode == "dp":
                step = pxform.shard(loss, mesh=pxform.Mesh({"dp": world}),
                                    in_specs=(None, pxform.P("dp")))
            else:  # "pipeline": auto with the stages pinned to the world's size
                pin = Pin(stages=world, microbatches=2) if mode == "pipeline" else None
                step = pxform.auto(loss, mesh=world, memory_budget="1GiB",
                                   hardware="a100-40gb", plan=pin)
                out["config"] = step.plan(params, inputs).config_text()
            value, grads = pxform.value_and_grad(step)(params, inputs)
        out["warnings"] = [str(w.message)[:300] for w in caught
                           if issubclass(w.category, pxform.PxformWarning)]
        full = pxform.gather(grads)
        have = [k for k in ref_grads if ref_grads[k] is not None and full.get(k) is not None]
        scale = max((float(g.abs().max()) for g in ref_grads.values() if g is not None),
                    default=1.0) or 1.0
        out["loss_err"] = abs(float(value) - float(ref_value)) / max(abs(float(ref_value)), 1.0)
        out["grad_err"] = max((float((full[k] - ref_grads[k]).abs().max()) for k in have),
                              default=0.0) / scale
        out["have"] = have
        # leaves the loss depends on (an unused parameter's zero gradient may be missing on
        # a pipeline rank: no stage reads it)
        out["need"] = [k for k, g in ref_grads.items() if g is not None and bool(g.any())]
        out["ok"] = True
    except Exception as exc:  # a sweep records every failure
        out["error"] = f"{type(exc).__name__}: {exc}"[:1500]
        out["trace"] = traceback.format_exc()[-3000:]
    out["seconds"] = time.perf_counter() - start
    return out


def run_train_mode(name: str) -> dict:
    """The zoo model in training mode (Swin: stochastic depth 0.1) under data parallel on this
    world, pxform's own run of the traced function on one process, and eager, each from
    the same torch seed: the loss of each."""
    import warnings

    import hf_zoo
    import torch

    warnings.simplefilter("ignore")
    model, inputs = hf_zoo.build(name, dtype=torch.float64)
    model.train()
    fn, params = pxform.module_fn(model)
    params = {k: v.detach() for k, v in params.items()}

    def loss(params, inputs):
        return fn(params, **inputs).loss

    torch.manual_seed(0)
    step = pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}), in_specs=(None, pxform.P("dp")))
    parallel = float(step(params, inputs))
    torch.manual_seed(0)
    one_rank = float(pxform.trace(loss, params, inputs)(params, inputs).detach())
    torch.manual_seed(0)
    eager = float(loss(params, inputs).detach())
    return {"parallel": parallel, "one_rank": one_rank, "eager": eager}


FROZEN = {
    # the embedding and the first two layers frozen: they run no backward at all
    "prefix": lambda name: name.startswith(("model.embed_tokens", "model.layers.0.",
                                            "model.layers.1.")),
    # the embedding and the first three layers: a 2-stage pipeline's first stage trains
    # nothing (its B does nothing; the stage after it is sent no gradient)
    "stage": lambda name: name.startswith(("model.embed_tokens", "model.layers.0.",
                                           "model.layers.1.", "model.layers.2.")),
    # every weight matrix frozen, the norms trained (BitFit-like): each matmul's backward
    # makes its input's gradient alone
    "matrices": lambda name: "norm" not in name,
}
"""`run_hf_memory`'s `frozen`: which of HF Llama's parameters are frozen."""


def _small_llama(frozen: str | None) -> tuple:
    """HF Llama of width 256 (4 layers, 8 heads, 4 of keys and values, 64 tokens,
    vocabulary 1,024, float32, global batch 16): (loss, parameters, inputs). `frozen` (a
    key of `FROZEN`): those parameters `requires_grad=False`, the others True (None: none
    marked, so every one is trained)."""
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=1024, max_position_embeddings=64,
                                      hidden_size=256, num_attention_heads=8,
                                      num_key_value_heads=4, intermediate_size=512,
                                      num_hidden_layers=4)
    fn, params = pxform.module_fn(transformers.LlamaForCausalLM(config).eval())
    params = {k: v.detach() for k, v in params.items()}
    if frozen is not None:
        params = {k: v.requires_grad_(not FROZEN[frozen](k)) for k, v in params.items()}
    ids = torch.randint(1, 1024, (16, 64), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids.clone()}

    def loss(params, inputs):
        return fn(params, **inputs).loss

    return loss, params, inputs


def run_hf_memory(pins: dict[str, Pin], frozen: str | None = None) -> dict[str, list[float]]:
    """`_small_llama(frozen)`: per pinned plan (planned against the a100-40gb preset)
    distributed, one AdamW step so the optimizer's state exists, then `measure` and
    `plan.report`: each rank's signed memory error, predicted over metered."""
    import torch.distributed as dist
    from auto_workers import metered_memory_errors

    loss, params, inputs = _small_llama(frozen)
    return {name: metered_memory_errors(
                pxform.auto(loss, mesh=dist.get_world_size(), memory_budget="40GiB",
                            hardware="a100-40gb", plan=pin), params, inputs)
            for name, pin in pins.items()}


def run_zoo_memory(name: str, pins: dict[str, tuple[int, tuple | None, bool]],
                   seq: int | None = None) -> dict[str, list[float]]:
    """The zoo model `name` (`hf_zoo.build`, float32, global batch 16; text models' `seq`
    tokens, None: `hf_zoo.SEQ`) under each pin, given as (stages, roles of every block or
    None, recompute every block); planned against the a100-40gb preset: each rank's signed
    memory error, predicted over metered (`auto_workers.metered_memory_errors`)."""
    import hf_zoo
    import torch
    import torch.distributed as dist
    from auto_workers import metered_memory_errors

    from pxform.search.pipelines import ScheduleChoice
    from pxform.search.space import Option

    default, hf_zoo.SEQ = hf_zoo.SEQ, seq or hf_zoo.SEQ  # (read by `build`)
    try:
        model, inputs = hf_zoo.build(name, dtype=torch.float32, batch=16)
    finally:
        hf_zoo.SEQ = default
    fn, params = pxform.module_fn(model)
    params = {k: v.detach() for k, v in params.items()}

    def loss(params, inputs):
        return fn(params, **inputs).loss

    loss.__name__ = f"{name}_loss"
    world = dist.get_world_size()

    def step(the_pin: Pin):
        return pxform.auto(loss, mesh=world, memory_budget="40GiB", hardware="a100-40gb",
                           plan=the_pin)

    num_blocks = len(step(Pin(stages=1)).plan(params, inputs).blocks)
    out = {}
    for key, (stages, roles, recompute) in pins.items():
        options = None
        if roles is not None or recompute:
            options = (Option(roles or (), recompute),) * num_blocks
        axes = {a for a, _ in roles or ()}
        the_pin = Pin(stages=stages, microbatches=4 if stages > 1 else 1,
                      outer=world // stages if "outer" in axes else 1 if stages == 1 else None,
                      inner=world // stages if "inner" in axes else 1 if stages == 1 else None,
                      block_options=options,
                      schedule=ScheduleChoice("1f1b") if stages > 1 else None)
        out[key] = metered_memory_errors(step(the_pin), params, inputs)
    return out


def run_hf_frozen_grads(frozen: str, pin: Pin) -> dict:
    """`_small_llama(frozen)`, one step under `pin` on this world against the same step
    in one process: the loss, the largest gradient difference over the gradients this
    rank holds, the frozen parameters given a gradient anywhere here (none should be),
    and how many gradients this rank holds."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    loss, params, inputs = _small_llama(frozen)
    ref_value, ref_grads = pxform.value_and_grad(loss)(params, inputs)
    step = pxform.auto(loss, mesh=dist.get_world_size(), memory_budget="40GiB",
                       hardware="a100-40gb", plan=pin)
    dparams = step.distribute(params, inputs)[0]
    value, grads = pxform.value_and_grad(step)(dparams, inputs)
    worst, frozen_with_grad, held = 0.0, [], 0
    for k, g in grads.items():
        if g is None:
            continue
        if ref_grads[k] is None:
            frozen_with_grad.append(k)
            continue
        held += 1
        full = g.full_tensor() if isinstance(g, DTensor) else g
        worst = max(worst, float((full - ref_grads[k]).abs().max()
                                 / ref_grads[k].abs().max().clamp_min(1e-30)))
    return {"loss": float(value), "ref_loss": float(ref_value), "worst": worst,
            "frozen_with_grad": frozen_with_grad, "held": held,
            "trained": sum(g is not None for g in ref_grads.values())}
