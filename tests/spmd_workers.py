"""Functions run on gloo ranks by the SPMD tests (module level, so workers can import them)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pxform.core.layout import Layout
from pxform.core.spec import P


def mlp_loss(params, batch):
    h = F.gelu(F.linear(batch["x"], params["w1"], params["b1"]))
    return ((h @ params["w2"] - batch["y"]) ** 2).mean()


def mlp_args():
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(8, 4, generator=g, dtype=torch.float64),
              "b1": torch.randn(8, generator=g, dtype=torch.float64),
              "w2": torch.randn(8, 4, generator=g, dtype=torch.float64)}
    batch = {"x": torch.randn(4, 4, generator=g, dtype=torch.float64),
             "y": torch.randn(4, 4, generator=g, dtype=torch.float64)}
    return params, batch


def run_lowered(fn, args, axes_sizes, specs):
    """On every rank: trace, propagate, lower, execute with autograd; return the loss, the
    max gradient error against the single-process reference, and the collectives."""
    import optree

    import pxform
    from pxform.lower.spmd import lower
    from pxform.passes.propagate import gradient_layout, propagate
    from pxform.runtime.collectives import AxisGroups, local_shard
    from pxform.runtime.mesh import Mesh
    from pxform.runtime.program import execute

    mesh = Mesh(axes_sizes)
    axes = AxisGroups({a: mesh.group(a) for a in mesh.names}, mesh.coordinate(),
                      dict(mesh.abstract.axes))
    traced = pxform.trace(fn, *args)
    leaves = optree.tree_leaves(args)
    spec_leaves = optree.tree_leaves(specs, none_is_leaf=True)
    layouts = [Layout.of(s or P(), t.dim()) for s, t in zip(spec_leaves, leaves)]
    strategies = propagate(traced.graph, mesh.abstract, layouts)
    program = lower(traced.graph, mesh.abstract, layouts, strategies,
                    [Layout.replicated(0)])
    local = [local_shard(t, lay, axes).requires_grad_(t.dtype.is_floating_point)
             for t, lay in zip(leaves, layouts)]
    (loss,) = execute(program, local, axes)
    float_local = [t for t in local if t.requires_grad]
    grads = torch.autograd.grad(loss, float_local)
    ref_leaves = [t.clone().requires_grad_(t.dtype.is_floating_point) for t in leaves]
    ref_args = optree.tree_unflatten(optree.tree_structure(args), ref_leaves)
    ref = fn(*ref_args)
    ref_grads = torch.autograd.grad(ref, [t for t in ref_leaves if t.requires_grad])
    float_layouts = [lay for lay, t in zip(layouts, leaves) if t.dtype.is_floating_point]
    err = 0.0
    for g, rg, lay in zip(grads, ref_grads, float_layouts):
        expected = local_shard(rg, gradient_layout(lay), axes)
        err = max(err, (g - expected).abs().max().item())
    return {"loss": loss.item(), "ref": ref.item(), "grad_err": err,
            "fwd": program.collectives(), "bwd": program.backward_collectives(),
            "text": program.as_text()}


def big_mlp_args(batch=16):
    params, _ = mlp_args()
    g = torch.Generator().manual_seed(1)
    data = {"x": torch.randn(batch, 4, generator=g, dtype=torch.float64),
            "y": torch.randn(batch, 4, generator=g, dtype=torch.float64)}
    return params, data


def shard_value_and_grad(fn, args, axes_sizes, in_specs, out_specs=None, bucket_mb=25.0):
    """On every rank: pxform.shard + value_and_grad; compare with the single-process
    reference; report errors and the program's collectives."""
    import optree

    import pxform

    mesh = pxform.Mesh(axes_sizes)
    step = pxform.shard(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                        bucket_mb=bucket_mb)
    loss, grads = pxform.value_and_grad(step)(*args)
    stats = step.bucket_stats
    ref_loss, ref_grads = pxform.value_and_grad(fn)(*args)
    program = step.lower(*args)
    errs = []
    for g, rg in zip(optree.tree_leaves(grads), optree.tree_leaves(ref_grads)):
        full = g.full_tensor() if hasattr(g, "full_tensor") else g
        errs.append((full - rg).abs().max().item())
    again = step(*args)  # cached: no new trace
    dargs = step.distribute(*args)  # DTensors laid out per the specs, accepted as inputs
    dloss, dgrads = pxform.value_and_grad(step)(*dargs)
    dist_err = max((getattr(g, "full_tensor", lambda g=g: g)() - rg).abs().max().item()
                   for g, rg in zip(optree.tree_leaves(dgrads), optree.tree_leaves(ref_grads)))
    return {"loss": float(loss.detach()), "ref": float(ref_loss), "grad_err": max(errs),
            "fwd": program.collectives(), "bwd": program.backward_collectives(),
            "text": program.as_text(), "cached": len(step._cache),
            "again": float(again.detach()), "dtensor_loss": float(dloss.detach()),
            "dtensor_grad_err": dist_err, "buckets": vars(stats),
            "grad_types": sorted({type(g).__name__ for g in optree.tree_leaves(grads)})}


