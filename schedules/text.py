"""Schedules as text and CSV, so they can be read, diffed, written by hand and kept as golden
files. Both forms round-trip exactly (`from_text(to_text(s)) == s`).

Text: one line per rank, `rank <r>:` then the actions separated by spaces, `-` for an idle
slot. Blank lines and lines starting with `#` are ignored.

    rank 0: 0F0 0F1 - 0B0 0B1
    rank 1: - 1F0 1B0 1F1 1B1

CSV: one row per rank, the rank in the first column, then one action per cell; an empty
cell is an idle slot. Rows are not padded to a common length, because a trailing empty cell
is an idle slot. A first row whose first cell is `rank` is taken as a header and skipped.

    0,0F0,0F1,,0B0,0B1
    1,,1F0,1B0,1F1,1B1
"""

from __future__ import annotations

import csv
import io
import re

from pxform.core.errors import ScheduleError
from pxform.schedules.actions import Action, Schedule

_IDLE = "-"
_LINE = re.compile(r"^\s*rank\s+(\d+)\s*:(.*)$")


def _cell(a: Action | None, idle: str) -> str:
    return idle if a is None else str(a)


def to_text(schedule: Schedule) -> str:
    """The schedule as text, one line per rank in rank order (see module doc).

    Example:
        >>> print(to_text({0: [Action(0, "F", 0), None, Action(0, "B", 0)]}))
        rank 0: 0F0 - 0B0
    """
    lines = []
    for rank in sorted(schedule):
        cells = " ".join(_cell(a, _IDLE) for a in schedule[rank])
        lines.append(f"rank {rank}: {cells}".rstrip())
    return "\n".join(lines)


def _parse_cell(token: str, where: str, idle: str) -> Action | None:
    if token == idle:
        return None
    try:
        return Action.parse(token)
    except ValueError:
        raise ScheduleError(
            f"pxform.schedules.{where}: token {token!r} is not an action or "
            f"{'an empty cell' if idle == '' else repr(idle)}; an action is "
            f"<stage><kind><microbatch> with kind one of F, B, W, R, SF, RF, SB, RB "
            f"(e.g. '0F3', '1B2', '0SF1')") from None


def _add_rank(out: Schedule, rank: int, row: list[Action | None], where: str) -> None:
    if rank in out:
        raise ScheduleError(f"pxform.schedules.{where}: rank {rank} is listed twice")
    out[rank] = row


def _check_ranks(out: Schedule, fn: str) -> Schedule:
    if not out:
        raise ScheduleError(f"pxform.schedules.{fn}: no rank found; the text must have one "
                            f"line per rank")
    missing = sorted(set(range(len(out))) - set(out))
    if missing:
        raise ScheduleError(f"pxform.schedules.{fn}: ranks {sorted(out)} are listed but "
                            f"rank {missing[0]} is missing; ranks must be 0..p-1")
    return {r: out[r] for r in sorted(out)}


def from_text(text: str) -> Schedule:
    """Parse the text form (see module doc) back into a schedule.

    Raises:
        ScheduleError: a line is not `rank <r>: ...`, a token is not an action, or a rank
            is missing or listed twice; the message names the line and the token.

    Example:
        >>> from_text("rank 0: 0F0 - 0B0")[0][1] is None
        True
    """
    out: Schedule = {}
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            raise ScheduleError(f"pxform.schedules.from_text: line {number} ({line.strip()!r}) "
                                f"does not start with 'rank <r>:'")
        where = f"from_text: line {number}"
        row = [_parse_cell(tok, where, _IDLE) for tok in m.group(2).split()]
        _add_rank(out, int(m.group(1)), row, f"from_text: line {number}")
    return _check_ranks(out, "from_text")


def to_csv(schedule: Schedule) -> str:
    """The schedule as CSV, one row per rank (see module doc).

    Example:
        >>> to_csv({0: [Action(0, "F", 0), None, Action(0, "B", 0)]})
        '0,0F0,,0B0\\n'
    """
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for rank in sorted(schedule):
        writer.writerow([rank, *(_cell(a, "") for a in schedule[rank])])
    return buf.getvalue()


def from_csv(text: str) -> Schedule:
    """Parse the CSV form (see module doc) back into a schedule.

    Raises:
        ScheduleError: the first cell of a row is not a rank, a cell is not an action, or a
            rank is missing or listed twice; the message names the line and the cell.

    Example:
        >>> from_csv("0,0F0,,0B0\\n")[0][1] is None
        True
    """
    out: Schedule = {}
    for number, cells in enumerate(csv.reader(io.StringIO(text)), start=1):
        if not cells or all(not c.strip() for c in cells):
            continue
        head = cells[0].strip()
        if number == 1 and head.lower() == "rank":
            continue
        if not head.isdigit():
            raise ScheduleError(f"pxform.schedules.from_csv: line {number}: the first cell "
                                f"{head!r} is not a rank number")
        where = f"from_csv: line {number}"
        row = [_parse_cell(c.strip(), where, "") for c in cells[1:]]
        _add_rank(out, int(head), row, where)
    return _check_ranks(out, "from_csv")
