"""Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters Using Megatron-LM", SC 2021).

Each of the p ranks holds v model chunks: stages `r, r+p, ..., r+(v-1)p` (looped
placement), so a microbatch goes round the ranks v times. Microbatches move in groups of p:
a rank runs chunk 0 of the group's microbatches, then chunk 1, and so on, so a microbatch
comes back to a rank exactly when the rank is free for it. Backwards go the other way
(last chunk first). Rank r warms up with `2(p-r-1) + (v-1)p` forwards (Megatron's count),
then alternates one forward and one backward, then drains.

(Megatron runs all forwards first when m == p; the formula is kept here, which validates
and holds fewer activations.)

Chunks are v times smaller, so the warm-up and drain bubbles shrink v times: with uniform
chunks the idle fraction is `(p-1)/(v*m+p-1)` when m is a multiple of p. Megatron requires
m to be a multiple of p; here any m works: the schedule for m rounded up to a multiple of p
is built and the extra microbatches are dropped (the closed form then no longer holds).
"""

from __future__ import annotations

from pxform.schedules._args import count
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.one_f_one_b import one_f_one_b


def _order(rank: int, p: int, v: int, m: int, kind: str) -> list[Action]:
    chunks = range(v) if kind == "F" else range(v - 1, -1, -1)
    return [Action(c * p + rank, kind, i) for first in range(0, m, p) for c in chunks
            for i in range(first, first + p)]


def interleaved(stages: int, microbatches: int, virtual_stages: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B on `stages` ranks with `virtual_stages` chunks each.

    The schedule has `stages * virtual_stages` stages; stage s runs on rank `s % stages`.
    `virtual_stages=1` is plain 1F1B.

    Example:
        >>> from pxform.schedules import to_text
        >>> print(to_text(interleaved(2, 2, virtual_stages=2)))
        rank 0: 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
        rank 1: 1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1
    """
    p = count("interleaved", "stages", stages)
    m = count("interleaved", "microbatches", microbatches)
    v = count("interleaved", "virtual_stages", virtual_stages)
    if v == 1:
        return one_f_one_b(p, m)
    # Build the schedule for m rounded up to a multiple of p, then drop the extra
    # microbatches. A smaller last group would bring a microbatch back to a rank before it
    # has gone round the others, while that rank's 1F1B pairing already waits on a backward:
    # a deadlock (e.g. p=5, m=7, v=2). Dropping whole microbatches from a deadlock-free
    # schedule keeps it deadlock free, since dependencies never cross microbatches.
    padded = -(-m // p) * p
    out: Schedule = {}
    for r in range(p):
        forward, backward = _order(r, p, v, padded, "F"), _order(r, p, v, padded, "B")
        warmup = min(2 * (p - r - 1) + (v - 1) * p, len(forward))
        acts = forward[:warmup]
        for k in range(len(forward) - warmup):
            acts += [forward[warmup + k], backward[k]]
        acts += backward[len(forward) - warmup:]
        out[r] = [a for a in acts if a.microbatch < m]
    return out
