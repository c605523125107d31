"""`pxform.pipeline`: run a function as a pipeline of stages over microbatches (MPMD).

    step = pxform.pipeline(loss_fn, stages=2, microbatches=4, schedule="1f1b")
    loss, grads = pxform.value_and_grad(step)(params, batch)   # under torchrun, 2 ranks
    print(step.cuts(params, batch))                            # which ops each stage holds

Stages come from `pxform.stage_boundary(x)` markers in the model, or from graph sharding
(`pxform.passes.cuts`). The batch arguments (all positional arguments after the first, unless
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
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import optree
import torch

from pxform.core.errors import PipelineError, PxformWarning
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.core.precision import Precision
from pxform.core.units import parse_bytes
from pxform.frontend.regions import RECOMPUTE
from pxform.frontend.trace import Traced, cache_key, module_given, trace
from pxform.lower.mpmd import (
    MB,
    PipelineProgram,
    lower_pipeline,
    output_layouts,
    split_batch,
    with_microbatches,
)
from pxform.passes.cuts import StageCuts, stage_cuts, tag_blocks
from pxform.passes.expand import prepare
from pxform.runtime import world
from pxform.runtime.boundary import (
    global_stand_in,
    is_dtensor,
    mesh_axes,
)
from pxform.runtime.buckets import DEFAULT_BUCKET_MB
from pxform.runtime.collectives import AxisGroups
from pxform.runtime.mesh import Mesh
from pxform.runtime.pipeline import PipelineGroup, reads, run_pipeline
from pxform.transforms.base import Enclosing, Nested, precision_arg, trainable_leaves
from pxform.transforms.compile import Fallback, op_strategies
from pxform.transforms.initialize import (
    initialize,
    known_batch,
    parameters_like,
    refuse_meta,
    stand_ins,
    with_placeholders_filled,
)
from pxform.transforms.specs import out_spec_layouts

if TYPE_CHECKING:  # stage-aware recompute is a search: loaded only when asked for
    from pxform.search.stage_recompute import RecomputePlan


@dataclass(frozen=True, eq=False)
class Pipelined(Nested):
    """A function transformed by `pxform.pipeline`."""

    label: ClassVar[str] = "pipeline"

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
    # ops without a rule: refused, or run replicated (`allow_fallback=True`)
    fallback: Fallback = Fallback()
    # mixed precision (`pxform.Precision`); None: the enclosing shard's, if any
    precision: Precision | None = None
    # training-mode BatchNorm by the whole batch's statistics (default: each microbatch's
    # rows, and each rank's, by their own)
    sync_batch_norm: bool = False
    _cache: dict = field(default_factory=dict, repr=False)

    def options_text(self) -> str:
        return (f", stages={self.stages}, microbatches={self.microbatches}, "
                f"schedule={self.schedule!r})")

    def _trace(self, full: tuple[Any, ...], enclosing: Enclosing | None = None) -> Traced:
        # the pipeline's own allow_fallback, or the enclosing shard's
        fallback = self.fallback if self.fallback.allow or enclosing is None \
            else enclosing.fallback
        precision = self.precision if self.precision is not None or enclosing is None \
            else enclosing.precision
        traced = trace(self.fn, *full, allow_fallback=fallback.allow,
                       report_fallbacks=fallback.report, precision=precision,
                       param_argnums=[n for n in range(len(full))
                                      if n not in self._batch_argnums(len(full))],
                       sync_batch_norm=self.sync_batch_norm)
        if traced.state:
            names = ", ".join(traced.graph.inputs[k].name for k in traced.state[:3])
            raise PipelineError(
                f"pxform.{self.__name__}: the function updates module buffers in place "
                f"({names}{', ...' if len(traced.state) > 3 else ''}: BatchNorm's running "
                f"statistics in training mode), and a pipeline runs its microbatches one at "
                f"a time, so no step sees the whole batch's statistics.\n  Fix: run it "
                f"under pxform.shard (or pxform.auto, which then plans no pipeline), or put "
                f"the BatchNorm layers in eval mode (or track_running_stats=False).")
        return traced

    # ---------------------------------------------------------------- schedule

    def releases(self) -> dict[int, dict[Any, tuple[Any, ...]]]:
        """Per pipeline rank, after which receive each of its sends is waited for
        (`pxform.schedules.send_releases`)."""
        if "releases" not in self._cache:
            from pxform.schedules import send_releases

            self._cache["releases"] = send_releases(self.actions())
        return self._cache["releases"]

    def actions(self) -> dict[int, list[Any]]:
        """The validated schedule with its send/receive actions, per pipeline rank."""
        if "actions" not in self._cache:
            import pxform.schedules as schedules

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
        arg_of, leaves = [], []
        for n, a in enumerate(args):
            for leaf in optree.tree_leaves(a, is_leaf=is_dtensor):  # type: ignore[arg-type]
                if isinstance(leaf, torch.Tensor):
                    arg_of.append(n)
                    leaves.append(leaf)
        return arg_of, leaves

    def cuts(self, *args: Any) -> StageCuts:
        """Which ops (and modules) each stage holds; `print` it."""
        full: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
        traced = self._trace(full)
        return self._cuts(traced, full)

    def _cuts(self, traced: Traced, args: tuple[Any, ...], mesh: AbstractMesh | None = None,
              layouts: list[Layout] | None = None) -> StageCuts:
        arg_of, _ = self._inputs(args)
        batch = set(self._batch_argnums(len(args)))
        names = {v.name for v, n in zip(traced.graph.inputs, arg_of) if n in batch}
        graph = prepare(traced.graph, mesh, layouts)
        return stage_cuts(graph, self.num_stages, names, fn=self.__name__)

    def lower(self, *args: Any, mesh: AbstractMesh | None = None,
              layouts: list[Layout] | None = None,
              enclosing: Enclosing | None = None) -> PipelineProgram:
        """The per-stage programs for these arguments (`.as_text()` prints them). `mesh` is
        the sub-mesh each stage runs on (None: one device per stage); `layouts` lay out
        every tensor leaf on it (default replicated). Inside `pxform.shard`, `enclosing`
        gives both (the enclosing mesh without this pipeline's axis) and the out_specs."""
        if enclosing is not None:
            mesh, layouts = self._sub_mesh(enclosing), list(enclosing.layouts)
        return self._compile(args, mesh, layouts, enclosing)[0]

    def _sub_mesh(self, enclosing: Enclosing) -> AbstractMesh | None:
        """The enclosing mesh without this pipeline's axis: what each stage runs on."""
        whole = enclosing.abstract_mesh
        names = [a for a in whole.names if a != self.axis]
        return AbstractMesh(tuple((a, whole.axis_size(a)) for a in names)) if names else None

    def _compile(self, args: tuple[Any, ...], mesh: AbstractMesh | None,
                 layouts: list[Layout] | None, enclosing: Enclosing | None = None
                 ) -> tuple[PipelineProgram, Traced]:
        full: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
        out_specs = repr(enclosing.out_specs) if enclosing is not None else None
        key = (cache_key(full, {}), mesh, tuple(layouts or ()), out_specs)
        if key in self._cache:
            return self._cache[key]
        # a trace the caller made already (`pxform.auto` plans on one)
        traced = self._cache.get(("traced", key[0])) or self._trace(full, enclosing)
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
        split = {a.stage for acts in self.actions().values() for a in acts
                 if a is not None and a.kind == "W"}
        _warn_split_recompute(graph, cuts, split, self.__name__)
        graph, strategies = op_strategies(graph, lowering_mesh, in_layouts, self.planner,
                                          frozenset({MB}))
        # an enclosing shard's out_specs lay the outputs out on the sub-mesh
        wanted = (out_spec_layouts(enclosing.out_specs, traced, enclosing.abstract_mesh,
                                   enclosing.name)
                  if enclosing is not None and enclosing.out_specs is not None
                  else [None] * len(graph.outputs))
        outs = output_layouts(graph, lowering_mesh, in_layouts, strategies, wanted)
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

        self._compile(args, mesh, layouts)
        full: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
        key = (cache_key(full, {}), mesh, tuple(layouts or ()), None)
        return self._cache[("plan", key)]

    def _plan_recompute(self, cuts: StageCuts, batch_inputs: set[int], layouts: list[Layout],
                        mesh: AbstractMesh, leaves: list[Any]) -> RecomputePlan:
        from pxform.search.stage_recompute import block_memory, choose_recompute, in_flight

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
            return choose_recompute(memory, block_stage, param_bytes, flights, self.memory_budget,
                              fixed=[len(cuts.blocks)] * n, fn=self.__name__,
                              microbatches=self.microbatches)
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
            return choose_recompute(memory, block_stage, param_bytes, flights, self.memory_budget,
                              fn=self.__name__, microbatches=self.microbatches)
        fixed = list(self.recompute)
        if len(fixed) != n or not all(isinstance(c, int) and c >= 0 for c in fixed):
            raise PipelineError(
                f"pxform.{self.__name__}: recompute={self.recompute!r} must give a number of "
                f"blocks (>= 0) for each of the {n} stages.")
        return choose_recompute(memory, block_stage, param_bytes, flights, self.memory_budget,
                          fixed=fixed, fn=self.__name__, microbatches=self.microbatches)

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

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...],
            enclosing: Enclosing | None = None) -> tuple[Any, Any]:
        """Run this rank's part; with `grad_argnums`, also return gradients (see module
        doc). `enclosing` comes from an enclosing `pxform.shard` (its mesh has the pipeline
        axis)."""
        mesh, place, axes, sub = self._placement(enclosing)
        if enclosing is None:  # inside a shard, the shard checked
            refuse_meta(self.fn, args, self.__name__)
            args = with_placeholders_filled(args, self._cache.get("params_like"))
            self._cache["rest"] = stand_ins(args[1:])
        layouts = list(enclosing.layouts) if enclosing is not None else None
        program, traced = self._compile(args, sub, layouts, enclosing)
        arg_of, leaves = self._inputs(args)
        batch_args = set(self._batch_argnums(len(args)))
        batch_dims = {j: self.batch_dim for j, n in enumerate(arg_of) if n in batch_args}
        actions = self.actions()[place.rank]
        if grad_argnums:
            self._check_trainable(program)
        else:  # forward sweeps only
            actions = [a for a in actions if a is not None and a.kind in ("F", "SF", "RF")]
        split = {a.stage for acts in self.actions().values() for a in acts
                 if a is not None and a.kind == "W"}
        return run_pipeline(
            program, traced.out_tree, actions, split, args, grad_argnums, arg_of, leaves,
            layouts or [Layout.replicated(t.dim()) for t in leaves], batch_dims, place, axes,
            mesh, sub, enclosing.bucket_mb if enclosing is not None else DEFAULT_BUCKET_MB,
            enclosing.reshard_after_forward if enclosing is not None else True,
            trainable_leaves(traced, args), self.releases()[place.rank])

    def init(self, init_fn: Any, *init_args: Any, batch: tuple[Any, ...] | None = None
             ) -> Any:
        """The parameters computed by `init_fn(*init_args)` on this rank, only the leaves
        its stages read (whole: a pipeline alone runs one device per stage); the others are
        None. Which leaves those are depends on the traced step: pass the other arguments
        as `batch=` (shapes suffice), unless an earlier call or `lower` gave them.
        Inside `pxform.shard`, call the shard's `init` instead.

        Example:
            >>> step = pxform.pipeline(loss_fn, stages=2, microbatches=4)
            >>> params = step.init(init_gpt, cfg, batch=(batch,))  # rank 1: None for wte...
        """
        traced, params = parameters_like(init_fn, init_args)
        self._cache["params_like"] = params  # the shapes None placeholders stand for
        leaves = [x for x in optree.tree_leaves(params) if isinstance(x, torch.Tensor)]  # type: ignore[arg-type]
        rest = known_batch(batch, self._cache.get("rest"), self.__name__, PipelineError)
        held = self.holds((params, *rest))[:len(leaves)]
        return initialize(init_fn, init_args, None,
                          [Layout.replicated(t.dim()) for t in leaves], held, self.__name__,
                          traced)

    def holds(self, args: tuple[Any, ...], enclosing: Enclosing | None = None) -> list[bool]:
        """Per tensor leaf of `args`, whether this rank's stages read it: the leaves it
        computes with and gets gradients for (a tied weight is held by every stage that
        reads it). Lowers (cached) on the first call."""
        _, place, _, sub = self._placement(enclosing)
        layouts = list(enclosing.layouts) if enclosing is not None else None
        program, _ = self._compile(args, sub, layouts, enclosing)
        held = reads(program, place)
        return [j in held for j in range(len(self._inputs(args)[1]))]

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

    def _placement(self, enclosing: Enclosing | None
                   ) -> tuple[Any, Any, Any, AbstractMesh | None]:
        """(bound mesh or None, this rank's PipelineGroup, sub-mesh AxisGroups, sub-mesh)."""
        if enclosing is None:
            if not world.initialized():
                if self.stages == 1:
                    return None, PipelineGroup(0, 1), AxisGroups({}, {}, {}), None
                raise PipelineError(
                    f"pxform.{self.__name__}: {self.stages} stages need {self.stages} ranks, "
                    f"but torch.distributed is not initialised.\n  Fix: run under torchrun "
                    f"--nproc-per-node {self.stages}, or use .lower()/.cuts() to inspect.")
            ranks = world.size()
            mesh_text = f"Mesh({{{self.axis!r}: {self.stages}, 'dp': " \
                        f"{max(1, ranks // self.stages)}}})"
            if ranks != self.stages:
                raise PipelineError(f"pxform.{self.__name__}: {self.stages} stages but the "
                                    f"world has {ranks} ranks; alone, a pipeline uses every "
                                    f"rank along {self.axis!r}.\n  Fix: launch {self.stages} "
                                    f"processes, or wrap it in pxform.shard with a mesh such "
                                    f"as {mesh_text}.")
            if "world" not in self._cache:
                self._cache["world"] = Mesh({self.axis: ranks})
            mesh = self._cache["world"]
            place = PipelineGroup(mesh.coordinate()[self.axis], self.stages,
                                  mesh.group(self.axis), mesh.timeout_s)
            return None, place, AxisGroups({}, {}, {}), None
        mesh = enclosing.bound_mesh("call")
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
        place = PipelineGroup(full.index[self.axis], self.stages, full.groups[self.axis],
                              mesh.timeout_s)
        return mesh, place, axes, sub


