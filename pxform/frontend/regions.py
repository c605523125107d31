"""Region tags: what `pxform.recompute` and `pxform.coshard` leave on the ops they trace,
and the marker op that names values and region inputs.

Transforms annotate, they never run anything (DESIGN.md §5): while the user's function is
traced, a `recompute` or `coshard` region wraps its call in `torch.fx.traceback.annotate`,
so every op traced inside carries a tag (`RecomputeTag` or `CoshardTag`) in `Op.tags`.
Values are marked with `pxform::mark`, an identity op that survives tracing:

- `pxform.checkpoint_name(x, "attn")` marks `x` with `"name:attn"`; a policy can then ask
  for named values to be saved;
- a coshard region marks each tensor argument with `"in:<leaf index>"`, so the lowering
  knows which traced value is which argument and along which dim to split it.

`pxform.passes.expand.prepare` strips the markers and turns the tags into what the runtime
runs (a recompute region per tag, one per coshard piece).
"""

from __future__ import annotations

import contextvars
import itertools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from pxform.core.errors import PxformError
from pxform.core.ir import Op
from pxform.ops.registry import OpInfo, fresh_labels, register_rule
from pxform.ops.signature import LabelMaker, Signature

RECOMPUTE = "pxform.recompute"
"""Tag key of ops inside a `pxform.recompute` region (value: `RecomputeTag`)."""
COSHARD = "pxform.coshard"
"""Tag key of ops inside a `pxform.coshard` region (value: `CoshardTag`)."""
NAME = "pxform.name"
"""Tag key the lowering puts on the op producing a `checkpoint_name`d value (value: names)."""
SAVE = "pxform.save"
"""Tag key the lowering puts on recompute-region ops whose outputs the policy saves."""
PIECE = "pxform.piece"
"""Tag key the coshard expansion puts on the ops of each piece of a region whose pieces
overlap their collectives (`coshard(..., overlap=True)`; value: `PieceTag`)."""

# Ops whose outputs "save matmul outputs" keeps: the contractions (and attention, which is
# two of them), as JAX's `dots_saveable` and torch's selective-checkpoint examples do.
MATMUL_OPS = frozenset({
    "linear", "matmul", "mm", "bmm", "addmm", "addmv", "mv", "addbmm", "baddbmm", "dot",
    "vdot", "einsum", "tensordot", "conv1d", "conv2d", "conv3d", "convolution",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
})


class RegionError(PxformError):
    """A recompute or coshard region cannot be lowered as asked."""


@dataclass(frozen=True)
class Policy:
    """What a recompute region saves in forward (everything else is recomputed).

    kinds: `"nothing"` (default), `"matmuls"` (outputs of matmul-like ops), `"names"`
    (values marked with `pxform.checkpoint_name`), `"predicate"` (a function of the IR `Op`
    returning True to save its outputs).
    """

    kind: str = "nothing"
    names: tuple[str, ...] = ()
    predicate: Callable[[Op], bool] | None = None

    def saves(self, op: Op) -> bool:
        if self.kind == "matmuls":
            return op.name in MATMUL_OPS
        if self.kind == "names":
            return bool(set(op.tag(NAME, ())) & set(self.names))
        if self.kind == "predicate":
            assert self.predicate is not None
            return bool(self.predicate(op))
        return False

    def __str__(self) -> str:
        if self.kind == "names":
            return "save " + ", ".join(repr(n) for n in self.names)
        if self.kind == "predicate":
            return f"save where {getattr(self.predicate, '__name__', 'predicate')}(op)"
        return "save nothing" if self.kind == "nothing" else "save matmul outputs"


def make_policy(policy: Any, where: str) -> Policy:
    """The `Policy` for a user's `policy=` argument (see `pxform.recompute`)."""
    if policy is None or policy == "nothing":
        return Policy()
    if isinstance(policy, Policy):
        return policy
    if policy in ("matmuls", "matmul", "dots"):
        return Policy("matmuls")
    if isinstance(policy, str):
        raise RegionError(
            f"{where}: policy={policy!r} is not a policy.\n  Fix: use None (save nothing), "
            f"'matmuls', a list of names given to pxform.checkpoint_name, or a function "
            f"op -> bool; to save one named value write policy=[{policy!r}].")
    if callable(policy):
        return Policy("predicate", predicate=policy)
    if isinstance(policy, (list, tuple, set, frozenset)) and all(
            isinstance(n, str) for n in policy):
        if not policy:
            raise RegionError(f"{where}: policy is an empty list of names.\n  Fix: name the "
                              f"values to save, or pass policy=None to save nothing.")
        return Policy("names", tuple(sorted(policy)))
    raise RegionError(f"{where}: policy must be None, 'matmuls', a list of value names or a "
                      f"function op -> bool, got {type(policy).__name__} {policy!r}.")


