"""The transform protocol: what every transformed function shares, and how transforms
compose without reaching into each other.

- `Transform`: the wrapper boilerplate. A transform is a frozen dataclass holding the
  wrapped `fn` and its options; it names itself after the function (`shard(loss_fn)`), so
  traces and messages name the user's function, and it keeps the function's signature, so
  traces name the arguments as the user did.
- `Executable`: a transform that runs on this rank. `run(args, grad_argnums)` returns
  `(value, grads)` (grads None when `grad_argnums` is empty); calling it returns the value.
  `pxform.value_and_grad` accepts any `Executable`.
- `Nested`: an executable transform that can run inside `pxform.shard` on part of its mesh
  (a pipeline: its stages take one mesh axis, each stage runs on the rest). The enclosing
  shard passes an explicit `Enclosing` value down; nothing calls back up.
- `Region`: `Recomputed` and `Cosharded` tag the ops traced inside them and run eagerly
  (traced, lowered for one device and run, once per signature) outside a trace; they are
  `Transform`s but not `Executable`s.

Example:
    >>> @dataclass(frozen=True, eq=False)
    ... class Twice(Executable):
    ...     label: ClassVar[str] = "twice"
    ...     fn: Any
    ...     def run(self, args, grad_argnums):
    ...         return 2 * self.fn(*args), None
    >>> Twice(loss_fn)              # pxform.twice(loss_fn)
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, ClassVar

import optree
import torch

from pxform.core.errors import PxformError, SpecError
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.core.precision import Precision
from pxform.frontend.trace import cache_key, is_tracing
from pxform.runtime.collectives import AxisGroups
from pxform.runtime.mesh import Mesh
from pxform.runtime.program import execute
from pxform.runtime.reshard import Reshard
from pxform.transforms.compile import Fallback, compile_program


def trainable_leaves(traced: Any, args: tuple[Any, ...]) -> list[bool]:
    """Per tensor leaf of `args`, whether `value_and_grad` differentiates it (when its
    argument is differentiated and it is floating point): not a module buffer
    (`Traced.buffers`, from `module_fn`), and, in an argument where some floating leaf
    requires grad, only the leaves that do (PyTorch's mark of a trainable tensor: a frozen
    parameter gets no gradient). An argument of plain tensors (none requires grad) has
    every floating leaf differentiated.

    Example:
        >>> trainable_leaves(traced, (params, batch))   # [True, True, False, ...]
    """
    flat: list[tuple[int, Any]] = []
    for n, a in enumerate(args):
        flat += [(n, x) for x in optree.tree_leaves(a, is_leaf=is_tensor_leaf)  # type: ignore[arg-type]
                 if isinstance(x, torch.Tensor)]
    marked = {n for k, (n, x) in enumerate(flat)
              if k not in traced.buffers and x.requires_grad and x.is_floating_point()}
    return [k not in traced.buffers and (n not in marked or x.requires_grad)
            for k, (n, x) in enumerate(flat)]


def is_tensor_leaf(x: Any) -> bool:
    """optree's `is_leaf` for tensors (DTensors too: leaves, not pytrees)."""
    return isinstance(x, torch.Tensor)


def fn_name(fn: Any) -> str:
    """The name a transform shows for the function it wraps."""
    return getattr(fn, "__name__", "fn")


class Transform:
    """Base of every transform (module doc). Subclasses are frozen dataclasses with a field
    `fn` and a class attribute `label`, the public transform's name."""

    label: ClassVar[str]
    fn: Any

    @property
    def __signature__(self) -> inspect.Signature | None:
        """The wrapped function's, so traces name the arguments as the user did."""
        try:
            return inspect.signature(self.fn)
        except (TypeError, ValueError):
            return None

    @property
    def __name__(self) -> str:
        return f"{self.label}({fn_name(self.fn)})"

    def options_text(self) -> str:
        """The options `repr` shows after the function, e.g. ", mesh=Mesh(dp=2)"."""
        return ""

    def __repr__(self) -> str:
        return f"pxform.{self.label}({fn_name(self.fn)}{self.options_text()})"


class Executable(Transform):
    """A transform that runs on this rank: `run(args, grad_argnums) -> (value, grads)`."""

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...]) -> tuple[Any, Any]:
        raise NotImplementedError(f"{type(self).__name__}.run")

    def __call__(self, *args: Any) -> Any:
        value, _ = self.run(args, ())
        return value


