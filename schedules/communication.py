"""`add_communication`: the pass that turns a compute schedule into one the executor runs.

For every dependency that crosses ranks it inserts a send right after the producing action
and the matching receive right before the consuming one (rules in `rules.send_after` and
`rules.receive_before`):

    stage s and s+1 on different ranks:      SF(s,i) after F(s,i), RF(s+1,i) before F(s+1,i)
    trainable s-1 and s on different ranks:  SB(s,i) after B(s,i), RB(s-1,i) before B(s-1,i)

Receives go right before their consumer and not earlier: anything the rank can do first
(a recompute, say) runs while the data is in flight. Idle slots are kept. Where that would
post two ranks' messages in different orders on the two ends, receives move earlier
(`in_sender_order`): NCCL matches point-to-point messages by order.
"""

from __future__ import annotations

import collections

from pxform.core.errors import ScheduleError
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.rules import Shape, receive_before, send_after
from pxform.schedules.validate import check, message


def add_communication(schedule: Schedule) -> Schedule:
    """The schedule with its sends and receives inserted (see module doc); a new dict.

    Raises:
        ScheduleError: the schedule already has send/receive actions, or is invalid.

    Example:
        >>> from pxform.schedules import gpipe, to_text
        >>> print(to_text(add_communication(gpipe(2, 1))))
        rank 0: 0F0 0SF0 0RB0 0B0
        rank 1: 1RF0 1F0 1B0 1SB0
    """
    comm = [str(a) for row in schedule.values() for a in row
            if isinstance(a, Action) and a.is_comm] if isinstance(schedule, dict) else []
    if comm:
        raise ScheduleError(f"pxform.schedules.add_communication: the schedule already has "
                            f"send/receive actions ({', '.join(comm[:4])}"
                            f"{', ...' if len(comm) > 4 else ''}); pass the compute-only "
                            f"schedule (rules.compute_only strips them)")
    return with_transfers(schedule, check(schedule, "add_communication"))


def with_transfers(schedule: Schedule, shape: Shape) -> Schedule:
    """`add_communication` without validating `schedule` first (its `shape`): for the
    search, which prices the generators' schedules (tested valid for every size)."""
    out: Schedule = {}
    for rank in sorted(schedule):
        row: list[Action | None] = []
        for a in schedule[rank]:
            if a is None:
                row.append(None)
                continue
            before, after = receive_before(a, shape), send_after(a, shape)
            row += [x for x in (before, a, after) if x is not None]
        out[rank] = row
    return in_sender_order(out)


def in_sender_order(schedule: Schedule) -> Schedule:
    """Receives reordered so that between every two ranks they are posted in the order
    the messages were sent. NCCL matches point-to-point messages by order, not by tag: a
    rank that receives B0 before F2 while its peer sent F2 first would take F2's bytes for
    B0. A receive only ever moves earlier (to just before the first receive that needs it
    out of the way), so no rank waits for a send that has not been posted before: no
    deadlock is added. A new dict; schedules already in order come back equal."""
    num = len(schedule)
    sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for rank in sorted(schedule):
        for a in schedule[rank]:
            m = message(a, num) if isinstance(a, Action) and a.kind in ("SF", "SB") else None
            if m is not None:
                sent.setdefault((m[0], m[1]), []).append(m[2])
    out: Schedule = {}
    for rank in sorted(schedule):
        done: set[tuple[int, tuple[str, int, int]]] = set()
        pending = {key: list(msgs) for key, msgs in sent.items() if key[1] == rank}
        row: list[Action | None] = []
        for a in schedule[rank]:
            m = message(a, num) if isinstance(a, Action) and a.kind in ("RF", "RB") else None
            if m is None:
                row.append(a)
                continue
            src, _, msg = m
            if (src, msg) in done:
                continue  # received earlier, in the sender's order
            queue = pending.get((src, rank), [])
            while queue and queue[0] != msg:  # what the peer sent first comes first
                early = queue.pop(0)
                row.append(_receive_of(early))
                done.add((src, early))
            if queue:
                queue.pop(0)
            row.append(a)
            done.add((src, msg))
        out[rank] = row
    return out


def _receive_of(msg: tuple[str, int, int]) -> Action:
    """The receive action of a message (direction, sending stage, microbatch)."""
    direction, stage, microbatch = msg
    if direction == "F":
        return Action(stage + 1, "RF", microbatch)
    return Action(stage - 1, "RB", microbatch)


def send_releases(schedule: Schedule) -> dict[int, dict[Action, tuple[Action, ...]]]:
    """Per rank, for a schedule with its transfers (`add_communication`): after which of
    its receives each of its sends is known to have arrived, so that the executor may wait
    for the send there, at once, instead of keeping its tensor to the end of the step.

    A send to rank q has arrived once this rank has received a message that q sent after
    q's receive of it: q runs its actions in order and waits for each receive before going
    on. Waiting there never blocks, so it adds no deadlock. Sends no such receive follows
    are not listed (they are waited for at the end of the step).

    Example:
        >>> from pxform.schedules import add_communication, one_f_one_b
        >>> releases = send_releases(add_communication(one_f_one_b(2, 3)))
        >>> releases[0][Action(0, "RB", 1)]   # rank 1 sent 1B1's gradient after 1RF1
        (Action(stage=0, kind='SF', microbatch=1),)
    """
    num = len(schedule)
    # the index of each message in the row of the rank that sends it and of the receiver
    sent_at: dict[tuple[str, int, int], int] = {}
    received_at: dict[tuple[str, int, int], int] = {}
    for row in schedule.values():
        for k, a in enumerate(row):
            m = message(a, num) if isinstance(a, Action) and a.is_comm else None
            if m is not None:
                (sent_at if a.kind in ("SF", "SB") else received_at)[m[2]] = k
    out: dict[int, dict[Action, tuple[Action, ...]]] = {}
    for rank in sorted(schedule):
        # peer -> (its receive's index, our send), in our order, which is the order the
        # peer receives them in (`in_sender_order`)
        waiting: dict[int, collections.deque[tuple[int, Action]]] = {}
        mine: dict[Action, tuple[Action, ...]] = {}
        for a in schedule[rank]:
            m = message(a, num) if isinstance(a, Action) and a.is_comm else None
            if m is None:
                continue
            src, dst, msg = m
            if a.kind in ("SF", "SB"):
                if msg in received_at:
                    waiting.setdefault(dst, collections.deque()).append((received_at[msg], a))
                continue
            # a receive from `src`: the peer sent it at `sent_at[msg]`, past every one of
            # its receives before that
            queue = waiting.get(src)
            sent = sent_at.get(msg, -1)
            done = []
            while queue and queue[0][0] < sent:
                done.append(queue.popleft()[1])
            if done:
                mine[a] = tuple(done)
        out[rank] = mine
    return out