def gpt_case(tp_mlp=False):
    import sys

    sys.path.insert(0, "examples")
    import gpt

    cfg = gpt.GPTConfig(vocab_size=32, seq_len=8, num_layers=2, num_heads=2, d_model=16)
    params = gpt.init_params(cfg, dtype=torch.float64)
    batch = gpt.make_batch(cfg, 4)
    batch["targets"][0, :3] = -100

    def loss(p, b):
        return gpt.loss_fn(p, b, cfg)

    loss.__name__ = "gpt_loss"
    pspec = None
    if tp_mlp:
        blocks = [{"ln1_w": None, "ln1_b": None, "qkv_w": None, "qkv_b": None, "proj_w": None,
                   "proj_b": None, "ln2_w": None, "ln2_b": None, "fc_w": P("tp", None),
                   "fc_b": P("tp"), "out_w": P(None, "tp"), "out_b": None}
                  for _ in params["blocks"]]
        pspec = {"wte": None, "wpe": None, "blocks": blocks, "lnf_w": None, "lnf_b": None}
    return loss, (params, batch), pspec


def gpt_shard(axes_sizes, batch_spec, tp_mlp=False):
    fn, args, pspec = gpt_case(tp_mlp)
    return shard_value_and_grad(fn, args, axes_sizes, (pspec, batch_spec))


def spec_errors():
    """Each bad input gives its message (run on rank 0 of a 2-rank world)."""
    import pxform

    out = {}
    mesh = pxform.Mesh({"dp": 2})
    params, batch = big_mlp_args()
    cases = {
        "indivisible": (None, {"x": P("dp"), "y": P(None, "dp")}),
        "unknown_axis": (None, {"x": P("pp"), "y": None}),
        "too_long": (None, {"x": P("dp", None, None), "y": None}),
        "prefix": (None, {"x": P("dp")}),
        "twice": (None, {"x": P("dp", "dp"), "y": None}),
    }
    batch_odd = dict(batch, y=torch.randn(16, 3, dtype=torch.float64))
    for name, specs in cases.items():
        try:
            args = (params, batch_odd if name == "indivisible" else batch)
            pxform.shard(mlp_loss, mesh=mesh, in_specs=specs)(*args)
            out[name] = "no error"
        except pxform.PxformError as exc:
            out[name] = str(exc)
    try:
        pxform.Mesh({"dp": 2, "tp": 2})
        out["world"] = "no error"
    except pxform.PxformError as exc:
        out["world"] = str(exc)
    return out


def sp_block_loss(params, batch):
    """A pre-norm MLP block with a residual, the shape sequence parallelism is made for."""
    x = batch["x"]
    h = F.layer_norm(x, x.shape[-1:], params["ln_w"], params["ln_b"])
    h = F.linear(F.gelu(F.linear(h, params["fc_w"], params["fc_b"])), params["out_w"])
    return ((x + h - batch["y"]) ** 2).mean()


