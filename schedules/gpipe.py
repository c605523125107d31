"""GPipe (Huang et al., NeurIPS 2019): every microbatch's forward, then every backward.

Rank r runs stage r: `F(r, 0..m-1)` then `B(r, 0..m-1)`, both in microbatch order (the
order torch.distributed.pipelining's `ScheduleGPipe` uses). Simple and deadlock free, but
each stage holds the activations of all m microbatches at once. With uniform stages the
idle fraction is `(p-1)/(m+p-1)`.
"""

from __future__ import annotations

from pxform.schedules._args import count
from pxform.schedules.actions import Action, Schedule


def gpipe(stages: int, microbatches: int) -> Schedule:
    """All forwards, then all backwards, on `stages` ranks (one stage each).

    Example:
        >>> from pxform.schedules import to_text
        >>> print(to_text(gpipe(2, 2)))
        rank 0: 0F0 0F1 0B0 0B1
        rank 1: 1F0 1F1 1B0 1B1
    """
    p = count("gpipe", "stages", stages)
    m = count("gpipe", "microbatches", microbatches)
    return {r: [Action(r, "F", i) for i in range(m)] + [Action(r, "B", i) for i in range(m)]
            for r in range(p)}
