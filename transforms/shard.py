"""`pxform.shard`: run a function SPMD over a mesh with the given input and output specs.

    step = pxform.shard(loss_fn, mesh=mesh,
                        in_specs=({"w1": P("tp", None), "w2": P("tp", None)}, {"x": P("dp")}))
    loss = step(params, batch)              # full tensors (sliced locally) or DTensors
    print(step.lower(params, batch).as_text())

Specs are pytree prefixes of the arguments: `None` means replicated, a `P` lays out every
tensor below it. Values inside get strategies by propagation (`pxform.passes.propagate.propagate`,
the least forward communication); the search of a later issue replaces it. Each input
signature (shapes, dtypes, static leaves) is traced and lowered once and cached, as
`jax.jit` does.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, ClassVar

import optree
import torch

from pxform.core.errors import SpecError
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.core.precision import Precision
from pxform.frontend.trace import Traced, cache_key, module_given
from pxform.lower.spmd import Program
from pxform.runtime.boundary import distribute, global_stand_in, is_dtensor, mesh_axes
from pxform.runtime.buckets import DEFAULT_BUCKET_MB, BucketStats
from pxform.runtime.mesh import Mesh
from pxform.runtime.program import run_spmd
from pxform.runtime.reshard import Reshard
from pxform.transforms.base import (
    Enclosing,
    Executable,
    Nested,
    bound_mesh,
    precision_arg,
    trainable_leaves,
)
from pxform.transforms.compile import Fallback, compile_program
from pxform.transforms.initialize import (
    initialize,
    known_batch,
    parameters_like,
    refuse_meta,
    stand_ins,
    with_placeholders_filled,
)
from pxform.transforms.specs import in_spec_layouts, out_spec_layouts


@dataclass(frozen=True, eq=False)
class Sharded(Executable):
    """A function transformed by `pxform.shard` (a small frozen object)."""

    label: ClassVar[str] = "shard"

    fn: Any
    mesh: Mesh | AbstractMesh
    in_specs: Any
    out_specs: Any = None
    bucket_mb: float = DEFAULT_BUCKET_MB
    # chooses op strategies instead of greedy propagation (`pxform.auto`'s plan)
    planner: Any = None
    # ops without a rule: refused, or run replicated (`allow_fallback=True`)
    fallback: Fallback = Fallback()
    # ZeRO-3: free gathered parameters after forward, gather again for backward
    reshard_after_forward: Reshard = True
    # mixed precision (`pxform.Precision`), applied by the trace
    precision: Precision | None = None
    # training-mode BatchNorm by the whole batch's statistics (default: each rank's own)
    sync_batch_norm: bool = False
    _cache: dict = field(default_factory=dict, repr=False)
    _last: dict = field(default_factory=dict, repr=False)

    def options_text(self) -> str:
        return f", mesh={self.mesh}"

    @property
    def abstract_mesh(self) -> AbstractMesh:
        return self.mesh.abstract if isinstance(self.mesh, Mesh) else self.mesh

    # ---------------------------------------------------------------- lowering

    def _compile(self, args: tuple[Any, ...]) -> tuple[Traced, Program, list[Layout]]:
        full_args: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
        key = cache_key(full_args, {})
        if key not in self._cache:
            layouts = self._input_layouts(full_args)
            traced, program = compile_program(self.fn, full_args, {}, self.abstract_mesh,
                                              layouts, self._output_layouts, self.planner,
                                              self.fallback, precision=self.precision,
                                              sync_batch_norm=self.sync_batch_norm,
                                              # a trace the caller made (`pxform.auto`)
                                              traced=self._cache.get(("traced", key)))
            self._cache[key] = (traced, program, layouts)
        return self._cache[key]

    def _input_layouts(self, args: tuple[Any, ...]) -> list[Layout]:
        specs = tuple(self.in_specs)
        rest = args[len(specs):]
        # arguments past the specs given that hold no tensor (an initialiser's config:
        # `in_specs=()`) need none; a tensor argument without a spec is still an error
        leaves: list[Any] = optree.tree_leaves(rest)  # type: ignore[arg-type]
        if rest and not any(isinstance(x, torch.Tensor) for x in leaves):
            specs += (None,) * len(rest)
        return in_spec_layouts(self.fn, specs, args, self.abstract_mesh, self.__name__)

    def _output_layouts(self, traced: Traced) -> list[Layout | None]:
        return out_spec_layouts(self.out_specs, traced, self.abstract_mesh, self.__name__)

    def lower(self, *args: Any) -> Any:
        """The lowered per-rank program for these arguments (`.as_text()` prints it); for a
        pipelined function, its per-stage programs (`PipelineProgram`)."""
        self._last["rest"] = stand_ins(args[1:])
        if isinstance(self.fn, Nested):
            return self.fn.lower(*args, enclosing=self.enclosing(args))
        return self._compile(args)[1]

    # ---------------------------------------------------------------- running

    def distribute(self, *args: Any) -> Any:
        """The arguments as DTensors laid out per the in_specs (needs a bound `Mesh`).
        The DTensors never share memory with the arguments (an optimizer updating them in
        place leaves the caller's tensors as they were). Needs full tensors on every rank;
        for a model larger than one device use `init` or `pxform.load_checkpoint`."""
        mesh = bound_mesh(self.mesh, self.__name__, "distribute")
        refuse_meta(self.fn, args, f"{self.__name__}.distribute", self.mesh)
        return distribute(args, self._input_layouts(args), mesh)

    def init(self, init_fn: Any, *init_args: Any, batch: tuple[Any, ...] | None = None
             ) -> Any:
        """The step's first argument (the parameters), computed by `init_fn(*init_args)`
        on this world and laid out exactly as the step runs it: each rank computes only
        its own pieces, and random fills give the same numbers under every plan (see
        `pxform.transforms.initialize`). For a pipelined step, a rank computes only the
        leaves its stages read; the others are None. Which those are depends on the traced
        step, so a pipeline needs the other arguments: `batch=` (shapes only: meta tensors
        do), or those of an earlier call, `lower` or `holds`.

        Example:
            >>> step = pxform.shard(loss_fn, mesh=mesh, in_specs=({"w": P("dp")}, P("dp")))
            >>> params = step.init(lambda: {"w": torch.randn(1024, 1024) * 0.02})
        """
        mesh = bound_mesh(self.mesh, self.__name__, "init")
        traced, params = parameters_like(init_fn, init_args)
        self._last["params_like"] = params  # the shapes None placeholders stand for
        num = sum(isinstance(x, torch.Tensor) for x in optree.tree_leaves(params))  # type: ignore[arg-type]
        if isinstance(self.fn, Nested):
            rest = known_batch(batch, self._last.get("rest"), self.__name__, SpecError)
            full = (params, *rest)
            enclosing = self.enclosing(full)
            held = self.fn.holds(full, enclosing)[:num]
            layouts = list(enclosing.layouts[:num])
        else:
            layouts = in_spec_layouts(self.fn, self.in_specs[:1], (params,), mesh.abstract,
                                      self.__name__)
            held = [True] * num
        return initialize(init_fn, init_args, mesh, layouts, held, self.__name__, traced)

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...]) -> tuple[Any, Any]:
        """Run on this rank; with `grad_argnums`, also return gradients of the (scalar)
        output with respect to those arguments, laid out like them (as DTensors)."""
        refuse_meta(self.fn, args, self.__name__, self.mesh)
        args = with_placeholders_filled(args, self._last.get("params_like"))
        self._last["rest"] = stand_ins(args[1:])
        if isinstance(self.fn, Nested):
            return self.fn.run(args, grad_argnums, enclosing=self.enclosing(args))
        mesh = bound_mesh(self.mesh, self.__name__, "call")
        traced, program, layouts = self._compile(args)
        if "axes" not in self._last:  # process groups and coordinates: once per function
            self._last["axes"] = mesh_axes(mesh)
        result = run_spmd(program, traced.out_tree, layouts, args, grad_argnums, mesh,
                          self._last["axes"], self.bucket_mb, self.__name__,
                          self.reshard_after_forward, trainable_leaves(traced, args),
                          traced.state)
        if result.bucket_stats is not None:
            self._last["bucket_stats"] = result.bucket_stats
        return result.value, result.grads

    @property
    def bucket_stats(self) -> BucketStats | None:
        """What the gradient buckets did in this rank's last `value_and_grad` call."""
        return self._last.get("bucket_stats")

    def enclosing(self, args: tuple[Any, ...]) -> Enclosing:
        """What this shard passes to the `Nested` transform it wraps, for these arguments."""
        return Enclosing(self.__name__, self.mesh, tuple(self._input_layouts(args)),
                         self.out_specs, self.bucket_mb, self.fallback,
                         self.reshard_after_forward, self.precision)


def shard(fn: Any, *, mesh: Mesh | AbstractMesh, in_specs: Any, out_specs: Any = None,
          bucket_mb: float = DEFAULT_BUCKET_MB, allow_fallback: bool = False,
          reshard_after_forward: bool | Collection[str] = True,
          precision: Precision | None = None, sync_batch_norm: bool = False) -> Sharded:
    """Run `fn` SPMD on `mesh` with inputs laid out per `in_specs`.

    Args:
        fn: a pure function of pytrees of tensors.
        mesh: a bound `pxform.Mesh` to run, or an `AbstractMesh` to `.lower()` only.
        in_specs: a pytree prefix of the positional arguments: `P` specs, or None
            (replicated). Arguments without tensors need no spec (`in_specs=()` for an
            initialiser whose arguments are configuration).
        out_specs: a prefix of the outputs; None returns every output replicated (as full
            tensors).
        bucket_mb: parameter gradients are reduced in buckets of this many MiB, launched
            during backward as they fill (DDP's default, 25).
        allow_fallback: run ops that have no sharding rule replicated (their inputs
            gathered, every rank computing the whole op), reported per op in one
            `PxformWarning`, instead of refusing them.
        reshard_after_forward: parameters a program gathers (ZeRO-3: `P("dp")` on a
            parameter that an op needs whole) are freed after their forward use and
            gathered again for backward, as FSDP2's option of that name; False keeps them
            from forward to backward (less communication, more memory). A collection of
            block names reshards those blocks only: a block is a parameter's pytree path
            up to its first list index (`"blocks.3"`; `""` for parameters outside lists),
            as `pxform.runtime.prefetch` groups gathers, and the choice is per block as
            FSDP2's is per module. The collection may also name single parameters by
            their pytree path (`"blocks.3.fc_w"`), as `pxform.auto`'s plans do.
        precision: a mixed-precision policy (`pxform.Precision`): parameters stay in
            their dtype and are cast where used (on the shard, before ZeRO-3 gathers), ops
            compute as autocast runs them, gradients are reduced in its `reduce_dtype` and
            returned in the parameters' dtype. A nested `pxform.pipeline` follows it.
        sync_batch_norm: BatchNorm in training mode normalises by the whole batch's
            statistics, however the mesh splits the batch (synchronised BatchNorm: the
            one-process result). By default each rank normalises its own rows by their
            statistics, as DDP does. Running statistics are the whole batch's either way,
            written back into the buffers passed, as eager updates them (`docs/models.md`).

    Example:
        >>> step = pxform.shard(loss_fn, mesh=pxform.Mesh({"dp": 2}),
        ...                     in_specs=(None, {"x": P("dp"), "y": P("dp")}))
        >>> loss = step(params, batch)      # data parallel
    """
    if isinstance(fn, torch.nn.Module):
        raise module_given(fn, "shard")
    if not isinstance(in_specs, tuple):
        in_specs = (in_specs,)
    reshard: Reshard = reshard_after_forward if isinstance(reshard_after_forward, bool) \
        else frozenset(reshard_after_forward) or False
    return Sharded(fn, mesh, in_specs, out_specs, bucket_mb,
                   fallback=Fallback(allow=allow_fallback), reshard_after_forward=reshard,
                   precision=precision_arg(precision, "shard"),
                   sync_batch_norm=sync_batch_norm)
