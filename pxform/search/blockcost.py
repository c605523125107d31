"""Op-level strategies of a block under given axis roles, and what they cost.

A block's strategy gives each mesh axis of its stage a *role*:

- `dp` (data): the batch is split over the axis, parameters are replicated;
- `sdp` (sharded data, ZeRO-3): the batch is split, parameters are stored split over the
  axis and gathered for use (the lowering's conversion rule gives the all-gather and the
  gradient reduce-scatter);
- `tp` (tensor): ops are split inside; which dims, per op, is found here.

On a data axis every op takes the strategy the data-parallel reference propagation gave it
(`Analysis.data_strategies`). On the tensor axis a small beam search over the block's ops,
in program order, picks per op one of its rule's strategies that does not split the batch:
inputs from earlier blocks arrive whole (replicated over the tensor axis) and the block's
outputs leave whole; a parameter is stored as its first reader needs it; the cost of a
state is its compute time (split ops do 1/n of the work) plus the forward and backward
re-layout time; states with fewer weight matrices left replicated come first (the tensor
role is there to split them).
Megatron's pattern, a column-split linear feeding a row-split one and one all-reduce,
comes out of this search; it is not written anywhere.

`walk` costs a block under full per-op strategies on the stage mesh: per microbatch
forward and backward compute, activation re-layouts (on the critical path), parameter-
gradient re-layouts (overlapped with backward), bytes saved for backward, and parameter
bytes per device. Conversions are counted once per value and layout, as the lowering
emits them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from pxform.core.ir import Value, block_name
from pxform.core.layout import Layout, Relayout, plan_relayout
from pxform.core.mesh import AbstractMesh
from pxform.cost.model import (
    BACKWARD_RATIO,
    GRAD_PASSTHROUGH,
    CostModel,
    relayout_copies_storage,
    relayout_steps,
)
from pxform.ops.strategy import REPLICATE, Strategy, strategies, strategy_for
from pxform.passes.propagate import consumer_gradient_layout, gradient_layout
from pxform.search.analysis import DATA, Analysis, BlockInfo, group_bytes
from pxform.search.plan import TENSOR_ROLES

BEAM_WIDTH = 8
"""States kept per op by the tensor-axis beam search (a transformer layer's Megatron
pattern is found with 4; more costs time for nothing on the models tested)."""

ROLES = ("dp", "sdp", "tp", "sp")

RELAYOUT_GAP_S = 2.5e-4
"""Compute between two conversions' collectives below which they count as one run
(`Hardware.relayout_overhead_s`): a sequence-parallel GPT block's all-to-alls follow its
all-gathers after 0.05-0.09 ms of views, and in a step they cost 0.5 ms beyond the comm
table against 1-1.3 ms for the collectives after a matmul or a norm."""


@dataclass
class RelayoutCache:
    """`plan_relayout` results per (shape, itemsize, src, dst, mesh): the same few
    re-layouts recur in every block."""

    model: CostModel
    axes: Mapping[str, tuple[int, int]]  # axis -> (size, link level)
    mesh: AbstractMesh
    _cache: dict = field(default_factory=dict)
    _times: dict = field(default_factory=dict)  # (..., scale) -> seconds
    _own: dict = field(default_factory=dict)  # (...) -> `copies_storage`

    def relayout(self, v: Value, src: Layout, dst: Layout) -> Relayout:
        key = (v.type.shape, v.type.dtype.itemsize, src, dst)
        r = self._cache.get(key)
        if r is None:
            costs = {a: self.model.hardware.axis_cost(level)
                     for a, (_, level) in self.axes.items()}
            r = plan_relayout(v.type.shape, v.type.dtype.itemsize, src, dst, self.mesh, costs)
            self._cache[key] = r
        return r

    def time(self, v: Value, src: Layout, dst: Layout, scale: float) -> float:
        if src == dst:
            return 0.0
        key = (v.type.shape, v.type.dtype.itemsize, src, dst, scale)
        t = self._times.get(key)
        if t is None:
            r = self.relayout(v, src, dst)
            # the transfers, and the runtime's copies around them (`relayout_copies`)
            t = self._times[key] = (
                self.model.relayout_time(r, self.axes, scale)
                + self.model.copies_time(r, src.local_shape(v.type.shape, self.mesh),
                                         v.type.dtype, self.axes, scale))
        return t

    def steps(self, v: Value, src: Layout, dst: Layout) -> list[tuple[str, str, float]]:
        return [] if src == dst else relayout_steps(self.relayout(v, src, dst))

    def copies_storage(self, v: Value, src: Layout, dst: Layout) -> bool:
        """Does re-laying `v` out from `src` to `dst` give a tensor of its own
        (`relayout_copies_storage`)?"""
        if src == dst:
            return False
        key = (v.type.shape, v.type.dtype.itemsize, src, dst)
        own = self._own.get(key)
        if own is None:
            own = self._own[key] = relayout_copies_storage(
                self.relayout(v, src, dst), src.local_shape(v.type.shape, self.mesh),
                {a: n for a, (n, _) in self.axes.items()})
        return bool(own)

    def collectives(self, v: Value, src: Layout, dst: Layout) -> int:
        """How many collectives re-laying `v` out from `src` to `dst` runs (steps over an
        axis of more than one device that are not local)."""
        return sum(self.axes[axis][0] > 1 for _, axis, _ in self.steps(v, src, dst))


@dataclass(frozen=True)
class WalkCost:
    """One block, one microbatch, per device (times in seconds, bytes)."""

    fwd_compute: float
    fwd_comm: float
    bwd_comm: float       # activation gradients: on the critical path
    grad_comm: float      # parameter gradients: overlapped with backward
    saved_bytes: float    # saved for backward by the block's ops
    kept_bytes: float     # what a recomputed block keeps: its inputs from earlier blocks
    param_bytes: float    # local bytes (+ gradients and optimizer state) of the
                          # parameters the block holds
    grad_bytes: float     # of which their gradients
    transient_bytes: float  # the block's largest op's inputs and outputs: about what its
                            # backward holds at once (output and input gradients)
    packed_bytes: float = 0.0  # parameter gradients all-reduced from a packed bucket
    packed_outer: float = 0.0  # of which sent over the outer axis (ring volume), and
    packed_inner: float = 0.0  # over the inner: priced per step (`bucketed_all_reduce`)
    redo_bytes: float = 0.0  # the peak of its backward when recomputed: what its ops up
                             # to the one at work save, plus that op's transient and the
                             # gradients waiting for their maker (`_pending_gradients`)
    bwd_compute: float = 0.0  # the backward of its ops (`CostModel.op_times`)
    weight_compute: float = 0.0  # of which the weight gradients: what a zero-bubble
                                 # schedule's W action runs (ops reading a weight and an
                                 # activation, `pxform.lower.mpmd`'s weight ops)
    weight_out_bytes: float = 0.0  # those ops' outputs: zero-bubble's B keeps their
                                   # gradients for its W (`pxform.runtime.pipeline`)
    gather_s: float = 0.0  # ZeRO-3: one pass of the block's parameter gathers (in
                           # `fwd_comm`, and again in `bwd_comm`: reshard after forward)
    weight_ops: float = 0.0  # how many ops read a weight and an activation (a W's)
    gathered_saved_bytes: float = 0.0  # of the parameters they make whole, those the
                                       # block's ops save for backward: what a microbatch
                                       # keeps without reshard after forward
    weight_held_bytes: float = 0.0  # of `weight_out_bytes`' outputs, those no op saves,
                                    # and the weights those ops read that the block makes
                                    # and no op saves: a zero-bubble stage keeps them from
                                    # F to W (the roots and the weights its W asks
                                    # autograd about), beyond the saved
    redo_fwd: float = 0.0  # what recomputing the block runs again: its forward up to and
                           # with the last op that saves a tensor for backward (torch's
                           # checkpoint stops once that op saved it: autograd saves an
                           # op's inputs after its kernel ran), and its parameter gathers
    largest_grad_bytes: float = 0.0  # its largest parameter's local gradient: what a
                                     # pipeline's sum over microbatches allocates at once
                                     # (`pxform.runtime.buckets.GradAccumulator`)
    gather_transient_bytes: float = 0.0  # of `transient_bytes`, what ZeRO-3's gathers
                                         # in backward add (none where the option keeps
                                         # what forward gathered)
    freed_bytes: float = 0.0  # of `transient_bytes`, what a backward that frees its
                              # graph as it goes has freed by its largest op (what the
                              # ops after it saved)
    kept_freed_bytes: float = 0.0  # the same without the gathers (ZeRO-3 keeping them)
    redo_first_bytes: float = 0.0  # `redo_bytes` in the first microbatch's backward:
                                   # with the gradients of the block's parameters that
                                   # the ops after the one at work have made (later
                                   # microbatches' exist anyway, in `grad_bytes`)


def _floating(v: Value) -> bool:
    return v.type.dtype.is_floating_point or v.type.dtype.is_complex


def _ways(strategy: Strategy, axes: Mapping[str, tuple[int, int]]) -> int:
    return math.prod(axes[a][0] for a, c in strategy.choices if c[0] == "split")


def _local_fraction(v: Value, layout: Layout, cache: RelayoutCache) -> float:
    """The share of `v` one device holds when laid out as `layout`."""
    return _fraction(tuple(v.type.shape), layout, cache.mesh)


@functools.lru_cache(maxsize=65536)
def _fraction(shape: tuple[int, ...], layout: Layout, mesh: AbstractMesh) -> float:
    whole = math.prod(shape)
    if not whole:
        return 1.0
    return math.prod(layout.local_shape(shape, mesh)) / whole


def input_times(v: Value, i: int, s: Strategy, have: Layout, cache: RelayoutCache,
                scale: float, first_use: bool, grad: bool | None = None
                ) -> tuple[float, float]:
    """Seconds to bring input `i` (value `v`, laid out as `have`) to what strategy `s`
    needs (only on the first use of that layout: the lowering converts once per value and
    layout), and to bring its gradient back (C -> G(have), the conversion rule) where it
    has one (`grad`; None: where it is floating)."""
    fwd = cache.time(v, have, s.inputs[i], scale) if first_use else 0.0
    bwd = 0.0
    if _floating(v) if grad is None else grad:
        c = consumer_gradient_layout(s, i)
        g = gradient_layout(have)
        if c != g:
            bwd = cache.time(v, c, g, scale)
    return fwd, bwd


def _unsaved_weight(a: Analysis, block: BlockInfo, v: Value, layouts: Mapping[str, Layout],
                    cache: RelayoutCache, held: set[str]) -> float:
    """Bytes zero-bubble keeps of weight `v`, a weight op's input, from its F to its W
    beyond the saved bytes (`walk`): those of a storage the block makes of weights each
    microbatch (a position embedding's lookup) that no op of the block saves, once
    (`held` collects them); nothing for a parameter, a view or a saved tensor."""
    if v.name in held or v.name in a.params or v.name in a.param_casts:
        return 0.0
    k = a.defined_at.get(v.name)
    if k is None or not block.start <= k < block.stop:
        return 0.0
    op, kept_by = a.graph.ops[k], a.op_saved[k]
    i = next(j for j, o in enumerate(op.outputs) if o.name == v.name)
    if (kept_by.outputs_alias and kept_by.outputs_alias[i] >= 0) or \
            (kept_by.outputs_saved[i] if kept_by.outputs_saved else True):
        return 0.0
    held.add(v.name)
    lay = layouts.get(v.name)
    return v.type.nbytes * (_local_fraction(v, lay, cache) if lay is not None else 1.0)


class OpSeconds(NamedTuple):
    """One op's compute on one device (`op_seconds`)."""

    forward: float
    backward: float   # what autograd runs of it (none, weight or input gradients)
    weight: float     # a weight op's weight gradient, about its forward (`walk`)
    weight_in: list[Value]  # its floating inputs made without the batch
    trains: bool      # a weight among them requires grad
    backs: bool       # autograd runs a backward for it


def op_seconds(a: Analysis, k: int, model: CostModel, scale: float, ways: int
               ) -> OpSeconds:
    """Op `k`'s forward and backward on one device of the `ways` its strategy splits it
    over, `scale` its microbatch over the traced batch (1 for an op not on the batch).
    The forward, and the sum of the two, only grow with `scale / ways` (the backward
    alone need not: an input gradient without the weight's is the backward less about
    the forward); `bounds.quick_bound` takes a block's ops at their largest split.

    The backward autograd runs for the op: none where no input requires grad (a mask,
    positions, a frozen layer before any trained one); a weight op's weight gradient
    (about its forward: `x^T dy` for a matmul) only for a weight that requires grad, its
    other inputs' gradient (the rest) only for an activation that does (a frozen layer's
    matmul runs `dy w` alone; an embedding's lookup its weight's gradient alone: the
    token ids have none).

    Example:
        >>> op_seconds(a, 3, CostModel(hardware("a100-80gb")), 0.5, 8).forward
    """
    op = a.graph.ops[k]
    dtype = op.outputs[0].type.dtype if op.outputs else op.inputs[0].type.dtype
    f, b = model.op_times(a.op_flops[k] * scale / ways, dtype, a.op_bytes[k] * scale / ways,
                          a.op_classes[k] if a.op_classes else "elementwise")
    grads, batch_values = a.requires_grad, a.batch_values
    weight_in = [v for v in op.inputs if _floating(v) and v.name not in batch_values]
    trains = any(v.name in grads for v in weight_in)
    share = 1.0
    if trains and len(weight_in) > 1:
        # of its weight gradients, those that run, by their weights' elements: a linear
        # with a frozen matrix and a trained bias sums the bias's gradient alone, not
        # `x^T dy` (GPT small with every weight matrix frozen, its biases and norms
        # trained: every plan priced 5-14 % over its measured step, 11 % more than the
        # reference program's error, charged its matrices' weight gradients)
        sizes = [v.type.numel for v in weight_in]
        share = sum(n for v, n in zip(weight_in, sizes) if v.name in grads) / max(1, sum(sizes))
    own = min(f, b) * share
    if share < 1.0:
        # (a bias's gradient reads the output's gradient once: a memory-bound reduction)
        outs = [v for v in op.outputs if _floating(v)]
        own += max(0.0, model.op_times(sum(v.type.numel for v in outs) * scale / ways, dtype,
                                       sum(v.type.nbytes for v in outs) * scale / ways,
                                       "elementwise")[0]
                   - model.fitted_backward_s() / BACKWARD_RATIO)
    backs = op.grad and any(v.name in grads for v in op.inputs)
    # (the per-op time the calibration fitted over every op stays, whatever runs: it
    # took each op to pay it, `CostModel.fitted_backward_s`) but before the first block
    # that trains, where autograd's backward never goes: a frozen prefix has none (GPT
    # small with its embeddings and first two layers frozen, 2 stages under zero-bubble,
    # the first stage's B priced 4.4 ms a microbatch, 1.06 ms measured)
    fitted = min(b, model.fitted_backward_s())
    if not backs:
        first = a.first_trained
        b = 0.0 if first < len(a.blocks) and k < a.blocks[first].start else fitted
    elif weight_in and a.op_batch[k]:
        core = b - fitted
        part = min(f - fitted / BACKWARD_RATIO, core)
        b = fitted + (min(part, own) if trains else 0.0) + (
            core - part if any(v.name in grads for v in op.inputs
                               if v.name in batch_values) else 0.0)
    return OpSeconds(f, b, own, weight_in, trains, backs)


class _GatherGroup:
    """ZeRO-3's gather group as the runtime makes it (`pxform.runtime.prefetch`): a run of
    gathers of one model block's parameters (`block_name`), as `walk` finds it in a search
    block. Filled in as the walk goes."""

    __slots__ = ("name", "first", "last", "whole", "shards", "grads", "read")

    def __init__(self, name: str, at: int) -> None:
        self.name = name
        self.first = self.last = at  # the first and last op of the block reading it
        self.whole = 0.0  # its parameters gathered whole, bytes
        self.shards = 0.0  # the shards its gather sends
        self.grads = 0.0  # of `whole`, the trained parameters': their whole gradients
        self.read = 0  # its parameters' bytes (unsplit) that this block reads


def walk(a: Analysis, block: BlockInfo, strats: list[Strategy], outside: Mapping[str, Layout],
         params: Mapping[str, Layout], cache: RelayoutCache, scale: float,
         batch_values: frozenset[str], outputs: Mapping[str, Layout]) -> WalkCost:
    """The cost of `block` with one strategy per op (module doc). `outside` lays out
    values from earlier blocks and batch inputs, `params` the parameters as stored,
    `outputs` the layouts crossing values must leave in; `scale` is microbatch size over
    traced batch."""
    model = cache.model
    axes = cache.axes
    grads = a.requires_grad
    any_backward = False  # does autograd run a backward for any op of the block?
    layouts: dict[str, Layout] = {}
    done: set[tuple[str, Layout]] = set()
    fwd_compute = fwd_comm = bwd_comm = grad_comm = saved = transient = gathered = 0.0
    # ZeRO-3: what its parameters' shards hold (the packed gather's send buffer); per op,
    # its transient, and the last op that reads a gathered parameter (backward gathers
    # them again when it gets there, `pxform.runtime.reshard`)
    shards = unpack = 0.0
    heres: list[float] = []
    last_gathered = -1
    # ZeRO-3's gather groups, in the order the block reads them, and per op the bytes of
    # its activations' part of `heres` (what sits beside a gradient reduce-scatter there)
    groups: list[_GatherGroup] = []
    group_of: dict[str, _GatherGroup] = {}
    acts: list[float] = []
    # of `saved`, the block's own inputs from earlier blocks as they came: a recompute saves
    # them again without a copy (they are its checkpoint's inputs, in `kept`). Those of its
    # kind (`Analysis.kind_reads`): the search walks a kind's first block for them all
    inputs_saved = 0.0
    reads = frozenset(a.kind_reads[block.kind])
    saved_upto: list[float] = []  # per op, `saved` once it ran
    # the block's forward and backward in the order they run, as compute and the number of
    # activation collectives on the critical path (`sync_waits`): ranks meet at each
    fwd_seq: list[tuple[float, int]] = []  # per op: its inputs' collectives, then its compute
    bwd_seq: list[tuple[float, int]] = []  # per op: its backward, then its inputs' gradients'
    bwd_compute = weight_compute = weight_out = weight_ops = weight_held = 0.0
    # the forward so far, and up to where a recompute must run (`WalkCost.redo_fwd`)
    ran = redo_until = 0.0
    redo_runs = 0  # the forward's `fwd_seq` up to there: its collectives meet again
    # values made from parameters alone (a transposed or cast weight): weights too
    weights = set(a.params) | set(a.param_casts)
    held_weights: set[str] = set()  # weights made in the block that a W keeps (`walk`)
    held_outputs: list[tuple[str, float]] = []  # weight ops' outputs no op saves, bytes
    # weight ops' outputs -> their bytes in `weight_out`, how many ops read each, and
    # those an add hands its own output's gradient to as it is (`GRAD_PASSTHROUGH`)
    weight_outs: dict[str, float] = {}
    read_count: dict[str, int] = {}
    passed: set[str] = set()
    graph = a.graph
    values = {}
    # parameter gradients go to buckets (`pxform.runtime.buckets`): one collective per
    # kind and axis for the block's gradients together, so one latency, not one per tensor
    bucket: dict[tuple[str, str], float] = {}
    gathers: dict[tuple[str, str], float] = {}  # ZeRO-3's parameter gathers, likewise
    gathered_params: dict[str, float] = {}  # parameter -> its bytes gathered whole
    # a value re-laid out in the block is a storage of its own in the program, and so are
    # the views of it: value -> that copy, (value, layout) it was made at; the copies
    # counted as saved
    fresh: dict[str, tuple[str, Layout]] = {}
    fresh_saved: set[tuple[str, Layout]] = set()
    # value -> the value whose storage it is (a view's, through `outputs_alias`), and the
    # storages no op has saved yet as they are: each view of them an op saved was re-laid
    # out into a copy of its own (root -> its bytes, counted if a later op saves it as is)
    root: dict[str, str] = {}
    uncounted: dict[str, float] = {}
    # values an op made reading an input re-laid out into a copy for it: their layout is
    # the kernel's own, not the trace's, and a reshape that was a view only by the
    # trace's strides copies them (`SavedBytes.restrides`)
    restrided = any(a.op_saved[k].restrides for k in range(block.start, block.stop))
    kernel_made: set[str] = set()
    # a recomputed block's backward also holds, at each op, the gradients that wait for
    # their maker: of values an op after it read and it or an op before it made (the
    # residual stream's), and in the first microbatch the block's parameters' that the ops
    # after it made (`_pending_gradients`): value -> (the op making it, -1 for one from
    # outside the block; its local bytes), and per op what it and the ops before it
    # hold in a recompute (its `redo` without them)
    waiting: dict[str, tuple[int, float]] = {}
    trained: dict[str, float] = {}  # parameter -> its gradient's local bytes where read
    readers: dict[str, list[int]] = {}  # value -> the ops reading it, relative to the block
    redo_at: list[float] = []
    for k, s in zip(range(block.start, block.stop), strats):
        op = graph.ops[k]
        ways = _ways(s, axes)
        sc = scale if a.op_batch[k] else 1.0
        f, b, own, weight_in, trains, backs = op_seconds(a, k, model, sc, ways)
        syncs_in = syncs_back = 0
        any_backward |= backs
        fwd_compute += f
        bwd_compute += b
        # a weight op as `pxform.lower.mpmd._weight_ops` finds a zero-bubble W's: one
        # that reads a floating weight (a value made without the batch: a parameter, a
        # constant, what is made from them alone) and a value made from the batch, of
        # any dtype: an embedding's lookup of the token ids is one (counted as making a
        # weight, its output went uncounted where zero-bubble keeps it for the W, 0.37
        # MiB a microbatch of GPT small's first stage at width 256 x 128 tokens: the
        # forty-sixth session)
        for v in op.inputs:
            if v.name in weight_outs:
                read_count[v.name] = read_count.get(v.name, 0) + 1
        if not a.op_batch[k]:
            weights.update(v.name for v in op.outputs)
        elif weight_in and backs and trains and any(_floating(v) for v in op.outputs):
            # its weight gradient costs about its forward (x^T dy for a matmul). Only where
            # a weight requires grad: the runtime's W leaves the others alone (a frozen
            # layer's, HF Llama's rotary products with cosines from a buffer), and its B
            # lets their outputs go (`pxform.runtime.pipeline._weight_op_outputs`)
            weight_compute += own
            weight_ops += 1
            made = {v.name: v.type.nbytes * sc * _local_fraction(v, lay, cache)
                    for v, lay in zip(op.outputs, s.outputs) if _floating(v)}
            weight_outs.update(made)
            weight_out += sum(made.values())
            if op.target in GRAD_PASSTHROUGH:
                # (an embedding's lookup summed with the positions': the gradient B
                # keeps for the lookup is the one it keeps for the sum)
                passed.update(v.name for v in op.inputs if v.name in weight_outs
                              and v.type == op.outputs[0].type)
            # zero-bubble's W asks autograd from the op's outputs for its weight inputs:
            # the stage keeps both from F to W, also those no op saves. (An output read
            # after the block, or a view of it, is held there anyway: saved by its
            # reader, or sent on; counted at the end, once the views are known.)
            kept_anyway = a.op_saved[k].outputs_saved or (True,) * len(op.outputs)
            held_outputs += [(v.name, made[v.name]) for v, kept in zip(op.outputs, kept_anyway)
                             if v.name in made and not kept]
            weight_held += sum(_unsaved_weight(a, block, v, layouts, cache, held_weights)
                               for v in weight_in)
        # each saved tensor at its own layout's local size; the op's intermediates as its
        # split (`ways`)
        kept_by = a.op_saved[k]
        # (the storages first saved here, counted once the inputs' copies are known below)
        storages = [nbytes * sc * _local_fraction(v, lay, cache) if nbytes else 0.0
                    for v, lay, nbytes in zip(op.inputs, s.inputs, kept_by.inputs)]
        for v, lay, nbytes in zip(op.outputs, s.outputs, kept_by.outputs):
            if nbytes:
                saved += nbytes * sc * _local_fraction(v, lay, cache)
        saved += kept_by.other * sc / ways
        # (parameters gathered whole are counted per block, below). An input stands for
        # its gradient, made by the op's backward: one that requires none (an image
        # model's pixels read by its first convolution, a mask) has none, and an op
        # without a backward (a frozen prefix's) holds its other inputs and outputs alone
        # (HF Swin's first pipeline stage, a convolution of the pixels, came out 10 %
        # over the meter with the pixels counted as its backward's; HF Llama's frozen
        # first stage of a zero-bubble pipeline 4.1 % with its embedding table's 1 MiB
        # counted as its lookup's workspace)
        held_inputs = [(v, lay) for v, lay in zip(op.inputs, s.inputs)
                       if (v.name in grads if backs else v.name not in a.params)]
        # (the activations' part apart: what sits beside a gradient reduce-scatter there)
        act = param_part = 0.0
        for v, lay in (*held_inputs, *zip(op.outputs, s.outputs)):
            if v.name not in a.params:
                act += v.type.nbytes * sc * _local_fraction(v, lay, cache)
            elif not (v.name in params and params[v.name] != lay):
                param_part += v.type.nbytes * _local_fraction(v, lay, cache)
        here = act + param_part
        # an op that runs as several (cross-entropy: log-softmax, then the loss) saves its
        # own intermediates, and its backward makes a gradient of each beside its input's
        # (the log-softmax's 2 MiB at the peak of GPT small's tensor-parallel step)
        here += kept_by.other * sc / ways
        transient = max(transient, here)
        heres.append(here)
        acts.append(act)
        # per input, its own copy if it has one (asked only where the op saves the input
        # or an output is a view of it: `SavedBytes.asks`)
        asks = kept_by.asks
        copies: list[tuple[str, Layout] | None] = [None] * len(op.inputs) if asks else []
        for i, v in enumerate(op.inputs):
            values[v.name] = v
            have = layouts.get(v.name) or params.get(v.name) or outside.get(v.name)
            if have is None:
                have = Layout.replicated(v.type.rank)
            first = (v.name, s.inputs[i]) not in done
            done.add((v.name, s.inputs[i]))
            fwd, bwd = input_times(v, i, s, have, cache,
                                   sc if v.name in batch_values else 1.0, first,
                                   backs and v.name in grads)
            param = v.name in a.params or v.name in a.param_casts
            copy = None
            if asks and asks[i]:  # (`asks`, like `inputs_saved`, has one per op input)
                if have == s.inputs[i]:
                    copy = fresh.get(v.name)
                elif not param and cache.copies_storage(v, have, s.inputs[i]):
                    copy = (v.name, s.inputs[i])
                copies[i] = copy
            if copy is not None and kept_by.inputs_saved[i] and copy not in fresh_saved:
                # the op saves a storage an earlier op saved too (counted there), but here
                # it is re-laid out: the copy it saves is its own. (A tensor-parallel GPT
                # whose attention output is sliced for a row-parallel projection saved 4
                # such 256 KiB slices at its peak, 3.3 % of it, uncounted)
                fresh_saved.add(copy)
                # (the copy may be of the value this one is a view of: an earlier op's
                # input, gathered whole for a split into query, key and value)
                of = values[copy[0]]
                saved += of.type.nbytes * sc * _local_fraction(of, copy[1], cache)
            gathered_here = param and have != s.inputs[i] and _floating(v)
            if gathered_here:
                last_gathered = len(heres) - 1
                if v.name in group_of:  # (read again: backward gathers it here at the latest)
                    group_of[v.name].last = last_gathered
            if gathered_here and first:
                # gathered at use (ZeRO-3): the runtime gathers a block's parameters in
                # one packed collective per kind and axis (`pxform.runtime.prefetch`),
                # priced below; it frees the gathered copy after its forward use and
                # gathers it again for backward (reshard after forward,
                # `pxform.runtime.reshard`): transient, not saved; the gather runs twice
                for kind, axis, sent in cache.steps(v, have, s.inputs[i]):
                    gathers[kind, axis] = gathers.get((kind, axis), 0.0) + sent
                whole = v.type.nbytes * _local_fraction(v, s.inputs[i], cache)
                gathered += whole
                shard = v.type.nbytes * _local_fraction(v, have, cache)
                shards += shard
                # the runtime's group: consecutive gathers of one model block's parameters
                name = block_name(v.name)
                if not groups or groups[-1].name != name:
                    groups.append(_GatherGroup(name, last_gathered))
                group = group_of[v.name] = groups[-1]
                group.last = last_gathered
                group.whole += whole
                group.shards += shard
                if v.name in a.trainable:
                    group.grads += whole
                if v.name in a.params:
                    group.read += v.type.nbytes
                # its piece cut out of the packed buffer: one concatenation of the ranks'
                # chunks per parameter (`pxform.runtime.buckets.finish_gather`)
                unpack += model.pack_time(whole)
                if v.name in a.params:  # (a cast parameter's saved copy is in `saved`)
                    gathered_params[v.name] = whole
            else:
                fwd_comm += fwd
                if first and fwd:
                    syncs_in += cache.collectives(v, have, s.inputs[i])
            if param:
                if bwd > 0:
                    # a cast parameter's gradient is reduced in the reduce dtype
                    wider = a.param_casts.get(v.name, 1.0)
                    for kind, axis, sent in cache.steps(v, consumer_gradient_layout(s, i),
                                                        gradient_layout(have)):
                        bucket[kind, axis] = bucket.get((kind, axis), 0.0) + sent * wider
            else:
                bwd_comm += bwd
                if bwd:
                    syncs_back += cache.collectives(v, consumer_gradient_layout(s, i),
                                                    gradient_layout(have))
        # the storages first saved here, and those an earlier op saved only as copies:
        # a storage whose every view the op saves is re-laid out into a copy of its own is
        # not saved (the copies are, above). (A tensor-parallel attention that splits its
        # heads saves its query, key and value re-laid out, each a copy; counted as the
        # projection's whole output besides, a 3-layer GPT of width 192 came out 5.9 %
        # over the meter: the forty-fifth session)
        shared = [root.get(v.name, v.name) for v in op.inputs]
        # (`inputs_saved` empty: not known; an op that saves nothing skips this)
        asked = (kept_by.inputs_saved or tuple(bool(b) for b in storages)) \
            if kept_by.packs else ()
        for i, (v, ask) in enumerate(zip(op.inputs, asked)):
            if not ask:
                continue
            if storages[i]:
                if copies and all(copies[j] is not None for j, (r, other) in
                                  enumerate(zip(shared, asked)) if r == shared[i] and other):
                    uncounted[shared[i]] = storages[i]
                    continue
                saved += storages[i]
                # (the input as it came, or a view of it: split over an axis of one
                # device, a pipeline stage's input on a data axis of 1 is the same tensor;
                # counted as made again, HF RegNet's recomputed 2-stage pipeline came out
                # a layer input over the meter on its last stage, +9.5 %)
                came = outside.get(v.name)
                if v.name in reads and came is not None \
                        and not cache.collectives(v, came, s.inputs[i]) \
                        and not cache.copies_storage(v, came, s.inputs[i]):
                    inputs_saved += storages[i]
            elif shared[i] in uncounted and not (copies and copies[i] is not None):
                saved += uncounted.pop(shared[i])
        for out, src in zip(op.outputs, kept_by.outputs_alias):
            if src >= 0:
                root[out.name] = shared[src]
        aliases = kept_by.outputs_alias
        if restrided:
            if kept_by.restrides and shared[0] in kernel_made:
                # the reshape copies: its output is a storage of its own, which an op
                # that saves it counts (`fresh`, below). (A tensor-parallel attention
                # that splits its heads, its query re-laid out into a contiguous copy,
                # returns its output in that layout, not the trace's, and the
                # projection after it saves a copy: 1 MiB a layer of a GPT of width 256
                # at 16 x 128 tokens, uncounted, 3.1 % of its peak: the forty-fifth
                # session)
                out = op.outputs[0]
                root[out.name] = out.name
                copies, aliases = [(out.name, s.outputs[0])], (0,)
            elif op.inputs and _floating(op.inputs[0]) and op.inputs[0].name not in weights \
                    and layouts.get(op.inputs[0].name) is not None and cache.copies_storage(
                        op.inputs[0], layouts[op.inputs[0].name], s.inputs[0]):
                # (a kernel's output follows its first input's layout: attention's its
                # query's, an elementwise op's its operand's)
                kernel_made.update(v.name for v in op.outputs)
        # a recomputed block's backward reaches this op holding what it and the ops before
        # it saved: torch's checkpoint frees each recomputed tensor once backward used it.
        # Its inputs are not made again: `kept` counts them (counted here too, a recomputed
        # tensor-parallel GPT 3 layers of width 192 came out 5.6 % over the meter, its
        # replicated layer input twice: the forty-second session)
        redo_at.append(saved - inputs_saved + here)
        saved_upto.append(saved)
        for name in {v.name for v in op.inputs}:
            readers.setdefault(name, []).append(k - block.start)
        for v, lay in zip(op.inputs, s.inputs):
            if v.name in a.params:
                if v.name in a.trainable and _floating(v):
                    trained[v.name] = v.type.nbytes * _local_fraction(v, lay, cache)
            elif v.name in grads and v.name not in waiting and _floating(v):
                vs = scale if v.name in batch_values else 1.0
                have = outside.get(v.name) or Layout.replicated(v.type.rank)
                waiting[v.name] = (-1, v.type.nbytes * vs * _local_fraction(v, have, cache))
        for v, lay in zip(op.outputs, s.outputs):
            if v.name in grads and _floating(v):
                waiting[v.name] = (k - block.start,
                                   v.type.nbytes * sc * _local_fraction(v, lay, cache))
        if copies:
            for out, src in zip(op.outputs, aliases):
                base = copies[src] if src >= 0 else None
                if base is not None:
                    fresh[out.name] = base
        fwd_seq += [(0.0, syncs_in), (f, 0)]
        bwd_seq += [(0.0, syncs_back), (b, 0)]  # (reversed below: backward runs last op first)
        for v, lay in zip(op.outputs, s.outputs):
            layouts[v.name] = lay
            values[v.name] = v
        # (this op's forward: its compute and the re-layouts of its inputs, `fwd_comm`)
        ran = fwd_compute + fwd_comm
        if kept_by.packs:
            redo_until, redo_runs = ran, len(fwd_seq)
    # each gather's collective, and on the rank's own thread the copies around it: the
    # shards packed into one buffer and each parameter cut out of the gathered one
    # (`pxform.runtime.buckets`), as the gradients' buckets are priced below
    gather_time = sum(model.step_time(kind, axis, sent, axes)
                      for (kind, axis), sent in gathers.items())
    if gathers:
        gather_time += model.pack_time(shards) + unpack
    fwd_comm += gather_time
    if any_backward:  # (a block without one gathers nothing again: nothing was saved)
        bwd_comm += gather_time
    # all-reduces are packed across blocks into the step's buckets (`bucketed_all_reduce`,
    # per step); the others (ZeRO-3's reduce-scatters) go per block, launched during
    # backward (`GradBuckets`). Their transfers overlap the backward that follows
    # (`grad_comm`); what each costs the compute thread does not, and joins the backward:
    # packing the block's gradients rank-major (`CostModel.pack_time` of their local
    # bytes) and the runtime's own time per collective
    # (`collective_overhead_s`: wrapping and launching it, and on gloo waiting for the
    # group's previous collective, one at a time). Overlapped whole, ZeRO-3 plans came out
    # 11-19 % under on 2 gloo ranks, their 7 launches timed at 7.5-9 ms per step.
    grad_comm = 0.0
    per_collective = model.hardware.collective_overhead_s
    for (kind, axis), sent in bucket.items():
        transfer = model.step_time(kind, axis, sent, axes)
        if kind == "all_reduce" or transfer <= 0:
            continue
        n = axes[axis][0]
        local = sent * n / (n - 1) if kind == "reduce_scatter" else 0.0
        grad_comm += transfer - per_collective
        # launched as the block's backward ends, it meets the peers there, after that
        # backward's compute (`Hardware.sync_wait`), and gloo's one collective at a time
        # (`pxform.runtime.collectives.launch`) holds the next block's gather behind it:
        # as data parallelism's last bucket does once per step (`stages._stage_sums`),
        # ZeRO-3 does per block (its plans had come out 5-12 % under beside data
        # parallelism's 0-5 on GPT small, 2026-11-28: a probe had 37 ms of its step
        # blocked in collectives' waits against data parallelism's 7)
        bwd_comm += per_collective + model.pack_time(local) + model.hardware.sync_wait_s(
            bwd_compute)
    packed_sent = {axis: sent for (kind, axis), sent in bucket.items() if kind == "all_reduce"}
    # data parallel's bucket is packed into one buffer before its all-reduce: its bytes
    # (local: the ring volume's n / 2(n - 1))
    packed = sum(sent * axes[axis][0] / (2 * (axes[axis][0] - 1))
                 for axis, sent in packed_sent.items() if axes[axis][0] > 1)
    for name, want in outputs.items():
        have = layouts.get(name)
        if have is None or have == want:
            continue
        v = values.get(name) or a.values()[name]
        vs = scale if name in batch_values else 1.0
        fwd_comm += cache.time(v, have, want, vs)
        fwd_seq.append((0.0, cache.collectives(v, have, want)))
        if name in grads:
            bwd_comm += cache.time(v, gradient_layout(want), gradient_layout(have), vs)
            bwd_seq.append((0.0, cache.collectives(v, gradient_layout(want),
                                                   gradient_layout(have))))
    hw = model.hardware

    def meet(gap: float) -> float:
        # the ranks meet after compute: the wait, and the runtime's cost of a
        # conversion's collectives in a step beyond the comm tables' and
        # `collective_overhead_s` (`Hardware.relayout_overhead_s`); a few views between
        # two conversions leave the ranks together
        # (and more the longer that compute: `Hardware.relayout_wait_share`)
        if gap <= RELAYOUT_GAP_S:
            return hw.sync_wait_s(gap)
        return hw.sync_wait_s(gap) + hw.relayout_overhead_s + hw.relayout_wait_s(gap)

    fwd_comm += sync_waits(fwd_seq, meet)
    bwd_comm += sync_waits(bwd_seq[::-1], meet)
    # a recompute runs the forward's conversions again, inside backward: the ranks meet
    # there as in the forward (tensor parallelism with recompute had been priced 13-24 %
    # under, its replayed collectives paying their transfers alone)
    redo_until += sync_waits(fwd_seq[:redo_runs], meet)
    kept = 0.0
    vals = a.values()
    # a recomputed block with no backward (a frozen prefix) records no graph: torch's
    # checkpoint holds its inputs only through what its ops save, so nothing is kept (GPT
    # small with its embeddings and first two layers frozen, 2 gloo ranks: tensor
    # parallelism with recompute came out 7.4 % over the meter, 0.86 MiB of the two
    # layers' inputs counted kept)
    for name in a.kind_reads[block.kind] if any_backward else ():
        v = vals[name]
        lay = outside.get(name, Layout.replicated(v.type.rank))
        local = math.prod(lay.local_shape(v.type.shape, cache.mesh))
        kept += local * v.type.dtype.itemsize * (scale if name in batch_values else 1.0)
    pbytes = gbytes = largest_grad = 0.0
    for name in block.params:
        v = vals[name]
        lay = params.get(name, Layout.replicated(v.type.rank))
        local = math.prod(lay.local_shape(v.type.shape, cache.mesh))
        if name not in a.trainable:  # frozen: the parameter alone
            pbytes += local * v.type.dtype.itemsize
            continue
        pbytes += local * model.state_bytes_per_param(v.type.dtype)
        gbytes += local * v.type.dtype.itemsize
        largest_grad = max(largest_grad, local * v.type.dtype.itemsize)
    # ZeRO-3's gathers run per group, one group ahead (`pxform.runtime.prefetch`,
    # `pxform.runtime.reshard`): a group is a run of gathers of one model block's
    # parameters (`block_name`: a numbered layer's, or those outside any list), which is
    # the search's block in a stack of layers but not always (HF BART's and T5's decoder
    # layers are one search block, "head", of several groups). Backward gathers a group's
    # parameters again at the last op that reads one (the first it reaches), frees them
    # once the first has run, and launches the gather of the group before it there: at an
    # op, the groups it lies within and the next one in flight (its whole buffer and the
    # packed shards it sends; the block before's, taken as the first group's) are held
    # beside the op at work; before the last, the op alone (a GPT head's loss, its largest
    # op, runs before its tied embedding is gathered again). Charged one block's worth on
    # every op, the largest such block's step came out 4 % under, the largest head's 3 %
    # over (the forty-second session: docs/benchmarks/accuracy.md); charged the whole
    # block's on each, HF BART's ZeRO-3 step came out 13 % over (the fifty-fourth).
    #
    # A backward that frees the graph as it goes (all but zero-bubble's B, which keeps it
    # for its W) reaches an op after freeing what the ops after it saved: the op's
    # transient less that is what it adds (a GPT layer's largest op, its GELU, comes after
    # the projection freed the GELU's output; charged whole, a 2-stage pipeline's first
    # stage came out 5.7 % over the meter on a held-out shape: the forty-second session).
    freed_by = [h - (saved - upto) for h, upto in zip(heres, saved_upto)]

    # ZeRO-3 gathers a numbered layer's group whole where its first parameter is read,
    # also the part another search block reads (HF T5's decoder layer is cut into two
    # search blocks: its second gathered both, 7.6 % over its prediction). Where the
    # block gathers every parameter of the group it reads (not a tensor-parallel block
    # re-laying out one): the runtime gathers parameters outside any list where they
    # are read, run by run
    read_here = group_bytes([a.values()[name] for name in block.params]) if groups else {}
    for group in groups:
        total = a.group_bytes.get(group.name, 0)
        if group.name and group.read and group.read == read_here.get(group.name) \
                and total > group.read:
            grow = total / group.read
            group.whole, group.shards, group.grads = \
                group.whole * grow, group.shards * grow, group.grads * grow

    def largest(per_op: list[float], gathers: bool) -> float:
        if not (gathers and gathered):
            return max(per_op, default=0.0)
        best = max(per_op[last_gathered + 1:], default=0.0)
        order = sorted(groups, key=lambda g: -g.last)  # as backward reaches them
        for j, group in enumerate(order):
            # the next group's gather in flight (the first's: the block before's, taken
            # at its size)
            nxt = order[j + 1] if j + 1 < len(order) else group
            ahead = nxt.whole + nxt.shards
            for i in range(nxt.last + 1 if nxt is not group else 0, group.last + 1):
                live = sum(g.whole for g in groups if g.first <= i <= g.last)
                best = max(best, per_op[i] + live + ahead)
            if group.grads:
                # its gradients' reduce-scatter, once its backward is done: the whole
                # gradients packed into one buffer and the shard it makes, beside them
                # (`pxform.runtime.buckets.GradBuckets`; HF MobileNetV2's head, a 1x1
                # convolution to 1,280 channels, peaks there: -6.7 % without it)
                shard = group.grads * group.shards / group.whole
                best = max(best, acts[group.first] + 2 * group.grads + shard)
        return best

    for name in outputs:  # (read after the block)
        readers.setdefault(name, []).append(block.stop - block.start)
    pending, pending_params = _pending_gradients(a, block, waiting, trained, readers)
    redo = max((r + p for r, p in zip(redo_at, pending)), default=0.0)
    redo_first = max((r + p + q for r, p, q in zip(redo_at, pending, pending_params)),
                     default=0.0)
    plain = transient
    transient = largest(heres, True)
    freed = transient - largest(freed_by, True)
    kept_freed = plain - largest(freed_by, False)
    stored = {n for k in range(block.start, block.stop) for n in a.op_saved[k].stored}
    crossing = {root.get(n, n) for n in outputs}
    # (read once, by the add: a second reader, in the block or after it, sums gradients)
    weight_out -= sum(weight_outs[n] for n in passed
                      if read_count.get(n) == 1 and n not in outputs)
    weight_held += sum(b for n, b in held_outputs if root.get(n, n) not in crossing)
    gathered_saved = sum(b for n, b in gathered_params.items() if n in stored)
    return WalkCost(fwd_compute, fwd_comm, bwd_comm, grad_comm, saved, kept, pbytes, gbytes,
                    transient, packed, packed_sent.get("outer", 0.0),
                    packed_sent.get("inner", 0.0), redo + gathered, bwd_compute,
                    weight_compute, weight_out, gather_time if any_backward else 0.0,
                    weight_ops, gathered_saved,
                    weight_held, redo_until + gather_time, largest_grad,
                    transient - plain, freed, kept_freed, redo_first + gathered)


def _pending_gradients(a: Analysis, block: BlockInfo, waiting: Mapping[str, tuple[int, float]],
                       trained: Mapping[str, float], readers: Mapping[str, list[int]]
                       ) -> tuple[list[float], list[float]]:
    """Per op of `block`, the gradients its backward finds waiting beside its own inputs'
    and outputs': (1) of the values in `waiting` (value -> the op making it, relative to
    the block, -1 for one from outside it; its local bytes) that an op after it reads
    (`readers`: per value the ops of the block reading it in order, relative to the block,
    and the block's length for a later block) and it or an op before it made, which wait
    from their last reader's backward to their maker's; (2) of the parameters in `trained` (their
    gradients' local bytes) that an op after it reads, made in the first microbatch's
    backward there. A probe of HF OPT's recomputed step had the residual stream's 64 KiB
    and the second projection's 33 KiB gradient alive at its peak, uncounted (the
    fifty-sixth session); RegNet's recomputed data-parallel step came out 9.6 % under
    the meter without them. (x from outside the block read by ops 0 and 2, y made by op 0
    and read by op 2: at op 1 both x's and y's gradients wait, made by op 2's backward.)

    An add hands its output's gradient to its inputs as it is (`GRAD_PASSTHROUGH`): the
    inputs whose only reader still to come is that add wait on one storage, counted once
    (HF GPT-NeoX's parallel residual, x + attention + MLP, came out 6 % over the meter
    with its layer input's and its attention output's gradients counted apart while its
    MLP's backward ran); an input with a reader still to come of another kind waits on a
    sum of its own.
    """
    num = block.stop - block.start
    ops = a.graph.ops

    def passes(i: int, name: str) -> bool:  # does op i hand `name` its output's gradient?
        op = ops[block.start + i]
        return op.target in GRAD_PASSTHROUGH and any(
            v.name == name and v.type == op.outputs[0].type for v in op.inputs)

    def storage(i: int) -> int:
        # the add whose output's gradient add i's is: its own, or that of the add its
        # output goes to alone (x + attention + MLP is two adds and one gradient)
        out = ops[block.start + i].outputs[0].name
        at = readers.get(out, [])
        while len(at) == 1 and at[0] < num and passes(at[0], out):
            i = at[0]
            out = ops[block.start + i].outputs[0].name
            at = readers.get(out, [])
        return i

    diff = [0.0] * (num + 1)
    # per add (its index), the spans its inputs wait on its output's gradient, its bytes,
    # and the ops whose outputs' gradient it is too: their own, counted in their transient
    shared: dict[int, tuple[list[tuple[int, int]], float, set[int]]] = {}
    for name, (made, nbytes) in waiting.items():
        at = readers.get(name, [])
        if not at:
            continue
        end = at[-1]
        if end < num and passes(end, name):
            before = at[-2] if len(at) > 1 else made
            spans, _, makers = shared.setdefault(storage(end), ([], nbytes, set()))
            spans.append((before, end))
            if len(at) == 1:
                makers.add(made)
            end = before
        # its own storage between its maker and that reader, less at the readers between
        # (an input's gradient there is the op's own, counted in its transient)
        if end - made >= 2:
            diff[made + 1] += nbytes
            diff[end] -= nbytes
            for r in at:
                if made < r < end:
                    diff[r] -= nbytes
                    diff[r + 1] += nbytes
    for spans, nbytes, makers in shared.values():
        covered: set[int] = set()
        for lo, hi in spans:
            covered.update(range(lo + 1, hi))
        for r in covered - makers:
            diff[r] += nbytes
            diff[r + 1] -= nbytes
    params = [0.0] * (num + 1)
    for name, nbytes in trained.items():
        params[0] += nbytes
        params[max(readers.get(name, [0]))] -= nbytes
    pending, pending_params = [], []
    run = run_params = 0.0
    for i in range(num):
        run += diff[i]
        run_params += params[i]
        pending.append(run)
        pending_params.append(run_params)
    return pending, pending_params


def sync_waits(sequence: list[tuple[float, int]], wait: Callable[[float], float]) -> float:
    """Seconds a block's collectives wait for the ranks to meet (`Hardware.sync_wait`):
    `sequence` is what the block runs in order, as (compute seconds, collectives) pairs;
    each run of collectives with no compute between pays `wait(gap)` once, for the compute
    since the run before (the later ones in a run find the ranks together). The block is
    taken as one of a repeated stack (a model's layers): its first collectives come after
    the compute that follows its last ones (cyclically), not after none.

    Example:
        >>> sync_waits([(0.0, 1), (2e-3, 0), (0.0, 2), (1e-3, 0)], lambda g: g / 10)
        0.0003
    """
    if not any(n for _, n in sequence):
        return 0.0
    tail = 0.0  # the compute after the last collectives: before the first, cyclically
    for t, n in sequence:
        tail = 0.0 if n else tail + t
    total, gap = 0.0, tail
    for t, n in sequence:
        if n:
            if gap > 0:
                total += wait(gap)
            gap = 0.0
        else:
            gap += t
    return total


# ---------------------------------------------------------------- tensor-axis beam search

@dataclass
class _State:
    """One path of the tensor-axis beam after some of a block's ops. It keeps only what a
    later op asks of it: `layouts` of the values read later or leaving the block, `done`
    the conversions made of values read again (a second read at the same layout is free).
    Dropping the rest as it dies kept each extension from copying the whole block's
    history (BERT-large's 18 beams: 0.20 -> 0.12 s of CPU, the same picks)."""

    key: tuple[float, float]  # (replicated weight matrices, seconds)
    layouts: dict[str, Layout]
    params: dict[str, Layout]  # parameter -> how its first reader stores it
    done: frozenset[tuple[str, Layout]]
    picks: tuple[Strategy, ...]
    params_key: tuple[tuple[str, Layout], ...] = ()  # `params`, sorted: part of the signature


def tensor_strategies(a: Analysis, block: BlockInfo, axis: str, size: int, level: int,
                      model: CostModel, scale: float, sequence_parallel: bool = False,
                      cache: RelayoutCache | None = None) -> tuple[Strategy, ...]:
    """Per op of `block`, its strategy on the tensor axis `axis` of `size` (module doc).
    Values from earlier blocks arrive, and values for later ones leave, whole; with
    `sequence_parallel`, split over the axis along their sequence dim
    (`sequence_layout`). `cache`: re-layouts on that one-axis mesh, shared between calls."""
    mesh = AbstractMesh({axis: size})
    if cache is None:
        cache = RelayoutCache(model, {axis: (size, level)}, mesh)
    graph = a.graph
    vals = a.values()
    last: dict[str, int] = {}
    for k in range(block.start, block.stop):
        for v in graph.ops[k].inputs:
            last[v.name] = k
    crossing = set(block.crossing)

    def between(name: str) -> Layout:
        """Where a value crossing blocks is laid out on the tensor axis."""
        v = vals[name]
        whole = Layout.replicated(v.type.rank)
        if not sequence_parallel or not is_activation(a, name):
            return whole
        return sequence_layout(a, name, v.type.shape, whole, axis, size)

    arriving = {n: between(n) for n in block.reads if n in vals and is_activation(a, n)}
    beam = [_State((0.0, 0.0), arriving, {}, frozenset(), ())]
    for k in range(block.start, block.stop):
        op = graph.ops[k]
        # the tensor axis splits inside ops, never the batch: splitting the batch is the
        # data roles' job, and a batch dim split over the tensor axis as well as the
        # pipeline's microbatch axis could only be regrouped through the whole batch
        batch = a.data_strategies[k].choices[0][1]
        options = [s for s in strategies(op, mesh)
                   if not (batch[0] == "split" and s.choices[0][1] == batch)]
        dtype = op.outputs[0].type.dtype if op.outputs else op.inputs[0].type.dtype
        sc = scale if a.op_batch[k] else 1.0
        # what a state keeps after this op (`_State`): an input read for the last time
        # here is dropped, and a conversion is remembered only for a value read again
        dying = {v.name for v in op.inputs if last.get(v.name) == k and v.name not in crossing}
        kept_outputs = [(j, v.name) for j, v in enumerate(op.outputs)
                        if last.get(v.name, -1) > k or v.name in crossing]
        read_again = [(i, v.name) for i, v in enumerate(op.inputs) if last.get(v.name, -1) > k]
        new_params = [(i, v.name) for i, v in enumerate(op.inputs) if v.name in a.params]
        grown: dict[tuple, _State] = {}
        # a choice's price depends only on how the state holds the op's inputs (layout,
        # parameter seen, layout used before): states of a beam mostly agree there, and
        # pricing each anew was half of the tensor search (BERT-large on 8: 8,735
        # prices, 0.19 s of a 0.35 s search)
        priced: dict[tuple, tuple[float, float | None]] = {}
        for st in beam:
            allowed = options
            if sequence_parallel and (a.op_classes[k] if a.op_classes else "") not in \
                    GATHERING_CLASSES:
                # Megatron's layout: norms, dropouts and residual adds run on their
                # share of the tokens; a split value is gathered only for a matmul
                kept = [s for s in options if not _gathers(op, s, st)]
                allowed = kept or options
            held = tuple((st.layouts.get(v.name), st.params.get(v.name),
                          v.name in st.params) for v in op.inputs)
            for s in allowed:
                key = (id(s), held, tuple((v.name, s.inputs[i]) in st.done
                                          for i, v in enumerate(op.inputs)))
                got = priced.get(key)
                if got is None:
                    got = priced[key] = _tensor_step(a, k, s, st, cache, sc, dtype, model)
                bad, t = got
                if t is None:
                    continue
                layouts = {n: lay for n, lay in st.layouts.items() if n not in dying} \
                    if dying else dict(st.layouts)
                for j, name in kept_outputs:
                    layouts[name] = s.outputs[j]
                params, params_key = st.params, st.params_key
                fresh = [(name, Layout(s.inputs[i].dims)) for i, name in new_params
                         if name not in params]
                if fresh:
                    params = {**params, **dict(fresh)}
                    params_key = tuple(sorted(params.items()))
                done = st.done
                again = [(name, s.inputs[i]) for i, name in read_again
                         if (name, s.inputs[i]) not in done]
                if again:
                    done = done.union(again)
                if k == block.stop - 1:  # outputs leave whole (or sequence-split)
                    for name in crossing:
                        have = layouts.get(name)
                        want = between(name)
                        if have is not None and have != want:
                            v = vals[name]
                            t += cache.time(v, have, want, sc)
                            t += cache.time(v, gradient_layout(want), gradient_layout(have),
                                            sc)
                live = tuple(sorted(layouts.items()))
                sig = (live, params_key)
                old = grown.get(sig)
                new_key = (st.key[0] + bad, st.key[1] + t)
                if old is None or new_key < old.key:
                    grown[sig] = _State(new_key, layouts, params, done, (*st.picks, s),
                                        params_key)
        # order by cost so far plus a lower bound of what live partial sums will cost:
        # each must be reduced at least once (a reduce-scatter) before anything but a
        # linear op can read it, so a path that defers its reduction is not favoured
        def order(x: _State, k: int = k, sc: float = sc) -> tuple[float, float]:
            pending = 0.0
            for name, lay in x.layouts.items():
                if lay.partial and (last.get(name, -1) > k or name in crossing):
                    v = vals[name]
                    pending += cache.time(v, lay, _reduced(lay, v.type.shape, mesh), sc)
            return (x.key[0], x.key[1] + pending)

        beam = sorted(grown.values(), key=order)[:BEAM_WIDTH]
    return beam[0].picks


GATHERING_CLASSES = ("matmul", "attention")
"""Op classes (`cost.model.op_class`) that may gather a split input under sequence
parallelism."""


def _gathers(op: Any, s: Strategy, st: _State) -> bool:
    """Whether strategy `s` reads a value the state holds split over the tensor axis
    (not partial) as a whole."""
    for v, need in zip(op.inputs, s.inputs):
        have = st.layouts.get(v.name)
        if have is not None and not have.partial and any(have.dims) and \
                not any(need.dims):
            return True
    return False


def _reduced(lay: Layout, shape: tuple[int, ...], mesh: AbstractMesh) -> Layout:
    """`lay` with its partial sums reduced and scattered over the first dim left whole
    that they divide (all-reduced when none does)."""
    dims = list(lay.dims)
    ways = math.prod(mesh.axis_size(a) for a in lay.partial)
    free = [d for d, axes in enumerate(dims) if not axes and shape[d] % ways == 0]
    if free:
        dims[free[0]] = tuple(sorted(lay.partial))
    return Layout(tuple(dims))


def _tensor_step(a: Analysis, k: int, s: Strategy, st: _State, cache: RelayoutCache,
                 sc: float, dtype: Any, model: CostModel) -> tuple[float, float | None]:
    """(weight matrices this choice leaves replicated, seconds) for op `k`'s choice."""
    op = a.graph.ops[k]
    size = cache.axes[next(iter(cache.axes))][0]
    split = any(c[0] == "split" for _, c in s.choices)
    # forward and backward of the op (`CostModel.op_times`): its per-op host time is the
    # same for every choice, so the beam's ranking is unchanged
    f, b = model.op_times(a.op_flops[k] * sc / (size if split else 1), dtype,
                          a.op_bytes[k] * sc / (size if split else 1),
                          a.op_classes[k] if a.op_classes else "elementwise")
    t = f + b
    bad = 0.0
    for i, v in enumerate(op.inputs):
        need = s.inputs[i]
        if v.name in a.params and v.name not in st.params:
            # stored whole or split, never partial: a partial need (a row-split linear's
            # bias) is met by zeroing all copies but one, which is free
            if v.type.rank >= 2 and not need.used_axes():
                bad += 1.0
            have = Layout(need.dims)
        else:
            have = st.layouts.get(v.name) or st.params.get(v.name) or \
                Layout.replicated(v.type.rank)
        fwd, bwd = input_times(v, i, s, have, cache, sc, (v.name, need) not in st.done,
                               v.name in a.requires_grad)
        t += fwd + bwd
    return bad, t


# ---------------------------------------------------------------- combining roles

def combine(a: Analysis, k: int, mesh: AbstractMesh, roles: Mapping[str, str],
            tensor: Strategy | None) -> Strategy:
    """Op `k`'s strategy on `mesh`: each data axis (`dp`, `sdp`, or the pipeline's `mb`)
    takes the data-parallel choice, the tensor axis the tensor search's; when the two do
    not fit together (sizes that do not divide), the closest strategy that does."""
    op = a.graph.ops[k]
    data_choice = a.data_strategies[k].choices[0][1]
    tensor_choice = tensor.choices[0][1] if tensor is not None else REPLICATE
    combo = tuple(tensor_choice if roles.get(ax) in TENSOR_ROLES else data_choice
                  for ax in mesh.names)
    return strategy_for(op, mesh, combo)


def sequence_dim(a: Analysis, name: str, shape: tuple[int, ...], size: int) -> int | None:
    """The dim sequence parallelism splits value `name` along over a tensor axis of
    `size`: the first dim that is not the batch's (the data-parallel reference's) and that
    `size` divides, the last one (the hidden dim) only when no other does; None when none
    does (the value then crosses whole).

    Example:
        >>> sequence_dim(a, "blocks.0.add_1", (16, 1024, 768), 4)   # (batch, seq, hidden)
        1
    """
    ref = a.data_layouts.get(name)
    batch = {d for d, axes in enumerate(ref.dims) if DATA in axes} if ref is not None \
        else set()
    dims = [d for d in range(len(shape)) if d not in batch and shape[d] % size == 0]
    inner = [d for d in dims if d != len(shape) - 1]
    found = inner or dims
    return found[0] if found else None


def sequence_layout(a: Analysis, name: str, shape: tuple[int, ...], base: Layout,
                    axis: str, size: int) -> Layout:
    """`base` (a value's data layout) with the value also split over the tensor `axis`
    along its sequence dim (`sequence_dim`): where sequence parallelism keeps values
    between blocks."""
    d = sequence_dim(a, name, shape, size)
    if d is None or base.partial:
        return base
    dims = list(base.dims)
    dims[d] = (*dims[d], axis)
    return Layout(tuple(dims), base.partial)


def is_activation(a: Analysis, name: str) -> bool:
    """A value an op computes from the batch: what crosses blocks (not a parameter, a
    batch input, or a value of parameters alone)."""
    return name in a.defined_at and name in a.data_layouts and name not in a.params


def data_layout(a: Analysis, name: str, rank: int, data_axes: tuple[str, ...]) -> Layout:
    """The layout of value `name` with the data-parallel reference's `data` axis replaced
    by `data_axes` (outer to inner)."""
    ref = a.data_layouts.get(name)
    if ref is None:
        return Layout.replicated(rank)
    dims = tuple(tuple(ax for d in axes for ax in (data_axes if d == DATA else (d,)))
                 for axes in ref.dims)
    partial = frozenset(ax for p in ref.partial for ax in (data_axes if p == DATA else (p,)))
    return Layout(dims, partial)


def sdp_layout(v: Value, tensor: Layout, sdp_axes: tuple[str, ...],
               mesh: AbstractMesh) -> Layout:
    """Where a ZeRO-3 parameter is stored: split over the sharded-data axes along its
    first dim the tensor axis leaves alone and that divides; whole if none does."""
    ways = math.prod(mesh.axis_size(ax) for ax in sdp_axes)
    for d, size in enumerate(v.type.shape):
        if tensor.dims[d] or size % ways:
            continue
        dims = list(tensor.dims)
        dims[d] = tuple(sdp_axes)
        return Layout(tuple(dims))
    return tensor