def pipeline(fn: Any, *, stages: int, microbatches: int, schedule: Any = "1f1b",
             axis: str = "pp", batch_argnums: int | tuple[int, ...] | None = None,
             batch_dim: int = 0, recompute: Any = None, memory_budget: Any = None,
             allow_fallback: bool = False, precision: Precision | None = None,
             sync_batch_norm: bool = False, **options: Any) -> Pipelined:
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
        allow_fallback: run ops that have no sharding rule replicated (their inputs
            gathered, every rank computing the whole op), reported per op in one
            `PxformWarning`, instead of refusing them.
        precision: a mixed-precision policy (`pxform.Precision`, see `pxform.shard`);
            microbatch gradients are summed in its `reduce_dtype`.
        sync_batch_norm: training-mode BatchNorm by the whole batch's statistics; by
            default each microbatch's rows are normalised by their own (see
            `pxform.shard`). A function that writes running statistics is refused: no
            pipeline step sees the whole batch at once.
        **options: passed to the schedule (`virtual_stages=2`, `forwards=3`).

    Example:
        >>> step = pxform.pipeline(loss_fn, stages=2, microbatches=4)
        >>> loss, grads = pxform.value_and_grad(step)(params, batch)   # 2 ranks
        >>> step2 = pxform.shard(pxform.pipeline(loss_fn, stages=2, microbatches=4),
        ...                      mesh=pxform.Mesh({"pp": 2, "dp": 2}),
        ...                      in_specs=(None, P("dp")))             # 4 ranks
    """
    if isinstance(fn, torch.nn.Module):
        raise module_given(fn, "pipeline")
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
                     nums, batch_dim, recompute, budget, fallback=Fallback(allow=allow_fallback),
                     precision=precision_arg(precision, "pipeline"),
                     sync_batch_norm=sync_batch_norm)


def _warn_split_recompute(graph: Any, cuts: StageCuts, split: set[int], fn: str) -> None:
    """Warn where a stage with W actions (zero-bubble) has recompute regions: its W asks
    autograd for each weight op's gradient apart, and torch's checkpoint runs a region's
    forward again for each such call as well as for B, keeping what B recomputed until the
    W. On GPT small (2 gloo ranks, every block recomputed) that took 1.8 times the memory
    and 3.7 times the step of zero-bubble without recompute (the fifty-third session);
    `pxform.auto` never pairs them."""
    regions = list(dict.fromkeys(op.tag(RECOMPUTE).fn for k, op in enumerate(graph.ops)
                                 if cuts.op_stage[k] in split
                                 and op.tag(RECOMPUTE) is not None))
    if not regions:
        return
    warnings.warn(
        f"pxform.{fn}: stages {sorted(split)} of its zero-bubble schedule run "
        f"recompute regions ({', '.join(regions[:3])}{', ...' if len(regions) > 3 else ''}): "
        f"each W action asks for each weight gradient apart, and the checkpoint runs the "
        f"region's forward again for each of them as well as for B, keeping what B "
        f"recomputed until the W. That takes more memory and time than no recompute "
        f"(GPT small on 2 ranks: 1.8x the memory, 3.7x the step).\n  Fix: recompute under "
        f"schedule='1f1b' or 'shifted' (stage-aware recompute), or drop recompute for 'zb'.",
        PxformWarning, stacklevel=4)
