"""Worker functions for tests/test_rng.py: random ops under every plan equal pxform's own
1-rank run (the traced function run on one process), in float64."""

from __future__ import annotations

import torch

import pxform
from pxform import P

P_DROP = 0.1


def setup(batch_size=8):
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    params = {"w1": t(16, 32) * 0.3, "w2": t(32, 8) * 0.3}
    batch = {"x": t(batch_size, 4, 16), "y": t(batch_size, 4, 8)}
    return params, batch


def block(w1, x):
    h = torch.nn.functional.dropout(x @ w1, P_DROP, training=True)
    return torch.nn.functional.gelu(h) + 0.1 * torch.randn_like(h)


def head(w2, h, y):
    out = torch.nn.functional.dropout(h, P_DROP, training=True) @ w2
    return ((out - y) ** 2).mean()


def loss_plain(params, batch):
    return head(params["w2"], block(params["w1"], batch["x"]), batch["y"])


def loss_pipelined(params, batch):
    h = pxform.stage_boundary(block(params["w1"], batch["x"]))
    return head(params["w2"], h, batch["y"])


def loss_recompute(params, batch):
    h = pxform.recompute(block)(params["w1"], batch["x"])
    return head(params["w2"], h, batch["y"])


def loss_coshard(params, batch):
    h = pxform.coshard(block, chunks=2, dim=(None, 0))(params["w1"], batch["x"])
    return head(params["w2"], h, batch["y"])


def _step(plan, num_ranks):
    replicated = {"w1": None, "w2": None}
    batch_dp = {"x": P("dp"), "y": P("dp")}
    if plan == "dp":
        return pxform.shard(loss_plain, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(replicated, batch_dp)), loss_plain
    if plan == "zero3":
        return pxform.shard(loss_plain, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=({"w1": P("dp"), "w2": P("dp")}, batch_dp)), loss_plain
    if plan == "tp":
        return pxform.shard(loss_plain, mesh=pxform.Mesh({"tp": num_ranks}),
                            in_specs=({"w1": P(None, "tp"), "w2": P("tp", None)}, None)), \
            loss_plain
    if plan == "sp":  # the sequence dim split: dropout on pieces of every example
        return pxform.shard(loss_plain, mesh=pxform.Mesh({"sp": num_ranks}),
                            in_specs=(replicated, {"x": P(None, "sp"), "y": P(None, "sp")})), \
            loss_plain
    if plan == "dp_tp":
        return pxform.shard(loss_plain, mesh=pxform.Mesh({"dp": 2, "tp": num_ranks // 2}),
                            in_specs=({"w1": P(None, "tp"), "w2": P("tp", None)}, batch_dp)), \
            loss_plain
    if plan == "pipeline":
        return pxform.pipeline(loss_pipelined, stages=num_ranks, microbatches=4), \
            loss_pipelined
    if plan == "pp_dp":
        inner = pxform.pipeline(loss_pipelined, stages=2, microbatches=4)
        return pxform.shard(inner, mesh=pxform.Mesh({"pp": 2, "dp": num_ranks // 2}),
                            in_specs=(replicated, batch_dp)), loss_pipelined
    if plan == "recompute":
        return pxform.shard(loss_recompute, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(replicated, batch_dp)), loss_recompute
    if plan == "coshard":
        return pxform.shard(loss_coshard, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(replicated, batch_dp)), loss_coshard
    raise ValueError(plan)


def run(plan, num_ranks, steps=2):
    """Two calls of the step (the seed advances between them), each against the 1-rank
    run with the same generator state. Returns the largest loss and gradient errors."""
    params, batch = setup()
    step, fn = _step(plan, num_ranks)
    torch.manual_seed(1234)
    worst = {"loss": 0.0, "grad": 0.0, "losses": []}
    for _ in range(steps):
        state = torch.get_rng_state()
        loss, grads = pxform.value_and_grad(step)(params, batch)
        after = torch.get_rng_state()
        torch.set_rng_state(state)
        ref_loss, ref_grads = reference_at_state(fn, params, batch)
        assert torch.equal(torch.get_rng_state(), after), "the step advanced the generator " \
            "differently from the 1-rank run"
        grads = pxform.gather(grads)
        worst["loss"] = max(worst["loss"], abs(float(loss) - float(ref_loss)))
        worst["losses"].append(float(loss))
        for name, g in grads.items():
            if g is not None:
                worst["grad"] = max(worst["grad"], float((g - ref_grads[name]).abs().max()))
    return worst


def reference_at_state(fn, params, batch):
    """pxform's 1-rank run: the traced function on this process, with autograd."""
    import optree
    traced = pxform.trace(fn, params, batch)
    flat, tree = optree.tree_flatten(params)
    leaves = [v.detach().clone().requires_grad_(True) for v in flat]
    loss = traced(optree.tree_unflatten(tree, leaves), batch)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), optree.tree_unflatten(tree, list(grads))


def masks(num_ranks):
    """Dropout masks over 10^5 elements under data parallelism: each rank's own shard."""
    x = torch.ones(num_ranks * 250, 400, dtype=torch.float32)

    def f(x):
        return torch.nn.functional.dropout(x, P_DROP, training=True)

    step = pxform.shard(f, mesh=pxform.Mesh({"dp": num_ranks}), in_specs=(P("dp"),),
                        out_specs=P("dp"))
    torch.manual_seed(7)
    out = step(x)
    local = out.to_local() if hasattr(out, "to_local") else out
    return (local == 0).to(torch.int8)


def attention_dropout(plan, num_ranks):
    """GPT with dropout everywhere, attention dropout included (written out at trace
    time), under tensor parallelism (heads split) or ZeRO-3, against the 1-rank run."""
    import dataclasses

    from gpt import GPT_CONFIGS, init_params, loss_fn, make_batch
    cfg = dataclasses.replace(GPT_CONFIGS["tiny"], dropout=0.1)
    params = {k: v for k, v in init_params(cfg, dtype=torch.float64).items()}
    batch = make_batch(cfg, 4)

    def fn(params, batch):
        return loss_fn(params, batch, cfg)

    if plan == "tp":
        heads = {"qkv_w": P("tp"), "qkv_b": P("tp"), "proj_w": P(None, "tp")}
        specs = {**{k: None for k in params if k != "blocks"},
                 "blocks": [{k: heads.get(k) for k in b} for b in params["blocks"]]}
        step = pxform.shard(fn, mesh=pxform.Mesh({"tp": num_ranks}), in_specs=(specs, None))
    else:
        step = pxform.shard(fn, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(P("dp"), P("dp")))
    torch.manual_seed(9)
    loss, grads = pxform.value_and_grad(step)(params, batch)
    torch.manual_seed(9)
    ref_loss, ref_grads = reference_at_state(fn, params, batch)
    traced = pxform.trace(fn, params, batch)
    import optree
    grads = pxform.gather(grads)
    err = max(float((g - r).abs().max()) for g, r in zip(optree.tree_leaves(grads),
                                                          optree.tree_leaves(ref_grads)))
    return {"loss": abs(float(loss) - float(ref_loss)), "grad": err,
            "dropouts": sum(op.name == "dropout" for op in traced.graph.ops)}
