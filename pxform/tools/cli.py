"""The `pxform` console script.

    pxform plan MODULE:FACTORY --devices N --batch B [--seq S] [--hardware H] [--memory M]
                [--margin F] [--objective time|memory|devices] [--out plan.json] [--plots DIR]
                [--per-block] [--quiet]
    pxform calibrate --out profile.json [--sizes ...] [--repeats R] [--name NAME] [--runs N]
    pxform check-profile PROFILE [--repeats R] [--tolerance F] [--refresh NEW]
                         [--model MODULE:FACTORY --batch B [--seq S]]
    pxform --version

`pxform plan` imports MODULE (the current directory first on `sys.path`, so
`examples.factories:gpt_tiny` works from the repository root; `path/to/file.py:FACTORY`
loads a file), calls `FACTORY(batch=B, seq=S)` for `(fn, args)`, searches a plan with
`pxform.auto(fn, mesh=N, ...).plan(*args)` on fake tensors (no devices needed), prints
`Plan.explain()` and the time/memory frontier, and optionally writes the plan as JSON and
two pictures (the frontier, and the chosen plan's pipeline timeline; they need matplotlib).

`pxform check-profile` (on every rank of the world PROFILE was measured on, under
torchrun) times the program the profile's op time scale was fitted on and compares it with
the profile's price (`pxform.tools.profile_check`): is the profile still this machine's?
With --refresh it writes the profile with its op times rescaled to the machine as it is.
With --model it times and prices the factory's function on one device's batch instead, and
--refresh rescales the op times to that model's (`check_profile`'s `fn`).

Exit codes: 0 done (check-profile: within the tolerance, or refreshed); 1 no plan fits
(`pxform.SearchError`) or planning failed; 2 a usage error (bad arguments, a
MODULE:FACTORY that cannot be loaded or called, matplotlib missing for --plots, a profile
that cannot be read or was measured on another number of ranks); 3 check-profile found the
profile stale (and no --refresh; under torchrun every rank exits 3 and torchrun itself 1,
naming their exit codes); 130 interrupted.

Example:
    $ pxform plan examples.factories:gpt_tiny --devices 2 --batch 8 --hardware a100-40gb \\
          --memory 40GiB --out plan.json --plots plots
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import inspect
import math
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any, NoReturn, TextIO

from pxform.core.errors import PxformError
from pxform.core.units import format_bytes, format_table, parse_bytes
from pxform.cost.hardware import PRESETS, Hardware
from pxform.cost.hardware import hardware as get_hardware
from pxform.runtime import calibrate, world
from pxform.runtime.worker import exit_worker
from pxform.search import SearchError
from pxform.search.plan import FrontierPoint, Plan, schedule_text
from pxform.tools.profile_check import (
    DEFAULT_TOLERANCE,
    ProfileCheck,
    calibration_spread,
    check_profile,
    refreshed_profile,
)
from pxform.tools.runtime_costs import representative_profile, runtime_costs
from pxform.transforms.auto import DEFAULT_MEMORY_MARGIN, auto

__all__ = ["build_parser", "frontier_table", "load_factory", "main", "write_plots"]

_GIB = 2**30
_EXAMPLE = "examples.factories:gpt_tiny"


class UsageError(Exception):
    """A command-line mistake: `what` went wrong, `fix` says what to do (exit code 2)."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(f"{what}\n  Fix: {fix}")


# ---------------------------------------------------------------------------- parser
def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be at least 1")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be above 0, e.g. 0.1 for 10 %")
    return value


