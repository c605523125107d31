"""Pointwise ops with broadcasting: arithmetic, comparisons, activations, casts, dropout.

Signature: every input is aligned to the broadcast output from the right; a size-1 dim
that broadcasts is `1` (it can't be split, it is replicated). FLOPs: one per output element
(a convention; for transformers, pointwise ops are well under 1% of matmul FLOPs).
"""

from __future__ import annotations

from typing import Any

import torch

from pxform.core.ir import Op
from pxform.ops.registry import (
    OpInfo,
    bind,
    has_rule,
    norm_dim,
    overloads,
    pointwise_terms,
    register_family,
    register_rule,
    rule_info,
)
from pxform.ops.signature import LabelMaker, Signature

# Output linear jointly in all tensor inputs (partial sums pass through).
_ADDITIVE = ["add", "sub", "rsub", "neg", "positive"]
# Linear in each tensor input separately (bilinear when both are tensors).
_MULTIPLICATIVE = ["mul"]
# Linear in the first input only.
_FIRST_LINEAR = ["div", "_to_copy", "to.dtype", "to.dtype_layout", "to.device"]
_NONLINEAR = [
    "abs", "acos", "asin", "atan", "atan2", "ceil", "clamp", "clamp_min", "clamp_max", "cos",
    "cosh", "elu", "erf", "erfc", "erfinv", "exp", "exp2", "expm1", "floor", "floor_divide",
    "fmod", "frac", "gelu", "hardsigmoid", "hardswish", "hardtanh", "isinf", "isnan",
    "leaky_relu", "lerp", "log", "log10", "log1p", "log2", "logical_and", "logical_not",
    "logical_or", "logical_xor", "logit", "maximum", "minimum", "mish", "nan_to_num",
    "pow", "reciprocal", "relu", "relu6", "remainder", "round", "rsqrt", "selu", "sigmoid",
    "sign", "silu", "sin", "sinh", "softplus", "sqrt", "square", "tan", "tanh", "trunc",
    "eq", "ne", "lt", "le", "gt", "ge", "bitwise_and", "bitwise_or", "bitwise_xor",
    "bitwise_not", "__and__", "__or__", "__xor__", "__lshift__", "__rshift__", "where",
    "masked_fill", "bernoulli",
    "xlogy", "heaviside", "copysign", "hypot", "logaddexp", "sgn", "signbit",
    "addcmul", "addcdiv", "threshold", "prelu",
]


