"""Views and data movement: view/reshape/flatten/unflatten, permute/transpose, expand,
squeeze/unsqueeze, identity copies, split/chunk/unbind, cat/stack, slice/select/narrow, pad,
repeat.

Reshapes map dims by grouping runs of dims with equal products: a run of input dims merged
into one output dim is a merged term `(a b)` (and the reverse for splits), so a split on a
merged dim maps to its major factor. Runs that regroup both ways (`[6, 4] -> [4, 6]`) are
`^`. Ops that move data along a dim by position (slice, cat, pad, ...) make that dim `^`.
Views have no FLOPs; copies are counted as one FLOP per element moved.
"""

from __future__ import annotations

import math

from pxform.core.errors import RuleError
from pxform.core.ir import Op, Value
from pxform.ops.registry import OpInfo, bind, fresh_labels, norm_dim, overloads, register_rule
from pxform.ops.signature import LabelMaker, Signature, Term

_LINEAR0 = [{0}]


def _terms(labels: list[str]) -> list[Term]:
    return [(lb,) for lb in labels]


TRACED_VIEW = "pxform.traced_view"
"""Tag of an op that may copy (`MAY_COPY`) which returned a view of its input when traced
(`pxform.frontend.trace`): its input's strides allowed one, as they will when it runs, so
it costs the host's time only (the cost model's "view" class). Untagged, it is priced as
the copy it may be: the IR does not carry strides (a reshape after a transpose copies; a
flatten of a contiguous tensor does not; `contiguous` copies unless its input is)."""

MAY_COPY = frozenset({"reshape", "flatten", "unflatten", "reshape_as", "contiguous"})
"""The ops that return a view where the input's strides allow one and a copy otherwise
(`TRACED_VIEW`)."""


@register_rule(*overloads("contiguous", "clone", "alias", "detach", "lift_fresh_copy",
                          "lift_fresh", "lift", "_assert_tensor_metadata_passthrough"))
def _identity(op: Op) -> OpInfo:
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    (x,) = op.inputs
    t = _terms(fresh_labels(x, lm, sizes))
    # (`contiguous` copies unless its input was contiguous when traced: `TRACED_VIEW`)
    copies = op.name in ("clone", "lift_fresh_copy") or (
        op.name in MAY_COPY and not op.tag(TRACED_VIEW))
    return OpInfo(Signature.make([t], [t], sizes, linear=_LINEAR0),
                  x.type.numel if copies else 0, view=not copies)


def reshape_terms(in_shape: tuple[int, ...], out_shape: tuple[int, ...], lm: LabelMaker,
                  sizes: dict[str, int]) -> tuple[list[Term], list[Term], set[str]]:
    """Match two shapes of equal numel into groups; return both sides' terms and `^` labels."""
    if math.prod(in_shape) != math.prod(out_shape):
        raise RuleError(f"reshape: cannot view {list(in_shape)} as {list(out_shape)}")
    ins: list[Term] = []
    outs: list[Term] = []
    fixed: set[str] = set()
    i = j = 0
    while i < len(in_shape) or j < len(out_shape):
        # size-1 dims carry no data: they are their own group
        if i < len(in_shape) and in_shape[i] == 1:
            ins.append(())
            i += 1
            continue
        if j < len(out_shape) and out_shape[j] == 1:
            outs.append(())
            j += 1
            continue
        gi, gj = [in_shape[i]], [out_shape[j]]
        i, j = i + 1, j + 1
        while math.prod(gi) != math.prod(gj):
            if math.prod(gi) < math.prod(gj):
                gi.append(in_shape[i])
                i += 1
            else:
                gj.append(out_shape[j])
                j += 1
        if len(gi) == 1:  # one input dim -> len(gj) output dims: input is merged (x y)
            labels = lm.many(len(gj))
            sizes.update(zip(labels, gj))
            ins.append(tuple(labels))
            outs.extend((lb,) for lb in labels)
        elif len(gj) == 1:  # several input dims merged into one output dim
            labels = lm.many(len(gi))
            sizes.update(zip(labels, gi))
            ins.extend((lb,) for lb in labels)
            outs.append(tuple(labels))
        else:  # regrouped both ways: no label survives
            a, b = lm.many(len(gi)), lm.many(len(gj))
            sizes.update(zip(a, gi))
            sizes.update(zip(b, gj))
            ins.extend((lb,) for lb in a)
            outs.extend((lb,) for lb in b)
            fixed |= set(a) | set(b)
    return ins, outs, fixed


@register_rule(*overloads("view.default", "reshape", "_unsafe_view", "flatten",
                          "unflatten", "view_as", "reshape_as", "_reshape_alias"))
