"""The pipeline schedules the search chooses between, and how each is priced.

For a pipeline of `p` ranks and `m` microbatches the search tries:

    1f1b          one stage per rank
    zb            ZB-H1: the same stages, the weight gradients split off into W actions
                  (`OptionCost.weight`) that fill the drain
    interleaved   `v = 2` chunks per rank (`2p` stages, stage s on rank s % p): the warm-up
                  and drain shrink about v times, for twice the actions and transfers
    shifted       Merak's shifted critical path with stage-aware recompute: every stage
                  but the last recomputes itself whole (an early R action before each B),
                  so it keeps only its inputs per microbatch in flight and one
                  microbatch's activations; the last stage keeps its activations, and
                  stage p-2 runs one forward more before its first backward

Each is timed by the schedule simulator's own rules (`pxform.schedules.Timer`, compiled
once per schedule shape), and holds activations as the executor does
(`pxform.schedules.held`): zero-bubble keeps a microbatch's graph from its F until its W,
so its stages hold up to `p` microbatches where 1F1B's stage s holds `p - s`, and stage s
keeps the output gradients of its weight ops for up to `s + 1` microbatches between their B
and W (`awaiting`, `OptionCost.weight_out`); interleaved
ranks hold more microbatches of smaller chunks; a stage that recomputes itself (shifted)
holds one microbatch's activations and its inputs for those in flight (`inputs_held`).
The memory model reads those counts, so the search trades the smaller bubble against the
memory it costs.

Schedules with more than `TIMED_UP_TO` (stage, microbatch) pairs are priced by closed
forms that equal the simulation when stages are equal (module functions below), so a
1,024-GPU search does not simulate 100,000 actions per candidate. A stage the shifted
schedule recomputes whole takes only its blocks' options without recompute (recomputing a
block inside a recomputed stage would run it three times).

Example:
    >>> [c.text() for c in choices(Config(2, 1, 1, 4), num_blocks=8)]
    ['1f1b', 'zb', 'interleaved(virtual_stages=2)', 'shifted']
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pxform.cost.model import one_f_one_b_in_flight, one_f_one_b_time
from pxform.schedules import NAMES as GENERATORS
from pxform.schedules import Schedule, Timer, awaiting_weights, most_between, peak_walk
from pxform.search.plan import schedule_text
from pxform.search.space import Config

NAMES = ("1f1b", "zb", "interleaved", "shifted")
"""The schedules the search chooses between (`pxform.schedules.NAMES` has all that run)."""

COUNTED = ("1f1b", "zb", "shifted")
"""Schedules whose per-stage counts (`in_flight`, `awaiting`, `inputs_held`, `sent`) are
taken from closed forms at every size (interleaved's spread a rank's count evenly over
its chunks: those are walked while the schedule is timed)."""

TIMED_UP_TO = 2048
"""Schedules with at most this many (stage, microbatch) pairs, virtual stages counted, are
timed by the simulator's rules; bigger ones by closed forms (module doc)."""


@dataclass(frozen=True)
class ScheduleChoice:
    """A pipeline schedule by name, with its chunks per rank (`virtual_stages`, >1 only
    for interleaved)."""

    name: str = "1f1b"
    virtual_stages: int = 1

    def text(self) -> str:
        return schedule_text(self.name, self.virtual_stages)

    @property
    def options(self) -> tuple[tuple[str, Any], ...]:
        """What `pxform.pipeline` takes besides the name (`virtual_stages=`)."""
        return (("virtual_stages", self.virtual_stages),) if self.virtual_stages > 1 else ()

    @property
    def split(self) -> bool:
        """Whether the backward splits into B and W."""
        return self.name == "zb"

    def num_stages(self, ranks: int) -> int:
        return ranks * self.virtual_stages

    def recomputes(self, stage: int, ranks: int) -> bool:
        """Whether `stage` recomputes its whole forward before each backward (R actions:
        the shifted schedule's stages but the last)."""
        return self.name == "shifted" and stage < ranks - 1


ONE_F_ONE_B = ScheduleChoice()


def choices(config: Config, num_blocks: int, pinned: ScheduleChoice | None = None
            ) -> tuple[ScheduleChoice, ...]:
    """The schedules to price for `config` (1F1B alone without a pipeline); `pinned`, the
    one the user fixed. Interleaving needs two blocks per rank at least."""
    if config.stages == 1:
        return (ONE_F_ONE_B,)
    if pinned is not None:
        return (pinned,)
    out = [ONE_F_ONE_B, ScheduleChoice("zb")]
    if 2 * config.stages <= num_blocks:
        out.append(ScheduleChoice("interleaved", 2))
    out.append(ScheduleChoice("shifted"))
    return tuple(out)


