"""Worker functions for tests/test_auto.py: run a plan of `pxform.auto` on every rank of
a gloo world and compare it with the single-process reference (float64)."""

from __future__ import annotations

import os
import sys

import optree
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "examples"))

import gpt  # noqa: E402

import pxform  # noqa: E402
from pxform.search import Pin  # noqa: E402
from pxform.search.pipelines import ScheduleChoice  # noqa: E402
from pxform.search.space import Option  # noqa: E402

CFG = gpt.GPT_CONFIGS["tiny"]
NUM_BLOCKS = 4  # embed, layer 0, layer 1, head


def setup() -> tuple:
    torch.manual_seed(0)
    params = gpt.init_params(CFG, dtype=torch.float64)
    batch = gpt.make_batch(CFG, 8)
    return params, batch, CFG


def pin(stages: int, outer: int, inner: int, microbatches: int,
        roles: tuple[tuple[str, str], ...] | None, recompute: tuple[bool, ...] | None = None,
        schedule: ScheduleChoice | None = None, reshard: tuple[bool, ...] | None = None
        ) -> Pin:
    """A pin of the whole configuration; `roles` for every block (None: searched);
    `schedule` the pipeline's (None: searched); `reshard` per block, ZeRO-3's
    (`Option.reshard`, default True)."""
    options = None
    if roles is not None:
        flags = recompute or (False,) * NUM_BLOCKS
        options = tuple(Option(roles, r, k) for r, k in
                        zip(flags, reshard or (True,) * len(flags)))
    return Pin(stages=stages, outer=outer, inner=inner, microbatches=microbatches,
               block_options=options, schedule=schedule)


