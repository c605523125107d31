"""Merak's shifted critical path schedule (Lai et al., "Merak: An Efficient Distributed DNN
Training Framework with Automated 3D Parallelism for Giant Foundation Models", IEEE TPDS
2023; `FullCriticalPathTrainSchedule` in github.com/HPDL-Group/Merak).

With activation recomputation, 1F1B recomputes a microbatch's forward right before its
backward, after the gradient has arrived: the recompute sits on the critical path (the
chain F(0..S-1), then B(S-1..0) of the first microbatches), and every stage idles
`(S-1)(F+R+B)`. Merak shortens that path three ways; this generator writes all three as
plain actions:

1. Early recompute: `R(s,i)` is placed before the gradient for `B(s,i)` arrives (right
   after the previous action, ahead of the receive that `add_communication` puts right
   before B), so it runs while the rank would wait: in the bubble.
2. No recompute on the last stage: its B follows its F at once, so its activations are
   kept; it costs `F+B` per microbatch instead of `F+R+B`, and the gradients start back
   sooner.
3. The shift: stage S-2 runs one more forward before its first backward (its first B and
   the F after it swap). The first gradient reaches stage S-2 later than its recompute
   ends, and the extra forward fills that wait instead of leaving it idle; the last stage,
   which has slack (`F+B < F+R+B`), absorbs the reordering.

Relative bubble (Merak's measure, `Timeline.relative_bubble`): the idle time of the
busiest stage divided by its compute time, the ideal per-stage time `m(F+R+B)`. With
Merak's cost assumptions (F = R = T, B = 2T, free p2p) and m >= 3, simulated idle times:

    1F1B, recompute inside B         (S-1)(F+R+B)    relative (S-1)/m
    + early recompute                (S-1)(F+B)
    + no recompute on the last stage (S-2)(F+B) + F
    + the shift (this schedule)      (S-2)(F+B)      relative 3(S-2)/(4m)
"""

from __future__ import annotations

from pxform.schedules._args import count
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.one_f_one_b import one_f_one_b_order


def shifted_critical_path(stages: int, microbatches: int) -> Schedule:
    """Merak's schedule on `stages` ranks (one stage each): 1F1B with early recompute on all
    stages but the last, and stage `stages-2` shifted by one forward (see module doc).

    Example:
        >>> from pxform.schedules import to_text
        >>> print(to_text(shifted_critical_path(2, 3)))
        rank 0: 0F0 0F1 0F2 0R0 0B0 0R1 0B1 0R2 0B2
        rank 1: 1F0 1B0 1F1 1B1 1F2 1B2
    """
    p = count("shifted_critical_path", "stages", stages)
    m = count("shifted_critical_path", "microbatches", microbatches)
    out: Schedule = {}
    for r in range(p):
        base: list[Action] = one_f_one_b_order(r, p - r - 1, m)
        if r == p - 2:
            first_b = next(k for k, a in enumerate(base) if a.kind == "B")
            if first_b + 1 < len(base) and base[first_b + 1].kind == "F":
                base[first_b], base[first_b + 1] = base[first_b + 1], base[first_b]
        acts: list[Action | None] = []
        for a in base:
            if a.kind == "B" and r < p - 1:
                acts.append(Action(r, "R", a.microbatch))
            acts.append(a)
        out[r] = acts
    return out
