"""Einsum-like ops: linear, matmul, mm, bmm, addmm, baddbmm, einsum, convolutions.

Signature: batch dims and free dims pass through; the contracted dim `k` appears only in
inputs, so splitting it makes the output partial (Megatron's row-parallel linear). FLOPs:
2 x product of all label sizes (one multiply and one add per term), plus one per output
element for a bias.
"""

from __future__ import annotations

import math

from pxform.core.errors import RuleError
from pxform.core.ir import Op
from pxform.ops.registry import (
    OpInfo,
    bind,
    flops_of_contraction,
    overloads,
    pointwise_terms,
    register_rule,
)
from pxform.ops.signature import LabelMaker, Signature, Term


def _matmul_sig(a_shape: tuple[int, ...], b_shape: tuple[int, ...], lm: LabelMaker,
                sizes: dict[str, int]) -> tuple[list[Term], list[Term], list[Term]]:
    """torch.matmul semantics: 1-D operands are promoted then squeezed, batch dims broadcast."""
    if not a_shape or not b_shape:
        raise RuleError("matmul: both operands must be at least 1-D")
    k = lm()
    sizes[k] = a_shape[-1]
    m = n = None
    if len(a_shape) >= 2:
        m = lm()
        sizes[m] = a_shape[-2]
    if len(b_shape) >= 2:
        n = lm()
        sizes[n] = b_shape[-1]
    batch_a, batch_b = a_shape[:-2], b_shape[:-2]
    (ta, tb), out_batch = pointwise_terms([batch_a, batch_b], lm, sizes)
    a_terms = ta + ([(m,)] if m else []) + [(k,)]
    b_terms = tb + [(k,)] + ([(n,)] if n else [])
    out = out_batch + ([(m,)] if m else []) + ([(n,)] if n else [])
    return a_terms, b_terms, out


def _contraction(op: Op, a_shape, b_shape, bias_shape=None) -> OpInfo:  # type: ignore[no-untyped-def]
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    a, b, out = _matmul_sig(a_shape, b_shape, lm, sizes)
    flops = flops_of_contraction(Signature.make([a, b], [out], sizes))
    ins = [a, b]
    linear = [{0}, {1}]
    if bias_shape is not None:
        out_shape = [math.prod(sizes[lb] for lb in t) for t in out]
        bias_terms = _broadcast_into(bias_shape, out, out_shape)
        ins = [bias_terms, a, b]  # addmm-style: bias is the first input
        linear = [{0, 1}, {0, 2}]
        flops += math.prod(out_shape)
    sig = Signature.make(ins, [out], sizes, linear=linear)
    return OpInfo(sig, flops)


def _broadcast_into(shape: tuple[int, ...], out: list[Term], out_shape: list[int]) -> list[Term]:
    terms: list[Term] = []
    for i, d in enumerate(shape):
        j = len(out) - len(shape) + i
        terms.append(() if d == 1 and out_shape[j] != 1 else out[j])
    return terms


@register_rule(*overloads("matmul", "mm", "bmm", "dot", "mv", "vdot"))
def _matmul(op: Op) -> OpInfo:
    a, b = op.inputs
    return _contraction(op, a.type.shape, b.type.shape)


@register_rule(*overloads("addmm", "baddbmm", "addmv"))
def _addmm(op: Op) -> OpInfo:
    bias, a, b = op.inputs
    return _contraction(op, a.type.shape, b.type.shape, bias.type.shape)


@register_rule(*overloads("linear"))
def _linear(op: Op) -> OpInfo:
    """linear(x[..., k], w[n, k], b[n]) -> [..., n]: Megatron's column (split n) and row
    (split k, output partial) patterns are the two ways to split it."""
    x, w, *rest = op.inputs
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    batch = lm.many(x.type.rank - 1)
    sizes.update(zip(batch, x.type.shape[:-1]))
    k = lm()
    sizes[k] = x.type.shape[-1]
    out: list[Term] = [(lb,) for lb in batch]
    x_terms: list[Term] = [*out, (k,)]
    w_terms: list[Term]
    if w.type.rank == 1:
        w_terms = [(k,)]
    else:
        n = lm()
        sizes[n] = w.type.shape[0]
        w_terms = [(n,), (k,)]
        out.append((n,))
    ins: list[list[Term]] = [x_terms, w_terms]
    flops = 2 * math.prod(sizes.values())
    linear: list[set[int]] = [{0}, {1}]
    if rest:
        (b,) = rest
        out_shape = [math.prod(sizes[lb] for lb in t) for t in out]
        ins.append(_broadcast_into(b.type.shape, out, out_shape))
        linear = [{0, 2}, {1, 2}]
        flops += math.prod(out_shape)
    return OpInfo(Signature.make(ins, [out], sizes, linear=linear), flops)


def _einsum_tokens(spec: str) -> list[str]:
    """`"b...k"` -> `["b", "...", "k"]`."""
    out: list[str] = []
    rest = spec
    while rest:
        if rest.startswith("..."):
            out.append("...")
            rest = rest[3:]
        else:
            out.append(rest[0])
            rest = rest[1:]
    return out


