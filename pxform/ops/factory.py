"""Factories: arange, zeros/ones/full/empty (and their _like and new_ forms), random fills,
scalar_tensor, eye; meshgrid.

Constant fills split freely: each rank makes its own shard with the local shape. `arange`,
`eye` and `linspace` are `^`: their values depend on the global position (a lowering rule
with an offset can lift this later). `*_like` outputs share their template's dims; `new_*`
take their template's dims as unrelated `^` inputs. FLOPs: one per output element.
"""

from __future__ import annotations

from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, fresh_labels, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature

_FILLS = ["zeros", "ones", "full", "empty.memory_format", "empty.names", "empty_strided",
          "new_zeros", "new_ones", "new_full", "new_empty", "new_empty_strided",
          "scalar_tensor", "rand", "randn", "randint", "randperm"]
# `*_like` ops and the functional forms of in-place fills (`normal_`, `uniform_`, `fill_`,
# `zero_`: what `torch.nn.init` calls): the output has the template's shape
_LIKE = ["zeros_like", "ones_like", "full_like", "empty_like", "rand_like", "randn_like",
         "randint_like", "normal_functional", "uniform", "fill.Scalar", "zero",
         "exponential", "geometric", "log_normal", "cauchy", "random"]
_POSITIONAL = ["arange", "eye", "linspace", "logspace", "tril_indices", "triu_indices"]


def _factory_info(op: Op, positional: bool) -> OpInfo:
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    ins = []
    fixed: set[str] = set()
    for v in op.inputs:  # templates of new_*: shape only, unrelated dims
        labels = fresh_labels(v, lm, sizes)
        fixed |= set(labels)
        ins.append([(lb,) for lb in labels])
    outs = []
    for v in op.outputs:
        labels = fresh_labels(v, lm, sizes)
        if positional:
            fixed |= set(labels)
        outs.append([(lb,) for lb in labels])
    return OpInfo(Signature.make(ins, outs, sizes, fixed=fixed),
                  sum(v.type.numel for v in op.outputs))


@register_rule(*overloads(*_FILLS))
def _fill(op: Op) -> OpInfo:
    if op.name.startswith("new_") and op.inputs and op.outputs \
            and op.outputs[0].type.shape == op.inputs[0].type.shape:
        return _like(op)  # `x.new_zeros(x.shape)` is `zeros_like(x)`: shards with x
    return _factory_info(op, positional=op.name == "randperm")


@register_rule(*overloads(*_LIKE))
def _like(op: Op) -> OpInfo:
    """`zeros_like(x)`: the output has x's dims (so a shard of x gives a shard of the
    output); the values do not depend on x, so the op is not linear in it."""
    (x,) = op.inputs
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    terms = [(lb,) for lb in labels]
    return OpInfo(Signature.make([terms], [terms], dict(zip(labels, x.type.shape))),
                  x.type.numel)


@register_rule(*overloads(*_POSITIONAL))
def _positional(op: Op) -> OpInfo:
    return _factory_info(op, positional=True)


@register_rule(*overloads("meshgrid"))
def _meshgrid(op: Op) -> OpInfo:
    """Coordinate grids from 1-D tensors (relative-position tables: BEiT, Swin): every dim
    `^`, inputs and outputs alike. Grids are built from small `arange`s, so replicated is
    what they cost; splitting them would need the grid's global positions."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    ins = [[(lb,) for lb in fresh_labels(v, lm, sizes)] for v in op.inputs]
    outs = [[(lb,) for lb in fresh_labels(v, lm, sizes)] for v in op.outputs]
    fixed = {lb for t in [*ins, *outs] for term in t for lb in term}
    return OpInfo(Signature.make(ins, outs, sizes, fixed=fixed),
                  sum(v.type.numel for v in op.outputs))
