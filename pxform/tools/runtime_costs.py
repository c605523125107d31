"""The runtime's own fixed costs, measured by running tiny pxform programs.

`pxform.runtime.calibrate` measures the hardware: op curves, collectives, overlap. What a
training step costs beyond its ops and collectives is pxform's own host work, and the
cost model needs it too (`docs/search.md`, "Fixed costs"): on CPUs it is several
milliseconds of a step of tens. `runtime_costs(hw)` measures these numbers on the current
world and returns the profile with them set (`runtime_costs` lists them below):

* `collective_overhead_s`, per collective the program runs: the conversion's autograd
  function, the functional collective's wrapping and waiting, copies into and out of
  its buffers, and waiting for the peers and waking up once they arrive. A
  tensor-parallel chain of tiny matmuls on 64 KiB activations at 2 and at 26 layers
  (timed 3 x `repeats` times: a collective costs about a millisecond here): the
  difference, less the comm tables' times of the extra collectives (their transfer), over
  their number (`program.collectives()` and `backward_collectives()` count them). 64 KiB:
  what a step pays per collective beyond the transfer grows with the message before it
  levels off (measured here: 0.75 ms at 64 B, 1.1-1.2 ms at 64 KiB, 1.3 ms at 1 MiB).
* `param_overhead_s`, per parameter tensor per step: its local piece, its gradient hook
  and bucket slot, its gradient laid out and regrouped. A data-parallel step over K tiny
  parameters read by one `stack` (so the ops do not grow with K), at K = 4 and K = 64: the
  difference over 60. The parameters are laid out by `distribute` (DTensors), as `init`
  and `distribute` give them to `auto`'s users: unwrapping each and wrapping its gradient
  was most of this cost (until 2026-11-27 plain tensors, and data-parallel plans came out
  5-15 % under; since the fifty-fifth session, 2026-12-05, the runtime takes a DTensor's
  local tensor as it is and builds each gradient's DTensor on its parameter's spec,
  `pxform.runtime.boundary`: GPT small's data-parallel step 4-5 % faster).
* `step_overhead_s`, per step: the K = 4 step less its 4 parameters, less what the cost
  model prices its ops and its all-reduce at.
* one more point of `sync_wait` (which `calibrate` measures up to 8 ms of compute on
  chains of matmuls), where a data-parallel step's last gradient bucket meets its peers
  after the whole backward: the reference transformer (below) data parallel at
  `_GRADIENT_WAIT_ROWS` times its largest size per rank, paired with one rank's share on
  one device per rank; the sharded step, scaled by the one device's price over its
  measured time, less the model's price, is added to the curve's wait at that step's
  backward (`_gradient_wait`; since the fifty-fifth session, 2026-12-05).
* `action_overhead_s` and `op_action_overhead_s`, per pipeline action (one stage's
  forward or backward of one microbatch: the executor, autograd building and walking the
  stage's graph anew each time) and per op of the stage per action, `send_overhead_s`
  and `receive_overhead_s`, per transfer an action makes, and `receive_stall_s`, what
  each transfer stalls the receiving rank while it moves: the reference transformer at 2
  and at 4 layers cut into 2 stages, its 1F1B pipeline at 2 and at 16 microbatches of
  the same batch, the longer one's actions recorded as they run, and the same at 16
  microbatches under zero-bubble and interleaved (2 chunks a rank), recorded
  (`_action_costs`). The interleaved pipeline runs the same ops in twice the actions:
  what its forwards and backwards take more than 1F1B's, beyond the model's difference,
  gives the per-action cost (`_extra_action`); the rest of what the 1F1B forwards and
  backwards take beyond the model, over their ops, the per-op cost. The recorded sends
  (their mean) and receives (their lower quartile: where the data had come) give the
  next two. The stall, and `transfer_overhead_s` (a delay charged only where an action
  waits for its input), split 1 : 3 (`_STALL_SHARE`), are what make the model price the
  16-microbatch 1F1B and interleaved pipelines' whole calls at their measured shares of
  the same model's data-parallel step, the three timed in turn (`fit_to_call`, averaged;
  until the twenty-seventh session the stall was what the schedule simulator, fed each
  stage's actions as recorded, had to charge every receiving action for its span to be
  the recorded one, `fit_receive_stall` (removed since), averaged over the 1F1B and
  zero-bubble pipelines, and the delay was 0). Until 2026-11-29 the per-action cost was the
  intercept of a line through the per-action residues at the two depths (it came out 0
  or near it, and interleaved plans 8-12 % under), and the transfers' cost was that
  delay alone, fitted to the 1F1B pipelines' step difference: zero-bubble, interleaved
  and shifted plans, whose schedules have slack to hide a delay in, came out 4-7 points
  under 1F1B's, where the recorded receives still stalled. Until late 2026-11-28 the
  transfers were in the forwards and backwards: one per action, as a 2-stage pipeline
  makes, and interleaved plans (one and a half per action) came out 8-13 % under. Until
  2026-11-28 the first two were fitted to the step difference alone and took the ranks'
  waits for each other into every forward and backward: schedules that wait less (the
  shifted one, zero-bubble) came out 5-13 points further over than 1F1B. Until
  2026-11-27 they came from a pipeline of two tiny matmuls at 2 and at 8 microbatches:
  it measured the transfers' round trips, which stages with compute to do hide since the
  executor posts its receives ahead (`pxform.runtime.pipeline._posted_ahead`), and
  8-microbatch GPT pipelines came out 5-21 % over.
* `param_action_overhead_s`, per parameter tensor of a stage per pipeline action (its
  conversion's autograd function, its gradient accumulated over microbatches): a 2-stage
  1F1B pipeline of two tiny matmuls at 2 and at 8 microbatches, with 64 parameters per
  stage and with 1: the difference of the two differences over 2 x 6 x 63. (With 16
  parameters until the twenty-fifth session, 2026-11-29: over 25 calibrations of that
  day it came out 0-38 us, and the calibrations' 8-microbatch GPT pipelines moved with
  it by a third of a point per microsecond; six blocks in one process gave 3-21 us at
  16, 15-19 at 64.)
* `weight_op_overhead_s` and `split_backward_share`, per weight op of a zero-bubble W
  action (the executor asks autograd for each weight op's gradient on its own, then
  hands it on) and per second of the backward zero-bubble splits into B and W (the two
  passes run slower than the fused one: each weight gradient is made from operands the
  input gradients' pass left cold): the same reference pipelines under zero-bubble and
  1F1B, at 16 microbatches and at 2, their B and W actions recorded: what B + W took
  beyond 1F1B's fused B, fitted over the stages' weight ops and backward seconds
  (`_action_costs`, `_fit_split_costs`). Until 2026-11-28 a 2-stage ZB-H1 pipeline of
  chained tiny 8 x 8 matmuls, 1 and 16 per stage: 14-95 us per op, while GPT small's W
  actions ran 4.5-5.1 ms against 2.2-2.5 priced (its weight ops' gradients over 2
  sequences each, not 2 rows).
* `recompute_overhead_s`, per recompute region per microbatch (torch's non-reentrant
  checkpoint: its frame, the saved tensors' hooks, the RNG state, stopping the recompute;
  the region's re-entry into pxform's process groups): tiny residual layers, data
  parallel, every block recomputed against none; the measured difference less the
  predicted one (the ops recomputed), over the regions (`_recompute_region`).

* `relayout_wait_share`, what a run of a conversion's collectives after compute costs per
  second of that compute (what tensor and sequence parallelism pay in a step beyond the
  transfers, the per-collective cost and the sync wait): the reference transformer
  (below) at 16 sequences of 64 tokens per pair of ranks, every block tensor parallel
  over pairs (and data parallel across them), and the same with sequence parallelism
  between blocks, each paired with a pair's sequences on one device per rank; each
  sharded step, scaled by the one device's price over its measured time (the machine's
  speed as the op times were fitted), less the model's price, fitted as the share times
  the compute before the runs (`_relayout_costs`, `fit_wait_share`; 0 on an odd world),
  of which the profile keeps `WAIT_SHARE_CARRIED` (`carried_wait_share`: the reference's
  residue priced a GPT's tensor-parallel plans over).
  `relayout_overhead_s`, a cost per run, is left at 0 (until 2026-11-29 it was this
  measurement).
* `all_to_all_share`, an all-to-all's per-collective cost as a share of
  `collective_overhead_s`: its latency over an all-reduce's in the comm tables
  (`all_to_all_share`; fitted with the share above until the twenty-fourth session,
  2026-11-29).

* `op_time_scale` and `op_step_overhead_s`, a factor on every op's time and a time per
  op: a reference training step (a 2-layer transformer language model: embedding, layer
  norms, attention, a GELU MLP, the cross-entropy; `_reference`) run under
  `pxform.value_and_grad` on every rank at once at 1, 2, 4 and 8 sequences of 64 tokens
  and at 1 of 4 tokens (`_SIZES`), its median times fitted (least squares) as the factor
  times what the cost model gives its ops on one device, plus the time per op (the same
  ops at every size). The step is timed in three blocks seconds apart and the medians
  taken over all of them (`_ReferenceSteps`): a slow spell of the machine over the one
  block timed before carried whole calibrations. The op curves are timed on ops alone,
  in chains; in a step the same ops run slower (their inputs come cold from memory, the
  allocator churns, autograd's engine walks a bigger graph, and copies, fills and sums
  run that no traced op stands for). This is measured first (the per-collective cost
  between its blocks), and the fixed costs below are taken against the model with it. On a device
  whose kernels run asynchronously to the host (`Hardware.host_overlaps`: CUDA) the fit
  is `t = max(scale f, ops per_op / 3) + max(scale b, 2 ops per_op / 3)` per pass
  instead (`_fit_overlapped`), as the search prices such a device.

* `autograd_op_overhead_s` and `autograd_share`, what recording autograd's graph costs a
  forward per op and as a share of its time (a forward without it: the shifted
  schedule's first forward of a stage that recomputes early, 20-25 % faster than the same
  stage's forward with it in GPT pipelines here): the reference transformer's forward at
  each size of `_SIZES`, with gradients and without, timed in turn within each repeat,
  the median differences fitted against the model's forward (`_AutogradForwards`).

The programs run where training runs: on this rank's GPU under NCCL (the device
`calibrate` measured; their random values are drawn on the CPU and moved), else on the
CPU. On a GPU the reference step is wider (`_REFERENCE_CUDA`, up to 16 sequences of 512
tokens): the CPU's is all kernel launches there. Before, the programs ran on the CPU
whatever the device, and an H100's `op_time_scale` came out 2.3 (CPU steps against the
GPU's op curves): every GPU prediction 2.3x too slow (`benchmarks/accuracy_gpu.py`).

Each difference is the median of `repeats` paired differences, the short and the long
program timed alternately, each call after a barrier (a drift in the machine's load falls
on both sides); every rank times, rank 0's numbers are kept (every rank gets them).
With one rank only the per-step and per-parameter costs are measured (the data-parallel
step has no collective then); pipelines need 2 ranks (an even world: `pp=2` by
`dp=world/2`). These are differences of short timings: on a loaded machine they are
noisy, and clamped at 0 (a stream of tiny collectives can also run faster than the comm
table's barrier-timed ones that the per-collective figure is corrected by).

Example (every rank):
    >>> hw = pxform.runtime.calibrate.calibrate()
    >>> hw = runtime_costs(hw)
    >>> hw.param_overhead_s, hw.step_overhead_s, hw.action_overhead_s, hw.transfer_overhead_s
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import optree
import torch
import torch.nn.functional as F

from pxform.core.mesh import abstract_mesh
from pxform.core.spec import P
from pxform.cost.hardware import Hardware, check_one_machine
from pxform.cost.model import BACKWARD_RATIO, CostModel
from pxform.frontend.boundary import stage_boundary
from pxform.runtime import world
from pxform.runtime.calibrate import sent_bytes
from pxform.runtime.graph_module import default_device, synchronize
from pxform.runtime.mesh import Mesh
from pxform.runtime.pipeline import recording
from pxform.search.context import Pin
from pxform.search.pipelines import ScheduleChoice
from pxform.search.solve import SearchError
from pxform.search.space import Option
from pxform.transforms.auto import auto
from pxform.transforms.grad import value_and_grad
from pxform.transforms.pipeline import pipeline
from pxform.transforms.shard import shard

__all__ = ["reference_price", "reference_program", "representative_profile", "runtime_costs",
           "timed_call"]

_WIDTH = 8  # elements per tiny parameter
_COLLECTIVE_ROWS = 2048  # rows of the tensor-parallel chain's activations (64 KiB)


def runtime_costs(hw: Hardware, repeats: int = 9) -> Hardware:
    """`hw` with the runtime's fixed costs (`param_overhead_s`, `step_overhead_s`,
    `action_overhead_s`, ...) measured on the current world (module doc). Call it on every
    rank, like a collective.

    Example:
        >>> hw = runtime_costs(calibrate())
    """
    n = world.size() if world.initialized() else 1
    gen = torch.Generator().manual_seed(0)
    # the programs run where training will: this rank's GPU under NCCL (the device
    # `calibrate` measured), else the CPU; the random values are drawn on the CPU
    device = default_device()
    # the reference step thrice `repeats` times (under a second here: every prediction's
    # compute scales with this figure, and at 9 a slow spell of the machine carried
    # whole calibrations, op time scales 1.71, 1.02, 1.31, 1.13, 0.94 in one run), in
    # three blocks seconds apart (`_ReferenceSteps`), the forwards with and without
    # autograd and the per-collective cost (which the scale does not enter) between them
    steps = _ReferenceSteps(hw, gen)
    forwards = _AutogradForwards(gen)
    steps.time(repeats)
    forwards.time(repeats)
    # (every figure is rank 0's from here on, `_agreed`: the programs below are planned
    # with them)
    per_collective = _agreed(_per_collective(hw, gen, repeats)) if n >= 2 else 0.0
    steps.time(repeats)
    forwards.time(repeats)
    steps.time(repeats)
    forwards.time(repeats)
    fit = steps.fit()
    scale, per_op = world.gather_objects(fit)[0] if n > 1 else fit
    # the forward and the backward apart: the reference forward (autograd's graph
    # recorded) timed in `forwards`' blocks against the step (`_fit_passes`)
    passes = steps.split(forwards.forward_medians(), scale, per_op)
    forward_scale, backward_scale = world.gather_objects(passes)[0] if n > 1 else passes
    hw = dataclasses.replace(hw, op_time_scale=scale, op_step_overhead_s=per_op,
                             forward_scale=forward_scale, backward_scale=backward_scale,
                             collective_overhead_s=per_collective)
    # against the forward priced with the scale just fitted
    autograd = forwards.fit(hw)
    per_node, share = world.gather_objects(autograd)[0] if n > 1 else autograd
    hw = dataclasses.replace(hw, autograd_op_overhead_s=per_node, autograd_share=share)

    def dp_step(count: int) -> Callable[[], Any]:
        params = _on([torch.randn(_WIDTH, generator=gen) for _ in range(count)], device)
        batch = _on(torch.randn(2 * n, _WIDTH, generator=gen), device)

        def loss(ps: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            return (x @ torch.stack(ps).T).sum()

        sharded = shard(loss, mesh=Mesh({"dp": n}), in_specs=(None, P("dp")))
        # the parameters as users pass them: laid out by `distribute` (DTensors; a
        # GPT small data-parallel step took 3-4 ms more with them than with plain
        # tensors, 52 parameters, 2026-11-27)
        laid_out, _ = sharded.distribute(params, batch)
        step = value_and_grad(sharded)
        return lambda: step(laid_out, batch)

    few, many = 4, 64
    # thrice the repeats: 60 parameters add a few milliseconds, as noisy here as that
    # (63-151 us per parameter from one calibration to the next at 9)
    t_few, more = _agreed(_paired(dp_step(few), dp_step(many), 3 * repeats))
    per_param = max(0.0, more / (many - few))
    model = CostModel(hw)
    axes = {"dp": (n, hw.level(n))}
    # the K = 4 step's own work as the cost model prices it: stack, matmul, sum, and the
    # all-reduce of its gradients
    ops = (sum(model.op_times(0.0, torch.float32, few * _WIDTH * 8.0, "elementwise"))
           + sum(model.op_times(4.0 * n * few * _WIDTH, torch.float32, 0.0, "matmul"))
           + sum(model.op_times(0.0, torch.float32, 2 * n * few * 4.0, "elementwise")))
    if n > 1:
        ops += model.bucketed_all_reduce(few * _WIDTH * 4.0 * 2 * (n - 1) / n, "dp", axes)
    per_step = max(0.0, t_few - few * per_param - ops)
    hw = dataclasses.replace(hw, sync_wait=_gradient_wait(
        dataclasses.replace(hw, param_overhead_s=per_param, step_overhead_s=per_step,
                            collective_overhead_s=per_collective), gen, repeats))

    per_param_action = 0.0
    if n >= 2 and n % 2 == 0:
        def two_stages(p: dict[str, list[torch.Tensor]], x: torch.Tensor) -> torch.Tensor:
            h = stage_boundary(x @ torch.stack(p["w1"]).sum(0))
            return (h @ torch.stack(p["w2"]).sum(0)).sum()

        def pp_step(microbatches: int, count: int) -> Callable[[], Any]:
            piped = pipeline(two_stages, stages=2, microbatches=microbatches)
            step = value_and_grad(shard(piped, mesh=Mesh({"pp": 2, "dp": n // 2}),
                                        in_specs=(None, P("dp"))))
            params = _on({k: [torch.randn(_WIDTH, _WIDTH, generator=gen)
                              for _ in range(count)] for k in ("w1", "w2")}, device)
            batch = _on(torch.randn(8 * n, _WIDTH, generator=gen), device)
            return lambda: step(params, batch)

        # 6 more microbatches: 6 more forward-backward slots on the critical path, 2
        # actions each; with `many` parameters per stage instead of 1, what each
        # parameter adds to an action (its piece of the stage's gradients accumulated
        # per microbatch, its conversion's autograd function)
        # thrice the repeats: a difference of two differences, each of ~10 ms here; at 9
        # it came out 0-92 us from one calibration to the next (2026-11-27), and the
        # 92 priced GPT small's 8-microbatch pipelines 25-46 % over (26 parameters a
        # stage, 18 actions on the critical path). 64 parameters, not 16: the signal
        # four times larger for 0.6 s more per block of pairs (module doc)
        many = 64
        _, slots = _paired(pp_step(2, 1), pp_step(8, 1), 3 * repeats)
        _, slots_many = _paired(pp_step(2, many), pp_step(8, many), 3 * repeats)
        per_param_action = _agreed(max(0.0, (slots_many - slots) / (2 * 6 * (many - 1))))

    per_action = per_op_action = per_stall = per_delay = per_send = per_receive = 0.0
    per_weight_op: tuple[float, float] = (0.0, 0.0)  # (per weight op, the split's share)
    if n >= 2 and n % 2 == 0:
        (per_action, per_op_action, per_stall, per_delay, per_weight_op, per_send,
         per_receive) = _action_costs(
            dataclasses.replace(
                hw, param_overhead_s=per_param, step_overhead_s=per_step,
                collective_overhead_s=per_collective,
                param_action_overhead_s=per_param_action),
            gen, repeats)

    per_region = _recompute_region(dataclasses.replace(
        hw, param_overhead_s=per_param, step_overhead_s=per_step,
        collective_overhead_s=per_collective), gen, repeats)

    # an all-to-all's share of the per-collective cost: the comm tables' ratio, not a
    # timing (`all_to_all_share`); the share per second of compute is fitted with it
    a2a_share = all_to_all_share(hw, n)
    wait_share = wait_gap = 0.0
    if n >= 2:
        wait_share, wait_gap = _relayout_costs(dataclasses.replace(
            hw, param_overhead_s=per_param, step_overhead_s=per_step,
            collective_overhead_s=per_collective, all_to_all_share=a2a_share), gen, repeats)

    mine = (per_param, per_step, per_action, per_collective, per_param_action, per_weight_op,
            per_op_action, per_region, wait_share, per_stall, per_send, per_receive,
            a2a_share, per_delay, wait_gap)
    kept = world.gather_objects(mine)[0] if n > 1 else mine
    return dataclasses.replace(hw, param_overhead_s=kept[0], step_overhead_s=kept[1],
                               action_overhead_s=kept[2], collective_overhead_s=kept[3],
                               param_action_overhead_s=kept[4],
                               weight_op_overhead_s=kept[5][0],
                               split_backward_share=kept[5][1],
                               op_action_overhead_s=kept[6], recompute_overhead_s=kept[7],
                               relayout_overhead_s=0.0, relayout_wait_share=kept[8],
                               relayout_gap_s=kept[14],
                               all_to_all_share=kept[12], receive_stall_s=kept[9],
                               send_overhead_s=kept[10], receive_overhead_s=kept[11],
                               transfer_overhead_s=kept[13])


def _agreed(value: Any) -> Any:
    """Rank 0's `value` on every rank (itself without a process group). Each rank times
    the programs itself, but what is planned from a figure must be planned from the same
    one everywhere: `auto` plans on every rank, and profiles a few microseconds apart
    can tip a near-tie (a tensor-parallel op's choice, a pipeline cut) one way on one
    rank and the other way on another; the ranks then run different collectives until
    the mesh's timeout. Until 2026-11-29 the per-collective and per-parameter figures
    were each rank's own until the end of `runtime_costs`, and `pxform calibrate` on 2
    ranks failed once in three CI runs with a broadcast of `distribute` timing out on
    rank 0 (the cause not proven)."""
    return world.gather_objects(value)[0]


def representative_profile(profiles: Sequence[Hardware]) -> Hardware:
    """The one of `profiles` (calibrations of one machine, same sizes) whose predictions
    sit in the middle of theirs, kept (nearly) whole: each prices the reference transformer's
    steps on one node of its devices (`_representative_steps`: data parallel, ZeRO-3,
    tensor parallel over pairs, 2 pipeline stages of 8 microbatches at 2 and at 8 layers,
    and at 8 under each schedule), and the profile whose
    predictions are nearest the median prediction per step (the sum of their absolute
    log ratios; the first on a tie) is returned, its `source` saying so. One number is
    not kept: the conversions' cost (`relayout_wait_share`, or on older profiles
    `relayout_overhead_s`) is set so that the profile prices the tensor-parallel
    pairs at the calibrations' median (`_median_relayout`; it flips between calibrations
    while the rest sit alike).

    Not the median of every number (`pxform.cost.hardware.median_profile`): one
    calibration's numbers hang together. The runtime's fixed costs are each measured
    against the model with that calibration's op time scale and per-collective cost, so a
    slow spell that raised one lowered the next, and field-by-field medians mixed them
    into a profile faster than the calibrations it came from (2026-11-27, two runs of
    `benchmarks/accuracy.py` with 5 calibrations each: priced with the median of every
    number 1 and 2 of 13 plans came out within 10 %, all but one under; with this
    profile 8 and 9).

    The profiles come along whole as the returned one's `calibrations`: the search
    chooses with the representative's numbers, then predicts the chosen plan's step as
    the median of its prices under each calibration. Over 50 saved runs of
    `benchmarks/accuracy.py` (12 pinned plans each, priced as the runs' code priced them),
    the median price put every plan within 10 % in 28 runs, the representative's own in 23.
    Call it on every rank alike (it plans, it runs nothing). `pxform calibrate --runs N`
    writes this profile.

    Example:
        >>> hw = runtime_costs(calibrate())
        >>> representative_profile([hw]) is hw
        True
    """
    if not profiles:
        raise ValueError("representative_profile: no profiles given; pass the profiles of "
                         "one or more calibrations of the same machine")
    if len(profiles) == 1:
        return profiles[0]
    check_one_machine(profiles, f"representative_profile of {len(profiles)} profiles of "
                                f"{profiles[0].name!r}")
    # (each alone: a representative passed back in brings its own calibrations along)
    profiles = [dataclasses.replace(p, calibrations=()) for p in profiles]
    predicted = [_representative_steps(hw) for hw in profiles]
    middle = [statistics.median(p[k] for p in predicted) for k in range(len(predicted[0]))]
    distance = [sum(abs(math.log(t / m)) for t, m in zip(p, middle) if t > 0 and m > 0)
                for p in predicted]
    best = distance.index(min(distance))
    chosen = profiles[best]
    source = (f"calibration {best + 1} of {len(profiles)}, the one whose predictions sit in "
              f"the middle of theirs")
    # its cost per run of a conversion's collectives is the one number that flips between
    # calibrations minutes apart while the rest sit alike (0.07 against 0.89-0.98 ms in
    # one run of `benchmarks/accuracy.py`, 2026-11-29: the ranks' gloo wake-ups come and
    # go in spells, and a GPT step timed right after each calibration needed the same
    # figure as it), and a calibration in the middle of the other steps was kept with
    # it, pricing tensor parallelism 17 % under; so it is set to price the
    # tensor-parallel pairs at the calibrations' median
    # (profiles measured since 2026-11-29 carry a share per second of compute, older ones
    # a cost per run: whichever the calibrations measured is the one moved)
    field = ("relayout_wait_share" if any(p.relayout_wait_share > 0 for p in profiles)
             else "relayout_overhead_s")
    own = predicted[best]
    # an all-to-all's share of the per-collective cost was the noisiest number of a
    # calibration while it was fitted (0-1.65 over 30 calibrations on 2026-11-29: it came
    # from one step's 20 all-to-alls among 45 collectives), and at 0 the search took
    # all-to-alls for free (GPT small's tensor-parallel plan with recompute, made with
    # such a calibration, ran 7-16 % slower than the one made with the others, data
    # parallelism alike); taken from the comm tables since, it still varies (0.37-0.84),
    # and the per-collective cost it multiplies with it; so the chosen one's all-to-all
    # cost (its share of its per-collective cost) is set at the calibrations' median,
    # first: the tensor-parallel price below counts it
    a2a = _median_all_to_all(chosen, profiles)
    if a2a != chosen.all_to_all_share:
        source += (f", its all_to_all_share {chosen.all_to_all_share:.3g} -> {a2a:.3g} to "
                   f"cost an all-to-all their median")
        chosen = dataclasses.replace(chosen, all_to_all_share=a2a)
        own = [own[0], *_representative_steps(chosen, pairs_only=True)]
    measured = [getattr(p, field) for p in profiles]
    value = _median_relayout(chosen, own, middle, min(measured), max(measured), field)
    if value != getattr(chosen, field):
        shown = ((f"{getattr(chosen, field) * 1e6:.3g} -> {value * 1e6:.3g} us")
                 if field == "relayout_overhead_s" else
                 f"{getattr(chosen, field):.3g} -> {value:.3g}")
        source += f", its {field} {shown} to price tensor parallelism at their median"
    # every calibration kept whole beside it: the search prices its chosen plan with
    # each and predicts their median (`Hardware.calibrations`)
    changed: dict[str, Any] = {field: value, "source": f"{source}; {profiles[best].source}",
                               "calibrations": tuple(profiles)}
    return dataclasses.replace(chosen, **changed)


def _median_all_to_all(hw: Hardware, profiles: Sequence[Hardware]) -> float:
    """`hw.all_to_all_share` such that an all-to-all's per-collective cost (the share
    times `collective_overhead_s`) is the median of `profiles`' (`representative_profile`);
    unchanged where none measured one (all 1: profiles before 2026-11-29) or `hw` has no
    per-collective cost."""
    if all(p.all_to_all_share == 1.0 for p in profiles) or hw.collective_overhead_s <= 0:
        return hw.all_to_all_share
    cost = statistics.median(p.all_to_all_share * p.collective_overhead_s for p in profiles)
    return cost / hw.collective_overhead_s


def _median_relayout(hw: Hardware, own: Sequence[float], middle: Sequence[float],
                     low: float, high: float, field: str = "relayout_overhead_s") -> float:
    """`hw`'s `field` (`relayout_overhead_s` or `relayout_wait_share`) moved so that `hw`
    prices the reference's tensor-parallel pairs (`_representative_steps`' second step)
    at `middle`'s (the calibrations' median; `own` is `hw`'s own prices): the step grows
    linearly in either. Kept within `low`-`high`, the values the calibrations measured:
    the pairs' prices also differ by the calibrations' other numbers, and a difference of
    op time scale is not to turn into a conversion cost none of them found (all 0 stays
    0). Unchanged where there is no such step (an odd node) or it does not move with the
    field."""
    current = getattr(hw, field)
    if len(own) < 2 or own[1] <= 0 or middle[1] <= 0 or own[1] == middle[1]:
        return current
    step = 1e-3
    moved: dict[str, Any] = {field: current + step}
    more = _representative_steps(dataclasses.replace(hw, **moved), pairs_only=True)[0]
    slope = (more - own[1]) / step
    if slope <= 0:
        return current
    return min(high, max(low, current + (middle[1] - own[1]) / slope))


def _representative_steps(hw: Hardware, pairs_only: bool = False) -> list[float]:
    """`hw`'s predicted seconds for the reference transformer (8 sequences per device) on
    one node of `hw.devices_per_node` devices: data parallel; with an even count, tensor
    parallel over pairs (data parallel across them), a 2-stage 1F1B pipeline of 8
    microbatches of the reference and of its 8-layer form, ZeRO-3 over the node, and the
    8-layer pipeline under zero-bubble, interleaved and shifted schedules
    (`representative_profile`); a step the search cannot plan is left out alike for every
    profile. With `pairs_only`, the tensor-parallel pairs alone (an even node)."""
    n = max(1, hw.devices_per_node)
    gen = torch.Generator().manual_seed(0)
    device = default_device()
    _, _, vocab, seq = _reference_shape(device)
    params = _reference_params(gen, torch.device("cpu"))  # (planned only: never run)
    tokens = torch.randint(0, vocab, (8 * n, seq), generator=gen)
    mesh = abstract_mesh(n)
    try:
        blocks = len(auto(_reference, mesh=mesh, hardware=hw).plan(params, tokens).blocks)
    except SearchError:  # (no plan at all: nothing to tell the profiles apart by)
        return []
    steps = [(params, Pin(stages=1, outer=n, inner=1, microbatches=1, block_options=(
        Option((("outer", "dp"),) if n > 1 else (), False),) * blocks))]
    if pairs_only:
        steps = [(params, _pairs_pin(n, blocks))] if n % 2 == 0 else []
    elif n % 2 == 0:
        pipelined = Pin(stages=2, outer=n // 2, inner=1, microbatches=8,
                        schedule=ScheduleChoice())
        # the pipeline twice: the reference's 2 layers, and 8 (4 a stage), whose stages
        # hold parameters and ops as a real model's do; the costs per parameter and per op
        # of an action weigh there as in training (one calibration's 92 us per parameter
        # and action, 2-5x the others', sat in the middle at 2 layers, and priced GPT
        # small's 8-microbatch pipelines 25-46 % over)
        cpu = torch.device("cpu")
        deep = _reference_params(gen, cpu, layers=4 * _reference_shape(cpu)[0])
        steps += [(params, _pairs_pin(n, blocks)), (params, pipelined), (deep, pipelined)]
        # and every other family the search prices: ZeRO-3, and the deep form under the
        # other schedules. A calibration whose numbers for one of them were off (its
        # per-transfer delay, or its waits after compute, which price ZeRO-3's and the
        # schedules' waits) sat in the middle of the four steps above and priced those
        # plans 10-13 % under (2026-11-28: the chosen calibration 8 of 13 plans within
        # 10 %, each of three others 13 of 13)
        steps.append((params, Pin(stages=1, outer=n, inner=1, microbatches=1, block_options=(
            Option((("outer", "sdp"),), False),) * blocks)))
        steps += [(deep, dataclasses.replace(pipelined, schedule=choice))
                  for choice in (ScheduleChoice("zb"), ScheduleChoice("interleaved", 2),
                                 ScheduleChoice("shifted"))]
    out = []
    for tree, pin in steps:
        try:
            out.append(auto(_reference, mesh=mesh, hardware=hw, memory_margin=0.0,
                            plan=pin).plan(tree, tokens).step_time_s)
        except SearchError:  # (the same for every profile of one machine: not counted)
            out.append(0.0)
    return out


def _pairs_pin(n: int, blocks: int, role: str = "tp") -> Pin:
    """Every block tensor parallel over pairs of `n` ranks (even), data parallel across the
    pairs (`_relayout_costs`, `_representative_steps`), with sequence parallelism between
    the blocks where `role` is "sp": the reference's 4 heads split no further, and an
    inner axis of 2 stays within a node of 2 devices.

    Example:
        >>> _pairs_pin(4, 3).block_options[0].roles
        (('outer', 'dp'), ('inner', 'tp'))
    """
    roles = (("inner", role),) if n == 2 else (("outer", "dp"), ("inner", role))
    return Pin(stages=1, outer=n // 2, inner=2, microbatches=1,
               block_options=(Option(roles, False),) * blocks)


def reference_program(rows: int = 8, seq: int | None = None, seed: int = 0
                      ) -> tuple[Callable[..., torch.Tensor], dict[str, Any], torch.Tensor]:
    """(loss, parameters, tokens): the reference transformer `op_time_scale` is fitted on
    (module doc), at `rows` sequences of `seq` tokens (default: its own, 64 on a CPU), on
    this rank's device. Timed under `pxform.value_and_grad` on every rank at once, as
    `runtime_costs` times it, and priced with `reference_price`, it tells how far the
    machine has moved since a profile was measured: the fit makes the two agree then.

    Example:
        >>> loss, params, tokens = reference_program(8)
        >>> loss(params, tokens).shape
        torch.Size([])
    """
    device = default_device()
    _, _, vocab, tokens_per_row = _reference_shape(device)
    gen = torch.Generator().manual_seed(seed)
    params = _reference_params(gen, device)
    tokens = torch.randint(0, vocab, (rows, tokens_per_row if seq is None else seq),
                           generator=gen)
    return _reference, params, _on(tokens, device)


def reference_price(hw: Hardware, params: dict[str, Any], tokens: torch.Tensor) -> float:
    """What `hw` predicts for one `value_and_grad` step of `reference_program` on
    `tokens`: its ops on one device at `hw`'s op time scale and time per op, as
    `runtime_costs` fits them (`_ReferenceSteps`), without pxform runtime's per-step and
    per-parameter costs (the program runs as a plain function, not a distributed plan).

    Example:
        >>> loss, params, tokens = reference_program(8)
        >>> reference_price(hw, params, tokens)
        0.0131
    """
    return program_price(hw, _reference, params, tokens)


def program_price(hw: Hardware, fn: Callable[..., Any], *args: Any) -> float:
    """What `hw` predicts for one `value_and_grad` step of the plain function `fn` on
    `args` on one device, as `reference_price` prices the reference program (its ops;
    not pxform runtime's per-step and per-parameter costs, which a plain function does
    not pay): what `pxform.check_profile(hw, fn=fn, args=args)` compares with the step
    timed.

    Example:
        >>> program_price(hw, *reference_program(8)) == reference_price(hw, params, tokens)
        True
    """
    plain = dataclasses.replace(hw, step_overhead_s=0.0, param_overhead_s=0.0,
                                calibrations=())
    return auto(fn, mesh=abstract_mesh(1), hardware=plain,
                memory_margin=0.0).plan(*args).step_time_s


def _reference(params: dict[str, Any], tokens: torch.Tensor) -> torch.Tensor:
    """A small transformer language model's loss (`_ReferenceSteps`)."""
    h = params["embedding"][tokens]
    for layer in params["layers"]:
        h = _layer(layer, h)
    return _head(params, h, tokens)


