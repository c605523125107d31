"""`pxform.shard`: run a function SPMD over a mesh with the given input and output specs.

    step = pxform.shard(loss_fn, mesh=mesh,
                        in_specs=({"w1": P("tp", None), "w2": P("tp", None)}, {"x": P("dp")}))
    loss = step(params, batch)              # full tensors (sliced locally) or DTensors
    print(step.lower(params, batch).as_text())

Specs are pytree prefixes of the arguments: `None` means replicated, a `P` lays out every
tensor below it. Values inside get strategies by propagation (`pxform.lower.spmd.propagate`,
the least forward communication); the search of a later issue replaces it. Each input
signature (shapes, dtypes, static leaves) is traced and lowered once and cached, as
`jax.jit` does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor

from pxform.errors import SpecError
from pxform.layout import Layout
from pxform.lower.regions import prepare
from pxform.lower.spmd import Program, gradient_layout, lower, propagate
from pxform.mesh import AbstractMesh, Mesh, check_spec
from pxform.runtime.buckets import DEFAULT_BUCKET_MB, BucketStats, GradBuckets
from pxform.spec import P
from pxform.trace import Traced, arg_names, cache_key, path_text, trace


@dataclass(frozen=True, eq=False)
class Sharded:
    """A function transformed by `pxform.shard` (a small frozen object)."""

    fn: Any
    mesh: Mesh | AbstractMesh
    in_specs: Any
    out_specs: Any = None
    bucket_mb: float = DEFAULT_BUCKET_MB
    # chooses op strategies instead of greedy propagation (`pxform.auto`'s plan)
    planner: Any = None
    _cache: dict = field(default_factory=dict, repr=False)
    _last: dict = field(default_factory=dict, repr=False)

    @property
    def __name__(self) -> str:  # so traces and messages name the user's function
        return f"shard({getattr(self.fn, '__name__', 'fn')})"

    def __repr__(self) -> str:
        return f"pxform.shard({getattr(self.fn, '__name__', 'fn')}, mesh={self.mesh})"

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return self.mesh.abstract if isinstance(self.mesh, Mesh) else self.mesh

    # ---------------------------------------------------------------- lowering

    def _compile(self, args: tuple[Any, ...]) -> tuple[Traced, Program, list[Layout]]:
        full_args: Any = optree.tree_map(_as_global, args, is_leaf=_is_dtensor)  # type: ignore[arg-type]
        key = cache_key(full_args, {})
        if key not in self._cache:
            layouts = self._input_layouts(full_args)
            traced = trace(self.fn, *full_args)
            mesh = self.abstract_mesh
            graph = prepare(traced.graph, mesh, layouts)  # recompute and coshard regions
            if self.planner is not None:
                graph, strategies = self.planner.strategies(graph, mesh, layouts)
            else:
                strategies = propagate(graph, mesh, layouts)
            out_layouts = self._output_layouts(traced)
            program = lower(graph, mesh, layouts, strategies, out_layouts)
            self._cache[key] = (traced, program, layouts)
        return self._cache[key]

    def _input_layouts(self, args: tuple[Any, ...]) -> list[Layout]:
        name = self.__name__
        flat: Any = optree.tree_flatten_with_path(args)  # type: ignore[arg-type]
        paths, leaves, _ = flat
        specs = _broadcast_specs(self.in_specs, args, name)
        layouts = []
        names = arg_names(self.fn, len(args))
        for path, leaf, spec in zip(paths, leaves, specs):
            if not isinstance(leaf, torch.Tensor):
                continue
            spec = spec if spec is not None else P()
            where = path_text((0, *path), names)  # paths as trace() names them
            check_spec(spec, tuple(leaf.shape), self.abstract_mesh, fn=name, path=where)
            layouts.append(Layout.of(spec, leaf.dim()))
        return layouts

    def _output_layouts(self, traced: Traced) -> list[Layout | None]:
        outs = [o for o in traced.graph.outputs]
        if self.out_specs is None:
            return [Layout.replicated(o.type.rank) if hasattr(o, "type") else None
                    for o in outs]
        shaped = optree.tree_unflatten(traced.out_tree, list(outs))
        specs = _broadcast_specs(self.out_specs, shaped, self.__name__, what="out_specs")
        paths = optree.tree_paths(shaped)  # type: ignore[arg-type]
        layouts: list[Layout | None] = []
        for path, s, o in zip(paths, specs, outs):
            if not hasattr(o, "type"):
                layouts.append(None)
                continue
            check_spec(s or P(), o.type.shape, self.abstract_mesh, fn=self.__name__,
                       path="output" + "".join(f"[{k!r}]" for k in path))
            layouts.append(Layout.of(s or P(), o.type.rank))
        return layouts

    def lower(self, *args: Any) -> Any:
        """The lowered per-rank program for these arguments (`.as_text()` prints it); for a
        pipelined function, its per-stage programs (`PipelineProgram`)."""
        if _is_pipelined(self.fn):
            names = [a for a in self.abstract_mesh.names if a != self.fn.axis]
            sub = AbstractMesh(tuple((a, self.abstract_mesh.axis_size(a)) for a in names)) \
                if names else None
            return self.fn.lower(*args, mesh=sub, layouts=self._input_layouts(args),
                                 sharded=self)
        return self._compile(args)[1]

    # ---------------------------------------------------------------- running

    def distribute(self, *args: Any) -> Any:
        """The arguments as DTensors laid out per the in_specs (needs a bound `Mesh`).
        The DTensors never share memory with the arguments (an optimizer updating them in
        place leaves the caller's tensors as they were)."""
        from torch.distributed.tensor import distribute_tensor

        mesh = self._bound_mesh("distribute")
        layouts = iter(self._input_layouts(args))

        def dist(leaf: Any) -> Any:
            if not isinstance(leaf, torch.Tensor):
                return leaf
            layout = next(layouts)
            # distribute_tensor keeps a replicated tensor's storage as the local piece
            source = leaf if layout.used_axes() else leaf.detach().clone()
            return distribute_tensor(source, mesh.device_mesh,
                                     placements(layout, self.abstract_mesh))

        return optree.tree_map(dist, args)  # type: ignore[arg-type]

    def __call__(self, *args: Any) -> Any:
        value, _ = self.run(args, grad_argnums=())
        return value

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...]) -> tuple[Any, Any]:
        """Run on this rank; with `grad_argnums`, also return gradients of the (scalar)
        output with respect to those arguments, laid out like them (as DTensors)."""
        from pxform.runtime.program import execute

        if _is_pipelined(self.fn):
            return self.fn.run(args, grad_argnums, sharded=self)
        mesh = self._bound_mesh("call")
        traced, program, layouts = self._compile(args)
        if "axes" not in self._last:  # process groups and coordinates: once per function
            self._last["axes"] = mesh_axes(mesh)
        axes = self._last["axes"]
        leaves, _ = optree.tree_flatten(args, is_leaf=_is_dtensor)  # type: ignore[arg-type]
        arg_of_leaf = _leaf_arg_index(args)
        local: list[torch.Tensor] = []
        wants: list[bool] = []
        tensor_leaves = [(lf, a) for lf, a in zip(leaves, arg_of_leaf)
                         if isinstance(lf, torch.Tensor)]
        for (leaf, arg_index), layout in zip(tensor_leaves, layouts):
            t = _local_input(leaf, layout, axes, self.abstract_mesh)
            want = arg_index in grad_argnums and t.dtype.is_floating_point
            t = t.detach().requires_grad_(want)
            local.append(t)
            wants.append(want)
        # parameter-gradient collectives go to buckets, launched during backward
        buckets = GradBuckets(axes, int(self.bucket_mb * 2**20)) if grad_argnums else None
        with torch.set_grad_enabled(bool(grad_argnums) or torch.is_grad_enabled()):
            outs = execute(program, local, axes, buckets)
        if not grad_argnums:
            value = optree.tree_unflatten(traced.out_tree, [
                _wrap_output(o, v, mesh) for o, v in zip(outs, program.outputs)])
            return value, None
        # value_and_grad returns values, not graphs: detached, as on a plain function
        value = optree.tree_unflatten(traced.out_tree, [
            _wrap_output(o.detach() if isinstance(o, torch.Tensor) else o, v, mesh)
            for o, v in zip(outs, program.outputs)])
        loss = outs[0]
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
            raise SpecError(f"pxform.value_and_grad({self.__name__}): the function must return "
                            f"a scalar tensor (its first output), got {type(loss).__name__}")
        needed = [t for t, w in zip(local, wants) if w]
        # a value that does not depend on the arguments has zero gradients
        grads: Any = (torch.autograd.grad(loss, needed, allow_unused=True)
                      if needed and loss.requires_grad else [None] * len(needed))
        assert buckets is not None
        reduced = buckets.finish()  # every bucketed collective has completed here
        self._last["bucket_stats"] = buckets.stats
        grad_iter = iter(grads)
        wrapped: list[Any] = []
        given = [_is_dtensor(leaf) for leaf, _ in tensor_leaves]
        for index, (t, w, layout) in enumerate(zip(local, wants, layouts)):
            if not w:
                wrapped.append(None)
                continue
            g = next(grad_iter)
            if index in reduced:
                g = reduced[index] if g is None else g + reduced[index]
            g = torch.zeros_like(t) if g is None else g
            grad_layout = gradient_layout(layout)
            # like the arguments: DTensors (as `distribute` makes them) get DTensors with
            # the same placements, so `p.grad = g` and torch.optim work on them directly;
            # of full tensors, replicated ones get full tensors, sharded ones DTensors
            wrapped.append(_to_dtensor(g, grad_layout, mesh)
                           if given[index] or grad_layout.used_axes() else g)
        return value, _regroup_grads(args, grad_argnums, wrapped)

    @property
    def bucket_stats(self) -> BucketStats | None:
        """What the gradient buckets did in this rank's last `value_and_grad` call."""
        return self._last.get("bucket_stats")

    def _bound_mesh(self, what: str) -> Mesh:
        if not isinstance(self.mesh, Mesh):
            raise SpecError(f"pxform.{self.__name__}.{what}: the mesh is abstract "
                            f"({self.mesh}); running needs pxform.Mesh bound to a "
                            f"torch.distributed world.\n  Fix: pass mesh=pxform.Mesh(...) under "
                            f"torchrun; abstract meshes are for .lower() only.")
        return self.mesh


