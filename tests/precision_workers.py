"""Worker functions for tests/test_precision.py: GPT small trained under the bf16 policy
(`pxform.Precision`) with DP, ZeRO-3, TP and a 2-stage pipeline, against float32 on one
process; autocast blocks inside the traced function against eager autocast."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F

import pxform
from pxform import P

STEPS = 20


def setup(num_layers=2, batch=32):
    import gpt

    cfg = gpt.GPTConfig(vocab_size=256, seq_len=32, num_layers=num_layers, num_heads=4,
                        d_model=64)
    params = gpt.init_params(cfg, dtype=torch.float32)
    data = [gpt.make_batch(cfg, batch, seed=k % 2) for k in range(STEPS)]
    return cfg, params, data


def tp_specs(params):
    """Megatron TP of the MLPs (column then row parallel); the rest replicated."""
    block = {"fc_w": P("tp", None), "fc_b": P("tp"), "out_w": P(None, "tp")}
    return {k: ([{n: block.get(n) for n in b} for b in v] if k == "blocks" else None)
            for k, v in params.items()}


def zero3_specs(params):
    return optree.tree_map(lambda t: P("dp") if t.shape[0] % 2 == 0 else None, params)


def reference_curve(steps=STEPS):
    """float32 on one process, plain autograd and Adam: the oracle's loss curve."""
    import gpt

    cfg, params, data = setup()
    params = optree.tree_map(lambda t: t.clone().requires_grad_(), params)
    leaves = optree.tree_leaves(params)
    opt = torch.optim.Adam(leaves, lr=3e-3)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        loss = gpt.loss_fn(params, data[k], cfg)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def make_step(mode, cfg, params, policy):
    import gpt

    def loss(p, b):
        return gpt.loss_fn(p, b, cfg)

    if mode == "dp":
        return pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}),
                            in_specs=(None, {"idx": P("dp"), "targets": P("dp")}),
                            precision=policy)
    if mode == "zero3":
        return pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}),
                            in_specs=(zero3_specs(params),
                                      {"idx": P("dp"), "targets": P("dp")}),
                            precision=policy)
    if mode == "tp":
        return pxform.shard(loss, mesh=pxform.Mesh({"tp": 2}), in_specs=(tp_specs(params), None),
                            precision=policy)
    if mode == "pipeline":
        import gpt as g

        def staged(p, b):
            x = F.embedding(b["idx"], p["wte"]) + F.embedding(
                torch.arange(b["idx"].shape[1]), p["wpe"])
            for i, blk in enumerate(p["blocks"]):
                if i == len(p["blocks"]) // 2:
                    x = pxform.stage_boundary(x)
                x = g.block(blk, x, cfg)
            x = F.layer_norm(x, (cfg.d_model,), p["lnf_w"], p["lnf_b"])
            logits = F.linear(x, p["wte"])
            return F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten())

        return pxform.pipeline(staged, stages=2, microbatches=2, precision=policy)
    raise ValueError(mode)


def train(mode, steps=STEPS, bf16=True):
    """`steps` Adam steps of GPT small under `mode` with the bf16 policy: the loss curve,
    the dtypes of the gradients, parameters and Adam state, and the ZeRO-3 program's
    gathers."""
    cfg, params, data = setup()
    policy = pxform.Precision() if bf16 else None
    step = make_step(mode, cfg, params, policy)
    if mode == "pipeline":
        local = params
    else:
        local, _ = step.distribute(params, data[0])
    leaves = [t for t in optree.tree_leaves(local) if t is not None]
    for t in leaves:
        t.requires_grad_(False)
    opt = torch.optim.Adam(leaves, lr=3e-3)
    grad_fn = pxform.value_and_grad(step)
    losses, grad_dtypes = [], set()
    for k in range(steps):
        batch = data[k] if mode == "pipeline" else step.distribute(params, data[k])[1]
        loss, grads = grad_fn(local, batch)
        for p, g in zip(optree.tree_leaves(local, none_is_leaf=True),
                        optree.tree_leaves(grads, none_is_leaf=True)):
            if p is not None and g is not None:
                p.grad = g
                grad_dtypes.add(str(g.dtype))
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    state_dtypes = {str(v.dtype) for s in opt.state.values() for key, v in s.items()
                    if key != "step"}
    out = {"losses": losses, "grad_dtypes": sorted(grad_dtypes),
           "param_dtypes": sorted({str(t.dtype) for t in leaves}),
           "state_dtypes": sorted(state_dtypes)}
    if mode != "pipeline":
        program = step.lower(params, data[0])
        out["program"] = program.as_text()
    return out