def _timed_up_to(choice: ScheduleChoice, p: int, m: int) -> bool:
    return p * m * choice.virtual_stages <= TIMED_UP_TO


def _schedule(choice: ScheduleChoice, p: int, m: int) -> Schedule:
    # the generator's schedule, not `resolve`'s validated one: the generators are tested
    # valid for every size (tests/test_schedules.py), validating each size the search
    # prices took a sixth of its time on GPT-3 175B, and the Timer still refuses a deadlock
    return GENERATORS[choice.name](p, m, **dict(choice.options))


@functools.lru_cache(maxsize=256)
def _timer(choice: ScheduleChoice, p: int, m: int) -> Timer | None:
    """The schedule compiled for timing (None past `TIMED_UP_TO`: closed forms), made
    when a plan is first priced under it: many schedules the search counts for memory
    never get a plan that fits."""
    return Timer(_schedule(choice, p, m)) if _timed_up_to(choice, p, m) else None


@functools.lru_cache(maxsize=256)
def _counts(choice: ScheduleChoice, p: int, m: int,
            weights: tuple[float, ...] | None = None
            ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...],
                       tuple[tuple[int, int], ...]]:
    """(`in_flight`, `awaiting`, `inputs_held`, `sent`); `weights` as `in_flight`'s."""
    if choice.name in COUNTED or not _timed_up_to(choice, p, m):
        # the counts do not depend on the costs: their closed forms, equal to the walk of
        # the schedule with its transfers for these schedules (tests/test_search.py),
        # which took a fifth of a first search of GPT-3 175B
        waits = tuple(min(s + 1, m) for s in range(p)) if choice.split else \
            (0,) * choice.num_stages(p)
        flights = _held_closed(choice, p, m)
        return (flights, waits, _inputs_closed(choice, p, m),
                _sent_closed(choice, p, m, flights))
    schedule, walk = _walked(choice, p, m)
    # a recomputed stage keeps a microbatch's inputs from its F to its B
    inputs = tuple(n if choice.recomputes(s, p) else 0
                   for s, n in enumerate(most_between(schedule, "F", "B")))
    peak = walk(weights)
    return (tuple(h for h, _, _ in peak), awaiting_weights(schedule), inputs,
            tuple((f, b) for _, f, b in peak))


@functools.lru_cache(maxsize=16)
def _walked(choice: ScheduleChoice, p: int, m: int) -> tuple[Schedule, Any]:
    """The schedule and its peak walk (`pxform.schedules.peak_walk`), once per size: an
    interleaved pipeline's counts are asked at several stage weights (each microbatch
    count and stage cut weighs its stages apart), and the walk's transfers were two
    thirds of each (0.1 s of the 0.5 s search of HF BERT-large on 8 devices, which
    pipelines since the forty-seventh session)."""
    schedule = _schedule(choice, p, m)
    return schedule, peak_walk(schedule)


def _clear_caches() -> None:
    """Forget every compiled schedule (tests that change `TIMED_UP_TO`)."""
    for cached in (_timer, _counts, _timed, _walked):
        cached.cache_clear()


def in_flight(choice: ScheduleChoice, p: int, m: int,
              weights: tuple[float, ...] | None = None) -> tuple[int, ...]:
    """Per stage (virtual stages counted): the microbatches whose activations it holds at
    its rank's peak (`pxform.schedules.held`). `weights`, per stage: one microbatch's
    activation bytes there, where a rank runs several stages (interleaved): its peak is
    where their weighted sum is largest (`pxform.schedules.at_peak`; the closed forms
    past `TIMED_UP_TO` count every stage alike).

    Example:
        >>> in_flight(ScheduleChoice("zb"), 4, 8)
        (4, 4, 4, 4)
        >>> chunks = ScheduleChoice("interleaved", 2)
        >>> in_flight(chunks, 2, 8), in_flight(chunks, 2, 8, (1.0, 1.0, 1.0, 0.1))
        ((4, 2, 1, 1), (4, 3, 1, 0))
    """
    return _counts(choice, p, m, weights)[0]


def awaiting(choice: ScheduleChoice, p: int, m: int) -> tuple[int, ...]:
    """Per stage: the most microbatches between their B and their W, whose weight-op
    output gradients the executor keeps (`pxform.schedules.awaiting_weights`; 0 without
    W actions).

    Example:
        >>> awaiting(ScheduleChoice("zb"), 4, 8), awaiting(ONE_F_ONE_B, 2, 4)
        ((1, 2, 3, 4), (0, 0))
    """
    return _counts(choice, p, m)[1]