def _memory(text: str) -> int:
    try:
        return parse_bytes(text, what="--memory")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    """The `pxform` argument parser: subcommands `plan`, `calibrate` and `check-profile`."""
    parser = argparse.ArgumentParser(
        prog="pxform", description="pxform: parallelism transforms for PyTorch.")
    parser.add_argument("--version", action="version",
                        version=f"pxform {metadata.version('pxform')}")
    sub = parser.add_subparsers(dest="command", metavar="{plan,calibrate,check-profile}",
                                required=True)

    plan = sub.add_parser(
        "plan", help="search a parallel plan for a model factory (no devices needed)",
        description="Search a parallel plan for the function a factory returns: trace it\n"
                    "on fake tensors, search pipeline, data and tensor parallelism and\n"
                    "recompute for N devices, print the plan and its time/memory frontier.\n"
                    "Exit codes: 0 done, 1 no plan fits, 2 usage error.",
        epilog=f"example:\n  pxform plan {_EXAMPLE} --devices 2 --batch 8 \\\n"
               f"      --hardware a100-40gb --memory 40GiB --out plan.json --plots plots",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    plan.add_argument("factory", metavar="MODULE:FACTORY",
                      help="a function FACTORY(batch=B, seq=S) -> (fn, args) in MODULE (a "
                           "module importable from the current directory, or path/to/file.py)")
    plan.add_argument("--devices", type=_positive, required=True, metavar="N",
                      help="how many devices to plan for")
    plan.add_argument("--batch", type=_positive, required=True, metavar="B",
                      help="the global batch size passed to the factory")
    plan.add_argument("--seq", type=_positive, default=None, metavar="S",
                      help="the sequence length passed to the factory (default: the "
                           "factory's own)")
    plan.add_argument("--hardware", default="h100-80gb", metavar="NAME|PATH",
                      help=f"a preset ({', '.join(PRESETS)}) or a profile written by "
                           f"`pxform calibrate --out PATH` (default: h100-80gb)")
    plan.add_argument("--memory", type=_memory, default=None, metavar="SIZE",
                      help="memory budget per device, e.g. 80GiB (default: the hardware's "
                           "device memory)")
    plan.add_argument("--margin", type=float, default=DEFAULT_MEMORY_MARGIN, metavar="FRACTION",
                      help=f"share of the budget the plan keeps free (default "
                           f"{DEFAULT_MEMORY_MARGIN}; 0: plan to all of it)")
    plan.add_argument("--objective", choices=("time", "memory", "devices"), default="time",
                      help="fastest step within the budget, least memory, or fewest "
                           "devices (default: time)")
    plan.add_argument("--out", default=None, metavar="PATH",
                      help="write the plan as JSON (read it with pxform.Plan.load)")
    plan.add_argument("--plots", default=None, metavar="DIR",
                      help="write DIR/frontier.png and DIR/timeline.png (needs matplotlib)")
    plan.add_argument("--per-block", action="store_true",
                      help="one row per block in the report (default: similar blocks share "
                           "a row)")
    plan.add_argument("--quiet", action="store_true",
                      help="no progress messages on stderr")
    plan.set_defaults(run=_plan_command)

    cal = sub.add_parser(
        "calibrate", help="measure this machine's compute and collectives into a profile",
        description="Measure matmul rates and collective times on this machine (run under "
                    "torchrun for collectives) and write a hardware profile for "
                    "`pxform plan --hardware PATH`.")
    calibrate.add_arguments(cal)
    cal.set_defaults(run=functools.partial(calibrate.main, refine=runtime_costs,
                                           combine=representative_profile,
                                           advise=_spread_text))

    check = sub.add_parser(
        "check-profile", help="is a profile from `pxform calibrate` still this machine's?",
        description="Time the reference program a profile's op time scale was fitted on\n"
                    "(on every rank at once: run under torchrun with the ranks the profile\n"
                    "was measured on) and compare it with the profile's price for it.\n"
                    "Exit codes: 0 within the tolerance (or --refresh written), 2 usage\n"
                    "error, 3 stale.",
        epilog="example:\n  torchrun --nproc-per-node 2 -m pxform check-profile cpu.json "
               "--refresh cpu-now.json",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("profile", metavar="PROFILE",
                       help="a profile written by `pxform calibrate --out PATH`")
    check.add_argument("--repeats", type=_positive, default=30, metavar="R",
                       help="timed steps; the median counts (default: 30, half a second "
                            "on a CPU)")
    check.add_argument("--tolerance", type=_fraction, default=DEFAULT_TOLERANCE,
                       metavar="FRACTION",
                       help=f"the largest error that is not stale (default "
                            f"{DEFAULT_TOLERANCE})")
    check.add_argument("--refresh", default=None, metavar="NEW",
                       help="write the profile with its op times rescaled to the time "
                            "measured now to NEW (rank 0; NEW may be PROFILE)")
    check.add_argument("--model", default=None, metavar="MODULE:FACTORY",
                       help="time and price your own function instead of the reference "
                            "program: FACTORY(batch=B, seq=S) returns (fn, args), as for "
                            "`pxform plan`; with --refresh the profile then prices this "
                            "model's ops at what they take here")
    check.add_argument("--batch", type=_positive, default=None, metavar="B",
                       help="with --model: one device's batch (e.g. the global batch over "
                            "the data-parallel degree)")
    check.add_argument("--seq", type=_positive, default=None, metavar="S",
                       help="with --model: the sequence length, passed as seq=S")
    check.set_defaults(run=_check_profile_command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `pxform` command line with `argv` (default: `sys.argv[1:]`); the exit code.

    Example:
        >>> main(["plan", "examples.factories:gpt_tiny", "--devices", "2", "--batch", "8"])
        0
    """
    parser = build_parser()
    try:
        args = parser.parse_args(None if argv is None else list(argv))
    except SystemExit as exc:  # --help, --version, or a usage error argparse printed
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 2)
    try:
        return int(args.run(args))
    except KeyboardInterrupt:
        print(f"pxform {args.command}: interrupted", file=sys.stderr)
        return 130


def entry() -> NoReturn:
    """The `pxform` executable and `python -m pxform`: `main()`, then `exit_worker` with its
    code (not sys.exit: under torchrun a gloo thread can abort a clean exit; see
    `pxform/runtime/worker.py`)."""
    exit_worker(main())


# ---------------------------------------------------------------------------- plan
def _plan_command(args: argparse.Namespace) -> int:
    err = sys.stderr
    try:
        hw = _hardware(args.hardware)
        if args.plots is not None:
            _need_matplotlib()
        factory = load_factory(args.factory)
        fn, fn_args = call_factory(factory, args.factory, args.batch, args.seq)
    except UsageError as exc:
        print(f"pxform plan: {exc}", file=err)
        return 2

    bar = _ProgressBar(err, live=None if not args.quiet else False)
    if not args.quiet:
        budget = format_bytes(args.memory if args.memory is not None else hw.memory_bytes)
        print(f"searching {args.devices} devices ({hw.name}, {budget} per device, objective "
              f"{args.objective}) for {args.factory} ...", file=err, flush=True)
    start = time.perf_counter()
    try:
        step = auto(fn, mesh=args.devices, memory_budget=args.memory,
                    objective=args.objective, hardware=hw, progress=bar,
                    memory_margin=args.margin)
        plan = step.plan(*fn_args)
    except SearchError as exc:  # no plan fits: the message has the least memory needed
        bar.close()
        print(f"pxform plan: {exc}", file=err)
        return 1
    except PxformError as exc:  # tracing or analysing the function failed
        bar.close()
        print(f"pxform plan: planning {args.factory} failed: {exc}", file=err)
        return 1
    bar.close()
    if not args.quiet:
        print(f"searched in {time.perf_counter() - start:.2f} s", file=err, flush=True)

    print(plan.explain(per_block=args.per_block))
    print()
    print(frontier_table(plan))
    sys.stdout.flush()
    try:
        if args.out is not None:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            plan.save(args.out)
            if not args.quiet:
                print(f"wrote {args.out}", file=err)
        if args.plots is not None:
            for path in write_plots(plan, args.plots):
                if not args.quiet:
                    print(f"wrote {path}", file=err)
    except OSError as exc:
        print(f"pxform plan: cannot write {exc.filename or 'the output'}: "
              f"{exc.strerror or exc}\n  Fix: pass --out / --plots a writable path.", file=err)
        return 1
    return 0


def _spread_text(hw: Hardware) -> str:
    """`pxform calibrate --runs N`'s last word: how far apart its calibrations priced the
    reference program (`calibration_spread`), a warning past 10 %."""
    return calibration_spread(hw).explain()


# ---------------------------------------------------------------------------- check-profile
def _check_profile_command(args: argparse.Namespace) -> int:
    err = sys.stderr
    try:
        hw = Hardware.load(args.profile)
    except OSError as exc:
        print(f"pxform check-profile: cannot read {args.profile}: {exc.strerror or exc}\n"
              f"  Fix: pass a profile written by `pxform calibrate --out PATH`.", file=err)
        return 2
    except ValueError as exc:  # (its message says what is wrong and how to fix it)
        print(f"pxform check-profile: {exc}", file=err)
        return 2
    if (args.batch is not None or args.seq is not None) and args.model is None:
        print("pxform check-profile: --batch and --seq are the arguments of --model's "
              "factory, and no --model was given.\n  Fix: add --model MODULE:FACTORY, or "
              "drop them to check the reference program.", file=err)
        return 2
    if args.model is not None and args.batch is None:
        print(f"pxform check-profile: --model {args.model} needs --batch B: one device's "
              f"batch to time its step at.\n  Fix: add --batch (e.g. the global batch over "
              f"the data-parallel degree).", file=err)
        return 2
    with world.torchrun_world():
        try:
            fn, fn_args = None, ()
            if args.model is not None:
                # every rank builds its own arguments (same seed, same values)
                fn, fn_args = call_factory(load_factory(args.model), args.model, args.batch,
                                           args.seq)
            result = check_profile(hw, repeats=args.repeats, tolerance=args.tolerance,
                                   fn=fn, args=fn_args)
        except (ValueError, UsageError, PxformError) as exc:
            # raised alike on every rank, before any collective
            if world.rank() == 0:
                print(f"pxform check-profile: {exc}", file=err, flush=True)
            world.barrier()  # (rank 0 printed before any rank leaves: see below)
            return 2
        code = _report_check(args, hw, result) if world.rank() == 0 else None
        # every rank leaves with rank 0's code, after it printed: under torchrun a rank
        # that exits non-zero first gets the others stopped, rank 0's lines unprinted
        return int(world.gather_objects(code)[0])


def _report_check(args: argparse.Namespace, hw: Hardware, result: ProfileCheck) -> int:
    """On rank 0: print the check, write --refresh; the exit code."""
    print(result.explain(), flush=True)
    if args.refresh is None:
        return 3 if result.stale else 0
    try:
        refreshed_profile(hw, result).save(args.refresh)
    except OSError as exc:
        print(f"pxform check-profile: cannot write {args.refresh}: "
              f"{exc.strerror or exc}\n  Fix: pass --refresh a writable path.",
              file=sys.stderr, flush=True)
        return 1
    print(f"wrote {args.refresh} (op times x{result.factor:.3f})", flush=True)
    return 0


def _hardware(spec: str) -> Hardware:
    try:
        return get_hardware(spec)
    except ValueError as exc:
        raise UsageError(f"--hardware {spec}: {exc}",
                         "pass a preset name, or measure this machine with `pxform "
                         "calibrate --out PATH` and pass PATH.") from None


def _need_matplotlib() -> None:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        raise UsageError("--plots needs matplotlib, which is not installed.",
                         "pip install 'pxform[plot]' (or pip install matplotlib), or leave "
                         "out --plots.") from None


# ---------------------------------------------------------------------------- factory
def _is_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def load_factory(spec: str) -> Callable[..., Any]:
    """The callable `spec` names: `module.path:name` (imported with the current directory
    first on `sys.path`) or `path/to/file.py:name`; `name` may be dotted (`Class.method`).

    Raises:
        UsageError: no colon, the module or file cannot be imported, the attribute is
            missing or not callable (the message names `spec` and a fix).
    """
    target, colon, attr = spec.rpartition(":")
    if not colon or not target or not attr:
        raise UsageError(f"{spec!r} is not MODULE:FACTORY.",
                         f"name a module and the factory in it, separated by a colon, e.g. "
                         f"{_EXAMPLE} or path/to/file.py:FACTORY.")
    module = _import_file(spec, target) if _is_file(target) else _import_module(spec, target)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            names = _factories(module)
            hint = (f"use one of the functions in {target}: {', '.join(names)}" if names
                    else f"define {attr}(batch, seq) -> (fn, args) in {target}")
            raise UsageError(f"{spec}: {target} has no attribute {attr!r}.", hint + ".")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec}: {attr} is a {type(obj).__name__}, not a function.",
                         "name a function FACTORY(batch, seq) -> (fn, args).")
    return obj


def _import_module(spec: str, name: str) -> Any:
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise UsageError(f"{spec}: no module named {exc.name!r} (looked in the current "
                             f"directory {cwd} and the installed packages).",
                             f"run from the folder that holds {name.split('.')[0]}, check "
                             f"the spelling, or give a file: path/to/file.py:FACTORY.") from None
        raise _import_failed(spec, name, exc) from None
    except Exception as exc:
        raise _import_failed(spec, name, exc) from None


def _import_file(spec: str, target: str) -> Any:
    path = os.path.abspath(target)
    if not os.path.isfile(path):
        raise UsageError(f"{spec}: no file {target!r} (from {os.getcwd()}).",
                         "check the path, or name an importable module: "
                         f"{_EXAMPLE}.")
    folder = os.path.dirname(path)
    if folder not in sys.path:  # so the file can import its neighbours
        sys.path.insert(0, folder)
    stem = os.path.splitext(os.path.basename(path))[0]
    loaded = sys.modules.get(stem)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        return loaded
    name = stem if stem.isidentifier() and loaded is None else \
        f"pxform_cli_{abs(hash(path)):x}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise UsageError(f"{spec}: cannot load {target!r} as Python.",
                         "give a .py file.")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise _import_failed(spec, target, exc) from None
    return module


def _import_failed(spec: str, name: str, exc: BaseException) -> UsageError:
    return UsageError(f"{spec}: importing {name} raised {type(exc).__name__}: {exc}"
                      f"{_where(exc)}.",
                      "fix that error (install what the module needs), then run again.")


def _where(exc: BaseException) -> str:
    """` (file.py, line N)` of the innermost frame of `exc`'s traceback outside this file
    ("" when it was raised here, e.g. calling with the wrong keywords)."""
    here = os.path.abspath(__file__)
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if os.path.abspath(f.filename) != here]
    if not frames:
        return ""
    last = frames[-1]
    return f" ({last.filename}, line {last.lineno})"


def _factories(module: Any) -> list[str]:
    """The public functions defined in `module`, sorted."""
    return sorted(n for n, v in vars(module).items()
                  if not n.startswith("_") and inspect.isfunction(v)
                  and v.__module__ == module.__name__)


def call_factory(factory: Callable[..., Any], spec: str, batch: int, seq: int | None
                 ) -> tuple[Callable[..., Any], tuple[Any, ...]]:
    """`factory(batch=batch, seq=seq)` (no `seq` when None) checked to be `(fn, args)`.

    Raises:
        UsageError: the factory raised, or returned something else.
    """
    kwargs: dict[str, int] = {"batch": batch}
    if seq is not None:
        kwargs["seq"] = seq
    call = f"{spec}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
    try:
        result = factory(**kwargs)
    except Exception as exc:
        raise UsageError(f"{call} raised {type(exc).__name__}: {exc}{_where(exc)}.",
                         "the factory must accept batch= (and seq= when --seq is given) "
                         "and return (fn, args); fix it or the arguments.") from None
    if not (isinstance(result, (tuple, list)) and len(result) == 2 and callable(result[0])
            and isinstance(result[1], (tuple, list))):
        raise UsageError(f"{call} returned {type(result).__name__}, not (fn, args).",
                         "return a function and the tuple of example arguments to trace it "
                         "with, e.g. `return loss_fn, (params, batch)`.")
    return result[0], tuple(result[1])


# ---------------------------------------------------------------------------- progress
class _ProgressBar:
    """`[#####-----] 12/22 configurations` redrawn in place on `stream`; only drawn when
    `live` (default: when `stream` is a terminal)."""

    def __init__(self, stream: TextIO, live: bool | None = None, width: int = 20) -> None:
        if live is None:
            isatty = getattr(stream, "isatty", None)
            live = bool(isatty()) if isatty is not None else False
        self.stream, self.live, self.width = stream, live, width
        self._shown = 0  # characters of the line drawn so far

    def __call__(self, done: int, total: int) -> None:
        if not self.live:
            return
        filled = self.width if total <= 0 else min(self.width, self.width * done // total)
        line = f"[{'#' * filled}{'-' * (self.width - filled)}] {done}/{total} configurations"
        self.stream.write("\r" + line.ljust(self._shown))
        self.stream.flush()
        self._shown = len(line)

    def close(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = 0


# ---------------------------------------------------------------------------- output
def _chosen_index(plan: Plan) -> int | None:
    """The frontier point of the chosen plan: same configuration and block strategies,
    the nearest in (memory, time) when several match (the plan's own step time may be
    simulated more exactly than the frontier's estimate); None if none matches."""
    counts = Counter(b.strategy for b in plan.blocks)
    strategies = ", ".join(f"{n}x {t}" for t, n in counts.most_common())
    config = plan.config_text()

    def distance(p: FrontierPoint) -> float:
        return sum(abs(math.log(max(a, 1e-300) / max(b, 1e-300)))
                   for a, b in ((p.memory_bytes, plan.peak_memory_bytes),
                                (p.time_s, plan.step_time_s)))

    same = [(distance(p), k) for k, p in enumerate(plan.frontier())
            if (config == p.config or config.startswith(p.config + " "))
            and p.strategies == strategies]
    return min(same)[1] if same else None


def frontier_table(plan: Plan) -> str:
    """The plan's time/memory frontier as a table, least memory first, the chosen plan
    marked `*`."""
    points = plan.frontier()
    if not points:
        return "frontier: none recorded (the plan was pinned, not searched)"
    chosen = _chosen_index(plan)
    rows = [("", "step time", "memory", "config", "strategies")]
    for k, p in enumerate(points):
        rows.append(("*" if k == chosen else "", f"{p.time_s:.4g} s",
                     format_bytes(int(p.memory_bytes)), p.config, p.strategies))
    mark = " (* the chosen plan)" if chosen is not None else ""
    lines = [f"frontier: {len(points)} plan(s), least memory first{mark}"]
    lines += format_table(rows)
    return "\n".join(lines)


def write_plots(plan: Plan, folder: str | os.PathLike[str]) -> list[str]:
    """Write `folder/frontier.png` and `folder/timeline.png`; their paths.

    Raises:
        ImportError: matplotlib is not installed (the message has the fix).
    """
    os.makedirs(folder, exist_ok=True)
    frontier = os.path.join(os.fspath(folder), "frontier.png")
    timeline = os.path.join(os.fspath(folder), "timeline.png")
    plot_frontier(plan, frontier)
    plot_timeline(plan, timeline)
    return [frontier, timeline]


def _figure(size: tuple[float, float]) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as missing:
        raise ImportError("pxform plan --plots needs matplotlib: pip install 'pxform[plot]' "
                          "(or pip install matplotlib)") from missing
    return Figure(figsize=size)


def plot_frontier(plan: Plan, path: str) -> None:
    """The frontier as a step line of points (x: peak memory per device in GiB, y: step
    time in s), the chosen plan as a star, the budget as a vertical line (an arrow at the
    right edge when it lies far beyond every point)."""
    fig = _figure((6.4, 4.2))
    ax = fig.subplots()
    points = plan.frontier()
    xs = [p.memory_bytes / _GIB for p in points]
    ys = [p.time_s for p in points]
    if points:
        ax.step(xs, ys, where="post", color="#4C72B0", linewidth=1.2, alpha=0.7, zorder=1)
        ax.scatter(xs, ys, s=28, color="#4C72B0", zorder=2,
                   label=f"frontier ({len(points)} plans)")
    chosen_x, chosen_y = plan.peak_memory_bytes / _GIB, plan.step_time_s
    ax.scatter([chosen_x], [chosen_y], marker="*", s=220, color="#C44E52",
               edgecolor="black", linewidth=0.5, zorder=3,
               label=f"chosen: {plan.config_text()}")
    budget = plan.memory_budget / _GIB
    right = max(xs + [chosen_x])
    if budget <= 3 * right:
        ax.axvline(budget, color="#DD8452", linestyle="--", linewidth=1.2,
                   label=f"budget {format_bytes(plan.memory_budget)}")
        ax.set_xlim(0, max(budget, right) * 1.08)
    else:
        ax.set_xlim(0, right * 1.15)
        ax.annotate(f"budget {format_bytes(plan.memory_budget)} \u2192", xy=(0.99, 0.97),
                    xycoords="axes fraction", ha="right", va="top", fontsize=8,
                    color="#DD8452")
    top = max(ys + [chosen_y])
    ax.set_ylim(0, top * 1.12 if top > 0 else 1.0)
    ax.set_xlabel("peak memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"{plan.function}: {plan.devices} devices ({plan.hardware}), "
                 f"batch {plan.global_batch}", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.grid(True, linewidth=0.4, alpha=0.5)
    ax.ticklabel_format(axis="both", style="sci", scilimits=(-3, 4))
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.16),
              ncol=1)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _time_unit(seconds: float) -> tuple[str, float]:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return unit, scale
    return "ns", 1e-9


def plot_timeline(plan: Plan, path: str) -> None:
    """The chosen plan's pipeline: its schedule over `plan.stages` ranks (one rank of GPipe
    when there is one stage) with the predicted per-stage forward/backward (and
    weight-gradient) times per microbatch, drawn by `pxform.schedules.plot`."""
    import pxform.schedules as schedules

    stages, m = plan.stages, plan.microbatches
    per_stage = list(plan.stage_plans)[:plan.num_stages]
    step = sum(s.forward_s + s.backward_s for s in per_stage) * m / plan.virtual_stages
    unit, scale = _time_unit(step)
    split = plan.schedule == "zb"
    costs = schedules.Costs(
        forward=[s.forward_s / scale for s in per_stage],
        backward=[(s.backward_s - (s.weight_s if split else 0.0)) / scale for s in per_stage],
        weight=[s.weight_s / scale for s in per_stage],
        recompute=[(s.recompute_s or s.forward_s) / scale for s in per_stage],
        p2p=[s.transfer_s / scale for s in per_stage],
        forward_sync=[s.forward_sync_s / scale for s in per_stage],
        backward_sync=[s.backward_sync_s / scale for s in per_stage])
    if stages > 1:
        schedule = schedules.resolve(plan.schedule, stages, m, **plan.schedule_options)
        name = schedule_text(plan.schedule, plan.virtual_stages)
    else:
        schedule, name = schedules.gpipe(1, m), "one stage"
    timeline = schedules.simulate(schedule, costs)
    schedules.plot(timeline, path, title=f"{plan.function}: {name}, {stages} stage(s) x "
                                         f"{m} microbatches, times in {unit}")


if __name__ == "__main__":
    entry()
