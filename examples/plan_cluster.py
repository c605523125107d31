"""Plan GPT-3 175B and a Llama-2-70B-shaped GPT for clusters you do not have.

`pxform.auto(fn, mesh=N, hardware=...).plan(params, batch)` traces the training loss on fake
tensors (parameters on the `meta` device, bfloat16: nothing is allocated) and searches
pipeline, data, ZeRO-3 and tensor parallelism and recompute for N devices under the
device's memory. This script does that for a few clusters and prints, per case: the chosen
configuration (`plan.config_text()`), a summary of `plan.explain()` (block strategies,
stages), the predicted step time, peak memory per device, samples/s and model FLOPs
utilisation, how long the search took, and the time/memory frontier
(`pxform.tools.cli.frontier_table`). Into `--out DIR/<case>/` it writes the plan as JSON
(`plan.save`, load it with `pxform.Plan.load`), the full `explain()` text, and the
frontier and 1F1B timeline pictures (`pxform.tools.cli.write_plots`, the pictures of
`pxform plan --plots`; skipped with a message when matplotlib is missing).

Models (`examples/gpt.py`, GPT-3 paper shapes, tied embeddings, learned positions):

    gpt3-175b   GPT_CONFIGS["175B"]: 96 layers, d_model 12288, 96 heads, seq 2048,
                174.6 B parameters; global batch 1536 sequences (3.1 M tokens, the paper's)
    llama70b    NOT Llama: the example GPT at Llama-2-70B's shape (80 layers, d_model 8192,
                64 heads, seq 4096, vocab 32000), 64.7 B parameters against Llama-2-70B's
                69 B: grouped-query attention, the SwiGLU MLP (3 matrices of 8192 x 28672
                instead of 2 of 8192 x 32768), RMSNorm and rotary positions are not
                modelled; global batch 1024 sequences (4.2 M tokens, as Llama 2)
    gpt-1.3b    GPT_CONFIGS["1.3B"], global batch 64 (the --quick case)

Cases (`--cases` picks some, comma-separated, or `all`; `--list` shows them):

    gpt3-175b-h100x1024      1024 H100-80GB
    gpt3-175b-h100x256        256 H100-80GB
    gpt3-175b-a100-80gbx512   512 A100-80GB
    llama70b-h100x256         256 H100-80GB
    llama70b-a100-40gbx64      64 A100-40GB
    gpt3-175b-a100-40gbx64     64 A100-40GB: does not fit (the optimizer state alone, 16 B
                               per parameter fully sharded, is 40.7 GiB per device); prints
                               the search's SearchError, which says how much memory and how
                               many devices it would take. Not in the default set: that
                               diagnosis takes ~25 s more than a search.
    gpt-1.3b-h100x16           16 H100-80GB (--quick)

Run (one process: no GPU, no torchrun):

    python examples/plan_cluster.py                    # the five default cases
    python examples/plan_cluster.py --quick            # GPT 1.3B on 16 H100s, seconds
    python examples/plan_cluster.py --cases gpt3-175b-a100-40gbx64,llama70b-a100-40gbx64
    python examples/plan_cluster.py --full --out /tmp/plans --no-plots

On a 2-core machine the default cases take about 60 s of planning (5-20 s each, most of it
tracing the 175B model on `meta`), and drawing their timelines (up to 16 x 1024
microbatches) another minute, done in a second process while the next case plans: about
1.5 minutes in all, 1 minute with `--no-plots`.

Predictions come from pxform's cost model with the hardware presets' datasheet numbers
(`pxform.hardware.PRESETS`: 50% of peak FLOP/s, nccl-tests bandwidths), not from
measurements: compare plans with each other, not with published step times.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import multiprocessing
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# the example GPT lives next to this file: importable however this file is run or imported
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt  # noqa: E402

import pxform  # noqa: E402
from pxform.core.units import format_bytes  # noqa: E402
from pxform.tools.cli import frontier_table, write_plots  # noqa: E402


@dataclass(frozen=True)
class Model:
    """A model to plan: the example GPT at `cfg`'s shape, and the global batch."""

    cfg: gpt.GPTConfig
    batch: int
    title: str


