"""Floor 2, schedules: pipeline schedules as data, installed as `pxform.schedules`. May
import core only (the search costs schedules, the runtime executes them).

A schedule is `{rank: [Action | None]}`: what each pipeline rank runs, in order (`None` is an
idle slot). Generators are pure functions `(stages, microbatches, **options) -> Schedule`
of compute actions; `add_communication` adds the sends and receives; `validate` checks a
schedule and reports deadlocks with a step-by-rank grid; `simulate` times it against costs;
`plot` draws the timeline. The semantics every part shares are in `rules`.

    Action, Schedule          an action ("0F3": stage 0, forward, microbatch 3); the schedule type
    gpipe                     all forwards, then all backwards
    one_f_one_b               1F1B (PipeDream-flush)
    interleaved               Megatron's interleaved 1F1B, `virtual_stages` chunks per rank
    zero_bubble               ZB-H1: backward split into B and W, W delayed
    shifted_critical_path     Merak: early recompute, shifted stage S-2
    nf1b                      nnScaler's nF1B: `forwards` sweeps, the last one trained
    NAMES, resolve            a name, callable, text, CSV or dict -> a validated schedule
    add_communication         insert SF/RF/SB/RB
    send_releases             per rank, after which receive each send has arrived
    validate, grid            check a schedule; print it as a marked grid
    simulate, Costs           time a schedule -> Timeline (events, bubble, peak activations)
    Timeline, Event           what simulate returns
    Timer, held               a schedule compiled for repeated timing (the search); the
                              activations each stage holds at its rank's peak
    awaiting_weights          per stage, the most microbatches between their B and W
    most_between              per stage, the most microbatches between two action kinds
    sent_at_peak              per stage, the boundary outputs and input gradients it keeps
                              at its rank's peak (in flight, or sent and not yet arrived)
    at_peak                   held and sent_at_peak in one walk
    peak_walk                 at_peak as a function of the stages' weights
    plot                      draw a Timeline (needs matplotlib: pip install 'pxform[plot]')
    to_text, from_text        "rank 0: 0F0 0F1 - 0B0" lines
    to_csv, from_csv          one CSV row per rank

Example:
    >>> from pxform import schedules
    >>> s = schedules.one_f_one_b(stages=4, microbatches=8)
    >>> schedules.validate(schedules.add_communication(s))
    >>> t = schedules.simulate(s, schedules.Costs(forward=1.0, backward=2.0))
    >>> round(t.bubble_fraction, 3), t.peak_activations[0]
    (0.273, 4)
"""

from pxform.schedules.actions import COMM_KINDS, COMPUTE_KINDS, Action, Schedule
from pxform.schedules.communication import add_communication, send_releases
from pxform.schedules.gpipe import gpipe
from pxform.schedules.interleaved import interleaved
from pxform.schedules.multi_forward import nf1b
from pxform.schedules.one_f_one_b import one_f_one_b
from pxform.schedules.plot import plot
from pxform.schedules.resolve import NAMES, resolve
from pxform.schedules.shifted_critical_path import shifted_critical_path
from pxform.schedules.simulate import Costs, Event, Timeline, simulate
from pxform.schedules.text import from_csv, from_text, to_csv, to_text
from pxform.schedules.timing import (
    Timer,
    at_peak,
    awaiting_weights,
    expected_later,
    held,
    most_between,
    peak_walk,
    sent_at_peak,
)
from pxform.schedules.validate import grid, validate
from pxform.schedules.zero_bubble import zero_bubble

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "NAMES",
    "Action",
    "Costs",
    "Event",
    "Schedule",
    "Timeline",
    "Timer",
    "at_peak",
    "add_communication",
    "awaiting_weights",
    "expected_later",
    "from_csv",
    "from_text",
    "gpipe",
    "grid",
    "held",
    "interleaved",
    "most_between",
    "peak_walk",
    "send_releases",
    "sent_at_peak",
    "nf1b",
    "one_f_one_b",
    "plot",
    "resolve",
    "shifted_critical_path",
    "simulate",
    "to_csv",
    "to_text",
    "validate",
    "zero_bubble",
]
