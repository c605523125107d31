"""What the search needs to know about a traced graph, computed once.

- **blocks** from graph sharding (`pxform.passes.cuts.graph_blocks`, Merak): layers, plus the
  embedding and head around them; stage boundaries the user marked are block boundaries;
- **kinds**: blocks with the same ops on the same shapes share a kind and are solved once;
- per op: FLOPs, whether it depends on the batch (its FLOPs, saved bytes and activation
  traffic scale with the microbatch), and the bytes it saves for backward, measured on fake
  tensors for one block of each kind;
- the **data layout** of every value: the strategy each op takes when the batch inputs are
  split on their batch dim over a data axis and parameters are replicated (plain data
  parallelism, chosen by the lowering's own propagation), so a value's batch dim is known;
- which block first reads each parameter (it owns its memory).

Example:
    >>> a = analyse(prepared_graph, batch_inputs={"batch.idx", "batch.targets"})
    >>> [b.label for b in a.blocks][:2], a.num_kinds
    (['embed', 'layer 0'], 3)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from pxform.core.errors import PxformError
from pxform.core.ir import Graph, Op, Value, block_name, read_from_outside
from pxform.core.layout import LOCAL_STEPS, Layout, plan_relayout
from pxform.core.mesh import AbstractMesh
from pxform.core.spec import P
from pxform.cost.model import (
    SavedBytes,
    grad_flow,
    op_class,
    requiring_grad,
    saved_bytes_per_op,
)
from pxform.frontend.precision import INPUT_CAST
from pxform.frontend.trace import last_uses
from pxform.ops import rule_info
from pxform.ops.strategy import Strategy
from pxform.passes.cuts import block_signature, graph_blocks, module_label, strip_markers
from pxform.passes.propagate import propagate

DATA = "data"
"""The axis of the data-parallel reference propagation."""


@dataclass(frozen=True)
class BlockInfo:
    """A block: ops `[start, stop)`, its kind, and the values crossing into and out of it."""

    index: int
    label: str
    start: int
    stop: int
    kind: int
    flops: int
    params: tuple[str, ...]      # parameters this block reads first (it holds them)
    reads: tuple[str, ...]       # activations defined by earlier blocks that it reads
    crossing: tuple[str, ...]    # values defined up to this block and read after it


@dataclass(frozen=True)
class Analysis:
    graph: Graph
    blocks: tuple[BlockInfo, ...]
    batch_inputs: frozenset[str]
    params: frozenset[str]
    op_flops: tuple[int, ...]
    op_bytes: tuple[int, ...]            # bytes an op reads and writes (inputs + outputs)
    op_batch: tuple[bool, ...]
    op_saved: tuple[SavedBytes, ...]     # saved for backward at the traced batch,
                                         # by input and output (unsharded)
    data_strategies: tuple[Strategy, ...]  # per op, on a one-axis mesh DATA
    data_layouts: dict[str, Layout]      # value -> layout under data parallelism
    traced_batch: int
    marked: tuple[int, ...]              # block indices starting a user-marked stage
    kind_of_block: tuple[int, ...]
    batch_values: frozenset[str]         # values depending on the batch
    defined_at: dict[str, int]           # value -> index of the op defining it
    # why the batch cannot be cut into microbatches (an op needs values of the whole
    # batch in the forward pass: data parallelism gathers them, a pipeline cannot); None
    # when it can
    whole_batch: str | None
    value_map: dict[str, Value]          # every value by name
    # mixed precision: a parameter's cast (`INPUT_CAST`) -> its gradient's bytes in the
    # reduce dtype per byte of the cast value (float32 gradients of a bf16 copy: 2.0).
    # Priced as the parameter: gathered at use, its gradient reduced in the buckets
    param_casts: dict[str, float] = field(default_factory=dict)
    # per op, the class whose measured curve prices it (`cost.model.op_class`)
    op_classes: tuple[str, ...] = ()
    # the parameters the step differentiates (`requires_grad` marks them, `pxform.
    # value_and_grad`); the others are frozen: held, never given a gradient, optimizer
    # state or a reduction. Every parameter unless the caller says otherwise
    trainable: frozenset[str] = frozenset()
    # the values that require grad when the step runs (`cost.model.requiring_grad` from
    # `trainable`), as the search walks each kind's first block: an op reading none of
    # them has no backward, and only their gradients are re-laid out
    requires_grad: frozenset[str] = frozenset()
    # the first block an op of which, run with autograd, reads a value that requires grad
    # (the number of blocks where none does): the blocks before it (a frozen prefix) have
    # no backward, and no gradient flows back to them (`pxform.runtime.pipeline.
    # first_trained`: a pipeline sends the stages before it a token)
    first_trained: int = 0
    # per kind, what a recomputed block of it keeps (its checkpoint's inputs): the values
    # its first block reads from outside where some block of the kind reads one an earlier
    # block made. That is the first block's `reads`, and also the batch input the first of
    # a stack of layers reads where the others read the layer before (its `reads` holds
    # no input, and priced from it every layer of a recomputed residual MLP on 2 gloo
    # ranks kept none: 18-43 % under the meter, the fifty-third session)
    kind_reads: tuple[tuple[str, ...], ...] = ()
    # per model block (`block_name`: a numbered layer, or "" outside any list), the bytes
    # of its floating parameters: ZeRO-3's runtime gathers and reduce-scatters each as one
    # group (`pxform.runtime.prefetch`), which a search block may hold a part of (HF T5's
    # decoder layer spans two)
    group_bytes: Mapping[str, int] = field(default_factory=dict)

    @property
    def num_kinds(self) -> int:
        return 1 + max(self.kind_of_block, default=-1)

    def values(self) -> dict[str, Value]:
        """Every value of the graph by name."""
        return self.value_map


def analyse(graph: Graph, batch_inputs: set[str], batch_dim: int = 0,
            fn: str = "auto", trainable: Collection[str] | None = None) -> Analysis:
    """Blocks, kinds and per-op numbers of `graph` (module doc). Stage-boundary markers
    are removed; the blocks they delimit are reported in `marked`. `trainable`: the
    parameters the step differentiates (None: every floating input that is not the
    batch); the others are frozen (`Analysis.trainable`)."""
    stripped, marks = strip_markers(graph)
    graph = stripped
    batch = frozenset(batch_inputs)
    sizes = {v.type.shape[batch_dim] for v in graph.inputs if v.name in batch}
    if not sizes:
        raise PxformError(f"pxform.{fn}: no batch input: the search splits the batch of the "
                          f"arguments given by batch_argnums, and none is a tensor.")
    if len(sizes) > 1:
        raise PxformError(f"pxform.{fn}: the batch inputs disagree on the batch size (dim "
                          f"{batch_dim}): {sorted(sizes)}.")
    blocks = _blocks(graph, batch, marks)
    params = frozenset(v.name for v in graph.inputs
                       if v.name not in batch and v.type.dtype.is_floating_point)
    if trainable is None:
        learned = params
    else:
        learned = params & frozenset(trainable)
        unknown = sorted(set(trainable) - params)
        if unknown:
            raise PxformError(
                f"pxform.{fn}: trainable names {unknown[:4]}"
                f"{' ...' if len(unknown) > 4 else ''} are not floating inputs of the "
                f"traced function that are not the batch (its parameters are "
                f"{sorted(params)[:4]}{' ...' if len(params) > 4 else ''}).\n  Fix: give "
                f"names of graph inputs, as `pxform.trace(...).graph.inputs` lists them.")
    depends = set(batch)
    op_batch = []
    for op in graph.ops:
        on = any(v.name in depends for v in op.inputs)
        if on:
            depends.update(v.name for v in op.outputs)
        op_batch.append(on)
    infos_of = [rule_info(op) for op in graph.ops]
    op_flops = tuple(i.flops for i in infos_of)
    op_classes = tuple(op_class(op.target, i.view, dict(op.kwargs))
                       for op, i in zip(graph.ops, infos_of))
    op_bytes = tuple(sum(v.type.numel * v.type.dtype.itemsize
                         for v in (*op.inputs, *op.outputs) if hasattr(v, "type"))
                     for op in graph.ops)
    # kinds: same ops on the same shapes
    ids: dict[tuple, int] = {}
    # (and the same parameters frozen: a frozen layer has no weight gradients, keeps no
    # optimizer state and may have no backward at all, unlike a trained one beside it)
    signatures = [block_signature(graph.ops[a:b]) for a, b, _ in blocks]
    kind_of = [ids.setdefault((sig, _frozen_mask(graph.ops[a:b], params, learned)), len(ids))
               for sig, (a, b, _) in zip(signatures, blocks)]
    shapes: dict[tuple, int] = {}
    shape_of = [shapes.setdefault(sig, len(shapes)) for sig in signatures]
    saved: list[SavedBytes] = [SavedBytes((), (), 0)] * len(graph.ops)
    skip = set(batch) | set(params)
    # per kind, at each position of the values its blocks read from outside, whether
    # every block reads a stored value there (a parameter, a batch input such as a mask)
    stored_at: dict[int, list[bool]] = {}
    # and whether some block reads a value there that requires grad when the step runs
    # (the step differentiates the parameters): an op reading it saves what its
    # gradient needs. The first of a stack of layers reads the batch where the others
    # read an activation, and its first matmul saves no weight for the batch's gradient
    grads = requiring_grad(graph, learned)
    grad_at: dict[int, list[bool]] = {}
    for (a, b, _), k in zip(blocks, kind_of):
        outside = read_from_outside(graph.ops[a:b])
        here = [v.name in skip for v in outside]
        before = stored_at.get(k)
        stored_at[k] = here if before is None else [x and y for x, y in zip(before, here)]
        needs = [v.name in grads for v in outside]
        before = grad_at.get(k)
        grad_at[k] = needs if before is None else [x or y for x, y in zip(before, needs)]
    done: dict[int, list[SavedBytes]] = {}
    kind_reads: dict[int, tuple[str, ...]] = {}
    # what requires grad as the search walks each kind's first block: the whole graph's,
    # and in that block what it makes from a value read where some block of the kind
    # reads one requiring grad (`seeded`, below), as its saved bytes are measured
    requires = set(grads)
    for (a, b, _), k in zip(blocks, kind_of):
        # (a kind's blocks share the first one's: its `stored` names that block's
        # parameters, as the search walks the first block of each kind). A value the first
        # block reads from the batch where the others read an activation (a stack of
        # layers, the first on the input) is counted as the others save it: skipped, the
        # layer norm's saved input went uncounted in every block of the kind
        if k not in done:
            outside = read_from_outside(graph.ops[a:b])
            own = {v.name for v, kept in zip(outside, stored_at[k]) if not kept}
            kind_reads[k] = tuple(v.name for v in outside if v.name in own and v.name in depends)
            seeded = {v.name for v, need in zip(outside, grad_at[k]) if need}
            done[k] = saved_bytes_per_op(graph, a, b, (skip - own) | set(params),
                                         grads | seeded)
            requires |= grad_flow(graph.ops[a:b], seeded)
    _saved_by_readers(graph, blocks, kind_of, done)
    for (a, b, _), k in zip(blocks, kind_of):
        saved[a:b] = done[k]
    # the reference data axis: the smallest split of the batch there is (2 for even
    # batches), so the propagation can split it; which dims carry the batch is all it
    # tells, whatever the real data axes' sizes
    traced = next(iter(sizes))
    ways = next((d for d in range(2, traced + 1) if traced % d == 0), 1)
    data_mesh = AbstractMesh({DATA: ways})
    in_layouts = [Layout.of(_batch_spec(v, batch_dim), v.type.rank) if v.name in batch
                  else Layout.replicated(v.type.rank) for v in graph.inputs]
    strategies = propagate(graph, data_mesh, in_layouts)
    layouts = {v.name: lay for v, lay in zip(graph.inputs, in_layouts)}
    for c in graph.constants:
        layouts[c.value.name] = Layout.replicated(c.value.type.rank)
    whole_batch = None
    for op, s in zip(graph.ops, strategies):
        for i, v in enumerate(op.inputs):
            if whole_batch is None and _gathers_batch(v, layouts[v.name], s.inputs[i],
                                                      data_mesh):
                whole_batch = f"{op} at {op.source or 'an unknown line'} reads %{v.name} " \
                              f"({v.type}) across the whole batch"
        for v, lay in zip(op.outputs, s.outputs):
            layouts[v.name] = lay
    infos = _block_infos(graph, blocks, kind_of, params, depends, shape_of)
    marked = tuple(i for i, (_, _, m) in enumerate(blocks) if m)
    defined_at = {v.name: k for k, op in enumerate(graph.ops) for v in op.outputs}
    return Analysis(graph, infos, batch, params, op_flops, op_bytes, tuple(op_batch), tuple(saved),
                    tuple(strategies), layouts, traced, marked, tuple(kind_of),
                    frozenset(depends), defined_at, whole_batch,
                    {v.name: v for v in graph.values()}, _param_casts(graph, params),
                    op_classes, learned, frozenset(requires),
                    next((k for k, (a, b, _) in enumerate(blocks)
                          if any(op.grad and any(v.name in grads for v in op.inputs)
                                 for op in graph.ops[a:b])), len(blocks)),
                    tuple(kind_reads[k] for k in range(len(kind_reads))),
                    group_bytes([v for v in graph.inputs if v.name in params]))


def group_bytes(params: Collection[Value]) -> dict[str, int]:
    """Bytes of the floating parameters `params` per model block (`block_name`), as
    ZeRO-3's runtime groups them (`Analysis.group_bytes`).

    Example:
        >>> group_bytes([Value("layers.0.w", TensorType((2, 2), torch.float32))])
        {'layers.0': 16}
    """
    out: dict[str, int] = {}
    for v in params:
        if v.type.dtype.is_floating_point:
            name = block_name(v.name)
            out[name] = out.get(name, 0) + v.type.nbytes
    return out


def _saved_by_readers(graph: Graph, blocks: Sequence[tuple[int, int, bool]],
                      kind_of: Sequence[int], done: dict[int, list[SavedBytes]]) -> None:
    """Count a block's saved output once, for the later block that saves it too: in
    `done` (per kind, its first block's `SavedBytes`), the bytes an op saves of an output
    are taken off where, in every block of its kind, a later block's op reading that
    output saves it as well. A block measures its saves alone, so the storage was counted
    by both: a CNN layer ends in a ReLU, which saves its output, and the next begins with
    a convolution, which saves its input (HF RegNet's saved bytes came out 17 % over the
    meter; the fifty-third session). The reader's count stands: it keeps the value when
    the producer is recomputed, and when the reader is (its checkpoint's input, `kept`).

    A kind's last block is not asked: what follows a stack (a pooling head) may not save
    its output, and as the blocks of a kind share one cost that block's output then goes
    uncounted (one layer's output, where the stack's other layers had each been counted
    twice). Nor is the layout asked: where the two blocks lay the value out apart the
    reader saves a re-laid-out copy of its own, and the producer's is uncounted."""
    op_block = _op_blocks(len(graph.ops), blocks)
    readers: dict[str, list[tuple[int, int]]] = {}
    for i, op in enumerate(graph.ops):
        for n, v in enumerate(op.inputs):
            readers.setdefault(v.name, []).append((i, n))
    members: dict[int, list[int]] = {}
    for j, k in enumerate(kind_of):
        members.setdefault(k, []).append(j)

    def saves_later(name: str, j: int) -> bool:
        for i, n in readers.get(name, ()):
            block = op_block[i]
            if block <= j:
                continue
            # (a kind's blocks have the same ops at the same offsets as its first)
            got = done[kind_of[block]][i - blocks[block][0]]
            if got.inputs and got.inputs[n] > 0:
                return True
        return False

    for k, js in members.items():
        fixed = list(done[k])
        for off, s in enumerate(fixed):
            if not any(s.outputs):
                continue
            outs = list(s.outputs)
            for i, nbytes in enumerate(outs):
                if nbytes and all(saves_later(graph.ops[blocks[j][0] + off].outputs[i].name, j)
                                  for j in js[:-1] or js):
                    outs[i] = 0
            if outs != list(s.outputs):
                fixed[off] = dataclasses.replace(s, outputs=tuple(outs))
        done[k] = fixed


def _op_blocks(num_ops: int, blocks: Sequence[tuple[int, int, bool]]) -> list[int]:
    """Per op, the index of the block it is in."""
    out = [0] * num_ops
    for k, (a, b, _) in enumerate(blocks):
        for i in range(a, b):
            out[i] = k
    return out


def _frozen_mask(ops: Sequence[Op], params: frozenset[str], learned: frozenset[str]
                 ) -> tuple[bool, ...]:
    """Per parameter read by `ops`, in order, whether it is frozen (not in `learned`)."""
    return tuple(v.name not in learned for op in ops for v in op.inputs if v.name in params)


def _param_casts(graph: Graph, params: frozenset[str]) -> dict[str, float]:
    out = {}
    for op in graph.ops:
        reduce = op.tag(INPUT_CAST, False)
        if reduce is not False and op.inputs[0].name in params:
            cast = op.outputs[0].type.dtype
            grad = reduce if reduce is not None else op.inputs[0].type.dtype
            out[op.outputs[0].name] = grad.itemsize / cast.itemsize
    return out


def _gathers_batch(v: Value, have: Layout, need: Layout, mesh: AbstractMesh) -> bool:
    """Does converting `v` from `have` to `need` gather or reduce over the data axis in
    the forward pass?"""
    if have == need or DATA not in have.used_axes() | have.partial:
        return False
    steps = plan_relayout(v.type.shape, v.type.dtype.itemsize, have, need, mesh).steps
    return any(st.axis == DATA and st.kind not in LOCAL_STEPS for st in steps)


def _batch_spec(v: Value, batch_dim: int):  # type: ignore[no-untyped-def]
    return P(*([None] * batch_dim), DATA)


def _blocks(graph: Graph, batch: frozenset[str], marks: Sequence[int]
            ) -> list[tuple[int, int, bool]]:
    """(start, stop, starts a marked stage) per block: graph sharding's blocks, split
    again at the user's stage-boundary markers."""
    cuts = sorted(set(marks))
    out: list[tuple[int, int, bool]] = []
    for blk in graph_blocks(graph, set(batch)):
        edges = [blk.start, *[m for m in cuts if blk.start < m < blk.stop], blk.stop]
        for a, b in zip(edges, edges[1:]):
            out.append((a, b, a in cuts))
    return out


def _block_infos(graph: Graph, blocks: Sequence[tuple[int, int, bool]], kind_of: Sequence[int],
                 params: frozenset[str], depends: set[str], shape_of: Sequence[int]
                 ) -> tuple[BlockInfo, ...]:
    """Per block its `BlockInfo`; `shape_of` numbers blocks of the same ops alike (a
    frozen layer is a kind of its own, but labelled as the layer it is)."""
    op_block = _op_blocks(len(graph.ops), blocks)
    defined_in = {v.name: op_block[i] for i, op in enumerate(graph.ops) for v in op.outputs}
    last = last_uses(graph)
    owner: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        for v in op.inputs:
            if v.name in params:
                owner.setdefault(v.name, op_block[i])
    infos = []
    layer = 0
    num = len(blocks)
    for k, (a, b, _) in enumerate(blocks):
        reads: dict[str, None] = {}
        for op in graph.ops[a:b]:
            for v in op.inputs:
                if defined_in.get(v.name, k) < k and v.name in depends:
                    reads[v.name] = None
        crossing = tuple(sorted(name for name, blk in defined_in.items()
                                if blk <= k and last.get(name, -1) >= b and k < num - 1))
        label = module_label(graph.ops[a:b])
        if not label:
            same = sum(1 for j in range(num) if shape_of[j] == shape_of[k]) > 1
            label = f"layer {layer}" if same else ("embed" if k == 0 else
                                                   "head" if k == num - 1 else f"block {k}")
            layer += same
        flops = sum(rule_info(op).flops for op in graph.ops[a:b])
        infos.append(BlockInfo(k, label, a, b, kind_of[k], flops,
                               tuple(sorted(p for p, o in owner.items() if o == k)),
                               tuple(reads), crossing))
    return tuple(infos)

