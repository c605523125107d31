"""nF1B: several forward sweeps per microbatch, one backward (nnScaler's 3F1B, Lin et al.,
"nnScaler: Constraint-Guided Parallelization Plan Generation for Deep Learning Training",
OSDI 2024, written for AlphaFold2's recycling: the model runs `forwards` times on each
input, feeding each output back in, and only the last run is differentiated).

Each microbatch sweeps the p ranks `forwards` times: sweep k is stages `kp..kp+p-1`, stage s
on rank `s % p`, and the last stage of sweep k feeds the first of sweep k+1 (rank p-1 to
rank 0). Sweeps `0..forwards-2` run without gradient (F only, nothing kept); the last sweep
is trained (F and B).

Order (the one nnScaler's `ScheduleNF1B.run` uses): every rank first runs the forward-only
sweeps of all microbatches, sweep by sweep (a microbatch comes back to rank 0 after p
forwards, so with m >= p the sweeps pipeline without gaps), then plain 1F1B over the
trained sweep. Forward-only sweeps hold no activations, so the peak stays 1F1B's: `p-r`
microbatches on rank r. What waits between the phases are the last forward-only outputs,
one boundary tensor per microbatch. Interleaving the forward-only sweeps into 1F1B's
warm-up bubble would shave that bubble but hold more of those tensors for longer; nnScaler
chose the simple order and so do we.
"""

from __future__ import annotations

from pxform.schedules._args import count
from pxform.schedules.actions import Action, Schedule
from pxform.schedules.one_f_one_b import one_f_one_b_order


def nf1b(stages: int, microbatches: int, forwards: int = 3) -> Schedule:
    """`forwards` sweeps through `stages` ranks per microbatch, the last one trained.

    The schedule has `stages * forwards` stages; `forwards=1` is plain 1F1B.

    Example:
        >>> from pxform.schedules import to_text
        >>> print(to_text(nf1b(2, 2, forwards=2)))
        rank 0: 0F0 0F1 2F0 2F1 2B0 2B1
        rank 1: 1F0 1F1 3F0 3B0 3F1 3B1
    """
    p = count("nf1b", "stages", stages)
    m = count("nf1b", "microbatches", microbatches)
    n = count("nf1b", "forwards", forwards)
    last = (n - 1) * p
    out: Schedule = {}
    for r in range(p):
        sweeps = [Action(k * p + r, "F", i) for k in range(n - 1) for i in range(m)]
        out[r] = [*sweeps, *one_f_one_b_order(last + r, p - r - 1, m)]
    return out
