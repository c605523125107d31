"""`pxform.coshard` (nnScaler): run a region as `chunks` pieces, one after another, on the
same devices, each piece recomputed in backward, so the region's peak activation memory
drops to about one piece's.

Like `recompute`, the transform only annotates the trace: each tensor argument is marked
with its leaf index (`pxform.frontend.regions`), and every op inside carries a `CoshardTag`. The
lowering (`pxform.passes.coshard`) splits the marked arguments along their dims, checks that
every op of the region can run on pieces with no communication (from the op rules: the same
rules that shard ops over a mesh axis), writes one copy of the region per piece, and
combines the pieces' results: concatenated where the output carries the split dim, summed
where the op reduced it (a contraction over a split hidden dim, a mean over a split batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import optree
import torch

from pxform.frontend.regions import COSHARD, CoshardTag, RegionError, mark, next_region, tagging
from pxform.frontend.trace import arg_names, path_text
from pxform.transforms.base import Region


@dataclass(frozen=True, eq=False)
class Cosharded(Region):
    """`pxform.coshard(fn, chunks, dim)`: `fn` runs as `chunks` recomputed pieces, one after
    another, each on a slice of the arguments along `dim`."""

    label: ClassVar[str] = "coshard"

    fn: Any
    chunks: int
    dim: Any
    recompute: bool = True
    overlap: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    def options_text(self) -> str:
        flags = "".join(f", {k}={getattr(self, k)}" for k, default in
                        (("recompute", True), ("overlap", False))
                        if getattr(self, k) != default)
        return f", chunks={self.chunks}, dim={self.dim!r}{flags}"

    def traced_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        where = f"pxform.{self.__name__}"
        if kwargs:
            raise RegionError(f"{where}: keyword arguments {sorted(kwargs)}; coshard splits "
                              f"positional arguments only.\n  Fix: pass them positionally.")
        dims, paths = self._leaf_dims(args, where)
        tag = CoshardTag(next_region(), self.chunks, dims, paths,
                         getattr(self.fn, "__name__", "fn"), self.recompute, self.overlap)
        with tagging(COSHARD, tag, where) as active:
            if not active:  # inside another coshard: refused by tagging
                return self.fn(*args)
            counter = iter(range(len(dims)))

            def marked(t: Any) -> Any:
                return mark(t, f"in:{next(counter)}") if isinstance(t, torch.Tensor) else t

            return self.fn(*optree.tree_map(marked, args))  # type: ignore[arg-type]

    def _leaf_dims(self, args: tuple[Any, ...], where: str
                   ) -> tuple[tuple[int | None, ...], tuple[str, ...]]:
        """The split dim of every tensor leaf of `args` (None: not split), and its path."""
        spec = self.dim if isinstance(self.dim, tuple) else (self.dim,) * len(args)
        if len(spec) != len(args):
            raise RegionError(
                f"{where}: dim={self.dim!r} gives {len(spec)} entries for {len(args)} "
                f"arguments.\n  Fix: give one entry per positional argument (an int, None, or "
                f"a pytree of them), e.g. dim=(None, 0) to split the second along dim 0.")
        names = arg_names(self.fn, len(args))
        dims: list[int | None] = []
        paths: list[str] = []
        for n, (a, s) in enumerate(zip(args, spec)):
            try:
                per_leaf = optree.broadcast_prefix(s, a, none_is_leaf=True)  # type: ignore[arg-type]
            except ValueError as exc:
                raise RegionError(f"{where}: dim entry {n} ({s!r}) is not a pytree prefix of "
                                  f"argument {n}: {exc}") from None
            leaf_paths, leaves, _ = optree.tree_flatten_with_path(a)  # type: ignore[arg-type]
            for p, leaf, d in zip(leaf_paths, leaves, per_leaf):
                if not isinstance(leaf, torch.Tensor):
                    continue
                path = path_text((0, n, *p), names)
                if d is not None:
                    if not isinstance(d, int) or isinstance(d, bool):
                        raise RegionError(f"{where}: the dim for {path} must be an int or "
                                          f"None, got {d!r}")
                    if not -leaf.dim() <= d < leaf.dim():
                        raise RegionError(
                            f"{where}: {path} has shape {list(leaf.shape)}, with no dim {d}.")
                    d %= leaf.dim()
                    if leaf.shape[d] % self.chunks:
                        raise RegionError(
                            f"{where}: {path} has shape {list(leaf.shape)}; its dim {d} "
                            f"({leaf.shape[d]}) does not divide into chunks={self.chunks} "
                            f"pieces.\n  Fix: choose chunks dividing {leaf.shape[d]}, or "
                            f"coshard along another dim.")
                dims.append(d)
                paths.append(path)
        if all(d is None for d in dims):
            raise RegionError(f"{where}: dim={self.dim!r} splits no tensor argument.\n  Fix: "
                              f"give the dim to split for the activations, e.g. dim=(None, 0).")
        return tuple(dims), tuple(paths)


def coshard(fn: Any, *, chunks: int, dim: Any, recompute: bool = True,
            overlap: bool = False) -> Cosharded:
    """Run `fn` as `chunks` pieces split along `dim`, on the same devices.

    Each piece is recomputed in backward, so only one piece's activations are alive at a
    time: the region's peak activation memory drops to about 1/chunks, for the price of one
    more forward. The results of the pieces are concatenated along the split dim, or summed
    where the region reduces over it.

    With `overlap=True` (Merak's sub-pipelined tensor parallelism, torch's async TP) the
    pieces run interleaved: each piece's collectives (the all-reduce of a tensor-parallel
    block, the reduce-scatter or all-gather of sequence parallelism) are launched without
    waiting, and the next piece computes while they run; a piece waits for its collective
    where it first reads the result. Backward overlaps the same way. The result is
    exactly the one without pieces. Pieces that overlap are not recomputed (interleaved
    pieces are alive together): pass `recompute=False` with it.

    Args:
        fn: a pure function of pytrees of tensors (e.g. an attention layer or the head and
            loss of a model with a large vocabulary).
        chunks: the number of pieces; must divide every split dim.
        recompute: recompute each piece in backward (the memory saving); False keeps the
            pieces' activations, as without coshard.
        overlap: interleave the pieces so that their collectives overlap compute.
        dim: per positional argument, as `jax.vmap`'s `in_axes`: an int (split every
            tensor of that argument along that dim), None (pass it whole to every piece),
            or a pytree of those. A single int applies to every argument.

    Raises:
        RegionError: chunks not dividing a dim, or an op of the region that cannot run on
            pieces along that dim (it normalises or reduces over it): the op is named.

    Example:
        >>> attn = pxform.coshard(attention, chunks=4, dim=(None, 0))   # batch pieces
        >>> heads = pxform.coshard(attention, chunks=2,
        ...                        dim=({"wq": 0, "wk": 0, "wv": 0, "wo": 1}, None))
        >>> mlp_tp = pxform.coshard(mlp, chunks=2, dim=(None, 0), recompute=False,
        ...                         overlap=True)   # its all-reduce overlaps the next piece
    """
    where = f"pxform.coshard({getattr(fn, '__name__', 'fn')})"
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise RegionError(f"{where}: chunks must be a positive int, got {chunks!r}")
    for key, flag in (("recompute", recompute), ("overlap", overlap)):
        if not isinstance(flag, bool):
            raise RegionError(f"{where}: {key} must be True or False, got {flag!r}")
    if overlap and recompute:
        raise RegionError(
            f"{where}: overlap=True interleaves the pieces, so they are alive together and "
            f"cannot each be recomputed on its own (recompute=True, the default).\n  Fix: "
            f"pass recompute=False with overlap=True; to also save activation memory, wrap "
            f"the cosharded call in pxform.recompute.")
    return Cosharded(fn, chunks, dim, recompute, overlap)
