"""`Plan`: what the search chose, as a frozen value that prints, diffs, and saves as JSON.

A plan holds every choice the lowering needs and nothing it can recompute: the pipeline
degree, the stage mesh (`outer` x `inner`, see `pxform.search.space`), microbatches and
schedule; per block its stage, axis roles and recompute flag; per block kind that uses the
tensor role, each op's choice on the tensor axis; the resulting storage spec of every
parameter. Predictions (step time, memory per stage, the time/memory frontier) come with
it so that `explain()` can show them and a later run can be checked against them.

JSON only, never pickle: `save(path)` / `Plan.load(path)` round-trip exactly, and a loaded
plan passed back to `pxform.auto(..., plan=...)` pins every choice (`pin` with some fields
set to None pins only those).

Example:
    >>> plan = step.plan(params, batch)
    >>> print(plan.explain())
    >>> plan.save("plan.json"); pxform.Plan.load("plan.json").diff(plan)
    ''
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from pxform.errors import PxformError
from pxform.mesh import AbstractMesh
from pxform.units import format_bytes

FORMAT = "pxform-plan/1"


def strategy_text(roles: tuple[tuple[str, str], ...], recompute: bool) -> str:
    """A block's strategy as plans print it: "outer=dp inner=tp +recompute"."""
    text = " ".join(f"{a}={r}" for a, r in roles) or "single device"
    return text + (" +recompute" if recompute else "")


@dataclass(frozen=True)
class BlockPlan:
    """One block: where it runs and how. `time_s` is its share of a stage's step (all
    microbatches), `memory_bytes` its share of the stage's peak per device."""

    index: int
    label: str
    kind: int
    stage: int
    roles: tuple[tuple[str, str], ...]
    recompute: bool
    time_s: float
    memory_bytes: float

    @property
    def strategy(self) -> str:
        return strategy_text(self.roles, self.recompute)