def shard(fn: Any, *, mesh: Mesh | AbstractMesh, in_specs: Any, out_specs: Any = None,
          bucket_mb: float = DEFAULT_BUCKET_MB) -> Sharded:
    """Run `fn` SPMD on `mesh` with inputs laid out per `in_specs`.

    Args:
        fn: a pure function of pytrees of tensors.
        mesh: a bound `pxform.Mesh` to run, or an `AbstractMesh` to `.lower()` only.
        in_specs: a pytree prefix of the positional arguments: `P` specs, or None
            (replicated).
        out_specs: a prefix of the outputs; None returns every output replicated (as full
            tensors).
        bucket_mb: parameter gradients are reduced in buckets of this many MiB, launched
            during backward as they fill (DDP's default, 25).

    Example:
        >>> step = pxform.shard(loss_fn, mesh=pxform.Mesh({"dp": 2}),
        ...                     in_specs=(None, {"x": P("dp"), "y": P("dp")}))
        >>> loss = step(params, batch)      # data parallel
    """
    if not isinstance(in_specs, tuple):
        in_specs = (in_specs,)
    return Sharded(fn, mesh, in_specs, out_specs, bucket_mb)


# ---------------------------------------------------------------- helpers

def placements(layout: Layout, mesh: AbstractMesh) -> list[Any]:
    """DTensor placements (mesh-major) of a layout. Only here and at the boundary."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    out: list[Any] = []
    for axis in mesh.names:
        dims = [d for d, axes in enumerate(layout.dims) if axis in axes]
        if dims:
            out.append(Shard(dims[0]))
        elif axis in layout.partial:
            out.append(Partial())
        else:
            out.append(Replicate())
    for d, axes in enumerate(layout.dims):
        if list(axes) != [a for a in mesh.names if a in axes]:
            raise SpecError(f"pxform: dim {d} is split over {axes} in an order other than the "
                            f"mesh's ({mesh}); DTensor cannot express it.\n  Fix: list the "
                            f"axes of a dim in mesh order.")
    return out


def mesh_axes(mesh: Mesh):  # type: ignore[no-untyped-def]
    from pxform.runtime.collectives import AxisGroups

    return AxisGroups({a: mesh.group(a) for a in mesh.names}, mesh.coordinate(),
                      dict(mesh.abstract.axes))


def _is_pipelined(fn: Any) -> bool:
    from pxform.transforms.pipeline import Pipelined

    return isinstance(fn, Pipelined)


def _is_dtensor(x: Any) -> bool:
    return isinstance(x, DTensor)


def _as_global(x: Any) -> Any:
    """A DTensor's global shape stand-in for tracing (meta: no data, no communication)."""
    if _is_dtensor(x):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _local_input(leaf: Any, layout: Layout, axes: Any, mesh: AbstractMesh) -> torch.Tensor:
    from pxform.runtime.collectives import local_shard

    if _is_dtensor(leaf):
        want = placements(layout, mesh)
        if list(leaf.placements) != want:
            leaf = leaf.redistribute(placements=want)
        return leaf.to_local()
    if not layout.used_axes():
        return leaf  # replicated: the whole tensor is this rank's piece
    return local_shard(leaf, layout, axes)


