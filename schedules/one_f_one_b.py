"""1F1B, PipeDream-flush (Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN
Training", ICML 2021; Megatron-LM's non-interleaved schedule).

Rank r warms up with `min(p-r-1, m)` forwards, then alternates one forward and one backward,
then drains the remaining backwards. Rank r holds at most `p-r` microbatches' activations
(GPipe holds m) for the same idle fraction `(p-1)/(m+p-1)` with uniform stages.
"""

from __future__ import annotations

from pxform.schedules._args import count
from pxform.schedules.actions import Action, Schedule


def one_f_one_b_order(stage: int, warmup: int, microbatches: int) -> list[Action]:
    """The 1F1B list of one stage: `warmup` forwards, alternate F and B, drain the Bs.

    Example:
        >>> " ".join(map(str, one_f_one_b_order(0, 1, 2)))
        '0F0 0F1 0B0 0B1'
    """
    warmup = min(warmup, microbatches)
    out = [Action(stage, "F", i) for i in range(warmup)]
    for j in range(microbatches - warmup):
        out += [Action(stage, "F", warmup + j), Action(stage, "B", j)]
    out += [Action(stage, "B", j) for j in range(microbatches - warmup, microbatches)]
    return out


def one_f_one_b(stages: int, microbatches: int) -> Schedule:
    """1F1B on `stages` ranks (one stage each).

    Example:
        >>> from pxform.schedules import to_text
        >>> print(to_text(one_f_one_b(2, 3)))
        rank 0: 0F0 0F1 0B0 0F2 0B1 0B2
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    p = count("one_f_one_b", "stages", stages)
    m = count("one_f_one_b", "microbatches", microbatches)
    return {r: one_f_one_b_order(r, p - r - 1, m) for r in range(p)}