def _reshape(op: Op) -> OpInfo:
    x = op.inputs[0]
    out_shape = op.outputs[0].type.shape
    # The output shape is an argument of every reshape-like op; reading it from the output
    # type is equivalent and avoids resolving -1 and flatten's start/end ourselves. `check`
    # still catches a wrong output: the dtype/numel check below and meta execution.
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    expected = _reshape_target(op, x.type.shape)
    if expected is not None and expected != out_shape:
        raise RuleError(f"{op.name}: arguments give shape {list(expected)} but output is "
                        f"declared {list(out_shape)}")
    ins, outs, fixed = reshape_terms(x.type.shape, out_shape, lm, sizes)
    all_ins = [ins]
    for v in op.inputs[1:]:  # view_as / reshape_as: the template's dims are unrelated, and
        extra = fresh_labels(v, lm, sizes)  # the template (not a local shape) gives the output
        fixed |= set(extra) | {lb for t in outs for lb in t} | {lb for t in ins for lb in t}
        all_ins.append(_terms(extra))
    view = op.name in ("view", "_unsafe_view", "view_as", "_reshape_alias") or (
        op.name in MAY_COPY and bool(op.tag(TRACED_VIEW)))
    return OpInfo(Signature.make(all_ins, [outs], sizes, fixed=fixed, linear=_LINEAR0), 0,
                  view=view)


