"""The pipeline executor: runs any validated action list on this rank (DESIGN.md §7).

Each pipeline rank holds the stage programs `stage % num_ranks == rank` and walks its list
of actions in order:

    F   run the stage's module on microbatch i (graph inputs cut to the microbatch, values
        received from the previous stage as leaves that collect their gradients)
    B   backward from the values sent on (their gradients received from the next stage)
        and, on the last stage, from the loss; without W actions this also accumulates the
        weight gradients; with them it computes only the gradients of the received values
        and of each weight op's outputs (autograd computes only what is asked for)
    W   for each weight op, its weight gradient from the saved output gradients, then on
        into the parameters (zero-bubble: B's chain of input gradients is not recomputed)
    SF/RF/SB/RB  send or receive activations or gradients with `batch_isend_irecv`;
        receives are waited for at once; a send is waited for after the receive that shows
        it arrived (`pxform.schedules.send_releases`: the peer sent that message after
        receiving it), else at the end of the step. A send keeps its tensor until waited
        for: holding every microbatch's boundary values to the end would cost two whole
        batches' worth of them

Parameter gradients accumulate over microbatches (`GradAccumulator`): leaves sum them, and
parameter collectives (DP's all-reduce, ZeRO-3's reduce-scatter) run once at the end.

A frozen prefix (fine-tuning with the embeddings and first layers `requires_grad=False`):
the ranks agree each step on the first stage that trains (`first_trained`); the stages
before it run forward only (their B, W and R do nothing), that stage computes no gradient of
what it receives, and the gradient messages back to them are one-element tokens, so the
schedule and each send's release stay as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import datetime
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake

from pxform.core.errors import PxformError
from pxform.core.ir import TensorType, Value
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.lower.mpmd import MB, PipelineProgram, StageProgram
from pxform.passes.propagate import gradient_layout, layout_of, typed_layout
from pxform.runtime.boundary import (
    is_dtensor,
    local_input,
    mesh_axes,
    regroup_grads,
    to_dtensor,
    wrap_output,
)
from pxform.runtime.buckets import GradAccumulator
from pxform.runtime.collectives import AxisGroups, Microbatches, all_reduce_sum, peer_error
from pxform.runtime.graph_module import (
    draw_seeds,
    local_count,
    module_of,
    regions_off,
    runtime_device,
    synchronize,
    with_groups,
)
from pxform.runtime.mesh import Mesh
from pxform.runtime.prefetch import Prefetch, gather_plan
from pxform.runtime.reshard import Reshard, reshard_after_forward, reshard_when
from pxform.schedules.actions import Action

_RECORD: contextvars.ContextVar[list[tuple[Action, float, float]] | None] = \
    contextvars.ContextVar("pxform_pipeline_record", default=None)


@contextlib.contextmanager
def recording() -> Iterator[list[tuple[Action, float, float]]]:
    """Record `(action, start, end)` wall-clock times of every action this rank runs
    (benchmarks compare them with `pxform.schedules.simulate`; `pxform.tools.runtime_costs`
    prices pipeline actions from them). On a CUDA device the executor waits for the
    device before and after each action while recording (an action returns before its
    kernels ran): the times are the device's, and the recorded step runs without the
    overlap of one action's kernels with the next action's host work.

    Example:
        >>> with recording() as events:
        ...     loss, grads = pxform.value_and_grad(step)(params, batch)
    """
    events: list[tuple[Action, float, float]] = []
    token = _RECORD.set(events)
    try:
        yield events
    finally:
        _RECORD.reset(token)


@dataclass(frozen=True)
class PipelineGroup:
    """This rank's place in the pipeline: its index along the pipeline axis, the number of
    pipeline ranks, and the process group over that axis (None: one rank)."""

    rank: int
    size: int
    group: Any = None
    # seconds a transfer may wait for its peer (the mesh's timeout); None: the group's own
    timeout_s: float | None = None

    def peer(self, pp_rank: int) -> int:
        """The global rank of pipeline rank `pp_rank` (same coordinates on other axes)."""
        return dist.get_global_rank(self.group, pp_rank) if self.group is not None else 0


@dataclass
class _Slot:
    """One (stage, microbatch) in flight."""

    leaves: list[torch.Tensor] = field(default_factory=list)      # received values
    outputs: tuple[Any, ...] = ()
    recv_grads: list[torch.Tensor | None] = field(default_factory=list)
    input_grads: list[torch.Tensor | None] = field(default_factory=list)
    weight_grads: list[torch.Tensor | None] = field(default_factory=list)
    rng: Any = None  # generator states at F, while an early recompute (R) is to come


@dataclass
class PipelineResult:
    outputs: list[Any]
    grads: dict[int, torch.Tensor]


def run(program: PipelineProgram, actions: Sequence[Action | None], place: PipelineGroup,
        axes: AxisGroups, inputs: Sequence[torch.Tensor | None], batch_dims: dict[int, int],
        want_grad: Sequence[bool], bucket_bytes: int, split_weights: set[int],
        reshard: Reshard = True,
        releases: Mapping[Action, Sequence[Action]] | None = None,
        first: int = 0) -> PipelineResult:
    """Run this rank's `actions`.

    Args:
        inputs: this rank's local piece of every graph input (None where no stage of this
            rank reads it); batch inputs are cut into microbatches along `batch_dims`.
        want_grad: per graph input, whether to return its gradient.
        split_weights: stages whose schedule has W actions.
        reshard: free parameters gathered in forward (ZeRO-3) and gather them again for
            backward (`pxform.runtime.reshard`).
        releases: after which receive each send is waited for (`pxform.schedules.
            send_releases`, this rank's); the rest at the end of the step.
        first: the first stage that trains (`first_trained`, the same on every pipeline
            rank): nothing before it requires grad, so those stages' B, W and R do
            nothing, the values `first` receives collect no gradient, and the gradient
            messages back to the stages before it are one element each (sent so that the
            schedule, and each send's release, stay as they are).

    Returns:
        The function's outputs (combined over microbatches, the same on every pipeline
        rank) and the gradients of the inputs this rank's stages read.
    """
    m = program.microbatches
    num_stages = len(program.stages)
    # one seed per call, drawn on every rank (all hold every stage's program) so the
    # generator advances alike everywhere, whether or not this rank's stages draw
    seeds = draw_seeds(program.stages)
    device = runtime_device(inputs)  # every buffer the executor makes lives here
    micro = Microbatches()
    per_mb = [AxisGroups({**axes.groups, MB: micro}, {**axes.index, MB: i},
                         {**axes.sizes, MB: m}) for i in range(m)]
    leaves: dict[int, torch.Tensor] = {}
    for j, t in enumerate(inputs):
        if t is not None:
            want = want_grad[j] and t.dtype.is_floating_point
            leaves[j] = t.detach().requires_grad_(want)
    pieces: dict[int, tuple[torch.Tensor, ...]] = {
        j: leaves[j].chunk(m, dim=d) for j, d in batch_dims.items() if j in leaves}

    def graph_input(j: int, i: int) -> torch.Tensor:
        return pieces[j][i] if j in pieces else leaves[j]

    mine = [st for st in program.stages if st.stage % place.size == place.rank]
    # (stages before `first` have their B actions, which do nothing: module doc)
    trainable = {a.stage for a in actions if a is not None and a.kind == "B"
                 and a.stage >= first}
    for st in mine:
        for pre in st.counts:  # counts over all microbatches, before any backward
            total = torch.zeros((), dtype=torch.float64, device=device)
            for i in range(m):
                with with_groups(per_mb[i], seeds=seeds), torch.no_grad():
                    got = module_of(pre.program)(*[graph_input(j, i)
                                                     for j in pre.graph_inputs])
                total = total + local_count(got[0], got[1] if len(got) > 1 else None,
                                            pre.spec)
            others = tuple(a for a in pre.spec.axes if a != MB)
            micro.counts[pre.key] = all_reduce_sum(total.reshape(1), others, axes).reshape(())

    accumulator = GradAccumulator(axes, bucket_bytes, MB)
    early = {(a.stage, a.microbatch) for a in actions if a is not None and a.kind == "R"}
    slots: dict[tuple[int, int], _Slot] = {}
    finals: list[tuple[Any, ...]] = [() for _ in range(m)]
    pending: dict[Action, list[Any]] = {}  # sends in flight
    releases = releases or {}

    def slot(s: int, i: int) -> _Slot:
        return slots.setdefault((s, i), _Slot())

    # this step's program of each stage of this rank: a zero-bubble stage before `first`
    # returns no weight op's outputs (`without_weight_outputs`). (A stage that trains still
    # returns those of its frozen layers' ops, let go after its forward: dropping them too
    # took 1 MiB off the peak of HF Llama's stages with every matrix frozen, where the
    # search's price of the B's peak then came out 5-6 % over the meter, so far unexplained:
    # the forty-ninth session)
    programs = {st.stage: without_weight_outputs(st) if st.stage < first and st.weight_ops
                else st for st in mine}

    def stage(s: int) -> StageProgram:
        return programs.get(s) or program.stages[s]

    def tag(a: Action, k: int) -> int:
        """The same number on both ends of a transfer: keyed by the sending stage."""
        forward = a.kind in ("SF", "RF")
        sender = a.stage - 1 if a.kind == "RF" else a.stage + 1 if a.kind == "RB" else a.stage
        return ((a.microbatch * num_stages + sender) * 2 + (0 if forward else 1)) * 4096 + k

    def forward(s: int, i: int) -> None:
        st, sl = stage(s), slot(s, i)
        grad = s in trainable and st.grad and torch.is_grad_enabled()
        if len(sl.leaves) != len(st.receives):
            raise RuntimeError(f"pxform pipeline: {s}F{i} ran before its inputs arrived")
        # (the first stage that trains gets values nothing trained made: no gradient)
        sl.leaves = [t.requires_grad_(grad and s > first and t.dtype.is_floating_point)
                     for t in sl.leaves]
        args = [graph_input(j, i) for j in st.graph_inputs] + sl.leaves
        # with an early recompute (R) to come, forward keeps nothing but its inputs
        later = grad and (s, i) in early
        if later:
            sl.rng = _rng_state(args)
        plan = gather_plan(st.program)  # ZeRO-3 gathers: per block, one block ahead
        prefetch = Prefetch(plan, per_mb[i], args) if plan.groups else None
        with with_groups(per_mb[i], accumulator, seeds, prefetch), \
                torch.set_grad_enabled(grad and not later), \
                reshard_after_forward(reshard_when(reshard, grad and not later
                                                   and bool(plan.groups))):
            sl.outputs = tuple(module_of(st)(*args))
        if s in split_weights and s >= first:
            # a W asks nothing of a weight op with no weight to train (a frozen layer's):
            # its outputs and weights are let go now, not held to the B
            sl.outputs = _idle_weight_ops_dropped(st, sl.outputs)
        num_sends = len(st.sends)
        if st.num_outputs:
            finals[i] = tuple(o.detach() if isinstance(o, torch.Tensor) else o
                              for o in sl.outputs[num_sends:num_sends + st.num_outputs])
        if s + 1 < num_stages and (s + 1) % place.size == place.rank:  # same rank: hand over
            slot(s + 1, i).leaves = [o.detach() for o in sl.outputs[:num_sends]]
        if s not in trainable:
            sl.outputs = sl.outputs[:num_sends]

    def backward(s: int, i: int) -> None:
        st, sl = stage(s), slot(s, i)
        if s < first:  # nothing of it requires grad: no gradient to take or hand back
            slots.pop((s, i), None)
            return
        num_sends = len(st.sends)
        tensors, grads = [], []
        if num_sends:
            if len(sl.recv_grads) != num_sends:
                raise RuntimeError(f"pxform pipeline: {s}B{i} ran before its gradients "
                                   f"arrived")
            for t, g in zip(sl.outputs[:num_sends], sl.recv_grads):
                if g is not None and isinstance(t, torch.Tensor) and t.requires_grad:
                    tensors.append(t)
                    grads.append(g)
        if st.num_outputs:
            loss = sl.outputs[num_sends]
            if isinstance(loss, torch.Tensor) and loss.requires_grad:
                tensors.append(loss)
                grads.append(torch.ones_like(loss))
        wanted = [t for t in sl.leaves if t.requires_grad]
        if s in split_weights:
            ys = _weight_op_outputs(st, sl.outputs)
            # only the outputs of ops with a weight to train, and that have a gradient: a
            # frozen layer's, or one before anything trained, give its W nothing (and
            # autograd refuses a tensor that does not require grad), and their gradients
            # would be held to the W for nothing (HF Llama's rotary products, whose
            # cosines come from a buffer: 0.75 MiB a layer and microbatch)
            live = [y for y in ys if y is not None]
            asked = wanted + live
            got = (torch.autograd.grad(tensors, asked, grads, retain_graph=True,
                                       allow_unused=True) if tensors and asked else
                   [None] * len(asked))
            input_grads = list(got[:len(wanted)])
            rest = iter(got[len(wanted):])
            sl.weight_grads = [None if y is None else next(rest) for y in ys]
        else:
            if tensors:
                torch.autograd.backward(tensors, grads)
            input_grads = [t.grad for t in wanted]
        it = iter(input_grads)
        sl.input_grads = [next(it) if t.requires_grad else None for t in sl.leaves]
        if s > 0 and (s - 1) % place.size == place.rank and (s - 1) in trainable:
            slot(s - 1, i).recv_grads = _grads_for(sl)
        sl.leaves = []  # activations received: no longer needed
        sl.recv_grads = []  # (kept, every microbatch's gradients stayed to the step's end)
        if s not in split_weights:
            sl.outputs = ()

    def recompute(s: int, i: int) -> None:
        """Merak's early recompute: run the stage's forward again, with gradients and every
        activation kept, before its backward (in the time the rank would wait for the
        gradient); regions inside it run plainly, so B recomputes nothing."""
        if s < first:  # its F kept what it sends, and it has no backward to run
            return
        st, sl = stage(s), slot(s, i)
        if sl.rng is None:
            raise RuntimeError(f"pxform pipeline: {s}R{i} ran before {s}F{i}")
        args = [graph_input(j, i) for j in st.graph_inputs] + sl.leaves
        with with_groups(per_mb[i], accumulator, seeds), torch.enable_grad(), regions_off(), \
                _restored_rng(sl.rng):
            sl.outputs = tuple(module_of(st)(*args))
        sl.rng = None

    def weights(s: int, i: int) -> None:
        if s < first:
            return
        st, sl = stage(s), slot(s, i)
        dys = iter(sl.weight_grads)
        offset = len(st.sends) + st.num_outputs
        # Each weight op's gradient is asked of autograd apart (one call over all of them
        # would also run each op's activation side on to the weights before it), but they
        # reach the parameters in one call per bucket's worth of bytes: one call per op
        # cost GPT small's zero-bubble pipeline 86 ms a step against 77.6 ms batched and
        # 76.5 ms for 1F1B (2 gloo ranks, 8 microbatches, 2026-11-30), the parameters'
        # gradient hooks and autograd's own start-up paid 14 times per W.
        ready: list[tuple[torch.Tensor, torch.Tensor]] = []
        held = 0

        def accumulate() -> None:
            if ready:
                torch.autograd.backward([w for w, _ in ready], [g for _, g in ready],
                                        retain_graph=True)
                ready.clear()

        with with_groups(per_mb[i], accumulator, seeds):
            for num_out, num_w in st.weight_ops:
                ys = sl.outputs[offset:offset + num_out]
                ws = sl.outputs[offset + num_out:offset + num_out + num_w]
                offset += num_out + num_w
                pairs = [(y, g) for y, g in zip(ys, [next(dys) for _ in ys]) if g is not None]
                need = [w for w in ws if isinstance(w, torch.Tensor) and w.requires_grad]
                if not pairs or not need:
                    continue
                gws = torch.autograd.grad([y for y, _ in pairs], need, [g for _, g in pairs],
                                          retain_graph=True, allow_unused=True)
                for w, g in zip(need, gws):
                    if g is not None:
                        ready.append((w, g))
                        held += g.numel() * g.element_size()
                if held >= bucket_bytes:  # what waits is bounded as a bucket is
                    accumulate()
                    held = 0
            accumulate()
        sl.outputs = ()
        sl.weight_grads = []

    def receiving(a: Action) -> tuple[list[tuple[tuple[int, ...], torch.dtype]], int]:
        """What receive `a` (RF or RB) gets, and from which pipeline rank."""
        st = stage(a.stage)
        if a.kind == "RF":
            return ([(st.local_shape(v), v.type.dtype) for v in st.receives],
                    (a.stage - 1) % place.size)
        shapes = [(st.local_shape(v), v.type.dtype) for v in st.sends
                  if v.type.dtype.is_floating_point]
        if a.stage < first and shapes:  # (`SB`: the stage after sends one element)
            shapes = [NO_GRADIENT]
        return shapes, (a.stage + 1) % place.size

    # receives posted ahead of their actions (`_posted_ahead`): the next RF and the next
    # RB of this rank's list each wait posted while the actions before them run
    ahead = _posted_ahead(place)
    upcoming = {kind: [a for a in actions if a is not None and a.kind == kind]
                for kind in ("RF", "RB")} if ahead else {}
    posted: dict[Action, tuple[list[torch.Tensor], list[Any]]] = {}

    def post_ahead() -> None:
        for kind, queue in upcoming.items():
            if queue and not any(p.kind == kind for p in posted):
                a = queue.pop(0)
                shapes, frm = receiving(a)
                posted[a] = _post_recv(shapes, place, frm, a, tag, device)

    def received(a: Action) -> list[torch.Tensor]:
        shapes, frm = receiving(a)
        bufs, works = posted.pop(a) if a in posted else \
            _post_recv(shapes, place, frm, a, tag, device)
        for work in works:
            _wait(work, place, f"receiving for {a} from pipeline rank {frm}")
        return bufs

    if ahead:
        post_ahead()  # the first of each kind
    record = _RECORD.get()
    for a in actions:
        if a is None:
            continue
        if record is not None:
            synchronize(device)  # (CUDA: the action's own time, not its launch)
        started = time.time() if record is not None else 0.0
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            forward(s, i)
        elif a.kind == "B":
            backward(s, i)
        elif a.kind == "W":
            weights(s, i)
        elif a.kind == "R":
            recompute(s, i)
        elif a.kind == "SF":
            outs = slot(s, i).outputs[:len(stage(s).sends)]
            pending[a] = _send([o.detach() for o in outs], place, (s + 1) % place.size, a,
                               tag)
        elif a.kind == "RF":
            slot(s, i).leaves = received(a)
        elif a.kind == "SB":
            st = stage(s)
            if s <= first:
                # the stage before trains nothing: a token, not zeros of every value
                grads = [torch.zeros(NO_GRADIENT[0], dtype=NO_GRADIENT[1], device=device)
                         ] if any(v.type.dtype.is_floating_point for v in st.receives) else []
            else:
                sl = slot(s, i)
                grads = [g if g is not None else
                         torch.zeros(st.local_shape(v), dtype=v.type.dtype, device=device)
                         for v, g in zip(st.receives, sl.input_grads)
                         if v.type.dtype.is_floating_point]
                sl.input_grads = []  # the slot itself may still wait for its W
            pending[a] = _send(grads, place, (s - 1) % place.size, a, tag)
        elif a.kind == "RB":
            got = iter(received(a))
            if s >= first:  # (before it: the token `SB` sends)
                slot(s, i).recv_grads = [next(got) if v.type.dtype.is_floating_point
                                         else None for v in stage(s).sends]
        else:
            raise RuntimeError(f"pxform pipeline: unknown action {a}")
        for done in releases.get(a, ()):  # arrived: waiting frees their tensors now
            _wait_sent(pending.pop(done, []), place, done)
        if ahead:
            post_ahead()
        if record is not None:
            synchronize(device)
            record.append((a, started, time.time()))
    for sent, works in pending.items():  # sends still in flight
        for work in works:
            _wait(work, place, f"sending {sent}")
    reduced = accumulator.finish()
    out_grads: dict[int, torch.Tensor] = {}
    for j, leaf in leaves.items():
        g = leaf.grad
        if j in reduced:
            g = reduced[j] if g is None else g + reduced[j]
        if want_grad[j] and leaf.dtype.is_floating_point:
            out_grads[j] = torch.zeros_like(leaf) if g is None else g
    outputs = _combine(program, finals, place, device) if any(finals) or place.size > 1 else []
    return PipelineResult(outputs, out_grads)


# what a stage sends back in place of the gradients of values that none has (`run`'s
# `first`): one element, so that the message, and what the schedule times by it, stays
NO_GRADIENT: tuple[tuple[int, ...], torch.dtype] = ((1,), torch.float32)


def first_trained(program: PipelineProgram, inputs: Sequence[torch.Tensor | None],
                  want_grad: Sequence[bool], place: PipelineGroup,
                  device: torch.device) -> int:
    """The first stage that computes with a graph input whose gradient is wanted (`run`'s
    `first`; the number of stages when none does), agreed by every pipeline rank: each
    knows the marks of the inputs its own stages read, and one all-reduce (the minimum
    over the ranks) gives the rest. Before that stage nothing requires grad (a frozen
    prefix: an embedding and the first layers under `requires_grad=False`), so no
    gradient need flow back to it.

    Example:
        >>> first_trained(program, inputs, want_grad, place, device)   # a frozen stage 0
        1
    """
    num_stages = len(program.stages)

    def trained(j: int) -> bool:
        t = inputs[j]
        return want_grad[j] and t is not None and t.dtype.is_floating_point

    mine = min((st.stage for st in program.stages
                if st.stage % place.size == place.rank and st.grad
                and any(trained(j) for j in st.graph_inputs)), default=num_stages)
    if place.group is None or place.size < 2:
        return mine
    agreed = torch.tensor([mine], dtype=torch.int64, device=device)
    if is_fake(agreed):  # (under FakeTensorMode, to check placement: no values to agree)
        return mine
    try:
        work = dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=place.group,
                               async_op=True)
    except RuntimeError as exc:
        raise peer_error(exc, f"agreeing on the first stage that trains, pipeline rank "
                              f"{place.rank} of {place.size},") from exc
    _wait(work, place, "agreeing on the first stage that trains")
    return int(agreed.item())


def _rng_state(tensors: Sequence[Any]) -> tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]:
    """The CPU generator's state, and each CUDA device's the tensors live on: what the
    early recompute restores so that dropout draws the same numbers again."""
    devices = sorted({t.device.index or 0 for t in tensors
                      if isinstance(t, torch.Tensor) and t.device.type == "cuda"})
    return torch.get_rng_state(), [(d, torch.cuda.get_rng_state(d)) for d in devices]


@contextlib.contextmanager
def _restored_rng(state: tuple[torch.Tensor, list[tuple[int, torch.Tensor]]]
                  ) -> Iterator[None]:
    cpu, cuda = state
    with torch.random.fork_rng(devices=[d for d, _ in cuda]):
        torch.set_rng_state(cpu)
        for d, st in cuda:
            torch.cuda.set_rng_state(st, d)
        yield


def _weight_op_outputs(st: StageProgram, outputs: tuple[Any, ...]
                       ) -> list[torch.Tensor | None]:
    """Per output of each weight op (`StageProgram.weight_ops`) in order: the output, or
    None where its W has nothing to ask of it (no weight of the op requires grad, or the
    output does not)."""
    offset = len(st.sends) + st.num_outputs
    ys: list[torch.Tensor | None] = []
    for num_out, num_w in st.weight_ops:
        ws = outputs[offset + num_out:offset + num_out + num_w]
        trains = any(isinstance(w, torch.Tensor) and w.requires_grad for w in ws)
        ys += [y if trains and isinstance(y, torch.Tensor) and y.requires_grad else None
               for y in outputs[offset:offset + num_out]]
        offset += num_out + num_w
    return ys


def without_weight_outputs(st: StageProgram) -> StageProgram:
    """`st` whose program returns what it sends and the function's outputs alone, not its
    weight ops' outputs and weights (`StageProgram.weight_ops`, for zero-bubble's W): the
    forward of a stage that trains nothing (before `run`'s `first`). Returned as program
    outputs they were all alive together as its forward ended: HF Llama's frozen first
    stage of 4 blocks metered 52 % over its prediction under zero-bubble (the forty-ninth
    session). Made once per stage program.

    Example:
        >>> without_weight_outputs(st).weight_ops
        ()
    """
    made = st.__dict__.get("_without_weight_outputs")
    if made is None:
        kept = st.program.outputs[:len(st.sends) + st.num_outputs]
        made = dataclasses.replace(st, program=dataclasses.replace(st.program, outputs=kept),
                                   weight_ops=())
        st.__dict__["_without_weight_outputs"] = made  # frozen dataclass: as `module_of`
    return made


def _idle_weight_ops_dropped(st: StageProgram, outputs: tuple[Any, ...]) -> tuple[Any, ...]:
    """`outputs` with the outputs and weights of each weight op that gives its W nothing
    to do (all its outputs None in `_weight_op_outputs`) replaced by None."""
    ys = _weight_op_outputs(st, outputs)
    out = list(outputs)
    offset = len(st.sends) + st.num_outputs
    at = 0
    for num_out, num_w in st.weight_ops:
        if all(y is None for y in ys[at:at + num_out]):
            out[offset:offset + num_out + num_w] = [None] * (num_out + num_w)
        at += num_out
        offset += num_out + num_w
    return tuple(out)


def _grads_for(sl: _Slot) -> list[torch.Tensor | None]:
    """The gradients a stage hands back to the previous one on the same rank."""
    return [g if g is not None or not t.dtype.is_floating_point else torch.zeros_like(t)
            for t, g in zip(sl.leaves, sl.input_grads)]


def _send(tensors: list[torch.Tensor], place: PipelineGroup, to: int, a: Action,
          tag: Any) -> list[Any]:
    if not tensors:
        return []
    peer = place.peer(to)
    ops = [dist.P2POp(dist.isend, t.contiguous(), peer, place.group, tag(a, k))
           for k, t in enumerate(tensors)]
    return list(dist.batch_isend_irecv(ops))


def _post_recv(shapes: list[tuple[tuple[int, ...], torch.dtype]], place: PipelineGroup,
               frm: int, a: Action, tag: Any, device: torch.device
               ) -> tuple[list[torch.Tensor], list[Any]]:
    """Post the receives of `a` (not waited for): the buffers and their works."""
    if not shapes:
        return [], []
    peer = place.peer(frm)
    # on the stage's device: under NCCL a CPU buffer cannot receive
    bufs = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype in shapes]
    ops = [dist.P2POp(dist.irecv, b, peer, place.group, tag(a, k)) for k, b in enumerate(bufs)]
    return bufs, list(dist.batch_isend_irecv(ops))


def _posted_ahead(place: PipelineGroup) -> bool:
    """Whether this rank posts its next receives ahead of their actions: on gloo.

    A gloo receive is a rendezvous: the data moves only once the receiver has posted its
    buffer and the sender's communication thread has answered. Posted when its action
    comes, a receive of data the peer sent long before still waited for that thread,
    which on a busy machine is asleep behind the peer's compute: on this project's
    2-vCPU machine a GPipe step's receives of gradients sent 3-10 ms earlier took 3.1-6.9
    ms each (2026-11-27, `pxform.runtime.pipeline.recording`), and GPipe's measured step
    was 13-17 % over the simulated one in four runs of `benchmarks/pipeline.py`. Posted
    one action ahead, the data lands while the rank computes. Gloo matches a receive to
    its send by tag, so posting out of turn is safe there; NCCL matches transfers
    between two ranks in the order they were issued (no tags), and a receive posted early
    would hold up this rank's sends behind it, so NCCL posts at the action as before."""
    if place.group is None or place.size < 2:
        return False
    return dist.get_backend(place.group) == "gloo"


def _wait_sent(works: list[Any], place: PipelineGroup, done: Action) -> None:
    """Wait for the sends of `done`, which have arrived. In a function of its own: a
    send's work holds its tensor, and a loop variable in `run` kept the last one alive
    until the next release (HF ConvNeXt's last stage held a second input gradient of 784
    KiB, 7 % of its peak, through each backward)."""
    for work in works:
        _wait(work, place, f"sending {done}")


def _wait(work: Any, place: PipelineGroup, what: str) -> None:
    """Wait for a transfer, at most the mesh's timeout: a peer that failed (or runs
    another schedule) ends this rank with a `CollectiveError` naming it, instead of a wait
    without end (gloo's send and receive waits have no timeout of their own)."""
    try:
        if place.timeout_s is None:
            work.wait()
        elif not work.wait(datetime.timedelta(seconds=place.timeout_s)):
            raise RuntimeError(f"no completion within {place.timeout_s:g} s")
    except RuntimeError as exc:
        if isinstance(exc, PxformError):
            raise
        raise peer_error(exc, f"{what}, pipeline rank {place.rank} of {place.size},") \
            from exc


def _combine(program: PipelineProgram, finals: list[tuple[Any, ...]],
             place: PipelineGroup, device: torch.device) -> list[Any]:
    """The outputs over all microbatches, broadcast from the last stage's rank."""
    last = program.stages[-1]
    owner = last.stage % place.size
    out: list[Any] = []
    num_sends = len(last.sends)
    values = last.program.outputs[num_sends:num_sends + last.num_outputs]
    for k, (mode, value) in enumerate(zip(program.output_modes, values)):
        if not isinstance(value, Value):
            out.append(value)
            continue
        if place.rank == owner:
            parts = [f[k] for f in finals]
            if mode == "sum":
                result = torch.stack(parts).sum(0)
            elif mode == "first":
                result = parts[0]
            else:
                result = torch.cat(parts, dim=mode[1])
        else:
            shape = list(last.local_shape(value))
            if isinstance(mode, tuple):
                shape[mode[1]] *= program.microbatches
            result = torch.empty(shape, dtype=value.type.dtype, device=device)
        if place.size > 1:
            result = result.contiguous()
            dist.broadcast(result, src=place.peer(owner), group=place.group)
        out.append(result)
    return out


def share_grads(program: PipelineProgram, place: PipelineGroup, grads: dict[int, Any],
                want: list[bool], layouts: list[Layout], sub: AbstractMesh | None,
                leaves: list[Any]) -> dict[int, Any]:
    """Sum, over the pipeline ranks that read it, the gradient of every input read on
    several of them (a tied weight); a rank that reads it keeps the sum. Every pipeline
    rank takes part in every such sum, in the same order (inputs by index), zeros where it
    has no gradient of its own."""
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
            g = torch.zeros(shape, dtype=leaves[j].dtype, device=leaves[j].device)
        g = g.contiguous()
        dist.all_reduce(g, group=place.group)
        if place.rank in owners[j]:
            grads[j] = g
    return grads


def reads(program: PipelineProgram, place: PipelineGroup) -> set[int]:
    """The graph inputs this pipeline rank's stages read: the argument leaves it slices,
    computes with and gets gradients for (a tied weight on every rank that reads it)."""
    return {j for st in program.stages if st.stage % place.size == place.rank
            for j in st.graph_inputs}


def run_pipeline(program: PipelineProgram, out_tree: Any, actions: Sequence[Action | None],
                 weight_stages: set[int], args: tuple[Any, ...], grad_argnums: tuple[int, ...],
                 arg_of: Sequence[int], leaves: Sequence[Any], layouts: Sequence[Layout],
                 batch_dims: dict[int, int], place: PipelineGroup, axes: AxisGroups,
                 mesh: Mesh | None, sub: AbstractMesh | None, bucket_mb: float,
                 reshard: Reshard = True, trainable: Sequence[bool] | None = None,
                 releases: Mapping[Action, Sequence[Action]] | None = None
                 ) -> tuple[Any, Any]:
    """Run this pipeline rank's `actions` on its pieces of `args`, as `pxform.pipeline`
    does (`pxform.value_and_grad` semantics): the value, and with `grad_argnums` the
    gradients laid out like the arguments. `leaves` are the arguments' tensor leaves
    (`arg_of`: which argument each is) and `layouts` theirs on the whole `mesh` (None: a
    pipeline alone, one device per stage); only the leaves this rank's stages read are
    sliced. Gradients of leaves read on several ranks (tied weights) are summed over the
    pipeline (`share_grads`); DTensor arguments and sharded layouts get DTensor gradients.
    `trainable` (per leaf) leaves out those it marks False (module buffers, frozen
    parameters), as `run_spmd`. `releases`: when to wait for each send (`run`).
    """
    held = reads(program, place)
    full_axes = mesh_axes(mesh) if mesh is not None else AxisGroups({}, {}, {})
    local = [(local_input(leaf, layout, full_axes, mesh.abstract) if mesh is not None
              else leaf) if j in held else None
             for j, (leaf, layout) in enumerate(zip(leaves, layouts))]
    want = [n in grad_argnums and (trainable is None or trainable[j])
            for j, n in enumerate(arg_of)]
    # (a call without gradients runs forward sweeps alone, on every rank alike)
    first = first_trained(program, local, want, place, runtime_device(local)) \
        if grad_argnums else len(program.stages)
    with torch.set_grad_enabled(bool(grad_argnums) or torch.is_grad_enabled()):
        result = run(program, actions, place, axes, local, batch_dims, want,
                     int(bucket_mb * 2**20), weight_stages, reshard, releases, first)
    grads = share_grads(program, place, result.grads, want, list(layouts), sub, list(leaves))
    values = [wrap_output(o, _without_mb(v), mesh) if mesh is not None else o
              for o, v in zip(result.outputs, program.outputs)]
    value = optree.tree_unflatten(out_tree, values)
    if not grad_argnums:
        return value, None
    flat: list[Any] = []
    for j, layout in enumerate(layouts):
        g = grads.get(j)
        if g is None or not want[j]:
            flat.append(None)
            continue
        grad_layout = gradient_layout(layout)
        # DTensor arguments get DTensor gradients with their placements (as run_spmd)
        if mesh is not None and (grad_layout.used_axes() or is_dtensor(leaves[j])):
            g = to_dtensor(g, grad_layout, mesh, leaves[j])
        flat.append(g)
    return value, regroup_grads(args, grad_argnums, flat)


def _without_mb(v: Any) -> Any:
    """The output value's type without the microbatch axis (combined by the runtime)."""
    if not isinstance(v, Value):
        return v
    layout = layout_of(v.type)
    dims = tuple(tuple(a for a in axes if a != MB) for axes in layout.dims)
    t = typed_layout(TensorType(v.type.shape, v.type.dtype), Layout(dims, layout.partial - {MB}))
    return Value(v.name, t)
