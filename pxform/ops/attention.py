"""scaled_dot_product_attention.

    q[*b, h, l, e], k[*b, h, s, e], v[*b, h, s, f], mask[*b, h, l, s]? -> out[*b, h, l, f]

Batch and heads split freely (tensor parallel attention); `f` (value features) splits too,
since the output is linear in `v`. `e` and `s` feed the softmax, so they are `^`; `l`
(queries) splits unless the mask is causal, which depends on each query's global position.
With grouped-query attention (`enable_gqa`, fewer key/value heads) the head dims are `^`.
FLOPs: 2·l·s·e (scores) + 2·l·s·f (weighted sum) + 5·l·s (softmax) per batch and head.
"""

from __future__ import annotations

import math

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, bind, overloads, pointwise_terms, register_rule
from pxform.ops.signature import LabelMaker, Signature, Term


@register_rule(*overloads("scaled_dot_product_attention"))
def _sdpa(op: Op) -> OpInfo:
    args = bind(op)
    q, k, v = args["query"], args["key"], args["value"]
    mask = args.get("attn_mask")
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    # batch dims (all but the last three) broadcast among q, k, v as in matmul
    (bq, bk, bv), bout = pointwise_terms([q.type.shape[:-3], k.type.shape[:-3],
                                         v.type.shape[:-3]], lm, sizes)
    gqa = q.type.shape[-3] != k.type.shape[-3]
    h = lm()
    sizes[h] = q.type.shape[-3]
    hk = h
    if gqa:
        hk = lm()
        sizes[hk] = k.type.shape[-3]
    l_, s, e, f = lm(), lm(), lm(), lm()
    sizes.update({l_: q.type.shape[-2], s: k.type.shape[-2], e: q.type.shape[-1],
                  f: v.type.shape[-1]})
    q_terms = bq + [(h,), (l_,), (e,)]
    k_terms = bk + [(hk,), (s,), (e,)]
    v_terms = bv + [(hk,), (s,), (f,)]
    out = bout + [(h,), (l_,), (f,)]
    ins = [q_terms, k_terms, v_terms]
    fixed = {s, e}
    if gqa:
        fixed |= {h, hk}
    if args.get("is_causal"):
        fixed.add(l_)
    if mask is not None:
        full = out[:-1] + [(s,)]  # [*b, h, l, s]
        full_shape = [math.prod(sizes[lb] for lb in t) for t in full]
        m_terms: list[Term] = []
        for i, d in enumerate(mask.type.shape):
            j = len(full) - mask.type.rank + i
            m_terms.append(() if d == 1 and full_shape[j] != 1 else full[j])
        ins.append(m_terms)
    batch = math.prod(sizes[t[0]] for t in bout) * sizes[h]
    flops = batch * (2 * sizes[l_] * sizes[s] * (sizes[e] + sizes[f]) + 5 * sizes[l_] * sizes[s])
    return OpInfo(Signature.make(ins, [out], sizes, fixed=fixed, linear=[{2}]), flops)