def sp_block_args():
    g = torch.Generator().manual_seed(2)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    params = {"ln_w": 1 + r(8), "ln_b": r(8), "fc_w": r(16, 8), "fc_b": r(16), "out_w": r(8, 16)}
    batch = {"x": r(2, 4, 8), "y": r(2, 4, 8)}
    return params, batch


SP_PARAMS = {"ln_w": None, "ln_b": None, "fc_w": P("tp"), "fc_b": P("tp"),
             "out_w": P(None, "tp")}


def gpt2_case():
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=64,
                                  n_positions=16, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg).double().eval()
    import pxform

    fn, params = pxform.module_fn(model)
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[0, :3] = -100

    def gpt2_loss(params, inputs):
        return fn(params, **inputs).loss

    return gpt2_loss, params, {"input_ids": ids, "labels": labels}


def gpt2_specs(params, kind):
    """Parameter specs for GPT-2 (HF Conv1D weights are [in, out])."""
    specs = {}
    for name, p in params.items():
        spec = None
        if "zero3" in kind and p.dim() and p.shape[0] % 2 == 0:
            spec = P("dp")
        if "tp" in kind:  # Megatron MLP: c_fc column-parallel, c_proj row-parallel
            if name.endswith("mlp.c_fc.weight"):
                spec = P(None, "tp")
            elif name.endswith("mlp.c_fc.bias"):
                spec = P("tp")
            elif name.endswith("mlp.c_proj.weight"):
                spec = P("tp", None)
        specs[name] = spec
    return specs


def gpt2_shard(axes_sizes, kind, batch_spec):
    fn, params, inputs = gpt2_case()
    return shard_value_and_grad(fn, (params, inputs), axes_sizes,
                                (gpt2_specs(params, kind), batch_spec))


def dropout_replicated():
    """Dropout with p > 0 after a row-parallel layer (its output is replicated over tp):
    both ranks draw the same mask (the counter-based stream), equal to the 1-rank run's."""
    import pxform

    def dropout_mlp(params, batch):
        h = F.gelu(F.linear(batch["x"], params["w1"], params["b1"]))
        return F.dropout(h @ params["w2"], p=0.1).sum()

    params, batch = big_mlp_args(batch=4)
    step = pxform.shard(dropout_mlp, mesh=pxform.Mesh({"tp": 2}),
                        in_specs=({"w1": P("tp"), "b1": P("tp"), "w2": P("tp")}, None))
    torch.manual_seed(3)
    loss = step(params, batch)
    torch.manual_seed(3)
    ref = pxform.trace(dropout_mlp, params, batch)(params, batch)
    torch.manual_seed(3)
    eager = dropout_mlp(params, batch)  # torch's own stream: other numbers
    return {"err": abs(float(loss) - float(ref)), "differs_from_eager": float(eager) != float(ref)}


def bucket_packing():
    """GradBuckets packs gradients of different shapes for each collective kind and gives
    what running each gradient's steps alone gives (on every rank)."""
    from pxform.core.layout import Step
    from pxform.runtime.buckets import GradBuckets
    from pxform.runtime.collectives import AxisGroups, run_steps
    from pxform.runtime.mesh import Mesh

    mesh = Mesh({"dp": 2})
    axes = AxisGroups({"dp": mesh.group("dp")}, mesh.coordinate(), {"dp": 2})
    g = torch.Generator().manual_seed(10 + torch.distributed.get_rank())
    cases = [
        ((4, 6), (Step("all_reduce", "dp"),)),
        ((3,), (Step("all_reduce", "dp"),)),
        ((4, 6), (Step("reduce_scatter", "dp", 1),)),
        ((2, 3, 4), (Step("reduce_scatter", "dp", 0),)),
        ((8,), (Step("reduce_scatter", "dp", 0), Step("all_gather", "dp", 0))),
        ((3, 2), (Step("all_gather", "dp", 1),)),
        ((5, 2), (Step("all_gather", "dp", 0),)),
        ((4, 2), (Step("slice", "dp", 0),)),
        ((2, 4), (Step("all_to_all", "dp", 1, 0),)),
    ]
    errs = {}
    for bucket_bytes in (1, 10**9):
        buckets = GradBuckets(axes, bucket_bytes)
        grads = [torch.randn(*shape, generator=g, dtype=torch.float64) for shape, _ in cases]
        for i, (grad, (_, steps)) in enumerate(zip(grads, cases)):
            buckets.add(i, grad, steps)
        out = buckets.finish()
        errs[bucket_bytes] = max((out[i] - run_steps(grad, steps, axes)).abs().max().item()
                                 for i, (grad, (_, steps)) in enumerate(zip(grads, cases)))
        errs[f"launched {bucket_bytes}"] = buckets.stats.launched
    return errs


