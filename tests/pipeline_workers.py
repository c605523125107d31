"""Functions run on gloo ranks by the pipeline tests (module level, so workers import them)."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F

import pxform
from pxform import P

SMALL = dict(vocab_size=96, seq_len=16, num_heads=2, d_model=32)


def gpt_setup(num_layers=4, batch=8, dtype=torch.float64):
    import gpt

    cfg = gpt.GPTConfig(num_layers=num_layers, **SMALL)
    params = gpt.init_params(cfg, dtype=dtype)
    data = gpt.make_batch(cfg, batch)
    data["targets"][0, :5] = -100  # ignored targets: the mean divides by a data count
    return cfg, params, data


def gpt_loss(params, batch, cfg):
    import gpt

    return gpt.loss_fn(params, batch, cfg)


def marked_gpt_loss(params, batch, cfg):
    """The example GPT with a stage boundary after every layer but the last."""
    import gpt

    t = batch["idx"].shape[1]
    pos = torch.arange(t, device=batch["idx"].device)
    x = F.embedding(batch["idx"], params["wte"]) + F.embedding(pos, params["wpe"])
    for k, p in enumerate(params["blocks"]):
        x = gpt.block(p, x, cfg)
        if k + 1 < len(params["blocks"]):
            x = pxform.stage_boundary(x)
    x = F.layer_norm(x, (cfg.d_model,), params["lnf_w"], params["lnf_b"])
    logits = F.linear(x, params["wte"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)


def recycling_loss(params, batch, cfg, forwards, per_stage):
    """A recycling model (nnScaler's nF1B use case): the GPT trunk runs `forwards` times on
    the previous output plus the embeddings, the first sweeps without gradient; a stage
    boundary after every `per_stage` layers and after each sweep."""
    import gpt

    def trunk(h):
        t = batch["idx"].shape[1]
        pos = torch.arange(t, device=batch["idx"].device)
        x = F.embedding(batch["idx"], params["wte"]) + F.embedding(pos, params["wpe"])
        x = x if h is None else x + h
        for k, p in enumerate(params["blocks"]):
            x = gpt.block(p, x, cfg)
            if (k + 1) % per_stage == 0 and k + 1 < len(params["blocks"]):
                x = pxform.stage_boundary(x)
        return x

    h = None
    with torch.no_grad():
        for _ in range(forwards - 1):
            h = pxform.stage_boundary(trunk(h))
    x = trunk(h)
    x = F.layer_norm(x, (cfg.d_model,), params["lnf_w"], params["lnf_b"])
    logits = F.linear(x, params["wte"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten(), ignore_index=-100)


def _errors(loss, grads, ref_loss, ref_grads):
    paths, leaves, _ = optree.tree_flatten_with_path(grads, none_is_leaf=True)
    ref = dict(zip(*optree.tree_flatten_with_path(ref_grads)[:2]))
    err = 0.0
    have = []
    for path, g in zip(paths, leaves):
        if g is None:
            continue
        g = pxform.gather(g)
        err = max(err, float((g - ref[path]).abs().max()))
        have.append(".".join(map(str, path)))
    return {"loss": float(loss), "ref": float(ref_loss), "grad_err": err, "have": have}


def run_gpt(schedule, stages, microbatches, options=None, num_layers=4, fn="auto",
            forwards=None):
    """value_and_grad of the pipelined example GPT against the single-process reference."""
    cfg, params, batch = gpt_setup(num_layers)
    if fn == "marked":
        loss_fn = marked_gpt_loss
    elif fn == "recycling":
        per = num_layers * forwards // (stages * forwards)

        def loss_fn(p, b, c):
            return recycling_loss(p, b, c, forwards, per)
    else:
        loss_fn = gpt_loss

    def f(p, b):
        return loss_fn(p, b, cfg)

    step = pxform.pipeline(f, stages=stages, microbatches=microbatches, schedule=schedule,
                           **(options or {}))
    loss, grads = pxform.value_and_grad(step)(params, batch)
    ref_loss, ref_grads = pxform.value_and_grad(f)(params, batch)
    out = _errors(loss, grads, ref_loss, ref_grads)
    out["forward_only"] = float(step(params, batch))  # no grad: only F actions run
    return out


def run_pp_dp(schedule="1f1b", zero=False):
    """2 pipeline stages, each data-parallel (or ZeRO-3) over 2 ranks."""
    cfg, params, batch = gpt_setup(4)

    def f(p, b):
        return gpt_loss(p, b, cfg)

    mesh = pxform.Mesh({"pp": 2, "dp": 2})
    specs = (None, {"idx": P("dp"), "targets": P("dp")})
    if zero:
        specs = (optree.tree_map(lambda t: P("dp") if t.dim() == 2 else None, params),
                 specs[1])
    step = pxform.shard(pxform.pipeline(f, stages=2, microbatches=2, schedule=schedule),
                        mesh=mesh, in_specs=specs)
    loss, grads = pxform.value_and_grad(step)(params, batch)
    ref_loss, ref_grads = pxform.value_and_grad(f)(params, batch)
    out = _errors(loss, grads, ref_loss, ref_grads)
    text = step.lower(params, batch).as_text()
    out["text"] = text
    out["dtensor"] = sorted({type(g).__name__ for g in optree.tree_leaves(grads)})
    return out


def class_token(schedule, microbatches):
    """A vision-transformer class token: a parameter expanded to the batch and concatenated
    with the tokens, then a stage boundary. Every microbatch makes the expanded token whole
    and reads its own rows; its gradient is each microbatch's rows padded with zeros,
    summed over microbatches. Loss and gradients against one process."""
    import pxform

    def loss(p, x):
        cls = p["cls"].expand(x.shape[0], -1, -1)
        h = torch.cat([cls, x @ p["w0"]], dim=1)
        h = pxform.stage_boundary(torch.tanh(h))
        return (h @ p["w1"]).pow(2).mean()

    g = torch.Generator().manual_seed(0)
    params = {"cls": torch.randn(1, 1, 8, generator=g, dtype=torch.float64),
              "w0": torch.randn(8, 8, generator=g, dtype=torch.float64),
              "w1": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    x = torch.randn(8, 5, 8, generator=g, dtype=torch.float64)
    ref_loss, ref_grads = pxform.value_and_grad(loss)(params, x)
    step = pxform.pipeline(loss, stages=2, microbatches=microbatches, schedule=schedule)
    value, grads = pxform.value_and_grad(step)(params, x)
    errs = {k: float((pxform.gather(grads[k]) - ref_grads[k]).abs().max())
            for k in params if grads[k] is not None}
    return {"loss_err": abs(float(value) - float(ref_loss)), "grad_errs": errs}


def class_token_auto():
    """`pxform.auto` on 2 ranks for a small class-token transformer: its plan with 2
    pipeline stages (pinned: since the search prices data parallelism's all-reduce per
    bucket, it prefers that here) runs, against one process."""
    import optree

    import pxform

    def loss(p, x):
        cls = p["cls"].expand(x.shape[0], -1, -1)
        h = torch.cat([cls, x @ p["w0"]], dim=1)
        for w in p["layers"]:
            h = h + torch.tanh(torch.nn.functional.layer_norm(h, (16,)) @ w)
        return (h[:, 0] @ p["head"]).pow(2).mean()

    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    params = {"cls": randn(1, 1, 16), "w0": randn(8, 16),
              "layers": [randn(16, 16) / 4 for _ in range(4)], "head": randn(16, 4)}
    x = randn(8, 5, 8)
    ref_loss, ref_grads = pxform.value_and_grad(loss)(params, x)
    from pxform.search import Pin

    step = pxform.auto(loss, mesh=2, plan=Pin(stages=2))
    plan = step.plan(params, x)
    value, grads = pxform.value_and_grad(step)(params, x)
    full = pxform.gather(grads)
    err = max(float((a - b).abs().max()) for a, b in
              zip(optree.tree_leaves(full, none_is_leaf=True),
                  optree.tree_leaves(ref_grads, none_is_leaf=True)) if a is not None)
    return {"stages": plan.stages, "loss_err": abs(float(value) - float(ref_loss)),
            "grad_err": err}


def sends_released(schedule):
    """The region's peak memory (`MemoryMeter`, above the tracked arguments) of a 2-stage
    pipeline whose boundary values are wide, at 4 and at 16 microbatches of the same size:
    the executor waits for each send once a receive shows it arrived, so the boundary
    outputs and input gradients it keeps do not grow with the microbatch count."""
    import pxform
    from pxform.tools.memory import MemoryMeter

    def loss(p, x):
        h = pxform.stage_boundary(torch.tanh(x @ p["w0"]))
        return (h @ p["w1"]).pow(2).mean()

    g = torch.Generator().manual_seed(0)
    params = {"w0": torch.randn(64, 4096, generator=g, dtype=torch.float64) / 8,
              "w1": torch.randn(4096, 4, generator=g, dtype=torch.float64) / 64}
    peaks = {}
    for m in (4, 16):
        x = torch.randn(2 * m, 64, generator=g, dtype=torch.float64)
        step = pxform.value_and_grad(pxform.pipeline(loss, stages=2, microbatches=m,
                                                     schedule=schedule))
        step(params, x)  # lowered once, outside the region
        with MemoryMeter() as meter:
            meter.track(params, x)
            step(params, x)
        peaks[m] = meter.stats.peak_bytes - meter.stats.baseline_bytes
    return {"peaks": peaks, "boundary": 2 * 4096 * 8}  # one microbatch's boundary value


def receives_posted(schedule, options):
    """Per receive action of one recorded step of the example GPT in a 2-stage pipeline:
    whether its receive was posted before the action started (`pxform.runtime.pipeline.
    _posted_ahead`), and the loss against one process's."""
    import time

    import pxform
    import pxform.runtime.pipeline as executor

    cfg, params, data = gpt_setup()
    posted: dict[str, float] = {}
    real = executor._post_recv

    def logged(shapes, place, frm, a, tag, device):
        posted[str(a)] = time.time()
        return real(shapes, place, frm, a, tag, device)

    step = pxform.value_and_grad(pxform.pipeline(
        lambda p, b: gpt_loss(p, b, cfg), stages=2, microbatches=4, schedule=schedule,
        **options))
    ref, _ = pxform.value_and_grad(lambda p, b: gpt_loss(p, b, cfg))(params, data)
    step(params, data)
    executor._post_recv = logged
    try:
        with executor.recording() as events:
            value, _ = step(params, data)
    finally:
        executor._post_recv = real
    ahead = [posted[str(a)] < start for a, start, _ in events if a.kind in ("RF", "RB")]
    return {"ahead": ahead, "loss_err": abs(float(value) - float(ref))}


def weight_accumulations(bucket_mb=None, microbatches=4):
    """The example GPT on 2 pipeline stages under the zero-bubble schedule, `value_and_grad`
    once with `torch.autograd.backward` counted (a W action's accumulation into the
    parameters is the only caller: its B asks `torch.autograd.grad`), against the
    single-process reference; `bucket_mb` given: inside a `shard` over `pp` with that
    bucket size."""
    cfg, params, batch = gpt_setup(4)

    def f(p, b):
        return gpt_loss(p, b, cfg)

    pipe = pxform.pipeline(f, stages=2, microbatches=microbatches, schedule="zb")
    step = pipe
    if bucket_mb is not None:
        step = pxform.shard(pipe, mesh=pxform.Mesh({"pp": 2}), in_specs=(None, None),
                            bucket_mb=bucket_mb)
    stage = pipe.lower(params, batch).stages[torch.distributed.get_rank()]
    real, calls = torch.autograd.backward, []

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    torch.autograd.backward = counted
    try:
        loss, grads = pxform.value_and_grad(step)(params, batch)
    finally:
        torch.autograd.backward = real
    ref_loss, ref_grads = pxform.value_and_grad(f)(params, batch)
    out = _errors(loss, grads, ref_loss, ref_grads)
    out["calls"] = len(calls)
    out["weight_ops"] = len(stage.weight_ops)
    return out


def frozen_prefix(schedule, options, trained_layers=1):
    """One step of the example GPT (4 layers, 2 ranks) with all but its last
    `trained_layers` layers, its final norm and, frozen: the embeddings (`requires_grad`
    False), against one process: the loss and gradient errors, which gradients this
    rank holds, and per gradient message it sent (SB) its stage and the elements it
    carried (a stage before the first that trains gets a one-element token)."""
    import pxform.runtime.pipeline as executor

    cfg, params, batch = gpt_setup(4)
    last = len(params["blocks"]) - trained_layers
    for path, t in zip(*optree.tree_flatten_with_path(params)[:2]):
        t.requires_grad_(path[0] == "lnf_w" or path[0] == "lnf_b"
                         or (path[0] == "blocks" and path[1] >= last))

    def f(p, b):
        return gpt_loss(p, b, cfg)

    sent: list[tuple[int, int]] = []
    real = executor._send

    def logged(tensors, place, to, a, tag):
        if a.kind == "SB":
            sent.append((a.stage, sum(t.numel() for t in tensors)))
        return real(tensors, place, to, a, tag)

    step = pxform.value_and_grad(pxform.pipeline(f, stages=2, microbatches=4,
                                                 schedule=schedule, **options))
    executor._send = logged
    try:
        loss, grads = step(params, batch)
    finally:
        executor._send = real
    ref_loss, ref_grads = pxform.value_and_grad(f)(params, batch)
    out = _errors(loss, grads, ref_loss, ref_grads)
    out["sent"] = sent
    out["trained"] = sorted(".".join(map(str, p)) for p, t in zip(
        *optree.tree_flatten_with_path(params)[:2]) if t.requires_grad)
    return out
