"""Shared helpers of the side-by-side benchmarks (`overhead.py`, `dp_vs_ddp.py`,
`sdp_vs_fsdp2.py`): interleaved timing, summaries, the GPT as an `nn.Module` for DDP and
FSDP2, and the result file.

Two contenders are timed in alternating blocks (A B, B A, A B, ...) of `steps` calls each;
each block gives one per-step time. Figures are medians over the blocks, and the ratio is
computed from times taken side by side in the same run, so slow drift of a shared machine
hits both contenders alike.
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import platform
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
DATE = datetime.date.today().isoformat()


def parser(doc: str, batch: int, reps: int, steps: int, ranks: bool = False) -> Any:
    """The flags every benchmark takes (`--config --batch --reps --steps --warmup --quick
    --out`, and `--ranks --bucket-mb` for multi-rank ones); add more, then `parse`."""
    import argparse

    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--config", default="small", help="a key of gpt.GPT_CONFIGS")
    p.add_argument("--batch", type=int, default=batch,
                   help="global sequences per step" if ranks else "sequences per step")
    if ranks:
        p.add_argument("--ranks", type=int, default=2)
        p.add_argument("--bucket-mb", type=float, default=25.0, help="pxform's buckets")
        p.add_argument("--malloc", choices=MALLOC_CHOICES, default="default",
                       help=MALLOC_HELP)
    p.add_argument("--reps", type=int, default=reps, help="timed blocks per contender")
    p.add_argument("--steps", type=int, default=steps, help="steps per timed block")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    p.add_argument("--quick", action="store_true",
                   help="3 blocks of 2 steps; a smoke run: writes no result")
    p.add_argument("--out", default=RESULTS)
    return p


def parse(p: Any) -> Any:
    """Parse the flags; `--quick` shrinks the run; the batch must split over the ranks."""
    args = p.parse_args()
    if args.quick:
        args.reps, args.steps, args.warmup = 3, 2, 1
    if getattr(args, "ranks", 1) and args.batch % getattr(args, "ranks", 1):
        p.error(f"--batch {args.batch} must be a multiple of --ranks {args.ranks}")
    return args


PINNED_MALLOC = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20),
                 "MALLOC_TRIM_THRESHOLD_": str(4 * 2**30)}
"""glibc's heap thresholds fixed: tensors under 32 MiB come from the heap, and freed heap
is kept rather than returned to the OS and faulted in again on the next step."""

MALLOC_CHOICES = ("default", "pinned", "system")
MALLOC_HELP = ("glibc's heap on every rank: default, as pxform's runtime leaves it (freed "
               "pages kept, `pxform.runtime.heap`); pinned, glibc's thresholds fixed by "
               "environment variables (`PINNED_MALLOC`); system, glibc's adaptive "
               "thresholds (PXFORM_KEEP_HEAP=0)")


def pin_malloc(args: Any) -> dict[str, str]:
    """With `--malloc pinned`, set `PINNED_MALLOC` in the environment the ranks inherit
    (glibc reads it at start); with `--malloc system`, `PXFORM_KEEP_HEAP=0`, so that the
    runtime leaves glibc's adaptive thresholds alone. Both contenders run in the same
    processes, so both get it. Returns what was set.

    With glibc's adaptive thresholds, a step can end with its heap top trimmed and its
    big blocks unmapped: the next step takes page faults to get the memory back (tens of
    thousands per step at GPT small, batch 256, more for one contender's allocation order
    than the other's; `docs/benchmarks/dp_vs_ddp.md`). Since the thirty-seventh session
    the runtime keeps the pages itself (`pxform.runtime.heap`), as `pinned` does."""
    choice = getattr(args, "malloc", "default")
    env = (dict(PINNED_MALLOC) if choice == "pinned"
           else {"PXFORM_KEEP_HEAP": "0"} if choice == "system" else {})
    os.environ.update(env)
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def add_paths() -> None:
    """Make `examples/gpt.py` and the benchmark modules importable (also on worker ranks)."""
    for sub in ("examples", "benchmarks"):
        path = os.path.join(ROOT, sub)
        if path not in sys.path:
            sys.path.insert(0, path)


CALIBRATION_SIZES = (2**10, 2**14, 2**18, 2**20, 2**22)  # accuracy.py and stability.py


def calibrated(runs: int, name: str, sizes: tuple[int, ...] = CALIBRATION_SIZES,
               repeats: int = 15) -> Any:
    """On every rank: the profile `pxform calibrate --runs runs` writes, the
    representative (`pxform.tools.runtime_costs.representative_profile`) of `runs`
    calibrations with the runtime's fixed costs (`calibrate`, then `runtime_costs`)."""
    from pxform.runtime.calibrate import calibrate
    from pxform.tools.runtime_costs import representative_profile, runtime_costs

    return representative_profile([
        runtime_costs(calibrate(sizes=sizes, repeats=repeats, name=name))
        for _ in range(runs)])


def profile_or_calibrated(path: str | None, name: str) -> Any:
    """On every rank: the profile saved at `path`, or (None) one measured now
    (`calibrated`, one calibration)."""
    if path:
        from pxform.cost.hardware import hardware

        return hardware(path)
    return calibrated(1, name)


def interleave(contenders: dict[str, Callable[[], Any]], reps: int, steps: int,
               sync: Callable[[], Any] | None = None) -> dict[str, list[float]]:
    """Seconds per call of each contender, one figure per block of `steps` calls; the
    order of the contenders alternates from one repetition to the next. `sync` runs
    before every block, untimed (a barrier on multi-rank runs)."""
    names = list(contenders)
    times: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for name in (names if rep % 2 == 0 else names[::-1]):
            gc.collect()
            if sync is not None:
                sync()
            fn = contenders[name]
            start = time.perf_counter()
            for _ in range(steps):
                fn()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def recorded_steps(call: Callable[[], Any], reps: int) -> tuple[list[float], list[Any]]:
    """`reps` calls of a pipelined step, each after a barrier: the seconds of each call
    (wall clock, `time.time`, as the recorded actions are) and the actions each call ran,
    `(action, start, end)` per action (`pxform.runtime.pipeline.recording`)."""
    import torch.distributed as dist

    from pxform.runtime.pipeline import recording

    steps: list[float] = []
    events: list[Any] = []
    for _ in range(reps):
        dist.barrier()
        start = time.time()
        with recording() as rec:
            call()
        steps.append(time.time() - start)
        events.append(rec)
    return steps, events


def slowest_rank(per_rank: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per block, the slowest rank's time: a step is done when every rank is done."""
    return {name: [max(r[name][i] for r in per_rank) for i in range(len(per_rank[0][name]))]
            for name in per_rank[0]}


def summarise(times: dict[str, list[float]], num: str, den: str) -> dict[str, Any]:
    """Medians (and quartiles) per contender, and `num`/`den` as the ratio of the medians
    and as the median of the per-repetition ratios (the blocks of one repetition ran back
    to back)."""
    def quartiles(xs: list[float]) -> list[float]:
        if len(xs) < 2:
            return [xs[0]] * 3
        q = statistics.quantiles(xs, n=4)
        return [q[0], statistics.median(xs), q[2]]

    out: dict[str, Any] = {"per_step_s": {}, "quartiles_s": {}, "blocks_s": times}
    for name, xs in times.items():
        out["per_step_s"][name] = statistics.median(xs)
        out["quartiles_s"][name] = quartiles(xs)
    paired = [a / b for a, b in zip(times[num], times[den])]
    out["ratio"] = {"what": f"{num}/{den}",
                    "of_medians": out["per_step_s"][num] / out["per_step_s"][den],
                    "median_paired": statistics.median(paired),
                    "paired_quartiles": quartiles(paired)}
    return out


def report_checks(checks: list[dict[str, Any]], disagree: str, extra: str = "") -> None:
    """Print the ranks' agreement checks (largest loss and gradient differences, then
    `extra`) and stop the benchmark with `disagree` when any rank's check failed: timing
    contenders that compute different things means nothing."""
    print(f"  check: loss diff {max(c['loss_abs_diff'] for c in checks):.3g}, max grad diff "
          f"{max(c['grad_max_abs_diff'] for c in checks):.3g}{extra}")
    if not all(c["ok"] for c in checks):
        raise SystemExit(f"{disagree}: {checks}")


def max_abs_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two equal-length lists of tensors."""
    return max(float((x.detach() - y.detach()).abs().max()) for x, y in zip(a, b))


def counts(items: list[str]) -> str:
    """`['a', 'b', 'a']` as `'2 x a, 1 x b'` (collective lists, compactly)."""
    seen: dict[str, int] = {}
    for item in items:
        seen[item] = seen.get(item, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in seen.items()) or "none"


def machine() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "cpus": os.cpu_count(),
            "platform": platform.platform(), "torch": torch.__version__}


def variant(args: Any, parser: Any, names: dict[str, str]) -> str:
    """A result-file suffix naming the options in `names` ({dest: label}) that differ from
    their defaults, e.g. `threads1-batch64`; empty for a default run."""
    parts = []
    for dest, label in names.items():
        value = getattr(args, dest)
        if value != parser.get_default(dest):
            parts.append(f"{label}{value}")
    return "-".join(parts)


def write_result(name: str, result: dict[str, Any], out_dir: str = RESULTS,
                 variant: str = "") -> str:
    """Write `<name>[-<variant>]-<date>.json` (a variant: a run with non-default options
    worth keeping beside the default one)."""
    result = {"benchmark": name, "variant": variant or "default", "date": DATE,
              "machine": machine(), **result}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{name}{'-' + variant if variant else ''}-{DATE}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
    return path


def print_table(summary: dict[str, Any], unit: str = "ms") -> None:
    scale = 1e3 if unit == "ms" else 1.0
    for name, med in summary["per_step_s"].items():
        q = summary["quartiles_s"][name]
        print(f"  {name:>8}: {med * scale:8.2f} {unit}/step  ({1 / med:7.2f} steps/s; "
              f"quartiles {q[0] * scale:.2f} .. {q[2] * scale:.2f} {unit})")
    r = summary["ratio"]
    print(f"  ratio {r['what']}: {r['of_medians']:.3f} (of medians), "
          f"{r['median_paired']:.3f} (median of paired blocks; quartiles "
          f"{r['paired_quartiles'][0]:.3f} .. {r['paired_quartiles'][2]:.3f})")


# ---------------------------------------------------------------- the GPT as an nn.Module

def gpt_case(cfg_name: str, batch_size: int) -> tuple[Any, dict, dict, dict, Any]:
    """On a rank of the default group: the example GPT's config, parameters (same seed, so
    the same on every rank), global batch, this rank's half of it and the loss function."""
    add_paths()
    import gpt
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = gpt.GPT_CONFIGS[cfg_name]
    params = gpt.init_params(cfg, dtype=torch.float32)
    batch = gpt.make_batch(cfg, batch_size)
    local = {k: v.chunk(world)[rank].contiguous() for k, v in batch.items()}

    def loss(p: dict, b: dict) -> torch.Tensor:
        return gpt.loss_fn(p, b, cfg)

    return cfg, params, batch, local, loss


def gpt_module(cfg: Any, params: dict) -> Any:
    """`examples/gpt.py`'s model as an `nn.Module` holding copies of `params` (same
    values), for DDP and FSDP2. Each transformer block is a submodule whose forward calls
    `gpt.block` with its parameters as a dict, so FSDP2 can shard and gather per block; the
    root computes the rest exactly as `gpt.gpt` and `gpt.loss_fn` do (the benchmarks check
    loss and gradients against pxform before timing)."""
    import gpt
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Block(nn.Module):
        def __init__(self, p: dict) -> None:
            super().__init__()
            self.names = list(p)
            for k, v in p.items():
                self.register_parameter(k, nn.Parameter(v.detach().clone()))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return gpt.block({k: getattr(self, k) for k in self.names}, x, cfg)

    class GPT(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            for k in ("wte", "wpe", "lnf_w", "lnf_b"):
                self.register_parameter(k, nn.Parameter(params[k].detach().clone()))
            self.blocks = nn.ModuleList(Block(p) for p in params["blocks"])

        def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = F.embedding(idx, self.wte) + F.embedding(pos, self.wpe)
            x = F.dropout(x, cfg.dropout)
            for blk in self.blocks:
                x = blk(x)
            x = F.layer_norm(x, (cfg.d_model,), self.lnf_w, self.lnf_b)
            logits = F.linear(x, self.wte)
            return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

        def grad_tree(self) -> dict:
            """The `.grad`s, nested like `gpt.init_params` (compare with `optree`)."""
            tree = {k: getattr(self, k).grad for k in ("wte", "wpe", "lnf_w", "lnf_b")}
            tree["blocks"] = [{k: getattr(blk, k).grad for k in blk.names}
                              for blk in self.blocks]
            return tree

    return GPT()
