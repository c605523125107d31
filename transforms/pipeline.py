"""`pxform.pipeline`: run a function as a pipeline of stages over microbatches (MPMD).

    step = pxform.pipeline(loss_fn, stages=2, microbatches=4, schedule="1f1b")
    loss, grads = pxform.value_and_grad(step)(params, batch)   # under torchrun, 2 ranks
    print(step.cuts(params, batch))                            # which ops each stage holds

Stages come from `pxform.stage_boundary(x)` markers in the model, or from graph sharding
(`pxform.cuts`). The batch arguments (all positional arguments after the first, unless
`batch_argnums` says otherwise) are cut into `microbatches` along `batch_dim`. Each stage is
lowered SPMD (`pxform.lower.mpmd`): alone, `pipeline` uses every rank along one axis;
inside `pxform.shard(..., mesh=Mesh({"pp": 2, "dp": 2}))` each stage runs on the sub-mesh
without `pp`, so PP x DP x TP compose. The schedule is data (`pxform.schedules`): a name,
a function `(stages, microbatches, **options) -> {rank: [Action]}`, or an action list as
text; it is validated, communication actions are added, and one executor runs it.

Returned values are combined over microbatches (a mean loss is the full-batch mean) and
are the same on every pipeline rank. Gradients are returned for the inputs read by this
rank's stages; inputs read only on other pipeline ranks get `None` (their gradients live
there), and parameters read on several pipeline ranks (tied embeddings) get the sum.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from pxform.cuts import StageCuts, stage_cuts
from pxform.errors import PipelineError
from pxform.layout import Layout
from pxform.lower.mpmd import (
    PipelineProgram,
    lower_pipeline,
    output_layouts,
    split_batch,
    with_microbatches,
)
from pxform.lower.regions import prepare
from pxform.lower.spmd import gradient_layout, propagate
from pxform.mesh import AbstractMesh, Mesh
from pxform.runtime.buckets import DEFAULT_BUCKET_MB
from pxform.stage_recompute import RecomputePlan, block_memory, in_flight, tag_blocks
from pxform.stage_recompute import plan as stage_plan
from pxform.trace import Traced, cache_key, trace
from pxform.units import parse_bytes


@dataclass(frozen=True, eq=False)
class Pipelined:
    """A function transformed by `pxform.pipeline`."""

    fn: Any
    stages: int
    microbatches: int
    schedule: Any = "1f1b"
    axis: str = "pp"
    options: tuple[tuple[str, Any], ...] = ()
    batch_argnums: tuple[int, ...] | None = None
    batch_dim: int = 0
    recompute: Any = None
    memory_budget: int | None = None
    # assigns stages and chooses op strategies (`pxform.auto`'s plan)
    planner: Any = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def __name__(self) -> str:
        return f"pipeline({getattr(self.fn, '__name__', 'fn')})"

    def __repr__(self) -> str:
        return (f"pxform.pipeline({getattr(self.fn, '__name__', 'fn')}, stages={self.stages}, "
                f"microbatches={self.microbatches}, schedule={self.schedule!r})")

    # ---------------------------------------------------------------- schedule

    def actions(self) -> dict[int, list[Any]]:
        """The validated schedule with its send/receive actions, per pipeline rank."""
        if "actions" not in self._cache:
            from pxform import schedules

            try:
                compute = schedules.resolve(self.schedule, self.stages, self.microbatches,
                                            **dict(self.options))
            except PipelineError:
                raise
            except Exception as exc:  # ScheduleError (with the grid) or a bad option
                raise type(exc)(f"pxform.{self.__name__}: {exc}") from None
            if len(compute) != self.stages:
                raise PipelineError(
                    f"pxform.{self.__name__}: the schedule has {len(compute)} ranks but the "
                    f"pipeline has stages={self.stages}.\n  Fix: give one action list per "
                    f"pipeline rank.")
            self._cache["actions"] = schedules.add_communication(compute)
        return self._cache["actions"]

    @property
    def num_stages(self) -> int:
        """Stages in all (virtual stages: `stages` x chunks per rank for interleaved and
        nF1B)."""
        acts = self.actions()
        return 1 + max(a.stage for lst in acts.values() for a in lst if a is not None)

    # ---------------------------------------------------------------- lowering

    def _batch_argnums(self, num_args: int) -> tuple[int, ...]:
        if self.batch_argnums is not None:
            return tuple(n % num_args for n in self.batch_argnums)
        return tuple(range(1, num_args)) if num_args > 1 else (0,)

    def _inputs(self, args: tuple[Any, ...]) -> tuple[list[int], list[Any]]:
        """Per tensor leaf (graph input), the positional argument it belongs to, and the
        leaves."""
        from pxform.transforms.shard import _is_dtensor

        arg_of, leaves = [], []
        for n, a in enumerate(args):
            for leaf in optree.tree_leaves(a, is_leaf=_is_dtensor):  # type: ignore[arg-type]
                if isinstance(leaf, torch.Tensor):
                    arg_of.append(n)
                    leaves.append(leaf)
        return arg_of, leaves

    def cuts(self, *args: Any) -> StageCuts:
        """Which ops (and modules) each stage holds; `print` it."""
        from pxform.transforms.shard import _as_global, _is_dtensor

        full: Any = optree.tree_map(_as_global, args, is_leaf=_is_dtensor)  # type: ignore[arg-type]
        traced = trace(self.fn, *full)
        return self._cuts(traced, full)

    def _cuts(self, traced: Traced, args: tuple[Any, ...], mesh: AbstractMesh | None = None,
              layouts: list[Layout] | None = None) -> StageCuts:
        arg_of, _ = self._inputs(args)
        batch = set(self._batch_argnums(len(args)))
        names = {v.name for v, n in zip(traced.graph.inputs, arg_of) if n in batch}
        graph = prepare(traced.graph, mesh, layouts)
        return stage_cuts(graph, self.num_stages, names, fn=self.__name__)

    def lower(self, *args: Any, mesh: AbstractMesh | None = None,
              layouts: list[Layout] | None = None, sharded: Any = None) -> PipelineProgram:
        """The per-stage programs for these arguments (`.as_text()` prints them). `mesh` is
        the sub-mesh each stage runs on (None: one device per stage); `layouts` lay out
        every tensor leaf on it (default replicated); `sharded` is an enclosing
        `pxform.shard`, whose out_specs lay the outputs out."""
        return self._compile(args, mesh, layouts, sharded)[0]

    def _compile(self, args: tuple[Any, ...], mesh: AbstractMesh | None,
                 layouts: list[Layout] | None, sharded: Any = None
                 ) -> tuple[PipelineProgram, Traced]:
        from pxform.transforms.shard import _as_global, _is_dtensor

        full: Any = optree.tree_map(_as_global, args, is_leaf=_is_dtensor)  # type: ignore[arg-type]
        out_specs = repr(sharded.out_specs) if sharded is not None else None
        key = (cache_key(full, {}), mesh, tuple(layouts or ()), out_specs)
        if key in self._cache:
            return self._cache[key]
        traced = trace(self.fn, *full)
        arg_of, leaves = self._inputs(full)
        batch_args = set(self._batch_argnums(len(full)))
        lowering_mesh = (with_microbatches(mesh, self.microbatches, self.__name__)
                         if mesh is not None else AbstractMesh({"mb": self.microbatches}))
        base = layouts or [Layout.replicated(t.dim()) for t in leaves]
        in_layouts = []
        batch_inputs = set()
        for j, (n, leaf, layout) in enumerate(zip(arg_of, leaves, base)):
            if n in batch_args:
                self._check_batch(traced, j, leaf, layout, lowering_mesh)
                in_layouts.append(split_batch(layout, self.batch_dim))
                batch_inputs.add(j)
            else:
                in_layouts.append(layout)
        cuts = self._cuts(traced, full, lowering_mesh, in_layouts)
        if self.planner is not None:
            cuts = self.planner.cuts(cuts)
        graph = cuts.graph
        if self.recompute is not None:
            plan = self._plan_recompute(cuts, batch_inputs, in_layouts, lowering_mesh, leaves)
            graph = tag_blocks(graph, cuts.blocks, [r for s in plan.stages
                                                    for r in s.recompute], self.__name__)
            self._cache[("plan", key)] = plan
        if self.planner is not None:
            graph, strategies = self.planner.strategies(graph, lowering_mesh, in_layouts)
        else:
            strategies = propagate(graph, lowering_mesh, in_layouts)
        # an enclosing shard's out_specs lay the outputs out on the sub-mesh
        wanted = (sharded._output_layouts(traced) if sharded is not None and
                  sharded.out_specs is not None else [None] * len(graph.outputs))
        outs = output_layouts(graph, lowering_mesh, in_layouts, strategies, wanted)
        split = {a.stage for acts in self.actions().values() for a in acts
                 if a is not None and a.kind == "W"}
        program = lower_pipeline(graph, cuts.op_stage, cuts.num_stages, lowering_mesh,
                                 in_layouts, strategies, outs, batch_inputs, fn=self.__name__,
                                 weight_stages=split)
        self._cache[key] = (program, traced)
        return program, traced

    def recompute_plan(self, *args: Any, mesh: AbstractMesh | None = None,
                       layouts: list[Layout] | None = None) -> RecomputePlan:
        """Which blocks each stage recomputes (`recompute=` given), and the memory per
        device that leaves, estimated; `print` it."""
        if self.recompute is None:
            raise PipelineError(f"pxform.{self.__name__}: no recompute= was given, so no "
                                f"stage recomputes anything.")
        from pxform.transforms.shard import _as_global, _is_dtensor

        self._compile(args, mesh, layouts)
        full: Any = optree.tree_map(_as_global, args, is_leaf=_is_dtensor)  # type: ignore[arg-type]
        key = (cache_key(full, {}), mesh, tuple(layouts or ()), None)
        return self._cache[("plan", key)]

    def _plan_recompute(self, cuts: StageCuts, batch_inputs: set[int], layouts: list[Layout],
                        mesh: AbstractMesh, leaves: list[Any]) -> RecomputePlan:
        graph = cuts.graph
        block_stage = [cuts.op_stage[b.start] for b in cuts.blocks]
        n = cuts.num_stages
        # per device: the whole batch's bytes over microbatches and batch-splitting axes
        ways = 1
        for j in batch_inputs:
            ways = max(ways, math.prod(mesh.axis_size(a) for a in layouts[j].dims[self.batch_dim]))
        names = {graph.inputs[j].name for j in batch_inputs}
        memory = block_memory(graph, cuts.blocks, names, ways)
        param_bytes = [0] * n
        for j, v in enumerate(graph.inputs):
            if j in batch_inputs:
                continue
            local = math.prod(layouts[j].local_shape(v.type.shape, mesh)) * v.type.dtype.itemsize
            for s in sorted({cuts.op_stage[k] for k, op in enumerate(graph.ops)
                             if any(i.name == v.name for i in op.inputs)}):
                param_bytes[s] += local
        flights = in_flight(self.actions(), n)
        if isinstance(self.recompute, str) and self.recompute == "all":
            return stage_plan(memory, block_stage, param_bytes, flights, self.memory_budget,
                              fixed=[len(cuts.blocks)] * n, fn=self.__name__)
        if isinstance(self.recompute, str):
            if self.recompute != "stage_aware":
                raise PipelineError(
                    f"pxform.{self.__name__}: recompute={self.recompute!r}; use None, 'all', "
                    f"'stage_aware' (with memory_budget=) or a list of block counts per stage")
            if self.memory_budget is None:
                raise PipelineError(
                    f"pxform.{self.__name__}: recompute='stage_aware' chooses the blocks to "
                    f"recompute under a memory budget, and none was given.\n  Fix: pass "
                    f"memory_budget= (bytes, or a string such as '16GiB').")
            return stage_plan(memory, block_stage, param_bytes, flights, self.memory_budget,
                              fn=self.__name__)
        fixed = list(self.recompute)
        if len(fixed) != n or not all(isinstance(c, int) and c >= 0 for c in fixed):
            raise PipelineError(
                f"pxform.{self.__name__}: recompute={self.recompute!r} must give a number of "
                f"blocks (>= 0) for each of the {n} stages.")
        return stage_plan(memory, block_stage, param_bytes, flights, self.memory_budget,
                          fixed=fixed, fn=self.__name__)

    def _check_batch(self, traced: Traced, j: int, leaf: torch.Tensor, layout: Layout,
                     mesh: AbstractMesh) -> None:
        path = traced.graph.inputs[j].name
        d = self.batch_dim
        if leaf.dim() <= d:
            raise PipelineError(
                f"pxform.{self.__name__}: batch input {path} has shape {list(leaf.shape)}, "
                f"with no dim {d} to cut into {self.microbatches} microbatches.\n  Fix: pass "
                f"batch_argnums= naming the arguments that carry the batch, or batch_dim=.")
        ways = 1
        for a in layout.dims[d]:
            ways *= mesh.axis_size(a)
        if leaf.shape[d] % (ways * self.microbatches):
            split = f" (already split {ways} ways by its spec)" if ways > 1 else ""
            raise PipelineError(
                f"pxform.{self.__name__}: batch input {path} has shape {list(leaf.shape)}; "
                f"its dim {d} ({leaf.shape[d]}{split}) does not divide into "
                f"{self.microbatches} microbatches.\n  Fix: make the batch a multiple of "
                f"{ways * self.microbatches}, or choose microbatches dividing "
                f"{leaf.shape[d] // ways}.")

    # ---------------------------------------------------------------- running

    def __call__(self, *args: Any) -> Any:
        value, _ = self.run(args, ())
        return value

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...],
            sharded: Any = None) -> tuple[Any, Any]:
        """Run this rank's part; with `grad_argnums`, also return gradients (see module
        doc). `sharded` is the enclosing `pxform.shard` (its mesh has the pipeline axis)."""
        from pxform.runtime.collectives import AxisGroups
        from pxform.runtime.pipeline import run as run_actions
        from pxform.transforms.shard import (
            _is_dtensor,
            _local_input,
            _regroup_grads,
            _to_dtensor,
            _wrap_output,
            mesh_axes,
        )

        mesh, place, axes, sub = self._placement(sharded)
        layouts = sharded._input_layouts(args) if sharded is not None else None
        program, traced = self._compile(args, sub, layouts, sharded)
        arg_of, leaves = self._inputs(args)
        reads = self._reads(program, place)
        base = layouts or [Layout.replicated(t.dim()) for t in leaves]
        full_axes = mesh_axes(mesh) if mesh is not None else AxisGroups({}, {}, {})
        local = [(_local_input(leaf, layout, full_axes, mesh.abstract) if mesh is not None
                  else leaf) if j in reads else None
                 for j, (leaf, layout) in enumerate(zip(leaves, base))]
        batch_args = set(self._batch_argnums(len(args)))
        batch_dims = {j: self.batch_dim for j, n in enumerate(arg_of) if n in batch_args}
        want = [n in grad_argnums for n in arg_of]
        actions = self.actions()[place.rank]
        split = {a.stage for acts in self.actions().values() for a in acts
                 if a is not None and a.kind == "W"}
        if grad_argnums:
            self._check_trainable(program)
        bucket_mb = sharded.bucket_mb if sharded is not None else DEFAULT_BUCKET_MB
        with torch.set_grad_enabled(bool(grad_argnums) or torch.is_grad_enabled()):
            result = run_actions(program, actions if grad_argnums else
                                 [a for a in actions if a is not None and a.kind in
                                  ("F", "SF", "RF")],
                                 place, axes, local, batch_dims, want, int(bucket_mb * 2**20),
                                 split)
        grads = self._share_grads(program, place, result.grads, want, base, sub, leaves)
        values = []
        for o, v in zip(result.outputs, program.outputs):
            values.append(_wrap_output(o, _without_mb(v), mesh) if mesh is not None else o)
        value = optree.tree_unflatten(traced.out_tree, values)
        if not grad_argnums:
            return value, None
        flat: list[Any] = []
        for j, layout in enumerate(base):
            g = grads.get(j)
            if g is None or not want[j]:
                flat.append(None)
                continue
            grad_layout = gradient_layout(layout)
            # DTensor arguments get DTensor gradients with their placements (see shard.py)
            wrap = mesh is not None and (grad_layout.used_axes() or _is_dtensor(leaves[j]))
            flat.append(_to_dtensor(g, grad_layout, mesh) if wrap else g)
        return value, _regroup_grads(args, grad_argnums, flat)

    def holds(self, args: tuple[Any, ...], sharded: Any = None) -> list[bool]:
        """Per tensor leaf of `args`, whether this rank's stages read it: the leaves it
        computes with and gets gradients for (a tied weight is held by every stage that
        reads it). Lowers (cached) on the first call."""
        _, place, _, sub = self._placement(sharded)
        layouts = sharded._input_layouts(args) if sharded is not None else None
        program, _ = self._compile(args, sub, layouts, sharded)
        reads = self._reads(program, place)
        return [j in reads for j in range(len(self._inputs(args)[1]))]

    @staticmethod
    def _reads(program: PipelineProgram, place: Any) -> set[int]:
        return {j for st in program.stages if st.stage % place.size == place.rank
                for j in st.graph_inputs}

    def _check_trainable(self, program: PipelineProgram) -> None:
        """A stage the schedule runs no backward for must not need one (nF1B's sweeps
        without gradient): otherwise its parameters would silently get no gradient."""
        trained = {a.stage for acts in self.actions().values() for a in acts
                   if a is not None and a.kind == "B"}
        for st in program.stages:
            if st.stage not in trained and st.grad:
                op = next(i.op for i in st.program.instrs if hasattr(i, "op") and i.op.grad)
                raise PipelineError(
                    f"pxform.{self.__name__}: schedule {self.schedule!r} runs no backward for "
                    f"stage {st.stage}, but the stage computes with gradients ({op} at "
                    f"{op.source or 'an unknown line'}).\n  Fix: run the forward-only sweeps "
                    f"under torch.no_grad() and cut them into the first stages, or use a "
                    f"schedule that trains every stage.")

    def _placement(self, sharded: Any) -> tuple[Any, Any, Any, AbstractMesh | None]:
        """(bound mesh or None, this rank's PipelineGroup, sub-mesh AxisGroups, sub-mesh)."""
        import torch.distributed as dist

        from pxform.runtime.collectives import AxisGroups
        from pxform.runtime.pipeline import PipelineGroup
        from pxform.transforms.shard import mesh_axes

        if sharded is None:
            if not dist.is_available() or not dist.is_initialized():
                if self.stages == 1:
                    return None, PipelineGroup(0, 1), AxisGroups({}, {}, {}), None
                raise PipelineError(
                    f"pxform.{self.__name__}: {self.stages} stages need {self.stages} ranks, "
                    f"but torch.distributed is not initialised.\n  Fix: run under torchrun "
                    f"--nproc-per-node {self.stages}, or use .lower()/.cuts() to inspect.")
            world = dist.get_world_size()
            if world != self.stages:
                raise PipelineError(
                    f"pxform.{self.__name__}: {self.stages} stages but the world has {world} "
                    f"ranks; alone, a pipeline uses every rank along {self.axis!r}.\n  Fix: "
                    f"launch {self.stages} processes, or wrap it in pxform.shard with a mesh "
                    f"such as Mesh({{{self.axis!r}: {self.stages}, 'dp': "
                    f"{max(1, world // self.stages)}}}).")
            if "world" not in self._cache:
                self._cache["world"] = Mesh({self.axis: world})
            mesh = self._cache["world"]
            place = PipelineGroup(mesh.coordinate()[self.axis], self.stages,
                                  mesh.group(self.axis))
            return None, place, AxisGroups({}, {}, {}), None
        mesh = sharded._bound_mesh("call")
        if self.axis not in mesh.names or mesh.axis_size(self.axis) != self.stages:
            raise PipelineError(
                f"pxform.{self.__name__}: the enclosing shard's mesh {mesh} needs an axis "
                f"{self.axis!r} of size {self.stages} (the pipeline's stages).\n  Fix: e.g. "
                f"Mesh({{{self.axis!r}: {self.stages}, ...}}).")
        full = mesh_axes(mesh)
        names = [a for a in mesh.names if a != self.axis]
        axes = AxisGroups({a: full.groups[a] for a in names}, {a: full.index[a] for a in names},
                          {a: full.sizes[a] for a in names})
        sub = AbstractMesh(tuple((a, mesh.axis_size(a)) for a in names)) if names else None
        place = PipelineGroup(full.index[self.axis], self.stages, full.groups[self.axis])
        return mesh, place, axes, sub

    def _share_grads(self, program: PipelineProgram, place: Any, grads: dict[int, Any],
                     want: list[bool], layouts: list[Layout], sub: AbstractMesh | None,
                     leaves: list[Any]) -> dict[int, Any]:
        """Sum the gradients of inputs read on several pipeline ranks (tied weights)."""
        import torch.distributed as dist

        if place.size == 1:
            return grads
        owners: dict[int, set[int]] = {}
        for st in program.stages:
            for j in st.graph_inputs:
                owners.setdefault(j, set()).add(st.stage % place.size)
        for j in sorted(owners):
            if len(owners[j]) < 2 or not want[j] or not leaves[j].dtype.is_floating_point:
                continue
            g = grads.get(j)
            if g is None:
                shape = layouts[j].local_shape(tuple(leaves[j].shape), sub) if sub else \
                    tuple(leaves[j].shape)
                g = torch.zeros(shape, dtype=leaves[j].dtype)
            g = g.contiguous()
            dist.all_reduce(g, group=place.group)
            if place.rank in owners[j]:
                grads[j] = g
        return grads


def _without_mb(v: Any) -> Any:
    """The output value's type without the microbatch axis (combined by the runtime)."""
    from pxform.ir import TensorType, Value
    from pxform.lower.mpmd import MB
    from pxform.lower.spmd import layout_of, typed_layout

    if not isinstance(v, Value):
        return v
    layout = layout_of(v.type)
    dims = tuple(tuple(a for a in axes if a != MB) for axes in layout.dims)
    t = typed_layout(TensorType(v.type.shape, v.type.dtype), Layout(dims, layout.partial - {MB}))
    return Value(v.name, t)


def pipeline(fn: Any, *, stages: int, microbatches: int, schedule: Any = "1f1b",
             axis: str = "pp", batch_argnums: int | tuple[int, ...] | None = None,
             batch_dim: int = 0, recompute: Any = None, memory_budget: Any = None,
             **options: Any) -> Pipelined:
    """Run `fn` as a pipeline of `stages` ranks over `microbatches` microbatches.

    Args:
        fn: a pure function `(params, *batch) -> loss` (or `(loss, aux)`).
        stages: pipeline ranks along `axis` (virtual stages per rank come from the
            schedule: `virtual_stages=` for "interleaved", `forwards=` for "nf1b").
        microbatches: how many pieces the batch is cut into along `batch_dim`.
        schedule: "gpipe", "1f1b", "interleaved", "zb", "shifted", "nf1b", a schedule
            function `(stages, microbatches, **options) -> {rank: [Action]}`, or an action
            list as text or CSV (see `pxform.schedules`).
        axis: the mesh axis of the pipeline (when composed with `pxform.shard`).
        batch_argnums: the positional arguments carrying the batch (default: all but the
            first).
        recompute: blocks (layers from graph sharding) to recompute: None (only the
            user's `pxform.recompute` regions), "all", "stage_aware" (Merak: per stage, as
            few as fit `memory_budget`, see `recompute_plan`), or a list with the number of
            blocks each stage recomputes (its first ones).
        memory_budget: bytes per device (or a string such as "16GiB") for "stage_aware".
        **options: passed to the schedule (`virtual_stages=2`, `forwards=3`).

    Example:
        >>> step = pxform.pipeline(loss_fn, stages=2, microbatches=4)
        >>> loss, grads = pxform.value_and_grad(step)(params, batch)   # 2 ranks
        >>> step2 = pxform.shard(pxform.pipeline(loss_fn, stages=2, microbatches=4),
        ...                      mesh=pxform.Mesh({"pp": 2, "dp": 2}),
        ...                      in_specs=(None, P("dp")))             # 4 ranks
    """
    if not isinstance(stages, int) or stages < 1:
        raise PipelineError(f"pxform.pipeline: stages={stages!r}; give a positive integer")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PipelineError(f"pxform.pipeline: microbatches={microbatches!r}; give a positive "
                            f"integer")
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    budget = None
    if memory_budget is not None:
        try:
            budget = parse_bytes(memory_budget, "pxform.pipeline: memory_budget")
        except ValueError as exc:
            raise PipelineError(str(exc)) from None
    if isinstance(recompute, (list, tuple)):
        recompute = tuple(recompute)
    return Pipelined(fn, stages, microbatches, schedule, axis, tuple(sorted(options.items())),
                     nums, batch_dim, recompute, budget)