@dataclass(frozen=True)
class RecomputeTag:
    """Ops of one call of a `pxform.recompute` function."""

    region: int
    policy: Policy
    fn: str

    def __repr__(self) -> str:
        return f"recompute#{self.region}({self.policy})"


@dataclass(frozen=True)
class CoshardTag:
    """Ops of one call of a `pxform.coshard` function: split into `chunks` pieces along
    `dims[i]` of its i-th tensor argument leaf (None: passed whole to every piece). With
    `recompute`, each piece is recomputed in backward; with `overlap`, the pieces run
    interleaved and each piece's collectives overlap the next piece's compute."""

    region: int
    chunks: int
    dims: tuple[int | None, ...]
    paths: tuple[str, ...]
    fn: str
    recompute: bool = True
    overlap: bool = False

    def __repr__(self) -> str:
        return f"coshard#{self.region}(chunks={self.chunks})"


@dataclass(frozen=True)
class PieceTag:
    """Piece `piece` of the pieces of coshard region `region` (`coshard(overlap=True)`):
    the lowering interleaves the pieces' instructions so that one piece's collectives run
    while another piece computes (`pxform.lower.overlap`)."""

    region: int
    piece: int

    def __repr__(self) -> str:
        return f"piece#{self.region}.{self.piece}"


_ids = itertools.count()


def next_region() -> int:
    """A fresh region number (renumbered in order of appearance by the lowering)."""
    return next(_ids)


# Set while an enclosing recompute or coshard region is being traced: nested regions merge
# into the outermost one (a nested recompute would only recompute what is recomputed).
_OUTER: contextvars.ContextVar[str | None] = contextvars.ContextVar("pxform_region",
                                                                   default=None)


@contextmanager
def tagging(key: str, tag: Any, where: str) -> Iterator[bool]:
    """Annotate the ops traced inside with `{key: tag}`; yields False (and annotates
    nothing) inside another region of the same kind. A coshard inside a coshard is refused."""
    import torch.fx.traceback as fx_traceback

    outer = _OUTER.get()
    if outer == COSHARD and key == COSHARD:
        raise RegionError(f"{where}: coshard regions cannot nest.\n  Fix: coshard the outer "
                          f"function only (its pieces already run one at a time).")
    if outer in (key, COSHARD):
        yield False
        return
    token = _OUTER.set(key)
    try:
        with fx_traceback.annotate({key: tag}):
            yield True
    finally:
        _OUTER.reset(token)


# ---------------------------------------------------------------- the marker op

@torch.library.custom_op("pxform::mark", mutates_args=())
def _mark(x: torch.Tensor, what: str) -> torch.Tensor:
    # a new tensor, not an alias: custom ops may not return their inputs (the lowering
    # removes the op, so the copy only exists when a traced graph is run as it is)
    return x.clone()


@_mark.register_fake
def _mark_fake(x: torch.Tensor, what: str) -> torch.Tensor:
    return torch.empty_like(x)


def _mark_backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return grad, None


_mark.register_autograd(_mark_backward)

MARK = torch.ops.pxform.mark.default
"""The marker's op overload as it appears in traced graphs."""


def mark(x: torch.Tensor, what: str) -> torch.Tensor:
    return _mark(x, what)


def is_mark(op: Op) -> bool:
    return op.target is MARK


def mark_text(op: Op) -> str:
    return str(op.args[1])


@register_rule(MARK)
def _mark_rule(op: Op) -> OpInfo:
    """The identity: any layout in, the same layout out."""
    lm = LabelMaker()
    sizes: dict[str, int] = {}
    x = op.inputs[0]
    terms = [(lb,) for lb in fresh_labels(x, lm, sizes)]
    return OpInfo(Signature.make([terms], [terms], sizes, linear=[{0}]), 0)
