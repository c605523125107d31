"""`step.init(init_fn, *init_args)`: a step's parameters initialised where they live.

An initialiser is a function like any other: pxform traces it, lays its outputs out as the
step lays out its first argument, and runs it on every rank. Each rank computes only its
own pieces (`pxform.passes.propagate.split_constants` pushes the layouts wanted at the
outputs back into the factories), so no rank allocates a full sharded tensor, and random
fills draw from the plan-independent stream (`pxform.core.rng`): the same numbers under
every plan as on one process. A pipeline rank computes only the leaves its stages read;
the others are `None` placeholders. Ops without a sharding rule (`orthogonal_`'s QR) run
replicated, named in one warning.

Also here: the check that refuses `meta` tensors reaching a run, with the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import optree
import torch

from pxform.core.errors import SpecError
from pxform.core.ir import TensorType
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.frontend.trace import Traced, arg_names, path_text, trace
from pxform.runtime.boundary import global_stand_in, is_dtensor, mesh_axes, to_dtensor
from pxform.runtime.collectives import AxisGroups
from pxform.runtime.mesh import Mesh
from pxform.runtime.program import execute
from pxform.transforms.compile import Fallback, compile_program

_ONE_DEVICE = AbstractMesh({"local": 1})


def parameters_like(init_fn: Any, init_args: tuple[Any, ...]) -> tuple[Traced, Any]:
    """The initialiser traced (no data), and its outputs as `meta` tensors: the shapes of
    the parameters, for planning and lowering the step."""
    # ops without a rule (orthogonal_'s QR) run replicated in an initialiser, reported
    # here: `initialize` lowers this trace, not another
    traced = trace(init_fn, *init_args, allow_fallback=True)
    metas = [torch.empty(o.type.shape, dtype=o.type.dtype, device="meta")
                 if hasattr(o, "type") else o for o in traced.graph.outputs]
    return traced, optree.tree_unflatten(traced.out_tree, metas)


def known_batch(batch: tuple[Any, ...] | None, last: tuple[Any, ...] | None, name: str,
                error: type[Exception]) -> tuple[Any, ...]:
    """The step's other arguments for a pipelined `init`: `batch=` if given, else those of
    an earlier call; which leaves a pipeline rank holds depends on the traced step."""
    rest = batch if batch is not None else last
    if rest is None:
        raise error(
            f"pxform.{name}.init: which parameters this rank's pipeline stages read depends "
            f"on the traced step, and no batch is known yet.\n  Fix: pass the step's other "
            f"arguments (shapes suffice: meta tensors do): step.init(init_fn, "
            f"batch=(batch,)).")
    return rest


def initialize(init_fn: Any, init_args: tuple[Any, ...], mesh: Mesh | None,
               layouts: Sequence[Layout], held: Sequence[bool], name: str,
               traced: Traced | None = None) -> Any:
    """Run `init_fn(*init_args)` on this rank, computing only the outputs `held` marks,
    each laid out per `layouts` (one per output leaf) on `mesh`: DTensors on a mesh, whole
    tensors without one (a pipeline alone: one device per stage). Unheld outputs are None.
    `traced` is the initialiser's trace from `parameters_like`, when the caller has it.

    Example:
        >>> params = initialize(init_gpt, (cfg,), mesh, layouts, [True] * n, "shard(loss)")
    """
    if traced is None:  # the caller's trace from `parameters_like`, or a new one
        traced, _ = parameters_like(init_fn, init_args)
    outputs = traced.graph.outputs
    if len(layouts) != len(outputs) or len(held) != len(outputs):
        raise SpecError(f"pxform.{name}.init({getattr(init_fn, '__name__', 'init_fn')}): the "
                        f"initialiser returns {len(outputs)} leaves but the step's first "
                        f"argument has {len(layouts)}.\n  Fix: return the parameters exactly "
                        f"as the step takes them (same pytree).")
    if not any(held):
        return optree.tree_unflatten(traced.out_tree, [None] * len(outputs))
    abstract = mesh.abstract if mesh is not None else _ONE_DEVICE
    wanted = list(layouts) if mesh is not None else [
        Layout.replicated(o.type.rank) for o in outputs]
    _, program = compile_program(init_fn, init_args, {}, abstract, None,
                                 lambda _: list(wanted), fallback=Fallback(allow=True),
                                 keep=list(held), traced=traced)
    axes = mesh_axes(mesh) if mesh is not None else \
        AxisGroups({"local": None}, {"local": 0}, {"local": 1})
    leaves: list[Any] = optree.tree_leaves(init_args)  # type: ignore[arg-type]
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    with torch.no_grad():
        local = iter(execute(program, tensors, axes))
    flat: list[Any] = []
    for layout, h in zip(wanted, held):
        if not h:
            flat.append(None)
            continue
        t = next(local)
        # parameters are leaves the optimizer steps: DTensors on a mesh (replicated ones
        # too, as `step.distribute` gives them), plain tensors without one
        flat.append(to_dtensor(t, layout, mesh) if mesh is not None else t)
    return optree.tree_unflatten(traced.out_tree, flat)


def with_placeholders_filled(args: tuple[Any, ...], like: Any) -> tuple[Any, ...]:
    """`args` with the None placeholders of the first argument (the leaves another
    pipeline rank holds, as `init` returns them) replaced by `meta` stand-ins of their
    shape from `like` (the initialiser's outputs), so the step traces the whole function;
    nothing reads them on this rank."""
    if like is None or not args:
        return args
    try:
        filled = optree.tree_map(lambda a, m: m if a is None else a, args[0], like,
                                 none_is_leaf=True, is_leaf=is_dtensor)  # type: ignore[arg-type]
    except ValueError:  # another structure: not the parameters init made
        return args
    return (filled, *args[1:])


def stand_ins(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """`args` with DTensors as meta tensors of their global shape (what a trace needs)."""
    return tuple(optree.tree_map(global_stand_in, args, is_leaf=is_dtensor))  # type: ignore[arg-type]


def refuse_meta(fn: Any, args: tuple[Any, ...], name: str, mesh: Any = None) -> None:
    """Refuse `meta` tensors (no data) among the arguments of a run, naming the first one
    and the fix: parameters built on meta are initialised with `step.init`."""
    # every call runs this: the paths and names are found only for the error
    leaves: Any = optree.tree_leaves(args, is_leaf=is_dtensor)  # type: ignore[arg-type]
    if not any(isinstance(leaf, torch.Tensor) and leaf.device.type == "meta"
               for leaf in leaves):
        return
    flat: Any = optree.tree_flatten_with_path(args, is_leaf=is_dtensor)  # type: ignore[arg-type]
    paths, leaves, _ = flat
    names = arg_names(fn, len(args))
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        local: Any = leaf.to_local() if is_dtensor(leaf) else leaf  # type: ignore[attr-defined]
        if local.device.type == "meta":
            where = path_text((0, *path), names)
            raise SpecError(
                f"pxform.{name}: {where} ({TensorType(tuple(leaf.shape), leaf.dtype)}) is on the "
                f"meta device: it has a shape but no data, so the step cannot run on it"
                f"{' on ' + str(mesh) if mesh is not None else ''}.\n"
                f"  Fix: initialise the parameters where they live: params = "
                f"step.init(init_fn) (or pxform.module_init(model) for a module built on "
                f"meta), or load them with pxform.load_checkpoint(path, like=params).")

