"""Indexing: embedding, index (advanced indexing), gather, index_select, scatter-likes.

The indexed dim of the source is `^`: an index on one shard may point into another
(vocabulary-parallel embedding needs a masked lookup, which a lowering rule can add later).
Dims the index tensors contribute pass through to the output and may be split. FLOPs: one
per output element.
"""

from __future__ import annotations

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, bind, fresh_labels, norm_dim, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature, Term


@register_rule(*overloads("embedding"))
def _embedding(op: Op) -> OpInfo:
    """embedding(weight[v, d], indices[...]) -> [..., d]: linear in the weight."""
    weight, indices = op.inputs
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    v, d = fresh_labels(weight, lm, sizes)
    idx = fresh_labels(indices, lm, sizes)
    out = [(lb,) for lb in idx] + [(d,)]
    sig = Signature.make([[(v,), (d,)], [(lb,) for lb in idx]], [out], sizes, fixed={v},
                         linear=[{0}])
    return OpInfo(sig, op.outputs[0].type.numel)


@register_rule(*overloads("index.Tensor", "_unsafe_index.Tensor"))
def _index(op: Op) -> OpInfo:
    """x[i0, i1, ...] with index tensors for some dims (None for the rest). The index
    tensors broadcast together; their dims go where torch puts them (in place of the indexed
    dims when those are adjacent, else in front)."""
    x = op.inputs[0]
    indices = bind(op)["indices"]
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    positions = [i for i, t in enumerate(indices) if t is not None]
    idx_values = [t for t in indices if t is not None]
    # bool masks select a data-dependent number of elements; fake tracing already rejects
    # them, so every index tensor here is an integer index.
    rank = max(v.type.rank for v in idx_values)
    shape = [1] * rank
    for v in idx_values:
        for i, s in enumerate(v.type.shape):
            if s != 1:
                shape[rank - v.type.rank + i] = s
    blabels = lm.many(rank)
    sizes.update(zip(blabels, shape))
    idx_terms: list[list[Term]] = []
    for v in idx_values:
        off = rank - v.type.rank
        idx_terms.append([() if s == 1 and shape[off + i] != 1 else (blabels[off + i],)
                          for i, s in enumerate(v.type.shape)])
    adjacent = positions == list(range(positions[0], positions[-1] + 1))
    rest: list[Term] = [(lb,) for i, lb in enumerate(labels) if i not in positions]
    bterms: list[Term] = [(lb,) for lb in blabels]
    if adjacent:
        before: list[Term] = [(labels[i],) for i in range(positions[0])]
        after: list[Term] = [(labels[i],) for i in range(positions[-1] + 1, x.type.rank)
                             if i not in positions]
        out = before + bterms + after
    else:
        out = bterms + rest
    fixed = {labels[i] for i in positions}
    x_terms: list[Term] = [(lb,) for lb in labels]
    sig = Signature.make([x_terms, *idx_terms], [out], sizes, fixed=fixed,
                         linear=[{0}])
    return OpInfo(sig, op.outputs[0].type.numel)


@register_rule(*overloads("gather", "take_along_dim"))
def _gather(op: Op) -> OpInfo:
    """gather(x, dim, index): output has index's shape; dims other than `dim` are shared
    where the sizes agree (torch allows index to be smaller there: those stay `^`)."""
    x, index = op.inputs
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    xl = fresh_labels(x, lm, sizes)
    il = list(xl)
    fixed = {xl[dim]}
    for d in range(index.type.rank):
        if d == dim or index.type.shape[d] != x.type.shape[d]:
            il[d] = lm()
            sizes[il[d]] = index.type.shape[d]
            fixed |= {il[d], xl[d]}
    sig = Signature.make([[(lb,) for lb in xl], [(lb,) for lb in il]], [[(lb,) for lb in il]],
                         sizes, fixed=fixed, linear=[{0}])
    return OpInfo(sig, op.outputs[0].type.numel)


@register_rule(*overloads("index_select"))
def _index_select(op: Op) -> OpInfo:
    x, index = op.inputs
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    xl = fresh_labels(x, lm, sizes)
    (il,) = fresh_labels(index, lm, sizes) or [lm()]
    sizes.setdefault(il, 1)
    out = [(lb,) for lb in xl]
    out[dim] = (il,)
    idx_terms = [(il,)] if index.type.rank else []
    sig = Signature.make([[(lb,) for lb in xl], idx_terms], [out], sizes, fixed={xl[dim]},
                         linear=[{0}])
    return OpInfo(sig, op.outputs[0].type.numel)


@register_rule(*overloads("scatter", "scatter_add", "scatter_reduce", "index_add",
                          "index_copy", "index_fill", "index_put", "masked_scatter"))
def _scatter(op: Op) -> OpInfo:
    """Scatters write by position: output has x's shape, every dim `^` except where all
    tensor operands share the same size (and the scatter dim)."""
    x = op.inputs[0]
    args = bind(op)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    xl = fresh_labels(x, lm, sizes)
    dim = args.get("dim")
    scatter_dims = set(range(x.type.rank)) if dim is None else {norm_dim(dim, x.type.rank)}
    fixed = {xl[d] for d in scatter_dims}
    ins = [[(lb,) for lb in xl]]
    for v in op.inputs[1:]:
        vl = fresh_labels(v, lm, sizes)
        terms = []
        for d, lb in enumerate(vl):
            if (v.type.rank == x.type.rank and d not in scatter_dims
                    and v.type.shape[d] == x.type.shape[d]):
                terms.append((xl[d],))
            else:
                fixed.add(lb)
                terms.append((lb,))
        ins.append(terms)
    sig = Signature.make(ins, [[(lb,) for lb in xl]], sizes, fixed=fixed)
    return OpInfo(sig, op.outputs[0].type.numel)
