"""`validate`: is a schedule complete, well placed and free of deadlock?

Checks, in order (the first failure raises `ScheduleError`):

1. the schedule is `{0..p-1: [Action | None]}`;
2. every action is on the rank of its stage (`stage % p`);
3. no action occurs twice;
4. every (stage, microbatch) has an F;
5. the stages with a backward form a suffix of the stages, and each has a B per microbatch;
6. a stage with any W has one per microbatch; R only on trainable stages;
7. on each rank: F before R before B before W for the same microbatch;
8. sends and receives, if the schedule has any, are exactly those it needs
   (`rules.expected_comm`), sends after their producer, receives before their consumer;
9. between every two ranks, receives are posted in the order of the sends (NCCL matches
   point-to-point messages by order);
10. no deadlock: each rank runs its list in order, sends never block, a receive waits for its
   send, a compute action waits for what it `needs`. When no rank can move and some have
   actions left, the message says what each stuck rank waits for, and the cycle of waits.

Every message carries the step-by-rank grid with the failing actions marked `>like this<`.

Example:
    >>> from pxform.schedules import one_f_one_b
    >>> validate(one_f_one_b(4, 8))   # returns None; raises ScheduleError when invalid
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TypeAlias

from pxform.core.errors import ScheduleError
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.rules import (
    Shape,
    execution_order,
    expected_comm,
    needs,
    positions,
    shape_of,
)

Mark: TypeAlias = "tuple[int, int] | Action"
"""A cell to mark in a grid: `(rank, step)`, or an action (each place it occurs)."""

_GRID_WINDOW = 24
"""Messages show at most this many steps around the marks, so a long schedule's error stays
readable; `grid` itself shows everything unless asked."""


def grid(schedule: Schedule, mark: Iterable[Mark] = (), max_steps: int | None = None) -> str:
    """The schedule as a table: a row per rank, a column per step, marked cells `>0F3<`.

    Args:
        schedule: `{rank: [Action | None]}`; idle slots print as `-`.
        mark: `(rank, step)` positions or actions (every occurrence is marked).
        max_steps: show at most this many columns, centred on the marks.

    Example:
        >>> print(grid({0: [Action(0, "F", 0), None], 1: [None, Action(1, "F", 0)]},
        ...            mark=[(1, 1)]))
        step      0     1
        rank 0   0F0    -
        rank 1    -   >1F0<
    """
    marked: set[tuple[int, int]] = set()
    where: dict[Action, list[tuple[int, int]]] | None = None
    for m in mark:
        if isinstance(m, Action):
            where = positions(schedule) if where is None else where
            marked.update(where.get(m, []))
        else:
            marked.add((m[0], m[1]))
    ranks = sorted(schedule)
    width = max((len(schedule[r]) for r in ranks), default=0)
    lo, hi = 0, width
    if max_steps is not None and width > max_steps:
        steps = sorted(s for _, s in marked) or [0]
        centre = (steps[0] + steps[-1]) // 2
        lo = max(0, min(centre - max_steps // 2, width - max_steps))
        hi = lo + max_steps

    def cell(r: int, s: int) -> str:
        row = schedule[r]
        text = "" if s >= len(row) else "-" if row[s] is None else str(row[s])
        return f">{text}<" if (r, s) in marked else f" {text} "

    columns = [[f" {s} "] + [cell(r, s) for r in ranks] for s in range(lo, hi)]
    widths = [max(len(c) for c in col) for col in columns]
    labels = ["step"] + [f"rank {r}" for r in ranks]
    label_width = max(len(x) for x in labels)
    lines = []
    for k, label in enumerate(labels):
        cells = " ".join(col[k].center(w) for col, w in zip(columns, widths))
        prefix = "... " if lo > 0 else ""
        suffix = " ..." if hi < width else ""
        lines.append(f"{label.ljust(label_width)}  {prefix}{cells}{suffix}".rstrip())
    return "\n".join(lines)


def _fail(fn: str, schedule: Schedule, what: str, marks: Iterable[Mark] = (),
          detail: Sequence[str] = ()) -> ScheduleError:
    body = "\n".join([f"pxform.schedules.{fn}: {what}", *detail, "",
                      grid(schedule, marks, max_steps=_GRID_WINDOW)])
    return ScheduleError(body)


def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` unless the schedule is complete, placed right and deadlock free.

    See the module doc for the checks. Returns None on success.

    Example:
        >>> validate({0: [Action(0, "F", 0), Action(0, "B", 0)]})
    """
    check(schedule, "validate")


