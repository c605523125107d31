"""Compose pxform's transforms by hand: a GPT training step with recomputed layers, a
two-stage 1F1B pipeline, and data (or tensor) parallelism inside each stage.

What it shows, innermost first, on the example GPT (`examples/gpt.py`):

    layer = pxform.recompute(block, policy=...)           # activation checkpointing
    step  = pxform.pipeline(loss, stages=2, microbatches=M, schedule="1f1b")
    step  = pxform.shard(step, mesh=pxform.Mesh({"pp": 2, "dp": world // 2}),
                         in_specs=(param_specs, {"idx": P("dp"), "targets": P("dp")}))
    loss, grads = pxform.value_and_grad(step)(params, batch)

Each transform returns a plain callable object, so they nest like function calls: the
recompute regions are traced inside the pipeline's stages, and each stage runs SPMD on the
sub-mesh without the `pp` axis. `--inner tp` replaces data parallelism inside the stages by
Megatron tensor parallelism (attention and MLP column- then row-parallel over a `tp` axis);
`--inner zero3` stores the stages' weight matrices split over `dp` (ZeRO-3).

Rank 0 prints what was composed, the stage cuts, the schedule each pipeline rank runs
(`pxform.schedules.to_text`) and a summary of the lowered per-stage programs (`--show-program`
prints them whole). Then every rank trains `--steps` steps and rank 0 prints each loss. The
parameters are DTensors laid out per the in_specs (`step.distribute`), updated by
`torch.optim` (SGD, or `--optimizer adamw`) with the gradients as `value_and_grad` returns
them: DTensors laid out like their parameters, and `None` for the parameters only the other
pipeline rank's stage reads (that rank updates them; the optimizer skips them here).

`--check` runs the same training on full tensors in each process (plain `gpt.loss_fn`, no
recompute, no pipeline, no sharding; `pxform.value_and_grad`, the same optimizer) and
compares step 1's loss and every gradient a rank holds (`pxform.gather`ed), then every
step's loss; it exits with status 1 on a mismatch. `--dtype float64` makes the tolerance
tight (1e-10).

Run (from the repository root; gloo on CPU; NCCL when every rank has its own GPU, a path
not exercised by the tests):

    torchrun --nproc-per-node 2 examples/compose_by_hand.py --size tiny --steps 3
    torchrun --nproc-per-node 4 examples/compose_by_hand.py --size tiny --steps 3
    torchrun --nproc-per-node 4 examples/compose_by_hand.py --inner tp --check
    torchrun --nproc-per-node 2 examples/compose_by_hand.py --check --dtype float64

The world size must be even (2 pipeline stages times the inner axis).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import Any

import optree
import torch
import torch.distributed as dist

# the example GPT lives next to this file: importable however this file is run or imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import pxform  # noqa: E402
from pxform import P  # noqa: E402

POLICIES = ("nothing", "matmuls", "none")
"""Recompute policies for the transformer blocks: "nothing" saves only each block's input
(full activation checkpointing), "matmuls" keeps the matmul and attention outputs, "none"
does not recompute."""

DTYPES = {"float32": torch.float32, "float64": torch.float64}
TOLERANCES = {"float32": (1e-5, 1e-4), "float64": (1e-10, 1e-9)}
"""(atol, rtol) of `--check` per dtype: float64 shows the maths is the same up to
rounding; float32 allows for the different summation orders of microbatches and shards."""


# ---------------------------------------------------------------------------- the model
def make_loss(cfg: gpt.GPTConfig, policy: str) -> Any:
    """The example GPT's loss with each transformer block wrapped in `pxform.recompute`.

    The same maths as `gpt.loss_fn`; only what autograd keeps between forward and backward
    changes. `policy` is one of `POLICIES`.

    Example:
        >>> loss = make_loss(gpt.GPT_CONFIGS["tiny"], "matmuls")
        >>> loss(params, batch)                # a scalar, equal to gpt.loss_fn's
    """
    def block(p: dict, x: torch.Tensor) -> torch.Tensor:
        return gpt.block(p, x, cfg)

    layer = block if policy == "none" else pxform.recompute(block, policy=policy)

    def trunk(blocks: list, x: torch.Tensor) -> torch.Tensor:
        for p in blocks:
            x = layer(p, x)
        return x

    def loss(params: dict, batch: dict) -> torch.Tensor:
        return gpt.loss_fn(params, batch, cfg, trunk)

    loss.__name__ = f"gpt_loss_recompute_{policy}"
    return loss


def param_specs(params: dict, inner: str) -> Any:
    """In-specs for the parameters on the stage mesh (a prefix of `params`).

    - "dp": None, every parameter replicated (plain data parallelism);
    - "zero3": the weight matrices split along dim 0 over `dp` (ZeRO-3: gathered at use,
      gradients reduce-scattered), vectors replicated;
    - "tp": Megatron: qkv and fc column-parallel (`P("tp", None)`, their biases `P("tp")`),
      proj and out row-parallel (`P(None, "tp")`); the embeddings and norms replicated.
    """
    if inner == "dp":
        return None
    if inner == "zero3":
        return optree.tree_map(lambda t: P("dp") if t.dim() == 2 else None, params)  # type: ignore[arg-type]
    megatron = {"qkv_w": P("tp", None), "qkv_b": P("tp"), "fc_w": P("tp", None),
                "fc_b": P("tp"), "proj_w": P(None, "tp"), "out_w": P(None, "tp")}
    return {k: ([{n: megatron.get(n) for n in b} for b in v] if k == "blocks" else None)
            for k, v in params.items()}


SPEC_TEXT = {
    "dp": 'None, {"idx": P("dp"), "targets": P("dp")}',
    "zero3": '<P("dp") on every weight matrix>, {"idx": P("dp"), "targets": P("dp")}',
    "tp": '<Megatron: qkv_w, fc_w P("tp", None); proj_w, out_w P(None, "tp")>, None',
}
"""How `compose` sets the in_specs for each `--inner`, as printed."""


def compose(cfg: gpt.GPTConfig, params: dict, *, world: int, inner: str, policy: str,
            microbatches: int, schedule: str) -> tuple[Any, Any, pxform.Mesh]:
    """recompute -> pipeline -> shard, as the module doc shows; returns (the sharded step,
    the pipelined function inside it, the mesh)."""
    axis = "tp" if inner == "tp" else "dp"
    mesh = pxform.Mesh({"pp": 2, axis: world // 2})
    pipelined = pxform.pipeline(make_loss(cfg, policy), stages=2, microbatches=microbatches,
                                schedule=schedule)
    # under tensor parallelism every rank of a stage sees the whole (micro)batch
    batch_spec = None if inner == "tp" else {"idx": P("dp"), "targets": P("dp")}
    step = pxform.shard(pipelined, mesh=mesh, in_specs=(param_specs(params, inner), batch_spec))
    return step, pipelined, mesh


# ---------------------------------------------------------------------------- reporting
def describe(step: Any, pipelined: Any, mesh: pxform.Mesh, params: dict, batch: dict,
             args: argparse.Namespace, cfg: gpt.GPTConfig) -> str:
    """What was composed, the stage cuts, the schedule and the per-stage programs' summary
    (the full programs: `step.lower(params, batch).as_text()`)."""
    from pxform import schedules

    layer = ("  layer = gpt.block  (--policy none: not recomputed)" if args.policy == "none"
             else f"  layer = pxform.recompute(gpt.block, policy={args.policy!r})")
    lines = [
        f"GPT {args.size} ({cfg.num_params():,} parameters, {cfg.num_layers} layers), "
        f"batch {args.batch} x {cfg.seq_len} tokens, {args.dtype}, {dist.get_world_size()} "
        f"ranks ({dist.get_backend()})",
        "composed by hand:",
        layer,
        f"  step  = pxform.pipeline(loss, stages=2, microbatches={args.microbatches}, "
        f"schedule={args.schedule!r})",
        f"  step  = pxform.shard(step, mesh={mesh},",
        f"                       in_specs=({SPEC_TEXT[args.inner]}))",
        "  loss, grads = pxform.value_and_grad(step)(params, batch)",
        "",
        str(pipelined.cuts(params, batch)),
        "",
        "schedule (per pipeline rank, with its sends and receives):",
        schedules.to_text(pipelined.actions()),
        "",
        "lowered per-stage programs (--show-program prints them whole):",
    ]
    program = step.lower(params, batch)
    lines += program_summary(program)
    lines.append("  (all_reduce(mb) sums a gradient over microbatches: autograd accumulates "
                 "it in place, nothing is sent)")
    if args.show_program:
        lines += ["", program.as_text()]
    return "\n".join(lines)


def program_summary(program: Any) -> list[str]:
    """Per stage of a lowered pipeline (`step.lower(...)`): its mesh, op count, recompute
    regions, what crosses to the neighbour stage, and the collectives it runs (axes of size
    1 move nothing and are left out)."""
    from collections import Counter

    from pxform.runtime.graph_module import module_of

    def counted(names: list[str]) -> str:
        return ", ".join(f"{n} x {c}" for c, n in Counter(names).items()) or "none"

    def values(vs: tuple[Any, ...]) -> str:
        return ", ".join(f"%{v.name}: {v.type}" for v in vs) or "nothing"

    out = []
    for st in program.stages:
        prog = st.program
        ops = sum(1 for i in prog.instrs if hasattr(i, "op"))
        regions = sum(1 for name, _ in module_of(st).named_children()
                      if name.startswith("recompute"))
        out += [
            f"stage {st.stage} on {prog.mesh}: {ops} ops, {regions} recompute region(s); "
            f"receives {values(st.receives)}; sends {values(st.sends)}",
            f"  forward collectives:  {counted(prog.collectives())}",
            f"  backward collectives: {counted(prog.backward_collectives())}",
        ]
    return out


# ---------------------------------------------------------------------------- checking
def compare(loss: torch.Tensor, grads: Any, ref_loss: torch.Tensor, ref_grads: Any,
            atol: float, rtol: float) -> list[str]:
    """Mismatches between this rank's loss and gradients and the reference, one line each
    (empty when they agree). Gradients this rank does not hold (`None`) are skipped;
    DTensors are gathered, a collective over their stage's ranks, which hold the same
    gradients in the same order.

    Example:
        >>> compare(loss, grads, ref_loss, ref_grads, atol=1e-10, rtol=1e-9)
        []
    """
    problems = []
    if not math.isclose(float(loss), float(ref_loss), rel_tol=rtol, abs_tol=atol):
        problems.append(f"loss {float(loss):.17g} != reference {float(ref_loss):.17g}")
    paths, leaves, _ = optree.tree_flatten_with_path(grads, none_is_leaf=True)
    ref = dict(zip(*optree.tree_flatten_with_path(ref_grads)[:2]))
    for path, g in zip(paths, leaves):
        if g is None:
            continue
        full = pxform.gather(g)
        want = ref[path]
        if full.shape != want.shape or not torch.allclose(full, want, atol=atol, rtol=rtol):
            err = float((full - want).abs().max()) if full.shape == want.shape else math.inf
            problems.append(f"grad {'.'.join(map(str, path))}: max |error| {err:.3g}")
    return problems


def held(grads: Any) -> int:
    """How many gradients this rank holds (not None)."""
    return sum(g is not None for g in optree.tree_leaves(grads, none_is_leaf=True))


# ---------------------------------------------------------------------------- training
def make_optimizer(leaves: list[torch.Tensor], args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD or AdamW over `leaves` (DTensors or plain tensors alike)."""
    if args.optimizer == "adamw":
        return torch.optim.AdamW(leaves, lr=args.lr, weight_decay=0.01)
    return torch.optim.SGD(leaves, lr=args.lr)


