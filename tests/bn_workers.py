"""Worker functions for tests/test_batchnorm.py: a small CNN with BatchNorm in training mode
(float64) on a 2-rank gloo world, against real DDP and against one process."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import pxform
from pxform import P

BATCH = 8


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(8, momentum=0.3)
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.cross_entropy(self.fc(h.mean((2, 3))), y)


def setup() -> tuple[Net, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = Net().double().train()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, 3, 6, 6, generator=g, dtype=torch.float64) * 2 + 0.5
    y = torch.randint(0, 5, (BATCH,), generator=g)
    return model, x, y


def one_process(model: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict, dict]:
    """Eager, whole batch: the loss, the gradients and the buffers after the step."""
    ref = copy.deepcopy(model)
    loss = ref(x, y)
    loss.backward()
    return (float(loss.detach()), {k: p.grad for k, p in ref.named_parameters()},
            dict(ref.named_buffers()))


def per_rank_buffers(model: Net, x: torch.Tensor) -> dict:
    """The running statistics after a step whose ranks (2) normalise their own rows: the
    whole batch's mean and unbiased variance of each BatchNorm's input, as those inputs
    are under per-rank normalisation."""
    ref = copy.deepcopy(model)
    seen: dict[str, list[torch.Tensor]] = {}
    for name, bn in ref.named_modules():
        if isinstance(bn, torch.nn.BatchNorm2d):
            bn.register_forward_pre_hook(
                lambda m, a, name=name: seen.setdefault(name, []).append(a[0].detach()))
    with torch.no_grad():
        for rows in (slice(0, BATCH // 2), slice(BATCH // 2, BATCH)):
            ref(x[rows], torch.zeros(BATCH // 2, dtype=torch.long))
    out = dict(model.named_buffers())
    for name, bn in model.named_modules():
        if isinstance(bn, torch.nn.BatchNorm2d):
            whole = torch.cat(seen[name])
            m = bn.momentum
            out[f"{name}.running_mean"] = (1 - m) * bn.running_mean + m * whole.mean((0, 2, 3))
            out[f"{name}.running_var"] = (1 - m) * bn.running_var \
                + m * whole.var((0, 2, 3), correction=1)
            out[f"{name}.num_batches_tracked"] = bn.num_batches_tracked + 1
    return out


def ddp(model: Net, x: torch.Tensor, y: torch.Tensor) -> tuple[float, dict]:
    """Real DDP on this world: each rank its rows, gradients averaged; the loss averaged."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank, world = dist.get_rank(), dist.get_world_size()
    rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    wrapped = DistributedDataParallel(copy.deepcopy(model))
    loss = wrapped(x[rows], y[rows])
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return float(total.detach()) / world, {k: p.grad for k, p in wrapped.module.named_parameters()}


def _errors(loss, grads, buffers, ref_loss, ref_grads, ref_buffers) -> dict:
    grads = pxform.gather(grads)
    return {
        "loss": abs(float(loss) - ref_loss),
        "grad": max(float((grads[k] - g).abs().max()) for k, g in ref_grads.items()),
        "buffers": max(float((pxform.gather(buffers[k]) - b).abs().max())
                       for k, b in ref_buffers.items()),
        "buffer_grads": sorted(k for k in ref_buffers if grads.get(k) is not None),
        "count": int(buffers["bn1.num_batches_tracked"]),
    }


def run(mode: str) -> dict:
    model, x, y = setup()
    fn, params = pxform.module_fn(model)
    params = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in params.items()}

    def loss_fn(params, x, y):
        return fn(params, x, y)

    mesh = pxform.Mesh({"dp": 2})
    _, _, ref_buffers = one_process(model, x, y)
    if mode in ("rank", "sync"):
        if mode == "rank":
            ref_buffers = per_rank_buffers(model, x)
        step = pxform.shard(loss_fn, mesh=mesh, in_specs=(None, P("dp"), P("dp")),
                            sync_batch_norm=mode == "sync")
        held = step.distribute(params, x, y)[0]  # DTensors, copied before the step
        loss, grads = pxform.value_and_grad(step)(params, x, y)
        ref_loss, ref_grads = ddp(model, x, y) if mode == "rank" else \
            one_process(model, x, y)[:2]
        out = _errors(loss, grads, params, ref_loss, ref_grads, ref_buffers)
        # DTensor arguments: each rank's piece of the new statistics is written
        pxform.value_and_grad(step)(held, x, y)
        out["dtensor_buffers"] = max(float((pxform.gather(held[k]) - b).abs().max())
                                     for k, b in ref_buffers.items())
        return out
    if mode == "auto":
        step = pxform.auto(loss_fn, mesh=2, memory_budget="1GiB", hardware="a100-40gb",
                           sync_batch_norm=True)
        config = step.plan(params, x, y).config_text()
        loss, grads = pxform.value_and_grad(step)(params, x, y)
        out = _errors(loss, grads, params, *one_process(model, x, y)[:2], ref_buffers)
        out["config"] = config
        return out
    if mode == "pipeline":
        def staged(params, x, y):
            return fn(params, x, y)
        step = pxform.pipeline(staged, stages=2, microbatches=2)
        try:
            pxform.value_and_grad(step)(params, x, y)
        except pxform.PipelineError as exc:
            return {"error": str(exc)}
        return {"error": None}
    raise ValueError(mode)