def run_plan(the_pin: Pin | None, budget: str = "40GiB") -> dict:
    """Plan, run value_and_grad, and compare with the reference on this rank.

    Gradients of a pipeline come back on the ranks holding the parameter (None
    elsewhere): each rank reports the worst error over the gradients it has, and which
    leaves it has, so the test can check every leaf is covered."""
    import torch.distributed as dist

    params, batch, cfg = setup()
    step = pxform.auto(gpt.loss_fn, mesh=dist.get_world_size(), memory_budget=budget,
                       hardware="a100-40gb", plan=the_pin)
    plan = step.plan(params, batch, cfg)
    loss, grads = pxform.value_and_grad(step)(params, batch, cfg)
    ref_loss, ref_grads = pxform.value_and_grad(gpt.loss_fn)(params, batch, cfg)
    full = pxform.gather(grads)
    mine = optree.tree_leaves(full, none_is_leaf=True)
    ref = optree.tree_leaves(ref_grads)
    paths = optree.tree_paths(ref_grads)
    have = [str(p) for p, g in zip(paths, mine) if g is not None]
    err = max(((g - r).abs().max().item() for g, r in zip(mine, ref) if g is not None),
              default=0.0)
    kinds: dict[str, list[str]] = {}
    actions: list[tuple[int, str]] = []
    if plan.stages > 1:  # what this rank's pipeline runs: the plan's schedule
        pipelined = step.executable(params, batch, cfg).fn
        actions = [(a.stage, a.kind) for a in pipelined.actions()[dist.get_rank() // (
            dist.get_world_size() // plan.stages)] if a is not None and a.is_compute]
    if plan.stages == 1:
        program = step.executable(params, batch, cfg).lower(params, batch, cfg)
        kinds = {"forward": sorted({c.split("(")[0] for c in program.collectives()}),
                 "backward": sorted({c.split("(")[0] for c in program.backward_collectives()})}
    reshard = step.executable(params, batch, cfg).reshard_after_forward
    return {"config": plan.config_text(), "collectives": kinds, "actions": actions,
            "reshard": reshard if isinstance(reshard, bool) else sorted(reshard),
            "stage_of_block": [b.stage for b in plan.blocks],
            "strategies": [b.strategy for b in plan.blocks],
            "loss_err": float((loss - ref_loss).abs()), "grad_err": err, "have": have,
            "num_leaves": len(ref), "fingerprint": plan.fingerprint}


def run_distributed(the_pin: Pin) -> dict:
    """`step.distribute` lays the arguments out per the plan (DTensors where split), and
    calling the plan on them gives the reference loss."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params, batch, cfg = setup()
    step = pxform.auto(gpt.loss_fn, mesh=dist.get_world_size(), memory_budget="40GiB",
                       hardware="a100-40gb", plan=the_pin)
    local = step.distribute(params, batch, cfg)
    placements = {str(p): str(x.placements) for p, x in
                  zip(optree.tree_paths(local[0]), optree.tree_leaves(local[0]))
                  if isinstance(x, DTensor)}
    loss = step(*local)
    ref = gpt.loss_fn(params, batch, cfg)
    return {"placements": placements, "loss_err": float((loss - ref).abs())}


def run_training_api(the_pin: Pin) -> dict:
    """What a training loop relies on: `distribute` copies, `holds` says which leaves
    this rank computes with, gradients of DTensor parameters are DTensors with the same
    placements (None for leaves a pipeline rank does not hold), `measure` and
    `plan.report` give one row per rank."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    params, batch, cfg = setup()
    step = pxform.auto(gpt.loss_fn, mesh=dist.get_world_size(), memory_budget="40GiB",
                       hardware="a100-40gb", plan=the_pin)
    plan = step.plan(params, batch, cfg)
    before = params["wte"].clone()
    dparams = step.distribute(params, batch, cfg)[0]
    with torch.no_grad():
        for leaf in optree.tree_leaves(dparams, is_leaf=lambda x: isinstance(x, DTensor)):
            (leaf.to_local() if isinstance(leaf, DTensor) else leaf).add_(1.0)
    aliased = not torch.equal(params["wte"], before)
    dparams = step.distribute(params, batch, cfg)[0]
    held = step.holds(dparams, batch, cfg)[0]
    _, grads = pxform.value_and_grad(step)(dparams, batch, cfg)
    is_leaf = lambda x: isinstance(x, DTensor)  # noqa: E731
    p_leaves = optree.tree_leaves(dparams, is_leaf=is_leaf)
    g_leaves = optree.tree_leaves(grads, is_leaf=is_leaf, none_is_leaf=True)
    h_leaves = optree.tree_leaves(held)
    mismatched = []
    for k, (p, g, h) in enumerate(zip(p_leaves, g_leaves, h_leaves)):
        ok = (isinstance(g, DTensor) and g.placements == p.placements
              and g.shape == p.shape) if h else g is None
        if not ok:
            mismatched.append((k, h, type(g).__name__))
    owned = [p for p, h in zip(p_leaves, h_leaves) if h]
    opt = torch.optim.AdamW(owned, lr=1e-3)
    for p, g, h in zip(p_leaves, g_leaves, h_leaves):
        if h:
            p.grad = g
    opt.step()
    measured = pxform.measure(step, dparams, batch, cfg, optimizer=opt, steps=2, warmup=1)
    report = plan.report(measured)
    return {"aliased": aliased, "held": sum(h_leaves), "leaves": len(h_leaves),
            "mismatched": mismatched, "ranks": [(r.rank, r.stage) for r in report.ranks],
            "state": [r.state_bytes for r in measured.ranks],
            "peaks": [r.peak_memory_bytes for r in measured.ranks],
            "times": [r.step_time_s for r in measured.ranks], "text": str(report),
            "memory_errors": [r.memory_error for r in report.ranks]}


def run_memory_accuracy(the_pin: Pin, shape: dict | None = None,
                        profile: str | None = None) -> list[float]:
    """GPT "small" (float32, global batch 16), or its config with the fields `shape`
    gives, the pinned plan (planned against the a100-40gb preset, or the saved profile
    at path `profile`) distributed, one AdamW step so the optimizer's state exists, then
    `measure` and `plan.report`: each rank's signed memory error, predicted over
    metered."""
    import dataclasses

    import torch.distributed as dist

    torch.manual_seed(0)
    cfg = dataclasses.replace(gpt.GPT_CONFIGS["small"], **(shape or {}))
    params = gpt.init_params(cfg)
    batch = gpt.make_batch(cfg, 16)
    step = pxform.auto(gpt.loss_fn, mesh=dist.get_world_size(), memory_budget="40GiB",
                       hardware=profile or "a100-40gb", plan=the_pin)
    return metered_memory_errors(step, params, batch, cfg)


def residual_stack(params: dict, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A stack of residual MLP layers on the input itself (no embedding block before
    them), regressed onto one number per row."""
    h = x
    for p in params["layers"]:
        h = h + torch.nn.functional.linear(
            torch.nn.functional.gelu(torch.nn.functional.linear(h, p["w1"])), p["w2"])
    return ((h.mean(-1) - y) ** 2).mean()


def run_stack_memory(pins: dict[str, Pin], layers: int, width: int, rows: int
                     ) -> dict[str, list[float]]:
    """`residual_stack` of `layers` layers of `width`, on `rows` rows, under each pin:
    each rank's signed memory error, predicted over metered (`metered_memory_errors`)."""
    import torch.distributed as dist

    torch.manual_seed(0)
    params = {"layers": [{"w1": torch.randn(4 * width, width) * 0.02,
                          "w2": torch.randn(width, 4 * width) * 0.02} for _ in range(layers)]}
    x, y = torch.randn(rows, width), torch.randn(rows)
    out = {}
    for name, the_pin in pins.items():
        step = pxform.auto(residual_stack, mesh=dist.get_world_size(), memory_budget="40GiB",
                           hardware="a100-40gb", plan=the_pin)
        out[name] = metered_memory_errors(step, params, x, y)
    return out


def metered_memory_errors(step: object, params: object, *rest: object) -> list[float]:
    """`step`'s plan for these arguments, its parameters distributed, one AdamW step so the
    optimizer's state exists, then `measure` and `plan.report`: each rank's signed memory
    error, predicted over metered."""
    from torch.distributed.tensor import DTensor

    plan = step.plan(params, *rest)
    dparams = step.distribute(params, *rest)[0]
    held = optree.tree_leaves(step.holds(dparams, *rest)[0])
    is_leaf = lambda x: isinstance(x, DTensor)  # noqa: E731
    owned = [p for p, h in zip(optree.tree_leaves(dparams, is_leaf=is_leaf), held)
             if h and p.is_floating_point()]  # (an integer buffer takes no optimizer)
    # the optimizer's state for what the step trains: where some parameter is marked
    # requires_grad, only those (frozen ones get no gradient and no state)
    if any(p.requires_grad for p in owned):
        owned = [p for p in owned if p.requires_grad]
    opt = torch.optim.AdamW(owned, lr=1e-3)
    for p in owned:
        p.grad = torch.zeros_like(p)
    opt.step()
    for p in owned:
        p.grad = None
    measured = pxform.measure(step, dparams, *rest, optimizer=opt, steps=1, warmup=0)
    return [r.memory_error for r in plan.report(measured).ranks]


def relayout_costs() -> tuple[float, float, float, float]:
    """`runtime_costs`'s (`relayout_wait_share`, `all_to_all_share`, `relayout_gap_s`) on
    this world, and the share `fit_wait_share` fitted on the reference's pairs (tensor
    and sequence parallel pairs, data parallel across them), on a preset with 2 devices
    per node (as this machine's profile, `cpu-x2`) whose ops take 10,000 times as long
    (so that the model counts runs of collectives after compute and the programs run)."""
    import dataclasses

    from pxform.cost.hardware import hardware
    from pxform.tools import runtime_costs
    from pxform.tools.runtime_costs import _relayout_costs, all_to_all_share

    slow = dataclasses.replace(hardware("a100-80gb"), op_time_scale=1e4, devices_per_node=2)
    # as `runtime_costs` does: the tables' share first, the share per second with it
    a2a = all_to_all_share(slow, torch.distributed.get_world_size())
    fitted: list[float] = []
    fit = runtime_costs.fit_wait_share

    def recorded(steps: list[tuple[float, float]]) -> float:
        fitted.append(fit(steps))
        return fitted[-1]

    runtime_costs.fit_wait_share = recorded
    try:
        wait, gap = _relayout_costs(dataclasses.replace(slow, all_to_all_share=a2a),
                                    torch.Generator().manual_seed(0), 1)
    finally:
        runtime_costs.fit_wait_share = fit
    return wait, a2a, gap, fitted[0]


def run_unfrozen(the_pin: Pin | None) -> dict:
    """Plan with the embeddings frozen, step, unfreeze them (progressive unfreezing), step
    twice more: the pxform warnings each step gave, and the last step's worst gradient
    error against the reference with everything trained (gradients gathered whole)."""
    import warnings

    import torch.distributed as dist

    params, batch, cfg = setup()
    embedding = ("wte", "wpe")
    for leaf in optree.tree_leaves(params):
        leaf.requires_grad_(True)
    for k in embedding:
        params[k].requires_grad_(False)
    step = pxform.auto(gpt.loss_fn, mesh=dist.get_world_size(), memory_budget="40GiB",
                       hardware="a100-40gb", plan=the_pin)
    plan = step.plan(params, batch, cfg)
    texts = []
    grads = None
    for n in range(3):
        if n == 1:
            for k in embedding:
                params[k].requires_grad_(True)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            _, grads = pxform.value_and_grad(step)(params, batch, cfg)
        texts.append([str(w.message) for w in seen
                      if issubclass(w.category, pxform.PxformWarning)])
    plain = optree.tree_map(lambda t: t.detach(), params)
    _, ref_grads = pxform.value_and_grad(gpt.loss_fn)(plain, batch, cfg)
    full = pxform.gather(grads)
    mine = optree.tree_leaves(full, none_is_leaf=True)
    ref = optree.tree_leaves(ref_grads)
    err = max(((g - r).abs().max().item() for g, r in zip(mine, ref) if g is not None),
              default=0.0)
    return {"warnings": texts, "grad_err": err, "config": plan.config_text(),
            "embedding_grads": [full[k] is not None for k in embedding]}
