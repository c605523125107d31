"""`Timer`: a schedule compiled once and timed many times, for the search; `held`: the
activations each stage keeps at its rank's peak, as the pipeline executor keeps them.

`simulate` validates a schedule and builds a full `Timeline` on every call: right for a
report, too slow for a search that prices every candidate plan's schedule. A `Timer` walks
the schedule once (in `simulate`'s own order, with `simulate`'s rules for what each action
waits for and how long it lasts) and keeps per action only its rank, its duration's source
and the actions it waits for; `step_time` then replays that list with the given costs. The
result equals `simulate(schedule, costs).step_time` (tests/test_schedules.py checks it on
every generator).

Example:
    >>> from pxform.schedules import Costs, simulate, zero_bubble
    >>> t = Timer(zero_bubble(4, 8))
    >>> t.step_time([1.0] * 4, [1.0] * 4, [1.0] * 4)
    27.0
    >>> simulate(zero_bubble(4, 8), Costs(1.0, 1.0, weight=1.0)).step_time
    27.0
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pxform.core.errors import ScheduleError
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.communication import send_releases, with_transfers
from pxform.schedules.rules import Shape, execution_order, shape_of

# what an action's duration is made of: forward, backward (+ weight when its stage has
# no W actions), weight, recompute
_F, _B, _BW, _W, _R = range(5)


@dataclass(frozen=True)
class Timer:
    """`schedule` compiled for repeated timing (module doc). Send and receive actions are
    not allowed (the search times compute schedules; `p2p` prices every cross-rank wait).
    The schedule is not validated again (`resolve` and the generators' tests do): one
    that cannot run to its end is refused, `validate` says why.

    Raises:
        ScheduleError: the schedule deadlocks, or has send/receive actions.
    """

    stages: int
    ranks: int
    # per action, in an order in which every action follows what it waits for: (rank,
    # where its duration is in `step_time`'s flat list of durations (kind x stages +
    # stage), ((index of an awaited action, its stage when it runs on another rank, else
    # -1), ...))
    order: tuple[tuple[int, int, tuple[tuple[int, int], ...]], ...]

    def __init__(self, schedule: Schedule) -> None:
        shape = shape_of(schedule)
        if shape.has_comm:
            raise ScheduleError("pxform.schedules.Timer: the schedule has send/receive "
                                "actions; time its compute actions (rules.compute_only)")
        n = shape.stages
        rank_of = [shape.rank_of(s) for s in range(n)]
        kinds = {"F": _F, "W": _W, "R": _R}
        index: dict[Action, int] = {}
        out: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
        for rank, a, deps in execution_order(schedule, shape):  # `simulate`'s order
            waits = tuple((index[d], d.stage if rank_of[d.stage] != rank else -1)
                          for d in deps)
            kind = kinds.get(a.kind)
            if kind is None:  # B
                kind = _B if a.stage in shape.weight_stages else _BW
            index[a] = len(out)
            out.append((rank, kind * n + a.stage, waits))
        if len(out) < sum(a is not None for row in schedule.values() for a in row):
            raise ScheduleError("pxform.schedules.Timer: the schedule deadlocks (no rank "
                                "can go on); validate(schedule) shows where")
        object.__setattr__(self, "stages", n)
        object.__setattr__(self, "ranks", shape.ranks)
        object.__setattr__(self, "order", tuple(out))

    def step_time(self, forward: Sequence[float], backward: Sequence[float],
                  weight: Sequence[float] | None = None,
                  recompute: Sequence[float] | None = None,
                  p2p: Sequence[float] | None = None,
                  forward_sync: Sequence[float] | None = None,
                  backward_sync: Sequence[float] | None = None) -> float:
        """When the last action ends, with per-stage costs as `Costs` defines them
        (`weight` defaults to 0, `recompute` to `forward`, `p2p`, `forward_sync` and
        `backward_sync` to 0: an F or B that waits for another rank starts at
        `expected_later` of its rank's and its input's times).

        Example:
            >>> from pxform.schedules import one_f_one_b
            >>> Timer(one_f_one_b(4, 8)).step_time([1.0] * 4, [2.0] * 4)
            33.0
        """
        n = self.stages
        zero = [0.0] * n
        w = zero if weight is None else weight
        r = forward if recompute is None else recompute
        send = zero if p2p is None else p2p
        fs = zero if forward_sync is None else forward_sync
        bs = zero if backward_sync is None else backward_sync
        for name, seq in (("forward", forward), ("backward", backward), ("weight", w),
                          ("recompute", r), ("p2p", send), ("forward_sync", fs),
                          ("backward_sync", bs)):
            if len(seq) != n:
                raise ValueError(f"pxform.schedules.Timer: {name} has {len(seq)} entries "
                                 f"but the schedule has {n} stages")
        # in the order of _F, _B, _BW, _W, _R; a wait on the same rank (stage -1) reads
        # the 0.0 appended to `send`
        durations = [*forward, *backward, *(b + x for b, x in zip(backward, w)), *w, *r]
        sync = [*fs, *bs, *bs, *zero, *zero]
        synced = any(sync)
        send = [*send, 0.0]
        free = [0.0] * self.ranks
        end: list[float] = []
        for rank, kind, waits in self.order:
            start = free[rank]
            if synced and sync[kind] > 0:
                mine = start
                ready = -math.inf
                for d, other in waits:
                    if other < 0:
                        mine = max(mine, end[d])
                    else:
                        ready = max(ready, end[d] + send[other])
                start = expected_later(mine, ready, sync[kind]) if ready > -math.inf \
                    else mine
            else:
                for d, other in waits:
                    ready = end[d] + send[other]
                    if ready > start:
                        start = ready
            end.append(start + durations[kind])
            free[rank] = end[-1]
        return max(end, default=0.0)


def expected_later(mine: float, theirs: float, sync: float) -> float:
    """When an action that waits for another rank's transfer starts: the later of its
    rank's own time `mine` and the transfer's arrival `theirs`, with both jittered (two
    ranks never run the same work in quite the same time). `sync` is what the meeting
    costs over `max(mine, theirs)` when the two are equal: `Hardware.sync_wait`, what a
    collective waits after some compute. The jitter is taken as normal, so the expected
    later of the two exceeds the later by `sigma phi(d) - |mine - theirs| Q(d)`, with
    `sigma = sync sqrt(2 pi)`, `d = |mine - theirs| / sigma`, `phi` the standard normal
    density and `Q` its upper tail: `sync` at `d = 0`, nothing once one side waits for
    the other by a few sigma. Charging `sync` on every receive (the model until
    2026-11-27) also charged the pipeline's slower stage, whose inputs are there before
    it asks for them: a 2-microbatch GPT pipeline came out 2-3 ms (about 3 %) over.

    Example:
        >>> [round(expected_later(1.0, theirs, 0.1), 4) for theirs in (1.0, 0.9, 0.0)]
        [1.1, 1.0579, 1.0]
    """
    later = max(mine, theirs)
    if sync <= 0:
        return later
    sigma = sync * _SQRT_2PI
    d = abs(mine - theirs) / sigma
    if d > 8.0:  # the excess is below 1e-15 sigma
        return later
    return later + sigma * (math.exp(-0.5 * d * d) / _SQRT_2PI
                            - d * 0.5 * math.erfc(d / math.sqrt(2.0)))


_SQRT_2PI = math.sqrt(2.0 * math.pi)


def held(schedule: Schedule) -> tuple[int, ...]:
    """For a valid schedule (`validate`), per stage: how many microbatches' activations it
    holds when its rank holds the most (counted over the rank's stages together; the
    latest such moment on ties). The
    executor (`pxform.runtime.pipeline`) keeps a microbatch's activations from its `F` to
    the end of its backward: its `B`, or, for a stage that splits off `W`, its `W` (the
    input-gradient pass keeps the graph for the weight-gradient pass). A stage with `R`
    actions keeps only its inputs between `F` and `R`.

    Example:
        >>> from pxform.schedules import one_f_one_b, zero_bubble
        >>> held(one_f_one_b(4, 8)), held(zero_bubble(4, 8))
        ((4, 3, 2, 1), (4, 4, 4, 4))
    """
    return tuple(h for h, _, _ in at_peak(schedule))


def sent_at_peak(schedule: Schedule) -> tuple[tuple[int, int], ...]:
    """For a valid compute schedule, per stage, at the moment `held` counts (its rank's
    peak): how many microbatches' boundary outputs it keeps (those between its `F` and the
    end of their backward, and those sent but not yet known to have arrived), and how
    many microbatches' boundary input gradients (sent, not yet known to have arrived).
    The executor keeps a send's tensor until it waits for it: after the receive that shows
    it arrived (`communication.send_releases`), else at the end of the step.

    Example:
        >>> from pxform.schedules import one_f_one_b
        >>> sent_at_peak(one_f_one_b(2, 8))
        ((2, 0), (1, 1))
    """
    return tuple((f, b) for _, f, b in at_peak(schedule))


def at_peak(schedule: Schedule, weights: Sequence[float] | None = None
            ) -> list[tuple[int, int, int]]:
    """Per stage: (microbatches held, boundary outputs kept, input gradients kept) at its
    rank's peak (`held` and `sent_at_peak` in one walk), walking each rank's actions with
    the transfers the executor adds (`communication.with_transfers`).

    `weights`, per stage: the bytes one microbatch's activations hold there. A rank that
    runs several stages peaks where the sum of its stages' held microbatches times their
    weights is largest (default: every stage alike, the most microbatches). An
    interleaved GPT pipeline's last rank holds 3 microbatches of a layer and none of the
    head at one moment, 2 and 1 at another: counted alike, the second was taken and its
    peak came out 8.5 % under (the forty-second session).

    Example:
        >>> from pxform.schedules import interleaved, one_f_one_b
        >>> at_peak(one_f_one_b(2, 8))
        [(2, 2, 0), (1, 1, 1)]
        >>> [h for h, _, _ in at_peak(interleaved(2, 8, 2), [1.0, 1.0, 1.0, 0.1])]
        [4, 3, 1, 0]
    """
    return peak_walk(schedule)(weights)


def peak_walk(schedule: Schedule
              ) -> Callable[[Sequence[float] | None], list[tuple[int, int, int]]]:
    """`at_peak` for `schedule` as a function of the stages' `weights`: its transfers and
    their releases worked out once (two thirds of a walk: 42 of 61 ms for an interleaved
    schedule of 8 ranks and 128 microbatches), for a search that asks for several weights.

    Example:
        >>> walk = peak_walk(interleaved(2, 8, 2))
        >>> walk(None) == at_peak(interleaved(2, 8, 2))
        True
    """
    shape = shape_of(schedule)
    comm = with_transfers(schedule, shape)
    releases = send_releases(comm)
    return functools.partial(_walk_peak, shape, comm, releases)


def _walk_peak(shape: Shape, comm: Schedule,
               releases: dict[int, dict[Action, tuple[Action, ...]]],
               weights: Sequence[float] | None) -> list[tuple[int, int, int]]:
    """`at_peak`'s walk over a schedule with its transfers (`peak_walk`)."""
    out = [(0, 0, 0)] * shape.stages
    for rank, row in comm.items():
        acts = [a for a in row if a is not None]
        redone = {(a.stage, a.microbatch) for a in acts if a.kind == "R"}
        mine = [s for s in range(shape.stages) if shape.rank_of(s) == rank]
        count = {s: 0 for s in mine}
        outputs: dict[int, set[int]] = {s: set() for s in mine}  # in flight or sending
        sending: dict[int, set[int]] = {s: set() for s in mine}  # outputs
        freed: dict[int, set[int]] = {s: set() for s in mine}  # by the backward
        grads: dict[int, set[int]] = {s: set() for s in mine}  # input gradients sending
        best: tuple[float, int] = (-1.0, -1)
        at = {s: (0, 0, 0) for s in mine}
        for a in acts:
            s, i = a.stage, a.microbatch
            if a.kind in ("RF", "RB"):
                for sent in releases[rank].get(a, ()):
                    t, j = sent.stage, sent.microbatch
                    if sent.kind == "SB":
                        grads[t].discard(j)
                        continue
                    sending[t].discard(j)
                    if j in freed[t]:
                        outputs[t].discard(j)
                continue
            if a.kind == "SF":
                sending[s].add(i)
            elif a.kind == "SB":
                # (a send is a moment too: zero-bubble's last stage sends its last two B's
                # input gradients with both graphs still held for their W, where it
                # peaks; counted after its compute actions alone, that stage came out
                # 1.3 % under the meter on a GPT of width 256: the forty-sixth session)
                grads[s].add(i)
            else:
                split = s in shape.weight_stages
                if a.kind == "F":
                    outputs[s].add(i)
                if not shape.trainable(s):
                    continue  # a forward-only stage frees its activations as its F ends
                if (a.kind == "F" and (s, i) not in redone) or a.kind == "R":
                    count[s] += 1
                elif (a.kind == "B" and not split) or a.kind == "W":
                    count[s] -= 1
                    freed[s].add(i)
                    if i not in sending[s]:
                        outputs[s].discard(i)
            # the most activations; among those moments, the most transfers kept
            total = (sum(count[t] * (1.0 if weights is None else weights[t]) for t in mine),
                     sum(len(outputs[t]) + len(grads[t]) for t in mine))
            if total >= best:
                best = total
                at = {t: (count[t], len(outputs[t]), len(grads[t])) for t in mine}
        for t, c in at.items():
            out[t] = c
    return out


