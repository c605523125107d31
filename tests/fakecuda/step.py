"""One training step of a parallel form with every input a fake CUDA tensor, over a fake
process group, on a CPU-only build (run by `tests/test_fake_cuda.py` in a subprocess:
the shim must load before torch).

    python tests/fakecuda/step.py CASE [CASE ...]

CASE: FORM or FORM:FAULT. FORM: dp, zero3, tp, sp, pp (2-stage 1F1B). Prints one JSON line
per case: the devices of the loss and of every gradient, and the error's type and text if
the step failed. FAULT (the negative cases): `cpu-leak` makes one batch input a CPU tensor;
`runtime-cpu` makes the pipeline executor create its buffers on the CPU, as it did before
it took the inputs' device.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [os.path.dirname(HERE), os.path.join(ROOT, "examples")]

import fakecuda  # noqa: E402

fakecuda.load()

import gpt  # noqa: E402
import optree  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402
from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: E402

import pxform  # noqa: E402
from pxform import P  # noqa: E402

WORLD = 2
# c10d's Python `broadcast` asks the device's compute capability, which needs a real GPU:
# answer as an H100 would (nothing else of the fake device is real either)
torch.cuda.get_device_capability = lambda device=None: (9, 0)


def main(case: str) -> dict:
    import pxform.runtime.pipeline as executor

    form, _, fault = case.partition(":")
    cpu_leak = fault == "cpu-leak"
    kept = executor.runtime_device
    if fault == "runtime-cpu":
        executor.runtime_device = lambda tensors: torch.device("cpu")
    try:
        return _step(form, cpu_leak)
    finally:
        executor.runtime_device = kept


def overlapped_loss(cfg):
    """`gpt.loss_fn` with each block run as 2 batch pieces whose collectives overlap
    (`coshard(overlap=True)`): asynchronous collectives and their waits."""
    block = pxform.coshard(lambda p, x: gpt.block(p, x, cfg), chunks=2, dim=(None, 0),
                           recompute=False, overlap=True)

    def trunk(blocks, x):
        for p in blocks:
            x = block(p, x)
        return x

    def loss(params, batch):
        return gpt.loss_fn(params, batch, cfg, trunk)

    return loss


def _step(form: str, cpu_leak: bool) -> dict:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    cfg = gpt.GPTConfig(vocab_size=64, seq_len=16, num_layers=2, num_heads=2, d_model=32,
                        dropout=0.1)

    def loss(params, batch):
        return gpt.loss_fn(params, batch, cfg)

    out: dict = {"form": form, "cpu_leak": cpu_leak}
    # the mesh's process groups and device mesh are made outside fake mode
    mesh = pxform.Mesh({"pp": 2} if form == "pp" else
                       {"dp": 2} if form in ("dp", "zero3", "zero3_bf16") else {"tp": 2},
                       device="cuda")
    with FakeTensorMode():
        params = optree.tree_map(lambda t: t.to("cuda"), gpt.init_params(cfg))
        batch = {k: v.to("cuda") for k, v in gpt.make_batch(cfg, 4).items()}
        if cpu_leak:
            batch["targets"] = batch["targets"].to("cpu")
        if form == "dp":
            step = pxform.shard(loss, mesh=mesh, in_specs=(None, P("dp")))
        elif form in ("zero3", "zero3_bf16"):
            # zero3_bf16: mixed precision, each shard cast before its gather, gradients
            # cast back to float32 before their reduce-scatter
            specs = optree.tree_map(lambda t: P("dp"), params)
            step = pxform.shard(loss, mesh=mesh, in_specs=(specs, P("dp")),
                                precision=pxform.Precision() if form == "zero3_bf16"
                                else None)
        elif form in ("tp", "sp", "tp_overlap"):
            megatron = {"qkv_w": P("tp"), "qkv_b": P("tp"), "fc_w": P("tp"), "fc_b": P("tp"),
                        "proj_w": P(None, "tp"), "out_w": P(None, "tp")}
            specs = {**optree.tree_map(lambda t: None, params), "blocks": [
                {k: megatron.get(k) for k in block} for block in params["blocks"]]}
            batch_spec = P(None, "tp") if form == "sp" else None
            fn = overlapped_loss(cfg) if form == "tp_overlap" else loss
            step = pxform.shard(fn, mesh=mesh, in_specs=(specs, batch_spec))
        else:
            step = pxform.shard(pxform.pipeline(loss, stages=2, microbatches=2,
                                                schedule="1f1b"),
                                mesh=mesh, in_specs=(None, None))
        try:
            value, grads = pxform.value_and_grad(step)(params, batch)
            leaves = [g for g in optree.tree_leaves(grads, none_is_leaf=True)
                      if g is not None]
            locals_ = [g.to_local() if hasattr(g, "to_local") else g for g in leaves]
            out["loss_device"] = str(value.device)
            out["grad_devices"] = sorted({str(g.device) for g in locals_})
            out["num_grads"] = len(locals_)
            out["grad_dtypes"] = sorted({str(g.dtype) for g in locals_})
        except Exception as exc:  # reported, judged by the test
            out["error_type"] = type(exc).__name__
            out["error"] = str(exc)[:2000]
            chain = []
            cause = exc
            while cause is not None:
                chain.append(type(cause).__name__)
                cause = cause.__cause__ or cause.__context__
            out["error_chain"] = chain
            import traceback
            out["where"] = traceback.format_exc()[-3000:]
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print(json.dumps({"case": case, **main(case)}), flush=True)