def _layer(layer: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    x = F.layer_norm(h, h.shape[-1:], layer["norm1"])
    b, s, d = x.shape
    q, k, v = (t.reshape(b, s, _HEADS, d // _HEADS).transpose(1, 2)
               for t in F.linear(x, layer["qkv"]).split(d, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    h = h + F.linear(y.transpose(1, 2).reshape(b, s, d), layer["proj"])
    x = F.layer_norm(h, h.shape[-1:], layer["norm2"])
    return h + F.linear(F.gelu(F.linear(x, layer["up"]), approximate="tanh"), layer["down"])


def _head(params: dict[str, Any], h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    logits = F.linear(F.layer_norm(h, h.shape[-1:]), params["embedding"])
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def _reference_params(gen: torch.Generator, device: torch.device,
                      layers: int | None = None) -> dict[str, Any]:
    """The reference transformer's parameters (`_reference_shape`; `layers` of them when
    given)."""
    depth, d, vocab, _ = _reference_shape(device)
    layers = depth if layers is None else layers

    def weight(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) / shape[-1] ** 0.5

    return _on({"embedding": weight(vocab, d),
                "layers": [{"norm1": torch.ones(d), "norm2": torch.ones(d),
                            "qkv": weight(3 * d, d), "proj": weight(d, d),
                            "up": weight(4 * d, d), "down": weight(d, 4 * d)}
                           for _ in range(layers)]}, device)


def _on(tree: Any, device: torch.device) -> Any:
    """`tree`'s tensors on `device`."""
    return optree.tree_map(lambda t: t.to(device), tree)


def _reference_shape(device: torch.device) -> tuple[int, int, int, int]:
    """(layers, width, vocabulary, tokens per sequence) of the reference transformer."""
    return _REFERENCE_CUDA if device.type == "cuda" else _REFERENCE


def _sizes(device: torch.device) -> tuple[tuple[int, int], ...]:
    """(sequences, tokens per sequence) the reference step is timed at."""
    return _SIZES_CUDA if device.type == "cuda" else _SIZES


_HEADS = 4
_REFERENCE = (2, 96, 512, 64)  # layers, width, vocabulary, tokens per sequence
# On a GPU the CPU's reference is all kernel launches: its time hardly moves with its
# work, and the fit had nothing to find a scale in (on an H100 it gave 2.3 from steps
# that each cost about the same; with the programs left on the CPU it timed the CPU).
# A wider one, up to 8 K tokens, has matmuls of 10-100 us there.
_REFERENCE_CUDA = (2, 1024, 8192, 512)
# (sequences, tokens per sequence): the reference step at these sizes. The smallest does
# almost no work, so it pins the time per op; without it (1, 2, 4 and 8 sequences of 64
# tokens) the fit traded the scale against the time per op from one calibration to the
# next (0.94 and 34 us, 1.12 and 17 us), and pipelines of small microbatches moved by a
# third with it.
_SIZES = ((1, 4), (1, 64), (2, 64), (4, 64), (8, 64))
_SIZES_CUDA = ((1, 4), (1, 512), (4, 512), (8, 512), (16, 512))


_GRADIENT_WAIT_ROWS = 4
"""The data-parallel reference step of `_gradient_wait` runs this many times the largest
size's sequences of `_sizes` per rank: 32 of 64 tokens on a CPU, a backward of about 25
ms here, well beyond `calibrate`'s last sync-wait point (8 ms) and about GPT small's
data-parallel backward (20 ms). At 16 sequences (12-13 ms) the points came out 1.6-3.7
ms, steep beyond the 8 ms point's 0.3-1.4 ms, and a faster host would have put the
backward at or below that point, adding nothing."""


def _gradient_wait(hw: Hardware, gen: torch.Generator, repeats: int
                   ) -> tuple[tuple[float, float], ...]:
    """`hw.sync_wait` with one more point, where a data-parallel step's last gradient
    bucket meets its peers: the reference transformer data parallel over the world at
    `_GRADIENT_WAIT_ROWS` times the largest size of `_sizes` per rank, paired with one
    rank's share on one device per rank (every rank at once); the sharded step, scaled by
    the one device's price over its measured time (the machine's speed as the op times
    were fitted, as `_relayout_costs` scales), less `hw`'s price, is what the wait at the
    end of its backward costs beyond `hw.sync_wait_s` of that backward. The point is
    `(backward, sync_wait_s(backward) + residue)`, at least the last point's wait (the
    curve does not fall), and only beyond the last point; the slowest rank's residue (a
    step lasts until its slowest rank is done, as `pxform.measure` reports it). Unchanged
    on one rank, or where the backward is not beyond the last point (a fast device).

    Why: `calibrate` measures the wait on chains of matmuls up to 8 ms of compute, and
    beyond, the curve grows as the square root of the gap (`Hardware.sync_wait_s`). A
    training step's backward is longer and not a chain of equal matmuls: GPT small's
    data-parallel step on 2 gloo ranks was priced 6.8-9.0 % under in the last five plain
    runs of `benchmarks/accuracy.py` on an Intel host, with the reference program priced
    -4.4 to +0.7 % beside it (the fifty-fifth session, 2026-12-05: the reference's
    data-parallel step at 16 sequences a rank measured 0.6-2.6 ms beyond its price in one
    calibration, GPT small's 1.8-2.2 ms; at 32 sequences ten calibrations put the point
    at 1.6-3.5 ms, where the curve had extrapolated 0-2.9 ms from its 8 ms point).

    Example (every rank):
        >>> hw = dataclasses.replace(hw, sync_wait=_gradient_wait(hw, gen, 9))
    """
    points = hw.sync_wait
    n = world.size() if world.initialized() else 1
    if n < 2 or not points:
        return points
    device = default_device()
    _, _, vocab, _ = _reference_shape(device)
    rows, seq = max(_sizes(device))
    rows *= _GRADIENT_WAIT_ROWS
    params = _reference_params(gen, device)
    tokens = _on(torch.randint(0, vocab, (rows * n, seq), generator=gen), device)
    mesh = abstract_mesh(n)
    try:
        blocks = len(auto(_reference, mesh=mesh, hardware=hw).plan(params, tokens).blocks)
        pin = _dp_pin(n, blocks)

        def priced(curve: tuple[tuple[float, float], ...]) -> float:
            return auto(_reference, mesh=mesh, memory_margin=0.0, plan=pin,
                        hardware=dataclasses.replace(hw, sync_wait=curve, calibrations=())
                        ).plan(params, tokens).step_time_s

        price = priced(points)
        # the backward's compute the bucket meets the peers after: the price's growth
        # with a wait equal to the gap (the plan's only wait: data parallel, nothing
        # converted between blocks)
        backward = priced(((0.0, 0.0), (1e3, 1e3))) - priced(())
    except SearchError:  # (every rank alike: planning is deterministic)
        return points
    if backward <= points[-1][0]:
        return points
    step = auto(_reference, mesh=n, hardware=hw, memory_margin=0.0, plan=pin)
    sharded = functools.partial(value_and_grad(step), *step.distribute(params, tokens))
    one_device = functools.partial(value_and_grad(_reference), params, tokens[:rows])
    alone = program_price(hw, _reference, params, tokens[:rows])
    scaled = _at_fitted_speed(*_paired(one_device, sharded, 3 * repeats), alone)
    residue = max(world.gather_objects(scaled - price)) if n > 1 else scaled - price
    wait = max(points[-1][1], hw.sync_wait_s(backward) + residue)
    return (*points, (round(backward, 9), round(wait, 9)))


def _dp_pin(n: int, blocks: int) -> Pin:
    """Every one of `blocks` blocks data parallel over all `n` ranks, in one stage.

    Example:
        >>> _dp_pin(2, 3).block_options[0].roles
        (('outer', 'dp'),)
    """
    return Pin(stages=1, outer=n, inner=1, microbatches=1,
               block_options=(Option((("outer", "dp"),), False),) * blocks)


def _at_fitted_speed(measured_alone: float, longer: float, alone: float) -> float:
    """A sharded step that took `longer` seconds more than a one-device step timed beside
    it (`measured_alone` seconds, priced `alone`), at the speed the profile's op times were
    fitted at: scaled by the one device's price over its measured time (how far the
    machine has moved since; unscaled when nothing was measured).

    Example:
        >>> _at_fitted_speed(0.011, 0.004, 0.010)  # the machine 10 % slower than fitted
        0.013636...
    """
    if measured_alone <= 0:
        return measured_alone + longer
    return (measured_alone + longer) * alone / measured_alone


def _per_collective(hw: Hardware, gen: torch.Generator, repeats: int) -> float:
    """`collective_overhead_s` (module doc): a tensor-parallel chain of tiny matmuls at 2
    and at 26 layers, paired; the difference less the comm tables' times of the extra
    collectives, over their number (0 when there are none)."""
    n = world.size()
    device = default_device()
    # activations of 64 KiB per collective: what a step pays per collective beyond
    # the transfer grows with the message before it levels off (here 0.75 ms at 64 B,
    # 1.1-1.2 ms at 64 KiB, 1.3 ms at 1 MiB, over the comm table's lower quartile)
    rows = max(n, _COLLECTIVE_ROWS // n * n)

    def tp_step(layers: int) -> tuple[Callable[[], Any], list[str]]:
        ws = _on([torch.randn(_WIDTH, _WIDTH, generator=gen) / _WIDTH ** 0.5
                  for _ in range(layers)], device)
        x = _on(torch.randn(rows, _WIDTH, generator=gen), device)

        def chain(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
            for w in ws:
                x = x @ w
            return x.sum()

        sharded = shard(chain, mesh=Mesh({"tp": n}), in_specs=(P("tp"), P()))
        program = sharded.lower(ws, x)
        step = value_and_grad(sharded)
        return (lambda: step(ws, x),
                program.collectives() + program.backward_collectives())

    # many collectives against few, and thrice the repeats: each is a fraction of a
    # millisecond, and a loaded machine moved the figure by 2x between calibrations
    (call_short, short), (call_long, long) = tp_step(2), tp_step(26)
    _, longer = _paired(call_short, call_long, 3 * repeats)
    extra = list(long)
    for c in short:
        if c in extra:
            extra.remove(c)
    if not extra:
        return 0.0
    level = hw.level(n)
    local = rows * _WIDTH * 4.0  # each collective's tensor, float32
    comm = sum(hw.comm_time(kind, sent_bytes(kind, local, n), n, level)
               for kind in (c.split("(")[0] for c in extra))
    return max(0.0, (longer - comm) / len(extra))


class _ReferenceSteps:
    """(`op_time_scale`, `op_step_overhead_s`): the reference step (every rank at once,
    as in training) at each size of `_SIZES`, its median seconds `t` against the cost
    model's seconds `c` for its ops on one device, fitted by least squares as `t = scale x
    c + ops x per_op` (the same ops at every size); with `per_op` 0 when the fit makes it
    negative. The sizes are timed in turn within each repeat, so a drift in the machine's
    load falls on all of them alike: two sizes timed one after the other gave fits that
    moved the scale by a third between two calibrations. `time` runs one block of
    repeats; `runtime_costs` runs three, seconds apart, and `fit` takes the medians over
    all of them: a slow spell of the machine lasts seconds, and over one block of 27
    repeats it carried whole calibrations (op time scales 1.88 and 2.13 among 1.1-1.5 on
    2026-11-27); over a third of the repeats it moves the median less."""

    def __init__(self, hw: Hardware, gen: torch.Generator) -> None:
        device = default_device()
        _, _, vocab, _ = _reference_shape(device)
        params = _reference_params(gen, device)
        # the model's time for the same ops: one device, no fixed costs, no fit yet
        bare = dataclasses.replace(hw, op_time_scale=1.0, op_step_overhead_s=0.0,
                                   forward_scale=1.0, backward_scale=1.0,
                                   step_overhead_s=0.0, param_overhead_s=0.0)
        step = value_and_grad(_reference)
        self.host_overlaps = hw.host_overlaps
        self.calls: list[Callable[[], Any]] = []
        self.modelled: list[float] = []
        self.passes: list[tuple[float, float]] = []
        self.ops = 0
        for rows, seq in _sizes(device):
            tokens = _on(torch.randint(0, vocab, (rows, seq), generator=gen), device)
            for _ in range(2):
                step(params, tokens)
            self.calls.append(functools.partial(step, params, tokens))
            plan = auto(_reference, mesh=abstract_mesh(1), hardware=bare,
                        memory_margin=0.0).plan(params, tokens)
            self.modelled.append(plan.step_time_s)
            self.passes.append((plan.stage_plans[0].forward_s,
                                plan.stage_plans[0].backward_s))
            self.ops = sum(b.stop - b.start for b in plan.blocks)
        self.times: list[list[float]] = [[] for _ in self.calls]

    def time(self, repeats: int) -> None:
        for _ in range(repeats):
            for k, call in enumerate(self.calls):
                self.times[k].append(timed_call(call))

    def medians(self) -> list[float]:
        """Per size, the median seconds of the step over every block timed."""
        return [statistics.median(t) for t in self.times]

    def fit(self) -> tuple[float, float]:
        if self.host_overlaps:
            return _fit_overlapped(self.medians(), self.passes, self.ops)
        return _fit_scale(self.medians(), self.modelled, self.ops)

    def split(self, forwards: Sequence[float], scale: float, per_op: float
              ) -> tuple[float, float]:
        """(`forward_scale`, `backward_scale`) against the fitted `scale` and `per_op`:
        `_fit_passes` of the steps' medians and the reference forward's (`forwards`, per
        size); (1, 1) on a device whose host runs ahead (its passes overlap the host's
        time: `_fit_overlapped` prices them whole) or without forwards."""
        if self.host_overlaps or len(forwards) != len(self.passes):
            return 1.0, 1.0
        return _fit_passes(self.medians(), forwards, self.passes, self.ops, scale, per_op)


class _AutogradForwards:
    """(`autograd_op_overhead_s`, `autograd_share`): the reference transformer's forward
    (every rank at once) at each size of `_SIZES`, with gradients (its parameters require
    them) and under `no_grad`, timed in turn within each repeat (`time`, one block of
    repeats); `fit` takes the median difference per size over every block and fits it
    against the cost model's forward `f` for its ops (with the profile's op time scale)
    as `ops x per_op + share x f` (`_fit_autograd`). What a forward without autograd
    saves (the shifted schedule's first forward of a stage that recomputes early,
    `pxform.search.stages`): on one idle process 0.12 ms of 0.4 at the smallest size, 0.5
    of 6 ms at the largest, per op at small sizes and a share of the time at large ones."""

    def __init__(self, gen: torch.Generator) -> None:
        device = default_device()
        _, _, vocab, _ = _reference_shape(device)
        self.params = _reference_params(gen, device)
        for t in optree.tree_leaves(self.params):  # type: ignore[arg-type,var-annotated]
            t.requires_grad_()
        self.tokens = [_on(torch.randint(0, vocab, (rows, seq), generator=gen), device)
                       for rows, seq in _sizes(device)]
        self.calls = [(functools.partial(_forward, self.params, x, True),
                       functools.partial(_forward, self.params, x, False))
                      for x in self.tokens]
        for with_grad, without in self.calls:
            for _ in range(2):
                with_grad()
                without()
        self.saved: list[list[float]] = [[] for _ in self.calls]
        self.forwards: list[list[float]] = [[] for _ in self.calls]

    def time(self, repeats: int) -> None:
        for _ in range(repeats):
            for k, (with_grad, without) in enumerate(self.calls):
                recorded = timed_call(with_grad)
                self.forwards[k].append(recorded)
                self.saved[k].append(recorded - timed_call(without))

    def forward_medians(self) -> list[float]:
        """Per size, the median seconds of the forward with autograd's graph recorded."""
        return [statistics.median(t) for t in self.forwards if t]

    def fit(self, hw: Hardware) -> tuple[float, float]:
        bare = dataclasses.replace(hw, step_overhead_s=0.0, param_overhead_s=0.0)
        forwards, ops = [], 0
        for tokens in self.tokens:
            plan = auto(_reference, mesh=abstract_mesh(1), hardware=bare,
                        memory_margin=0.0).plan(self.params, tokens)
            forwards.append(plan.stage_plans[0].forward_s)
            ops = sum(b.stop - b.start for b in plan.blocks)
        return _fit_autograd([statistics.median(x) for x in self.saved], forwards, ops)


def _forward(params: dict[str, Any], tokens: torch.Tensor, grad: bool) -> None:
    """The reference transformer's forward, its autograd graph recorded or not (and
    dropped on return)."""
    with torch.set_grad_enabled(grad):
        _reference(params, tokens)


def _fit_autograd(saved: Sequence[float], forwards: Sequence[float], ops: int
                  ) -> tuple[float, float]:
    """(per_op >= 0, share in [0, 0.5]) fitting `saved[k] = ops x per_op + share x
    forwards[k]` by least squares over the sizes (`_AutogradForwards`); where the fit makes
    one negative, it is 0 and the other is fitted alone.

    Example:
        >>> per_op, share = _fit_autograd([1.9e-4, 2.6e-4, 5.4e-4], [1e-3, 2e-3, 6e-3], 40)
        >>> round(per_op, 9), round(share, 6)
        (3e-06, 0.07)
        >>> _fit_autograd([1e-4, 1e-4], [1e-3, 2e-3], 50)   # no share: per op only
        (2e-06, 0.0)
    """
    if not saved or ops <= 0:
        return 0.0, 0.0
    share, rest = _line(forwards, saved)
    per_op = rest / ops
    if share < 0:
        share, per_op = 0.0, sum(saved) / len(saved) / ops
    elif per_op < 0:
        per_op, share = 0.0, _through_origin(forwards, saved)
    return max(0.0, per_op), min(max(0.0, share), 0.5)


def _line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line through the points `(xs[k], ys[k])`;
    slope 0 (the mean) where the xs do not spread.

    Example:
        >>> _line([1.0, 2.0, 4.0], [3.0, 5.0, 9.0])
        (2.0, 1.0)
    """
    n = len(xs)
    mean_x, mean_y = sum(xs) / n, sum(ys) / n
    spread = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread \
        if spread > 0 else 0.0
    return slope, mean_y - slope * mean_x


def _through_origin(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The slope of the least-squares line through the origin (0 where the xs are all 0).

    Example:
        >>> _through_origin([1.0, 2.0], [2.0, 4.0])
        2.0
    """
    square = sum(x * x for x in xs)
    return sum(x * y for x, y in zip(xs, ys)) / square if square > 0 else 0.0


def _fit_scale(measured: list[float], modelled: list[float], ops: int
               ) -> tuple[float, float]:
    """Least squares `measured = scale x modelled + ops x per_op` over the sizes
    (`_ReferenceSteps`); `per_op` held at 0 where it fits negative, `(1, 0)` without a
    positive scale.

    Example:
        >>> _fit_scale([3.0, 5.0, 9.0], [1.0, 2.0, 4.0], 10)
        (2.0, 0.1)
    """
    scale, rest = _line(modelled, measured)
    per_op = rest / ops if ops else 0.0
    if scale > 0 and per_op >= 0:
        return scale, per_op
    scale = _through_origin(modelled, measured)  # no time per op
    return (scale, 0.0) if scale > 0 else (1.0, 0.0)


_PASS_SCALE_BOUNDS = (0.5, 2.0)
"""The range `_fit_passes` keeps each factor in: the forward and the backward of one step
came out 0.8-1.3 times the step's own scale here; beyond a factor of 2 a fit has read
noise (a slow spell over one block of forwards), not the passes."""


def _fit_passes(steps: Sequence[float], forwards: Sequence[float],
                passes: Sequence[tuple[float, float]], ops: int, scale: float,
                per_op: float) -> tuple[float, float]:
    """(`forward_scale`, `backward_scale`): per size, the reference step's measured seconds
    `steps`, its forward's `forwards` (autograd's graph recorded, the graph dropped), and
    the op model's `passes` (forward, backward) at scale 1. With the step's fit (`scale`,
    `per_op`: a third of the time per op in the forward, two thirds in the backward, as
    `CostModel.op_times` adds it), each pass's factor is fitted through the origin by
    least squares: `forward - ops x per_op / 3 = scale x f_scale x f` and `step - forward -
    2 ops x per_op / 3 = scale x b_scale x b`; each kept within `_PASS_SCALE_BOUNDS`, and
    (1, 1) where either cannot be fitted.

    Why: the op curves time forward and backward in chains, where a backward ran about
    twice its forward; in the reference step on this project's CPU the forward ran 29 %
    over its price and the backward 11 % (1.5 times the forward, priced 1.9), and one
    scale on both priced a recomputed block's second forward a quarter under (GPT small,
    one rank: 13.6-14.5 ms measured against 10.3 priced, 2026-11-30).

    Example:
        >>> # forwards 30 % over the model at scale 1, backwards 10 % under
        >>> f, b = _fit_passes([2.2, 4.4], [1.3, 2.6], [(1.0, 1.0), (2.0, 2.0)], 10, 1.0, 0.0)
        >>> round(f, 3), round(b, 3)
        (1.3, 0.9)
    """
    share = 1.0 / (1.0 + BACKWARD_RATIO)  # the forward's part of the time per op
    host = ops * per_op
    f_rest = [t - host * share for t in forwards]
    b_rest = [s - t - host * (1.0 - share) for s, t in zip(steps, forwards)]
    f_scale = _through_origin([scale * f for f, _ in passes], f_rest)
    b_scale = _through_origin([scale * b for _, b in passes], b_rest)
    low, high = _PASS_SCALE_BOUNDS
    if not (f_scale > 0 and b_scale > 0):
        return 1.0, 1.0
    return min(max(f_scale, low), high), min(max(b_scale, low), high)


def _fit_overlapped(measured: Sequence[float], passes: Sequence[tuple[float, float]],
                    ops: int) -> tuple[float, float]:
    """(`op_time_scale`, `op_step_overhead_s`) on a device whose kernels run
    asynchronously to the host (`Hardware.host_overlaps`), the form the search prices
    there (`pxform.search.stages.host_overlapped`): each pass takes the longer of the
    device's time (`scale` x the op model's) and the host's (`ops x per_op`, a third in
    forward, two thirds in backward), `t = max(scale f, ops per_op / 3) + max(scale b,
    2 ops per_op / 3)` for the modelled passes `(f, b)` per size. The linear fit
    (`_fit_scale`) adds the two, and on an H200 it priced host-bound GPT steps 37-74 %
    over. Fitted by a search over a grid (scale 1 % apart from 0.05 to 20; the time per op
    from 0 to the slowest step over the ops), then a finer one around its best, least
    squares of the relative error.

    Example:
        >>> passes = [(1e-4, 2e-4), (1e-3, 2e-3), (1e-2, 2e-2)]   # 100 ops
        >>> scale, per_op = _fit_overlapped([3e-3, 3.6e-3, 3.6e-2], passes, 100)
        >>> round(scale, 3), round(per_op * 1e6, 1)   # host-bound, mixed, device-bound
        (1.2, 30.0)
    """
    t = np.asarray(measured, dtype=float)
    f = np.asarray([p[0] for p in passes], dtype=float)
    b = np.asarray([p[1] for p in passes], dtype=float)
    if ops <= 0 or not (f + b).any() or not (t > 0).all():
        return _fit_scale(list(measured), [x + y for x, y in passes], ops)
    share = 1.0 / (1.0 + BACKWARD_RATIO)  # the forward's part of the host time

    def best(scales: Any, per_ops: Any) -> tuple[float, float]:
        s = scales[:, None, None]
        h = per_ops[None, :, None] * ops
        model = np.maximum(s * f, h * share) + np.maximum(s * b, h * (1.0 - share))
        cost = (((model - t) / t) ** 2).sum(axis=2)
        i, j = np.unravel_index(int(cost.argmin()), cost.shape)
        return float(scales[i]), float(per_ops[j])

    step = float(t.max()) / ops / 399
    scale, per_op = best(np.exp(np.arange(math.log(0.05), math.log(20.0), math.log(1.01))),
                         np.linspace(0.0, 399 * step, 400))
    # then finer around it: 0.02 % in the scale, a fiftieth of the step in the time per op
    return best(scale * np.exp(np.linspace(-0.01, 0.01, 101)),
                np.linspace(max(0.0, per_op - step), per_op + step, 101))


def _staged(params: dict[str, Any], tokens: torch.Tensor) -> torch.Tensor:
    """`_reference` with a pipeline stage boundary after the first half of its layers."""
    h = params["embedding"][tokens]
    layers = params["layers"]
    for k, layer in enumerate(layers):
        if k == len(layers) // 2:
            h = stage_boundary(h)
        h = _layer(layer, h)
    return _head(params, h, tokens)


def _action_costs(hw: Hardware, gen: torch.Generator, repeats: int
                  ) -> tuple[float, float, float, float, tuple[float, float], float, float]:
    """(`action_overhead_s`, `op_action_overhead_s`, `receive_stall_s`,
    `transfer_overhead_s`, (`weight_op_overhead_s`, `split_backward_share`),
    `send_overhead_s`, `receive_overhead_s`) (module doc):
    the reference transformer at each depth of `_ACTION_DEPTHS`, cut into 2 stages, its
    1F1B pipeline at `_ACTION_MICROBATCHES` microbatches of 16 sequences per data-parallel
    replica (the two timed alternately, every rank at once; the longer one's actions
    recorded, `pxform.runtime.pipeline.recording`), and at the longer one's microbatches
    under zero-bubble and interleaved, recorded.

    The actions' own cost: per action, what the interleaved pipeline's forwards and
    backwards (twice as many over the same ops) take more than 1F1B's beyond the model
    (`_extra_action`), averaged over the depths; per op, per depth, a 1F1B forward and
    backward of one microbatch as they ran (their means), averaged over the stages, less
    the cost model's without these costs, is `2 x (per_action + per_op x ops)` (ops: a
    stage's mean op count), averaged over the depths. The transfers' own cost: the
    recorded sends' mean and the receives' lower quartile (a receive whose data has
    arrived, not one that waited), over the stages and depths. Until 2026-11-28 (late)
    the two were in the forward and backward: one transfer per action, as a 2-stage
    pipeline makes, where an interleaved schedule's chunks make one and a half per
    action on average (its plans came out 8-13 % under).

    The stall and the delay on waits (`_STALL_SHARE` of a cost per transfer, and the
    rest): per depth, the 1F1B pipeline at the longer one's microbatches, the
    interleaved one (`_interleaved`) and the same model's data-parallel step, timed in
    turn (`_whole_calls`); per pipeline, the cost at which the model prices its whole
    call at its measured share of the data-parallel step's price (`fit_to_call`);
    averaged over both pipelines and the depths. The whole call, not the actions' span:
    a call runs per-step work before its first action and after its last (7.4-9.6 ms
    in GPT small's 2-stage pipelines here), which the span leaves out. A share of the
    data-parallel step, not the call's seconds: the pipelines are timed seconds after
    the reference step the op time scale came from, and a slow spell in between went
    whole into the stall. Until the twenty-seventh session (2026-11-29) the stall alone
    was fitted, for 1F1B and zero-bubble, so that the schedule simulator fed the
    stages' recorded actions gave the recorded span (`fit_receive_stall`), and the
    model's prices of those actions and the work outside the span were checked against
    nothing: profiles fitted so priced the reference's 16-microbatch pipeline from 14
    points under to 2 points over its share of the data-parallel step, four
    calibrations in a row; fitted to the whole call, within 3.3 points (three). Over
    the 5 calibrations of each of three accuracy runs, GPT small's pipelines' errors
    less data parallelism's spread by 1.1-6.2 points (standard deviation), against
    4.4-9.6 over the 27 saved runs before (pooled).
    Before 2026-11-28 the per-action costs were fitted to the step difference alone:
    they took the 1F1B ranks' waits for each other's transfers into every forward and
    backward (GPT small's stage 0: F priced 4.1 ms, run 3.0; B 7.0 and 4.5), and
    schedules that wait less (the shifted one, zero-bubble) came out 5-13 points further
    over than 1F1B.

    The split backward: the zero-bubble pipeline's B and W actions against 1F1B's fused B
    of the same stage, per depth at the longer pipeline's microbatches and at the deepest
    also at the shorter one's (8 times the tokens a microbatch): per stage, what B + W
    took beyond the fused B and one more action, fitted over the stage's weight ops and
    its backward's seconds in the model (`_fit_split_costs`: a cost per weight op and a
    share of the backward). Until 2026-11-30 the W alone against the model's W, per
    weight op, at one size: zero-bubble came out 8-17 points under 1F1B in the accuracy
    runs, and at 2 microbatches it was priced 12 % under 1F1B while it ran 2 % under.
    Until 2026-11-28 it came from tiny 8 x 8 matmuls chained 1 and 16 to a stage: 14-95 us
    per op, and GPT small's W actions ran 4.5-5.1 ms against 2.2-2.5 priced."""
    n = world.size()
    device = default_device()
    _, _, vocab, seq = _reference_shape(device)
    few, many = _ACTION_MICROBATCHES
    tokens = _on(torch.randint(0, vocab, (many * (n // 2), seq), generator=gen), device)
    # the model without the three costs, and without what a step costs outside its
    # actions (the per-step and per-parameter costs, which `assemble` spreads over the
    # backwards): the actions' prices to compare with their recorded times
    bare = dataclasses.replace(hw, action_overhead_s=0.0, op_action_overhead_s=0.0,
                               transfer_overhead_s=0.0, send_overhead_s=0.0,
                               receive_overhead_s=0.0, receive_stall_s=0.0)
    actions_only = dataclasses.replace(bare, param_overhead_s=0.0, step_overhead_s=0.0)
    per_action, ops_per_stage, zb_runs = [], [], []
    anchors = []
    per_extra_action: list[float] = []
    sends, receives = [], []
    for depth in _ACTION_DEPTHS:
        params = _reference_params(gen, device, depth)
        blocks = len(auto(_staged, mesh=abstract_mesh(n), hardware=bare,
                          plan=Pin(stages=2)).plan(params, tokens).blocks)
        roles = (("outer", "dp"),) if n > 2 else ()

        def staged_call(m: int, schedule: str = "1f1b", params: Any = params
                        ) -> Callable[[], Any]:
            """One training step of the reference cut into 2 stages, `m` microbatches."""
            piped = pipeline(_staged, stages=2, microbatches=m, schedule=schedule)
            sharded = shard(piped, mesh=Mesh({"pp": 2, "dp": n // 2}),
                            in_specs=(None, P("dp")))
            return functools.partial(value_and_grad(sharded), params, tokens)

        calls, pins = [], []
        for m in (few, many):
            calls.append(staged_call(m))
            # the same pipeline as the cost model prices it: data parallel, 1F1B
            pins.append(Pin(stages=2, outer=n // 2, inner=1, microbatches=m,
                            schedule=ScheduleChoice(), block_options=(Option(roles, False),)
                            * blocks))
        priced = functools.partial(_priced_pipeline, params=params, tokens=tokens, n=n)
        plan = priced(actions_only, pins[1])
        ops = sum(b.stop - b.start for b in plan.blocks) / 2  # a stage's, on average
        priced_pair = statistics.mean(s.forward_s + s.backward_s for s in plan.stage_plans)
        # twice the repeats: a difference of steps of tens of milliseconds, each spread
        # by a third on a loaded machine
        _, _, per_call = _paired_recorded(calls[0], calls[1], 2 * repeats)
        events = [e for got in per_call for e in got]
        # each rank recorded its own stage's actions, and its transfers: a 2-stage
        # pipeline's forward and backward make one each between them
        recorded = [r for r in world.gather_objects(_action_pair(events)) if r[0] > 0]
        pairs = [pair for pair, _, _ in recorded]
        sends += [send for _, send, _ in recorded if send > 0]
        receives += [receive for _, _, receive in recorded if receive > 0]
        per_action.append((statistics.mean(pairs) - priced_pair) / 2 if pairs else 0.0)
        ops_per_stage.append(ops)
        # zero-bubble's B and W actions at the longer pipeline's microbatches (its step
        # is not timed: the actions as they ran are what is read), each recorded in turn
        # with 1F1B's at the same microbatches (a slow spell
        # between the two went into the split's cost: its share came out 0-0.5 over five
        # calibrations recorded one after the other, 2026-11-30); at the deepest also at
        # the fewer, larger microbatches: what splitting a backward costs per second of
        # it, apart from per weight op (`_fit_split_costs`)
        for k in (1, 0) if depth == _ACTION_DEPTHS[-1] else (1,):
            split, fused = _alternated_recorded(staged_call((few, many)[k], "zb"), calls[k],
                                                repeats)
            zb_runs.append((split, fused,
                            dataclasses.replace(pins[k], schedule=ScheduleChoice("zb")),
                            priced))
        # interleaved, 2 chunks a rank, at the same microbatches: the same ops in twice
        # the actions, so what its forwards and backwards take more than 1F1B's over a
        # microbatch, less what the model has them take more, is 4 actions' own cost
        # (`_extra_action`)
        # the whole 1F1B call at the longer pipeline's microbatches against the same
        # model's data-parallel step, timed in turn (`_whole_calls`): what the stall is
        # fitted to, below
        dp_call = functools.partial(value_and_grad(shard(
            _reference, mesh=Mesh({"dp": n}), in_specs=(None, P("dp")))), params, tokens)
        # (the reference's blocks, planned once: the data-parallel and the interleaved
        # pins both cut the same blocks)
        dp_blocks = len(auto(_reference, mesh=abstract_mesh(n), hardware=bare,
                             plan=Pin(stages=1)).plan(params, tokens).blocks)
        dp_pin = _dp_pin(n, dp_blocks)
        int_pin, int_call = _interleaved(params, tokens, n, hw, dp_blocks)
        t_dp, t_pipe, t_int = _whole_calls([dp_call, calls[1], int_call], repeats)
        anchors.append((params, (pins[1], int_pin), dp_pin, (t_pipe / t_dp, t_int / t_dp)))
        if pairs:
            per_extra_action.append(_extra_action(
                params, tokens, n, int_pin, int_call, actions_only, repeats,
                one_f_one_b_total=2 * statistics.mean(pairs),
                priced_total=sum(s.forward_s + s.backward_s for s in plan.stage_plans)))
    # per action: what the interleaved pipelines' extra actions cost; per op: the rest of
    # what the 1F1B actions took beyond their prices, over their ops
    action = max(0.0, statistics.mean(per_extra_action)) if per_extra_action else 0.0
    per_op = max(0.0, statistics.mean((r - action) / o for r, o in
                                      zip(per_action, ops_per_stage) if o > 0))
    send = statistics.mean(sends) if sends else 0.0
    receive = statistics.mean(receives) if receives else 0.0
    fitted = dataclasses.replace(hw, action_overhead_s=action, op_action_overhead_s=per_op,
                                 send_overhead_s=send, receive_overhead_s=receive)
    # per stage and recording: (what its zero-bubble B + W took beyond 1F1B's fused B and
    # one more action's cost, its weight ops, its backward's seconds in the model), the
    # last two read off the model as each cost moves
    split_rows = []
    for events, fused, zb_pin, priced in zb_runs:
        at = [dataclasses.replace(fitted, weight_op_overhead_s=op, split_backward_share=share)
              for op, share in ((0.0, 0.0), (1e-3, 0.0), (0.0, 1e-3))]
        stages = [priced(h, zb_pin).stage_plans for h in at]
        # (stage, the recorded B + W's mean, the recorded fused B's mean) of each rank
        for stage, split, whole in world.gather_objects(_split_and_fused(events, fused)):
            if stage is None:
                continue
            ops = (stages[1][stage].weight_s - stages[0][stage].weight_s) / 1e-3
            backward = (stages[2][stage].backward_s - stages[0][stage].backward_s) / 1e-3
            if ops > 0.5:
                split_rows.append((split - whole - action, ops, backward))
    weight_op, split_share = _fit_split_costs(split_rows)
    # the stall and the delay on waits, in a fixed split (`_STALL_SHARE`): per depth and
    # pipeline (1F1B, interleaved), what makes the model's whole call its measured share
    # of the data-parallel step's (that step priced as the model prices it), averaged
    final = dataclasses.replace(fitted, weight_op_overhead_s=weight_op,
                                split_backward_share=split_share)
    levels = []
    for params, (one_pin, int_pin), dp_pin, ratios in anchors:
        dp_s = _priced_pipeline(final, dp_pin, params, tokens, n, fn=_reference).step_time_s
        for pin, fn, ratio in ((one_pin, _staged, ratios[0]), (int_pin, _reference, ratios[1])):
            def priced_call(level: float, params: Any = params, pin: Pin = pin,
                            fn: Callable[..., Any] = fn) -> float:
                stall, delay = transfer_costs(level)
                profile = dataclasses.replace(final, receive_stall_s=stall,
                                              transfer_overhead_s=delay)
                return float(_priced_pipeline(profile, pin, params, tokens, n,
                                              fn=fn).step_time_s)

            levels.append(fit_to_call(priced_call, ratio * dp_s))
    stall, delay = transfer_costs(statistics.mean(levels))
    return action, per_op, stall, delay, (weight_op, split_share), send, receive


def _fit_split_costs(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """(`weight_op_overhead_s`, `split_backward_share`) >= 0 from recorded pipelines: per
    row (one stage at one microbatch size), (what zero-bubble's B and W of a microbatch
    took beyond 1F1B's fused B of the same stage and one more action's cost, the stage's
    weight ops, its backward's seconds as the model prices them), fitted by least squares
    as `ops x per_op + share x backward`; where the rows cannot tell the two apart (one
    size only) or the fit makes one negative, that one is 0 and the other is fitted alone.

    Why a share: the split backward's extra grows with its work, not only with the weight
    ops' autograd calls. Two layers of the reference transformer in one process, split as
    the executor splits them, took 1.27-1.35 times the fused backward at 64-512 tokens; in
    GPT small's 2-stage pipelines (the same stages under both schedules, 2026-11-30) B + W
    took 1.27-1.42 times 1F1B's B at 2 sequences a microbatch and 1.29-1.32 at 8, priced
    1.2 and 1.08 times with a cost per weight op alone: zero-bubble came out 8-17 points
    under 1F1B in every accuracy run of the twenty-ninth to thirty-third sessions, and the
    search took it over 1F1B at 2 microbatches, where it measured 0.98 times 1F1B's step
    and was priced 0.88.

    Example:
        >>> # 50 us per weight op and a fifth of the backward, at two sizes
        >>> rows = [(12 * 50e-6 + 0.2 * b, 12, b) for b in (2e-3, 9e-3)]
        >>> [round(x, 6) for x in _fit_split_costs(rows)]
        [5e-05, 0.2]
        >>> [round(x, 6) for x in _fit_split_costs([(1.2e-3, 12, 2e-3)])]  # one size
        [0.0001, 0.0]
        >>> _fit_split_costs([(5e-3, 12, 2e-3), (20e-3, 13, 9e-3)])[1]  # held up: capped
        1.0
    """
    if not rows:
        return 0.0, 0.0
    extra = [r[0] for r in rows]
    ops = [r[1] for r in rows]
    backward = [r[2] for r in rows]
    per_op_alone = max(0.0, _through_origin(ops, extra))
    x = np.asarray([ops, backward], dtype=float).T
    gram = x.T @ x
    # (rows whose backward is in proportion to their ops cannot part the two)
    if len(rows) < 2 or abs(float(np.linalg.det(gram))) <= 1e-9 * float(gram.trace()) ** 2:
        return per_op_alone, 0.0
    per_op, share = (float(v) for v in np.linalg.solve(gram, x.T @ np.asarray(extra)))
    if share < 0:
        return per_op_alone, 0.0
    if per_op < 0:
        return 0.0, min(_MAX_SPLIT_SHARE, max(0.0, _through_origin(backward, extra)))
    return per_op, min(_MAX_SPLIT_SHARE, share)


_MAX_SPLIT_SHARE = 1.0
"""The most `_fit_split_costs` takes splitting a backward to cost per second of it: B and
W do the fused backward's arithmetic, so their extra is autograd's calls and the
operands read twice; a share above 1 (the split twice as slow as the whole) is a
recording the machine held up, not the split (measured 0.05-0.42 on four hosts)."""


_STALL_SHARE = 0.25
"""Of what a pipeline transfer costs the receiving rank beyond its receive, the share
charged on every receive (`Hardware.receive_stall_s`); the rest only where the receiving
action waits for it (`transfer_overhead_s`). 1F1B waits at nearly every receive, an
interleaved schedule (three receives per microbatch and rank on 2 ranks, where 1F1B has
one) at few, zero-bubble and the shifted schedule hide waits in their slack. Fitted apart
from the reference's 1F1B and interleaved calls (five calibrations, 2026-11-29), the two
traded: 0 and 789 us, 102 and 71, 345 and 163 (median split about 1 : 5). With the split
fixed at a cost of 1.5 ms per transfer, four accuracy runs' representative profiles
repriced put GPT small's four 8-microbatch pipelines within 2.7-5.6 points of one
another at 1 : 3 (2.7-8.9 at 2 ms), 2.6-12.2 at 1 : 1; with the stall alone (one
run's profile, fitted to 1F1B's whole call) 20 points apart, interleaved the
highest."""


def transfer_costs(level: float) -> tuple[float, float]:
    """(`Hardware.receive_stall_s`, `transfer_overhead_s`) for a receiver's cost `level`
    per transfer, split by `_STALL_SHARE`.

    Example:
        >>> transfer_costs(1e-3)
        (0.00025, 0.00075)
    """
    return _STALL_SHARE * level, (1.0 - _STALL_SHARE) * level


def _whole_calls(calls: Sequence[Callable[[], Any]], repeats: int) -> list[float]:
    """Per call of `calls`, the median seconds of `2 x repeats` timed runs: in each of
    `repeats` rounds, each call in turn runs once untimed and then twice timed (each
    after a barrier). In turn, so that a drift in the machine's load falls on all of
    them alike; after an untimed run, as a training loop runs a step after the same step
    (a data-parallel GPT step right after a pipeline's ran 12-15 % slower than after
    itself, 2026-11-29)."""
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for k, call in enumerate(calls):
            call()
            times[k] += [timed_call(call), timed_call(call)]
    return [statistics.median(t) for t in times]


def fit_to_call(price: Callable[[float], float], target: float,
                tolerance: float = 1e-8) -> float:
    """The cost at which `price` (a pipeline step's predicted seconds at a given cost;
    non-decreasing in it) reaches `target` seconds: 0 where it is there without one; else
    bisected to `tolerance` seconds: the cost per pipeline transfer (`transfer_costs`: a
    stall on every receive and a delay on the waits) of `_action_costs`, and of
    `benchmarks/pipeline.py`'s cost-model column.

    Example (a step of 10 ms and 20 receives on its critical path):
        >>> round(fit_to_call(lambda s: 0.010 + 20 * s, 0.016) * 1e6, 1)
        300.0
    """
    if price(0.0) >= target:
        return 0.0
    low, high = 0.0, 1e-3
    while price(high) < target:  # the price grows with the stall: the target is reached
        low, high = high, 2 * high
        if high > 10.0:  # not by any stall a step could have
            return high
    while high - low > tolerance:
        mid = (low + high) / 2
        if price(mid) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


def _interleaved(params: dict[str, Any], tokens: torch.Tensor, n: int, hw: Hardware,
                 blocks: int) -> tuple[Pin, Callable[[], Any]]:
    """(its pin, one `value_and_grad` call of it): the reference transformer (`params`,
    `blocks` blocks as `auto` cuts it) under `auto` as a 2-rank interleaved pipeline with
    2 chunks a rank (data parallel over the rest of the `n` ranks) at `tokens`'s
    `_ACTION_MICROBATCHES[1]` microbatches, planned with `hw`."""
    roles = (("outer", "dp"),) if n > 2 else ()
    pin = Pin(stages=2, outer=n // 2, inner=1, microbatches=_ACTION_MICROBATCHES[1],
              schedule=ScheduleChoice("interleaved", 2),
              block_options=(Option(roles, False),) * blocks)
    step = auto(_reference, mesh=n, hardware=hw, memory_margin=0.0, plan=pin)
    dparams, _ = step.distribute(params, tokens)
    return pin, functools.partial(value_and_grad(step), dparams, tokens)


def _extra_action(params: dict[str, Any], tokens: torch.Tensor, n: int, pin: Pin,
                  call: Callable[[], Any], actions_only: Hardware, repeats: int,
                  one_f_one_b_total: float, priced_total: float) -> float:
    """Seconds of one pipeline action's own cost (`Hardware.action_overhead_s`): the
    reference transformer (`params`) as a 2-rank interleaved pipeline with 2 chunks a
    rank (`_interleaved`: its `pin` and `call`), its actions recorded. Its forwards' and
    backwards' means summed over the chunks (over the ranks, each holding half of them)
    less `one_f_one_b_total` (the same over the 1F1B pipeline's 2 stages), less what the
    model (`actions_only`: without the per-action costs) prices that difference at
    (against `priced_total`), over the 4 actions more per microbatch.

    Until 2026-11-29 the per-action cost was the intercept of a line through the 1F1B
    actions' costs at 1 and 2 layers a stage: it came out 0 (clamped) or near it, the
    per-op cost took it all, and interleaved plans, whose chunks make twice the actions
    over the same ops, came out 8-12 % under (GPT small's chunk forwards ran 0.3-0.6 ms
    over their prices)."""
    priced = _priced_pipeline(actions_only, pin, params, tokens, n, fn=_reference)
    model = sum(s.forward_s + s.backward_s for s in priced.stage_plans) - priced_total
    calls = _recorded(call, repeats)
    mine = _chunk_sum([e for got in calls for e in got])
    sums = [x for x in world.gather_objects(mine) if x > 0]
    if not sums:
        return 0.0
    measured = 2 * statistics.mean(sums) - one_f_one_b_total  # each rank: half the chunks
    return (measured - model) / 4


def _chunk_sum(events: Sequence[tuple[Any, float, float]]) -> float:
    """Over the stages this rank ran, the sum of each one's mean F and mean B (seconds of
    a microbatch's forward and backward through them); 0 without both."""
    kinds: dict[tuple[int, str], list[float]] = {}
    for a, start, end in events:
        if a.kind in ("F", "B"):
            kinds.setdefault((a.stage, a.kind), []).append(end - start)
    stages = {stage for stage, _ in kinds}
    if not stages or any((s, k) not in kinds for s in stages for k in "FB"):
        return 0.0
    return sum(statistics.mean(t) for t in kinds.values())


def _recorded(call: Callable[[], Any], repeats: int) -> list[list[tuple[Any, float, float]]]:
    """The pipeline actions this rank ran in each of `repeats` calls of `call`, each after
    a barrier, after two unrecorded calls."""
    for _ in range(2):
        call()
    calls: list[list[tuple[Any, float, float]]] = []
    for _ in range(repeats):
        world.barrier()
        with recording() as got:
            call()
        calls.append(got)
    return calls


def _alternated_recorded(first: Callable[[], Any], second: Callable[[], Any], repeats: int
                         ) -> tuple[list[tuple[Any, float, float]],
                                    list[tuple[Any, float, float]]]:
    """The pipeline actions this rank ran in `repeats` calls of each of `first` and
    `second`, called in turn (each after a barrier, after two unrecorded calls of each):
    a drift of the machine falls on both alike."""
    for _ in range(2):
        first()
        second()
    got: tuple[list[tuple[Any, float, float]], list[tuple[Any, float, float]]] = ([], [])
    for _ in range(repeats):
        for out, call in zip(got, (first, second)):
            world.barrier()
            with recording() as events:
                call()
            out.extend(events)
    return got


def _median_weight(events: Sequence[tuple[Any, float, float]]) -> tuple[int | None, float]:
    """(the stage, the median seconds) of the W actions among `events` (one stage's: a
    rank of a 2-stage pipeline); (None, 0.0) without any."""
    seconds = [end - start for a, start, end in events if a.kind == "W"]
    if not seconds:
        return None, 0.0
    return next(a.stage for a, _, _ in events if a.kind == "W"), statistics.median(seconds)


def _split_and_fused(split: Sequence[tuple[Any, float, float]],
                     fused: Sequence[tuple[Any, float, float]]
                     ) -> tuple[int | None, float, float]:
    """(the stage, the median seconds of a microbatch's B and W, of its fused B) of one
    stage's actions recorded under zero-bubble (`split`) and under 1F1B (`fused`); (None,
    0, 0) unless both have them.

    Medians, not means: an action the machine held up (a rank preempted on 2 cores) is
    tens of milliseconds among actions of one to eight, and a few of them in one schedule's
    recording and not the other's made the split's share 1.54 in one CI run (0.05-0.42
    elsewhere)."""
    stage, w = _median_weight(split)
    b = [end - start for a, start, end in split if a.kind == "B"]
    whole = [end - start for a, start, end in fused if a.kind == "B" and a.stage == stage]
    if stage is None or not b or not whole:
        return None, 0.0, 0.0
    return stage, statistics.median(b) + w, statistics.median(whole)


def _priced_pipeline(profile: Hardware, pin: Pin, params: Any, tokens: torch.Tensor,
                     n: int, fn: Callable[..., Any] = _staged) -> Any:
    """`fn`'s plan for `pin` on `n` devices, priced with `profile`."""
    return auto(fn, mesh=abstract_mesh(n), hardware=profile, memory_margin=0.0,
                plan=pin).plan(params, tokens)


def _action_pair(events: Sequence[tuple[Any, float, float]]
                 ) -> tuple[float, float, float]:
    """(seconds of one microbatch's forward and backward on this rank, as recorded: the
    mean F and B; its sends' mean (`SF`, `SB`: on the rank's thread); its receives' lower
    quartile (`RF`, `RB`: a receive's own cost where the data had come; the rest is
    waiting, the schedule's and the transfers')); zeros without both F and B, a zero
    for a kind of transfer the rank made none of."""
    kinds: dict[str, list[float]] = {}
    for a, start, end in events:
        kinds.setdefault(a.kind, []).append(end - start)
    if "F" not in kinds or "B" not in kinds:
        return 0.0, 0.0, 0.0
    pair = statistics.mean(kinds["F"]) + statistics.mean(kinds["B"])
    sends = [t for kind in ("SF", "SB") for t in kinds.get(kind, ())]
    receives = [t for kind in ("RF", "RB") for t in kinds.get(kind, ())]
    send = statistics.mean(sends) if sends else 0.0
    receive = (statistics.quantiles(receives, n=4)[0] if len(receives) > 1 else
               receives[0] if receives else 0.0)
    return pair, send, receive


_ACTION_MICROBATCHES = (2, 16)
"""The microbatch counts `_action_costs` compares: the wider apart, the more actions the
costs are read from (2 and 8 gave 0-24 us per op over six calibrations in a row)."""

_ACTION_DEPTHS = (2, 4)
"""The reference transformer's layer counts `_action_costs` pipelines: 1 and 2 per stage."""


def _tiny_layers(ws: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Residual layers of a tiny matmul and a tanh (`_recompute_region`'s program)."""
    for w in ws:
        x = x + torch.tanh(x @ w)
    return x.sum()


_REGION_LAYERS = 16


def _recompute_region(hw: Hardware, gen: torch.Generator, repeats: int) -> float:
    """`recompute_overhead_s` (module doc): `_tiny_layers` with `_REGION_LAYERS` layers,
    data parallel over the world, every block recomputed against none (planned and run by
    `auto`, paired); the measured difference less the one the cost model predicts (the
    recomputed ops), over the recompute regions (one per recomputed block). The layers'
    ops are tiny, so what is left is the checkpoint's own cost: 0.15 ms per region for
    torch's checkpoint alone here, against 10 us for the ops it recomputes."""
    n = world.size()
    device = default_device()
    ws = _on([torch.randn(_WIDTH, _WIDTH, generator=gen) / _WIDTH
              for _ in range(_REGION_LAYERS)], device)
    x = _on(torch.randn(2 * n, _WIDTH, generator=gen), device)
    roles = (("outer", "dp"),) if n > 1 else ()
    blocks = len(auto(_tiny_layers, mesh=abstract_mesh(n), hardware=hw).plan(ws, x).blocks)
    calls, predicted, regions = [], [], 0
    for redo in (False, True):
        pin = Pin(stages=1, outer=n, inner=1, microbatches=1,
                  block_options=(Option(roles, redo),) * blocks)
        step = auto(_tiny_layers, mesh=n, hardware=hw, memory_margin=0.0, plan=pin)
        plan = step.plan(ws, x)
        predicted.append(plan.step_time_s)
        regions = sum(b.recompute for b in plan.blocks)
        args = step.distribute(ws, x)
        calls.append(functools.partial(value_and_grad(step), *args))
    if not regions:
        return 0.0
    _, longer = _paired(calls[0], calls[1], repeats)
    return max(0.0, (longer - (predicted[1] - predicted[0])) / regions)


# (sequences, tokens) of `_relayout_costs`' reference steps: at 8 sequences its compute
# between conversions is short (10 runs after more than `RELAYOUT_GAP_S`); at 16, 14 runs
# about 1.4 ms of compute apart, near a tensor-parallel GPT small step's 2.1
_RELAYOUT_SIZE = (16, 64)


def with_relayout_gap(hw: Hardware, n: int) -> Hardware:
    """`hw` (a profile measured on `n` ranks before the forty-second session, its
    `relayout_wait_share` fitted in proportion to any compute) with the
    `relayout_gap_s` its calibration would now record: the mean compute before a run of
    a conversion's collectives in the steps the share is fitted on (the reference
    transformer at `_RELAYOUT_SIZE` per pair of ranks, tensor and sequence parallel over
    pairs), as the cost model prices them (their total, the price's derivative in the
    share, over their count, its derivative in `relayout_overhead_s`), and its share
    moved so that those steps keep their prices (`_relayout_costs` fits both on new
    profiles). Unchanged where it has a gap, no share, an odd world or no plan.
    `benchmarks/accuracy.py --reprice` prices saved runs with it.

    Example:
        >>> round(with_relayout_gap(profile, 2).relayout_gap_s * 1e3, 2)  # ms
        1.41
    """
    if hw.relayout_wait_share <= 0 or hw.relayout_gap_s > 0:
        return hw
    steps = _relayout_steps(hw, n, torch.Generator().manual_seed(0))
    if steps is None or steps.gap <= 0:
        return hw
    gaps = sum(steps.gaps)
    weighed = sum(steps.weighed(steps.gap))
    share = hw.relayout_wait_share * gaps / weighed if weighed > 0 else hw.relayout_wait_share
    return dataclasses.replace(hw, relayout_gap_s=steps.gap,
                               relayout_wait_share=round(share, 12))


@dataclasses.dataclass(frozen=True)
class _RelayoutSteps:
    """The reference transformer's steps `relayout_wait_share` is fitted on, on `n` ranks
    (`_relayout_steps`): per step its pin (tensor, then sequence parallel over pairs) and
    a function pricing it with `bare`'s conversion costs replaced by those given; per
    step the model's price without them (`bases`), its compute before runs of
    conversions (`gaps`: the price's derivative in the share) and their count (its
    derivative in a cost per run); and their mean compute before a run (`gap`, 0 with
    none)."""

    pins: tuple[Pin, ...]
    priced: tuple[Callable[..., float], ...]
    params: Any
    tokens: torch.Tensor
    bare: Hardware
    bases: tuple[float, ...]
    gaps: tuple[float, ...]
    gap: float

    def weighed(self, gap: float) -> list[float]:
        """Per step, its compute before runs as the share weighs it with `gap` as
        `Hardware.relayout_gap_s` (`Hardware.relayout_wait_s`)."""
        return [(priced(relayout_wait_share=1e-3, relayout_gap_s=gap) - base) / 1e-3
                for priced, base in zip(self.priced, self.bases)]


def _relayout_steps(hw: Hardware, n: int, gen: torch.Generator) -> _RelayoutSteps | None:
    """`_RelayoutSteps` for `_relayout_costs` and `with_relayout_gap` on `n` ranks, with
    `hw`'s numbers but for its conversion costs; None on an odd world or without a
    plan."""
    if n % 2:
        return None  # (tensor parallel pairs need an even world)
    device = default_device()
    _, _, vocab, _ = _reference_shape(device)
    rows, seq = _RELAYOUT_SIZE
    params = _reference_params(gen, device)
    # tensor parallel over pairs of ranks (the reference's 4 heads split no further),
    # data parallel across the pairs: each pair runs `rows` sequences, as 2 ranks do
    tokens = _on(torch.randint(0, vocab, (rows * n // 2, seq), generator=gen), device)
    mesh = abstract_mesh(n)
    bare = dataclasses.replace(hw, relayout_overhead_s=0.0, relayout_wait_share=0.0,
                               relayout_gap_s=0.0)
    try:
        blocks = len(auto(_reference, mesh=mesh, hardware=bare).plan(params, tokens).blocks)
    except SearchError:  # (every rank alike: planning is deterministic)
        return None
    pins = tuple(_pairs_pin(n, blocks, role) for role in ("tp", "sp"))
    pricers = []
    for pin in pins:

        def priced(pin: Pin = pin, **costs: Any) -> float:
            return auto(_reference, mesh=mesh, hardware=dataclasses.replace(bare, **costs),
                        memory_margin=0.0, plan=pin).plan(params, tokens).step_time_s

        pricers.append(priced)
    try:
        bases = [priced() for priced in pricers]
        gaps = [(priced(relayout_wait_share=1e-3) - base) / 1e-3
                for priced, base in zip(pricers, bases)]
        runs = sum((priced(relayout_overhead_s=1e-3) - base) / 1e-3
                   for priced, base in zip(pricers, bases))
    except SearchError:
        return None
    gap = round(sum(gaps) / runs, 12) if runs > 0 and sum(gaps) > 0 else 0.0
    return _RelayoutSteps(pins, tuple(pricers), params, tokens, bare, tuple(bases),
                          tuple(gaps), gap)


def _relayout_costs(hw: Hardware, gen: torch.Generator, repeats: int
                    ) -> tuple[float, float]:
    """(`relayout_wait_share`, `relayout_gap_s`) (module doc), with the all-to-alls at
    `hw`'s share of the per-collective cost (`runtime_costs` sets it from the comm tables first,
    `all_to_all_share`): the reference transformer at `_RELAYOUT_SIZE` per pair of
    ranks, every block tensor parallel over pairs (data parallel across them), and the
    same with sequence parallelism between blocks, each paired with a pair's sequences on
    one device per rank (every rank at once); each sharded step, scaled by the one
    device's price over its measured time, less the cost model's price without the share
    (the all-to-alls at theirs) is the share times the compute before its runs of
    collectives after compute (the derivative of the prediction in the share), fitted
    over both steps (`fit_wait_share`); beyond the steps' mean compute before a run
    (`Hardware.relayout_gap_s`) a run's cost grows as the square root of its compute
    (`Hardware.relayout_wait_s`), and the share is fitted with that mean in place. (0 and
    0 on an odd world or without a plan.)

    Until 2026-11-29 this was `relayout_overhead_s`, one cost per run, timed on the tensor
    parallel step alone; it is now left at 0. The reference's cost per run grew with the
    compute between its conversions (on this project's 2-core machine 0.5-0.8, 1.3-1.4,
    1.6-2.7 and 3.8-4.5 ms per run at 8, 16, 32 and 64 sequences, 0.9-4.7 ms of compute
    apart; in another calibration over-priced by 0.5 ms a run at 8 sequences and under by
    1.1 at 64), so a figure taken at one size flipped between 0 and 1 ms from one
    calibration to the next. One cost per run priced tensor parallelism 6 points under
    data parallelism's error on average over the last nine runs of
    `benchmarks/accuracy.py`, and raising it priced sequence parallelism over by as much.
    Until the twenty-fourth session (2026-11-29) the two residues were solved for both
    numbers; the all-to-alls' share came out anywhere in 0-1.65 (`all_to_all_share`),
    and until the twenty-fifth this function passed the tables' share through beside
    its own."""
    n = world.size()
    steps = _relayout_steps(hw, n, gen)
    if steps is None:
        return 0.0, 0.0
    params, tokens, bare = steps.params, steps.tokens, steps.bare
    rows = _RELAYOUT_SIZE[0]
    # the same work on one device per rank: a pair's sequences
    alone = auto(_reference, mesh=abstract_mesh(1), hardware=bare,
                 memory_margin=0.0).plan(params, tokens[:rows]).step_time_s
    one_device = functools.partial(value_and_grad(_reference), params, tokens[:rows])
    residues = []
    for pin, base in zip(steps.pins, steps.bases):
        step = auto(_reference, mesh=n, hardware=bare, memory_margin=0.0, plan=pin)
        sharded = functools.partial(value_and_grad(step), *step.distribute(params, tokens))
        # a run costs about a millisecond, noisy from one pair to the next: thrice the
        # repeats. The sharded step at the speed the profile's op times were fitted at:
        # the one device's step, timed beside it, says how far the machine has moved
        # since. The difference of the two steps, as until the thirty-second session,
        # took a drift for a conversion cost: 6 fits in a row on one profile (2026-11-30)
        # gave 0, 0, 0, 0.29, 0.46 and 0.18, the last three where the one device ran
        # 25-30 % over its price; scaled, all six were 0
        scaled = _at_fitted_speed(*_paired(one_device, sharded, 3 * repeats), alone)
        residues.append(scaled - base)
    # each step's compute as the share weighs it with the steps' mean compute before a
    # run in place (`Hardware.relayout_wait_s`)
    fitted = fit_wait_share(list(zip(residues, steps.weighed(steps.gap))))
    return carried_wait_share(fitted), steps.gap


WAIT_SHARE_CARRIED = 0.6
"""The part of the share fitted on the reference's pairs that a model's conversions are
priced with (`carried_wait_share`)."""


def carried_wait_share(reference_share: float) -> float:
    """`Hardware.relayout_wait_share` for the profile: `WAIT_SHARE_CARRIED` of the share
    fitted on the reference's tensor- and sequence-parallel pairs (`fit_wait_share`).

    The reference's residue is everything its sharded steps cost beyond the model, and the
    share carries all of it to other models. Over the 20 saved runs of
    `benchmarks/accuracy.py` since the thirty-seventh session (four GPT shapes, three
    hosts; 2026-12-02, the forty-fourth session), the GPT's tensor- and sequence-parallel
    plans came out 4-6 points over their run's median error, and the more so the larger
    the share a run's calibrations fitted (0.12-1.04): their error less the run's median
    grew by 0.54 per unit of the step the conversions' waits took, so about half of what
    the share priced was not paid. Least squares over all 240 pinned plans, one intercept
    per run, put the share's scale at 0.61 (each run left out in turn: 0.59-0.64), and
    0.6 of the share took 201 of them within 10 % to 211 (9 runs with every plan within
    10 %, from 6); none of the collectives' other costs (per collective, comm tables,
    sync wait) explained as much. The reference's own pairs are priced under by as much:
    the share is for the user's model, not the reference.

    Example:
        >>> carried_wait_share(0.5)
        0.3
    """
    return round(reference_share * WAIT_SHARE_CARRIED, 12)


def all_to_all_share(hw: Hardware, n: int) -> float:
    """`Hardware.all_to_all_share` on `n` ranks: an all-to-all's time over an
    all-reduce's in `hw`'s comm tables for a message of 1 KiB per rank (their latencies:
    an all-to-all between two ranks is one exchange, a ring all-reduce two), 1 on one rank.

    What a collective costs in a step beyond its table is mostly waiting for and waking
    the ranks (on torch's fake process group, which returns at once, little of
    `collective_overhead_s` is left), and a collective of fewer rounds waits fewer times.
    Fitted instead from the two reference steps' residues (until the twenty-fourth
    session), the share came out 0.00-1.65 over 35 calibrations of one day (median 0.61;
    16 of them below 0.3 or over 1.0), uncorrelated with this ratio (-0.14), and a
    calibration with free all-to-alls put a block of the searched plan under sequence
    parallelism; this ratio came out 0.37-0.84 over the same calibrations (median 0.52).
    In a sequence-parallel GPT step on 2 gloo ranks the all-to-alls cost 0.5-0.6 ms
    beyond the comm table against 1.5-2.7 ms for its all-reduces (2026-11-29).

    Example (the alpha-beta model of a preset: n - 1 latencies against 2(n - 1)):
        >>> from pxform.cost.hardware import hardware
        >>> all_to_all_share(hardware("a100-80gb"), 8)
        0.5
    """
    if n < 2:
        return 1.0
    level = hw.level(n)
    local = 1024.0
    all_reduce = hw.comm_time("all_reduce", sent_bytes("all_reduce", local, n), n, level)
    if all_reduce <= 0:
        return 1.0  # (a profile whose all-reduces cost nothing tells no share)
    all_to_all = hw.comm_time("all_to_all", sent_bytes("all_to_all", local, n), n, level)
    return round(all_to_all / all_reduce, 12)


def fit_wait_share(steps: Sequence[tuple[float, float]]) -> float:
    """`Hardware.relayout_wait_share` from steps given as (seconds measured beyond the
    model without the share, the seconds of compute before the step's runs of
    collectives after compute): least squares through the origin, kept >= 0 (0 without
    compute before any run).

    Example (0.4 s a second of compute, measured on two steps):
        >>> fit_wait_share([(0.4 * 0.02, 0.02), (0.4 * 0.018, 0.018)])
        0.4
    """
    gaps = [g for _, g in steps]
    if not any(g > 0 for g in gaps):
        return 0.0
    return round(max(0.0, _through_origin(gaps, [r for r, _ in steps])), 12)


def _paired(short: Callable[[], Any], long: Callable[[], Any], repeats: int
            ) -> tuple[float, float]:
    """(median seconds of `short`, median of `long`'s seconds less `short`'s), the two
    timed alternately `repeats` times, each call after a barrier, after two untimed runs
    of each: a drift in the machine's load falls on both sides of each difference."""
    alone, more, _ = _paired_recorded(short, long, repeats, record=False)
    return alone, more


def _paired_recorded(short: Callable[[], Any], long: Callable[[], Any], repeats: int,
                     record: bool = True
                     ) -> tuple[float, float, list[list[tuple[Any, float, float]]]]:
    """`_paired`, with the pipeline actions this rank ran in each timed call of `long`
    (`pxform.runtime.pipeline.recording`: a clock read per action, microseconds; none
    without `record`)."""
    for _ in range(2):
        short()
        long()
    alone, more = [], []
    calls: list[list[tuple[Any, float, float]]] = []
    for _ in range(repeats):
        a = timed_call(short)
        recorded: contextlib.AbstractContextManager[list[tuple[Any, float, float]]] = \
            recording() if record else contextlib.nullcontext([])
        with recorded as got:
            b = timed_call(long)
        calls.append(got)
        alone.append(a)
        more.append(b - a)
    return statistics.median(alone), statistics.median(more), calls


def timed_call(call: Callable[[], Any]) -> float:
    """Seconds of one `call` on this rank, started after a barrier of the world (when
    there is one) and with the device synchronised before and after (a CUDA step returns
    before its kernels ran).

    Example:
        >>> seconds = timed_call(lambda: step(params, tokens))
    """
    if world.initialized():
        world.barrier()
    device = default_device()  # (a CUDA step returns before its kernels ran)
    synchronize(device)
    start = time.perf_counter()
    call()
    synchronize(device)
    return time.perf_counter() - start