def inputs_held(choice: ScheduleChoice, p: int, m: int) -> tuple[int, ...]:
    """Per stage: the most microbatches whose stage inputs it keeps for a recompute to
    come (0 for a stage that keeps its activations instead; `in_flight` counts those).

    Example:
        >>> inputs_held(ScheduleChoice("shifted"), 4, 8), in_flight(ScheduleChoice("shifted"), 4, 8)
        ((4, 3, 3, 0), (1, 1, 1, 1))
    """
    return _counts(choice, p, m)[2]


def sent(choice: ScheduleChoice, p: int, m: int,
         weights: tuple[float, ...] | None = None) -> tuple[tuple[int, int], ...]:
    """Per stage (virtual stages counted): how many microbatches' boundary outputs and
    boundary input gradients it keeps at its rank's peak (`pxform.schedules.
    sent_at_peak`): the outputs of those in flight, and what it sent that is not yet
    known to have arrived (the executor waits for a send after the receive that shows
    it arrived, `pxform.schedules.send_releases`).

    Example:
        >>> sent(ONE_F_ONE_B, 2, 8), sent(ScheduleChoice("zb"), 2, 8)
        (((2, 0), (1, 1)), ((2, 0), (2, 2)))
    """
    return _counts(choice, p, m, weights)[3]


def _sent_closed(choice: ScheduleChoice, p: int, m: int, flights: Sequence[int]
                 ) -> tuple[tuple[int, int], ...]:
    # (the simulation for equal sizes: tests/test_search.py) the boundary outputs of the
    # microbatches in flight, and one input gradient still sending; the shifted schedule's
    # first stage keeps its early forwards' outputs, and its later stages send gradients
    # that no receive from the stage before shows arrived
    if choice.name == "shifted":
        return tuple((min(max(p, 3), m), 0) if s == 0 else (1, min(max(p - s, 2), m - 1))
                     for s in range(p))
    # (zero-bubble's later stages send their last two B's input gradients with both
    # graphs still held for their W: `schedules.at_peak`)
    grads = 2 if choice.virtual_stages > 1 else min(2, m) if choice.split else 1
    return tuple((f, 0 if s == 0 else grads) for s, f in enumerate(flights))


def _inputs_closed(choice: ScheduleChoice, p: int, m: int) -> tuple[int, ...]:
    # 1F1B's p - s in flight, one more on stage p-2 (its extra forward before the first B)
    return tuple(min(p - s + (s == p - 2), m) if choice.recomputes(s, p) else 0
                 for s in range(choice.num_stages(p)))


def _held_closed(choice: ScheduleChoice, p: int, m: int) -> tuple[int, ...]:
    if choice.name == "zb":  # every rank keeps p graphs: p - r to its B, r more to its W
        return (min(p, m),) * p
    if choice.name == "shifted":  # one recomputed microbatch; the last stage's B is at once
        return (1,) * p
    if choice.name == "interleaved":
        # rank r warms up with 2(p - r - 1) + (v - 1)p forwards (Megatron's count) and
        # peaks one forward later; its chunks share that evenly
        v = choice.virtual_stages
        per_rank = [min(2 * (p - r - 1) + (v - 1) * p + 1, m * v) for r in range(p)]
        return tuple(math.ceil(per_rank[s % p] / v) for s in range(p * v))
    return tuple(one_f_one_b_in_flight(p, m))


