"""The op-rule registry: from an `Op` to its `OpInfo` (dim signature, FLOPs, view-ness).

A rule is a function `Op -> OpInfo` registered for one or more aten overloads. Families of
ops share one rule generator (pointwise, reductions, views, ...), one module each. Rules are
also derived from op metadata: a family registered with `register_family(matches, rule)`
serves every overload `matches` accepts and that has no rule of its own (the pointwise
family takes every overload torch tags `torch.Tag.pointwise`). An op with no rule fails at
trace time with its name, the user's source line and how to register
one; with `allow_fallback=True` such ops get a replicated fallback rule (every dim `^`) and
are reported.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from pxform.core.errors import RuleError, UnsupportedOpError
from pxform.core.ir import DEVICE, Op, TensorType, Value, map_values, op_name
from pxform.ops.signature import LabelMaker, Signature

aten = torch.ops.aten


@dataclass(frozen=True, slots=True)
class OpInfo:
    """What pxform knows about one op: its dim signature, forward FLOPs and whether it is a
    view (aliases its input, so it allocates nothing)."""

    signature: Signature
    flops: int
    view: bool = False


Rule = Callable[[Op], OpInfo]
_RULES: dict[Any, Rule] = {}
# (matches, rule): rules derived from op metadata, tried in registration order
_FAMILIES: list[tuple[Callable[[Any], bool], Rule]] = []
FALLBACK_TAG = "pxform.fallback"


def register_rule(*targets: Any, replace: bool = False) -> Callable[[Rule], Rule]:
    """Register `rule` for aten overloads (or packets, meaning all their overloads).

    Example:
        >>> @register_rule(torch.ops.aten.erfinv.default)
        ... def _erfinv(op):
        ...     return pointwise_info(op)
    """

    def deco(rule: Rule) -> Rule:
        for target in _expand(targets):
            if target in _RULES and not replace:
                raise RuleError(f"register_rule: {target} already has a rule; pass "
                                f"replace=True to override it")
            _RULES[target] = rule
        _INFOS.clear()  # ops seen before may take the new rule
        return rule

    return deco


def _expand(targets: Iterable[Any]) -> Iterable[Any]:
    for t in targets:
        if t is None:
            continue
        if isinstance(t, torch._ops.OpOverloadPacket):
            for name in t.overloads():
                yield getattr(t, name)
        else:
            yield t


def overloads(*names: str) -> list[Any]:
    """The aten overloads `name.overload` (or all overloads of `name`) that exist in this
    torch build; missing ones are skipped so the registry works across torch versions."""
    out = []
    for name in names:
        packet_name, _, overload = name.partition(".")
        packet = getattr(aten, packet_name, None)
        if packet is None:
            continue
        if overload:
            if overload in packet.overloads():
                out.append(getattr(packet, overload))
        else:
            out.extend(getattr(packet, o) for o in packet.overloads())
    return out


def register_family(matches: Callable[[Any], bool], rule: Rule) -> None:
    """Derive rules from op metadata: `rule` serves every overload for which `matches`
    is true and that has no rule registered for it.

    Example:
        >>> register_family(lambda t: torch.Tag.pointwise in getattr(t, "tags", ()),
        ...                 pointwise_info)
    """
    _FAMILIES.append((matches, rule))
    _INFOS.clear()


def _rule_for(target: Any) -> Rule | None:
    rule = _RULES.get(target)
    if rule is None:
        rule = next((r for matches, r in _FAMILIES if matches(target)), None)
    return rule


def has_rule(target: Any) -> bool:
    """Has `target` a rule, registered or derived from its metadata?"""
    return _rule_for(target) is not None


_INFOS: dict[int, tuple[Op, OpInfo]] = {}
"""`rule_info`'s results by the op's identity (the entry holds the op, so the identity
stays its own): planning asks about each op a dozen times, and a rule rebuilds its
signature on every call. Emptied when rules change and when it grows past `_INFOS_MAX`."""
_INFOS_MAX = 1 << 16


def rule_info(op: Op) -> OpInfo:
    """The `OpInfo` of `op`.

    Raises:
        UnsupportedOpError: the op has no rule and was not traced with the fallback.
    """
    hit = _INFOS.get(id(op))
    if hit is not None and hit[0] is op:
        return hit[1]
    info = _rule_info(op)
    if len(_INFOS) >= _INFOS_MAX:
        _INFOS.clear()
    _INFOS[id(op)] = (op, info)
    return info


def _rule_info(op: Op) -> OpInfo:
    if op.tag(FALLBACK_TAG):
        return fallback_info(op)
    rule = _rule_for(op.target)
    if rule is None:
        raise unsupported_error(op)
    try:
        return rule(op)
    except (RuleError, UnsupportedOpError):
        raise
    except Exception as exc:  # a rule that crashes is a pxform bug: say which and where
        raise RuleError(f"the rule for {op.target} failed on {op}{_where(op)}: "
                        f"{type(exc).__name__}: {exc}") from exc


def unsupported_error(op: Op, fn_name: str = "trace") -> UnsupportedOpError:
    target = op.target
    reg = (f"@pxform.ops.register_rule(torch.ops.{target})" if isinstance(
        target, torch._ops.OpOverload) else "@pxform.ops.register_rule(<target>)")
    return UnsupportedOpError(
        f"pxform.{fn_name}: op {target} ({op_name(target)}) has no sharding rule{_where(op)}.\n"
        f"  Fix: register one ({reg} on a function returning an OpInfo; see pxform/ops/), "
        f"or pass allow_fallback=True to run this op replicated.")


def _where(op: Op) -> str:
    parts = []
    if op.source:
        parts.append(f"called at {op.source}")
    if op.module:
        parts.append(f"in module {op.module}")
    return (" (" + ", ".join(parts) + ")") if parts else ""


def fallback_info(op: Op) -> OpInfo:
    """Replicated fallback: every dim of every input and output is `^` (never split)."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}

    def terms(v: Value) -> list[tuple[str, ...]]:
        out: list[tuple[str, ...]] = []
        for s in v.type.shape:
            lb = lm()
            sizes[lb] = s
            out.append((lb,))
        return out

    ins = [terms(v) for v in op.inputs]
    outs = [terms(v) for v in op.outputs]
    sig = Signature.make(ins, outs, sizes, fixed=set(sizes))
    return OpInfo(sig, sum(v.type.numel for v in op.outputs))


