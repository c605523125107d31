"""Pooling: max, average and adaptive pooling over 1 to 3 spatial dims; and resampling
(`F.interpolate`: nearest, linear, bilinear, bicubic, trilinear, area), which is laid out
the same way.

Signature: the leading dims (batch and channels; channels alone for an unbatched input)
split freely; the spatial dims of the input and of every output are `^`, since a window
near a split would need its neighbour's rows (halos are not exchanged). Average pooling
and interpolation are linear (partial sums pass through them); max pooling is not.
FLOPs: one per input element.
"""

from __future__ import annotations

import re

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature

_MAX = [f"{p}max_pool{d}d{s}" for p in ("", "adaptive_") for d in (1, 2, 3)
        for s in ("", "_with_indices")]
_AVG = [f"{p}avg_pool{d}d" for p in ("", "adaptive_", "_adaptive_") for d in (1, 2, 3)]
_RESAMPLE = [*(f"{p}upsample_nearest{d}d" for p in ("", "_") for d in (1, 2, 3)),
             *(f"_upsample_nearest_exact{d}d" for d in (1, 2, 3)),
             "upsample_linear1d", "upsample_bilinear2d", "upsample_bicubic2d",
             "upsample_trilinear3d", "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa"]


def pooling_info(op: Op, linear: bool) -> OpInfo:
    """The pooling signature of `op` (module doc); the spatial dim count comes from the
    op's name (`..._pool2d` pools 2 dims)."""
    x = op.inputs[0]
    match = re.search(r"(\d)d(?:_aa)?$", op.name) or re.search(r"pool(\d)d", op.name)
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


@register_rule(*overloads(*_RESAMPLE))
def _resample(op: Op) -> OpInfo:
    """`F.interpolate`'s ops (BEiT resizes its relative-position tables with bilinear):
    each output element a fixed weighted sum of input elements, so linear."""
    return pooling_info(op, linear=True)


@register_rule(*overloads("grid_sampler_2d", "grid_sampler_3d", "grid_sampler"))
def _grid_sample(op: Op) -> OpInfo:
    """`F.grid_sample`: each output position reads the input where its grid point says.
    Samples and channels split; the output's positions split with the grid's; the input's
    spatial dims are `^` (any point may read anywhere); not linear in the grid."""
    x, grid = op.inputs[0], op.inputs[1]
    spatial = x.type.rank - 2
    lm = LabelMaker()
    n, c = lm.many(2)
    sizes = {n: x.type.shape[0], c: x.type.shape[1]}
    src = lm.many(spatial)
    sizes.update(zip(src, x.type.shape[2:]))
    where = lm.many(spatial)
    sizes.update(zip(where, grid.type.shape[1:-1]))
    coord = lm()
    sizes[coord] = grid.type.shape[-1]
    ins = [[(n,), (c,), *((lb,) for lb in src)], [(n,), *((lb,) for lb in where), (coord,)]]
    outs = [[(n,), (c,), *((lb,) for lb in where)]]
    return OpInfo(Signature.make(ins, outs, sizes, fixed={*src, coord}),
                  4 * op.outputs[0].type.numel)


@register_rule(*overloads("im2col", "col2im"))
def _unfold_patches(op: Op) -> OpInfo:
    """`F.unfold` / `F.fold` (ConvBERT's span convolution): sliding patches gathered into
    columns and back. Samples (dim 0 of a batched input) split; channels and positions mix
    into the column dims, so the rest is `^`. Linear."""
    x, y = op.inputs[0], op.outputs[0]
    lm = LabelMaker()
    unbatched = x.type.rank == 3 if op.name == "im2col" else x.type.rank == 2
    lead = [] if unbatched else [lm()]
    sizes = dict(zip(lead, x.type.shape[:1]))
    rest_in = lm.many(x.type.rank - len(lead))
    rest_out = lm.many(y.type.rank - len(lead))
    sizes.update(zip(rest_in, x.type.shape[len(lead):]))
    sizes.update(zip(rest_out, y.type.shape[len(lead):]))
    ins = [[*((lb,) for lb in lead), *((lb,) for lb in rest_in)]]
    outs = [[*((lb,) for lb in lead), *((lb,) for lb in rest_out)]]
    return OpInfo(Signature.make(ins, outs, sizes, fixed={*rest_in, *rest_out},
                                 linear=[{0}]), y.type.numel)
