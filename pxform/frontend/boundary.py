"""`pxform.stage_boundary(x)`: a marker in model code where a pipeline may cut.

The marker is an identity op, `pxform::stage_boundary`, so it survives tracing as an op of
its own at the exact place the user put it; outside `pxform.pipeline` it does nothing but
copy its input. `pxform.passes.cuts` turns the markers of a traced graph into stage cuts: the ops
after the k-th group of adjacent markers belong to stage k + 1.

Example:
    >>> def model(params, x):
    ...     x = layer(params[0], x)
    ...     x = pxform.stage_boundary(x)      # stage 0 | stage 1
    ...     return layer(params[1], x).sum()
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, fresh_labels, register_rule
from pxform.ops.signature import LabelMaker, Signature


@torch.library.custom_op("pxform::stage_boundary", mutates_args=())
def _stage_boundary(x: torch.Tensor) -> torch.Tensor:
    # a new tensor, not an alias: custom ops may not return their inputs
    return x.clone()


@_stage_boundary.register_fake
def _stage_boundary_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
    return grad


_stage_boundary.register_autograd(_backward)

STAGE_BOUNDARY = torch.ops.pxform.stage_boundary.default
"""The marker's op overload, as it appears in traced graphs."""


def stage_boundary(x: Any) -> Any:
    """Mark a pipeline stage boundary after `x` (a tensor or a pytree of tensors): under
    `pxform.pipeline` the ops that follow run on the next stage. Returns `x` unchanged in
    value.

    Example:
        >>> h = pxform.stage_boundary(h)    # cut here
    """
    return optree.tree_map(
        lambda t: _stage_boundary(t) if isinstance(t, torch.Tensor) else t, x)


def is_boundary(op: Op) -> bool:
    return op.target is STAGE_BOUNDARY


@register_rule(STAGE_BOUNDARY)
def _boundary_rule(op: Op) -> OpInfo:
    """The identity: any layout in, the same layout out."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    (x,) = op.inputs
    terms = [(lb,) for lb in fresh_labels(x, lm, sizes)]
    return OpInfo(Signature.make([terms], [terms], sizes, linear=[{0}]), 0)
