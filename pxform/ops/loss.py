"""Losses: cross_entropy_loss, nll_loss, mse_loss, l1_loss, binary_cross_entropy_with_logits.

With reduction "mean" or "sum" the batch-like dims are reduced, so splitting them makes the
loss a partial sum (the lowering divides a mean by the global count, and by the global
number of non-ignored targets for `ignore_index`). The class dim of cross-entropy is `^`
(log-softmax over it). FLOPs: cross-entropy 6 per logit (log-softmax and pick), others 3 per
element.
"""

from __future__ import annotations

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, bind, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature, Term

_REDUCTION_NONE = 0


@register_rule(*overloads("cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"))
def _cross_entropy(op: Op) -> OpInfo:
    """input[n, c, *d] (or [c]), target[n, *d] class indices or [n, c, *d] probabilities,
    weight[c]? -> scalar, or [n, *d] with reduction "none"."""
    args = bind(op)
    x, target = args["self"], args["target"]
    weight = args.get("weight")
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    c = labels[1] if x.type.rank >= 2 else labels[0]
    rest = [lb for lb in labels if lb != c]
    x_terms: list[Term] = [(lb,) for lb in labels]
    probs = target.type.dtype.is_floating_point
    t_terms = x_terms if probs else [(lb,) for lb in rest]
    ins = [x_terms, t_terms] + ([[(c,)]] if weight is not None else [])
    none = args.get("reduction") == _REDUCTION_NONE
    out = [(lb,) for lb in rest] if none else []
    sig = Signature.make(ins, [out] * len(op.outputs), sizes, fixed={c})
    return OpInfo(sig, 6 * x.type.numel)


@register_rule(*overloads("mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                          "binary_cross_entropy_with_logits", "binary_cross_entropy",
                          "soft_margin_loss", "kl_div"))
def _elementwise_loss(op: Op) -> OpInfo:
    """Elementwise losses over same-shaped inputs, reduced over every dim unless "none"."""
    x = op.inputs[0]
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    terms: list[Term] = [(lb,) for lb in labels]
    ins = []
    for v in op.inputs:  # target, weight, pos_weight broadcast against the input
        off = x.type.rank - v.type.rank
        ins.append([() if s == 1 and x.type.shape[off + i] != 1 else terms[off + i]
                    for i, s in enumerate(v.type.shape)])
    none = bind(op).get("reduction") == _REDUCTION_NONE
    sig = Signature.make(ins, [terms if none else []], sizes)
    return OpInfo(sig, 3 * x.type.numel)
