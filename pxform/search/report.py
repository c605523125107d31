"""Predicted vs measured: how far a plan's numbers can be trusted (`Plan.report`).

A plan predicts one step time for the whole world (1F1B's step ends on every rank at the
same time) and a peak memory per device for each pipeline stage. `compare(plan,
measured)` sets them beside `pxform.measure`'s figures, rank by rank. An error is signed
and relative to the measurement: `predicted / measured - 1`, so +20% means the plan
expected 20% more than it got.

Predictions from a datasheet preset describe that hardware, not the machine measured: to
check the cost model, plan with a profile measured on the same machine
(`pxform calibrate`); `benchmarks/accuracy.py` does this for a set of plans.

Example:
    >>> report = plan.report(pxform.measure(step, params, batch, optimizer=opt))
    >>> report.time_error, report.memory_error        # e.g. (0.07, -0.02)
    >>> print(report)
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from pxform.core.units import format_bytes, format_table

__all__ = ["Measured", "PlanReport", "RankMeasure", "RankReport"]


@dataclass(frozen=True)
class RankReport:
    """One rank: its stage, predicted and measured step time (s) and peak memory (bytes)."""

    rank: int
    stage: int
    predicted_time_s: float
    measured_time_s: float
    predicted_memory_bytes: float
    measured_memory_bytes: int

    @property
    def time_error(self) -> float:
        return _error(self.predicted_time_s, self.measured_time_s)

    @property
    def memory_error(self) -> float:
        return _error(self.predicted_memory_bytes, self.measured_memory_bytes)


@dataclass(frozen=True)
class PlanReport:
    """A plan's predictions against a measurement, per rank (`compare`)."""

    function: str
    config: str
    hardware: str
    ranks: tuple[RankReport, ...]
    predicted_time_s: float
    measured_time_s: float   # the slowest rank's median step

    @property
    def time_error(self) -> float:
        """Step time: the plan's prediction against the slowest rank's step."""
        return _error(self.predicted_time_s, self.measured_time_s)

    @property
    def memory_error(self) -> float:
        """Peak memory: the rank whose prediction is furthest off (signed)."""
        return max((r.memory_error for r in self.ranks), key=abs)

    def __str__(self) -> str:
        head = ("rank", "stage", "time predicted", "measured", "error",
                "peak memory predicted", "measured", "error")
        rows = [(str(r.rank), str(r.stage), _seconds(r.predicted_time_s),
                 _seconds(r.measured_time_s), _percent(r.time_error),
                 format_bytes(int(r.predicted_memory_bytes)),
                 format_bytes(r.measured_memory_bytes), _percent(r.memory_error))
                for r in self.ranks]
        lines = [f"{self.function}: predicted vs measured ({self.config}; predictions for "
                 f"hardware {self.hardware!r})"]
        lines += format_table([head, *rows], align="r" * len(head), indent="  ")
        lines.append(f"  step time: predicted {_seconds(self.predicted_time_s)}, measured "
                     f"{_seconds(self.measured_time_s)} (slowest rank): "
                     f"{_percent(self.time_error)}; peak memory: worst rank "
                     f"{_percent(self.memory_error)}")
        return "\n".join(lines)


@dataclass(frozen=True)
class RankMeasure:
    """One rank's figures (times in seconds, bytes).

    Attributes:
        rank: the global rank.
        step_times_s: the timed `value_and_grad` calls, in order.
        peak_memory_bytes: metered peak of a call (arguments included) + `state_bytes`.
        activation_bytes: of which saved for backward (`MemoryStats.saved_bytes`).
        state_bytes: the optimizer's state on this rank (0 without an optimizer).
        device: "cpu" or the CUDA device measured.
    """

    rank: int
    step_times_s: tuple[float, ...]
    peak_memory_bytes: int
    activation_bytes: int
    state_bytes: int
    device: str

    @property
    def step_time_s(self) -> float:
        """The median timed call."""
        return statistics.median(self.step_times_s)


@dataclass(frozen=True)
class Measured:
    """Every rank's measurement of one function's training step (`measure`)."""

    function: str
    ranks: tuple[RankMeasure, ...]  # by rank

    @property
    def step_time_s(self) -> float:
        """A step lasts as long as its slowest rank: the largest median."""
        return max(r.step_time_s for r in self.ranks)

    @property
    def peak_memory_bytes(self) -> int:
        """The largest peak over the ranks."""
        return max(r.peak_memory_bytes for r in self.ranks)


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0 if measured > 0 else float("inf")


def _percent(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