@register_rule(*overloads("einsum"))
def _einsum(op: Op) -> OpInfo:
    """einsum with an explicit output (`"bij,bjk->bik"`); `...` stands for broadcast dims."""
    eq = bind(op)["equation"].replace(" ", "")
    if "->" not in eq:
        raise RuleError(f"einsum: pxform needs an explicit output in the equation, got {eq!r}")
    lhs, rhs = eq.split("->")
    specs = [_einsum_tokens(s) for s in lhs.split(",")]
    operands = op.inputs
    ell_ranks = [v.type.rank - (len(t) - 1) for t, v in zip(specs, operands) if "..." in t]
    n_ell = max(ell_ranks, default=0)
    ell = [f"e{i}" for i in range(n_ell)]
    sizes: dict[str, int] = {lb: 1 for lb in ell}
    ins: list[list[Term]] = []
    for tokens, v in zip(specs, operands):
        terms: list[Term] = []
        pos = 0
        for tok in tokens:
            if tok == "...":
                r = v.type.rank - (len(tokens) - 1)
                for lb in ell[n_ell - r:]:
                    d = v.type.shape[pos]
                    terms.append(() if d == 1 else (lb,))
                    if d != 1:
                        sizes[lb] = d
                    pos += 1
            else:
                sizes[tok] = v.type.shape[pos]
                terms.append((tok,))
                pos += 1
        ins.append(terms)
    out: list[Term] = []
    for tok in _einsum_tokens(rhs):
        out.extend([(lb,) for lb in ell] if tok == "..." else [(tok,)])
    sig = Signature.make(ins, [out], sizes, linear=[{i} for i in range(len(ins))])
    return OpInfo(sig, flops_of_contraction(sig))


def _conv_out(size: int, k: int, stride: int, pad: int, dil: int, transposed: bool,
              out_pad: int) -> int:
    if transposed:
        return (size - 1) * stride - 2 * pad + dil * (k - 1) + out_pad + 1
    return (size + 2 * pad - dil * (k - 1) - 1) // stride + 1


@register_rule(*overloads("conv1d", "conv2d", "conv3d", "convolution", "_convolution",
                          "conv_transpose1d", "conv_transpose2d", "conv_transpose3d"))
def _conv(op: Op) -> OpInfo:
    """Convolution: batch `n` and (without groups) output channels split freely; input
    channels are contracted (split -> partial); spatial dims are `^` (halos need exchange)."""
    args = bind(op)
    x, w, *rest = op.inputs
    transposed = bool(args.get("transposed", False)) or "transpose" in op.name
    nsp = w.type.rank - 2
    unbatched = x.type.rank == nsp + 1

    def per_dim(name: str, default: int) -> list[int]:
        v = args.get(name, default)
        if v is None:
            v = default
        if isinstance(v, int):
            return [v] * nsp
        return list(v) if len(v) == nsp else [v[0]] * nsp

    stride, dil = per_dim("stride", 1), per_dim("dilation", 1)
    out_pad = per_dim("output_padding", 0)
    padding = args.get("padding", 0)
    groups = int(args.get("groups", 1) or 1)
    ksz = list(w.type.shape[2:])
    xsp = list(x.type.shape[-nsp:])
    if isinstance(padding, str):
        # "same": output spatial size equals input size (torch allows it for stride 1 only)
        pad = [0] * nsp if padding == "valid" else None
    else:
        pad = per_dim("padding", 0)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    n = lm()
    ci, co = lm(), lm()
    cin = x.type.shape[-nsp - 1]
    cout = w.type.shape[1] * groups if transposed else w.type.shape[0]
    sizes.update({n: 1 if unbatched else x.type.shape[0], ci: cin, co: cout})
    s_in, s_k, s_out = lm.many(nsp), lm.many(nsp), lm.many(nsp)
    for i in range(nsp):
        sizes[s_in[i]] = xsp[i]
        sizes[s_k[i]] = ksz[i]
        sizes[s_out[i]] = xsp[i] if pad is None else _conv_out(
            xsp[i], ksz[i], stride[i], pad[i], dil[i], transposed, out_pad[i])
    wi = lm()
    sizes[wi] = w.type.shape[1]
    x_terms = ([] if unbatched else [(n,)]) + [(ci,)] + [(lb,) for lb in s_in]
    if groups == 1:
        w_terms = ([(ci,), (co,)] if transposed else [(co,), (ci,)]) + [(lb,) for lb in s_k]
    else:
        w_terms = [(w0 := lm(),), (wi,)] + [(lb,) for lb in s_k]
        sizes[w0] = w.type.shape[0]
    out = ([] if unbatched else [(n,)]) + [(co,)] + [(lb,) for lb in s_out]
    ins = [x_terms, w_terms]
    fixed = set(s_in) | set(s_k) | set(s_out)
    if groups != 1:
        fixed |= {ci, co, wi} | {t[0] for t in w_terms[:1]}
    linear: list[set[int]] = [{0}, {1}]
    if rest:
        ins.append([(co,)])
        linear = [{0, 2}, {1, 2}]
    out_numel = math.prod(sizes[t[0]] for t in out)
    flops = 2 * out_numel * (cin // groups) * math.prod(ksz) + (out_numel if rest else 0)
    return OpInfo(Signature.make(ins, [out], sizes, fixed=fixed, linear=linear), flops)
