"""Reductions: sum and mean (split reduced dims give partial sums), and the rest (max, var,
argmax, norms, logsumexp, cumsum, ...) whose reduced dims are `^`.

FLOPs: one per input element.
"""

from __future__ import annotations

from pxform.core.ir import Op
from pxform.ops.registry import (
    OpInfo,
    bind,
    fresh_labels,
    norm_dim,
    norm_dims,
    overloads,
    register_rule,
)
from pxform.ops.signature import LabelMaker, Signature, Term


def reduction_info(op: Op, dims: list[int], keepdim: bool, linear: bool) -> OpInfo:
    """Signature of reducing input 0 over `dims`; every output gets the reduced shape."""
    x = op.inputs[0]
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    out: list[Term] = []
    for d, lb in enumerate(labels):
        if d not in dims:
            out.append((lb,))
        elif keepdim:
            out.append(())
    reduced = {labels[d] for d in dims}
    ins = [[(lb,) for lb in labels]]
    # Extra tensor inputs (rare: e.g. a dtype-carrying tensor) are unrelated: their own `^` dims.
    extra_fixed: set[str] = set()
    for v in op.inputs[1:]:
        extra = fresh_labels(v, lm, sizes)
        extra_fixed |= set(extra)
        ins.append([(lb,) for lb in extra])
    sig = Signature.make(ins, [out] * len(op.outputs), sizes,
                         fixed=extra_fixed | (set() if linear else reduced),
                         linear=[{0}] if linear else [])
    return OpInfo(sig, x.type.numel)


def _dims_keepdim(op: Op) -> tuple[list[int], bool]:
    args = bind(op)
    rank = op.inputs[0].type.rank
    # overloads without a `dim` argument (sum.default, max.default) reduce every dim
    return norm_dims(args.get("dim"), rank), bool(args.get("keepdim") or False)


@register_rule(*overloads("sum", "mean", "nansum"))
def _sum(op: Op) -> OpInfo:
    dims, keepdim = _dims_keepdim(op)
    return reduction_info(op, dims, keepdim, linear=True)


@register_rule(*overloads("amax", "amin", "max.dim", "min.dim", "max.default",
                          "min.default", "argmax", "argmin", "var", "std", "var_mean",
                          "std_mean", "logsumexp", "any", "all", "prod", "linalg_vector_norm",
                          "norm", "count_nonzero", "aminmax", "median.default", "nanmean",
                          "median.dim", "mode", "kthvalue"))
def _nonlinear_reduction(op: Op) -> OpInfo:
    dims, keepdim = _dims_keepdim(op)
    return reduction_info(op, dims, keepdim, linear=False)


@register_rule(*overloads("topk", "sort", "argsort"))
def _along_dim(op: Op) -> OpInfo:
    """Selecting or ordering along one dim (topk keeps k of it, sort and argsort all):
    every other dim splits freely; the dim itself is `^` in the input and the outputs."""
    x = op.inputs[0]
    args = bind(op)
    dim = norm_dim(args.get("dim", -1), x.type.rank)
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    outs = []
    fixed = {labels[dim]} if labels else set()
    kept: dict[int, str] = {}  # topk keeps k of the dim: one label for values and indices
    for v in op.outputs:
        terms = [(lb,) for lb in labels]
        if labels and v.type.shape[dim] != x.type.shape[dim]:
            k = v.type.shape[dim]
            if k not in kept:
                kept[k] = lm()
                sizes[kept[k]] = k
                fixed.add(kept[k])
            terms[dim] = (kept[k],)
        outs.append(terms)
    sig = Signature.make([[(lb,) for lb in labels]], outs, sizes, fixed=fixed)
    return OpInfo(sig, x.type.numel)


@register_rule(*overloads("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp"))
def _scan(op: Op) -> OpInfo:
    """Scans keep the shape; the scanned dim depends on everything before it: `^`."""
    x = op.inputs[0]
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    terms = [(lb,) for lb in labels]
    sig = Signature.make([terms], [terms] * len(op.outputs), dict(zip(labels, x.type.shape)),
                         fixed={labels[dim]} if labels else set(),
                         linear=[{0}] if op.name == "cumsum" else [])
    return OpInfo(sig, x.type.numel)


@register_rule(*overloads("histc", "bincount"))
def _histogram(op: Op) -> OpInfo:
    """Counting into bins (MoE routing counts tokens per expert): the counts of a split
    input are the sums of its pieces' counts, so every input dim may split and the bins
    become partial sums; the bins themselves are `^`. Not linear in the values (a partial
    input has no histogram)."""
    x = op.inputs[0]
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    bins = lm.many(1)[0]
    sizes[bins] = op.outputs[0].type.shape[0]
    ins = [[(lb,) for lb in labels]]
    for _ in op.inputs[1:]:  # bincount's weights: split with the input
        ins.append([(lb,) for lb in labels])
    return OpInfo(Signature.make(ins, [[(bins,)]], sizes, fixed={bins}), x.type.numel)


@register_rule(*overloads("_cdist_forward", "cdist"))
def _cdist(op: Op) -> OpInfo:
    """Pairwise distances `(..., P, M), (..., R, M) -> (..., P, R)`: batch dims, and the
    points of either side, split; the coordinates `M` are `^` (a norm, not a sum)."""
    x1, x2 = op.inputs[0], op.inputs[1]
    lm = LabelMaker()
    batch = lm.many(x1.type.rank - 2)
    p, r, m = lm.many(3)
    sizes = dict(zip(batch, x1.type.shape[:-2]))
    sizes.update({p: x1.type.shape[-2], r: x2.type.shape[-2], m: x1.type.shape[-1]})
    lead = [(lb,) for lb in batch]
    return OpInfo(Signature.make([[*lead, (p,), (m,)], [*lead, (r,), (m,)]],
                                 [[*lead, (p,), (r,)]], sizes, fixed={m}),
                  3 * op.outputs[0].type.numel * x1.type.shape[-1])


_FFTS = [f"fft_{p}{k}" for p in ("", "i", "r", "ir", "h", "ih")
         for k in ("fft", "fft2", "fftn")]


@register_rule(*overloads(*_FFTS))
def _fft(op: Op) -> OpInfo:
    """Fourier transforms (FNet mixes tokens with `fftn`): the transformed dims are `^` in
    the input and the output (a new label where the size changes: rfft's half spectrum);
    every other dim splits. Linear in the input (partial sums pass through)."""
    x, y = op.inputs[0], op.outputs[0]
    args = bind(op)
    rank = x.type.rank
    dims = args.get("dim")
    if dims is None:
        dims = list(range(rank)) if op.name.endswith("n") else \
            ([rank - 2, rank - 1] if op.name.endswith("2") else [rank - 1])
    dims = norm_dims(dims if isinstance(dims, (list, tuple)) else [dims], rank)
    lm = LabelMaker()
    labels = lm.many(rank)
    sizes = dict(zip(labels, x.type.shape))
    fixed = {labels[d] for d in dims}
    out = []
    for d, size in enumerate(y.type.shape):
        if d in dims and size != x.type.shape[d]:
            lb = lm()
            sizes[lb] = size
            fixed.add(lb)
            out.append((lb,))
        else:
            out.append((labels[d],))
    return OpInfo(Signature.make([[(lb,) for lb in labels]], [out], sizes, fixed=fixed,
                                 linear=[{0}]),
                  5 * x.type.numel * max(1, len(dims)))