def pointwise_info(op: Op, linear: list[set[int]] | None = None) -> OpInfo:
    """The broadcasting signature of a pointwise op over all its tensor inputs."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    ins, out = pointwise_terms([v.type.shape for v in op.inputs], lm, sizes)
    sig = Signature.make(ins, [out] * len(op.outputs), sizes, linear=linear or [])
    return OpInfo(sig, sum(v.type.numel for v in op.outputs))


def _tagged_pointwise(target: object) -> bool:
    """An overload torch tags pointwise whose tensors are single tensors (not lists, as the
    _foreach ops take) and that writes nothing in place (tracing refuses those anyway)."""
    if torch.Tag.pointwise not in getattr(target, "tags", ()):
        return False
    schema = target._schema  # type: ignore[attr-defined]
    if schema.is_mutable:
        return False
    return all("[]" not in str(a.type) for a in (*schema.arguments, *schema.returns))


# Every other overload torch tags pointwise (min.other, isfinite, special functions, ...):
# the broadcasting signature, nonlinear (no partial sums pass through).
register_family(_tagged_pointwise, lambda op: pointwise_info(op))


@register_rule(*overloads(*_ADDITIVE))
def _additive(op: Op) -> OpInfo:
    # with a nonzero number as an operand (x + 2, 1 - x) the op is affine, not linear: a
    # partial sum passed through would add the number once per rank
    other = bind(op).get("other", 0)
    if isinstance(other, (int, float, complex, bool)) and other != 0:
        return pointwise_info(op)
    return pointwise_info(op, [set(range(len(op.inputs)))])


@register_rule(*overloads(*_MULTIPLICATIVE))
def _multiplicative(op: Op) -> OpInfo:
    return pointwise_info(op, [{i} for i in range(len(op.inputs))])


@register_rule(*overloads(*_FIRST_LINEAR))
def _first_linear(op: Op) -> OpInfo:
    info = pointwise_info(op, [{0}] if op.inputs else [])
    return _as_view(info) if op.name == "to" and returns_its_input(op) else info


def returns_its_input(op: Op) -> bool:
    """Is this cast (`to`, `type_as`) to the dtype its input has, without `copy=True` or
    another memory format? torch then returns the input itself: no kernel, no bytes, no
    autograd node (a Hugging Face norm's `hidden_states.to(torch.float32)` in a float32
    model), and it is priced as the view it is."""
    if not op.inputs or not op.outputs:
        return False
    if op.outputs[0].type.dtype != op.inputs[0].type.dtype:
        return False
    args = bind(op)
    return not args.get("copy", False) and args.get("memory_format") in (
        None, torch.preserve_format)


def _as_view(info: OpInfo) -> OpInfo:
    """`info` for an op that returns its input: no work, a view (`OpInfo.view`)."""
    return OpInfo(info.signature, 0, view=True)


@register_rule(*overloads("fill.Tensor"))
def _fill_tensor(op: Op) -> OpInfo:
    """`fill(x, value)` with a 0-d tensor value (`x[:, 0] = 5` in a trace)."""
    return pointwise_info(op, [{1}])


@register_rule(*overloads("copy.default"))
def _copy(op: Op) -> OpInfo:
    """`copy(x, src)` (a functionalised `x.copy_(src)`): src broadcast into x's shape and
    dtype; x gives only the shape, so the output is linear in src alone."""
    return pointwise_info(op, [{1}])


@register_rule(*overloads(*_NONLINEAR))
def _nonlinear(op: Op) -> OpInfo:
    return pointwise_info(op)


@register_rule(*overloads("tril", "triu"))
def _triangular(op: Op) -> OpInfo:
    """tril/triu depend on each element's global (row, col) position: those dims are `^`."""
    info = pointwise_info(op, [{0}])
    sig = info.signature
    last_two = {lb for term in sig.outputs[0][-2:] for lb in term}
    sig = Signature.make([list(t) for t in sig.inputs], [list(t) for t in sig.outputs],
                         dict(sig.sizes), fixed=last_two, linear=sig.linear)
    return OpInfo(sig, info.flops)


@register_rule(*overloads("native_dropout"))
def _native_dropout(op: Op) -> OpInfo:
    return pointwise_info(op)  # (output, mask): the mask never passes a partial sum


@register_rule(*overloads("dropout", "feature_dropout", "alpha_dropout"))
def _dropout(op: Op) -> OpInfo:
    """Dropout that drops nothing (p = 0, or not training) is the identity, so linear:
    partial sums pass through it (Megatron's row-parallel output can be reduce-scattered
    after the dropout). Otherwise its mask makes it nonlinear.

    The identity is also a view: torch returns the input tensor itself, no FLOPs, no
    bytes moved and no autograd node (1.3 us against an add's 18 us on a 512 KiB tensor
    here), so the cost model prices it at the per-op host time only, as a view. Priced as
    an elementwise op it was 0.3-1.9 % of GPT small's plans (9 such dropouts in a step)."""
    args = bind(op)
    if args.get("p") == 0 or args.get("train") is False:
        info = pointwise_info(op, [{0}])
        return OpInfo(info.signature, 0, view=True)
    return pointwise_info(op)