def apply(optimizer: torch.optim.Optimizer, leaves: list[torch.Tensor], grads: Any) -> None:
    """One optimizer step with `grads` as returned by `value_and_grad`.

    A gradient is a DTensor laid out like its (DTensor) parameter, or None where the
    parameter belongs to the other pipeline rank's stage: torch.optim skips parameters
    without a gradient, so each rank updates exactly what its stage holds (the tied
    embedding, read on both stages, gets the same summed gradient on both).
    """
    for p, g in zip(leaves, optree.tree_leaves(grads, none_is_leaf=True), strict=True):
        p.grad = g
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="A GPT training step composed by hand from pxform.recompute, "
                    "pxform.pipeline and pxform.shard (run under torchrun).")
    parser.add_argument("--size", default="tiny", choices=sorted(gpt.GPT_CONFIGS),
                        help="example GPT size (default tiny; real values are allocated, so "
                             "keep it to tiny or small on a CPU)")
    parser.add_argument("--steps", type=int, default=3, help="training steps (default 3)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (default 8)")
    parser.add_argument("--microbatches", type=int, default=4,
                        help="pipeline microbatches (default 4)")
    parser.add_argument("--schedule", default="1f1b",
                        help="pipeline schedule: gpipe, 1f1b, zb, ... (default 1f1b)")
    parser.add_argument("--inner", choices=("dp", "zero3", "tp"), default="dp",
                        help="parallelism inside each stage (default dp)")
    parser.add_argument("--policy", choices=POLICIES, default="nothing",
                        help="recompute policy of the blocks (default nothing)")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    parser.add_argument("--lr", type=float, default=1e-2, help="learning rate (default 0.01)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--check", action="store_true",
                        help="compare step 1's loss and gradients, and every step's loss, "
                             "with one process; exit 1 on a mismatch")
    parser.add_argument("--show-program", action="store_true",
                        help="print the lowered per-stage programs whole")
    parser.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                        help="auto: nccl when every local rank has its own GPU, else gloo "
                             "on CPU")
    return parser.parse_args(argv)


