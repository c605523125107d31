"""Train the example GPT with a searched plan: `pxform.auto`, AdamW, logging, checkpoints
with `torch.distributed.checkpoint` (DCP), resume, and a check against one process.

Run on 2 local CPU ranks (gloo; NCCL when CUDA is available):

    torchrun --nproc-per-node 2 examples/train_gpt.py --size small --steps 40 --check

    # survive failures: checkpoint every 10 steps, torchrun restarts the job after a crash
    # and every rank resumes from the newest checkpoint
    torchrun --nproc-per-node 2 --max-restarts 2 examples/train_gpt.py --size small \\
        --steps 40 --ckpt-dir ckpt --ckpt-every 10

    # plan with this machine's measured profile, so predictions can be compared
    torchrun --nproc-per-node 2 -m pxform calibrate --out cpu.json
    torchrun --nproc-per-node 2 examples/train_gpt.py --hardware cpu.json --report-at 3

What each piece does:

* the plan: `pxform.auto(gpt_loss, mesh=world, ...)` searches on fake tensors (no memory);
  rank 0 prints `plan.explain()`. `--stages N` pins the pipeline depth, `--plan FILE` pins
  a saved plan (`--save-plan FILE` writes one).
* the parameters: the model is planned on `meta` shapes, then `step.init(init_fn)` makes
  each rank compute only its own pieces, laid out per the plan (DTensors): no rank ever
  holds the whole model. Gradients come back as DTensors with the same placements, so
  `p.grad = g` and `torch.optim.AdamW` work unchanged. In a pipeline a rank initialises
  only its stages' leaves (the others are None); only those go to the optimizer and the
  checkpoint.
* data: the batch of step k is a pure function of (--seed, k), the same on every rank
  (`pxform.auto` slices each rank's piece), so a resumed run sees exactly the batches the
  uninterrupted run would have.
* checkpoints: `ckpt-dir/step-000010/` per save, written by every rank with DCP (each rank
  its own shards; replicas are written once), then `ckpt-dir/latest` names it (written
  last and renamed into place: a crash during a save leaves the previous checkpoint in
  charge). On start the newest one is loaded in place into the parameters and AdamW's
  state, so training goes on bit for bit as if never interrupted (CPU, same world).
* `--report-at K`: after step K, `pxform.measure` times and meters a few extra steps and
  `plan.report(...)` prints predicted vs measured step time and peak memory per rank.
* `--check`: afterwards rank 0 trains the same model on one process with plain autograd
  and AdamW and compares the loss curves (and the final parameters).
* `--fail-at-step K` (for the resume test): the last rank kills itself with SIGKILL after
  step K, on the first attempt only (torchrun's TORCHELASTIC_RESTART_COUNT is 0).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import optree
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpt import GPT_CONFIGS, GPTConfig, init_params, loss_fn, make_batch  # noqa: E402

import pxform  # noqa: E402
from pxform.search import Pin  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="small", choices=sorted(GPT_CONFIGS))
    p.add_argument("--batch", type=int, default=16, help="global batch (samples per step)")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    p.add_argument("--precision", default="none", choices=["none", "bf16"],
                   help="bf16: compute in bfloat16 with float32 master weights and "
                        "reductions (pxform.Precision); see docs/precision.md")
    p.add_argument("--clip", type=float, default=0.0,
                   help="clip gradients to this global norm (0: no clipping)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hardware", default="h100-80gb",
                   help="preset name or a profile written by `pxform calibrate`")
    p.add_argument("--memory", default=None, help="memory budget per device, e.g. 2GiB")
    p.add_argument("--stages", type=int, default=None, help="pin the pipeline depth")
    p.add_argument("--plan", default=None, help="pin a plan saved with --save-plan")
    p.add_argument("--save-plan", default=None)
    p.add_argument("--ckpt-dir", default=None, help="checkpoint here; resume from it")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--report-at", type=int, default=0,
                   help="after this step, print predicted vs measured (0: never)")
    p.add_argument("--log-every", type=int, default=1)
    p.add_argument("--log-json", default=None, help="rank 0 writes the losses here")
    p.add_argument("--save-final", default=None,
                   help="rank 0 saves the final parameters (full tensors) with torch.save")
    p.add_argument("--check", action="store_true",
                   help="compare with a single-process run; exit 1 on mismatch")
    p.add_argument("--fail-at-step", type=int, default=0, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def init_world() -> tuple[int, int]:
    """torchrun's environment, or a world of one process for plain `python`."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=os.environ.get("MASTER_PORT", "29511"))
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        torch.set_num_threads(1)  # the ranks share the machine's cores
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # After a restart, torchrun's workers meet in the same key-value store as the attempt
    # before, where the old processes' addresses are still published: a new rank can read
    # a dead peer's address and fail to connect (pytorch/pytorch#167288). A prefix per
    # attempt gives every attempt fresh keys.
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                          is_master=rank == 0 and not agent)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"pxform/attempt-{attempt}", store),
                            rank=rank, world_size=world)
    return rank, world


