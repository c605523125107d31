"""Predicted vs measured step time and peak memory on one CUDA GPU (needs one; run it where
there is one: it is not part of the test suite).

One process with a process group of its own (NCCL, 1 rank, so `calibrate` and
`pxform.tools.runtime_costs` measure the GPU, as `pxform calibrate` does under torchrun on
a GPU node) calibrates, then, per case, plans the example GPT on one device pinned with
and without recompute, lays it out, takes one AdamW step (so Adam's state exists) and runs
`pxform.measure` (`--steps` timed steps after 3 warm-ups; the median counts; peak memory
metered by `pxform.MemoryMeter` plus the optimizer's state). On one device there are no
collectives: this checks the op model on a GPU (the op curves `calibrate` measures, the
reference step's `op_time_scale`, the recompute), not the communication model
(`benchmarks/accuracy.py` does that on gloo ranks).

    python benchmarks/accuracy_gpu.py               # writes benchmarks/results/
    python benchmarks/accuracy_gpu.py --quick       # GPT small only, writes nothing
    python benchmarks/accuracy_gpu.py --params plain  # plain tensors, not DTensors

Cases: GPT small (float32, batch 64 x 64 tokens), GPT 125M, 350M and 760M (bfloat16,
sequences of 1,024 tokens, batch 8, 8 and 4).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

CASES = (("small", 64, None, "float32"), ("125M", 8, 1024, "bfloat16"),
         ("350M", 8, 1024, "bfloat16"), ("760M", 4, 1024, "bfloat16"))


def run(cases: tuple[tuple[str, int, int | None, str], ...], steps: int,
        params_as: str = "distributed") -> dict[str, Any]:
    harness.add_paths()
    import gpt
    import optree
    import torch
    import torch.distributed as dist

    import pxform
    from pxform.runtime.calibrate import calibrate, summary
    from pxform.search import Pin
    from pxform.search.space import Option
    from pxform.tools.runtime_costs import runtime_costs

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(harness.free_port()))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        start = time.perf_counter()
        hw = runtime_costs(calibrate(sizes=(2**20,), repeats=5, name="gpu-x1"))
        calibrate_s = time.perf_counter() - start
        print(summary(hw), flush=True)
        rows = []
        for size, batch, seq, dtype_name in cases:
            cfg = gpt.GPT_CONFIGS[size]
            if seq is not None:
                cfg = dataclasses.replace(cfg, seq_len=seq)
            dtype = getattr(torch, dtype_name)
            params = gpt.init_params(cfg, device="cuda", dtype=dtype)
            data = gpt.make_batch(cfg, batch, device="cuda")

            def loss(p: dict, b: dict, cfg: Any = cfg) -> torch.Tensor:
                return gpt.loss_fn(p, b, cfg)

            blocks = len(pxform.auto(loss, mesh=1, hardware=hw).plan(params, data).blocks)
            for redo in (False, True):
                pin = Pin(stages=1, outer=1, inner=1, microbatches=1,
                          block_options=(Option((), redo),) * blocks)
                step = pxform.auto(loss, mesh=1, hardware=hw, plan=pin)
                plan = step.plan(params, data)
                # by default the parameters laid out as `auto`'s users run them
                # (`distribute` or `init`: DTensors), as `runtime_costs` times its
                # per-parameter cost and `accuracy.py` runs its plans; `--params plain`
                # passes the tensors themselves (what this did until 2026-11-27)
                laid_out = (step.distribute(params, data)[0] if params_as == "distributed"
                            else params)
                owned = optree.tree_leaves(laid_out)
                opt = torch.optim.AdamW(owned, lr=1e-4, foreach=False)
                _, grads = pxform.value_and_grad(step)(laid_out, data)
                for p, g in zip(owned, optree.tree_leaves(grads)):
                    p.grad = g
                opt.step()
                opt.zero_grad(set_to_none=True)
                measured = pxform.measure(step, laid_out, data, optimizer=opt,
                                          steps=steps, warmup=3)
                report = plan.report(measured)
                rows.append({"model": size, "batch": batch, "seq_len": cfg.seq_len,
                             "dtype": dtype_name, "recompute": redo,
                             "predicted_time_s": report.predicted_time_s,
                             "measured_time_s": report.measured_time_s,
                             "time_error": report.time_error,
                             "memory_error": report.memory_error})
                r = rows[-1]
                print(f"  {size:>6} {dtype_name:8} recompute={redo!s:5}: predicted "
                      f"{r['predicted_time_s'] * 1e3:7.2f} ms, measured "
                      f"{r['measured_time_s'] * 1e3:7.2f} ms ({r['time_error']:+.1%}); "
                      f"memory {r['memory_error']:+.1%}", flush=True)
                del opt, grads, laid_out, owned
            del params, data
            torch.cuda.empty_cache()
        return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                "params": params_as,
                "calibrate_s": calibrate_s, "hardware": hw.to_json(), "cases": rows}
    finally:
        dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="timed steps per case")
    p.add_argument("--quick", action="store_true", help="GPT small only; writes nothing")
    p.add_argument("--out", default=harness.RESULTS)
    p.add_argument("--params", choices=("distributed", "plain"), default="distributed",
                   help="parameters as `step.distribute` lays them out (DTensors, the "
                        "default) or the plain tensors")
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("accuracy_gpu.py: needs a CUDA GPU (this machine has none)")
    result = run(CASES[:1] if args.quick else CASES, args.steps, args.params)
    errors = [abs(r["time_error"]) for r in result["cases"]]
    print(f"  {result['device']}: |time error| <= 10 % in {sum(e <= 0.10 for e in errors)}/"
          f"{len(errors)} cases (median {sorted(errors)[len(errors) // 2]:.1%})")
    if not args.quick:
        print("wrote", harness.write_result("accuracy_gpu", {**result, "steps": args.steps},
                                            out_dir=args.out))


if __name__ == "__main__":
    main()
