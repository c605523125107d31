"""Pooling: max, average and adaptive pooling over 1 to 3 spatial dims.

Signature: the leading dims (batch and channels; channels alone for an unbatched input)
split freely; the spatial dims of the input and of every output are `^`, since a window
near a split would need its neighbour's rows (halos are not exchanged). Average pooling is
linear (partial sums pass through it); max pooling is not. FLOPs: one per input element.
"""

from __future__ import annotations

import re

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature

_MAX = [f"{p}max_pool{d}d{s}" for p in ("", "adaptive_") for d in (1, 2, 3)
        for s in ("", "_with_indices")]
_AVG = [f"{p}avg_pool{d}d" for p in ("", "adaptive_", "_adaptive_") for d in (1, 2, 3)]


def pooling_info(op: Op, linear: bool) -> OpInfo:
    """The pooling signature of `op` (module doc); the spatial dim count comes from the
    op's name (`..._pool2d` pools 2 dims)."""
    x = op.inputs[0]
    match = re.search(r"pool(\d)d", op.name)
    spatial = int(match.group(1)) if match else max(x.type.rank - 2, 1)
    lm = LabelMaker()
    lead = lm.many(x.type.rank - spatial)
    sizes = dict(zip(lead, x.type.shape))
    fixed: set[str] = set()

    def spatial_terms(shape: tuple[int, ...]) -> list[tuple[str, ...]]:
        labels = lm.many(spatial)
        sizes.update(zip(labels, shape[-spatial:]))
        fixed.update(labels)
        return [(lb,) for lb in labels]

    ins = [[(lb,) for lb in lead] + spatial_terms(x.type.shape)]
    outs = [[(lb,) for lb in lead] + spatial_terms(v.type.shape) for v in op.outputs]
    sig = Signature.make(ins, outs, sizes, fixed=fixed, linear=[{0}] if linear else [])
    return OpInfo(sig, x.type.numel)


@register_rule(*overloads(*_MAX))
def _max_pool(op: Op) -> OpInfo:
    return pooling_info(op, linear=False)


@register_rule(*overloads(*_AVG))
def _avg_pool(op: Op) -> OpInfo:
    return pooling_info(op, linear=True)
