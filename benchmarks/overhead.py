"""pxform's runtime overhead on one process: a lowered training step against plain eager
PyTorch on the same parameters.

One process in a 1-rank gloo group runs the example GPT's loss forward and backward two
ways, interleaved (alternating blocks of `--steps` calls, `--reps` blocks each):

    pxform  pxform.value_and_grad(pxform.shard(loss, mesh=Mesh({"dp": 1}),
                                               in_specs=(None, None)))(params, batch)
    eager   loss = gpt.loss_fn(params, batch, cfg); torch.autograd.grad(loss, leaves)

Both return the loss and every parameter's gradient (checked equal before timing). The
first pxform call traces and lowers the program: that compile time is reported apart.
Reported: steps/s of each and the ratio pxform/eager in steps/s (goal >= 0.97).

    python benchmarks/overhead.py                     # GPT "small", batch 8
    python benchmarks/overhead.py --config tiny --threads 1
    python benchmarks/overhead.py --quick             # a few seconds, smoke run
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402


def main() -> None:
    parser = harness.parser(__doc__, batch=8, reps=40, steps=10)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads (0: torch's default)")
    args = harness.parse(parser)
    harness.add_paths()
    import gpt
    import optree
    import torch
    import torch.distributed as dist

    import pxform

    if args.threads:
        torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{harness.free_port()}", rank=0,
                            world_size=1)
    cfg = gpt.GPT_CONFIGS[args.config]
    params = gpt.init_params(cfg, dtype=torch.float32)
    batch = gpt.make_batch(cfg, args.batch)

    def loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    step = pxform.shard(loss, mesh=pxform.Mesh({"dp": 1}), in_specs=(None, None))
    px_step = pxform.value_and_grad(step)

    start = time.perf_counter()
    px_loss, px_grads = px_step(params, batch)
    first_call = time.perf_counter() - start

    leaves, tree = optree.tree_flatten(params)
    eager_params = optree.tree_unflatten(
        tree, [t.detach().clone().requires_grad_(True) for t in leaves])
    eager_leaves = optree.tree_leaves(eager_params)

    def eager_step() -> tuple:
        value = gpt.loss_fn(eager_params, batch, cfg)
        return value.detach(), torch.autograd.grad(value, eager_leaves)

    ref_loss, ref_grads = eager_step()
    loss_diff = abs(float(px_loss.detach()) - float(ref_loss))
    grad_diff = harness.max_abs_diff(optree.tree_leaves(px_grads), ref_grads)
    ok = torch.allclose(px_loss.detach(), ref_loss, rtol=1e-5, atol=1e-6) and all(
        torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(optree.tree_leaves(px_grads), ref_grads))
    if not ok:
        raise SystemExit(f"overhead: pxform and eager disagree: loss diff {loss_diff:.3g}, "
                         f"max grad diff {grad_diff:.3g}")

    for _ in range(args.warmup):
        px_step(params, batch)
        eager_step()
    times = harness.interleave({"pxform": lambda: px_step(params, batch),
                                "eager": eager_step}, args.reps, args.steps)
    summary = harness.summarise(times, "eager", "pxform")  # time ratio = steps/s ratio
    summary["ratio"]["what"] = "pxform/eager steps/s (eager time / pxform time)"
    compile_s = first_call - statistics.median(times["pxform"])

    print(f"GPT {args.config} ({cfg.num_params() / 1e6:.2f} M params), batch {args.batch} x "
          f"{cfg.seq_len} tokens, float32, 1 process, {torch.get_num_threads()} threads; "
          f"{args.reps} blocks of {args.steps} steps each, interleaved")
    print(f"  check: loss diff {loss_diff:.3g}, max grad diff {grad_diff:.3g}")
    print(f"  pxform first call {first_call:.2f} s (trace + lower: {compile_s:.2f} s)")
    harness.print_table(summary)
    print(f"  goal pxform/eager >= 0.97: "
          f"{'met' if summary['ratio']['of_medians'] >= 0.97 else 'NOT met'} "
          f"({summary['ratio']['of_medians']:.4f})")
    if args.quick:
        dist.destroy_process_group()
        return
    tag = harness.variant(args, parser, {"config": "", "batch": "batch", "threads": "threads"})
    path = harness.write_result("overhead", {
        "goal": {"pxform_over_eager_steps_per_s": 0.97},
        "config": {"model": args.config, "params": cfg.num_params(), "batch": args.batch,
                   "seq_len": cfg.seq_len, "dtype": "float32", "threads":
                   torch.get_num_threads(), "reps": args.reps, "steps": args.steps,
                   "warmup": args.warmup, "quick": args.quick},
        "check": {"loss_abs_diff": loss_diff, "grad_max_abs_diff": grad_diff},
        "first_call_s": first_call, "compile_s": compile_s,
        "steps_per_s": {k: 1 / v for k, v in summary["per_step_s"].items()},
        **summary,
    }, args.out, variant=tag)
    print(f"wrote {path}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
