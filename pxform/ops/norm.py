"""Normalisation and softmax: the normalised dims are `^` (their statistics need every
element), the leading dims split freely.

FLOPs (a convention, per element): layer_norm 8, rms_norm 4, group_norm/batch_norm 8,
softmax 5, log_softmax 5 (max, subtract, exp, sum, divide or log).
"""

from __future__ import annotations

from pxform.core.ir import Op, Value
from pxform.ops.registry import OpInfo, bind, norm_dim, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature

_NORM_FLOPS = {"layer_norm": 8, "native_layer_norm": 8, "rms_norm": 4, "_fused_rms_norm": 4,
               "group_norm": 8, "batch_norm": 8, "instance_norm": 8}


@register_rule(*overloads("layer_norm", "rms_norm", "native_layer_norm", "_fused_rms_norm"))
def _layer_norm(op: Op) -> OpInfo:
    """layer_norm(x[..., *norm], norm_shape, weight[*norm], bias[*norm]): norm dims `^`.
    native_layer_norm's extra outputs (mean, rstd) keep the leading dims with size-1 norm dims."""
    x, *params = op.inputs
    k = len(bind(op)["normalized_shape"])
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    lead, norm = labels[: x.type.rank - k], labels[x.type.rank - k:]
    x_terms: list[tuple[str, ...]] = [(lb,) for lb in labels]
    ins = [x_terms] + [[(lb,) for lb in norm] for _ in params]
    outs: list[list[tuple[str, ...]]] = [x_terms]
    for _ in op.outputs[1:]:
        outs.append([(lb,) for lb in lead] + [()] * k)
    sig = Signature.make(ins, outs, sizes, fixed=set(norm))
    return OpInfo(sig, _NORM_FLOPS[op.name] * x.type.numel)


BATCH_STATS = "pxform.batch_stats"
"""Tag of a training-mode `batch_norm` (`pxform.frontend.trace`): "rank" when each rank (each
shard of the batch, as DDP) normalises by its own rows' statistics, "global" when the
statistics are the whole batch's (synchronised, one process's result)."""


@register_rule(*overloads("group_norm", "batch_norm", "instance_norm"))
def _channel_norm(op: Op) -> OpInfo:
    """Norms over channels or batch: only dim 0 (group/instance norm) or dim 1 (batch norm)
    may split; affine params and running stats are per channel. A training-mode batch norm
    tagged `BATCH_STATS="rank"` may also split the batch (dim 0): each piece normalises by
    its own statistics, which is the asked-for meaning, as under DDP. In eval mode batch
    norm reads its running statistics, so every dim splits."""
    x, *params = op.inputs
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    keep = labels[1] if op.name == "batch_norm" else labels[0]
    fixed = set(labels) - {keep}
    if op.name == "batch_norm" and dict(op.tags).get(BATCH_STATS) == "rank" and labels:
        fixed.discard(labels[0])
    if op.name == "batch_norm" and not bind(op).get("training"):
        fixed = set()  # eval mode: the running statistics, an affine map per element
    ch = labels[1] if x.type.rank > 1 else labels[0]
    ins = [[(lb,) for lb in labels]] + [[(ch,)] for _ in params]
    sig = Signature.make(ins, [[(lb,) for lb in labels]], sizes, fixed=fixed)
    return OpInfo(sig, _NORM_FLOPS[op.name] * x.type.numel)


@register_rule(*overloads("softmax.int", "_softmax", "log_softmax.int", "_log_softmax",
                          "_safe_softmax"))
def _softmax(op: Op) -> OpInfo:
    (x,) = op.inputs
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    terms = [(lb,) for lb in labels]
    sig = Signature.make([terms], [terms], dict(zip(labels, x.type.shape)),
                         fixed={labels[dim]} if labels else set())
    return OpInfo(sig, 5 * x.type.numel)


@register_rule(*overloads("_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
                          "native_batch_norm", "native_group_norm"))
def _native_norm(op: Op) -> OpInfo:
    """The forms `batch_norm` and `group_norm` decompose into, with their saved statistics
    as outputs: batch norm splits channels (dim 1) only, the statistics per channel with
    them; the rest is `^`. `native_group_norm` takes the global sizes (N, C, HxW) as
    arguments, so a piece cannot run it: all `^` (`group_norm` itself splits samples)."""
    x, *rest = op.inputs
    lm = LabelMaker()
    labels = lm.many(x.type.rank)
    sizes = dict(zip(labels, x.type.shape))
    keep = labels[1]
    fixed = set(labels) - ({keep} if op.name != "native_group_norm" else set())
    channels = x.type.shape[1] if x.type.rank > 1 else x.type.shape[0]
    ch = labels[1] if x.type.rank > 1 else labels[0]

    def terms(v: Value) -> list[tuple[str, ...]]:
        shape = v.type.shape
        if shape == (channels,):
            return [(ch,)]
        out: list[tuple[str, ...]] = []
        for d, size in enumerate(shape):
            if d == 0 and v.type.rank == 2 and size == x.type.shape[0]:
                out.append((labels[0],))  # group norm's (samples, groups) statistics
                continue
            lb = lm()
            sizes[lb] = size
            fixed.add(lb)
            out.append((lb,))
        return out

    ins = [[(lb,) for lb in labels]] + [terms(v) for v in rest]
    outs = [[(lb,) for lb in labels]] + [terms(v) for v in op.outputs[1:]]
    return OpInfo(Signature.make(ins, outs, sizes, fixed=fixed), 8 * x.type.numel)