def collectives_one_at_a_time(rounds=200):
    """Every collective the runtime launches on a gloo group waits for the one in flight
    there (gloo corrupts its heap or hangs with two at once): the earlier one is complete
    when the next is launched, and each still computes its own result. All-gathers,
    reduce-scatters and all-reduces, left running (`wait=False`) and waited at once, in
    turn."""
    from pxform.core.layout import Step
    from pxform.runtime.collectives import AxisGroups, all_gather, run_step
    from pxform.runtime.mesh import Mesh

    mesh = Mesh({"dp": 2})
    group = mesh.group("dp")
    axes = AxisGroups({"dp": group}, mesh.coordinate(), {"dp": 2})
    rank = torch.distributed.get_rank()
    kinds = [("all_gather", lambda x: all_gather(x, 0, group)),
             ("all_gather", lambda x: run_step(x, Step("all_gather", "dp", 0), axes, False)),
             ("reduce_scatter", lambda x: run_step(x, Step("reduce_scatter", "dp", 0), axes,
                                                   False)),
             ("all_reduce", lambda x: run_step(x, Step("all_reduce", "dp"), axes, False)),
             ("all_gather", lambda x: run_step(x, Step("all_gather", "dp", 0), axes)),
             ("all_reduce", lambda x: run_step(x, Step("all_reduce", "dp"), axes))]
    completed_before_next = launches = wrong = 0
    for k in range(rounds):
        outs = []
        for j, (kind, start) in enumerate(kinds):
            nxt = start(torch.full((64, 32), float(10 * k + j + rank)))
            if outs:
                launches += 1
                completed_before_next += bool(getattr(outs[-1][1], "completed", True))
            outs.append((kind, nxt))
        for j, (kind, out) in enumerate(outs):
            mine, other = (torch.full((64, 32), float(10 * k + j + r)) for r in (rank, 1 - rank))
            want = {"all_gather": torch.cat([mine, other] if rank == 0 else [other, mine]),
                    "reduce_scatter": (mine + other).chunk(2)[rank],
                    "all_reduce": mine + other}[kind]
            wrong += not torch.equal(out + 0, want)
    return {"completed_before_next": completed_before_next, "launches": launches,
            "wrong": wrong}


