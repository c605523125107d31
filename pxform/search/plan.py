"""`Plan`: what the search chose, as a frozen value that prints, diffs, and saves as JSON.

A plan is complete: lowering it needs only the traced graph and the plan (no cost model,
no search, no re-analysis; `pxform.lower.plan`). It holds the pipeline degree, the stage
mesh (`outer` x `inner`, see `pxform.search.space`), microbatches and schedule; per block
its ops (a range of the graph's ops), stage, axis roles, recompute flag, whether ZeRO-3
reshards after forward, and every op's strategy (`BlockPlan.ops`); the storage spec of
every parameter and the layout of every batch input, as `P` values; and a fingerprint of
the graph it was made for. Per block kind
that uses the tensor role, each op's tensor-axis choice is also kept, so that a plan pins a
new search (`pxform.search.pin_of`). Predictions (step time, memory per stage, the
time/memory frontier) come with it so that `explain()` can show them and a later run can
be checked against them.

JSON only, never pickle: `save(path)` / `Plan.load(path)` round-trip exactly. The file
names its format (`"format": "pxform-plan/2"`); a file of another format is refused with
both versions named. A loaded plan passed to `pxform.auto(..., plan=...)` runs as it is.

Example:
    >>> plan = step.plan(params, batch)
    >>> print(plan.explain())
    >>> plan.save("plan.json"); pxform.Plan.load("plan.json").diff(plan)
    ''
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from pxform.core.errors import PxformError
from pxform.core.mesh import AbstractMesh
from pxform.core.precision import Precision
from pxform.core.spec import P
from pxform.core.units import format_bytes, format_table
from pxform.search.report import Measured, PlanReport, RankReport

FORMAT_VERSION = 2
FORMAT = f"pxform-plan/{FORMAT_VERSION}"


TENSOR_ROLES = ("tp", "sp")
"""Axis roles that split ops over the axis (`BlockPlan.roles`); `sp` adds sequence
parallelism between blocks (`pxform.search.space`)."""


def schedule_text(name: str, virtual_stages: int) -> str:
    """A pipeline schedule as plans print it: "zb", "interleaved(virtual_stages=2)"."""
    return f"{name}(virtual_stages={virtual_stages})" if virtual_stages > 1 else name


def strategy_text(roles: tuple[tuple[str, str], ...], recompute: bool,
                  reshard: bool = True) -> str:
    """A block's strategy as plans print it: "outer=dp inner=tp +recompute", or
    "outer=sdp +keep-gathered" where ZeRO-3 keeps the gathered parameters for backward."""
    text = " ".join(f"{a}={r}" for a, r in roles) or "single device"
    return text + (" +recompute" if recompute else "") + ("" if reshard else " +keep-gathered")


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
    # the block's ops: graph.ops[start:stop] of the graph the plan was made for (stage
    # markers removed); per op, its strategy as "<data>/<tensor>" choices (`choice_text`):
    # every data axis (dp, sdp, and a pipeline's microbatch axis) makes the data choice,
    # the tensor axis the tensor choice ("-": the block has no tensor axis)
    start: int = 0
    stop: int = 0
    ops: tuple[str, ...] = ()
    # ZeRO-3 (an sdp axis): whether the parameters the block gathers are freed after its
    # forward and gathered again for backward (the runtime's `reshard_after_forward`)
    reshard: bool = True

    @property
    def strategy(self) -> str:
        return strategy_text(self.roles, self.recompute, self.reshard)


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
    # of `backward_s`, the weight gradients: a zero-bubble schedule's W action
    weight_s: float = 0.0
    # an early recompute of a microbatch (the shifted schedule's R): the forward's compute
    # without its transfer and the waits for it
    recompute_s: float = 0.0
    # what an F (a B) waits more where its input arrives just as its rank is ready for it
    # (`Hardware.sync_wait`; `pxform.schedules.expected_later`), apart from `forward_s`
    forward_sync_s: float = 0.0
    backward_sync_s: float = 0.0
    # what a transfer from this stage to another rank adds where the action that needs
    # it waits for it (`Hardware.transfer_overhead_s`; `pxform.schedules.Costs.p2p`)
    transfer_s: float = 0.0
    # per step, the stage's own costs outside its actions (per parameter, its gradients'
    # reductions; `Hardware.param_overhead_s`): a pipeline stage's rank runs them after its
    # last action, outside the schedule (one stage: they are in `backward_s`)
    step_extra_s: float = 0.0


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
    # where every parameter is stored, by graph input name
    parameter_specs: tuple[tuple[str, P], ...]
    frontier_points: tuple[FrontierPoint, ...] = ()
    search_seconds: float = 0.0
    # `Graph.fingerprint()` of the graph the plan was made for (markers removed)
    fingerprint: str = ""
    notes: tuple[str, ...] = field(default=())
    # batch inputs as the first block reading each wants them (its data axes): where
    # `auto` lays the batch out, so no block meets a batch the search did not cost
    batch_input_specs: tuple[tuple[str, P], ...] = ()
    # the mixed-precision policy the plan was made under (`Precision.to_json`), as
    # (field, value) pairs; () for none. `pxform.auto(fn, plan=...)` runs under it.
    precision: tuple[tuple[str, Any], ...] = ()
    # model chunks per pipeline rank (interleaved schedules): the plan has `stages x
    # virtual_stages` stages, stage s on pipeline rank s % stages
    virtual_stages: int = 1
    # the chosen configuration's best step time under each schedule the search priced
    # (inf: no plan fits; None: its bound could not beat the best, not assembled)
    schedule_times: tuple[tuple[str, float | None], ...] = ()
    # the plan's step priced under each calibration of its profile
    # (`Hardware.calibrations`; `step_time_s` is their median); () for a profile of one
    calibration_step_times_s: tuple[float, ...] = ()

    format_version: ClassVar[int] = FORMAT_VERSION

    # ---------------------------------------------------------------- views

    @property
    def param_specs(self) -> tuple[tuple[str, str], ...]:
        """`parameter_specs` as text, e.g. `("blocks.0.fc_w", "P('inner')")`."""
        return tuple((n, repr(p)) for n, p in self.parameter_specs)

    @property
    def batch_specs(self) -> tuple[tuple[str, str], ...]:
        """`batch_input_specs` as text."""
        return tuple((n, repr(p)) for n, p in self.batch_input_specs)

    @property
    def mesh(self) -> AbstractMesh:
        """The mesh the plan runs on: `pp`, `outer`, `inner` (axes of size 1 left out)."""
        axes = [(n, s) for n, s in (("pp", self.stages), ("outer", self.outer),
                                    ("inner", self.inner)) if s > 1]
        return AbstractMesh(tuple(axes) or (("outer", 1),))

    @property
    def policy(self) -> Precision | None:
        """The mixed-precision policy the plan was made under (None: none)."""
        return Precision.from_json(dict(self.precision)) if self.precision else None

    def frontier(self) -> list[FrontierPoint]:
        """The (step time, peak memory) Pareto frontier of every plan the search
        evaluated, by memory: the least memory first, the fastest last."""
        return list(self.frontier_points)

    @property
    def schedule_options(self) -> dict[str, Any]:
        """What `pxform.pipeline` takes besides the schedule's name."""
        return {"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}

    @property
    def num_stages(self) -> int:
        """Pipeline stages, virtual ones counted (`stages x virtual_stages`)."""
        return self.stages * self.virtual_stages

    def config_text(self) -> str:
        return (f"pp={self.stages} outer={self.outer} inner={self.inner} "
                f"microbatches={self.microbatches} "
                f"schedule={schedule_text(self.schedule, self.virtual_stages)}")

    @property
    def headroom_bytes(self) -> float:
        """What the predicted peak leaves of the budget per device. The memory model is
        within about 5 % of the meter on the plans `benchmarks/accuracy.py` measures (10 %
        for tensor parallelism): a plan with less headroom than that may not fit; the
        search keeps `auto`'s `memory_margin` (5 % by default) free.

        Example:
            >>> plan.headroom_bytes / plan.memory_budget
            0.31
        """
        return self.memory_budget - self.peak_memory_bytes

    def explain(self, per_block: bool = False) -> str:
        """A readable report: set-up, the mesh, per-block strategies (consecutive blocks
        with the same kind, stage and strategy share a row unless `per_block`), stages,
        parameter layouts of the tensor-parallel blocks, predictions."""
        lines = [
            f"plan for {self.function}: {self.devices} devices ({self.hardware}), "
            f"budget {format_bytes(self.memory_budget)} per device, objective "
            f"{self.objective!r}, global batch {self.global_batch}",
            f"mesh {self.mesh}: {self.config_text()}",
            *([f"precision: {self.policy}"] if self.precision else []),
            f"predicted step {self.step_time_s:.4g} s{self._spread_text()}, peak memory "
            f"{format_bytes(int(self.peak_memory_bytes))} per device, headroom "
            f"{format_bytes(max(0, int(self.headroom_bytes)))} "
            f"({self.headroom_bytes / self.memory_budget:.0%} of the budget) "
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
        lines += format_table(rows)
        if self.stages > 1 or len(self.stage_plans) > 1:
            lines.append("")
            rows = [("stage", "blocks", "F/microbatch", "B/microbatch", "after its actions",
                     "in flight", "params+grads+optimizer", "peak memory")]
            for st in self.stage_plans:
                span = f"{st.blocks[0]}-{st.blocks[-1]}" if st.blocks else "-"
                rows.append((str(st.stage), span, f"{st.forward_s:.4g} s",
                             f"{st.backward_s:.4g} s", f"{st.step_extra_s:.4g} s",
                             str(st.in_flight),
                             format_bytes(int(st.param_bytes)),
                             format_bytes(int(st.memory_bytes))))
            lines += format_table(rows)
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
        if self.frontier_points:
            # why it won: the time-memory frontier the search found, fastest first
            text = self.config_text()
            same = [p for p in self.frontier_points if text.startswith(p.config)]
            chosen = min(same, key=lambda p: abs(p.time_s - self.step_time_s), default=None)
            fastest = sorted(self.frontier_points, key=lambda p: p.time_s)
            why = "fastest" if self.objective == "time" else "best"
            if self.objective == "time" and chosen is not None and \
                    fastest[0].time_s < chosen.time_s:
                why = "simplest near-tie of the fastest (its note says which)"
            lines.append("")
            lines.append(f"why this plan: the {why} within the budget of the time-memory "
                         f"frontier the search found:")
            rows = [("", "configuration", "strategies", "step", "peak memory")]
            listed = fastest[:8]
            if chosen is not None and all(p is not chosen for p in listed):
                listed.append(chosen)
            for pt in listed:
                mark = "*" if pt is chosen else ""
                rows.append((mark, pt.config, pt.strategies, f"{pt.time_s:.4g} s",
                             format_bytes(int(pt.memory_bytes))))
            lines += format_table(rows)
        if self.schedule_times:
            priced: list[str] = []
            for name, t in self.schedule_times:
                text = ("not assembled (its bound could not beat the best)" if t is None
                        else "no plan fits" if t == float("inf") else f"{t:.4g} s")
                mark = " (chosen)" if self.config_text().endswith(f"schedule={name}") else ""
                priced.append(f"{name} {text}{mark}")
            lines.append("")
            lines.append("schedules priced for this configuration (simulated step): "
                         + "; ".join(priced))
        for note in self.notes:
            lines.append(f"note: {note}")
        return "\n".join(lines)

    def _spread_text(self) -> str:
        times = self.calibration_step_times_s
        if not times:
            return ""
        return (f" (the median of {len(times)} calibrations' prices, "
                f"{min(times):.4g}-{max(times):.4g} s)")

    def __str__(self) -> str:
        return self.explain()

    def report(self, measured: Measured) -> PlanReport:
        """This plan's predicted step time and peak memory per rank beside a measurement
        (`pxform.measure`, one entry per rank of the plan's world): a `PlanReport`;
        `print` it.

        Example:
            >>> print(plan.report(pxform.measure(step, params, batch, optimizer=opt)))
        """
        if len(measured.ranks) != self.devices:
            raise PxformError(
                f"pxform: plan.report: the plan of {self.function} is for {self.devices} "
                f"devices but the measurement has {len(measured.ranks)} rank(s).\n  Fix: "
                f"measure with pxform.measure(...) on the world the plan runs on (torchrun "
                f"--nproc-per-node {self.devices}).")
        per_stage = self.devices // self.stages
        memory = {s.stage: s.memory_bytes for s in self.stage_plans}
        rows = []
        for r in measured.ranks:
            # the plan's mesh is (pp, outer, inner), row-major: a stage is a run of ranks
            stage = r.rank // per_stage
            rows.append(RankReport(r.rank, stage, self.step_time_s, r.step_time_s,
                                   memory.get(stage, self.peak_memory_bytes),
                                   r.peak_memory_bytes))
        return PlanReport(self.function, self.config_text(), self.hardware, tuple(rows),
                          self.step_time_s, measured.step_time_s)

    def diff(self, other: Plan) -> str:
        """What differs from `other`, one line per difference; "" when the plans make the
        same choices and predictions."""
        out = []
        for name in ("function", "devices", "hardware", "memory_budget", "objective",
                     "global_batch", "stages", "outer", "inner", "microbatches", "schedule",
                     "virtual_stages",
                     "step_time_s", "peak_memory_bytes", "fingerprint"):
            a, b = getattr(self, name), getattr(other, name)
            if a != b:
                out.append(f"{name}: {a!r} -> {b!r}")
        if len(self.blocks) != len(other.blocks):
            out.append(f"blocks: {len(self.blocks)} -> {len(other.blocks)}")
        for x, y in zip(self.blocks, other.blocks):
            if (x.stage, x.roles, x.recompute, x.reshard) != \
                    (y.stage, y.roles, y.recompute, y.reshard):
                out.append(f"block {x.label}: stage {x.stage} {x.strategy} -> stage "
                           f"{y.stage} {y.strategy}")
        if self.policy != other.policy:
            out.append(f"precision: {self.policy} -> {other.policy}")
        mine, theirs = dict(self.param_specs), dict(other.param_specs)
        for n in sorted(set(mine) | set(theirs)):
            if mine.get(n) != theirs.get(n):
                out.append(f"param {n}: {mine.get(n)} -> {theirs.get(n)}")
        if self.tensor_choices != other.tensor_choices:
            out.append("tensor-axis op choices differ")
        for x, y in zip(self.blocks, other.blocks):
            if x.ops != y.ops:
                out.append(f"block {x.label}: op strategies differ")
        return "\n".join(out)

    # ---------------------------------------------------------------- JSON

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        # specs as lists of entries: None, an axis, or a list of axes (P(*entries) reads it)
        d["parameter_specs"] = [(n, list(p.entries)) for n, p in self.parameter_specs]
        d["batch_input_specs"] = [(n, list(p.entries)) for n, p in self.batch_input_specs]
        d = {"format": FORMAT, **d}
        return json.loads(json.dumps(d))  # tuples -> lists, the form load reads

    @staticmethod
    def from_json(d: dict[str, Any], where: str = "plan") -> Plan:
        fmt = d.get("format") if isinstance(d, dict) else None
        if isinstance(fmt, str) and fmt.startswith("pxform-plan/") and fmt != FORMAT:
            raise PxformError(
                f"pxform.Plan.load: {where} is a plan of format {fmt}, and this pxform "
                f"reads {FORMAT} (format version {FORMAT_VERSION}).\n  Fix: search the plan "
                f"again with this pxform (step.plan(*args), or `pxform plan ... --out`) and "
                f"save it; pin choices you want kept with pxform.search.Pin.")
        if fmt != FORMAT:
            raise PxformError(f"pxform.Plan.load: {where} is not a pxform plan (expected "
                              f"\"format\": \"{FORMAT}\").\n  Fix: pass a file written by "
                              f"Plan.save or `pxform plan --out`.")
        names = {f.name for f in fields(Plan)}
        missing = sorted(n for n in names if n not in d and n not in
                         ("frontier_points", "search_seconds", "notes",
                          "batch_input_specs", "precision", "virtual_stages",
                          "schedule_times", "calibration_step_times_s"))
        if missing:
            raise PxformError(f"pxform.Plan.load: {where} lacks {missing}.\n  Fix: write the "
                              f"plan again with Plan.save.")
        unknown = sorted(k for k in d if k not in names and k != "format")
        if unknown:
            raise PxformError(f"pxform.Plan.load: {where} has unknown keys {unknown}.")
        try:
            return Plan(
                **{k: d[k] for k in names if k in d and k not in
                   ("blocks", "stage_plans", "tensor_choices", "parameter_specs",
                    "frontier_points", "notes", "batch_input_specs", "precision",
                    "schedule_times", "calibration_step_times_s")},
                calibration_step_times_s=tuple(float(t) for t in
                                               d.get("calibration_step_times_s", ())),
                schedule_times=tuple((str(n), None if t is None else float(t))
                                     for n, t in d.get("schedule_times", ())),
                precision=tuple((str(k), tuple(v) if isinstance(v, list) else v)
                                for k, v in d.get("precision", ())),
                blocks=tuple(BlockPlan(**{**b, "roles": tuple(tuple(r) for r in b["roles"]),
                                          "ops": tuple(b["ops"])})
                             for b in d["blocks"]),
                stage_plans=tuple(StagePlan(**{**s, "blocks": tuple(s["blocks"])})
                                  for s in d["stage_plans"]),
                tensor_choices=tuple((int(k), tuple(_choice(c) for c in cs))
                                     for k, cs in d["tensor_choices"]),
                parameter_specs=tuple((n, P(*e)) for n, e in d["parameter_specs"]),
                frontier_points=tuple(FrontierPoint(**p) for p in d.get("frontier_points", ())),
                notes=tuple(d.get("notes", ())),
                batch_input_specs=tuple((n, P(*e)) for n, e in d.get("batch_input_specs", ())))
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
            if (last.kind, last.stage, last.roles, last.recompute, last.reshard) == \
                    (b.kind, b.stage, b.roles, b.recompute, b.reshard):
                out[-1].append(b)
                continue
        out.append([b])
    return out