def step_time(choice: ScheduleChoice, p: int, m: int, forward: Sequence[float],
              backward: Sequence[float], weight: Sequence[float],
              recompute: Sequence[float] | None = None,
              forward_sync: Sequence[float] | None = None,
              backward_sync: Sequence[float] | None = None,
              p2p: Sequence[float] | None = None) -> float:
    """Seconds per step: per stage (virtual stages counted), `forward` and `backward` per
    microbatch (the backward whole), `weight` its weight-gradient part (zero-bubble's W),
    `recompute` an early recompute (the shifted schedule's R; default: `forward`),
    `forward_sync` and `backward_sync` what an F or a B waits more when its input arrives
    just as its rank is ready (`Hardware.sync_wait`; default 0), `p2p` what a transfer from
    the stage to another rank adds to the wait of the action that needs it
    (`Hardware.transfer_overhead_s`; default 0). The schedule's `Timer` charges those only
    where an action waits for another rank (`pxform.schedules.expected_later`); the
    closed forms (past `TIMED_UP_TO`) add them to every F and B.

    Example:
        >>> step_time(ScheduleChoice("zb"), 4, 8, [1.0] * 4, [2.0] * 4, [1.0] * 4)
        27.0
    """
    redo = tuple(forward if recompute is None else recompute)
    zero = (0.0,) * len(forward)
    fs = zero if forward_sync is None else tuple(forward_sync)
    bs = zero if backward_sync is None else tuple(backward_sync)
    sends = zero if p2p is None else tuple(p2p)
    timer = _timer(choice, p, m)
    if timer is not None:
        return _timed(choice, p, m, tuple(forward), tuple(backward), tuple(weight), redo,
                      fs, bs, sends)
    # (a stage's input comes from the stage before it, its output gradient from the one
    # after it)
    into = (0.0, *sends[:-1])
    back = (*sends[1:], 0.0)
    forward = [f + x + t for f, x, t in zip(forward, fs, into)]
    backward = [b + x + t for b, x, t in zip(backward, bs, back)]
    per = [f + b for f, b in zip(forward, backward)]
    if choice.name == "zb":
        # m x the slowest stage, and a warm-up/drain of (F + B - W) per further stage
        # (uniform: the ZB-H1 paper's (p - 1)(F + B - W) idle time)
        drain = [x - 2 * w for x, w in zip(per, weight)]
        return m * max(per) + (p - 1) * max(0.0, sum(drain) / p)
    if choice.virtual_stages > 1:
        v = choice.virtual_stages
        ranks = [sum(per[r::p]) for r in range(p)]
        # uniform chunks c: (m v + p - 1) c, the idle share (p - 1) / (v m + p - 1)
        return m * max(ranks) + (p - 1) * sum(per) / (p * v)
    if choice.name == "shifted":
        # m x the slowest stage, its recompute counted, and Merak's (p - 2)(F + B) idle
        # time; a backward longer than two forwards waits that much more (the simulation
        # with equal stages: tests/test_search.py)
        busy = [x + (r if choice.recomputes(s, p) else 0.0)
                for s, (x, r) in enumerate(zip(per, redo))]
        f_mean, b_mean = sum(forward) / p, sum(backward) / p
        return m * max(busy) + max(p - 2, 0) * sum(per) / p + max(0.0, b_mean - 2 * f_mean)
    return one_f_one_b_time(forward, backward, m)


@functools.lru_cache(maxsize=4096)
def _timed(choice: ScheduleChoice, p: int, m: int, forward: tuple[float, ...],
           backward: tuple[float, ...], weight: tuple[float, ...],
           recompute: tuple[float, ...], forward_sync: tuple[float, ...],
           backward_sync: tuple[float, ...], p2p: tuple[float, ...]) -> float:
    """`step_time` by the schedule's `Timer`, once per costs: the search prices the same
    stages again at several memory levels of the frontier."""
    timer = _timer(choice, p, m)
    assert timer is not None
    if choice.split:
        return timer.step_time(forward, [b - w for b, w in zip(backward, weight)], weight,
                               recompute, p2p=p2p, forward_sync=forward_sync,
                               backward_sync=backward_sync)
    return timer.step_time(forward, backward, recompute=recompute, p2p=p2p,
                           forward_sync=forward_sync, backward_sync=backward_sync)


def bubble_bound(choice: ScheduleChoice, p: int, m: int, weight_share: float) -> float:
    """The step over the work spread evenly over the ranks, for equal stages: 1F1B's
    `(m + p - 1) / m`; ZB-H1's `1 + (p - 1)(1 - 2 s) / m` with `s` the weight gradients'
    share of a stage's work (`weight_share`); interleaved's `1 + (p - 1) / (v m)`; the
    shifted schedule's `1 + (p - 2) / (2 m)` over its work with the recompute (its idle
    time `(p - 2)(F + B)` is at least half of `p - 2` stages' `F + R + B` as R = F)
    (`bounds.lower_bound` uses it: no plan of the schedule beats it by much).

    Example:
        >>> bubble_bound(ONE_F_ONE_B, 4, 4, 0.0), bubble_bound(ScheduleChoice("zb"), 4, 4, 1/3)
        (1.75, 1.25)
    """
    if p == 1:
        return 1.0
    if choice.split:
        return 1.0 + (p - 1) * max(0.0, 1.0 - 2.0 * weight_share) / m
    if choice.name == "shifted":
        return 1.0 + max(p - 2, 0) / (2 * m)
    return 1.0 + (p - 1) / (choice.virtual_stages * m)
