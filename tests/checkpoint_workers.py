"""Worker functions for tests/test_checkpoint.py (run on every rank of a 4-rank gloo World),
and the small safetensors writer the tests use."""

from __future__ import annotations

import gc
import json
import struct

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import pxform
from pxform.core.errors import SpecError
from pxform.runtime.checkpoint import load_checkpoint

# ---------------------------------------------------------------- checkpoints


def small_model() -> dict:
    """A 2-layer model as a nested state dict: 64x48 weights, biases (one of 50, which no
    mesh here splits evenly), a 5-row head (uneven, and empty on some ranks) and an int64
    buffer."""
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g)

    return {"layers": {"0": {"w": t(64, 48), "b": t(64)},
                       "1": {"w": t(64, 48), "b": t(50)}},
            "head": {"w": t(5, 48)},
            "steps": torch.arange(7, dtype=torch.int64) * 3}


_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
             torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
             torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_safetensors(path, tensors: dict, metadata: dict | None = None) -> None:
    """The documented format: 8-byte little-endian header length, a JSON header
    {name: {dtype, shape, data_offsets}} padded with spaces to 8 bytes, then the data."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    blobs, offset = [], 0
    for name, t in tensors.items():
        raw = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for raw in blobs:
            f.write(raw)


def flat(state: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in state.items():
        name = f"{prefix}.{k}" if prefix else k
        out.update(flat(v, name) if isinstance(v, dict) else {name: v})
    return out


# ---------------------------------------------------------------- like trees


def like_tree(layout: str) -> dict:
    """Zeros laid out as a plan would, with None where a pipeline rank holds nothing.
    tp: dp2 x tp2, weights split by rows over tp, one bias Partial(sum) over tp.
    zero3: dp4, every float tensor split by rows (uneven ones too)."""
    model = small_model()
    if layout == "tp":
        dm = pxform.Mesh({"dp": 2, "tp": 2}).device_mesh
        rows = [Replicate(), Shard(0)]

        def put(t, placements=rows):
            return distribute_tensor(torch.zeros_like(t), dm, placements)

        partial = DTensor.from_local(torch.zeros(50), dm, [Replicate(), Partial()],
                                     run_check=False)
        return {"layers": [{"w": put(model["layers"]["0"]["w"]).requires_grad_(),
                            "b": put(model["layers"]["0"]["b"])},
                           {"w": None, "b": partial}],
                "head": {"w": put(model["head"]["w"], [Shard(0), Shard(0)])},
                "steps": torch.zeros(7, dtype=torch.int64)}
    dm = pxform.Mesh({"dp": 4}).device_mesh

    def put(t, placements=None):
        return distribute_tensor(torch.zeros_like(t), dm, placements or [Shard(0)])

    return {"layers": [None,
                       {"w": put(model["layers"]["1"]["w"]).requires_grad_(),
                        "b": put(model["layers"]["1"]["b"])}],
            "head": {"w": put(model["head"]["w"])},
            "steps": put(model["steps"], [Replicate()])}


def _leaves(tree: dict, prefix: str = "") -> dict:
    out = {}
    items = enumerate(tree) if isinstance(tree, list) else tree.items()
    for k, v in items:
        name = f"{prefix}.{k}" if prefix else str(k)
        out.update(_leaves(v, name) if isinstance(v, (dict, list)) else {name: v})
    return out


def compare(loaded: dict, like: dict, expected: dict) -> dict:
    """Per leaf path: None for None leaves, else whether the full value equals the
    checkpoint's exactly and the loaded leaf keeps the like leaf's kind, mesh, placements,
    dtype and requires_grad; and whether `like` still holds zeros."""
    out: dict = {}
    got, want = _leaves(loaded), _leaves(like)
    for path, leaf in want.items():
        if leaf is None:
            out[path] = None if got[path] is None else "not None"
            continue
        new = got[path]
        full = new.full_tensor() if isinstance(new, DTensor) else new
        same_kind = isinstance(new, DTensor) == isinstance(leaf, DTensor)
        if isinstance(leaf, DTensor):
            same_kind = same_kind and (new.device_mesh == leaf.device_mesh
                                       and new.placements == leaf.placements
                                       and new.to_local().shape == leaf.to_local().shape)
        out[path] = {"equal": torch.equal(full, expected[path].to(leaf.dtype)),
                     "kind": same_kind and new.dtype == leaf.dtype
                     and new.requires_grad == leaf.requires_grad and new.is_leaf,
                     "like_untouched": not bool(
                         (leaf.to_local() if isinstance(leaf, DTensor) else leaf).any())}
    return out


# ---------------------------------------------------------------- workers


def load(path: str, layout: str, prefix: str = "") -> dict:
    like = like_tree(layout)
    key = (lambda p: prefix + p) if prefix else None
    loaded = load_checkpoint(path, like, key=key)
    return compare(loaded, like, flat(small_model()))


def load_mixed_dtypes(path: str) -> dict:
    """A safetensors file of many dtypes into DTensors: bf16 into a bf16 leaf and into a
    float32 leaf (cast), ints and bools split over dp4."""
    dm = pxform.Mesh({"dp": 4}).device_mesh
    tensors = mixed_dtypes()
    like = {name: distribute_tensor(torch.zeros_like(t), dm, [Shard(0)])
            for name, t in tensors.items()}
    like["bf16_as_f32"] = distribute_tensor(torch.zeros(tensors["bf16"].shape), dm, [Shard(0)])
    loaded = load_checkpoint(path, like, key={"bf16_as_f32": "bf16"})
    expected = dict(tensors, bf16_as_f32=tensors["bf16"].float())
    return compare(loaded, like, expected)


def mixed_dtypes() -> dict:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, 6, generator=g)
    return {"f32": x, "f64": x.double() / 3, "f16": x.half(), "bf16": (x * 7).bfloat16(),
            "i64": torch.arange(54).reshape(9, 6) - 20,
            "i32": torch.arange(10, dtype=torch.int32) * 7, "bool": x > 0}


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory(path: str, n: int, rows: int, cols: int) -> dict:
    """Load n (rows x cols) float32 tensors split by rows over dp4 and measure this
    process's resident-set growth: the high-water mark (VmHWM, reset by writing 5 to
    clear_refs) minus the resident set just before loading."""
    dm = pxform.Mesh({"dp": 4}).device_mesh
    piece = rows // 4
    like = {f"w{i}": DTensor.from_local(torch.zeros(piece, cols), dm, [Shard(0)],
                                        run_check=False, shape=(rows, cols),
                                        stride=(cols, 1))
            for i in range(n)}
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status("VmRSS")
    loaded = load_checkpoint(path, like)
    peak, after = _status("VmHWM"), _status("VmRSS")
    held = sum(v.to_local().numel() * 4 for v in loaded.values())
    # check the pieces against the file (after measuring: this maps the file again)
    rank = torch.distributed.get_rank()
    if path.endswith(".safetensors"):
        from pxform.runtime.checkpoint import _entries
        full = {k: e.open() for k, e in _entries(path, path).items()}
    else:
        full = torch.load(path, mmap=True, weights_only=True)
    ok = all(torch.equal(v.to_local(), full[k][rank * piece:(rank + 1) * piece])
             for k, v in loaded.items())
    return {"before": before, "peak": peak, "growth": peak - before, "after": after - before,
            "held": held, "ok": ok}


def errors(path: str) -> list[str]:
    """The messages of a missing key, a shape mismatch and a missing key read only through
    None leaves on rank 0 (a pipeline rank not holding the leaf must raise too)."""
    dm = pxform.Mesh({"dp": 4}).device_mesh
    model = small_model()
    rank = torch.distributed.get_rank()

    def put(shape):
        return distribute_tensor(torch.zeros(shape), dm, [Shard(0)])

    good = put(model["layers"]["0"]["w"].shape)
    cases = [
        {"layers": {"0": {"weight": good, "b": put((64,))}}},
        {"layers": {"0": {"w": put((48, 64))}}},
        {"layers": {"0": {"w": good}}, "extra": None if rank == 0 else torch.zeros(3)},
    ]
    out = []
    for like in cases:
        try:
            load_checkpoint(path, like)
            out.append("no error")
        except SpecError as e:
            out.append(str(e))
    return out


def dcp_reshard(folder: str) -> dict:
    """Save DTensors laid out for tensor parallelism with torch.distributed.checkpoint and
    load them into a ZeRO-3 layout: DCP reshards across plans."""
    model = flat(small_model())
    tp = pxform.Mesh({"dp": 2, "tp": 2}).device_mesh
    state = {k: distribute_tensor(v, tp, [Replicate(), Shard(0)] if v.is_floating_point()
                                  else [Replicate(), Replicate()])
             for k, v in model.items()}
    dcp.save(state, checkpoint_id=folder)
    zero3 = pxform.Mesh({"dp": 4}).device_mesh
    state2 = {k: distribute_tensor(torch.zeros_like(v), zero3, [Shard(0)])
              for k, v in model.items()}
    dcp.load(state2, checkpoint_id=folder)
    return {k: (v.placements == (Shard(0),)) and torch.equal(v.full_tensor(), model[k])
            for k, v in state2.items()}