def _to_dtensor(local: torch.Tensor, layout: Layout, mesh: Mesh) -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, mesh.device_mesh, placements(layout, mesh.abstract),
                              run_check=False)


def _wrap_output(local: Any, value: Any, mesh: Mesh) -> Any:
    if not isinstance(local, torch.Tensor):
        return local
    from pxform.lower.spmd import layout_of

    layout = layout_of(value.type)
    if not layout.used_axes():
        return local  # replicated: the local tensor is the whole value
    return _to_dtensor(local, layout, mesh)


def _leaf_arg_index(args: tuple[Any, ...]) -> list[int]:
    out = []
    for i, a in enumerate(args):
        out += [i] * len(optree.tree_leaves(a, is_leaf=_is_dtensor))  # type: ignore[arg-type]
    return out


def _regroup_grads(args: tuple[Any, ...], argnums: tuple[int, ...], flat: list[Any]) -> Any:
    it = iter(flat)
    per_arg = []
    for a in args:
        leaves, tree = optree.tree_flatten(a, is_leaf=_is_dtensor)  # type: ignore[arg-type]
        mine = []
        for leaf in leaves:
            mine.append(next(it) if isinstance(leaf, torch.Tensor) else None)
        per_arg.append(optree.tree_unflatten(tree, mine))
    picked = tuple(per_arg[i] for i in argnums)
    return picked[0] if len(picked) == 1 else picked