def awaiting_weights(schedule: Schedule) -> tuple[int, ...]:
    """For a valid schedule (`validate`), per stage: the most microbatches whose `B` has
    run and whose `W` has not, counting the one whose W runs next (0 for a stage without W
    actions). The executor keeps the gradients of their weight ops' outputs meanwhile.

    Example:
        >>> from pxform.schedules import zero_bubble
        >>> awaiting_weights(zero_bubble(4, 8))
        (1, 2, 3, 4)
    """
    split = shape_of(schedule).weight_stages
    return tuple(n if s in split else 0
                 for s, n in enumerate(most_between(schedule, "B", "W")))


def most_between(schedule: Schedule, first: str, then: str) -> tuple[int, ...]:
    """Per stage: the most microbatches at once whose `first` action has run on its rank
    and whose `then` action has not (F and B: the microbatches in flight; B and W: those
    awaiting their weight gradients). Other actions and idle slots are skipped.

    Example:
        >>> from pxform.schedules import one_f_one_b
        >>> most_between(one_f_one_b(4, 8), "F", "B")
        (4, 3, 2, 1)
    """
    out = [0] * shape_of(schedule).stages
    for row in schedule.values():
        count = [0] * len(out)
        for a in row:
            if a is None:
                continue
            if a.kind == first:
                count[a.stage] += 1
                out[a.stage] = max(out[a.stage], count[a.stage])
            elif a.kind == then:
                count[a.stage] -= 1
    return tuple(out)


__all__ = ["Timer", "at_peak", "awaiting_weights", "expected_later", "held", "most_between",
           "sent_at_peak"]