def _reshape_target(op: Op, in_shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """The output shape the op's arguments ask for (None when a template tensor gives it)."""
    args = bind(op)
    numel = math.prod(in_shape)
    if op.name in ("view", "reshape", "_unsafe_view", "_reshape_alias"):
        shape = list(args.get("size") or args.get("shape") or [])
    elif op.name == "flatten":
        rank = len(in_shape)
        if rank == 0:
            return (1,)
        s, e = norm_dim(args["start_dim"], rank), norm_dim(args["end_dim"], rank)
        return in_shape[:s] + (math.prod(in_shape[s:e + 1]),) + in_shape[e + 1:]
    elif op.name == "unflatten":
        d = norm_dim(args["dim"], len(in_shape))
        sub = list(args["sizes"])
        if -1 in sub:
            k = sub.index(-1)
            sub[k] = in_shape[d] // max(1, math.prod(s for s in sub if s != -1))
        return in_shape[:d] + tuple(sub) + in_shape[d + 1:]
    else:
        return None
    if -1 in shape:
        k = shape.index(-1)
        rest = math.prod(s for i, s in enumerate(shape) if i != k)
        shape[k] = numel // rest if rest else 0
    return tuple(int(s) for s in shape)


@register_rule(*overloads("permute", "transpose.int", "t", "swapaxes", "swapdims",
                          "movedim.int", "numpy_T", "mT", "adjoint"))
def _permute(op: Op) -> OpInfo:
    x = op.inputs[0]
    rank = x.type.rank
    args = bind(op)
    if op.name == "permute":
        perm = [norm_dim(d, rank) for d in args["dims"]]
    elif op.name in ("transpose", "swapaxes", "swapdims", "movedim"):
        keys = [k for k in args if k not in ("self",)]
        d0, d1 = (norm_dim(args[k], rank) for k in keys[:2])
        if op.name == "movedim":
            perm = [d for d in range(rank) if d != d0]
            perm.insert(d1, d0)
        else:
            perm = list(range(rank))
            perm[d0], perm[d1] = perm[d1], perm[d0]
    elif op.name in ("numpy_T",):
        perm = list(reversed(range(rank)))
    else:  # t, mT, adjoint: swap the last two dims
        perm = list(range(rank))
        if rank >= 2:
            perm[-1], perm[-2] = perm[-2], perm[-1]
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    return OpInfo(Signature.make([_terms(labels)], [[(labels[p],) for p in perm]], sizes,
                                 linear=_LINEAR0), 0, view=True)


@register_rule(*overloads("expand", "expand_as", "broadcast_to"))
def _expand(op: Op) -> OpInfo:
    """New and size-1 dims that grow get fresh output labels (splitting them shards the
    output, which each rank can produce from its replicated input)."""
    x = op.inputs[0]
    out_shape = op.outputs[0].type.shape
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    out_labels = lm.many(len(out_shape))
    sizes.update(zip(out_labels, out_shape))
    ins: list[Term] = []
    off = len(out_shape) - x.type.rank
    for i, d in enumerate(x.type.shape):
        ins.append(() if d == 1 and out_shape[off + i] != 1 else (out_labels[off + i],))
    all_ins = [ins]
    fixed: set[str] = set()
    for v in op.inputs[1:]:  # expand_as: the template, not a local shape, gives the output
        extra = fresh_labels(v, lm, sizes)
        fixed |= set(extra) | set(out_labels)
        all_ins.append(_terms(extra))
    if op.name == "expand":
        want = [int(s) for s in bind(op)["size"]]
        got = [out_shape[i] if s == -1 else s for i, s in enumerate(want)]
        if tuple(got) != out_shape:
            raise RuleError(f"expand: size {want} does not give {list(out_shape)}")
    return OpInfo(Signature.make(all_ins, [_terms(out_labels)], sizes, fixed=fixed,
                                 linear=_LINEAR0), 0, view=True)


@register_rule(*overloads("squeeze", "unsqueeze"))
def _squeeze(op: Op) -> OpInfo:
    x = op.inputs[0]
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    args = bind(op)
    if op.name == "unsqueeze":
        d = norm_dim(args["dim"], x.type.rank + 1)
        terms = _terms(labels)
        out = terms[:d] + [()] + terms[d:]
        ins = [() if s == 1 else t for s, t in zip(x.type.shape, terms)]
    else:
        dims = args.get("dim")
        drop = (set(range(x.type.rank)) if dims is None else
                {norm_dim(d, x.type.rank) for d in ([dims] if isinstance(dims, int) else dims)})
        drop = {d for d in drop if x.type.shape[d] == 1}
        ins = [() if s == 1 else (lb,) for s, lb in zip(x.type.shape, labels)]
        out = [t for d, t in enumerate(ins) if d not in drop]
    return OpInfo(Signature.make([ins], [out], sizes, linear=_LINEAR0), 0, view=True)


def _along(op: Op, x: Value, dim: int, out_sizes: list[int | None],
           view: bool) -> OpInfo:
    """Ops that cut `x` along `dim` into outputs of the given sizes (None: dim removed)."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    fixed = {labels[dim]}
    outs = []
    for s in out_sizes:
        terms = _terms(labels)
        if s is None:
            del terms[dim]
        else:
            lb = lm()
            sizes[lb] = s
            fixed.add(lb)
            terms[dim] = (lb,)
        outs.append(terms)
    flops = 0 if view else sum(v.type.numel for v in op.outputs)
    return OpInfo(Signature.make([_terms(labels)], outs, sizes, fixed=fixed,
                                 linear=_LINEAR0), flops, view=view)


@register_rule(*overloads("split", "split_with_sizes", "chunk", "tensor_split",
                          "unsafe_split", "unsafe_chunk", "unsafe_split_with_sizes"))
def _split(op: Op) -> OpInfo:
    x = op.inputs[0]
    dim = norm_dim(bind(op).get("dim", 0), x.type.rank)
    return _along(op, x, dim, [v.type.shape[dim] for v in op.outputs], view=True)


@register_rule(*overloads("unbind"))
def _unbind(op: Op) -> OpInfo:
    x = op.inputs[0]
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    return _along(op, x, dim, [None] * len(op.outputs), view=True)


@register_rule(*overloads("slice.Tensor", "narrow", "slice_inverse"))
def _slice(op: Op) -> OpInfo:
    x = op.inputs[0]
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    out = op.outputs[0].type.shape[dim]
    expected = _slice_len(op, x.type.shape[dim])
    if expected is not None and expected != out:
        raise RuleError(f"{op.name}: arguments give length {expected} but output is "
                        f"declared {out}")
    if out == x.type.shape[dim] and op.name == "slice":  # x[:, :] is the whole dim
        lm = LabelMaker()
        sizes: dict[str, int] = {}
        t = _terms(fresh_labels(x, lm, sizes))
        return OpInfo(Signature.make([t], [t], sizes, linear=_LINEAR0), 0, view=True)
    return _along(op, x, dim, [out], view=True)


def _slice_len(op: Op, n: int) -> int | None:
    args = bind(op)
    if op.name == "narrow":
        length = args["length"]
        return int(length) if isinstance(length, int) else None
    if op.name != "slice":
        return None
    start, end, step = args.get("start"), args.get("end"), args.get("step") or 1
    return len(range(n)[slice(start, end, step)])


@register_rule(*overloads("select.int"))
def _select(op: Op) -> OpInfo:
    x = op.inputs[0]
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    return _along(op, x, dim, [None], view=True)


@register_rule(*overloads("cat", "concat", "concatenate", "stack", "hstack", "vstack"))
def _cat(op: Op) -> OpInfo:
    """Concatenation: the cat dim is `^` in every input and the output; others are shared."""
    tensors = op.inputs
    out = op.outputs[0].type.shape
    args = bind(op)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    stack = op.name in ("stack",)
    dim = norm_dim(args.get("dim", 0), len(out))
    out_labels = lm.many(len(out))
    sizes.update(zip(out_labels, out))
    fixed = {out_labels[dim]}
    ins: list[list[Term]] = []
    for v in tensors:
        if v.type.rank == 1 and v.type.shape[0] == 0 and not stack:
            ins.append([(lb,) for lb in fresh_labels(v, lm, sizes)])  # legacy empty tensor
            fixed |= set(ins[-1][0])
            continue
        terms = _terms(out_labels)
        if stack:
            del terms[dim]
        else:
            lb = lm()
            sizes[lb] = v.type.shape[dim]
            fixed.add(lb)
            terms[dim] = (lb,)
        ins.append(terms)
    return OpInfo(Signature.make(ins, [_terms(out_labels)], sizes, fixed=fixed,
                                 linear=[set(range(len(tensors)))]),
                  op.outputs[0].type.numel)


_PADS = ("pad", "constant_pad_nd", *(f"{kind}_pad{d}d" for kind in ("reflection", "replication")
                                      for d in (1, 2, 3)))


@register_rule(*overloads(*_PADS, "roll", "flip", "repeat", "tile",
                          "repeat_interleave.self_int", "diff"))
def _positional(op: Op) -> OpInfo:
    """Ops that move data by position along some dims: those dims are `^` (new labels where
    the size changes), the others pass through."""
    x = op.inputs[0]
    y = op.outputs[0]
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    touched = set(_positional_dims(op, x.type.rank, len(y.type.shape)))
    lead = len(y.type.shape) - x.type.rank  # repeat may add leading dims
    out: list[Term] = []
    fixed: set[str] = set()
    for j, s in enumerate(y.type.shape):
        i = j - lead
        if i >= 0 and i not in touched and x.type.shape[i] == s:
            out.append((labels[i],))
        else:
            lb = lm()
            sizes[lb] = s
            fixed.add(lb)
            out.append((lb,))
            if i >= 0:
                fixed.add(labels[i])
    ins = [_terms(labels)]
    for v in op.inputs[1:]:
        extra = fresh_labels(v, lm, sizes)
        fixed |= set(extra)
        ins.append(_terms(extra))
    linear = _LINEAR0 if op.name in ("constant_pad_nd", "roll", "flip", "repeat", "tile") else []
    return OpInfo(Signature.make(ins, [out], sizes, fixed=fixed, linear=linear),
                  y.type.numel)


def _positional_dims(op: Op, rank: int, out_rank: int) -> list[int]:
    args = bind(op)
    if op.name in _PADS:
        n = len(args.get("pad", args.get("padding")) or []) // 2
        return list(range(rank - n, rank))
    if op.name in ("roll", "flip"):
        dims = args.get("dims") or []
        if isinstance(dims, int):
            dims = [dims]
        return [norm_dim(d, rank) for d in dims] if dims else list(range(rank))
    if op.name in ("repeat", "tile"):
        reps = list(args.get("repeats") or args.get("dims") or [])
        reps = [1] * (rank - len(reps)) + reps if len(reps) < rank else reps[-rank:] if rank else []
        return [i for i, r in enumerate(reps) if r != 1]
    dim = args.get("dim")
    return list(range(rank)) if dim is None else [norm_dim(dim, rank)]


@register_rule(*overloads("select_scatter", "slice_scatter"))
def _scatter_into(op: Op) -> OpInfo:
    """`select_scatter(x, src, dim, index)` / `slice_scatter(x, src, dim, start, end)`:
    x with a slice replaced by src (what an in-place write into a view becomes when the
    trace is functionalised). The written dim is `^` (positions move); the others are
    shared with src; the output is linear in x and src jointly."""
    x, src = op.inputs[0], op.inputs[1]
    dim = norm_dim(bind(op)["dim"], x.type.rank)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    src_labels = list(labels)
    if op.name == "select_scatter":
        del src_labels[dim]
    else:
        src_labels[dim] = lm()
        sizes[src_labels[dim]] = src.type.shape[dim]
    fixed = {labels[dim]} | ({src_labels[dim]} if op.name == "slice_scatter" else set())
    return OpInfo(Signature.make([_terms(labels), _terms(src_labels)], [_terms(labels)],
                                 sizes, fixed=fixed, linear=[{0, 1}]), src.type.numel)


@register_rule(*overloads("diagonal.default"))
def _diagonal(op: Op) -> OpInfo:
    """`diagonal(x, offset, dim1, dim2)`: a view dropping dim1 and dim2 and appending the
    diagonal; the other dims pass through, the two read and the diagonal are `^`."""
    x, y = op.inputs[0], op.outputs[0]
    args = bind(op)
    rank = x.type.rank
    d1, d2 = norm_dim(args.get("dim1", 0), rank), norm_dim(args.get("dim2", 1), rank)
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    labels = fresh_labels(x, lm, sizes)
    diag = lm()
    sizes[diag] = y.type.shape[-1]
    out = [(lb,) for d, lb in enumerate(labels) if d not in (d1, d2)] + [(diag,)]
    return OpInfo(Signature.make([_terms(labels)], [out], sizes,
                                 fixed={labels[d1], labels[d2], diag}, linear=_LINEAR0),
                  0, view=True)