MODELS: dict[str, Model] = {
    "gpt3-175b": Model(gpt.GPT_CONFIGS["175B"], 1536, "GPT-3 175B"),
    # Llama-2-70B's shape (Touvron et al. 2023, table 1 and section 2.2) on the example
    # GPT's layers: see the module doc for what is not modelled
    "llama70b": Model(gpt.GPTConfig(vocab_size=32000, seq_len=4096, num_layers=80,
                                    num_heads=64, d_model=8192),
                      1024, "Llama-2-70B-shaped GPT (not Llama: no GQA, no SwiGLU)"),
    "gpt-1.3b": Model(gpt.GPT_CONFIGS["1.3B"], 64, "GPT-3 1.3B"),
}


@dataclass(frozen=True)
class Case:
    """One planning run: a model on `devices` devices of a hardware preset."""

    name: str
    model: str
    devices: int
    hardware: str


CASES: dict[str, Case] = {c.name: c for c in (
    Case("gpt3-175b-h100x1024", "gpt3-175b", 1024, "h100-80gb"),
    Case("gpt3-175b-h100x256", "gpt3-175b", 256, "h100-80gb"),
    Case("gpt3-175b-a100-80gbx512", "gpt3-175b", 512, "a100-80gb"),
    Case("llama70b-h100x256", "llama70b", 256, "h100-80gb"),
    Case("llama70b-a100-40gbx64", "llama70b", 64, "a100-40gb"),
    Case("gpt3-175b-a100-40gbx64", "gpt3-175b", 64, "a100-40gb"),
    Case("gpt-1.3b-h100x16", "gpt-1.3b", 16, "h100-80gb"),
)}
DEFAULT = ("llama70b-a100-40gbx64", "gpt3-175b-h100x256", "gpt3-175b-h100x1024",
           "gpt3-175b-a100-80gbx512", "llama70b-h100x256")
"""The default run. The cases whose timelines have the most (stage, microbatch) pairs come
first, so that their pictures, the slowest to draw, are drawn while later cases plan."""
QUICK = ("gpt-1.3b-h100x16",)


def model_args(name: str) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """`(loss, (params, batch))` for `MODELS[name]`: bfloat16 parameters and the batch on
    the `meta` device (shapes only, nothing allocated).

    Example:
        >>> loss, (params, batch) = model_args("gpt3-175b")
        >>> params["wte"].device, batch["idx"].shape
        (device(type='meta'), torch.Size([1536, 2048]))
    """
    model = MODELS[name]
    cfg = model.cfg

    def loss(params: dict, batch: dict) -> torch.Tensor:
        return gpt.loss_fn(params, batch, cfg)

    loss.__name__ = name.replace("-", "_").replace(".", "_")  # how the plan names it
    params = gpt.init_params(cfg, device="meta", dtype=torch.bfloat16)
    return loss, (params, gpt.make_batch(cfg, model.batch, device="meta"))


@dataclass(frozen=True)
class Outcome:
    """What planning a case gave: a plan, or the SearchError's message."""

    case: Case
    plan: pxform.Plan | None
    error: str | None
    seconds: float  # wall time of `plan()`: tracing, analysis and search


def plan_case(case: Case) -> Outcome:
    """Plan `case` with `pxform.auto` (the hardware's memory as the budget). A budget
    nothing fits is an outcome, not a failure: its SearchError explains what would fit."""
    fn, args = model_args(case.model)
    step = pxform.auto(fn, mesh=case.devices, hardware=case.hardware)
    start = time.perf_counter()
    try:
        plan = step.plan(*args)
    except pxform.SearchError as exc:
        return Outcome(case, None, str(exc), time.perf_counter() - start)
    return Outcome(case, plan, None, time.perf_counter() - start)


# ---------------------------------------------------------------------------- reporting
def mfu(plan: pxform.Plan, model: Model) -> float:
    """Model FLOPs utilisation of the predicted step: 6 x parameters x tokens (forward and
    backward of every weight, Kaplan et al. 2020; attention scores and recompute left
    out) over the devices' bf16 datasheet peak."""
    peak = dict(pxform.hardware.hardware(plan.hardware).peak_flops)["bf16"]
    tokens = plan.global_batch * model.cfg.seq_len
    return 6 * model.cfg.num_params() * tokens / (plan.step_time_s * plan.devices * peak)


