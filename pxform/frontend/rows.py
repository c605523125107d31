"""Row lookups by position, rewritten as per-row indexing.

Hugging Face builds its attention masks (`transformers.masking_utils`) by indexing the 2-D
padding mask with broadcast position tensors, `mask[arange(B)[:, None, None, None],
kv[None, None, None, :]]`: row b of the result is row b of the mask. Traced, the batch
index is an `arange(B)` of the traced batch size, a value of global positions: the
propagation cannot split it, so the mask is read whole on every rank, and a pipeline,
which runs each microbatch on its own rows, refused every such model for needing the
whole batch at once: BERT, RoBERTa, ALBERT, ELECTRA, DistilBERT and MPNet, and every
causal or seq2seq language model given a padding mask.

`rows_indexed` rewrites `index(x, [iota, i1, ...])`, where `iota` is `arange(n)` over all
of x's first dim, made a column by unsqueezes (`n` at its first dim, 1 at the others) and
the other indices are 1 there, into `index(x, [None, i1, ...])` followed by a squeeze of
the size-1 dim the other indices broadcast to: the same values, exactly, with x's first
dim passed through, so a batch split of x is a batch split of the result.

Example:
    >>> g = rows_indexed(pxform.trace(masked_loss, params, batch).graph)
    >>> [op.name for op in g.ops if op.name == "arange"]   # the row positions are gone
    []
"""

from __future__ import annotations

import torch

from pxform.core.ir import Graph, Op, TensorType, Value

_aten = torch.ops.aten
_INDEX = {_aten.index.Tensor, _aten._unsafe_index.Tensor}
_ARANGE = {_aten.arange.default, _aten.arange.start, _aten.arange.start_step}
# ops that only add size-1 dims on the way from the arange to the index
_UNSQUEEZE = {_aten.unsqueeze.default, _aten.view.default, _aten.reshape.default,
              _aten._unsafe_view.default}


def rows_indexed(graph: Graph) -> Graph:
    """`graph` with each row lookup by position (module doc) made per-row indexing, and
    the position ops no other op reads dropped. The graph itself where there is none."""
    made = graph.producers()
    rewritten: dict[int, tuple[Op, Op]] = {}
    chains: list[Op] = []
    for k, op in enumerate(graph.ops):
        if op.target not in _INDEX:
            continue
        chain = _row_positions(op, made)
        if chain is None:
            continue
        x, indices = op.args[0], op.args[1]
        out = op.outputs[0]
        rows = Value(f"{out.name}.rows",
                     TensorType((out.type.shape[0], 1, *out.type.shape[1:]), out.type.dtype))
        lookup = op.replace(args=(x, [None, *indices[1:]]), outputs=(rows,))
        squeeze = Op(_aten.squeeze.dim, (rows, 1), (out,), module=op.module,
                     source=op.source, grad=op.grad)
        rewritten[k] = (lookup, squeeze)
        chains += chain
    if not rewritten:
        return graph
    ops: list[Op] = []
    for k, op in enumerate(graph.ops):
        ops += rewritten.get(k, (op,))
    # the arange and its unsqueezes, where nothing else reads them now (latest first)
    readers: dict[str, int] = {}
    for v in [v for op in ops for v in op.inputs] + \
            [o for o in graph.outputs if isinstance(o, Value)]:
        readers[v.name] = readers.get(v.name, 0) + 1
    dropped: set[int] = set()
    for op in reversed(chains):
        if id(op) not in dropped and not any(readers.get(v.name) for v in op.outputs):
            dropped.add(id(op))
            for v in op.inputs:
                readers[v.name] -= 1
    return graph.replace(ops=tuple(op for op in ops if id(op) not in dropped))


def _row_positions(op: Op, made: dict[str, Op]) -> list[Op] | None:
    """The ops making `op`'s first index, from the arange on, where `op` is a row lookup
    by position (module doc); else None."""
    x, indices = op.args[0], op.args[1]
    if not isinstance(x, Value) or x.type.rank == 0 or not isinstance(indices, (list, tuple)) \
            or len(indices) < 2 or not all(isinstance(i, Value) for i in indices):
        return None
    first = indices[0]
    n = x.type.shape[0]
    rank = first.type.rank
    if first.type.shape != (n, *(1,) * (rank - 1)) or any(
            i.type.rank != rank or i.type.shape[0] != 1 for i in indices[1:]):
        return None
    chain: list[Op] = []
    v = first
    while (producer := made.get(v.name)) is not None and producer.target in _UNSQUEEZE:
        chain.append(producer)
        v = producer.inputs[0]
        if v.type.numel != n:
            return None
    producer = made.get(v.name)
    if producer is None or producer.target not in _ARANGE or producer.inputs \
            or v.type.shape != (n,) or v.type.dtype != torch.int64:
        return None
    bounds = [a for a in producer.args if not isinstance(a, Value)]
    start, end, step = (0, bounds[0], 1) if len(bounds) == 1 else \
        (bounds[0], bounds[1], bounds[2] if len(bounds) > 2 else 1)
    if (start, end, step) != (0, n, 1):
        return None
    return [producer, *reversed(chain)]
