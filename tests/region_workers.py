"""Functions run on gloo ranks (and on one process) by the recompute and coshard tests:
the example GPT with its layers wrapped in `pxform.recompute` under each policy, or with
parts of it cosharded along the batch, the sequence and the heads."""

from __future__ import annotations

import optree
import torch
import torch.nn.functional as F

import pxform
from pxform import P

SMALL = dict(vocab_size=96, seq_len=16, num_heads=2, d_model=32)

VARIANTS = ("plain", "nothing", "matmuls", "names", "predicate", "trunk", "coshard_batch",
            "coshard_seq", "coshard_heads", "coshard_loss", "overlap")


def setup(num_layers=2, batch=8, dtype=torch.float64):
    import gpt

    cfg = gpt.GPTConfig(num_layers=num_layers, **SMALL)
    params = gpt.init_params(cfg, dtype=dtype)
    data = gpt.make_batch(cfg, batch)
    data["targets"][0, :5] = -100  # ignored targets: the mean divides by a data count
    return cfg, params, data


def named_block(p, x, cfg):
    """The GPT block with its attention output named "attn" for a recompute policy."""
    import gpt

    d = cfg.d_model
    h = gpt.attention(p, F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"]), cfg)
    x = x + pxform.checkpoint_name(h, "attn")
    return x + gpt.mlp(p, F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"]), cfg)


def heads_attention(w, x, cfg):
    """Attention on a piece of the heads: `w["qkv"]` is [3, heads, head_dim, d] and
    `w["proj"]` [d, heads, head_dim], so a coshard along dim 1 of both splits the heads.
    The projection's bias is added by the caller (the pieces' outputs are summed)."""
    b, t, d = x.shape
    hd = cfg.head_dim

    def project(k):
        y = F.linear(x, w["qkv"][k].reshape(-1, d), w["qkv_b"][k].reshape(-1))
        return y.view(b, t, -1, hd).transpose(1, 2)

    y = F.scaled_dot_product_attention(project(0), project(1), project(2), is_causal=True)
    y = y.transpose(1, 2).reshape(b, t, -1)
    return F.linear(y, w["proj"].reshape(d, -1))


def make_loss(variant, cfg, chunks=2):
    """The GPT loss with `variant` applied to every layer (see VARIANTS)."""
    import gpt

    d, nh, hd = cfg.d_model, cfg.num_heads, cfg.head_dim

    def layer(p, x):
        if variant in ("plain", "coshard_loss", "trunk"):
            return gpt.block(p, x, cfg)
        if variant in ("overlap", "pieces", "overlap_recomputed"):
            # batch pieces, overlapping their collectives (and all recomputed together)
            pieces = pxform.coshard(lambda p, x: gpt.block(p, x, cfg), chunks=chunks,
                                    dim=(None, 0), recompute=False,
                                    overlap=variant != "pieces")
            if variant == "overlap_recomputed":
                return pxform.recompute(pieces)(p, x)
            return pieces(p, x)
        if variant == "nothing":
            return pxform.recompute(lambda p, x: gpt.block(p, x, cfg))(p, x)
        if variant == "matmuls":
            return pxform.recompute(lambda p, x: gpt.block(p, x, cfg), policy="matmuls")(p, x)
        if variant == "names":
            return pxform.recompute(lambda p, x: named_block(p, x, cfg), policy=["attn"])(p, x)
        if variant == "predicate":
            def save_gelu(op):
                return op.name == "gelu"
            return pxform.recompute(lambda p, x: gpt.block(p, x, cfg), policy=save_gelu)(p, x)
        h = F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"])
        if variant == "coshard_batch":
            att = pxform.coshard(lambda p, h: gpt.attention(p, h, cfg), chunks=chunks,
                                 dim=(None, 0))
            x = x + att(p, h)
        elif variant == "coshard_heads":
            w = {"qkv": p["qkv_w"].view(3, nh, hd, d), "qkv_b": p["qkv_b"].view(3, nh, hd),
                 "proj": p["proj_w"].view(d, nh, hd)}
            att = pxform.coshard(lambda w, h: heads_attention(w, h, cfg), chunks=chunks,
                                 dim=(1, None))
            x = x + att(w, h) + p["proj_b"]
        else:
            x = x + gpt.attention(p, h, cfg)
        h = F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"])
        if variant == "coshard_seq":
            return x + pxform.coshard(lambda p, h: gpt.mlp(p, h, cfg), chunks=chunks,
                                      dim=(None, 1))(p, h)
        return x + gpt.mlp(p, h, cfg)

    def head(params, x, targets):
        x = F.layer_norm(x, (d,), params["lnf_w"], params["lnf_b"])
        logits = F.linear(x, params["wte"])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def loss(params, batch):
        t = batch["idx"].shape[1]
        pos = torch.arange(t, device=batch["idx"].device)
        x = F.embedding(batch["idx"], params["wte"]) + F.embedding(pos, params["wpe"])
        if variant == "trunk":  # every layer in one region
            def trunk(blocks, x):
                for p in blocks:
                    x = layer(p, x)
                return x
            x = pxform.recompute(trunk)(params["blocks"], x)
        else:
            for p in params["blocks"]:
                x = layer(p, x)
        if variant == "coshard_loss":  # the vocabulary-sized logits, a batch piece at a time
            head_fn = pxform.coshard(head, chunks=chunks, dim=(None, 0, 0))
            return head_fn(params, x, batch["targets"])
        return head(params, x, batch["targets"])

    loss.__name__ = f"gpt_{variant}"
    return loss


def errors(loss, grads, ref_loss, ref_grads):
    paths, leaves, _ = optree.tree_flatten_with_path(grads, none_is_leaf=True)
    ref = dict(zip(*optree.tree_flatten_with_path(ref_grads)[:2]))
    err = 0.0
    for path, g in zip(paths, leaves):
        if g is None:
            continue
        err = max(err, float((pxform.gather(g) - ref[path]).abs().max()))
    return {"loss_err": abs(float(loss) - float(ref_loss)), "grad_err": err}


def tp_specs(params):
    """Megatron TP of the MLPs (column then row parallel); the rest replicated."""
    block = {"fc_w": P("tp", None), "fc_b": P("tp"), "out_w": P(None, "tp")}
    return {k: ([{n: block.get(n) for n in b} for b in v] if k == "blocks" else None)
            for k, v in params.items()}


def run_sharded(variants, axes, batch_axis=None, tp=False):
    """value_and_grad of each variant under `pxform.shard` on `axes`, against the
    single-process plain GPT; also the collectives the recomputed program runs."""
    from pxform.runtime.graph_module import module_of

    cfg, params, batch = setup()
    ref_loss, ref_grads = pxform.value_and_grad(make_loss("plain", cfg))(params, batch)
    mesh = pxform.Mesh(axes)
    bspec = {"idx": P(batch_axis), "targets": P(batch_axis)} if batch_axis else None
    out = {}
    for v in variants:
        step = pxform.shard(make_loss(v, cfg), mesh=mesh,
                            in_specs=(tp_specs(params) if tp else None, bspec))
        loss, grads = pxform.value_and_grad(step)(params, batch)
        out[v] = errors(loss, grads, ref_loss, ref_grads)
        program = step.lower(params, batch)
        out[v]["recompute_modules"] = sum(1 for n, _ in module_of(program).named_children()
                                          if n.startswith("recompute_"))
        # collectives launched and never waited for (a recompute that stopped early)
        out[v]["unwaited"] = torch._C._distributed_c10d._get_work_registry_size()
    return out


def run_pipeline(variant, schedule, stages, microbatches, num_layers=4, **options):
    """value_and_grad of the pipelined variant against the single-process plain GPT."""
    cfg, params, batch = setup(num_layers)
    ref_loss, ref_grads = pxform.value_and_grad(make_loss("plain", cfg))(params, batch)
    step = pxform.pipeline(make_loss(variant, cfg), stages=stages, microbatches=microbatches,
                           schedule=schedule, **options)
    loss, grads = pxform.value_and_grad(step)(params, batch)
    out = errors(loss, grads, ref_loss, ref_grads)
    out["forward_only"] = abs(float(step(params, batch)) - float(ref_loss))
    return out


def pipeline_memory(recompute, budget=None, num_layers=8, microbatches=8, batch=16):
    """Measure each rank's memory in one pipelined step (4 stages) with the meter: the peak
    of what the step allocates plus this stage's parameters (every rank is handed all the
    parameters, so the meter's baseline would count the other stages' too)."""
    import torch.distributed as dist

    cfg, params, data = setup(num_layers, batch)
    step = pxform.pipeline(make_loss("plain", cfg), stages=4, microbatches=microbatches,
                           recompute=recompute, memory_budget=budget)
    ref_loss, ref_grads = pxform.value_and_grad(make_loss("plain", cfg))(params, data)
    pxform.value_and_grad(step)(params, data)  # compile outside the measurement
    with pxform.MemoryMeter() as meter:
        meter.track(params, data)
        loss, grads = pxform.value_and_grad(step)(params, data)
    plan = step.recompute_plan(params, data)
    rank = dist.get_rank()
    program = step.lower(params, data)
    stage = program.stages[rank]
    inputs = [v for v in stage.program.inputs][:len(stage.graph_inputs)]
    param_bytes = sum(v.type.nbytes for v in inputs if v.type.dtype.is_floating_point)
    stats = meter.stats
    out = errors(loss, grads, ref_loss, ref_grads)
    out.update(measured=stats.peak_bytes - stats.baseline_bytes + param_bytes,
               estimate=plan.stages[rank].estimate_bytes, counts=plan.counts,
               saved=stats.saved_bytes, text=str(plan))
    return out


def count_collectives(variants):
    """How many collectives each variant's step runs under tensor parallelism (tp=2):
    a recomputed region runs its collectives again in backward."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(k in str(func) for k in ("all_reduce", "reduce_scatter", "all_gather")):
                self.n += 1
            return func(*args, **(kwargs or {}))

    cfg, params, batch = setup()
    mesh = pxform.Mesh({"tp": 2})
    out = {}
    for v in variants:
        step = pxform.shard(make_loss(v, cfg), mesh=mesh, in_specs=(tp_specs(params), None))
        pxform.value_and_grad(step)(params, batch)  # compile first
        with Count() as c:
            pxform.value_and_grad(step)(params, batch)
        out[v] = c.n
    return out


def overlap_order(variant="overlap"):
    """One training step of `variant` under Megatron tensor parallelism of the MLPs (tp=2):
    how many of its collectives have a matmul run between their launch and the first wait
    for their result (forward and backward), and the program's text."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class Order(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.running = {}  # id of a collective's result -> [it, matmuls since launch]
            self.overlapped = self.collectives = 0

        def waited(self, t):
            entry = self.running.pop(id(t), None)
            if entry is not None:
                self.overlapped += entry[1] > 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func)
            for a in optree.tree_leaves((args, kwargs)):
                if isinstance(a, AsyncCollectiveTensor):  # an op reading it waits
                    self.waited(a.elem)
            if "wait_tensor" in name:
                self.waited(args[0])
            out = func(*args, **(kwargs or {}))
            if "_c10d_functional" in name and "wait_tensor" not in name:
                self.collectives += 1
                self.running[id(out)] = [out, 0]
            elif any(k in name for k in ("aten.mm", "aten.addmm", "aten.bmm")):
                for entry in self.running.values():
                    entry[1] += 1
            return out

    cfg, params, batch = setup()
    step = pxform.shard(make_loss(variant, cfg), mesh=pxform.Mesh({"tp": 2}),
                        in_specs=(tp_specs(params), None))
    pxform.value_and_grad(step)(params, batch)  # compile first
    with Order() as order:
        pxform.value_and_grad(step)(params, batch)
    return {"overlapped": order.overlapped, "collectives": order.collectives,
            "text": step.lower(params, batch).as_text()}


def searched_memory(batch=16):
    """The example GPT "small" in float32 under `pxform.auto`, every block data parallel
    or every block tensor parallel, with and without recompute (pinned): per case the
    plan's predicted peak and the peak `pxform.measure` reads (SGD without momentum: no
    optimizer state on either side)."""
    import gpt

    from pxform.search import Pin
    from pxform.search.space import Option

    cfg = gpt.GPT_CONFIGS["small"]
    params = gpt.init_params(cfg, dtype=torch.float32)
    data = gpt.make_batch(cfg, batch)

    def loss(p, b):
        return gpt.loss_fn(p, b, cfg)

    world = torch.distributed.get_world_size()
    num_blocks = len(pxform.auto(loss, mesh=world, hardware="a100-40gb",
                                 optimizer="sgd").plan(params, data).blocks)
    out = {}
    for role, recompute in ((("outer", "dp"), False), (("outer", "dp"), True),
                            (("inner", "tp"), False), (("inner", "tp"), True)):
        outer, inner = (world, 1) if role[0] == "outer" else (1, world)
        pin = Pin(stages=1, outer=outer, inner=inner, microbatches=1,
                  block_options=(Option((role,), recompute),) * num_blocks)
        step = pxform.auto(loss, mesh=world, hardware="a100-40gb", plan=pin, optimizer="sgd")
        plan = step.plan(params, data)
        dparams, _ = step.distribute(params, data)
        measured = pxform.measure(step, dparams, data, steps=1, warmup=1)
        out[role[1], recompute] = (plan.peak_memory_bytes,
                                   measured.ranks[torch.distributed.get_rank()].peak_memory_bytes)
    return out
