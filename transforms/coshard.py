"""`pxform.coshard` (nnScaler): run a region as `chunks` pieces, one after another, on the
same devices, each piece recomputed in backward, so the region's peak activation memory
drops to about one piece's.

Like `recompute`, the transform only annotates the trace: each tensor argument is marked
with its leaf index (`pxform.regions`), and every op inside carries a `CoshardTag`. The
lowering (`pxform.lower.coshard`) splits the marked arguments along their dims, checks that
every op of the region can run on pieces with no communication (from the op rules: the same
rules that shard ops over a mesh axis), writes one copy of the region per piece, and
combines the pieces' results: concatenated where the output carries the split dim, summed
where the op reduced it (a contraction over a split hidden dim, a mean over a split batch).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from pxform.regions import COSHARD, CoshardTag, RegionError, mark, next_region, tagging
from pxform.trace import arg_names, is_tracing, path_text
from pxform.transforms.recompute import run_eagerly


@dataclass(frozen=True, eq=False)
class Cosharded:
    """A function transformed by `pxform.coshard`."""

    fn: Any
    chunks: int
    dim: Any
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The wrapped function's, so traces name the arguments as the user did."""
        try:
            return inspect.signature(self.fn)
        except (TypeError, ValueError):
            return None

    @property
    def __name__(self) -> str:
        return f"coshard({getattr(self.fn, '__name__', 'fn')})"

    def __repr__(self) -> str:
        return (f"pxform.coshard({getattr(self.fn, '__name__', 'fn')}, chunks={self.chunks}, "
                f"dim={self.dim!r})")

    def __call__(self, *args: Any) -> Any:
        if not is_tracing():
            return run_eagerly(self, args, {})
        where = f"pxform.{self.__name__}"
        dims, paths = self._leaf_dims(args, where)
        tag = CoshardTag(next_region(), self.chunks, dims, paths,
                         getattr(self.fn, "__name__", "fn"))
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


def coshard(fn: Any, *, chunks: int, dim: Any) -> Cosharded:
    """Run `fn` as `chunks` sequential pieces split along `dim`, on the same devices.

    Each piece is recomputed in backward, so only one piece's activations are alive at a
    time: the region's peak activation memory drops to about 1/chunks, for the price of one
    more forward. The results of the pieces are concatenated along the split dim, or summed
    where the region reduces over it.

    Args:
        fn: a pure function of pytrees of tensors (e.g. an attention layer or the head and
            loss of a model with a large vocabulary).
        chunks: the number of pieces; must divide every split dim.
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
    """
    if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks < 1:
        raise RegionError(f"pxform.coshard({getattr(fn, '__name__', 'fn')}): chunks must be a "
                          f"positive int, got {chunks!r}")
    return Cosharded(fn, chunks, dim)
