"""ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

The backward of a stage splits into B (the input gradient, which the previous stage waits
for) and W (the weight gradient, which nothing in the pipeline waits for). ZB-H1 keeps the
1F1B order of F and B, so each rank holds at most `p-r` microbatches between F and B, the
same peak as 1F1B; rank r runs each W `r` backwards late: W(j) right after B(j+r), the
rest at the end. The early ranks, which otherwise idle while the last ones finish, fill
their drain with the delayed Ws instead of waiting, and B travels back through the pipeline
without the W in its way.

With equal F, B and W times T and m >= p, the idle time of a rank drops from 1F1B's
`(p-1)(F+B+W) = 3(p-1)T` to `(p-1)(F+B-W) = (p-1)T`, a third (the paper's Table 2).
Rank r keeps `r` weight-gradient states (`(p-r)M_B + r*M_W` in the paper's terms).
"""

from __future__ import annotations

from pxform.schedules._args import count
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.one_f_one_b import one_f_one_b_order


def zero_bubble(stages: int, microbatches: int) -> Schedule:
    """ZB-H1 on `stages` ranks (one stage each): 1F1B with W split off and delayed.

    Example:
        >>> from pxform.schedules import to_text
        >>> print(to_text(zero_bubble(2, 2)))
        rank 0: 0F0 0F1 0B0 0W0 0B1 0W1
        rank 1: 1F0 1B0 1F1 1B1 1W0 1W1
    """
    p = count("zero_bubble", "stages", stages)
    m = count("zero_bubble", "microbatches", microbatches)
    out: Schedule = {}
    for r in range(p):
        acts: list[Action | None] = []
        pending: list[int] = []  # microbatches whose B ran and whose W waits
        for a in one_f_one_b_order(r, p - r - 1, m):
            acts.append(a)
            if a.kind == "B":
                pending.append(a.microbatch)
                if len(pending) > r:
                    acts.append(Action(r, "W", pending.pop(0)))
        acts += [Action(r, "W", j) for j in pending]
        out[r] = acts
    return out
