"""What one search knows and remembers: the pinned choices (`Pin`), the inputs, and every
cache (`SearchContext`), and the option tables blocks choose from (`OptionTable`).

Caches are typed and keyed by values: block kinds, configurations, option roles, and
`OptionTable.key`, which names an option list by its contents (equal lists get equal
keys), never by object identity.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pxform.core.errors import PxformError
from pxform.core.mesh import AbstractMesh
from pxform.cost.model import CostModel, peak_bytes, workspace_bytes
from pxform.ops.registry import rule_info
from pxform.ops.strategy import Strategy, build_strategy
from pxform.search.analysis import Analysis, BlockInfo
from pxform.search.blockcost import RelayoutCache, WalkCost, tensor_strategies
from pxform.search.frontier import Point
from pxform.search.pipelines import ScheduleChoice
from pxform.search.space import INNER, OUTER, Config, Option

Roles = tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Pin:
    """Choices fixed before the search: by the user's transforms (stage boundaries,
    recompute regions) or a plan passed back to `auto` (all of it, or some fields)."""

    stages: int | None = None
    outer: int | None = None
    inner: int | None = None
    microbatches: int | None = None
    block_options: tuple[Option | None, ...] | None = None  # per block, None: free
    block_stage: tuple[int, ...] | None = None
    # kind -> per op choice (`tensor_choice_key`: -kind - 1 for sequence parallelism)
    tensor_choices: Mapping[int, tuple[tuple, ...]] | None = None
    schedule: ScheduleChoice | None = None  # the pipeline schedule (`search.pipelines`)
    sequence_parallel: bool | None = None  # None: offered; False: never (`Option`)



@dataclass(frozen=True)
class OptionCost:
    forward: float      # per microbatch
    backward: float     # per microbatch, with per-microbatch gradient reductions overlapped
    step_extra: float   # per step: data-parallel gradient all-reduce beyond what overlaps
    saved: float
    kept: float
    params: float       # parameters, their gradients and optimizer state
    grads: float        # of which the gradients
    transient: float    # the largest op's inputs and outputs (`WalkCost.transient_bytes`)
    packed: float = 0.0  # gradients all-reduced from a packed bucket (`WalkCost.packed_bytes`)
    redo: float | None = None  # its backward's peak when recomputed (`WalkCost.redo_bytes`)
    packed_outer: float = 0.0  # ring volume of those over the outer axis, per step
    packed_inner: float = 0.0  # and over the inner (`SearchContext.packed_rate`)
    weight: float = 0.0  # of `backward`, the weight gradients (a zero-bubble W action)
    weight_out: float = 0.0  # gradients zero-bubble's B keeps for its W, per microbatch
    weight_ops: int = 0  # ops with a weight gradient: a W asks autograd for each apart
    weight_held: float = 0.0  # outputs of those ops no op saves: zero-bubble keeps them
                              # from F to W, per microbatch held (`WalkCost`)
    largest_grad: float = 0.0  # its largest parameter's gradient (`WalkCost`)
    freed: float = 0.0  # of `transient`, what a backward that frees its graph as it goes
                        # has freed by then (`WalkCost.freed_bytes`; not zero-bubble's B)
    redo_first: float | None = None  # `redo` in the first microbatch's backward
                                     # (`WalkCost.redo_first_bytes`)

    def step_time(self, m: int) -> float:
        return m * (self.forward + self.backward) + self.step_extra

    def memory(self, in_flight: int, recompute: bool, microbatches: int) -> float:
        """The block's bytes at its stage's peak, without the workspace
        (`pxform.cost.model.peak_bytes`)."""
        act = self.kept if recompute else self.saved
        return peak_bytes(self.params - self.grads, self.grads, act, in_flight, microbatches)

    def split_memory(self, in_flight: int, waits: int) -> float:
        """The bytes a zero-bubble stage's split backward adds to the block (`waits` > 0:
        it has W actions): its weight ops' output gradients for the `waits` microbatches
        between their B and W, and those outputs no op saves for the `in_flight`
        microbatches whose graphs it keeps to their W (`pxform.runtime.pipeline`)."""
        if not waits:
            return 0.0
        return waits * self.weight_out + in_flight * self.weight_held

    def workspace(self, recompute: bool, frees: bool = True, first: bool = False) -> float:
        """Bytes alive only while this block's backward runs
        (`pxform.cost.model.workspace_bytes`); `frees`: its backward frees the graph as
        it goes (False for zero-bubble's B, which keeps it for W); `first`: in the first
        microbatch's backward, where a recompute also holds the gradients of the block's
        parameters made so far (`redo_first`)."""
        transient = self.transient - (self.freed if frees else 0.0)
        redo = self.redo_first if first and self.redo_first is not None else self.redo
        return workspace_bytes(transient, self.saved, recompute, redo)



@dataclass(frozen=True, eq=False)
class OptionTable:
    """The options one block may take on a configuration, and their costs. `key` names
    the option list by value (`SearchContext.table_key`): blocks of one kind with the same
    allowed options share a key, and caches of stage frontiers key on it."""

    key: int
    options: tuple[Option, ...]
    costs: tuple[OptionCost, ...]


@dataclass(frozen=True)
class BlockLayouts:
    """A block kind's layouts under one option: its ops' strategies, and where the values
    it reads (from outside, parameters) and hands on are laid out."""

    strategies: list[Strategy]
    outside: dict[str, Any]
    params: dict[str, Any]
    outputs: dict[str, Any]


# (kind, outer, inner, roles, scale): a block kind's walk at a microbatch scale
WalkKey = tuple[int, int, int, Roles, float]
# (configuration, per block (kind, table key), in flight, borrowed bytes, microbatches
# awaiting W, bytes its transfers and a whole-stage recompute keep, bytes they add while
# a backward runs (`stages.transfer_bytes`)): a stage
StageKey = tuple[Config, tuple[tuple[int, int], ...], int, float, int, float, float]
StagePoint = tuple[Point, float, float]
"""A stage's frontier point, the stage's peak bytes with it (workspace and borrowed
parameters included), and the workspace alone (`stages.stage_frontier`)."""


@dataclass
class SearchContext:
    """Inputs and caches of one search (module doc)."""

    analysis: Analysis
    model: CostModel
    budget: float
    global_batch: int
    pin: Pin = field(default_factory=Pin)
    tensor: dict[tuple[int, int, int, bool], tuple[Strategy, ...]] = field(
        default_factory=dict)
    walks: dict[WalkKey, WalkCost] = field(default_factory=dict)
    # walked at the scales `walk_cost` interpolates between (1, 1/2, 1/8, 1/32, ...)
    measured_walks: dict[WalkKey, WalkCost] = field(default_factory=dict)
    block_layouts: dict[tuple[int, int, int, Roles], BlockLayouts] = field(
        default_factory=dict)
    relayouts: dict[tuple[AbstractMesh, tuple[Any, ...]], RelayoutCache] = field(
        default_factory=dict)
    # (kind, outer, inner, (data axes, sequence parallel) on each side, microbatch size)
    transitions: dict[tuple[int, int, int, tuple[tuple[str, ...], bool],
                            tuple[tuple[str, ...], bool], int], float] = \
        field(default_factory=dict)
    matrices: dict[tuple[int, Config, int, int], np.ndarray] = field(default_factory=dict)
    borrowed: dict[tuple[int, ...], tuple[tuple[int, float], ...]] = field(
        default_factory=dict)
    p2p: dict[tuple[Config, int], float] = field(default_factory=dict)
    packed_rates: dict[tuple[Config, str], float] = field(default_factory=dict)
    tables: dict[Config, list[OptionTable] | None] = field(default_factory=dict)
    groups: dict[Config, list[list[OptionTable]]] = field(default_factory=dict)
    frontiers: dict[StageKey, list[StagePoint]] = field(default_factory=dict)
    stage_sums: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # `stages._stage_sums`
    boundaries: dict[tuple[Config, int, bool], float] = field(default_factory=dict)
    batch_reads: dict[int, frozenset[str]] = field(default_factory=dict)  # per block
    table_keys: dict[tuple[Option, ...], int] = field(default_factory=dict)
    # (kind, scale, devices) -> a block's compute at its largest split (`bounds.quick_bound`)
    compute: dict[tuple[int, float, int], float] = field(default_factory=dict)
    # per configuration, each schedule's best step time (inf: nothing fits; None: its
    # bound could not beat the best so far, so it was not assembled)
    schedules: dict[Config, dict[ScheduleChoice, float | None]] = field(default_factory=dict)

    @property
    def hardware(self) -> Any:
        return self.model.hardware

    def axes(self, config: Config) -> dict[str, tuple[int, int]]:
        """Mesh axis -> (size, link level) of the stage mesh."""
        hw = self.hardware
        return {OUTER: (config.outer, hw.level(config.outer * config.inner)),
                INNER: (config.inner, hw.level(config.inner))}

    @functools.cached_property
    def param_bytes(self) -> float:
        """Bytes of every parameter the step trains, whole: what its gradients'
        all-reduce carries (a frozen one has none)."""
        vals = self.analysis.values()
        return float(sum(vals[p].type.nbytes for p in self.analysis.trainable))

    def packed_rate(self, config: Config, axis: str) -> float:
        """Seconds per byte sent of the step's packed gradient all-reduce over `axis`
        (`CostModel.bucketed_all_reduce`), at the bytes of every parameter replicated
        over one stage: what a block's all-reduced gradients add to the step, as a share
        of the whole (the last bucket's and latencies included)."""
        key = (config, axis)
        rate = self.packed_rates.get(key)
        if rate is None:
            axes = self.axes(config)
            n = axes[axis][0]
            if n <= 1:
                rate = 0.0
            else:
                whole = self.param_bytes
                sent = max(1.0, whole / config.stages * 2 * (n - 1) / n)
                rate = self.model.bucketed_all_reduce(sent, axis, axes) / sent
            self.packed_rates[key] = rate
        return rate

    def cache(self, config: Config) -> RelayoutCache:
        mesh = config.stage_mesh
        return self.relayout_cache(mesh, {a: v for a, v in self.axes(config).items()
                                          if a in mesh.names})

    def relayout_cache(self, mesh: AbstractMesh, axes: dict[str, tuple[int, int]]
                       ) -> RelayoutCache:
        """The re-layouts on `mesh` with `axes` (size, link level), one cache per pair:
        shared by every configuration, block kind and beam search on that mesh."""
        key = mesh, tuple(sorted(axes.items()))
        if key not in self.relayouts:
            self.relayouts[key] = RelayoutCache(self.model, axes, mesh)
        return self.relayouts[key]

    def tensor_picks(self, kind: int, config: Config, sequence_parallel: bool = False
                     ) -> tuple[Strategy, ...]:
        """The tensor-axis strategy of each op of blocks of `kind` (with sequence
        parallelism between blocks, or not: `Option.sequence_parallel`)."""
        a = self.analysis
        key_of = tensor_choice_key(kind, sequence_parallel)
        if self.pin.tensor_choices is not None and key_of in self.pin.tensor_choices:
            return _from_choices(a, first_block(a, kind), self.pin.tensor_choices[key_of],
                                 config.inner)
        level = self.hardware.level(config.inner)
        key = (kind, config.inner, level, sequence_parallel)
        if key not in self.tensor:
            block = first_block(a, kind)
            cache = self.relayout_cache(AbstractMesh({INNER: config.inner}),
                                        {INNER: (config.inner, level)})
            self.tensor[key] = tensor_strategies(a, block, INNER, config.inner, level,
                                                 self.model, 1.0, sequence_parallel, cache)
        return self.tensor[key]

    def table_key(self, options: tuple[Option, ...]) -> int:
        """A small number naming this option list by value."""
        return self.table_keys.setdefault(options, len(self.table_keys))



def tensor_choice_key(kind: int, sequence_parallel: bool) -> int:
    """Where a plan keeps a block kind's tensor-axis choices (`Plan.tensor_choices`):
    under the kind, or, with sequence parallelism, under `-kind - 1`.

    Example:
        >>> tensor_choice_key(3, False), tensor_choice_key(3, True)
        (3, -4)
    """
    return -kind - 1 if sequence_parallel else kind


def first_block(a: Analysis, kind: int) -> BlockInfo:
    """The representative block of `kind`: its first (blocks of a kind have the same ops
    at the same offsets)."""
    return next(b for b in a.blocks if b.kind == kind)



def _from_choices(a: Analysis, block: BlockInfo, choices: Sequence[tuple], size: int
                  ) -> tuple[Strategy, ...]:
    mesh = AbstractMesh({INNER: size})
    out = []
    for k, choice in zip(range(block.start, block.stop), choices):
        if choice[0] == "partial":
            choice = ("partial", frozenset(choice[1]))
        s = build_strategy(rule_info(a.graph.ops[k]).signature, mesh, (choice,))
        if s is None:
            raise PxformError(f"pxform.auto: the pinned plan's tensor choice {choice} for op "
                              f"{a.graph.ops[k]} does not fit an inner axis of size {size}.")
        out.append(s)
    return tuple(out)

