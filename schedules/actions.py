"""The `Action`: one step of one pipeline rank, and schedules as text.

A schedule is plain data, `{rank: [Action | None, ...]}`: each pipeline rank runs its list
in order; `None` is an idle slot (kept for pictures, skipped by the executor). An action is
`(stage, kind, microbatch)` and prints as stage, kind, microbatch:

    0F3    stage 0 runs forward of microbatch 3
    1B2    stage 1 runs backward of microbatch 2 (the input gradient only when the schedule
           also has 1W2; otherwise the whole backward)
    1W2    stage 1 computes the weight gradients of microbatch 2 (zero-bubble)
    0R1    stage 0 recomputes the activations of microbatch 1 before its backward
    0SF3   stage 0 sends the activations of microbatch 3 to stage 1
    1RF3   stage 1 receives them
    1SB2   stage 1 sends the input gradient of microbatch 2 to stage 0
    0RB2   stage 0 receives it

Stages are global (virtual) stage indices: with `p` ranks and `v` stages per rank
(interleaved, nF1B), stage `s` runs on rank `s % p`.

Example:
    >>> Action.parse("1B2")
    Action(stage=1, kind='B', microbatch=2)
    >>> str(Action(0, "SF", 3))
    '0SF3'
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COMPUTE_KINDS = ("F", "B", "W", "R")
"""Forward, backward (input gradient, or all of it), weight gradient, recompute."""
COMM_KINDS = ("SF", "RF", "SB", "RB")
"""Send/receive forward activations, send/receive backward (input) gradients."""
KINDS = COMPUTE_KINDS + COMM_KINDS

_PATTERN = re.compile(r"^(\d+)(SF|RF|SB|RB|F|B|W|R)(\d+)$")

Schedule = dict[int, list["Action | None"]]
"""`{pipeline rank: [Action | None]}`: what each rank runs, in order."""


@dataclass(frozen=True, slots=True, order=True)
class Action:
    """One step of a pipeline rank: `kind` of `stage` for `microbatch` (see module doc)."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Action: kind {self.kind!r} is not one of {', '.join(KINDS)}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(f"Action: stage and microbatch are >= 0, got {self.stage}, "
                             f"{self.microbatch}")

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @staticmethod
    def parse(text: str) -> Action:
        """The action a text such as `"0F3"` or `"1RB2"` stands for.

        Raises:
            ValueError: the text is not `<stage><kind><microbatch>`.
        """
        m = _PATTERN.match(text.strip())
        if m is None:
            raise ValueError(f"Action.parse: {text!r} is not <stage><kind><microbatch> with "
                             f"kind one of {', '.join(KINDS)} (e.g. '0F3', '1B2', '0SF1')")
        return Action(int(m.group(1)), m.group(2), int(m.group(3)))
