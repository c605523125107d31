"""`simulate`: run a schedule against per-action costs and report its timeline.

The execution model is the executor's: each rank runs its list in order; an action starts
when its rank is free and what it `needs` (see `rules`) has finished. Durations:

    F   forward[s]
    B   backward[s] when stage s has W actions (B is then the input gradient only),
        else backward[s] + weight[s] (the whole backward)
    W   weight[s]
    R   recompute[s] (forward[s] when recompute is None)

Sends and receives take no rank time. A send happens when its rank reaches it; a receive
blocks its rank until `send time + p2p[s]` (s the sending stage). Without comm actions, a
dependency on another rank's action adds that stage's `p2p` instead. Where the receiving
stage has a `forward_sync` (for its F's inputs) or `backward_sync` (its B's), the wait
ends at `expected_later(rank free, send time + p2p, sync)` (`timing.expected_later`:
the later of the two when they are far apart, `sync` more when they meet).

Metrics, each defined once here:

- `step_time`: when the last action ends (the step starts at 0).
- `busy[r]`: the compute time of rank r.
- `bubble_fraction`: `1 - sum(busy) / (ranks * step_time)`, the idle share of all ranks.
- `relative_bubble`: `(step_time - max(busy)) / max(busy)`, the idle time of the busiest rank
  relative to its compute time. This is Merak's measure (Lai et al., TPDS 2023): bubble
  time over the ideal per-stage compute time, `m * (F + R + B)` with recomputation.
- `peak_activations[s]`: the most microbatches whose activations stage s holds at once. They
  are held from the start of F to the end of B; a stage with R actions drops them after F
  and holds them again from the start of R to the end of B (it keeps only its input, which
  is not counted). A forward-only stage holds them only while its F runs. W's smaller saved
  state (inputs and output gradients) is not counted, as in the zero-bubble paper's M_B.

Example:
    >>> from pxform.schedules import one_f_one_b
    >>> t = simulate(one_f_one_b(4, 8), Costs(forward=1.0, backward=2.0))
    >>> t.step_time, round(t.bubble_fraction, 4)
    (33.0, 0.2727)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from pxform.schedules.actions import Action, Schedule
from pxform.schedules.rules import Shape, execution_order
from pxform.schedules.timing import expected_later
from pxform.schedules.validate import check

Cost = float | Sequence[float]
"""A duration for every stage, or one per stage (a sequence as long as the stages)."""


@dataclass(frozen=True, slots=True)
class Costs:
    """Durations of the actions of each stage (see module doc for how they combine).

    Example:
        >>> Costs(forward=1.0, backward=2.0, recompute=[1.0, 1.0]).at("recompute", 1, 2)
        1.0
    """

    forward: Cost
    backward: Cost
    weight: Cost = 0.0
    recompute: Cost | None = None
    p2p: Cost = 0.0
    forward_sync: Cost = 0.0
    backward_sync: Cost = 0.0

    def __post_init__(self) -> None:
        for name in ("forward", "backward", "weight", "recompute", "p2p", "forward_sync",
                     "backward_sync"):
            value = getattr(self, name)
            if value is None:
                continue
            values = list(value) if isinstance(value, Sequence) else [value]
            for v in values:
                if not isinstance(v, int | float) or isinstance(v, bool) or v < 0:
                    raise ValueError(f"pxform.schedules.Costs: {name} must be a number >= 0 "
                                     f"or a sequence of them (one per stage), got {value!r}")
            if isinstance(value, Sequence):
                object.__setattr__(self, name, tuple(float(v) for v in values))

    def at(self, name: str, stage: int, stages: int) -> float:
        """The cost `name` of `stage` in a schedule with `stages` stages.

        Raises:
            ValueError: a per-stage sequence does not have one entry per stage.

        Example:
            >>> Costs(forward=[1.0, 2.0], backward=1.0).at("forward", 1, 2)
            2.0
        """
        value = getattr(self, name)
        if name == "recompute" and value is None:
            value = self.forward
        if isinstance(value, Sequence):
            if len(value) != stages:
                raise ValueError(f"pxform.schedules.Costs: {name} has {len(value)} entries "
                                 f"but the schedule has {stages} stages; give one per stage "
                                 f"or a single number")
            return float(value[stage])
        return float(value)


@dataclass(frozen=True, slots=True)
class Event:
    """One action on one rank from `start` to `end`. A send lasts no time; a receive lasts
    while its rank waits for the data.

    Example:
        >>> Event(0, Action(0, "F", 0), 0.0, 1.0).duration
        1.0
    """

    rank: int
    action: Action
    start: float
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True, slots=True)
class Timeline:
    """What `simulate` found (metrics defined in the module doc).

    Example:
        >>> from pxform.schedules import gpipe
        >>> simulate(gpipe(2, 2), Costs(1.0, 1.0)).peak_activations[0]
        2
    """

    events: tuple[Event, ...]
    step_time: float
    bubble_fraction: float
    peak_activations: Mapping[int, int]
    busy: tuple[float, ...]
    ranks: int

    @property
    def relative_bubble(self) -> float:
        """`(step_time - max(busy)) / max(busy)`: Merak's relative bubble (module doc)."""
        most = max(self.busy)
        return (self.step_time - most) / most if most > 0 else 0.0