@register_rule(*overloads("glu"))
def _glu(op: Op) -> OpInfo:
    """glu halves `dim` and multiplies the halves: that dim is `^`."""
    (x,) = op.inputs
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    out = list(labels)
    out[dim] = lm()
    sizes[out[dim]] = x.type.shape[dim] // 2
    sig = Signature.make([[(lb,) for lb in labels]], [[(lb,) for lb in out]], sizes,
                         fixed={labels[dim], out[dim]})
    return OpInfo(sig, x.type.numel)


@register_rule(*overloads("to.other", "type_as"))
def _cast_like(op: Op) -> OpInfo:
    """`x.to(other)`: only `other`'s dtype matters, so any layout of it would do. Its
    leading dims of x's sizes take x's labels (RMSNorm's `out.type_as(x)`, x the
    layer's input; a padding mask cast `type_as` the embeddings): other comes split as x
    is, over the batch where x is; the rest are unrelated and kept `^`. (All kept `^`,
    other was gathered whole, and a pipeline refused Gemma and Funnel for reading the
    whole batch at once.)"""
    x, other = op.inputs
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    shared = 0
    while shared < min(x.type.rank, other.type.rank) and \
            x.type.shape[shared] == other.type.shape[shared]:
        shared += 1
    other_labels = labels[:shared] + lm.many(other.type.rank - shared)
    sizes = dict(zip(labels, x.type.shape)) | dict(zip(other_labels, other.type.shape))
    sig = Signature.make([[(lb,) for lb in labels], [(lb,) for lb in other_labels]],
                         [[(lb,) for lb in labels]], sizes,
                         fixed=set(other_labels) - set(labels), linear=[{0}])
    info = OpInfo(sig, x.type.numel)
    return _as_view(info) if returns_its_input(op) else info


@register_rule(*overloads("broadcast_tensors"))
def _broadcast_tensors(op: Op) -> OpInfo:
    """Each output is its input broadcast to the common shape (views, no FLOPs). Linear
    jointly in all inputs: a linear group makes every output partial, and output i is
    partial only if input i is."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    ins, out = pointwise_terms([v.type.shape for v in op.inputs], lm, sizes)
    sig = Signature.make(ins, [out] * len(op.outputs), sizes,
                         linear=[set(range(len(op.inputs)))])
    return OpInfo(sig, 0, view=True)


# Python-API aliases of pointwise ops (`torch.multiply`, `torch.greater`, ...): not tagged
# pointwise; each takes the rule of the op it aliases, with the same overload (bilinear
# `multiply` stays bilinear). ConvBERT calls `torch.multiply`.
_ALIASES = {"multiply": "mul", "divide": "div", "subtract": "sub", "true_divide": "div",
            "greater": "gt", "less": "lt", "greater_equal": "ge", "less_equal": "le",
            "not_equal": "ne", "negative": "neg", "absolute": "abs", "arctan2": "atan2",
            "fix": "trunc", "arccos": "acos", "arcsin": "asin", "arctan": "atan",
            "arccosh": "acosh", "arcsinh": "asinh", "arctanh": "atanh"}


def _aliased(alias: str, overload: str) -> tuple[Any, Any] | None:
    target = getattr(getattr(torch.ops.aten, alias, None), overload, None)
    packet = getattr(torch.ops.aten, _ALIASES[alias], None)
    canonical = getattr(packet, overload, None)
    if target is None or canonical is None:
        return None
    return target, canonical


def _alias_rule(canonical: Any) -> Any:
    def rule(op: Op) -> OpInfo:
        return rule_info(op.replace(target=canonical))
    return rule


for _alias in _ALIASES:
    for _overload in getattr(getattr(torch.ops.aten, _alias, None), "overloads", list)():
        _pair = _aliased(_alias, _overload)
        if _pair is not None and not has_rule(_pair[0]) and has_rule(_pair[1]):
            register_rule(_pair[0])(_alias_rule(_pair[1]))


@register_rule(*overloads("real", "imag"))
def _complex_part(op: Op) -> OpInfo:
    """The real or imaginary part of a complex tensor (a view): elementwise and linear."""
    return pointwise_info(op, [{0}])