# ---------------------------------------------------------------- helpers for rules

def bind(op: Op) -> dict[str, Any]:
    """The op's arguments by schema name, with schema defaults filled in."""
    target = op.target
    if not isinstance(target, torch._ops.OpOverload):
        raise RuleError(f"bind: {target} is not an aten overload")
    kwargs = dict(op.kwargs)
    out: dict[str, Any] = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(op.args) and not arg.kwarg_only:
            out[arg.name] = op.args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            out[arg.name] = None
    return out


def norm_dim(dim: int, rank: int) -> int:
    """A dim index in [0, rank); rank-0 tensors accept dims 0 and -1 as torch does."""
    if rank == 0:
        return 0
    return dim % rank


def norm_dims(dims: Any, rank: int) -> list[int]:
    """Dims as a sorted list; `None` or `[]` means all dims, as in torch reductions."""
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({norm_dim(d, rank) for d in dims})


def fresh_labels(v: Value, lm: LabelMaker, sizes: dict[str, int]) -> list[str]:
    """New labels for every dim of `v`, with their sizes recorded in `sizes`."""
    labels = lm.many(v.type.rank)
    sizes.update(zip(labels, v.type.shape))
    return labels


def out_bytes(op: Op) -> int:
    return sum(v.type.nbytes for v in op.outputs)


def numel(v: Value) -> int:
    return v.type.numel


def infer_types(op: Op) -> tuple[TensorType, ...]:
    """Output types of `op`: shapes from its dim signature, dtypes from running the op on
    meta tensors (so the dtype rules are torch's own)."""
    info = rule_info(op)
    shapes = info.signature.output_shapes()
    dtypes = [t.dtype for t in meta_types(op)]
    if len(dtypes) != len(shapes):
        raise RuleError(f"the rule for {op.target} gives {len(shapes)} outputs but the op "
                        f"returns {len(dtypes)} tensors{_where(op)}")
    return tuple(TensorType(s, d) for s, d in zip(shapes, dtypes))


def meta_types(op: Op) -> list[TensorType]:
    """Output types found by running the op on meta tensors (torch's own shape and dtype
    rules, no data)."""
    def to_meta(v: Any) -> Any:
        return torch.empty(v.type.shape, dtype=v.type.dtype, device="meta")

    def fix(a: Any) -> Any:
        a = map_values(a, to_meta)
        return torch.device("meta") if a is DEVICE else a

    args = [fix(a) for a in op.args]
    kwargs = {k: fix(v) for k, v in op.kwargs}
    with torch.no_grad():
        result = op.target(*args, **kwargs)
    flat = result if isinstance(result, (list, tuple)) else [result]
    return [TensorType.of(t) for t in flat if isinstance(t, torch.Tensor)]


def pointwise_terms(shapes: list[tuple[int, ...]], lm: LabelMaker,
                    sizes: dict[str, int]) -> tuple[list[list[tuple[str, ...]]],
                                                     list[tuple[str, ...]]]:
    """Broadcasting: labels of the broadcast output, and each input's terms (size-1 dims
    that broadcast become `()`)."""
    rank = max((len(s) for s in shapes), default=0)
    out_shape = [1] * rank
    for s in shapes:
        for i, d in enumerate(s):
            j = rank - len(s) + i
            if d != 1:
                out_shape[j] = d
    out_labels = lm.many(rank)
    for lb, d in zip(out_labels, out_shape):
        sizes[lb] = d
    ins: list[list[tuple[str, ...]]] = []
    for s in shapes:
        terms: list[tuple[str, ...]] = []
        for i, d in enumerate(s):
            j = rank - len(s) + i
            terms.append(() if d == 1 and out_shape[j] != 1 else (out_labels[j],))
        ins.append(terms)
    return ins, [(lb,) for lb in out_labels]


def flops_of_contraction(sig: Signature) -> int:
    """2 x the product of every label's size: multiply-adds of an einsum-like op."""
    return 2 * math.prod(sz for _, sz in sig.sizes)
