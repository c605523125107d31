"""Is a hardware profile still this machine's? Time the program its op time scale was
fitted on, and compare.

A profile from `pxform calibrate` prices ops at the speed the machine had while it was
measured. Machines drift: on this project's 2-core CI machine the same step ran 10-20 %
slower or faster minutes later (`docs/benchmarks/accuracy.md`), and a profile measured
under one load and used under another under- or over-predicts every plan by as much. The
calibration fits `op_time_scale` and `op_step_overhead_s` so that the profile prices the
reference transformer (`runtime_costs.reference_program`) at what it measured, so timing
that program again, and pricing it with the profile (`runtime_costs.reference_price`),
tells how far the machine has moved since: seconds of work, not the minutes a calibration
takes. `refreshed_profile` then rescales the profile's op times to the machine as it is
now, keeping every other measured number.

From the shell (under torchrun with as many ranks as the profile was measured on, since
ranks sharing cores and memory run slower together):

    $ torchrun --nproc-per-node 2 -m pxform check-profile cpu.json --refresh cpu-now.json

With `fn` and `args` (`--model MODULE:FACTORY --batch B` from the shell) the program timed
and priced is the user's own function on one device's share of the batch instead of the
reference (TensorOpt's and Alpa's profiled costs): the refreshed profile prices that
model's ops at what they take here. The reference transformer fixes one op time scale for
every model, and the op mix it has is not every model's: on this project's Zen 5 CPU host
(2026-12-02) one profile priced the reference's plain step +3 %, GPT small's +12 % and a
wider GPT's (3 layers of width 192, 96 tokens) +15 to +18 %, at 4-16 sequences alike
(`docs/benchmarks/accuracy.md`, forty-first session); on the Intel host of 2026-12-01
GPT small's and the reference's agreed within a point. A plan's other costs (the
collectives, the runtime's fixed costs, the pipeline's transfers) stay as calibrated.

Example:
    >>> result = check_profile(hardware("cpu.json"))
    >>> print(result.explain())
    profile cpu-x2 on 2 ranks: the reference program (8 x 64 tokens) ...
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from pxform.cost.hardware import Hardware
from pxform.runtime import world
from pxform.tools.runtime_costs import program_price, reference_program, timed_call
from pxform.transforms.grad import value_and_grad

__all__ = ["DEFAULT_TOLERANCE", "CalibrationSpread", "ProfileCheck", "calibration_spread",
           "check_profile", "profile_ranks", "refreshed_profile"]

DEFAULT_TOLERANCE = 0.10
"""How far the profile may price the reference program from its measured time before
`ProfileCheck.stale`: the accuracy the cost model aims at (10 % of a step)."""


# untimed steps first: a new process's first steps ran slower here (its allocator's pools
# still growing), and 2 of them left one check of 9 steps 15 % slow (13.9-27.7 ms)
_WARMUP = 5


@dataclasses.dataclass(frozen=True)
class ProfileCheck:
    """The reference program timed now against a profile's price for it.

    Attributes:
        profile: the profile's name.
        ranks: ranks that ran the program at once.
        rows, tokens: the program's sequences and tokens per sequence.
        predicted_s: the profile's price for one step (the median of its calibrations'
            prices when it carries several, as plans are priced).
        measured_s: the slowest rank's median step time.
        step_times_s: that rank's timed steps.
        tolerance: the largest `abs(time_error)` that is not `stale`.
        program: what was timed when not the reference program (`check_profile`'s
            `fn`): its name and its arguments' tensor shapes; "" for the reference, whose
            `rows` and `tokens` then say its size (0 and 0 otherwise).

    Example:
        >>> check = ProfileCheck("cpu-x2", 2, 8, 64, 0.010, 0.012, (0.012,), 0.1)
        >>> round(check.time_error, 3), check.stale
        (-0.167, True)
    """

    profile: str
    ranks: int
    rows: int
    tokens: int
    predicted_s: float
    measured_s: float
    step_times_s: tuple[float, ...]
    tolerance: float = DEFAULT_TOLERANCE
    program: str = ""

    @property
    def program_text(self) -> str:
        """What was timed, in words: the reference program and its size, or `program`."""
        return self.program or f"the reference program ({self.rows} x {self.tokens} tokens)"

    @property
    def time_error(self) -> float:
        """predicted / measured - 1, as `PlanReport.time_error`: negative when the
        profile prices the machine faster than it now is."""
        return self.predicted_s / self.measured_s - 1

    @property
    def factor(self) -> float:
        """measured / predicted: what `refreshed_profile` multiplies the op times by."""
        return self.measured_s / self.predicted_s

    @property
    def stale(self) -> bool:
        """Does the profile price the reference more than `tolerance` off?"""
        return abs(self.time_error) > self.tolerance

    def explain(self) -> str:
        """A few lines: the two times, the error, and what to do about it.

        Example:
            >>> print(check.explain().splitlines()[-1])
            within 10 %: the profile still prices this machine's ops
        """
        low, high = min(self.step_times_s), max(self.step_times_s)
        lines = [f"profile {self.profile} on {self.ranks} rank{'s' * (self.ranks != 1)}: "
                 f"{self.program_text}, one value_and_grad step",
                 f"  predicted {self.predicted_s * 1e3:.2f} ms, measured "
                 f"{self.measured_s * 1e3:.2f} ms (median of {len(self.step_times_s)} "
                 f"steps, {low * 1e3:.2f}-{high * 1e3:.2f} ms): error "
                 f"{self.time_error:+.1%}"]
        bound = f"{self.tolerance:.0%}"
        if not self.stale:
            lines.append(f"within {bound}: the profile still prices this machine's ops"
                         + (" for this program" if self.program else ""))
        else:
            way = "slower" if self.time_error < 0 else "faster"
            if self.program:
                # (the reference may still be priced right: this model's op mix is not
                # the reference's, so rescaling is the fix, not calibrating again)
                lines.append(f"off by more than {bound}: this program's ops run {way} "
                             f"here than the profile prices them. Fix: plan this model "
                             f"with the profile's op times rescaled by "
                             f"{self.factor:.3f} (`pxform check-profile PROFILE --model "
                             f"MODULE:FACTORY --batch B --refresh NEW`, "
                             f"`refreshed_profile`)")
            else:
                lines.append(f"stale: off by more than {bound}; the machine is now {way} "
                             f"than the profile. Fix: calibrate again (`pxform calibrate "
                             f"--out PATH`), or rescale the profile's op times by "
                             f"{self.factor:.3f} (`pxform check-profile PROFILE --refresh "
                             f"NEW`, `refreshed_profile`)")
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class CalibrationSpread:
    """How far apart the calibrations a profile carries (`Hardware.calibrations`, what
    `pxform calibrate --runs N` keeps) price the reference program: the machine's own
    drift while it was measured, which no fit can take out.

    Each calibration fits its op time scale so that it prices the reference program at
    what it measured then (`runtime_costs`), so their prices are the program's measured
    times, minutes apart. On this project's 2-core CI machine they spread 8-50 % within
    each of 12 runs of `benchmarks/accuracy.py` (5 calibrations over 10 minutes each,
    2026-11-30), while the program's median over each run's 30 rounds was 12.9-14.9 ms:
    the machine moves between states some 40 % apart (about 10.5 and 14.5 ms) for
    seconds to minutes, and a calibration, which times the program for about a second,
    catches one of them. A plan priced with such a profile is no closer than the spread.

    Attributes:
        profile: the profile's name.
        rows, tokens: the reference program's sequences and tokens per sequence.
        prices_s: per calibration (in the profile's order), its price for one step.
        tolerance: the largest `spread` that is not `wide`.

    Example:
        >>> spread = CalibrationSpread("cpu-x2", 8, 64, (0.0110, 0.0143, 0.0117), 0.1)
        >>> round(spread.spread, 2), spread.wide
        (0.3, True)
    """

    profile: str
    rows: int
    tokens: int
    prices_s: tuple[float, ...]
    tolerance: float = DEFAULT_TOLERANCE

    @property
    def spread(self) -> float:
        """The largest price over the smallest, less 1 (0 for one calibration)."""
        return max(self.prices_s) / min(self.prices_s) - 1 if self.prices_s else 0.0

    @property
    def wide(self) -> bool:
        """Do the calibrations price the reference more than `tolerance` apart?"""
        return self.spread > self.tolerance

    def explain(self) -> str:
        """One line: the prices, their spread, and (when `wide`) what to do about it.

        Example:
            >>> print(spread.explain())
            warning: profile cpu-x2's 3 calibrations priced the reference program ...
        """
        n = len(self.prices_s)
        prices = ", ".join(f"{p * 1e3:.2f}" for p in self.prices_s)
        text = (f"profile {self.profile}'s {n} calibration{'s' * (n != 1)} priced the "
                f"reference program ({self.rows} x {self.tokens} tokens, one "
                f"value_and_grad step) at {prices} ms: {self.spread:.0%} apart")
        if not self.wide:
            return f"{text}, within {self.tolerance:.0%}"
        return (f"warning: {text}, more than {self.tolerance:.0%}. The machine's speed "
                f"moved while it was measured, and plans priced with this profile are no "
                f"closer to their measured steps than that. Fix: calibrate while nothing "
                f"else runs on the machine, with more --runs, and run `pxform "
                f"check-profile PROFILE` (with --refresh NEW) right before timing a plan")


def calibration_spread(hw: Hardware, *, rows: int = 8,
                       tolerance: float = DEFAULT_TOLERANCE) -> CalibrationSpread:
    """Each of `hw`'s calibrations' price for one step of the reference program at `rows`
    sequences (`CalibrationSpread`; `hw` alone when it carries none). Prices only, runs
    nothing: call it anywhere (`pxform calibrate --runs N` prints it).

    Raises:
        ValueError: `rows` below 1 or `tolerance` not positive.

    Example:
        >>> calibration_spread(hardware("cpu.json")).wide
        False
    """
    what = f"calibration_spread({hw.name!r})"
    if rows < 1:
        raise ValueError(f"{what}: rows={rows}; give at least 1 sequence")
    if not tolerance > 0:
        raise ValueError(f"{what}: tolerance={tolerance!r}; give a fraction > 0, e.g. 0.1")
    loss, params, tokens = reference_program(rows)
    return CalibrationSpread(hw.name, rows, int(tokens.shape[1]),
                             _calibration_prices(hw, loss, params, tokens), tolerance)


def _calibration_prices(hw: Hardware, fn: Callable[..., Any], *args: Any
                        ) -> tuple[float, ...]:
    """Per calibration `hw` carries (`hw` alone without any), its price for one plain
    step of `fn` on `args` (`program_price`; the reference program's is its
    `reference_price`): what plans are priced with, one by one."""
    members: Sequence[Hardware] = hw.calibrations or (hw,)
    return tuple(program_price(c, fn, *args) for c in members)


def profile_ranks(hw: Hardware) -> int:
    """How many ranks measured `hw`: its largest collective group (1 without any).

    Example:
        >>> profile_ranks(hardware("a100-80gb"))
        1
    """
    return max((t.group_size for t in hw.comm_tables), default=1)


def check_profile(hw: Hardware, *, repeats: int = 30, rows: int = 8,
                  tolerance: float = DEFAULT_TOLERANCE,
                  fn: Callable[..., Any] | None = None,
                  args: Sequence[Any] = ()) -> ProfileCheck:
    """Time `repeats` steps of the reference program (`rows` sequences) on every rank at
    once, after `_WARMUP` untimed ones, each after a barrier, and compare the slowest rank's
    median with `hw`'s price for it. Call it on every rank of the world `hw` was
    measured on; every rank returns the same result.

    With `fn`, the program is `pxform.value_and_grad(fn)(*args)` instead (a plain
    function returning a scalar loss, as `pxform.auto` takes; `args` one device's share
    of the batch, the same on every rank, e.g. the global batch over the data-parallel
    degree, or a few of the model's layers when the whole does not fit one device),
    priced on one device as `runtime_costs.reference_price` prices the reference: what
    `refreshed_profile` then rescales to is this model's ops on this machine (module
    doc).

    Raises:
        ValueError: `repeats` or `rows` below 1, `tolerance` not positive, `fn` not
            callable or without `args`, or a world of another size than `hw` was
            measured on (raised on every rank alike, before any collective).

    Example:
        >>> check_profile(hardware("cpu.json")).stale
        False
        >>> check_profile(hw, fn=gpt.loss_fn, args=(params, batch)).factor  # one rank's
        0.87
    """
    what = f"check_profile({hw.name!r})"
    if repeats < 1 or rows < 1:
        raise ValueError(f"{what}: repeats={repeats}, rows={rows}; both must be at least 1")
    if not tolerance > 0:
        raise ValueError(f"{what}: tolerance={tolerance!r}; give a fraction > 0, e.g. 0.1")
    if fn is not None and not (callable(fn) and len(args) > 0):
        raise ValueError(f"{what}: fn={getattr(fn, '__name__', fn)!r} with {len(args)} "
                         f"argument(s); give a callable loss function and the arguments "
                         f"of one device's step, e.g. fn=loss_fn, args=(params, batch)")
    if hw.op_time_scale == 1.0 and hw.op_step_overhead_s == 0.0:
        raise ValueError(f"{what}: the profile has no fitted op time scale (a preset or a "
                         f"profile written without pxform's runtime costs); nothing here "
                         f"was measured on a machine to compare with. Fix: measure one with "
                         f"`pxform calibrate --out PATH`")
    ranks = profile_ranks(hw)
    if world.size() != ranks:
        raise ValueError(f"{what}: the profile was measured on {ranks} rank"
                         f"{'s' * (ranks != 1)} (its largest collective group), this world "
                         f"has {world.size()}; ranks that share cores and memory run each "
                         f"op slower together. Fix: run under `torchrun --nproc-per-node "
                         f"{ranks} -m pxform check-profile PROFILE`")
    if fn is None:
        loss, params, tokens = reference_program(rows)
        fn, args, tokens_per_row, program = loss, (params, tokens), int(tokens.shape[1]), ""
    else:
        args = tuple(args)
        rows = tokens_per_row = 0
        program = _program_text(fn, args)
    # priced before timing: a function the cost model cannot trace fails here, on every
    # rank alike, before any collective
    prices = _calibration_prices(hw, fn, *args)
    step = value_and_grad(fn)
    for _ in range(_WARMUP):
        step(*args)
    mine = [timed_call(lambda: step(*args)) for _ in range(repeats)]
    every = world.gather_objects(mine)
    slowest = max(every, key=statistics.median)
    return ProfileCheck(hw.name, ranks, rows, tokens_per_row, statistics.median(prices),
                        statistics.median(slowest), tuple(slowest), tolerance, program)


def _program_text(fn: Callable[..., Any], args: tuple[Any, ...]) -> str:
    """`name(...)` with each argument's tensors: their shapes, or for a pytree of more
    than 3 (the parameters) their count and size, for the check's text."""
    parts = []
    for arg in args:
        shapes = [list(t.shape) for t in optree.tree_leaves(arg, none_is_leaf=False)
                  if isinstance(t, torch.Tensor)]
        if len(shapes) > 3:
            values = sum(math.prod(s) for s in shapes)
            parts.append(f"{len(shapes)} tensors of {values:,} values")
        elif shapes:
            parts.append(", ".join(str(s) for s in shapes))
    return f"{getattr(fn, '__name__', type(fn).__name__)}({'; '.join(parts)})"


def refreshed_profile(hw: Hardware, check: ProfileCheck) -> Hardware:
    """`hw` with its op times (`op_time_scale` and `op_step_overhead_s`, in it and in
    each of its calibrations) multiplied by `check.factor`, so that it prices the
    reference program at what `check` measured; every other number (collectives, the
    runtime's fixed costs, memory) as measured. The source says when and by how much.

    Example:
        >>> now = refreshed_profile(hw, check_profile(hw))
        >>> now.op_time_scale / hw.op_time_scale == check.factor
        True
    """
    if check.profile != hw.name:
        raise ValueError(f"refreshed_profile: the check is of profile {check.profile!r}, "
                         f"not {hw.name!r}; check this profile first (check_profile(hw))")
    today = datetime.date.today().isoformat()

    def scaled(p: Hardware, note: bool) -> Hardware:
        source = (f"{p.source}; op times x{check.factor:.3f} by pxform check-profile on "
                  f"{today} (the reference program measured {check.measured_s * 1e3:.2f} "
                  f"ms, priced {check.predicted_s * 1e3:.2f} ms)") if note else p.source
        return dataclasses.replace(p, op_time_scale=p.op_time_scale * check.factor,
                                   op_step_overhead_s=p.op_step_overhead_s * check.factor,
                                   source=source)

    members = tuple(scaled(c, False) for c in hw.calibrations)
    return dataclasses.replace(scaled(hw, True), calibrations=members)