def collective_temporaries_freed():
    """Per collective step with a temporary (the gathered chunks before they are put in
    place, a reduce-scatter's or all-to-all's rearranged input): the value each rank gets,
    against the same collective along dim 0 rearranged by hand, and the storages resized to
    nothing, as `pxform.MemoryMeter` sees them (bytes alive when the step returns, the
    result and the input aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from pxform.core.layout import Step
    from pxform.runtime.collectives import AxisGroups, run_step
    from pxform.runtime.mesh import Mesh
    from pxform.tools.memory import MemoryMeter

    mesh = Mesh({"dp": 2})
    axes = AxisGroups({"dp": mesh.group("dp")}, mesh.coordinate(), {"dp": 2})
    rank = torch.distributed.get_rank()
    resize = torch.ops.inductor.resize_storage_bytes_.default

    class Resizes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.sizes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is resize:
                self.sizes.append((args[0].untyped_storage().nbytes(), args[1]))
            return func(*args, **(kwargs or {}))

    x = torch.arange(4 * 6 * 8, dtype=torch.float64).reshape(4, 6, 8) + 1000 * rank
    whole = [torch.arange(4 * 6 * 8, dtype=torch.float64).reshape(4, 6, 8) + 1000 * r
             for r in (0, 1)]
    cases = {
        "all_gather 1": (Step("all_gather", "dp", 1), torch.cat(whole, 1)),
        "all_gather 2": (Step("all_gather", "dp", 2), torch.cat(whole, 2)),
        "reduce_scatter 1": (Step("reduce_scatter", "dp", 1),
                             (whole[0] + whole[1]).chunk(2, 1)[rank]),
        "all_to_all 2 from 1": (Step("all_to_all", "dp", 2, 1),
                                torch.cat([w.chunk(2, 1)[rank] for w in whole], 2)),
        "all_gather 0": (Step("all_gather", "dp", 0), torch.cat(whole, 0)),
    }
    out = {}
    for name, (step, want) in cases.items():
        with MemoryMeter() as meter, Resizes() as log:
            got = run_step(x, step, axes)
            alive = meter.stats.end_bytes
        out[name] = {"equal": torch.equal(got, want), "freed": log.sizes,
                     "alive_beyond_result": alive - got.numel() * got.element_size()}
    return out


# ---------------------------------------------------------------- checkpoints

def _gpt_params_and_specs(kind):
    fn, (params, batch), tp_spec = gpt_case(tp_mlp=True)
    specs = optree_map_specs(params) if kind == "zero3" else tp_spec
    return fn, params, batch, specs


def optree_map_specs(params):
    """ZeRO-3: every parameter split on dim 0 over dp where it divides."""
    import optree

    return optree.tree_map(lambda p: P("dp") if p.dim() and p.shape[0] % 2 == 0 else None,
                           params)


def save_checkpoint(path):
    """Save the example GPT's parameters laid out ZeRO-3 on a 2-rank dp mesh."""
    import torch.distributed.checkpoint as dcp

    import pxform

    fn, params, batch, specs = _gpt_params_and_specs("zero3")
    step = pxform.shard(fn, mesh=pxform.Mesh({"dp": 2}), in_specs=(specs, None))
    dparams, _ = step.distribute(params, batch)
    dcp.save({"params": dparams}, checkpoint_id=path)
    return sorted({str(list(t.placements)) for t in _leaves(dparams)})


def load_checkpoint(path):
    """Load it on a 4-rank dp x tp mesh with Megatron specs; values equal, and the loss and
    gradients computed from the loaded parameters equal the reference."""
    import torch.distributed.checkpoint as dcp

    import pxform

    fn, params, batch, specs = _gpt_params_and_specs("tp")
    step = pxform.shard(fn, mesh=pxform.Mesh({"dp": 2, "tp": 2}),
                        in_specs=(specs, {"idx": P("dp"), "targets": P("dp")}))
    zeros = {"params": step.distribute(_zeros_like(params), batch)[0]}
    dcp.load(zeros, checkpoint_id=path)
    loaded = zeros["params"]
    err = max((a - b).abs().max().item()
              for a, b in zip(_leaves(pxform.gather(loaded)), _leaves(params)))
    loss, grads = pxform.value_and_grad(step)(loaded, batch)
    ref_loss, ref_grads = pxform.value_and_grad(fn)(params, batch)
    grad_err = max((a - b).abs().max().item()
                   for a, b in zip(_leaves(pxform.gather(grads)), _leaves(ref_grads)))
    placements = sorted({str(list(t.placements)) for t in _leaves(loaded)
                         if hasattr(t, "placements")})
    return {"value_err": err, "loss_err": abs(float(loss) - float(ref_loss)),
            "grad_err": grad_err, "placements": placements}


