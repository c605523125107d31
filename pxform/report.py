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

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pxform.errors import PxformError
from pxform.units import format_bytes

if TYPE_CHECKING:
    from pxform.measure import Measured
    from pxform.plan import Plan

__all__ = ["PlanReport", "RankReport", "compare"]


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
        widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
        lines = [f"{self.function}: predicted vs measured ({self.config}; predictions for "
                 f"hardware {self.hardware!r})"]
        lines += ["  " + "  ".join(c.rjust(w) for c, w in zip(row, widths))
                  for row in [head, *rows]]
        lines.append(f"  step time: predicted {_seconds(self.predicted_time_s)}, measured "
                     f"{_seconds(self.measured_time_s)} (slowest rank): "
                     f"{_percent(self.time_error)}; peak memory: worst rank "
                     f"{_percent(self.memory_error)}")
        return "\n".join(lines)


def compare(plan: Plan, measured: Measured) -> PlanReport:
    """Set `measured` (one entry per rank of the plan's world) beside `plan`.

    Example:
        >>> print(compare(plan, measured))
    """
    if len(measured.ranks) != plan.devices:
        raise PxformError(
            f"pxform: plan.report: the plan of {plan.function} is for {plan.devices} "
            f"devices but the measurement has {len(measured.ranks)} rank(s).\n  Fix: measure "
            f"with pxform.measure(...) on the world the plan runs on (torchrun "
            f"--nproc-per-node {plan.devices}).")
    per_stage = plan.devices // plan.stages
    memory = {s.stage: s.memory_bytes for s in plan.stage_plans}
    rows = []
    for r in measured.ranks:
        # the plan's mesh is (pp, outer, inner), row-major: a stage is a run of ranks
        stage = r.rank // per_stage
        rows.append(RankReport(r.rank, stage, plan.step_time_s, r.step_time_s,
                               memory.get(stage, plan.peak_memory_bytes),
                               r.peak_memory_bytes))
    return PlanReport(plan.function, plan.config_text(), plan.hardware, tuple(rows),
                      plan.step_time_s, measured.step_time_s)


def _error(predicted: float, measured: float) -> float:
    return predicted / measured - 1.0 if measured > 0 else float("inf")


def _percent(x: float) -> str:
    return f"{x * 100:+.1f}%"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.3g} ms" if s < 1 else f"{s:.3g} s"
