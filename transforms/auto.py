"""`pxform.auto`: search a plan for a function, then lower and run it.

`auto` adds no machinery of its own to the data flow: `.plan(*args)` traces on fake
tensors and runs the search (`pxform.search`) against an abstract device count; running
composes the transforms a user would write by hand, `pxform.shard` over
`pxform.pipeline` when the plan has stages, on a mesh with the plan's axes (`pp`, `outer`,
`inner`), with parameters laid out per the plan's specs and each op's strategy taken from
the plan instead of greedy propagation (`pxform.lower.plan.PlanLowering`). So a plan runs on
exactly the lowering and runtime every other program uses.

A complete plan given with `plan=` (e.g. `Plan.load(path)`) runs as it is: nothing is
searched, and neither the search nor the cost model is imported.

Example:
    >>> @pxform.auto(mesh=pxform.Mesh.abstract(8), memory_budget="40GiB",
    ...              hardware="a100-40gb")
    ... def step(params, batch):
    ...     return loss_fn(params, batch)
    >>> print(step.plan(params, batch).explain())      # on a laptop: fake tensors only
    >>> loss, grads = pxform.value_and_grad(step)(params, batch)   # under torchrun
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import optree
import torch

from pxform.core.errors import PxformError, PxformWarning
from pxform.core.ir import Graph
from pxform.core.mesh import AbstractMesh
from pxform.core.precision import Precision
from pxform.core.spec import P
from pxform.core.units import format_bytes, format_table, parse_bytes
from pxform.frontend.trace import cache_key, module_given, trace
from pxform.lower.plan import PlanLowering
from pxform.passes.expand import prepare
from pxform.runtime import world
from pxform.runtime.boundary import global_stand_in, is_dtensor, leaf_arg_index
from pxform.runtime.mesh import Mesh
from pxform.search.plan import Plan
from pxform.transforms.base import (
    Executable,
    fn_name,
    is_tensor_leaf,
    precision_arg,
    trainable_leaves,
)
from pxform.transforms.compile import Fallback
from pxform.transforms.initialize import stand_ins, with_placeholders_filled
from pxform.transforms.pipeline import Pipelined
from pxform.transforms.shard import Sharded

if TYPE_CHECKING:  # the search and the cost model load only when a plan is searched
    from pxform.cost.hardware import Hardware
    from pxform.search.context import Pin


@dataclass(frozen=True, eq=False)
class Auto(Executable):
    """A function transformed by `pxform.auto`."""

    label: ClassVar[str] = "auto"

    fn: Any
    devices: int
    memory_budget: int | None  # None with a given plan: nothing is searched
    objective: str
    hardware: Hardware | None  # None with a given plan
    batch_range: tuple[int, int] | None
    batch_argnums: tuple[int, ...] | None
    batch_dim: int
    pin: Pin | None
    optimizer: str
    progress: Callable[[int, int], None] | None = field(default=None, repr=False)
    given: Plan | None = None  # a complete plan to run as it is
    allow_fallback: bool = True  # ops without a rule run replicated, reported once
    precision: Precision | None = None  # mixed precision, applied by the trace
    sync_batch_norm: bool = False  # training-mode BatchNorm by the whole batch's statistics
    memory_margin: float = 0.0  # plans fit memory_budget x (1 - memory_margin)
    tolerance: float = 0.0  # plans within this fraction of the fastest: the simplest
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def __name__(self) -> str:  # the function's own: plans and messages say auto(name)
        return fn_name(self.fn)

    def options_text(self) -> str:
        hardware = self.hardware.name if self.hardware is not None else \
            self.given.hardware if self.given is not None else None
        return (f", devices={self.devices}, hardware={hardware!r}, "
                f"objective={self.objective!r}")

    def _batch_argnums(self, n: int) -> tuple[int, ...]:
        if self.batch_argnums is not None:
            return tuple(k % n for k in self.batch_argnums)
        return tuple(range(1, n)) if n > 1 else (0,)

    def _graph(self, args: tuple[Any, ...]) -> tuple[Graph, set[str], Any]:
        """The prepared graph, the names of its batch inputs, the global arguments."""
        full: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
        batch = set(self._batch_argnums(len(args)))
        traced = trace(self.fn, *full, allow_fallback=self.allow_fallback,
                       precision=self.precision,
                       param_argnums=[n for n in range(len(args)) if n not in batch],
                       sync_batch_norm=self.sync_batch_norm)
        self._cache["writes_state"] = bool(traced.state)
        # the lowering check traces the same function on the same arguments again: it
        # takes this trace instead (`_made`), a third of planning time for GPT-3 175B
        self._cache["traced"] = (cache_key(full, {}), traced)
        graph = prepare(traced.graph)
        leaves = optree.tree_leaves(full)  # type: ignore[arg-type]
        arg_of = [n for n, leaf in zip(leaf_arg_index(full), leaves)
                  if isinstance(leaf, torch.Tensor)]
        names = {v.name for v, n in zip(graph.inputs, arg_of) if n in batch}
        # the parameters the step will differentiate, as `value_and_grad` picks them
        # (`trainable_leaves`: requires_grad marks them, module buffers never): the
        # search holds the others frozen. From `args`, whose DTensors keep their marks
        # (`full`'s stand-ins do not)
        self._cache["trainable"] = frozenset(
            v.name for v, n, keep in zip(graph.inputs, arg_of, trainable_leaves(traced, args))
            if keep and n not in batch and v.type.dtype.is_floating_point)
        return graph, names, full

    def plan(self, *args: Any) -> Plan:
        """The plan for these arguments: searched on fake tensors (no devices, no
        processes), once per argument signature; or the plan given with `plan=`, checked
        to fit these arguments. Arguments may be on `meta`."""
        self._cache["planned"] = stand_ins(args)
        return self._planned(args)[0]

    def init(self, init_fn: Any, *init_args: Any) -> Any:
        """The parameters computed by `init_fn(*init_args)`, laid out as the plan of the
        last `plan(...)` call runs them (see `Sharded.init`): each rank computes only its
        own pieces; in a pipelined plan, only its stages' leaves (None for the rest).

        Example:
            >>> step = pxform.auto(loss_fn, mesh=4, memory_budget="8GiB")
            >>> step.plan(params_on_meta, batch)
            >>> params = step.init(init_fn)
        """
        args = self._cache.get("planned")
        if args is None:
            raise PxformError(
                f"pxform.auto({self.__name__}).init: the layout comes from the plan, and no "
                f"plan was made yet.\n  Fix: call step.plan(params, batch) first (meta "
                f"tensors do: params = pxform.trace-able shapes, e.g. from a model on meta).")
        exe = self.executable(*args)
        params = exe.init(init_fn, *init_args, batch=args[1:])
        self._cache["params_like"] = exe._last["params_like"]  # what None stands for
        return params

    def _filled(self, args: tuple[Any, ...]) -> tuple[Any, ...]:
        """`args` with the None placeholders `init` left (other stages' leaves) standing
        for their shapes again, so they plan and run as the parameters they stand for."""
        return with_placeholders_filled(args, self._cache.get("params_like"))

    def _planned(self, args: tuple[Any, ...]) -> tuple[Plan, set[str], tuple[Any, ...]]:
        """(plan, names of the batch inputs, the graph's inputs), once per signature."""
        with _gc_paused():  # from the first step: the caller's garbage is not ours to collect
            full: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
            key = cache_key(full, {})
            if key not in self._cache:
                self._cache[key] = self._plan_now(args)
            return self._cache[key]

    def _plan_now(self, args: tuple[Any, ...]) -> tuple[Plan, set[str], tuple[Any, ...]]:
        """Trace, search (or check the given plan) and check it lowers (`_planned`)."""
        graph, names, _ = self._graph(args)
        if self.given is not None:
            plan = self.given
            self._lowering(plan).graph(graph)  # made for this graph, or an error
        else:
            from pxform.search import search

            assert self.hardware is not None and self.memory_budget is not None
            from pxform.search.context import Pin

            pin = self.pin
            if self._cache.get("writes_state") and (pin is None or pin.stages is None):
                # module state written in place (BatchNorm's running statistics) needs
                # the whole batch in one step: no pipeline (`pxform.pipeline` refuses)
                pin = dataclasses.replace(pin or Pin(), stages=1)
            budget, hardware = self.memory_budget, self.hardware

            def best(pin: Pin | None) -> Plan:
                return search(graph, names, devices=self.devices,
                              budget=budget, hardware=hardware,
                              objective=self.objective, batch_range=self.batch_range,
                              pin=pin, batch_dim=self.batch_dim, optimizer=self.optimizer,
                              fn=f"auto({self.__name__})", function=self.__name__,
                              progress=self.progress, margin=self.memory_margin,
                              tolerance=self.tolerance, trainable=self._cache["trainable"])

            plan = best(pin)
            # never return a plan that cannot run: lower it on its abstract mesh first;
            # if it fails, the best plan without sequence parallelism, under 1F1B,
            # without pipeline stages, then without tensor parallelism (plain data
            # parallel / ZeRO), says which in its notes
            failure = self._fails_to_lower(plan, args, graph.inputs, names)
            tried = [(plan.config_text(), failure)] if failure else []
            from pxform.search.pipelines import ONE_F_ONE_B

            fallbacks: list[dict[str, Any]] = [{"stages": 1}, {"stages": 1, "inner": 1}]
            if plan.stages > 1 and (plan.schedule, plan.virtual_stages) != ("1f1b", 1):
                # the same pipeline under plain 1F1B first
                fallbacks.insert(0, {"schedule": ONE_F_ONE_B})
            if any(r == "sp" for b in plan.blocks for _, r in b.roles):
                # and the same without sequence parallelism
                fallbacks.insert(0, {"sequence_parallel": False})
            for fewer in fallbacks:
                if not failure:
                    break
                if pin is not None and any(getattr(pin, k) not in (None, v)
                                           for k, v in fewer.items()):
                    continue  # the user pinned otherwise
                plan = best(dataclasses.replace(pin or Pin(), **fewer))
                failure = self._fails_to_lower(plan, args, graph.inputs, names)
                if failure:
                    tried.append((plan.config_text(), failure))
            if failure:
                raise PxformError(
                    f"pxform.auto({self.__name__}): no plan the search found lowers for "
                    f"{self.devices} devices: " + "; ".join(f"{c}: {e}" for c, e in tried)
                    + "\n  Fix: pass plan=pxform.search.Pin(...) to fix the layout, "
                    "or report the error with the function that caused it.")
            if tried:
                plan = dataclasses.replace(plan, notes=(*plan.notes, *(
                    f"the searched plan {c} does not lower ({e}); this is the best "
                    f"that does" for c, e in tried)))
            if self.precision is not None:
                plan = dataclasses.replace(
                    plan, precision=tuple(self.precision.to_json().items()))
        # which blocks keep ZeRO-3's gathered parameters for backward: the runtime
        # takes it by parameter path (`PlanLowering.reshard`)
        self._cache[("reshard", id(plan))] = self._lowering(plan).reshard(graph)
        # what was trained when it was planned (`_check_marks`)
        traced = self._cache["traced"][1]
        self._cache[("marks", id(plan))] = (traced, trainable_leaves(traced, args))
        self._cache[("trainable", id(plan))] = self._cache["trainable"]
        return plan, names, graph.inputs

    def _fails_to_lower(self, plan: Plan, args: tuple[Any, ...], inputs: tuple[Any, ...],
                        names: set[str]) -> str | None:
        """Why `plan` does not lower on its abstract mesh (None: it does). The lowering
        checks every conversion and pipeline transfer, on fake tensors, for no devices."""
        checked = self._made(plan, AbstractMesh(dict(plan.mesh.axes)),
                             self._in_specs(plan, args, inputs, names),
                             Fallback(allow=self.allow_fallback, report=False))
        try:
            checked.lower(*args)
        except Exception as exc:  # any failure rejects the plan; the text says which
            text = str(exc).strip().splitlines()
            return f"{type(exc).__name__}: {text[0] if text else ''}"
        self._cache[("checked", id(plan))] = checked  # its programs serve `executable`
        return None

    def _made(self, plan: Plan, mesh: Any, specs: tuple[Any, ...], fallback: Fallback,
              like: Sharded | None = None) -> Sharded:
        """The `pxform.shard` (over `pxform.pipeline` when the plan has stages) running
        `plan` on `mesh` (bound, to run; abstract, to lower). `like`, the same made on the
        abstract mesh and lowered already, lends its programs (lowering depends on the
        abstract mesh only), so a checked plan is not lowered twice."""
        lowering = self._lowering(plan)
        reshard = self._cache.get(("reshard", id(plan)), True)
        if plan.stages > 1:
            fn: Any = like.fn if like is not None else Pipelined(
                self.fn, plan.stages, plan.microbatches, plan.schedule, "pp",
                tuple(sorted(plan.schedule_options.items())),
                batch_argnums=self._batch_argnums(len(specs)), batch_dim=self.batch_dim,
                planner=lowering, fallback=fallback, precision=self.precision,
                sync_batch_norm=self.sync_batch_norm)
            exe = Sharded(fn, mesh, specs, reshard_after_forward=reshard,
                          precision=self.precision, sync_batch_norm=self.sync_batch_norm)
        else:
            exe = Sharded(self.fn, mesh, specs, planner=lowering, fallback=fallback,
                          reshard_after_forward=reshard, precision=self.precision,
                          sync_batch_norm=self.sync_batch_norm)
        if like is not None:
            exe._cache.update(like._cache)
        elif "traced" in self._cache and self.precision is None:
            # (with a precision policy the two traces may cast different arguments)
            key, traced = self._cache["traced"]
            (fn if plan.stages > 1 else exe)._cache[("traced", key)] = traced
        return exe

    def executable(self, *args: Any) -> Any:
        """The `pxform.shard` (over `pxform.pipeline` when the plan has stages) that runs
        the plan on this world."""
        return self._executable(self._planned(args), args)

    def _executable(self, planned: tuple[Plan, set[str], tuple[Any, ...]],
                    args: tuple[Any, ...]) -> Any:
        plan, names, inputs = planned
        key = ("exe", id(plan))
        if key in self._cache:
            return self._cache[key]
        ranks = world.size()
        if ranks != plan.devices:
            raise PxformError(
                f"pxform.auto({self.__name__}): the plan is for {plan.devices} devices but "
                f"this world has {ranks} process(es).\n  Fix: launch with torchrun "
                f"--nproc-per-node {plan.devices} (or plan for {ranks} devices: "
                f"pxform.auto(..., mesh={ranks})).")
        specs = self._in_specs(plan, args, inputs, names)
        # planning traced the function and reported its fallback ops: running does not again
        exe = self._made(plan, Mesh(dict(plan.mesh.axes)), specs,
                         Fallback(allow=self.allow_fallback, report=False),
                         like=self._cache.pop(("checked", id(plan)), None))
        self._cache[key] = exe
        return exe

    def _lowering(self, plan: Plan) -> PlanLowering:
        """One `PlanLowering` per plan: it remembers the graphs it checked."""
        key = ("lowering", id(plan))
        if key not in self._cache:
            self._cache[key] = PlanLowering(plan, f"auto({self.__name__})")
        return self._cache[key]

    def _in_specs(self, plan: Plan, args: tuple[Any, ...], inputs: tuple[Any, ...],
                  names: set[str]) -> tuple[Any, ...]:
        """Per argument leaf, its spec: parameters per the plan, batch leaves as the first
        block reading each wants them (`plan.batch_input_specs`: split over that block's
        data axes; the search costs every block as receiving its batch inputs so). `inputs`
        are the graph's inputs, one per tensor leaf."""
        full: Any = optree.tree_map(global_stand_in, args, is_leaf=is_dtensor)  # type: ignore[arg-type]
        specs = dict(plan.parameter_specs)
        batch_specs = dict(plan.batch_input_specs)
        first = plan.blocks[0] if plan.blocks else None
        data_axes = tuple(a for a, r in (first.roles if first else ()) if r in ("dp", "sdp"))
        batch_entry: Any = (data_axes if len(data_axes) > 1 else data_axes[0]) \
            if data_axes else None
        leaf_specs = []
        for v in inputs:
            if v.name in batch_specs:  # as its first reader wants it
                leaf_specs.append(batch_specs[v.name])
            elif v.name in names:  # a batch input no op reads
                entries: list[Any] = [None] * v.type.rank
                entries[self.batch_dim] = batch_entry
                leaf_specs.append(P(*entries))
            else:
                leaf_specs.append(specs.get(v.name, P()))
        it = iter(leaf_specs)
        out = []
        for a in full:
            leaves, tree = optree.tree_flatten(a, none_is_leaf=True)
            out.append(optree.tree_unflatten(tree, [next(it) if isinstance(x, torch.Tensor)
                                                    else None for x in leaves]))
        return tuple(out)

    def holds(self, *args: Any) -> Any:
        """Per leaf of `args` (same pytree), whether this rank computes with it: True for
        every tensor leaf unless the plan has pipeline stages, where a rank holds only what
        its stage reads (it gets None gradients for the rest, and its copies of the rest
        are never read or updated). Training loops use it to give the optimizer and the
        checkpoint only the parameters this rank owns.

        Example:
            >>> held = step.holds(params, batch)[0]    # {"wte": True, "blocks": [...], ...}
        """
        args = self._filled(args)
        exe = self.executable(*args)
        reads = iter(exe.fn.holds(args, enclosing=exe.enclosing(args))) \
            if isinstance(exe.fn, Pipelined) else None

        def held(x: Any) -> bool:  # one flag per tensor leaf, in leaf order
            return isinstance(x, torch.Tensor) and (reads is None or next(reads))

        return tuple(optree.tree_map(held, a, is_leaf=is_dtensor, none_is_leaf=True)
                     for a in args)  # type: ignore[arg-type]

    def distribute(self, *args: Any) -> Any:
        """The arguments laid out per the plan, as DTensors on this world's mesh."""
        return self.executable(*args).distribute(*args)

    def run(self, args: tuple[Any, ...], grad_argnums: tuple[int, ...]) -> tuple[Any, Any]:
        """Plan (once), lower and run on this rank (what `value_and_grad` calls)."""
        filled = self._filled(args)
        planned = self._planned(filled)
        if grad_argnums:
            self._check_marks(planned, args, filled)
        return self._executable(planned, filled).run(args, grad_argnums)

    def _check_marks(self, planned: tuple[Plan, set[str], tuple[Any, ...]],
                     args: tuple[Any, ...], filled: tuple[Any, ...]) -> None:
        """Warn, once per change, where the leaves this rank holds are trained otherwise
        than when the plan was made (`requires_grad` set or cleared since: unfreezing
        layers as training goes on). The step runs them as they are marked now, exactly;
        but the plan was chosen, and its memory and time predicted, for the old marks: a
        parameter trained now holds a gradient and optimizer state the plan did not
        count. The warning names them and gives the plan's peak re-priced for the new
        marks (the same layouts, `search` with the plan pinned). Not re-planned: the
        parameters and the optimizer's state are laid out for this plan."""
        plan, names, inputs = planned
        was = self._cache.get(("marks", id(plan)))
        if was is None:
            return
        # (a pipeline rank holds only its stages' leaves: the others are None, stood in for)
        leaves = [x for x in optree.tree_leaves(args, none_is_leaf=True,  # type: ignore[arg-type]
                                                is_leaf=is_tensor_leaf)
                  if x is None or isinstance(x, torch.Tensor)]
        # the marks as they were at the last step checked: most steps stop here (0.1 ms
        # for HF BERT-large's 400 leaves; the full check below takes 0.25 ms more)
        seen = tuple(None if x is None else x.requires_grad for x in leaves)
        if self._cache.get(("marks seen", id(plan))) == seen:
            return
        self._cache[("marks seen", id(plan))] = seen
        traced, marks = was
        now = trainable_leaves(traced, filled)
        if now == marks:
            return
        held = [x is not None for x in leaves]
        changed = tuple(k for k, (a, b, h) in enumerate(zip(marks, now, held)) if h and a != b)
        key = ("marks warned", id(plan), changed, tuple(now[k] for k in changed))
        if not changed or key in self._cache:
            return
        self._cache[key] = True
        trained = [inputs[k].name for k in changed if now[k]]
        frozen = [inputs[k].name for k in changed if not now[k]]

        def listed(what: list[str]) -> str:
            return ", ".join(what[:4]) + (f" and {len(what) - 4} more" if len(what) > 4 else "")

        parts = []
        if trained:
            parts.append(f"{len(trained)} trained now that were frozen ({listed(trained)})")
        if frozen:
            parts.append(f"{len(frozen)} frozen now that were trained ({listed(frozen)})")
        repriced = self._repriced(plan, names, traced,
                                  (self._cache[("trainable", id(plan))] | set(trained))
                                  - set(frozen))
        warnings.warn(
            f"pxform.auto({self.__name__}): the requires_grad marks of the parameters "
            f"changed since the plan was made: {'; '.join(parts)}. The step runs them as "
            f"marked now (the gradients are exact), but the plan was chosen and priced for "
            f"the marks it was made with: predicted peak "
            f"{format_bytes(int(plan.peak_memory_bytes))} per device{repriced}.\n  Fix: to "
            f"plan for the new marks, make a new pxform.auto(...) and call .plan(...) with "
            f"them, then lay the parameters and optimizer state out for that plan "
            f"(step.init); or set the marks before planning.", PxformWarning, stacklevel=3)

    def _repriced(self, plan: Plan, names: set[str], traced: Any,
                  trainable: set[str]) -> str:
        """`_check_marks`' text: the plan's peak and step time with `trainable` trained
        (its choices pinned), against the budget; empty where that cannot be priced (a
        plan given with `plan=` has no hardware to price it on)."""
        if self.hardware is None or self.memory_budget is None:
            return ""
        from pxform.search import pin_of, search

        try:
            again = search(prepare(traced.graph), names, devices=self.devices,
                           budget=UNPRICED_BUDGET, hardware=self.hardware,
                           pin=pin_of(plan), batch_dim=self.batch_dim,
                           optimizer=self.optimizer, fn=f"auto({self.__name__})",
                           trainable=trainable)
        except PxformError:  # (the pinned choices no longer fit the graph's blocks)
            return ""
        budget = self.memory_budget
        verdict = "over" if again.peak_memory_bytes > budget else "within"
        return (f"; re-priced for the new marks: {format_bytes(int(again.peak_memory_bytes))}"
                f" ({verdict} the {format_bytes(budget)} budget), step "
                f"{again.step_time_s:.4g} s against {plan.step_time_s:.4g} s")


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Planning without the cyclic garbage collector: tracing and the search make millions
    of short-lived objects, and its full collections took a tenth of planning GPT-3 175B
    (nothing planning makes needs collecting before it ends; reference counting still frees
    everything else at once)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


UNPRICED_BUDGET = 2**60
"""The budget a plan is re-priced under (`Auto._repriced`): any peak fits it."""


DEFAULT_TOLERANCE = 0.05
"""`auto`'s default: plans within 5 % of the fastest predicted step are ties, and the
simplest wins (`pxform.search.partition.SIMPLER_WITHIN`)."""

DEFAULT_MEMORY_MARGIN = 0.05
"""The share of the memory budget `auto`'s plans keep free by default: the memory model's
error on measured plans (`docs/benchmarks/accuracy.md`)."""


def auto(fn: Any = None, *, mesh: Any, memory_budget: Any = None, objective: str = "time",
         hardware: Any = None, batch_range: tuple[int, int] | None = None,
         batch_argnums: int | tuple[int, ...] | None = None, batch_dim: int = 0,
         plan: Plan | Pin | None = None, optimizer: str = "adam",
         progress: Callable[[int, int], None] | None = None, allow_fallback: bool = True,
         precision: Precision | None = None, sync_batch_norm: bool = False,
         memory_margin: float = DEFAULT_MEMORY_MARGIN,
         tolerance: float = DEFAULT_TOLERANCE) -> Any:
    """Search a parallel plan for `fn` and run it (module doc). Usable as a decorator.

    Args:
        mesh: the devices to plan for: a device count, `pxform.Mesh.abstract(1024)`,
            named axis sizes (only their product is used: the search lays out its own
            axes), or a bound `pxform.Mesh` (its size).
        memory_budget: bytes per device, or a string such as "80GiB" (default: the
            hardware's device memory).
        objective: "time", "memory" or "devices" (see `pxform.search.search`).
        hardware: a preset name ("a100-40gb", "a100-80gb", "h100-80gb", the default), a
            path to a profile written by `pxform calibrate`, or a
            `pxform.hardware.Hardware`.
        batch_range: (low, high) to also search the global batch size.
        batch_argnums: the arguments carrying the batch (default: all but the first).
        plan: a complete `Plan` (e.g. `pxform.Plan.load(path)`) to run as it is, with
            nothing searched; or a `pxform.search.Pin` to search with some choices fixed.
        optimizer: "adam" or "sgd" (optimizer state in the memory count). Parameters
            marked `requires_grad=False` in the planned arguments are frozen: counted
            without gradients or optimizer state (docs/search.md, Frozen parameters).
        progress: called as `progress(done, total)` after each configuration the search
            evaluates (`pxform plan` draws its progress bar with it).
        allow_fallback: ops that have no sharding rule run replicated (inputs gathered,
            every rank computing the whole op, costed as such), named in one
            `PxformWarning` when the function is traced for planning; False refuses them.
        precision: a mixed-precision policy (`pxform.Precision`, see `pxform.shard`). The
            search prices what it gives: compute at the compute dtype's FLOP rate,
            activations and gathers in its bytes, gradient reductions in `reduce_dtype`.
        sync_batch_norm: training-mode BatchNorm by the whole batch's statistics (see
            `pxform.shard`); by default each rank's rows by their own, as DDP. A function
            that writes running statistics gets a plan without pipeline stages.
        memory_margin: a fraction of `memory_budget` the plan keeps free (default 0.05:
            plans fit 95 % of it): a plan at 99.9 % of the budget fails on the memory
            model's first error. The plan's `headroom_bytes` and `explain()` show what it
            leaves; 0 plans to the whole budget.
        tolerance: configurations predicted within this fraction of the fastest are
            ties, and the simplest wins: fewer pipeline stages, then fewer microbatches,
            then 1F1B, then fewer tensor-parallel blocks (default 0.05: the model's error
            is larger, and such near-ties flipped with each calibration); the plan's
            notes name the faster plan it passed over. 0 takes the fastest.

    Example:
        >>> step = pxform.auto(loss_fn, mesh=8, memory_budget="40GiB", hardware="a100-40gb")
        >>> plan = step.plan(params, batch)
    """
    if fn is None:
        return functools.partial(auto, mesh=mesh, memory_budget=memory_budget,
                                 objective=objective, hardware=hardware,
                                 batch_range=batch_range, batch_argnums=batch_argnums,
                                 batch_dim=batch_dim, plan=plan, optimizer=optimizer,
                                 progress=progress, allow_fallback=allow_fallback,
                                 precision=precision, sync_batch_norm=sync_batch_norm,
                                 memory_margin=memory_margin, tolerance=tolerance)
    if isinstance(fn, torch.nn.Module):
        raise module_given(fn, "auto")
    devices = _device_count(mesh)
    nums = (batch_argnums,) if isinstance(batch_argnums, int) else batch_argnums
    if isinstance(plan, Plan):
        if plan.devices != devices:
            raise PxformError(f"pxform.auto({getattr(fn, '__name__', 'fn')}): the pinned plan "
                              f"is for {plan.devices} devices but mesh= gives {devices}.\n  "
                              f"Fix: pass mesh={plan.devices}, or search again without plan=.")
        # runs as it is: no hardware profile, budget or search (nor their imports), under
        # the precision it was made with
        policy = precision_arg(precision, "auto")
        if policy is None:
            policy = plan.policy
        elif plan.policy != policy:
            raise PxformError(
                f"pxform.auto({getattr(fn, '__name__', 'fn')}): the pinned plan was made "
                f"under precision {plan.policy} but precision= gives {policy}.\n  Fix: drop "
                f"precision= (the plan's is used), or search again under the new policy.")
        return Auto(fn, devices, None, objective, None, batch_range, nums, batch_dim, None,
                    optimizer, progress, given=plan, allow_fallback=allow_fallback,
                    precision=policy, sync_batch_norm=sync_batch_norm)
    from pxform.cost.hardware import hardware as get_hardware

    hw = get_hardware(hardware if hardware is not None else "h100-80gb")
    budget = hw.memory_bytes if memory_budget is None else \
        _budget(memory_budget, getattr(fn, "__name__", "fn"))
    name = getattr(fn, "__name__", "fn")
    _fraction(memory_margin, "memory_margin", "memory_budget", name,
              "memory_margin=0.05 plans within 95 % of the budget; 0 plans to all of it")
    _fraction(tolerance, "tolerance", "the fastest plan's step", name,
              "tolerance=0.05 takes the simplest plan within 5 % of the fastest; 0 takes "
              "the fastest")
    return Auto(fn, devices, budget, objective, hw, batch_range, nums, batch_dim, plan,
                optimizer, progress, allow_fallback=allow_fallback,
                precision=precision_arg(precision, "auto"), sync_batch_norm=sync_batch_norm,
                memory_margin=memory_margin, tolerance=tolerance)


def _fraction(value: Any, arg: str, of: str, name: str, example: str) -> None:
    """Refuse `arg=value` unless it is a number in [0, 1) (a fraction of `of`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1:
        raise PxformError(f"pxform.auto({name}): {arg}={value!r}; give a fraction of {of} in "
                          f"[0, 1).\n  Fix: e.g. {example}.")


def _budget(value: Any, name: str) -> int:
    try:
        return parse_bytes(value, f"pxform.auto({name}): memory_budget")
    except ValueError as exc:
        raise PxformError(str(exc)) from None


def _device_count(mesh: Any) -> int:
    if isinstance(mesh, bool):
        raise PxformError(f"pxform.auto: mesh={mesh!r}; give a device count or a mesh")
    if isinstance(mesh, int):
        if mesh < 1:
            raise PxformError(f"pxform.auto: mesh={mesh}; give a positive device count")
        return mesh
    if isinstance(mesh, (AbstractMesh, Mesh)):
        return mesh.size
    if isinstance(mesh, dict):
        return AbstractMesh(mesh).size
    raise PxformError(f"pxform.auto: mesh={mesh!r}; give a device count, "
                      f"pxform.Mesh.abstract(n), named sizes such as {{'dp': 8}}, or a "
                      f"pxform.Mesh.")


@dataclass(frozen=True)
class Profile:
    """The best plan per device count (TensorOpt's profiling mode); `print` it."""

    function: str
    plans: tuple[tuple[int, Plan | None, str], ...]  # (devices, plan or None, why not)

    def __str__(self) -> str:
        rows = [("devices", "step time", "samples/s", "peak memory", "plan")]
        for n, plan, why in self.plans:
            if plan is None:
                rows.append((str(n), "-", "-", "-", why))
                continue
            rows.append((str(n), f"{plan.step_time_s:.4g} s",
                         f"{plan.global_batch / plan.step_time_s:.4g}",
                         format_bytes(int(plan.peak_memory_bytes)), plan.config_text()))
        lines = [f"profile of {self.function}: best plan per device count"]
        lines += format_table(rows)
        return "\n".join(lines)


def profile(fn: Any, *args: Any, devices: Sequence[int], memory_budget: Any = None,
            hardware: Any = None, batch_argnums: int | tuple[int, ...] | None = None,
            batch_dim: int = 0, optimizer: str = "adam") -> Profile:
    """The fastest plan for each device count in `devices` (None where nothing fits the
    budget), traced once.

    Example:
        >>> print(pxform.profile(loss_fn, params, batch, devices=[8, 16, 32],
        ...                      memory_budget="40GiB", hardware="a100-40gb"))
    """
    from pxform.search import SearchError, search

    step = auto(fn, mesh=max(devices), memory_budget=memory_budget, hardware=hardware,
                batch_argnums=batch_argnums, batch_dim=batch_dim, optimizer=optimizer)
    graph, names, _ = step._graph(args)
    out: list[tuple[int, Plan | None, str]] = []
    for n in devices:
        try:
            assert step.memory_budget is not None
            plan = search(graph, names, devices=n, budget=step.memory_budget,
                          hardware=step.hardware, batch_dim=batch_dim, optimizer=optimizer,
                          fn=f"profile({step.__name__})", function=step.__name__,
                          margin=step.memory_margin, trainable=step._cache["trainable"])
            out.append((n, plan, ""))
        except SearchError as exc:
            first = str(exc).split("\n")[0]
            out.append((n, None, first.split(": ", 1)[-1]))
    return Profile(getattr(fn, "__name__", "fn"), tuple(out))