@dataclass(frozen=True)
class Enclosing:
    """What an enclosing `pxform.shard` passes to the `Nested` transform it wraps.

    Attributes:
        name: the enclosing transform's name, for messages (`shard(loss_fn)`).
        mesh: its whole mesh, including the nested transform's axis.
        layouts: the layout of every tensor leaf of the arguments, on `mesh`.
        out_specs: the enclosing shard's out_specs (None: replicated outputs).
        bucket_mb: the gradient bucket size, in MiB.
        fallback: whether the enclosing shard lets ops without a rule run replicated.
        reshard_after_forward: whether parameters gathered in forward (ZeRO-3) are freed
            and gathered again for backward: all, none, or those of the named blocks
            and parameters.
        precision: the enclosing shard's mixed-precision policy.
    """

    name: str
    mesh: Mesh | AbstractMesh
    layouts: tuple[Layout, ...]
    out_specs: Any
    bucket_mb: float
    fallback: Fallback = Fallback()
    reshard_after_forward: Reshard = True
    precision: Precision | None = None

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return self.mesh.abstract if isinstance(self.mesh, Mesh) else self.mesh

    def bound_mesh(self, what: str) -> Mesh:
        """The mesh, which must be bound to a torch.distributed world to run."""
        return bound_mesh(self.mesh, self.name, what)


class Nested(Executable):
    """An executable transform that runs inside `pxform.shard` on part of its mesh: `axis`
    names the mesh axis it takes. The enclosing shard calls `lower`, `run` and `holds`
    with an `Enclosing` value."""

    axis: str

    def lower(self, *args: Any, enclosing: Enclosing | None = None) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.lower")

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...],
            enclosing: Enclosing | None = None) -> tuple[Any, Any]:
        raise NotImplementedError(f"{type(self).__name__}.run")

    def holds(self, args: tuple[Any, ...], enclosing: Enclosing | None = None) -> list[bool]:
        """Per tensor leaf of `args`, whether this rank computes with it."""
        raise NotImplementedError(f"{type(self).__name__}.holds")


def bound_mesh(mesh: Mesh | AbstractMesh, name: str, what: str) -> Mesh:
    """`mesh` if it is bound to a torch.distributed world; otherwise an error saying that
    abstract meshes only lower."""
    if not isinstance(mesh, Mesh):
        raise SpecError(f"pxform.{name}.{what}: the mesh is abstract ({mesh}); running needs "
                        f"pxform.Mesh bound to a torch.distributed world.\n  Fix: pass "
                        f"mesh=pxform.Mesh(...) under torchrun; abstract meshes are for "
                        f".lower() only.")
    return mesh


class Region(Transform):
    """A region transform (`recompute`, `coshard`): inside a trace it tags the ops its
    function issues (`traced_call`); outside, it runs eagerly on this process. Subclasses
    are dataclasses with a `_cache` field (compiled programs, per signature)."""

    _cache: dict

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not is_tracing():
            return run_eagerly(self, args, kwargs)
        return self.traced_call(args, kwargs)

    def traced_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        raise NotImplementedError(f"{type(self).__name__}.traced_call")


def run_eagerly(transformed: Region, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run a region transform on real tensors on this process: trace it (once per
    signature), lower it for one device, and run the program with autograd."""
    key = cache_key(args, kwargs)
    cache = transformed._cache
    if key not in cache:
        # one device: every conversion moves nothing
        cache[key] = compile_program(transformed, args, kwargs, AbstractMesh({"local": 1}))
    traced, program = cache[key]
    tensors = traced._check_args(args, kwargs)
    outs = execute(program, tensors, AxisGroups({"local": None}, {"local": 0}, {"local": 1}))
    return optree.tree_unflatten(traced.out_tree, outs)


def precision_arg(precision: Any, transform: str) -> Precision | None:
    """`precision=` of a transform, checked: a `pxform.Precision` or None."""
    if precision is None or isinstance(precision, Precision):
        return precision
    raise PxformError(
        f"pxform.{transform}: precision={precision!r} is not a pxform.Precision.\n  Fix: "
        f"pass pxform.Precision(compute_dtype=torch.bfloat16) (bf16 compute, float32 "
        f"master weights and reductions), or None for the parameters' own dtype.")