def check(schedule: Schedule, fn: str) -> Shape:
    """`validate` for other pxform functions: the message names `fn`; returns the shape.

    Example:
        >>> check({0: [Action(0, "F", 0)]}, "simulate").microbatches
        1
    """
    _check_types(schedule, fn)
    shape = shape_of(schedule)
    where = positions(schedule)
    _check_placement(schedule, shape, where, fn)
    _check_complete(schedule, shape, where, fn)
    _check_order(schedule, where, fn)
    if shape.has_comm:
        _check_comm(schedule, shape, where, fn)
        _check_pair_order(schedule, fn)
    _check_deadlock(schedule, shape, where, fn)
    return shape


def message(a: Action, num_ranks: int) -> tuple[int, int, tuple[str, int, int]] | None:
    """(sender rank, receiver rank, message) of a send or receive action, the message
    named the same on both ends (direction, sending stage, microbatch); None for compute."""
    if a.kind == "SF":
        return a.stage % num_ranks, (a.stage + 1) % num_ranks, ("F", a.stage, a.microbatch)
    if a.kind == "SB":
        return a.stage % num_ranks, (a.stage - 1) % num_ranks, ("B", a.stage, a.microbatch)
    if a.kind == "RF":
        return (a.stage - 1) % num_ranks, a.stage % num_ranks, ("F", a.stage - 1, a.microbatch)
    if a.kind == "RB":
        return (a.stage + 1) % num_ranks, a.stage % num_ranks, ("B", a.stage + 1, a.microbatch)
    return None


def _check_pair_order(schedule: Schedule, fn: str) -> None:
    """Between every two ranks, receives are posted in the order the sends were: NCCL
    matches point-to-point messages by order, not by tag."""
    num = len(schedule)
    order: dict[tuple[int, int], dict[str, list[tuple[Action, tuple[str, int, int]]]]] = {}
    for rank in sorted(schedule):
        for a in schedule[rank]:
            m = message(a, num) if isinstance(a, Action) else None
            if m is not None:
                side = "send" if a.kind in ("SF", "SB") else "receive"
                order.setdefault((m[0], m[1]), {"send": [], "receive": []})[side].append(
                    (a, m[2]))
    for (src, dst), sides in sorted(order.items()):
        for (s, sm), (r, rm) in zip(sides["send"], sides["receive"]):
            if sm != rm:
                raise _fail(fn, schedule, f"rank {dst} posts {r} where rank {src}'s next "
                            f"message is {s}: messages between two ranks must be received "
                            f"in the order they are sent (NCCL matches them by order, not by "
                            f"tag); add_communication orders them", [s, r])


def _check_types(schedule: Schedule, fn: str) -> None:
    if not isinstance(schedule, dict) or not schedule:
        raise ScheduleError(f"pxform.schedules.{fn}: a schedule is a non-empty dict "
                            f"{{rank: [Action | None]}}, got {type(schedule).__name__}"
                            f"{' (empty)' if isinstance(schedule, dict) else ''}")
    if sorted(schedule) != list(range(len(schedule))):
        raise ScheduleError(f"pxform.schedules.{fn}: the ranks are {sorted(schedule)!r}; "
                            f"they must be 0..{len(schedule) - 1}")
    for rank, row in schedule.items():
        if not isinstance(row, list):
            raise ScheduleError(f"pxform.schedules.{fn}: rank {rank} maps to a "
                                f"{type(row).__name__}; it must map to a list of actions")
        for step, a in enumerate(row):
            if a is not None and not isinstance(a, Action):
                raise ScheduleError(f"pxform.schedules.{fn}: rank {rank} step {step} is "
                                    f"{a!r}; entries are Action or None (Action.parse('0F1') "
                                    f"builds one from text)")
    if not any(a is not None for row in schedule.values() for a in row):
        raise ScheduleError(f"pxform.schedules.{fn}: the schedule has no actions")


