"""How one op runs on local shards under a strategy.

Most ops run unchanged on their local inputs. Three kinds need their call rewritten:

- shape arguments (`view(x, size)`, `expand`, `zeros(size)`, `new_ones`, `unflatten`):
  the global sizes become the output's local sizes;
- means over a split dim: each rank's mean is over its own elements, so it is scaled by
  local/global count and the outputs are partial sums that add up to the global mean;
- losses with a "mean" reduction over a split batch: the local call sums, and the result is
  divided by the global count, which for `cross_entropy`/`nll_loss` with `ignore_index` or
  class weights depends on the data, so the runtime all-reduces it (`LocalCall.count`).

`local_call` returns these rewrites as data; the lowering turns them into fx nodes and
collectives, and tests run them on a simulated mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from pxform.core.ir import Op
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.ops.registry import bind, rule_info

_SHAPE_ARGS = {"view": "size", "reshape": "shape", "_unsafe_view": "size",
               "expand": "size", "broadcast_to": "size", "zeros": "size", "ones": "size",
               "full": "size", "empty": "size", "rand": "size", "randn": "size",
               "randint": "size", "new_zeros": "size", "new_ones": "size", "new_full": "size",
               "new_empty": "size"}
_MEAN_REDUCTIONS = {"mean"}
_MEAN_LOSSES = {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                "binary_cross_entropy_with_logits", "binary_cross_entropy", "soft_margin_loss"}
_COUNTED_LOSSES = {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d"}
_MEAN = 1  # torch's Reduction::Mean
_SUM = 2


@dataclass(frozen=True, slots=True)
class CountSpec:
    """Divide the local result by a count all-reduced over `axes`: the number of targets not
    equal to `ignore_index` (weighted by `weight[target]` when the loss has class weights)."""

    axes: tuple[str, ...]
    ignore_index: int
    weighted: bool


@dataclass(frozen=True, slots=True)
class LocalCall:
    """The call to make on local shards: target, args and kwargs (with `Value`s standing
    for the local inputs), then multiply by `scale`, then divide by `count` if given."""

    target: Any
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]
    scale: float = 1.0
    count: CountSpec | None = None


def local_call(op: Op, inputs: tuple[Layout, ...], outputs: tuple[Layout, ...],
               mesh: AbstractMesh) -> LocalCall:
    """Rewrite `op` to run on local shards laid out as `inputs`, producing `outputs`.

    Example:
        >>> lc = local_call(view_op, (Layout.of(P("tp"), 2),), (Layout.of(P("tp"), 3),), mesh)
        >>> lc.args[1]   # the local size
        [4, 2, 8]
    """
    args = list(op.args)
    kwargs = dict(op.kwargs)
    name = op.name
    out_local = [lay.local_shape(v.type.shape, mesh) for lay, v in zip(outputs, op.outputs)]

    if name in _SHAPE_ARGS and outputs:
        _set_arg(op, args, kwargs, _SHAPE_ARGS[name], list(out_local[0]))
    elif name == "unflatten":
        dim = bind(op)["dim"] % op.inputs[0].type.rank
        n = len(bind(op)["sizes"])
        _set_arg(op, args, kwargs, "sizes", list(out_local[0][dim:dim + n]))

    split_contracted = _split_contracted_axes(op, inputs)
    if not split_contracted:
        return LocalCall(op.target, tuple(args), tuple(kwargs.items()))
    ways = math.prod(mesh.axis_size(a) for a in split_contracted)
    if name in _MEAN_REDUCTIONS:
        return LocalCall(op.target, tuple(args), tuple(kwargs.items()), scale=1 / ways)
    reduction = bind(op).get("reduction")
    if name in _MEAN_LOSSES and reduction == _MEAN:
        return LocalCall(op.target, tuple(args), tuple(kwargs.items()), scale=1 / ways)
    if name in _COUNTED_LOSSES and reduction == _MEAN:
        # sum locally; divide by the number of counted targets across the split axes
        _set_arg(op, args, kwargs, "reduction", _SUM)
        b = bind(op)
        has_weight = b.get("weight") is not None
        probs = op.inputs[1].type.dtype.is_floating_point
        if probs:  # soft targets: every row counts once
            return LocalCall(op.target, tuple(args), tuple(kwargs.items()), scale=1 / ways)
        return LocalCall(op.target, tuple(args), tuple(kwargs.items()),
                         count=CountSpec(split_contracted, int(b.get("ignore_index", -100)),
                                         has_weight))
    return LocalCall(op.target, tuple(args), tuple(kwargs.items()))


def _split_contracted_axes(op: Op, inputs: tuple[Layout, ...]) -> tuple[str, ...]:
    """Mesh axes that split a reduced label: some input is sharded on the axis along a dim
    whose (major) label no output carries. Partial sums passed through from inputs are not
    counted: they need no rescaling."""
    sig = rule_info(op).signature
    contracted = sig.contracted()
    axes: set[str] = set()
    for layout, terms in zip(inputs, sig.inputs):
        for term, dim_axes in zip(terms, layout.dims):
            if term and term[0] in contracted:
                axes.update(dim_axes)
    return tuple(sorted(axes))


def _set_arg(op: Op, args: list[Any], kwargs: dict[str, Any], name: str, value: Any) -> None:
    for i, arg in enumerate(op.target._schema.arguments):
        if arg.name == name:
            if i < len(args) and not arg.kwarg_only:
                args[i] = value
            else:
                kwargs[name] = value
            return
    raise KeyError(f"{op.target} has no argument {name!r}")
