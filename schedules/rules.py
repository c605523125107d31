"""The semantics of a schedule in one place: what each action waits for, where stages live,
and which send/receive pairs a schedule needs. `validate`, `simulate`, `add_communication`
and the pipeline executor all read these rules, so they cannot drift apart.

A schedule has `p` ranks (its keys), `S` stages (1 + the largest stage index), `m`
microbatches (1 + the largest microbatch index). Stage `s` runs on rank `s % p`. Stages that
have any `B` are *trainable*; they form a suffix `[first_trainable, S)`.

What each action waits for (`needs`):

    F(s,i)   F(s-1,i)                      (s > 0)
    B(s,i)   F(s,i) and B(s+1,i)           (B(s+1,i) only if s+1 < S)
    W(s,i)   B(s,i)
    R(s,i)   F(s,i)
    SF(s,i)  F(s,i)         SB(s,i)  B(s,i)          (sends follow their producer)
    RF(s,i)  SF(s-1,i)      RB(s,i)  SB(s+1,i)       (receives wait for the send)

Example:
    >>> from pxform.schedules import Action
    >>> needs(Action(1, "B", 0), Shape(ranks=2, stages=2, microbatches=1))
    (Action(stage=1, kind='F', microbatch=0),)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from pxform.schedules.actions import Action, Schedule


@dataclass(frozen=True, slots=True)
class Shape:
    """The sizes a schedule implies, read off its actions (see module doc).

    `first_trainable` is the first stage with a backward (`stages` when none has one);
    `weight_stages` are the stages that split their backward into `B` and `W`.

    Example:
        >>> Shape(ranks=2, stages=4, microbatches=8).rank_of(3)
        1
    """

    ranks: int
    stages: int
    microbatches: int
    first_trainable: int = 0
    weight_stages: frozenset[int] = field(default_factory=frozenset)
    has_comm: bool = False

    def rank_of(self, stage: int) -> int:
        """The rank that runs `stage` (stages are placed round-robin: `stage % ranks`).

        Example:
            >>> Shape(ranks=4, stages=8, microbatches=1).rank_of(5)
            1
        """
        return stage % self.ranks

    def trainable(self, stage: int) -> bool:
        """Whether `stage` runs a backward.

        Example:
            >>> Shape(ranks=2, stages=4, microbatches=1, first_trainable=2).trainable(1)
            False
        """
        return self.first_trainable <= stage < self.stages


def shape_of(schedule: Schedule) -> Shape:
    """The `Shape` of a schedule's actions; assumes only that the entries are actions or None.

    Example:
        >>> shape_of({0: [Action(0, "F", 0), Action(0, "B", 0)]}).microbatches
        1
    """
    actions = [a for row in schedule.values() for a in row if a is not None]
    stages = 1 + max((a.stage for a in actions), default=-1)
    backward = [a.stage for a in actions if a.kind == "B"]
    return Shape(
        ranks=len(schedule),
        stages=stages,
        microbatches=1 + max((a.microbatch for a in actions), default=-1),
        first_trainable=min(backward, default=stages),
        weight_stages=frozenset(a.stage for a in actions if a.kind == "W"),
        has_comm=any(a.is_comm for a in actions),
    )


def needs(action: Action, shape: Shape) -> tuple[Action, ...]:
    """The actions that must have run before `action` can start (see module doc).

    Example:
        >>> needs(Action(2, "RF", 5), Shape(ranks=4, stages=4, microbatches=8))
        (Action(stage=1, kind='SF', microbatch=5),)
    """
    s, kind, i = action.stage, action.kind, action.microbatch
    if kind == "F":
        return (Action(s - 1, "F", i),) if s > 0 else ()
    if kind == "B":
        later = (Action(s + 1, "B", i),) if s + 1 < shape.stages else ()
        return (Action(s, "F", i),) + later
    if kind in ("R", "SF"):
        return (Action(s, "F", i),)
    if kind in ("W", "SB"):
        return (Action(s, "B", i),)
    if kind == "RF":
        return (Action(s - 1, "SF", i),)
    return (Action(s + 1, "SB", i),)  # RB


def execution_order(schedule: Schedule, shape: Shape
                    ) -> Iterator[tuple[int, Action, tuple[Action, ...]]]:
    """Every action as the executor can run it: (rank, action, what it waits for), each
    after everything it waits for, ranks in their own order (rank by rank, each as far as
    it can go, round after round). Stops early where no rank can go on (a deadlock:
    `validate` says where). `simulate` and `Timer` both walk it.

    Example:
        >>> s = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "F", 0),
        ...                                                        Action(1, "B", 0)]}
        >>> [str(a) for _, a, _ in execution_order(s, shape_of(s))]
        ['0F0', '1F0', '1B0', '0B0']
    """
    done: set[Action] = set()
    rows = [(rank, [a for a in row if a is not None]) for rank, row in schedule.items()]
    pos = [0] * len(rows)
    # per rank, what the action it stopped at waits for: each action's needs are made
    # once, not once per round it stays blocked (Timer compiles GPT-3 175B's schedules)
    blocked: list[tuple[Action, ...] | None] = [None] * len(rows)
    progress = True
    while progress:
        progress = False
        for r, (rank, row) in enumerate(rows):
            k, deps = pos[r], blocked[r]
            while k < len(row):
                a = row[k]
                if deps is None:
                    deps = needs(a, shape)
                if any(d not in done for d in deps):
                    break
                yield rank, a, deps
                done.add(a)
                k, deps = k + 1, None
                progress = True
            pos[r], blocked[r] = k, deps


def receive_before(action: Action, shape: Shape) -> Action | None:
    """The receive a compute action needs right before it, if its producer is on another rank.

    Example:
        >>> receive_before(Action(1, "F", 0), Shape(ranks=2, stages=2, microbatches=1))
        Action(stage=1, kind='RF', microbatch=0)
    """
    s, i = action.stage, action.microbatch
    if action.kind == "F" and s > 0 and shape.rank_of(s - 1) != shape.rank_of(s):
        return Action(s, "RF", i)
    if (action.kind == "B" and s + 1 < shape.stages
            and shape.rank_of(s + 1) != shape.rank_of(s)):
        return Action(s, "RB", i)
    return None


def send_after(action: Action, shape: Shape) -> Action | None:
    """The send a compute action owes right after it, if its consumer is on another rank.

    Gradients flow back only between trainable stages: the forward-only stages before the
    first trainable one never receive one.

    Example:
        >>> send_after(Action(1, "B", 0), Shape(ranks=2, stages=2, microbatches=1))
        Action(stage=1, kind='SB', microbatch=0)
    """
    s, i = action.stage, action.microbatch
    if (action.kind == "F" and s + 1 < shape.stages
            and shape.rank_of(s + 1) != shape.rank_of(s)):
        return Action(s, "SF", i)
    if (action.kind == "B" and s - 1 >= shape.first_trainable
            and shape.rank_of(s - 1) != shape.rank_of(s)):
        return Action(s, "SB", i)
    return None


def expected_comm(shape: Shape) -> set[Action]:
    """Every send and receive a complete schedule of this shape must have.

    Example:
        >>> sorted(map(str, expected_comm(Shape(ranks=2, stages=2, microbatches=1))))
        ['0RB0', '0SF0', '1RF0', '1SB0']
    """
    out: set[Action] = set()
    for s in range(shape.stages):
        for i in range(shape.microbatches):
            kinds = ("F", "B") if shape.trainable(s) else ("F",)
            for kind in kinds:
                for comm in (receive_before(Action(s, kind, i), shape),
                             send_after(Action(s, kind, i), shape)):
                    if comm is not None:
                        out.add(comm)
    return out


def positions(schedule: Schedule) -> dict[Action, list[tuple[int, int]]]:
    """Where each action occurs: `{action: [(rank, step), ...]}` (several if duplicated).

    Example:
        >>> positions({0: [None, Action(0, "F", 0)]})[Action(0, "F", 0)]
        [(0, 1)]
    """
    out: dict[Action, list[tuple[int, int]]] = {}
    for rank, row in schedule.items():
        for step, a in enumerate(row):
            if a is not None:
                out.setdefault(a, []).append((rank, step))
    return out


def compute_only(schedule: Schedule) -> Schedule:
    """The schedule without its send/receive actions (idle slots kept).

    Example:
        >>> compute_only({0: [Action(0, "F", 0), Action(0, "SF", 0)]})
        {0: [Action(stage=0, kind='F', microbatch=0)]}
    """
    return {r: [a for a in row if a is None or a.is_compute] for r, row in schedule.items()}


def actions_of(schedule: Schedule) -> Iterable[Action]:
    """Every action of the schedule, rank by rank, idle slots skipped.

    Example:
        >>> list(map(str, actions_of({0: [Action(0, "F", 0), None]})))
        ['0F0']
    """
    for rank in sorted(schedule):
        for a in schedule[rank]:
            if a is not None:
                yield a