def _check_placement(schedule: Schedule, shape: Shape,
                     where: dict[Action, list[tuple[int, int]]], fn: str) -> None:
    for rank in sorted(schedule):
        for step, a in enumerate(schedule[rank]):
            if a is not None and shape.rank_of(a.stage) != rank:
                raise _fail(fn, schedule,
                            f"{a} is on rank {rank}, but stage {a.stage} runs on rank "
                            f"{shape.rank_of(a.stage)} ({a.stage} % {shape.ranks} ranks)",
                            [(rank, step)])
    for a, places in where.items():
        if len(places) > 1:
            raise _fail(fn, schedule, f"{a} occurs {len(places)} times (steps "
                        f"{', '.join(str(s) for _, s in places)} of rank {places[0][0]}); "
                        f"each action runs once", places)


def _check_complete(schedule: Schedule, shape: Shape,
                    where: dict[Action, list[tuple[int, int]]], fn: str) -> None:
    S, m = shape.stages, shape.microbatches

    def related(stage: int, mb: int) -> list[Mark]:
        return [Action(stage, k, mb) for k in ("F", "B", "W", "R") if Action(stage, k, mb)
                in where]

    for s in range(S):
        for i in range(m):
            if Action(s, "F", i) not in where:
                raise _fail(fn, schedule, f"stage {s} has no F for microbatch {i} (every "
                            f"stage runs one F per microbatch; {S} stages and {m} microbatches "
                            f"from the largest indices)", related(s, i))
    trainable = sorted({a.stage for a in where if a.kind == "B"})
    if trainable and trainable != list(range(trainable[0], S)):
        gap = next(s for s in range(trainable[0], S) if s not in trainable)
        raise _fail(fn, schedule, f"stage {gap} has no backward but stages {trainable} do; "
                    f"the stages with a backward must be a suffix of the stages (the ones "
                    f"before run forward only), so stage {gap} misses its B actions",
                    [Action(gap, "F", i) for i in range(m)])
    for s in trainable:
        for i in range(m):
            if Action(s, "B", i) not in where:
                raise _fail(fn, schedule, f"stage {s} has no B for microbatch {i} (stage {s} "
                            f"has a backward, so it needs one B per microbatch)",
                            related(s, i))
    for s in sorted(shape.weight_stages):
        for i in range(m):
            if Action(s, "W", i) not in where:
                raise _fail(fn, schedule, f"stage {s} has no W for microbatch {i} (a stage "
                            f"with W actions splits every backward into B and W)",
                            related(s, i))
    for a in where:
        if a.kind in ("W", "R") and not shape.trainable(a.stage):
            what = "W without B" if a.kind == "W" else "R on a stage without backward"
            raise _fail(fn, schedule, f"{a}: {what}; stage {a.stage} has no B actions", [a])


def _check_order(schedule: Schedule, where: dict[Action, list[tuple[int, int]]],
                 fn: str) -> None:
    # Pairs (earlier, later) of one microbatch on one rank; all of them share a rank because
    # placement is already checked.
    rules = (("F", "B", "backward before its forward"),
             ("F", "R", "recompute before its forward"),
             ("R", "B", "recompute after its backward"),
             ("B", "W", "weight gradient before its backward"))
    for a in sorted(where):
        for first, then, what in rules:
            if a.kind != then:
                continue
            before = Action(a.stage, first, a.microbatch)
            if before in where and where[before][0][1] > where[a][0][1]:
                raise _fail(fn, schedule, f"{a} comes before {before} on rank "
                            f"{where[a][0][0]}: {what}", [before, a])


