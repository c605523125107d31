"""Trace time and peak memory for the example GPT from 125M to 175B parameters on `meta`.

Each size runs in a fresh process, so peak RSS is that size's alone. Reported per size:
trace time (wall, `pxform.trace` only: the first call, which includes one-time warm-up of
torch's dispatcher and fake-tensor caches, and the best of `--repeat`), peak RSS of the
process, and RSS before tracing (Python + torch + pxform imported, parameters on meta).
Goal for 175B: <= 10 s and <= 1 GB.

    python benchmarks/trace.py                     # all sizes, writes benchmarks/results/
    python benchmarks/trace.py --sizes 125M 1.3B --repeat 3
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIZES = ["125M", "350M", "760M", "1.3B", "2.7B", "6.7B", "13B", "175B"]


def measure(size: str, batch: int, repeat: int) -> dict:
    """Runs in the child process: trace one size and report."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import gpt
    import torch

    import pxform

    cfg = gpt.GPT_CONFIGS[size]
    params = gpt.init_params(cfg, device="meta", dtype=torch.bfloat16)
    data = gpt.make_batch(cfg, batch, device="meta")
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    times = []
    traced = None
    for _ in range(repeat):
        start = time.perf_counter()
        traced = pxform.trace(gpt.loss_fn, params, data, cfg)
        times.append(time.perf_counter() - start)
    assert traced is not None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "size": size, "params": cfg.num_params(), "layers": cfg.num_layers,
        "d_model": cfg.d_model, "batch": batch, "seq_len": cfg.seq_len,
        "ops": len(traced.graph.ops), "trace_s": min(times), "trace_s_all": times,
        "rss_before_mib": rss_before, "peak_rss_mib": peak,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=SIZES)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.child, args.batch, args.repeat)))
        return
    rows = []
    for size in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--child", size, "--batch",
                              str(args.batch), "--repeat", str(args.repeat)],
                             capture_output=True, text=True, check=True, cwd=ROOT)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{r['size']:>5}  {r['params'] / 1e9:7.2f} B params  {r['ops']:5d} ops  "
              f"trace first {r['trace_s_all'][0]:6.2f} s best {r['trace_s']:6.2f} s  "
              f"peak RSS {r['peak_rss_mib']:7.0f} MiB "
              f"(before trace {r['rss_before_mib']:.0f} MiB)", flush=True)
    result = {
        "benchmark": "trace", "date": datetime.date.today().isoformat(),
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "platform": platform.platform()},
        "goal": {"size": "175B", "trace_s": 10, "peak_rss_mib": 1024},
        "rows": rows,
    }
    import torch

    result["machine"]["torch"] = torch.__version__
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"trace-{result['date']}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
