"""Worker functions for tests/test_hangs.py: an error on one rank ends every rank within
the mesh's timeout, with a message naming the rank, the collective and where it ran."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import pxform
from pxform import P


def asymmetric(timeout_s):
    """Rank 1 fails before the step (a user error only it sees); rank 0 runs the step and
    waits in its first collective until the timeout."""
    mesh = pxform.Mesh({"dp": 2}, timeout=timeout_s)

    def loss(params, batch):
        return ((batch["x"] @ params["w"]) ** 2).mean()

    step = pxform.shard(loss, mesh=mesh, in_specs=(P("dp"), P("dp")))
    params = {"w": torch.ones(4, 4)}
    batch = {"x": torch.ones(8, 4)}
    if dist.get_rank() == 1:
        return {"rank": 1, "error": "rank 1 failed before its step"}
    start = time.monotonic()
    try:
        step(params, batch)
    except pxform.PxformError as exc:
        return {"rank": 0, "error": str(exc), "type": type(exc).__name__,
                "seconds": time.monotonic() - start}
    return {"rank": 0, "error": None}


def asymmetric_pipeline(timeout_s):
    """The same for a 2-stage pipeline: rank 1 fails before the step; rank 0 runs stage 0
    and waits for stage 1's gradient until the mesh's timeout."""
    def loss(params, x):
        h = pxform.stage_boundary(torch.tanh(x @ params["w0"]))
        return (h @ params["w1"]).pow(2).mean()

    shard = pxform.shard(pxform.pipeline(loss, stages=2, microbatches=2),
                         mesh=pxform.Mesh({"pp": 2}, timeout=timeout_s), in_specs=(None, None))
    params = {"w0": torch.ones(4, 4), "w1": torch.ones(4, 2)}
    if dist.get_rank() == 1:
        return {"rank": 1, "error": "rank 1 failed before its step"}
    start = time.monotonic()
    try:
        pxform.value_and_grad(shard)(params, torch.ones(8, 4))
    except pxform.PxformError as exc:
        return {"rank": 0, "error": str(exc), "type": type(exc).__name__,
                "seconds": time.monotonic() - start}
    return {"rank": 0, "error": None}