@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its blocks, per-microbatch times, peak memory per device."""

    stage: int
    blocks: tuple[int, ...]
    forward_s: float
    backward_s: float
    memory_bytes: float
    in_flight: int
    param_bytes: float


@dataclass(frozen=True)
class FrontierPoint:
    """A plan the search found: predicted step time and peak memory per device."""

    time_s: float
    memory_bytes: float
    config: str
    strategies: str

    def __str__(self) -> str:
        return (f"{self.time_s:.4g} s  {format_bytes(int(self.memory_bytes))}  "
                f"{self.config}  {self.strategies}")


@dataclass(frozen=True)
class Plan:
    """A searched (or pinned) parallel plan for one function and argument shapes."""

    function: str
    devices: int
    hardware: str
    memory_budget: int
    objective: str
    global_batch: int
    stages: int
    outer: int
    inner: int
    microbatches: int
    schedule: str
    blocks: tuple[BlockPlan, ...]
    stage_plans: tuple[StagePlan, ...]
    step_time_s: float
    peak_memory_bytes: float
    tensor_choices: tuple[tuple[int, tuple[tuple[Any, ...], ...]], ...]
    param_specs: tuple[tuple[str, str], ...]
    frontier_points: tuple[FrontierPoint, ...] = ()
    search_seconds: float = 0.0
    fingerprint: str = ""
    notes: tuple[str, ...] = field(default=())
    # batch inputs as the first block reading each wants them (its data axes): where
    # `auto` lays the batch out, so no block meets a batch the search did not cost
    batch_specs: tuple[tuple[str, str], ...] = ()

    # ---------------------------------------------------------------- views

    @property
    def mesh(self) -> AbstractMesh:
        """The mesh the plan runs on: `pp`, `outer`, `inner` (axes of size 1 left out)."""
        axes = [(n, s) for n, s in (("pp", self.stages), ("outer", self.outer),
                                    ("inner", self.inner)) if s > 1]
        return AbstractMesh(tuple(axes) or (("outer", 1),))

    def frontier(self) -> list[FrontierPoint]:
        """The (step time, peak memory) Pareto frontier of every plan the search
        evaluated, by memory: the least memory first, the fastest last."""
        return list(self.frontier_points)

    def config_text(self) -> str:
        return (f"pp={self.stages} outer={self.outer} inner={self.inner} "
                f"microbatches={self.microbatches} schedule={self.schedule}")

    def explain(self, per_block: bool = False) -> str:
        """A readable report: set-up, the mesh, per-block strategies (consecutive blocks
        with the same kind, stage and strategy share a row unless `per_block`), stages,
        parameter layouts of the tensor-parallel blocks, predictions."""
        lines = [
            f"plan for {self.function}: {self.devices} devices ({self.hardware}), "
            f"budget {format_bytes(self.memory_budget)} per device, objective "
            f"{self.objective!r}, global batch {self.global_batch}",
            f"mesh {self.mesh}: {self.config_text()}",
            f"predicted step {self.step_time_s:.4g} s, peak memory "
            f"{format_bytes(int(self.peak_memory_bytes))} per device "
            f"(searched in {self.search_seconds:.2f} s)",
            "",
        ]
        rows: list[tuple[str, ...]] = [("blocks", "stage", "strategy", "time/step", "memory")]
        for group in _groups(self.blocks, per_block):
            first, last = group[0], group[-1]
            name = first.label if len(group) == 1 else \
                f"{first.label} .. {last.label} ({len(group)})"
            rows.append((name, str(first.stage), first.strategy,
                         f"{sum(b.time_s for b in group):.4g} s",
                         format_bytes(int(sum(b.memory_bytes for b in group)))))
        lines += _table(rows)
        if self.stages > 1 or len(self.stage_plans) > 1:
            lines.append("")
            rows = [("stage", "blocks", "F/microbatch", "B/microbatch", "in flight",
                     "params+grads+optimizer", "peak memory")]
            for st in self.stage_plans:
                span = f"{st.blocks[0]}-{st.blocks[-1]}" if st.blocks else "-"
                rows.append((str(st.stage), span, f"{st.forward_s:.4g} s",
                             f"{st.backward_s:.4g} s", str(st.in_flight),
                             format_bytes(int(st.param_bytes)),
                             format_bytes(int(st.memory_bytes))))
            lines += _table(rows)
        split = [(n, s) for n, s in self.param_specs if "inner" in s or "outer" in s]
        if split:
            lines.append("")
            lines.append(f"parameters stored split ({len(split)} of {len(self.param_specs)}; "
                         f"the rest replicated):")
            shown = split if per_block else split[:12]
            for n, s in shown:
                lines.append(f"  {n}: {s}")
            if len(shown) < len(split):
                lines.append(f"  ... {len(split) - len(shown)} more (explain(per_block=True))")
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()

    def report(self, measured: Any) -> Any:
        """This plan's predicted step time and peak memory per rank beside a measurement
        (`pxform.measure`): a `pxform.report.PlanReport`; `print` it.

        Example:
            >>> print(plan.report(pxform.measure(step, params, batch, optimizer=opt)))
        """
        from pxform.report import compare

        return compare(self, measured)

    def diff(self, other: Plan) -> str:
        """What differs from `other`, one line per difference; "" when the plans make the
        same choices and predictions."""
        out = []
        for name in ("function", "devices", "hardware", "memory_budget", "objective",
                     "global_batch", "stages", "outer", "inner", "microbatches", "schedule",
                     "step_time_s", "peak_memory_bytes", "fingerprint"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: {a!r} -> {b!r}")
        if len(self.blocks) != len(other.blocks):
            out.append(f"blocks: {len(self.blocks)} -> {len(other.blocks)}")
        for x, y in zip(self.blocks, other.blocks):
            if (x.stage, x.roles, x.recompute) != (y.stage, y.roles, y.recompute):
                out.append(f"block {x.label}: stage {x.stage} {x.strategy} -> stage "
                           f"{y.stage} {y.strategy}")
        mine, theirs = dict(self.param_specs), dict(other.param_specs)
        for n in sorted(set(mine) | set(theirs)):
            if mine.get(n) != theirs.get(n):
                out.append(f"param {n}: {mine.get(n)} -> {theirs.get(n)}")
        if self.tensor_choices != other.tensor_choices:
            out.append("tensor-axis op choices differ")
        return "\n".join(out)

    # ---------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d = {"format": FORMAT, **d}
        return json.loads(json.dumps(d))  # tuples -> lists, the form load reads

    @staticmethod
    def from_json(d: dict[str, Any], where: str = "plan") -> Plan:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise PxformError(f"pxform.Plan.load: {where} is not a pxform plan (expected "
                              f"\"format\": \"{FORMAT}\").\n  Fix: pass a file written by "
                              f"Plan.save or `pxform plan --out`.")
        names = {f.name for f in fields(Plan)}
        missing = sorted(n for n in names if n not in d and n not in
                         ("frontier_points", "search_seconds", "fingerprint", "notes",
                          "batch_specs"))
        if missing:
            raise PxformError(f"pxform.Plan.load: {where} lacks {missing}.\n  Fix: write the "
                              f"plan again with Plan.save.")
        unknown = sorted(k for k in d if k not in names and k != "format")
        if unknown:
            raise PxformError(f"pxform.Plan.load: {where} has unknown keys {unknown}.")
        try:
            return Plan(
                **{k: d[k] for k in names if k in d and k not in
                   ("blocks", "stage_plans", "tensor_choices", "param_specs",
                    "frontier_points", "notes", "batch_specs")},
                blocks=tuple(BlockPlan(**{**b, "roles": tuple(tuple(r) for r in b["roles"])})
                             for b in d["blocks"]),
                stage_plans=tuple(StagePlan(**{**s, "blocks": tuple(s["blocks"])})
                                  for s in d["stage_plans"]),
                tensor_choices=tuple((int(k), tuple(_choice(c) for c in cs))
                                     for k, cs in d["tensor_choices"]),
                param_specs=tuple((n, s) for n, s in d["param_specs"]),
                frontier_points=tuple(FrontierPoint(**p) for p in d.get("frontier_points", ())),
                notes=tuple(d.get("notes", ())),
                batch_specs=tuple((n, s) for n, s in d.get("batch_specs", ())))
        except (TypeError, KeyError, ValueError) as exc:
            raise PxformError(f"pxform.Plan.load: {where} is malformed: {exc}.\n  Fix: write "
                              f"the plan again with Plan.save.") from None

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the plan as JSON (indent 1, keys in field order)."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @staticmethod
    def load(path: str | os.PathLike[str]) -> Plan:
        """Read a plan written by `save`.

        Raises:
            PxformError: the file is not JSON or not a pxform plan (names the file).
        """
        try:
            with open(path) as f:
                d = json.load(f)
        except json.JSONDecodeError as exc:
            raise PxformError(f"pxform.Plan.load: {os.fspath(path)} is not JSON ({exc}).") from None
        return Plan.from_json(d, os.fspath(path))


def _choice(c: Any) -> tuple[Any, ...]:
    """A tensor-axis choice from JSON: ("replicate",), ("split", label) or
    ("partial", (group...))."""
    if c[0] == "partial":
        return ("partial", tuple(c[1]))
    return tuple(c)


def _groups(blocks: tuple[BlockPlan, ...], per_block: bool) -> list[list[BlockPlan]]:
    out: list[list[BlockPlan]] = []
    for b in blocks:
        if out and not per_block:
            last = out[-1][-1]
            if (last.kind, last.stage, last.roles, last.recompute) == \
                    (b.kind, b.stage, b.roles, b.recompute):
                out[-1].append(b)
                continue
        out.append([b])
    return out


def _table(rows: Sequence[tuple[str, ...]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