def _leaves(tree):
    import optree

    return optree.tree_leaves(tree, is_leaf=lambda x: hasattr(x, "placements"))


def _zeros_like(tree):
    import optree

    return optree.tree_map(torch.zeros_like, tree)


def has_aux_case():
    """value_and_grad(has_aux=True) on a sharded function: aux comes back laid out per the
    out_specs; without has_aux a tuple output is refused."""
    import pxform

    def mlp_with_aux(params, batch):
        h = F.gelu(F.linear(batch["x"], params["w1"], params["b1"]))
        return ((h @ params["w2"] - batch["y"]) ** 2).mean(), {"h": h}

    params, batch = big_mlp_args()
    step = pxform.shard(mlp_with_aux, mesh=pxform.Mesh({"dp": 2}),
                        in_specs=(None, {"x": P("dp"), "y": P("dp")}),
                        out_specs=(None, {"h": P("dp")}))
    (loss, aux), grads = pxform.value_and_grad(step, has_aux=True)(params, batch)
    (ref_loss, ref_aux), ref_grads = pxform.value_and_grad(mlp_with_aux, has_aux=True)(
        params, batch)
    try:
        pxform.value_and_grad(step)(params, batch)
        error = "no error"
    except pxform.PxformError as exc:
        error = str(exc)
    return {"loss_err": abs(float(loss) - float(ref_loss)),
            "aux_err": (pxform.gather(aux["h"]) - ref_aux["h"]).abs().max().item(),
            "aux_type": type(aux["h"]).__name__,
            "grad_err": max((grads[k] - ref_grads[k]).abs().max().item() for k in grads),
            "error": error}


def collectives_against_ddp(batch_size=16):
    """One data-parallel training step of the example GPT (small), pxform against DDP (25
    MiB buckets both), profiled: the gloo collectives each runs (torch.profiler's `gloo:`
    events, the same meter for both), and pxform's loss and gradients against DDP's."""
    import sys

    import optree
    from torch.nn.parallel import DistributedDataParallel

    import pxform

    sys.path.insert(0, "benchmarks")
    import harness

    cfg, params, batch, local, loss = harness.gpt_case("small", batch_size)
    sharded = pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}),
                           in_specs=(None, {"idx": P("dp"), "targets": P("dp")}))
    step = pxform.value_and_grad(sharded)
    module = harness.gpt_module(cfg, params)
    ddp = DistributedDataParallel(module, bucket_cap_mb=25)

    def ddp_step():
        module.zero_grad(set_to_none=True)
        value = ddp(local["idx"], local["targets"])
        value.backward()
        return value

    step(params, batch)  # compile and warm up both
    ddp_step()
    counts = {}
    for name, run in (("pxform", lambda: step(params, batch)), ("ddp", ddp_step)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = run()
        counts[name] = sorted(e.name for e in prof.events() if e.name.startswith("gloo:"))
        if name == "pxform":
            px_loss, px_grads = out
            # autograd nodes pxform adds per parameter (none: gradients reach the buckets
            # from tensor hooks, as DDP's reach its reducer)
            functions = sum("BucketedConvert" in e.name for e in prof.events())
    from pxform.runtime.graph_module import module_of

    program = sharded.lower(params, batch)
    zero3 = pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}),
                         in_specs=(P("dp"), {"idx": P("dp"), "targets": P("dp")}))
    zparams, zbatch = zero3.distribute(params, batch)
    hooked = {"dp": len(module_of(program, hooked=True).__dict__["hooked"]),
              "zero3": len(module_of(zero3.lower(zparams, zbatch), hooked=True
                                     ).__dict__["hooked"]),
              "params": len(optree.tree_leaves(params))}
    ddp_loss = ddp_step().detach()
    torch.distributed.all_reduce(ddp_loss)
    grad_err = max(float((a - b).abs().max()) for a, b in zip(
        optree.tree_leaves(px_grads), optree.tree_leaves(module.grad_tree())))
    return {"pxform": counts["pxform"], "ddp": counts["ddp"], "grad_err": grad_err,
            "loss_err": abs(float(px_loss) - float(ddp_loss) / 2), "functions": functions,
            "hooked": hooked}