def batch_at(cfg: GPTConfig, args: argparse.Namespace, k: int) -> dict:
    """The batch of step k: the same on every rank and in every attempt."""
    return make_batch(cfg, args.batch, seed=args.seed * 1_000_003 + k)


def named(tree: Any) -> dict[str, Any]:
    """Leaves of a parameter pytree by dotted path ("blocks.0.qkv_w")."""
    paths, leaves, _ = optree.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, torch.Tensor), none_is_leaf=True)
    return {".".join(str(k) for k in path): leaf for path, leaf in zip(paths, leaves)}


def make_optimizer(params: list[torch.Tensor], args: argparse.Namespace) -> Any:
    return torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay,
                             foreach=False)


def init_adam_state(opt: torch.optim.Optimizer) -> None:
    """Create AdamW's state (zeros, step 0) before any step, so a checkpoint can be loaded
    into it in place. Same keys and dtypes as `torch.optim.AdamW` creates lazily."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p not in opt.state or not opt.state[p]:
                opt.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                "exp_avg": torch.zeros_like(p),
                                "exp_avg_sq": torch.zeros_like(p)}


class Checkpoints:
    """`dir/step-NNNNNN/` (DCP, every rank) and `dir/latest` (rank 0, written last)."""

    def __init__(self, root: str, rank: int) -> None:
        self.root = Path(root)
        self.rank = rank

    def state(self, owned: dict[str, torch.Tensor], opt: torch.optim.Optimizer,
              step: torch.Tensor) -> dict:
        return {"params": owned,
                "optim": {name: opt.state[p] for name, p in owned.items()},
                "progress": {"step": step}}

    def latest(self) -> Path | None:
        marker = self.root / "latest"
        if not marker.exists():
            return None
        return self.root / marker.read_text().strip()

    def save(self, state: dict, step: int) -> Path:
        import torch.distributed.checkpoint as dcp

        where = self.root / f"step-{step:06d}"
        dcp.save(state, checkpoint_id=str(where))
        dist.barrier()  # every rank's shards are on disk before `latest` moves
        if self.rank == 0:
            tmp = self.root / "latest.tmp"
            tmp.write_text(where.name + "\n")
            os.replace(tmp, self.root / "latest")
        dist.barrier()
        return where

    def load(self, state: dict, where: Path) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.load(state, checkpoint_id=str(where))


def full_params(params: dict[str, Any], held: dict[str, bool],
                shapes: dict[str, torch.Tensor]) -> dict:
    """Every parameter as a full tensor on every rank, each taken from a rank that owns it
    (in a pipeline, a rank holds None for other stages' leaves)."""
    from torch.distributed.tensor import DTensor

    flags: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(flags, held)
    out = {}
    for name, p in params.items():
        if p is None:  # another stage's: receive it
            full = torch.empty(shapes[name].shape, dtype=shapes[name].dtype)
        else:
            full = p.full_tensor() if isinstance(p, DTensor) else p
        owner = min(r for r, f in enumerate(flags) if f[name])
        full = full.detach().clone().contiguous()
        dist.broadcast(full, src=owner)
        out[name] = full
    return out


def initializer(cfg: GPTConfig, args: argparse.Namespace, dtype: torch.dtype) -> Any:
    """The parameters' initialiser (GPT-2 init, seeded by --seed through its generator)."""
    return functools.partial(init_params, cfg, dtype=dtype, seed=args.seed)


def reference(cfg: GPTConfig, args: argparse.Namespace, dtype: torch.dtype, steps: int
              ) -> tuple[list[float], dict]:
    """The same training on this process alone, with plain autograd: the oracle. Its
    initial parameters are pxform's 1-rank run of the initialiser (pxform's random numbers
    are the same under every plan, and differ from eager PyTorch's)."""
    params = pxform.trace(initializer(cfg, args, dtype))()
    leaves = named(params)
    for p in leaves.values():
        p.requires_grad_(True)
    opt = make_optimizer(list(leaves.values()), args)
    losses = []
    for k in range(steps):
        loss = loss_fn(params, batch_at(cfg, args, k), cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.clip:
            torch.nn.utils.clip_grad_norm_(list(leaves.values()), args.clip)
        opt.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach() for n, p in leaves.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rank, world = init_world()
    say = print if rank == 0 else (lambda *a, **k: None)
    dtype = getattr(torch, args.dtype)
    cfg = GPT_CONFIGS[args.size]
    torch.manual_seed(args.seed)

    def gpt_loss(params: dict, batch: dict) -> torch.Tensor:
        return loss_fn(params, batch, cfg)

    pin: Any = pxform.Plan.load(args.plan) if args.plan else \
        (Pin(stages=args.stages) if args.stages else None)
    precision = pxform.Precision() if args.precision == "bf16" else None
    step = pxform.auto(gpt_loss, mesh=world, hardware=args.hardware,
                       memory_budget=args.memory, plan=pin, precision=precision)
    # plan on shapes only: the model is built on meta, no rank ever holds all of it
    shapes = init_params(cfg, dtype=dtype, device="meta")
    first = batch_at(cfg, args, 0)
    plan = step.plan(shapes, first)
    say(f"GPT {args.size} ({cfg.num_params() / 1e6:.2f} M parameters), {args.dtype}"
        f"{', bf16 compute' if precision else ''}, "
        f"global batch {args.batch} x {cfg.seq_len} tokens, {world} rank(s)")
    say(plan.explain())
    if args.save_plan and rank == 0:
        plan.save(args.save_plan)
    if args.clip and plan.stages > 1:
        say("--clip: a pipelined plan holds each stage's gradients on its own ranks, and a "
            "global norm over stages is not provided yet; pin --stages 1 or drop --clip")
        return 2

    # each rank initialises only its pieces (in a pipeline, only its stages' leaves: the
    # others are None); the numbers are the same under every plan
    params = step.init(initializer(cfg, args, dtype))
    leaves = named(params)
    held = {name: p is not None for name, p in leaves.items()}
    owned = {n: p for n, p in leaves.items() if held[n]}
    opt = make_optimizer(list(owned.values()), args)
    init_adam_state(opt)
    progress = torch.zeros((), dtype=torch.int64)  # steps done, checkpointed with the rest

    ckpts = Checkpoints(args.ckpt_dir, rank) if args.ckpt_dir else None
    start = 0
    if ckpts is not None:
        where = ckpts.latest()
        if where is not None:
            ckpts.load(ckpts.state(owned, opt, progress), where)
            start = int(progress)
            say(f"resumed from {where} at step {start} (attempt "
                f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')})")

    vg = pxform.value_and_grad(step)
    losses: list[tuple[int, float]] = []
    tokens = args.batch * cfg.seq_len
    for k in range(start, args.steps):
        batch = batch_at(cfg, args, k)
        t0 = time.perf_counter()
        loss, grads = vg(params, batch)
        for name, g in named(grads).items():
            if held[name]:
                leaves[name].grad = g
        if args.clip:  # the global norm over DTensor gradients (docs/precision.md)
            torch.nn.utils.clip_grad_norm_(list(owned.values()), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - t0
        value = float(loss)
        losses.append((k + 1, value))
        if not math.isfinite(value):
            say(f"step {k + 1}: loss is {value}; stopping")
            return 1
        if (k + 1) % args.log_every == 0 or k + 1 == args.steps:
            say(f"step {k + 1:4d}  loss {value:.4f}  {elapsed * 1e3:7.1f} ms  "
                f"{tokens / elapsed:9.0f} tokens/s")
        progress.fill_(k + 1)
        if ckpts is not None and ((k + 1) % args.ckpt_every == 0 or k + 1 == args.steps):
            where = ckpts.save(ckpts.state(owned, opt, progress), k + 1)
            say(f"checkpoint {where}")
        if args.report_at and k + 1 == args.report_at:
            measured = pxform.measure(step, params, batch, optimizer=opt)
            say(plan.report(measured))
        if (args.fail_at_step and k + 1 == args.fail_at_step and rank == world - 1
                and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"):
            print(f"rank {rank}: simulated failure after step {k + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    final = full_params(leaves, held, named(shapes))
    status = 0
    if rank == 0 and args.save_final:
        torch.save(final, args.save_final)
    if rank == 0 and args.log_json:
        Path(args.log_json).write_text(json.dumps({"losses": losses, "start": start}))
    if args.check and rank == 0:
        status = check(cfg, args, dtype, losses, final)
    dist.barrier()
    dist.destroy_process_group()
    return status


def check(cfg: GPTConfig, args: argparse.Namespace, dtype: torch.dtype,
          losses: list[tuple[int, float]], final: dict) -> int:
    """Compare with one process: every loss this run logged, and the final parameters."""
    ref_losses, ref_params = reference(cfg, args, dtype, args.steps)
    tol = {torch.float64: 1e-9, torch.float32: 2e-4, torch.bfloat16: 5e-2}[dtype]
    if args.precision == "bf16" and dtype != torch.bfloat16:
        tol = 2e-2  # bf16 compute against the reference's float32
    print(f"\ncheck against one process ({args.dtype}, tolerance {tol:g} relative):")
    print("  step    pxform       one process   difference")
    worst = 0.0
    for k, value in losses:
        ref = ref_losses[k - 1]
        diff = abs(value - ref) / max(abs(ref), 1e-12)
        worst = max(worst, diff)
        print(f"  {k:4d}  {value:12.6f}  {ref:12.6f}  {diff:10.2e}")
    if args.precision == "bf16":
        # Adam moves a parameter whose gradient is bf16 noise by +-lr per step, whichever
        # the sign, so per-tensor maxima mean nothing here: compare all parameters together
        num = sum(float((final[n] - ref_params[n]).pow(2).sum()) for n in ref_params)
        den = sum(float(ref_params[n].pow(2).sum()) for n in ref_params)
        param_err = (num / max(den, 1e-30)) ** 0.5
    else:
        param_err = max(float((final[n] - ref_params[n]).abs().max()) /
                        max(float(ref_params[n].abs().max()), 1e-12) for n in ref_params)
    print(f"  worst loss difference {worst:.2e}, worst parameter difference {param_err:.2e}")
    ok = worst <= tol and param_err <= tol * 10
    print("check passed" if ok else "check FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    # not sys.exit: see pxform.exit_worker (a gloo thread can abort a clean exit)
    pxform.exit_worker(main())