def _check_comm(schedule: Schedule, shape: Shape,
                where: dict[Action, list[tuple[int, int]]], fn: str) -> None:
    expected = expected_comm(shape)
    have = {a for a in where if a.is_comm}
    for a in sorted(expected - have):
        peer = _comm_peer(a)
        raise _fail(fn, schedule, f"the schedule has send/receive actions but misses {a} "
                    f"(the {'receive' if a.kind[0] == 'R' else 'send'} paired with {peer}); "
                    f"a schedule with comm actions needs all of them "
                    f"(add_communication inserts them)", [peer, _comm_compute(a)])
    for a in sorted(have - expected):
        raise _fail(fn, schedule, f"{a} is not a transfer this schedule needs (stages on the "
                    f"same rank, a forward-only stage, or beyond the last stage)", [a])
    for a in sorted(expected):
        compute = _comm_compute(a)
        _, step_c = where[compute][0]
        rank, step_a = where[a][0]
        is_receive = a.kind in ("RF", "RB")
        if is_receive and step_a > step_c:
            raise _fail(fn, schedule, f"receive {a} comes after {compute}, which needs it, on "
                        f"rank {rank}; a receive goes before its consumer", [a, compute])
        if not is_receive and step_a < step_c:
            raise _fail(fn, schedule, f"send {a} comes before {compute}, which produces it, "
                        f"on rank {rank}; a send goes after its producer", [a, compute])


def _comm_peer(a: Action) -> Action:
    """The other half of a send/receive pair."""
    s, i = a.stage, a.microbatch
    if a.kind == "SF":
        return Action(s + 1, "RF", i)
    if a.kind == "RF":
        return Action(s - 1, "SF", i)
    if a.kind == "SB":
        return Action(s - 1, "RB", i)
    return Action(s + 1, "SB", i)


def _comm_compute(a: Action) -> Action:
    """The compute action on the same rank that produces a send or consumes a receive."""
    kind = "F" if a.kind in ("SF", "RF") else "B"
    return Action(a.stage, kind, a.microbatch)


def _check_deadlock(schedule: Schedule, shape: Shape,
                    where: dict[Action, list[tuple[int, int]]], fn: str) -> None:
    done = {a for _, a, _ in execution_order(schedule, shape)}
    # (actions are unique here, `_check_complete`): a rank stops at its first action that
    # did not run
    stuck = {r: next(k for k, a in enumerate(row) if a is not None and a not in done)
             for r, row in schedule.items()
             if any(a is not None and a not in done for a in row)}
    if not stuck:
        return
    waits: dict[int, int] = {}
    detail = []
    for rank, step in sorted(stuck.items()):
        a = schedule[rank][step]
        assert a is not None
        missing = next(n for n in needs(a, shape) if n not in done)
        other, other_step = where[missing][0]
        waits[rank] = other
        detail.append(f"  rank {rank} waits at step {step} ({a}) for {missing}, which rank "
                      f"{other} runs at step {other_step} and has not reached")
    cycle = _cycle(waits)
    if cycle:
        detail.append("  cycle of waits: " + " -> ".join(f"rank {r}" for r in cycle))
    raise _fail(fn, schedule, "deadlock: no rank can run its next action", list(stuck.items()),
                detail)


def _cycle(waits: dict[int, int]) -> list[int]:
    """A cycle in the wait-for graph (every stuck rank waits for one other stuck rank)."""
    for start in sorted(waits):
        seen: list[int] = []
        r = start
        while r in waits and r not in seen:
            seen.append(r)
            r = waits[r]
        if r in seen:
            return seen[seen.index(r):] + [r]
    return []