def _duration(a: Action, shape: Shape, costs: Costs) -> float:
    S, s = shape.stages, a.stage
    if a.kind == "F":
        return costs.at("forward", s, S)
    if a.kind == "B":
        whole = s not in shape.weight_stages
        return costs.at("backward", s, S) + (costs.at("weight", s, S) if whole else 0.0)
    if a.kind == "W":
        return costs.at("weight", s, S)
    if a.kind == "R":
        return costs.at("recompute", s, S)
    return 0.0


def simulate(schedule: Schedule, costs: Costs) -> Timeline:
    """Run `schedule` with `costs`, event by event; validate it first.

    Raises:
        ScheduleError: the schedule is invalid (see `validate`).
        ValueError: a per-stage cost has the wrong length.

    Example:
        >>> from pxform.schedules import gpipe
        >>> simulate(gpipe(4, 8), Costs(forward=1.0, backward=2.0)).step_time
        33.0
    """
    shape = check(schedule, "simulate")
    for name in ("forward", "backward", "weight", "recompute", "p2p", "forward_sync",
                 "backward_sync"):
        costs.at(name, 0, shape.stages)  # fail early on a wrong-length sequence
    finished: dict[Action, float] = {}
    free = {r: 0.0 for r in schedule}
    events: list[Event] = []
    busy = {r: 0.0 for r in schedule}
    for rank, a, deps in execution_order(schedule, shape):  # validated: every action runs
        start = free[rank]
        if a.kind in ("RF", "RB"):
            (send,) = deps
            sync = costs.at("forward_sync" if a.kind == "RF" else "backward_sync", a.stage,
                            shape.stages)
            end = expected_later(start, finished[send] + costs.at("p2p", send.stage,
                                                                  shape.stages), sync)
        elif a.is_comm:
            end = start
        else:
            theirs = None
            for d in deps:
                ready = finished[d]
                if not shape.has_comm and shape.rank_of(d.stage) != rank:
                    ready += costs.at("p2p", d.stage, shape.stages)
                    theirs = ready if theirs is None else max(theirs, ready)
                else:
                    start = max(start, ready)
            if theirs is not None:
                sync = (costs.at("forward_sync", a.stage, shape.stages) if a.kind == "F" else
                        costs.at("backward_sync", a.stage, shape.stages) if a.kind == "B"
                        else 0.0)
                start = expected_later(start, theirs, sync)
            end = start + _duration(a, shape, costs)
            busy[rank] += end - start
        events.append(Event(rank, a, start, end))
        finished[a] = end
        free[rank] = end
    step = max((e.end for e in events), default=0.0)
    total = sum(busy.values())
    bubble = 1.0 - total / (len(schedule) * step) if step > 0 else 0.0
    return Timeline(
        events=tuple(sorted(events, key=lambda e: (e.rank, e.start, e.end))),
        step_time=step,
        bubble_fraction=bubble,
        peak_activations=MappingProxyType(_peak_activations(events, shape)),
        busy=tuple(busy[r] for r in sorted(busy)),
        ranks=len(schedule),
    )


def _peak_activations(events: list[Event], shape: Shape) -> dict[int, int]:
    at = {(e.action.kind, e.action.stage, e.action.microbatch): e for e in events
          if e.action.is_compute}
    recomputes = {s for (k, s, _) in at if k == "R"}
    peaks = {}
    for s in range(shape.stages):
        changes: list[tuple[float, int]] = []
        for i in range(shape.microbatches):
            f = at[("F", s, i)]
            b = at.get(("B", s, i))
            r = at.get(("R", s, i))
            if b is None:
                spans = [(f.start, f.end)]
            elif s in recomputes and r is not None:
                spans = [(f.start, f.end), (r.start, b.end)]
            else:
                spans = [(f.start, b.end)]
            for lo, hi in spans:
                changes += [(lo, 1), (hi, -1)]
        # Releases sort before acquisitions at the same time: a B ending as the next F
        # starts frees its memory first.
        count = peak = 0
        for _, delta in sorted(changes):
            count += delta
            peak = max(peak, count)
        peaks[s] = peak
    return peaks