def region_fn(params, batch):
    """A model with autocast blocks of its own: the MLP in bf16, a nested block with
    autocast off in float32, the loss outside."""
    x = batch["x"]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = F.gelu(F.linear(x, params["w1"], params["b1"]))
        with torch.autocast("cpu", enabled=False):
            h = F.layer_norm(h.float(), (h.shape[-1],), params["ln"])
        h = F.linear(h, params["w2"])
        s = torch.softmax(h, dim=-1)
    return ((s.float() - batch["y"]) ** 2).mean() + h.float().pow(2).mean()


def region_setup():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(64, 32, generator=g) / 6, "b1": torch.randn(64, generator=g),
              "ln": torch.ones(64), "w2": torch.randn(16, 64, generator=g) / 8}
    batch = {"x": torch.randn(8, 32, generator=g), "y": torch.rand(8, 16, generator=g)}
    return params, batch


def autocast_regions(specs):
    """`region_fn` under shard on 2 ranks against eager autocast on one process: loss and
    gradients, and the dtypes the IR gives the autocast values."""
    params, batch = region_setup()
    ref_params = optree.tree_map(lambda t: t.clone().requires_grad_(), params)
    ref = region_fn(ref_params, batch)
    ref.backward()
    ref_grads = optree.tree_map(lambda t: t.grad, ref_params)
    step = pxform.shard(region_fn, mesh=pxform.Mesh({"dp": 2}), in_specs=specs)
    loss, grads = pxform.value_and_grad(step)(params, batch)
    full = pxform.gather(grads)
    # relative to each gradient's largest entry: a bf16 weight gradient is rounded per rank
    # and summed in float32, against rounded once over the whole batch on one process
    errs = {k: float((full[k] - ref_grads[k]).abs().max() / ref_grads[k].abs().max())
            for k in params}
    traced = pxform.trace(region_fn, params, batch)
    return {"loss_err": abs(float(loss) - float(ref.detach())), "grad_errs": errs,
            "grad_dtypes": sorted({str(g.dtype) for g in full.values()}),
            "ir": str(traced)}


def collective_dtypes(mode, **policy):
    """(kind, dtype) of every collective one training step of `mode` under
    `Precision(**policy)` launches, seen by a dispatch mode on the real gloo step."""
    from torch.utils._python_dispatch import TorchDispatchMode

    cfg, params, data = setup()
    step = make_step(mode, cfg, params, pxform.Precision(**policy))
    local, batch = step.distribute(params, data[0])
    grad_fn = pxform.value_and_grad(step)
    grad_fn(local, batch)  # compiled outside the mode
    seen = []
    kinds = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
             "all_reduce": "all_reduce", "all_reduce_": "all_reduce"}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func._schema.name
            if name.startswith("_c10d_functional::"):
                kind = kinds.get(name.split("::")[1])
                if kind is not None:
                    seen.append((kind, str(args[0].dtype)))
            return func(*args, **(kwargs or {}))

    with Record():
        grad_fn(local, batch)
    return seen


