"""Worker functions for tests/test_init.py: `step.init` and `pxform.module_init` on a gloo
world (issue 17: initialise and hold only your shards, the same numbers under every plan)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from gpt import GPT_CONFIGS, GPTConfig, loss_fn

import pxform
from pxform import P

CFG = GPT_CONFIGS["tiny"]


def init_gpt(cfg: GPTConfig) -> dict:
    """A GPT initialiser using torch's default generator and torch.nn.init (truncated
    normal for the embeddings, normal for the rest, constants for norms and biases)."""
    d = cfg.d_model
    proj = 0.02 / math.sqrt(2 * cfg.num_layers)

    def normal(*shape, s=0.02):
        return torch.randn(*shape) * s

    wte = torch.empty(cfg.vocab_size, d)
    torch.nn.init.trunc_normal_(wte, std=0.02)
    blocks = [{
        "ln1_w": torch.ones(d), "ln1_b": torch.zeros(d),
        "qkv_w": normal(3 * d, d), "qkv_b": torch.zeros(3 * d),
        "proj_w": normal(d, d, s=proj), "proj_b": torch.zeros(d),
        "ln2_w": torch.ones(d), "ln2_b": torch.zeros(d),
        "fc_w": normal(4 * d, d), "fc_b": torch.zeros(4 * d),
        "out_w": normal(d, 4 * d, s=proj), "out_b": torch.zeros(d),
    } for _ in range(cfg.num_layers)]
    return {"wte": wte, "wpe": normal(cfg.seq_len, d, s=0.01), "blocks": blocks,
            "lnf_w": torch.ones(d), "lnf_b": torch.zeros(d)}


def gpt_loss(params, batch):
    return loss_fn(params, batch, CFG)


def batch_meta(cfg=CFG, batch_size=8):
    shape = (batch_size, cfg.seq_len)
    return {"idx": torch.empty(shape, dtype=torch.long, device="meta"),
            "targets": torch.empty(shape, dtype=torch.long, device="meta")}


def tp_specs(params):
    def spec(name):
        return {"qkv_w": P("tp"), "qkv_b": P("tp"), "fc_w": P("tp"), "fc_b": P("tp"),
                "proj_w": P(None, "tp"), "out_w": P(None, "tp")}.get(name)
    return {**{k: None for k in ("wte", "wpe", "lnf_w", "lnf_b")},
            "blocks": [{k: spec(k) for k in b} for b in params["blocks"]]}


def make_step(plan, num_ranks, params_like=None):
    if plan == "dp":
        return pxform.shard(gpt_loss, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(None, P("dp")))
    if plan == "zero3":
        return pxform.shard(gpt_loss, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(P("dp"), P("dp")))
    if plan == "tp":
        return pxform.shard(gpt_loss, mesh=pxform.Mesh({"tp": num_ranks}),
                            in_specs=(tp_specs(params_like), None))
    if plan == "pp_dp":
        return pxform.shard(pxform.pipeline(gpt_loss, stages=2, microbatches=2),
                            mesh=pxform.Mesh({"pp": 2, "dp": num_ranks // 2}),
                            in_specs=(None, P("dp")))
    if plan == "pp_zero3":
        return pxform.shard(pxform.pipeline(gpt_loss, stages=2, microbatches=2),
                            mesh=pxform.Mesh({"pp": 2, "dp": num_ranks // 2}),
                            in_specs=(P("dp"), P("dp")))
    raise ValueError(plan)


def train_step(step, params, batch, opt):
    """One step: gradients onto the parameters this rank holds, then the optimizer."""
    import optree
    loss, grads = pxform.value_and_grad(step)(params, batch)
    for p, g in zip(optree.tree_leaves(params, none_is_leaf=True),
                    optree.tree_leaves(grads, none_is_leaf=True)):
        if p is not None:
            p.grad = g
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss)


def init_matches(plan, num_ranks):
    """Initialise under `plan`; gather what this rank holds and compare bitwise with the
    1-process run (the traced initialiser on this process, same generator state)."""
    import optree
    like = pxform.trace(init_gpt, CFG)  # the parameters' structure, for tp_specs
    params_like = optree.tree_unflatten(like.out_tree, [None] * len(like.graph.outputs))
    step = make_step(plan, num_ranks, params_like)
    torch.manual_seed(11)
    params = step.init(init_gpt, CFG, batch=(batch_meta(),)) if plan.startswith("pp") \
        else step.init(init_gpt, CFG)
    after = torch.get_rng_state()
    torch.manual_seed(11)
    ref = pxform.trace(init_gpt, CFG)(CFG)
    same_state = torch.equal(after, torch.get_rng_state())
    mine = optree.tree_leaves(params, none_is_leaf=True)
    theirs = optree.tree_leaves(ref)
    paths = optree.tree_paths(ref)
    held, equal, types = [], True, set()
    for path, a, b in zip(paths, mine, theirs):
        if a is None:
            continue
        types.add(type(a).__name__)
        held.append(".".join(map(str, path)))
        full = a.full_tensor()
        equal = equal and torch.equal(full, b)
    return {"held": held, "equal": equal, "same_state": same_state, "types": sorted(types),
            "num": len(theirs)}


def init_memory(num_ranks):
    """ZeRO-3 init of a GPT: this rank's metered peak during init, the model's size and
    the largest single shard."""
    cfg = GPTConfig(vocab_size=4096, seq_len=128, num_layers=2, num_heads=4, d_model=512)
    step = pxform.shard(lambda p, b: loss_fn(p, b, cfg), mesh=pxform.Mesh({"dp": num_ranks}),
                        in_specs=(P("dp"), P("dp")))
    torch.manual_seed(0)
    with pxform.MemoryMeter() as meter:
        params = step.init(init_gpt, cfg)
    leaves = [p for p in __import__("optree").tree_leaves(params)]
    total = sum(p.numel() * p.element_size() for p in leaves)
    largest = max(p.to_local().numel() * p.element_size() for p in leaves)
    return {"peak": meter.stats.peak_bytes, "total": total, "largest_shard": largest,
            "held": sum(p.to_local().numel() * p.element_size() for p in leaves)}


def meta_error():
    step = pxform.shard(gpt_loss, mesh=pxform.Mesh({"dp": 2}), in_specs=(None, P("dp")))
    from gpt import init_params, make_batch
    params = init_params(CFG, device="meta")
    batch = make_batch(CFG, 4)
    out = {}
    try:
        step(params, batch)
    except pxform.PxformError as exc:
        out["call"] = str(exc)
    try:
        step.distribute(params)
    except pxform.PxformError as exc:
        out["distribute"] = str(exc)
    return out


def trains_after_init(plan, num_ranks, steps=3):
    """Init under `plan`, then a few AdamW steps; compared with one process starting from
    the same init (the traced initialiser) with the same data."""
    import optree
    from gpt import make_batch
    step = make_step(plan, num_ranks)
    torch.manual_seed(5)
    params = step.init(init_gpt, CFG, batch=(batch_meta(),)) if plan.startswith("pp") \
        else step.init(init_gpt, CFG)
    torch.manual_seed(5)
    ref = pxform.trace(init_gpt, CFG)(CFG)
    mine = [p for p in optree.tree_leaves(params) if p is not None]
    opt = torch.optim.AdamW(mine, lr=1e-2)
    ref_leaves = optree.tree_leaves(ref)
    ref_leaves = [t.clone().requires_grad_(True) for t in ref_leaves]
    ref_params = optree.tree_unflatten(optree.tree_structure(ref), ref_leaves)
    ref_opt = torch.optim.AdamW(ref_leaves, lr=1e-2)
    losses, ref_losses = [], []
    for k in range(steps):
        batch = make_batch(CFG, 8, seed=k)
        losses.append(train_step(step, params, batch, opt))
        ref_loss = gpt_loss(ref_params, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(ref_loss.detach()))
    err = 0.0
    for p, r in zip(optree.tree_leaves(params, none_is_leaf=True), ref_leaves):
        if p is not None:
            err = max(err, float((p.full_tensor() - r.detach()).abs().max()))
    return {"losses": losses, "ref_losses": ref_losses, "param_err": err}


def llama_from_meta():
    """HF Llama built on meta, initialised by module_init under ZeRO-3 on 2 ranks."""
    import transformers
    transformers.logging.set_verbosity_error()
    cfg = transformers.LlamaConfig(vocab_size=2048, hidden_size=256, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=1024,
                                   num_hidden_layers=2, max_position_embeddings=64)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    fn, params = pxform.module_fn(model)

    def loss(params, batch):
        return fn(params, input_ids=batch["ids"], labels=batch["ids"]).loss

    step = pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}), in_specs=(P("dp"), P("dp")))

    def rss():
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS"):
                    return int(line.split()[1]) * 1024
        return 0

    torch.manual_seed(0)
    with pxform.MemoryMeter() as meter:
        params = step.init(pxform.module_init(model))
    total = sum(p.numel() * p.element_size() for p in params.values())
    held = sum(p.to_local().numel() * p.element_size() for p in params.values())
    largest = max(p.to_local().numel() * p.element_size() for p in params.values())
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=torch.Generator().manual_seed(1))
    first = float(step(params, {"ids": ids}))
    eager = transformers.LlamaForCausalLM(cfg)  # real weights: its rotary buffer
    rotary = [k for k in params if k.endswith("inv_freq")]
    rot_err = max(float((params[k].full_tensor() - dict(eager.named_buffers())[k]).abs().max())
                  for k in rotary)
    std = float(params["model.layers.0.mlp.up_proj.weight"].full_tensor().std())
    return {"first_loss": first, "ln_vocab": math.log(cfg.vocab_size), "total": total,
            "held": held, "peak": meter.stats.peak_bytes, "rotary": rotary, "largest": largest,
            "rot_err": rot_err, "std": std, "init_range": cfg.initializer_range, "rss": rss()}


BIG = GPTConfig(vocab_size=1024, seq_len=32, num_layers=4, num_heads=4, d_model=256)


def big_loss(params, batch):
    """GPT loss with every block recomputed: the weights a block gathers (ZeRO-3) are
    freed after its forward and gathered again for its backward."""
    import gpt
    cfg = BIG
    idx = batch["idx"]
    pos = torch.arange(idx.shape[1], device=idx.device)
    x = F.embedding(idx, params["wte"]) + F.embedding(pos, params["wpe"])
    for p in params["blocks"]:
        x = pxform.recompute(lambda p, x: gpt.block(p, x, cfg))(p, x)
    x = F.layer_norm(x, (cfg.d_model,), params["lnf_w"], params["lnf_b"])
    logits = F.linear(x, params["wte"])
    return F.cross_entropy(logits.flatten(0, 1), batch["targets"].flatten())


def too_large(plan, num_ranks, steps=3):
    """A GPT trained from init on `num_ranks` ranks (ZeRO-3, or 2 stages x ZeRO-3), every
    block recomputed: this rank's metered peak (init, steps and AdamW state included)
    against the model's float32 training state (parameters, gradients, Adam moments), and
    the losses against one process from the same init."""
    import optree
    from gpt import make_batch
    if plan == "zero3":
        step = pxform.shard(big_loss, mesh=pxform.Mesh({"dp": num_ranks}),
                            in_specs=(P("dp"), P("dp")))
    else:
        step = pxform.shard(pxform.pipeline(big_loss, stages=2, microbatches=2),
                            mesh=pxform.Mesh({"pp": 2, "dp": num_ranks // 2}),
                            in_specs=(P("dp"), P("dp")))
    batches = [make_batch(BIG, 8, seed=k) for k in range(steps)]
    torch.manual_seed(3)
    losses = []
    with pxform.MemoryMeter() as meter:
        params = step.init(init_gpt, BIG, batch=(batches[0],)) if plan != "zero3" \
            else step.init(init_gpt, BIG)
        mine = [p for p in optree.tree_leaves(params) if p is not None]
        opt = torch.optim.AdamW(mine, lr=1e-3)
        for batch in batches:
            losses.append(train_step(step, params, batch, opt))
    peak = meter.stats.peak_bytes
    held = sum(p.to_local().numel() * 4 for p in mine)
    final = {".".join(map(str, k)): p for k, p in zip(
        optree.tree_paths(params, none_is_leaf=True),
        optree.tree_leaves(params, none_is_leaf=True))}
    # the 1-process run, outside the meter
    torch.manual_seed(3)
    ref = pxform.trace(init_gpt, BIG)(BIG)
    leaves = [t.clone().requires_grad_(True) for t in optree.tree_leaves(ref)]
    ref_params = optree.tree_unflatten(optree.tree_structure(ref), leaves)
    ref_opt = torch.optim.AdamW(leaves, lr=1e-3)
    ref_losses = []
    for batch in batches:
        loss = big_loss(ref_params, batch)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(float(loss.detach()))
    err = 0.0
    for k, r in zip(optree.tree_paths(ref), leaves):
        p = final[".".join(map(str, k))]
        if p is not None:
            err = max(err, float((p.full_tensor() - r.detach()).abs().max()))
    state = 16 * sum(t.numel() for t in leaves)  # fp32 params, grads, two Adam moments
    return {"peak": peak, "state": state, "held": held, "losses": losses,
            "ref_losses": ref_losses, "param_err": err}


def pipeline_and_auto_init():
    """`init` on a pipeline alone (whole tensors, only this stage's leaves) and on `auto`
    after `plan`; then a step on the initialised parameters equals one process's."""
    import optree
    from gpt import init_params, make_batch
    batch = make_batch(CFG, 8)
    torch.manual_seed(2)
    ref = pxform.trace(init_gpt, CFG)(CFG)
    ref_loss = float(gpt_loss(ref, batch))
    out = {}
    pipe = pxform.pipeline(gpt_loss, stages=2, microbatches=2)
    torch.manual_seed(2)
    params = pipe.init(init_gpt, CFG, batch=(batch,))
    leaves = optree.tree_leaves(params, none_is_leaf=True)
    out["pipe_types"] = sorted({type(p).__name__ for p in leaves})
    out["pipe_equal"] = all(torch.equal(p, r) for p, r in zip(leaves, optree.tree_leaves(ref))
                            if p is not None)
    out["pipe_loss_err"] = abs(float(pipe(params, batch)) - ref_loss)
    step = pxform.auto(gpt_loss, mesh=2, memory_budget="1GiB", hardware="a100-40gb")
    try:
        step.init(init_gpt, CFG)
    except pxform.PxformError as exc:
        out["before_plan"] = str(exc)
    step.plan(init_params(CFG, device="meta"), batch)
    torch.manual_seed(2)
    params = step.init(init_gpt, CFG)
    out["auto_equal"] = all(torch.equal(p.full_tensor(), r) for p, r in zip(
        optree.tree_leaves(params, none_is_leaf=True), optree.tree_leaves(ref))
        if p is not None)
    out["auto_loss_err"] = abs(float(step(params, batch)) - ref_loss)
    return out


def shard_init_direct():
    """`pxform.shard(init_fn, in_specs=(), out_specs=...)()`: the initialiser itself under
    shard; each rank's program allocates only its pieces (local shapes in the program)."""
    import optree
    specs = {"wte": P("dp"), "wpe": P(None, "dp"), "lnf_w": P("dp"), "lnf_b": None,
             "blocks": P("dp")}
    step = pxform.shard(init_gpt, mesh=pxform.Mesh({"dp": 2}), in_specs=(),
                        out_specs=specs)
    torch.manual_seed(4)
    params = step(CFG)
    torch.manual_seed(4)
    ref = pxform.trace(init_gpt, CFG)(CFG)
    equal = all(torch.equal(p.full_tensor() if hasattr(p, "full_tensor") else p, r)
                for p, r in zip(optree.tree_leaves(params), optree.tree_leaves(ref)))
    program = step.lower(CFG)
    whole = [str(i.op) for i in program.instrs if hasattr(i, "op")
             and any(program.local_shape(v) == v.type.shape and v.type.numel > CFG.d_model
                     for v in i.outputs)]
    return {"equal": equal, "wte_type": type(params["wte"]).__name__,
            "lnf_b_type": type(params["lnf_b"]).__name__, "whole": whole}


def reshard_peak(reshard, num_ranks, layers=4, d_model=256, batch_size=4):
    """One ZeRO-3 training step of a GPT whose layers are larger than its activations
    (no recompute): this rank's metered peak, with gathered weights freed after forward or
    kept until backward; and the loss and gradients against one process."""
    import optree
    from gpt import init_params, make_batch
    cfg = GPTConfig(vocab_size=512, seq_len=16, num_layers=layers, num_heads=4,
                    d_model=d_model)
    step = pxform.shard(lambda p, b: loss_fn(p, b, cfg), mesh=pxform.Mesh({"dp": num_ranks}),
                        in_specs=(P("dp"), P("dp")), reshard_after_forward=reshard)
    params = init_params(cfg, dtype=torch.float64)
    batch = make_batch(cfg, batch_size)
    dparams = step.distribute(params, batch)[0]
    pxform.value_and_grad(step)(dparams, batch)  # compiled outside the meter
    with pxform.MemoryMeter() as meter:
        meter.track(dparams, batch)
        loss, grads = pxform.value_and_grad(step)(dparams, batch)
    ref_loss, ref_grads = pxform.value_and_grad(lambda p, b: loss_fn(p, b, cfg))(params, batch)
    grads = pxform.gather(grads)
    err = max(float((g - r).abs().max()) for g, r in zip(optree.tree_leaves(grads),
                                                          optree.tree_leaves(ref_grads)))
    block = sum(t.numel() * 8 for t in params["blocks"][0].values())
    shards = sum(t.to_local().numel() * 8 for t in optree.tree_leaves(dparams))
    return {"peak": meter.stats.peak_bytes, "baseline": meter.stats.baseline_bytes
            if hasattr(meter.stats, "baseline_bytes") else None,
            "block": block, "shards": shards,
            "model": sum(t.numel() * 8 for t in optree.tree_leaves(params)),
            "loss_err": abs(float(loss) - float(ref_loss)), "grad_err": err}