def collectives_let_go(calls: int, disable: bool = False):
    """Per synchronous collective step (all-gather along dim 0 and along dim 1, a
    reduce-scatter along dim 0, an all-reduce), `calls` times with a matmul between: how
    many returned while the process group's work object still held the input (more
    holders than before the step) or the result (a holder beside the caller). `disable`:
    as if every wait of `collectives.settled` had run out (the runtime without it)."""
    from pxform.core.layout import Step
    from pxform.runtime import collectives
    from pxform.runtime.collectives import AxisGroups, run_step
    from pxform.runtime.mesh import Mesh

    mesh = Mesh({"dp": 2})
    group = mesh.group("dp")
    axes = AxisGroups({"dp": group}, mesh.coordinate(), {"dp": 2})
    if disable:
        collectives._RUNS_OUT[group] = collectives._RAN_OUT
    steps = {"all_gather 0": Step("all_gather", "dp", 0),
             "all_gather 1": Step("all_gather", "dp", 1),
             "reduce_scatter 0": Step("reduce_scatter", "dp", 0),
             "all_reduce": Step("all_reduce", "dp")}
    a = torch.randn(256, 256)
    held = {}
    try:
        for name, step in steps.items():
            held[name] = 0
            for k in range(calls):
                x = torch.full((64, 32, 16), float(k))
                before = _holders(x)
                got = run_step(x, step, axes)
                # the input beyond what held it before, the result beyond `got` itself
                held[name] += (any(n > b for n, b in zip(_holders(x), before))
                               or got._use_count() > 1)
                a = torch.tanh(a @ a)
        ran_out = collectives._RUNS_OUT.get(group, 0)
        # a collective's result still in flight (a wrapper) read by the next one
        x = torch.full((4, 3), 1.0 + torch.distributed.get_rank())
        pending = run_step(x, steps["all_reduce"], axes, wait=False)
        chained = run_step(pending, steps["all_gather 0"], axes)
        chained_ok = torch.equal(chained, torch.full((8, 3), 3.0))
    finally:
        collectives._RUNS_OUT.pop(group, None)
    return {"held": held, "ran_out": ran_out, "chained": chained_ok}


def _holders(t: torch.Tensor) -> tuple[int, int]:
    """What holds `t`: the tensor itself (its count), and its memory (its storage's count:
    tensors and views of it)."""
    storage = t.untyped_storage()
    return t._use_count(), torch._C._storage_Use_Count(storage._cdata)


def gradients_on_their_parameters_specs():
    """On every rank: DTensor parameters laid out by `distribute` (replicated, and one
    split over dp) give DTensor gradients on the same specs (global shape, placements,
    strides) matching one process."""
    import pxform

    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 3, generator=gen), "v": torch.randn(3, 4, generator=gen)}
    batch = torch.randn(6, 4, generator=gen)

    def loss(p, x):
        return ((x @ p["w"]) @ p["v"]).tanh().square().mean()

    step = pxform.shard(loss, mesh=pxform.Mesh({"dp": 2}),
                        in_specs=({"w": P("dp"), "v": None}, P("dp")))
    dparams, dbatch = step.distribute(params, batch)
    _, grads = pxform.value_and_grad(step)(dparams, dbatch)
    _, ref = pxform.value_and_grad(loss)(params, batch)
    out = {}
    for name in ("w", "v"):
        g, p = grads[name], dparams[name]
        out[name] = {"type": type(g).__name__, "shared": g._spec is p._spec,
                     "shape": list(g.shape) == list(p.shape), "local": list(g.to_local().shape),
                     "placements": list(g.placements) == list(p.placements),
                     "stride": g.stride() == p.stride(),
                     "err": (g.full_tensor() - ref[name]).abs().max().item()}
    return out