def clipped_and_accumulated(mode, max_norm=0.5, pieces=2):
    """Gradient clipping by global norm over pxform's DTensor gradients
    (`torch.nn.utils.clip_grad_norm_`) and gradient accumulation over `pieces` calls,
    against one process: the norm, and the clipped accumulated gradients' largest
    difference."""
    import gpt

    cfg, params, data = setup()
    step = make_step(mode, cfg, params, None)
    batch = data[0]
    halves = [{k: v[i::pieces] for k, v in batch.items()} for i in range(pieces)]
    # one process: the mean loss over the whole batch = the mean of the pieces' means
    ref_params = optree.tree_map(lambda t: t.clone().requires_grad_(), params)
    for h in halves:
        (gpt.loss_fn(ref_params, h, cfg) / pieces).backward()
    ref_leaves = optree.tree_leaves(ref_params)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_leaves, max_norm)
    grad_fn = pxform.value_and_grad(step)
    local = params if mode == "pipeline" else step.distribute(params, halves[0])[0]
    held = optree.tree_leaves(local, none_is_leaf=True)
    for h in halves:  # accumulate: add each piece's gradients into .grad
        lb = h if mode == "pipeline" else step.distribute(params, h)[1]
        _, grads = grad_fn(local, lb)
        for p, g in zip(held, optree.tree_leaves(grads, none_is_leaf=True)):
            if p is not None and g is not None:
                p.grad = g / pieces if p.grad is None else p.grad + g / pieces
    owned = [p for p in held if p is not None and p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(owned, max_norm)
    full = pxform.gather(optree.tree_map(lambda p: p.grad, local))
    err = max(float((f - r.grad).abs().max()) for f, r in
              zip(optree.tree_leaves(full), ref_leaves))
    return {"norm": float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
            "ref_norm": float(ref_norm), "grad_err": err}


def composed(kind):
    """One bf16 step of GPT small in compositions beyond one transform, against float32 on
    one process: loss difference, largest relative gradient difference, gradient dtypes.

    - "auto": `pxform.auto(..., precision=)`, searched for this world and run;
    - "pp_in_shard": `shard(pipeline(...), mesh={"pp": 2}, precision=)` (the pipeline
      follows the shard's policy);
    - "recompute_zero3": ZeRO-3 with every block under `pxform.recompute`."""
    import gpt

    cfg, params, data = setup()
    batch = data[0]
    ref_loss, ref_grads = pxform.value_and_grad(lambda p, b: gpt.loss_fn(p, b, cfg))(
        params, batch)
    policy = pxform.Precision()
    if kind == "auto":
        step = pxform.auto(lambda p, b: gpt.loss_fn(p, b, cfg), mesh=2, precision=policy)
        step.plan(params, batch)
        local = step.init(lambda: params)
        loss, grads = pxform.value_and_grad(step)(local, batch)
    elif kind == "pp_in_shard":
        inner = make_step("pipeline", cfg, params, None)
        step = pxform.shard(inner, mesh=pxform.Mesh({"pp": 2}), in_specs=(None, None),
                            precision=policy)
        loss, grads = pxform.value_and_grad(step)(params, batch)
    elif kind == "recompute_zero3":
        block = pxform.recompute(lambda p, x: gpt.block(p, x, cfg))

        def trunk(blocks, x):
            for p in blocks:
                x = block(p, x)
            return x

        step = pxform.shard(lambda p, b: gpt.loss_fn(p, b, cfg, trunk),
                            mesh=pxform.Mesh({"dp": 2}),
                            in_specs=(zero3_specs(params),
                                      {"idx": P("dp"), "targets": P("dp")}),
                            precision=policy)
        local, lb = step.distribute(params, batch)
        loss, grads = pxform.value_and_grad(step)(local, lb)
    else:
        raise ValueError(kind)
    full = pxform.gather(grads)
    rel = 0.0
    dtypes = set()
    for r, g in zip(optree.tree_leaves(ref_grads, none_is_leaf=True),
                    optree.tree_leaves(full, none_is_leaf=True)):
        if g is None:
            continue
        dtypes.add(str(g.dtype))
        rel = max(rel, float((g.float() - r).abs().max() / r.abs().max().clamp(min=1e-12)))
    return {"loss_err": abs(float(loss.detach()) - float(ref_loss.detach())),
            "grad_rel_err": rel, "grad_dtypes": sorted(dtypes)}


def policy_step(mode, **policy):
    """One step of `mode` under `Precision(**policy)` against float32 on one process: loss
    error and dtype, the largest gradient error relative to its scale, gradient dtypes."""
    import gpt

    cfg, params, data = setup()
    ref_loss, ref_grads = pxform.value_and_grad(lambda p, b: gpt.loss_fn(p, b, cfg))(
        params, data[0])
    step = make_step(mode, cfg, params, pxform.Precision(**policy))
    local, batch = (params, data[0]) if mode == "pipeline" else \
        step.distribute(params, data[0])
    loss, grads = pxform.value_and_grad(step)(local, batch)
    full = pxform.gather(grads)
    rel, dtypes = 0.0, set()
    for r, g in zip(optree.tree_leaves(ref_grads, none_is_leaf=True),
                    optree.tree_leaves(full, none_is_leaf=True)):
        if g is not None:
            dtypes.add(str(g.dtype))
            rel = max(rel, float((g.float() - r).abs().max() / r.abs().max().clamp(min=1e-12)))
    return {"loss_err": abs(float(loss.detach()) - float(ref_loss.detach())),
            "loss_dtype": str(loss.dtype), "grad_rel_err": rel, "grad_dtypes": sorted(dtypes)}