def pick_backend(choice: str) -> str:
    """gloo, or nccl when asked or (auto) when each local rank can have its own GPU
    (NCCL refuses two ranks on one device)."""
    if choice != "auto":
        return choice
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return "nccl" if gpus >= local_world else "gloo"


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, join the torchrun world, train; the exit code."""
    args = parse_args(argv)
    if "RANK" not in os.environ or not dist.is_available():
        print("compose_by_hand.py: run it under torchrun, e.g.\n  torchrun --nproc-per-node 2 "
              "examples/compose_by_hand.py --size tiny --steps 3", file=sys.stderr)
        return 2
    backend = pick_backend(args.backend)
    dist.init_process_group(backend)
    try:
        return train(args, cuda=backend == "nccl")
    finally:
        dist.destroy_process_group()


def train(args: argparse.Namespace, *, cuda: bool) -> int:
    """Compose, describe (rank 0), train `args.steps` steps; 1 when `--check` fails."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if world % 2:
        if rank == 0:
            print(f"compose_by_hand.py: the pipeline has 2 stages, so the world size must be "
                  f"even; got {world}.\n  Fix: torchrun --nproc-per-node 2 (or 4, 6, ...)",
                  file=sys.stderr)
        return 2
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # several ranks share few cores: no oversubscription
    cfg = gpt.GPT_CONFIGS[args.size]
    dtype = DTYPES[args.dtype]
    # seeded: the same full values on every rank, which distribute() then slices
    params = gpt.init_params(cfg, dtype=dtype, device=device, seed=0)
    batch = gpt.make_batch(cfg, args.batch, device=device, seed=1)

    step, pipelined, mesh = compose(cfg, params, world=world, inner=args.inner,
                                    policy=args.policy, microbatches=args.microbatches,
                                    schedule=args.schedule)
    say = print if rank == 0 else (lambda *a, **k: None)
    say(describe(step, pipelined, mesh, params, batch, args, cfg), flush=True)

    # parameters and batch as DTensors laid out per the in_specs (as FSDP2 keeps them)
    dparams, dbatch = step.distribute(params, batch)
    leaves = optree.tree_leaves(dparams)
    optimizer = make_optimizer(leaves, args)
    train_step = pxform.value_and_grad(step)
    reference = Reference(cfg, params, batch, args) if args.check else None
    failed = False
    say(f"\ntraining ({args.optimizer}, lr {args.lr:g}):", flush=True)
    for n in range(1, args.steps + 1):
        start = time.perf_counter()
        loss, grads = train_step(dparams, dbatch)
        apply(optimizer, leaves, grads)
        elapsed = time.perf_counter() - start
        note = ""
        if reference is not None:
            ref_loss, ref_grads = reference.step()
            if n == 1:
                failed |= check_first_step(args, loss, grads, ref_loss, ref_grads, rank)
            atol, rtol = TOLERANCES[args.dtype]
            ok = agree(math.isclose(float(loss), float(ref_loss), rel_tol=rtol, abs_tol=atol))
            failed |= not ok
            note = f"; one process: {float(ref_loss):.6f}{'' if ok else '  MISMATCH'}"
        say(f"step {n}: loss {float(loss):.6f}  ({elapsed:.2f} s; rank 0 holds "
            f"{held(grads)} of {len(leaves)} gradients{note})", flush=True)
    if reference is not None:
        say(f"check PASSED: {args.steps} step(s) agree with one process" if not failed else
            "check FAILED: see the mismatches above", flush=True)
    return 1 if failed else 0