def summary(outcome: Outcome) -> str:
    """The case's headline numbers and a compact `explain()` (the full one is written to
    explain.txt): configuration, predictions, block strategies, stages, split
    parameters."""
    plan, model = outcome.plan, MODELS[outcome.case.model]
    assert plan is not None
    seq = model.cfg.seq_len
    samples = plan.global_batch / plan.step_time_s
    strategies = Counter(b.strategy for b in plan.blocks)
    stages = plan.stage_plans
    split = sum(1 for _, s in plan.param_specs if "inner" in s or "outer" in s)

    def span(values: list[float], fmt: Callable[[float], str]) -> str:
        lo, hi = min(values), max(values)
        return fmt(lo) if fmt(lo) == fmt(hi) else f"{fmt(lo)} - {fmt(hi)}"

    def secs(x: float) -> str:
        return f"{x:.3g} s"

    def gib(x: float) -> str:
        return format_bytes(int(x))

    lines = [
        f"config: {plan.config_text()}  (mesh {plan.mesh})",
        f"predicted step {plan.step_time_s:.4g} s, peak memory "
        f"{format_bytes(int(plan.peak_memory_bytes))} per device (budget "
        f"{format_bytes(plan.memory_budget)}), {samples:.4g} samples/s = "
        f"{samples * seq:,.0f} tokens/s, MFU {100 * mfu(plan, model):.0f}%",
        f"search {plan.search_seconds:.2f} s; plan() {outcome.seconds:.2f} s in all (tracing "
        f"on meta and analysis included)",
        "blocks: " + ", ".join(f"{n}x {s}" for s, n in strategies.most_common()),
        f"stages: {len(stages)}; blocks per stage "
        f"{span([float(len(s.blocks)) for s in stages], lambda x: f'{x:.0f}')}; per "
        f"microbatch F {span([s.forward_s for s in stages], secs)}, B "
        f"{span([s.backward_s for s in stages], secs)}; microbatches in flight "
        f"{span([float(s.in_flight) for s in stages], lambda x: f'{x:.0f}')}; peak memory "
        f"{span([s.memory_bytes for s in stages], gib)}",
        f"parameters stored split: {split} of {len(plan.param_specs)} (explain.txt lists "
        f"them)",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def header(case: Case) -> str:
    model = MODELS[case.model]
    cfg = model.cfg
    return (f"== {case.name}: {model.title}, {cfg.num_params() / 1e9:.1f} B parameters "
            f"({cfg.num_layers} layers, d_model {cfg.d_model}, seq {cfg.seq_len}), global "
            f"batch {model.batch}, on {case.devices} x {case.hardware}")


# ---------------------------------------------------------------------------- files
def save(outcome: Outcome, out: str) -> list[str]:
    """Write plan.json and explain.txt into `out/<case>/`; their paths."""
    plan = outcome.plan
    assert plan is not None
    folder = os.path.join(out, outcome.case.name)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "plan.json")
    plan.save(path)
    text = os.path.join(folder, "explain.txt")
    with open(text, "w") as f:
        f.write(plan.explain(per_block=True) + "\n\n" + frontier_table(plan) + "\n")
    return [path, text]


def have_matplotlib() -> bool:
    """Whether the pictures can be drawn (matplotlib is an optional dependency)."""
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


class Pictures:
    """Draws each plan's pictures with `pxform.tools.cli.write_plots`, in a second process when
    there are several cases: a timeline of hundreds of microbatches takes seconds to draw,
    and planning the next case meanwhile uses the other core."""

    def __init__(self, background: bool) -> None:
        self.pool = (concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) if background else None)
        self.pending: list[tuple[str, concurrent.futures.Future[list[str]]]] = []

    def draw(self, name: str, plan: pxform.Plan, folder: str) -> None:
        if self.pool is None:
            done: concurrent.futures.Future[list[str]] = concurrent.futures.Future()
            try:
                done.set_result(write_plots(plan, folder))
            except Exception as exc:  # reported with the others in finish()
                done.set_exception(exc)
            self.pending.append((name, done))
        else:
            self.pending.append((name, self.pool.submit(write_plots, plan, folder)))

    def finish(self) -> bool:
        """Wait for every picture; print where each went. False if any failed."""
        ok = True
        for name, future in self.pending:
            try:
                print(f"{name}: wrote {', '.join(future.result())}")
            except Exception as exc:
                print(f"{name}: drawing the pictures failed: {type(exc).__name__}: {exc}",
                      file=sys.stderr)
                ok = False
        if self.pool is not None:
            self.pool.shutdown()
        return ok


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Plan GPT-3 175B and a Llama-2-70B-shaped GPT for several clusters "
                    "(one process, fake tensors: no GPU, no torchrun).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="cases: " + ", ".join(CASES) + f"\ndefault: {','.join(DEFAULT)}")
    parser.add_argument("--cases", default=None,
                        help="comma-separated case names, or 'all' (default: the five that "
                             "fit; see --list)")
    parser.add_argument("--quick", action="store_true",
                        help=f"only {QUICK[0]} (seconds; for tests and CI)")
    parser.add_argument("--out", default="plan_cluster_out",
                        help="folder for plan.json, explain.txt and the pictures, one "
                             "sub-folder per case (default: plan_cluster_out)")
    parser.add_argument("--no-plots", action="store_true", help="do not draw pictures")
    parser.add_argument("--full", action="store_true",
                        help="print the whole plan.explain() instead of a summary")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args(argv)
    if args.quick and args.cases:
        parser.error("give --quick or --cases, not both")
    names = (QUICK if args.quick else DEFAULT if args.cases is None else
             tuple(CASES) if args.cases == "all" else
             tuple(n.strip() for n in args.cases.split(",") if n.strip()))
    unknown = [n for n in names if n not in CASES]
    if unknown or not names:
        parser.error(f"unknown case(s) {', '.join(unknown) or '(none given)'}; choose from "
                     f"{', '.join(CASES)} or 'all'")
    args.case_names = names
    return args