def _broadcast_specs(specs: Any, tree: Any, name: str, what: str = "in_specs") -> list[Any]:
    """One spec per leaf of `tree`, from a pytree prefix `specs` (P and None are leaves)."""
    def is_spec(x: Any) -> bool:
        return x is None or isinstance(x, P)

    try:
        per_leaf = optree.broadcast_prefix(specs, tree, is_leaf=is_spec, none_is_leaf=True)
    except ValueError as exc:
        raise SpecError(
            f"pxform.{name}: {what} is not a pytree prefix of the "
            f"{'arguments' if what == 'in_specs' else 'outputs'}: {exc}\n  Fix: give one spec "
            f"per argument (a P, None, or a dict/list/tuple mirroring it), e.g. "
            f"in_specs=(None, {{'x': P('dp')}}).") from None
    return list(per_leaf)


def gather(tree: Any) -> Any:
    """`tree` with every DTensor replaced by the full tensor it stands for (all-gathered
    and summed as its placements say); other leaves are returned as they are.

    Example:
        >>> loss, grads = pxform.value_and_grad(step)(params, batch)
        >>> full = pxform.gather(grads)      # plain tensors, the same on every rank
    """
    def full(x: Any) -> Any:
        return x.full_tensor() if _is_dtensor(x) else x

    return optree.tree_map(full, tree, is_leaf=_is_dtensor, none_is_leaf=True)  # type: ignore[arg-type]