class Reference:
    """The same training on full tensors in this process: plain `gpt.loss_fn` (no
    recompute, no pipeline, no sharding) and the same optimizer."""

    def __init__(self, cfg: gpt.GPTConfig, params: dict, batch: dict,
                 args: argparse.Namespace) -> None:
        self.params = optree.tree_map(torch.clone, params)  # type: ignore[arg-type]
        self.leaves = optree.tree_leaves(self.params)
        self.optimizer = make_optimizer(self.leaves, args)
        self.batch = batch
        self.fn = pxform.value_and_grad(lambda p, b: gpt.loss_fn(p, b, cfg))

    def step(self) -> tuple[torch.Tensor, Any]:
        loss, grads = self.fn(self.params, self.batch)
        apply(self.optimizer, self.leaves, grads)
        return loss, grads


def agree(ok: bool) -> bool:
    """True when `ok` holds on every rank (a MIN all-reduce, so all ranks decide alike)."""
    flag = torch.tensor([1 if ok else 0],
                        device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def check_first_step(args: argparse.Namespace, loss: torch.Tensor, grads: Any,
                     ref_loss: torch.Tensor, ref_grads: Any, rank: int) -> bool:
    """Compare step 1's loss and this rank's gradients with one process; True on failure
    on any rank (each prints its own mismatches)."""
    atol, rtol = TOLERANCES[args.dtype]
    problems = compare(loss, grads, ref_loss, ref_grads, atol, rtol)
    for line in problems[:10]:
        print(f"rank {rank}: MISMATCH {line}", file=sys.stderr, flush=True)
    ok = agree(not problems)
    if rank == 0:
        print(f"check step 1: loss and gradients {'match' if ok else 'DIFFER from'} one "
              f"process (atol {atol:g}, rtol {rtol:g}; every rank, every gradient it holds)",
              flush=True)
    return not ok


if __name__ == "__main__":
    # not sys.exit: see pxform.exit_worker (a gloo thread can abort a clean exit)
    pxform.exit_worker(main())
