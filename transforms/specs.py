"""From user specs to layouts: `in_specs` and `out_specs` are pytree prefixes of the
arguments and outputs (`P` and None are leaves; None is replicated). Used by `shard`, and by
a transform nested in it for the outputs (`Enclosing.out_specs`)."""

from __future__ import annotations

from typing import Any

import optree
import torch

from pxform.core.errors import SpecError
from pxform.core.ir import TensorType
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh, check_spec
from pxform.core.spec import P
from pxform.frontend.trace import Traced, arg_names, path_text


def in_spec_layouts(fn: Any, in_specs: Any, args: tuple[Any, ...], mesh: AbstractMesh,
                    name: str) -> list[Layout]:
    """The layout of every tensor leaf of `args` per `in_specs`, each checked against the
    leaf's shape and `mesh` (errors name `name` and the leaf's path in `fn`'s arguments).

    Example:
        >>> in_spec_layouts(loss_fn, (None, {"x": P("dp")}), (params, batch), mesh, "shard")
    """
    flat: Any = optree.tree_flatten_with_path(args)  # type: ignore[arg-type]
    paths, leaves, _ = flat
    specs = broadcast_specs(in_specs, args, name)
    layouts = []
    names = arg_names(fn, len(args))
    for path, leaf, spec in zip(paths, leaves, specs):
        if not isinstance(leaf, torch.Tensor):
            continue
        spec = spec if spec is not None else P()
        where = path_text((0, *path), names)  # paths as trace() names them
        check_spec(spec, tuple(leaf.shape), mesh, fn=name, path=where)
        layouts.append(Layout.of(spec, leaf.dim()))
    return layouts


def out_spec_layouts(out_specs: Any, traced: Traced, mesh: AbstractMesh, name: str
                     ) -> list[Layout | None]:
    """The layout of every output of `traced` per `out_specs` (None: all replicated); None
    for outputs that are not tensors."""
    outs = list(traced.graph.outputs)
    if out_specs is None:
        return [Layout.replicated(o.type.rank) if hasattr(o, "type") else None for o in outs]
    shaped = optree.tree_unflatten(traced.out_tree, list(outs))
    specs = broadcast_specs(out_specs, shaped, name, what="out_specs")
    paths = optree.tree_paths(shaped)  # type: ignore[arg-type]
    layouts: list[Layout | None] = []
    for path, s, o in zip(paths, specs, outs):
        if not hasattr(o, "type"):
            layouts.append(None)
            continue
        check_spec(s or P(), o.type.shape, mesh, fn=name,
                   path="output" + "".join(f"[{k!r}]" for k in path))
        layouts.append(Layout.of(s or P(), o.type.rank))
    return layouts


class _Shown(str):
    """A leaf's description that repr shows without quotes (`f32[16,4]`)."""

    def __repr__(self) -> str:
        return str(self)


def _type_text(leaf: Any) -> Any:
    return _Shown(str(TensorType.of(leaf))) if isinstance(leaf, torch.Tensor) else leaf


def broadcast_specs(specs: Any, tree: Any, name: str, what: str = "in_specs") -> list[Any]:
    """One spec per leaf of `tree`, from a pytree prefix `specs` (P and None are leaves)."""
    def is_spec(x: Any) -> bool:
        return x is None or isinstance(x, P)

    try:
        per_leaf = optree.broadcast_prefix(specs, tree, is_leaf=is_spec, none_is_leaf=True)
    except ValueError as exc:
        # optree's message prints the tree with every tensor's values: show types instead
        reason = str(exc).split(";")[0]
        shapes = optree.tree_map(_type_text, tree, none_is_leaf=True)
        raise SpecError(
            f"pxform.{name}: {what} is not a pytree prefix of the "
            f"{'arguments' if what == 'in_specs' else 'outputs'} ({reason}): {what}={specs!r} "
            f"for {shapes!r}.\n  Fix: give one spec per argument (a P, None, or a "
            f"dict/list/tuple mirroring it), e.g. in_specs=(None, {{'x': P('dp')}}).") from None
    return list(per_leaf)