def main(argv: list[str] | None = None) -> int:
    """Plan the chosen cases; 0 when every case was planned or explained why nothing fits,
    1 when planning or writing failed."""
    args = parse_args(argv)
    if args.list:
        for c in CASES.values():
            mark = "default" if c.name in DEFAULT else "quick" if c.name in QUICK else ""
            print(f"{c.name:<24} {mark:<8} {c.devices:>5} x {c.hardware:<10} "
                  f"{MODELS[c.model].title}")
        return 0
    plots = not args.no_plots and have_matplotlib()
    if not args.no_plots and not plots:
        print("matplotlib is not installed: the frontier and timeline pictures are skipped "
              "(pip install pxform[plot] to draw them)")
    pictures = Pictures(background=plots and len(args.case_names) > 1)
    outcomes: list[Outcome] = []
    saved = 0  # cases whose files were written
    status = 0
    start = time.perf_counter()
    for name in args.case_names:
        case = CASES[name]
        print(header(case), flush=True)
        try:
            outcome = plan_case(case)
        except pxform.PxformError as exc:  # tracing or analysis failed: a real failure
            print(f"planning failed: {type(exc).__name__}: {exc}\n", file=sys.stderr)
            status = 1
            continue
        outcomes.append(outcome)
        if outcome.plan is None:
            print(f"no plan fits ({outcome.seconds:.1f} s):\n{outcome.error}\n", flush=True)
            continue
        print(outcome.plan.explain() if args.full else summary(outcome))
        print(frontier_table(outcome.plan))
        try:
            for path in save(outcome, args.out):
                print(f"wrote {path}")
            saved += 1
        except OSError as exc:
            print(f"cannot write {exc.filename}: {exc.strerror}\n  Fix: pass --out a "
                  f"writable folder.", file=sys.stderr)
            status = 1
            break
        if plots:
            pictures.draw(name, outcome.plan, os.path.join(args.out, name))
        print(flush=True)
    if not pictures.finish():
        status = 1
    print(table(outcomes))
    print(f"\n{len(outcomes)} case(s) in {time.perf_counter() - start:.1f} s"
          + (f"; files in {os.path.abspath(args.out)}" if saved else ""))
    return status


def table(outcomes: list[Outcome]) -> str:
    """One row per case: the plan's headline numbers, or why nothing fits."""
    rows = [("case", "config", "step", "peak memory", "samples/s", "MFU", "search",
             "plan()")]
    for o in outcomes:
        if o.plan is None:
            rows.append((o.case.name, "no plan fits (message above)", "-", "-", "-", "-",
                         "-", f"{o.seconds:.1f} s"))
            continue
        p = o.plan
        rows.append((o.case.name, f"pp={p.stages} outer={p.outer} inner={p.inner} "
                                  f"microbatches={p.microbatches}",
                     f"{p.step_time_s:.4g} s", format_bytes(int(p.peak_memory_bytes)),
                     f"{p.global_batch / p.step_time_s:.4g}",
                     f"{100 * mfu(p, MODELS[o.case.model]):.0f}%",
                     f"{p.search_seconds:.2f} s", f"{o.seconds:.1f} s"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
    sys.exit(main())
