"""Loading a full (unsharded) checkpoint into this rank's shards.

A checkpoint saved by one process (`torch.save(model.state_dict())`, a `.safetensors` file,
a Hugging Face model folder) holds every tensor whole. `load_checkpoint` fills a tree of
DTensors laid out by a plan from it without any rank ever holding the whole model: the file
is memory-mapped, each rank slices out the piece its placements give it and copies only
that piece onto its device. Pages of the file that no slice touches are never read.

Every check (keys, shapes) is decided from what every rank has alike, the checkpoint's key
list and shapes and the structure of `like`, so a bad checkpoint raises the same error on
every rank; loading issues no collective at all.

Sharded checkpoints saved by `torch.distributed.checkpoint` (DCP) need none of this: DCP
reshards across plans and world sizes itself (see docs/checkpoints.md).
"""

from __future__ import annotations

import ctypes
import difflib
import json
import math
import mmap
import os
import struct
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from pxform.core.errors import SpecError

KeyMap = Callable[[str], str] | Mapping[str, str] | None

# safetensors dtype names -> (numpy dtype to memory-map with, torch dtype it stands for).
# numpy has no bfloat16 or float8: map those bytes as unsigned ints of the same width and
# reinterpret them in torch (`.view(dtype)`), which copies nothing.
_SAFETENSORS_DTYPES: dict[str, tuple[Any, torch.dtype]] = {
    "F64": (np.float64, torch.float64),
    "F32": (np.float32, torch.float32),
    "F16": (np.float16, torch.float16),
    "BF16": (np.uint16, torch.bfloat16),
    "F8_E4M3": (np.uint8, torch.float8_e4m3fn),
    "F8_E5M2": (np.uint8, torch.float8_e5m2),
    "I64": (np.int64, torch.int64),
    "I32": (np.int32, torch.int32),
    "I16": (np.int16, torch.int16),
    "I8": (np.int8, torch.int8),
    "U8": (np.uint8, torch.uint8),
    "BOOL": (np.bool_, torch.bool),
}


@dataclass(frozen=True)
class _Entry:
    """One checkpoint tensor, known by shape and dtype before any of its data is read.
    `open()` returns the whole tensor as a view of the mapped file (no data read yet)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    open: Callable[[], torch.Tensor]
    mapped: bool = False  # a view of a file torch.load mapped for this call (see _drop_pages)


# ---------------------------------------------------------------- reading checkpoints


def _flatten_state(obj: Any, prefix: str, out: dict[str, _Entry], where: str,
                   mapped: bool = False) -> None:
    """Dotted names for the tensors of a (possibly nested) state dict. Non-tensor values
    (step counters, configs) are not parameters: they are left out."""
    if isinstance(obj, DTensor):
        raise SpecError(f"pxform.load_checkpoint({where}): the source holds a DTensor at "
                        f"{prefix or '<root>'!r}; load_checkpoint reads full tensors.\n  Fix: "
                        f"load sharded checkpoints with torch.distributed.checkpoint.load, which "
                        f"reshards across plans (docs/checkpoints.md).")
    if isinstance(obj, torch.Tensor):
        t = obj
        out[prefix] = _Entry(tuple(t.shape), t.dtype, lambda: t, mapped)
    elif isinstance(obj, Mapping):
        for k, v in obj.items():
            _flatten_state(v, f"{prefix}.{k}" if prefix else str(k), out, where, mapped)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _flatten_state(v, f"{prefix}.{i}" if prefix else str(i), out, where, mapped)


def _safetensors_entries(path: str, where: str) -> dict[str, _Entry]:
    """The tensors of a .safetensors file: an 8-byte little-endian header length, a JSON
    header {name: {dtype, shape, data_offsets: [begin, end]}} (plus `__metadata__`), then the
    data, offsets counted from the end of the header. Each tensor is memory-mapped on first
    use, so reading a slice faults in only the pages under that slice."""
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
    start = 8 + size
    out: dict[str, _Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise SpecError(f"pxform.load_checkpoint({where}): tensor {name!r} has dtype "
                            f"{info['dtype']}, which this reader does not support (it reads "
                            f"{', '.join(_SAFETENSORS_DTYPES)}).\n  Fix: convert the file, or "
                            f"load it yourself and pass the mapping name -> tensor as source.")
        np_dtype, dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        shape = tuple(int(s) for s in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
        numel = math.prod(shape)
        if end - begin != numel * np.dtype(np_dtype).itemsize:
            raise SpecError(f"pxform.load_checkpoint({where}): tensor {name!r} of shape "
                            f"{shape} and dtype {info['dtype']} spans {end - begin} bytes in "
                            f"the header; the file is corrupt.\n  Fix: save it again.")
        out[name] = _Entry(shape, dtype, _mapper(path, start + begin, numel, np_dtype, dtype,
                                                 shape))
    return out


def _mapper(path: str, offset: int, numel: int, np_dtype: Any, dtype: torch.dtype,
            shape: tuple[int, ...]) -> Callable[[], torch.Tensor]:
    def open_() -> torch.Tensor:
        if numel == 0:  # an empty region cannot be mapped
            return torch.empty(shape, dtype=dtype)
        # mode "c" (copy-on-write) gives a writable array, so torch.from_numpy does not warn;
        # nothing writes to it, and the file is never changed either way
        arr = np.memmap(path, dtype=np_dtype, mode="c", offset=offset, shape=(numel,))
        t = torch.from_numpy(arr)
        if t.dtype != dtype:
            t = t.view(dtype)  # reinterpret bf16 / float8 bits, no copy
        return t.reshape(shape)

    return open_


def _torch_entries(path: str, where: str) -> dict[str, _Entry]:
    # mmap=True: storages point into the mapped file and nothing is read until a slice is
    # copied; weights_only=True: never run pickled code from a downloaded file
    try:
        state = torch.load(path, mmap=True, weights_only=True, map_location="cpu")
    except Exception as e:
        raise SpecError(f"pxform.load_checkpoint({where}): torch.load could not memory-map "
                        f"it: {type(e).__name__}: {e}\n  Fix: load_checkpoint reads files "
                        f"saved by torch.save (zip format, the default since torch 1.6) or "
                        f".safetensors files.") from e
    out: dict[str, _Entry] = {}
    _flatten_state(state, "", out, where, mapped=True)
    return out


def _drop_pages(t: torch.Tensor) -> None:
    """Take the pages of `t`'s storage out of this process's resident set (Linux).

    torch.load maps the whole file as one region, so the pages a slice touched would stay
    resident until the last tensor of the file is gone: a rank would end up holding its
    pieces twice, once copied and once as file pages. MADV_DONTNEED drops them from this
    process only (the page cache keeps them for the other ranks). On a private file mapping
    nothing has written to, a later read faults the same bytes in again from the file;
    callers still drop a storage only once no leaf of this call will read it again."""
    if sys.platform != "linux":
        return
    storage = t.untyped_storage()
    page = mmap.PAGESIZE
    begin = -(-storage.data_ptr() // page) * page  # whole pages inside the storage only:
    end = (storage.data_ptr() + storage.nbytes()) // page * page  # neighbours keep theirs
    if end <= begin:
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise(begin, end - begin, 4)  # 4: MADV_DONTNEED; a failure only costs memory
    except (OSError, AttributeError):
        pass


def _file_entries(path: str, where: str) -> dict[str, _Entry]:
    with open(path, "rb") as f:
        head = f.read(9)
    # torch.save writes a zip archive ("PK"); a safetensors file has '{' after its length
    if path.endswith(".safetensors") or (not head.startswith(b"PK") and head[8:9] == b"{"):
        return _safetensors_entries(path, where)
    return _torch_entries(path, where)


def _folder_files(path: str, where: str) -> list[str]:
    """The files of a Hugging Face style checkpoint: those an `*.index.json` names in its
    weight_map, else every .safetensors file in the folder, else every .bin/.pt/.pth file."""
    if path.endswith(".json"):
        with open(path) as f:
            weight_map = json.load(f)["weight_map"]
        folder = os.path.dirname(path)
        return [os.path.join(folder, n) for n in sorted(set(weight_map.values()))]
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(".safetensors.index.json")]
    if indexes:
        return _folder_files(os.path.join(path, indexes[0]), where)
    for exts in ((".safetensors",), (".bin", ".pt", ".pth")):
        files = [os.path.join(path, n) for n in names if n.endswith(exts)]
        if files:
            return files
    raise SpecError(f"pxform.load_checkpoint({where}): the folder has no .safetensors, .bin, "
                    f".pt or .pth file.\n  Fix: pass the checkpoint file itself.")


def _entries(source: Any, where: str) -> dict[str, _Entry]:
    if isinstance(source, Mapping):
        out: dict[str, _Entry] = {}
        _flatten_state(source, "", out, where)
        return out
    path = os.fspath(source)
    if not os.path.exists(path):
        raise SpecError(f"pxform.load_checkpoint({where}): no such file or folder.\n  Fix: "
                        f"pass the path of a torch.save or .safetensors file (every rank must "
                        f"see it), or a mapping name -> tensor.")
    if not (os.path.isdir(path) or path.endswith(".json")):
        return _file_entries(path, where)
    out = {}
    for f in _folder_files(path, where):
        for name, entry in _file_entries(f, where).items():
            if name in out:
                raise SpecError(f"pxform.load_checkpoint({where}): tensor {name!r} is in more "
                                f"than one file (the second is {f}).\n  Fix: pass one file, "
                                f"or the folder's index.json.")
            out[name] = entry
    return out


# ---------------------------------------------------------------- this rank's piece


def _piece(shape: tuple[int, ...], leaf: DTensor, where: str,
           path: str) -> tuple[tuple[slice, ...], bool] | None:
    """This rank's slice of a DTensor leaf's global value, and whether the piece is zeros
    (a Partial(sum) placement holds the value on coordinate 0 and zeros elsewhere); None
    where this rank is not in the leaf's mesh. Shard(d) splits dim d as torch.chunk does,
    outer mesh dims first, the way DTensor lays out uneven shards."""
    mesh = leaf.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    begin = [0] * len(shape)
    size = list(shape)
    zeros = False
    for i, p in enumerate(leaf.placements):
        if type(p) is Shard:
            d = p.dim
            n, k = size[d], mesh.size(i)
            chunk = -(-n // k)
            lo = min(coord[i] * chunk, n)
            begin[d] += lo
            size[d] = min(lo + chunk, n) - lo
        elif type(p) is Partial:
            # sum: coordinate 0 holds the value; avg, max and min: every coordinate does
            zeros = zeros or (p.reduce_op == "sum" and coord[i] != 0)
        elif type(p) is not Replicate:
            raise SpecError(f"pxform.load_checkpoint({where}): leaf {path!r} has placement "
                            f"{p} on mesh dim {i}; load_checkpoint handles Shard, Replicate "
                            f"and Partial.\n  Fix: load into a tree laid out with those, then "
                            f"redistribute.")
    return tuple(slice(b, b + s) for b, s in zip(begin, size)), zeros


def _copy(src: torch.Tensor, like_local: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # one copy straight from the mapped pages into a fresh contiguous tensor on the leaf's
    # device, casting on the way: the slice is never materialised twice
    out = torch.empty(src.shape, dtype=dtype, device=like_local.device)
    out.copy_(src)
    return out


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _load_leaf(leaf: Any, entry: _Entry, where: str, path: str) -> Any:
    if isinstance(leaf, DTensor):
        local_like = leaf.to_local()
        piece = _piece(entry.shape, leaf, where, path)
        if piece is None:  # not in the leaf's mesh: DTensor holds an empty local tensor
            local = torch.empty_like(local_like)
        else:
            slices, zeros = piece
            local_shape = tuple(s.stop - s.start for s in slices)
            if local_shape != tuple(local_like.shape):
                raise SpecError(f"pxform.load_checkpoint({where}): leaf {path!r}'s local piece "
                                f"has shape {tuple(local_like.shape)}, but its placements "
                                f"{list(leaf.placements)} give {local_shape} (torch.chunk "
                                f"splits).\n  Fix: build `like` with distribute_tensor or "
                                f"pxform (step.init / step.distribute).")
            if zeros:
                local = torch.zeros(local_shape, dtype=leaf.dtype, device=local_like.device)
            else:
                local = _copy(entry.open()[slices], local_like, leaf.dtype)
        # shape and stride given: from_local would otherwise assume even shards, and
        # run_check=False: no collective, so a rank never waits on another here
        out: torch.Tensor = DTensor.from_local(
            local, leaf.device_mesh, leaf.placements, run_check=False, shape=leaf.shape,
            stride=_contiguous_stride(entry.shape))
    else:
        out = _copy(entry.open(), leaf, leaf.dtype)
    # requires_grad on the result, not on `local`: a parameter must be a leaf of autograd
    return out.requires_grad_(leaf.requires_grad)


# ---------------------------------------------------------------- checks and errors


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path)


def _key_fn(key: KeyMap) -> Callable[[str], str]:
    if key is None:
        return lambda p: p
    if isinstance(key, Mapping):
        table = key
        return lambda p: table.get(p, p)
    return key


def _close(name: str, keys: list[str]) -> str:
    near = difflib.get_close_matches(name, keys, n=3, cutoff=0.5)
    return ", ".join(repr(k) for k in near) if near else "none"


def _names(items: list[str], n: int = 4) -> str:
    shown = ", ".join(repr(i) for i in items[:n])
    return shown + (f" and {len(items) - n} more" if len(items) > n else "")


def _prefix_hint(paths: list[str], keys: list[str]) -> str:
    """A key= that fixes a prefix the checkpoint adds to (or `like` adds to) every name, as
    Hugging Face checkpoints add "model." — found from the first path alone."""
    if not paths:
        return ""
    first = paths[0]
    for k in keys:
        if k.endswith("." + first):
            pre = k[: -len(first)]
            return f" (here, perhaps key=lambda path: {pre!r} + path)"
    for k in keys:
        if first.endswith("." + k):
            pre = first[: -len(k)]
            return f" (here, perhaps key=lambda path: path.removeprefix({pre!r}))"
    return ""


def _check(leaves: list[tuple[str, str, Any]], entries: dict[str, _Entry], where: str) -> None:
    """Raise for the first problem found. Only the checkpoint's keys and shapes and the
    structure of `like` decide, which every rank has alike, so every rank raises the same
    error (None leaves, the leaves a pipeline rank does not hold, are checked by key only).
    A None leaf may stand for a whole subtree (`{"layers": {"0": None}}`): its key may then
    be the prefix of checkpoint keys."""
    keys = sorted(entries)
    prefixes = {k[:i] for k in keys for i, c in enumerate(k) if c == "."}
    fix_key = ("  Fix: pass key= to map a leaf's dotted path to its checkpoint key: a "
               "function, e.g. key=lambda path: 'model.' + path, or a dict {path: key}")
    wanted = [(p, k) for p, k, _ in leaves]
    missing = [(p, k) for p, k, leaf in leaves
               if k not in entries and (leaf is not None or k not in prefixes)]
    if wanted and len(missing) == len(wanted):
        hint = _prefix_hint([k for _, k in wanted], keys)
        raise SpecError(f"pxform.load_checkpoint({where}): no leaf of `like` matches a "
                        f"checkpoint key: it looked for {_names([k for _, k in wanted])}; the "
                        f"checkpoint has {len(keys)} tensors: {_names(keys) or 'none'}.\n"
                        f"{fix_key}{hint}.")
    if missing:
        path, k = missing[0]
        others = [p for p, _ in missing[1:]]
        also = f" {len(others)} more leaves are missing: {_names(others)}." if others else ""
        raise SpecError(f"pxform.load_checkpoint({where}): leaf {path!r} looks for key {k!r}, "
                        f"which the checkpoint does not have (close keys: {_close(k, keys)}).{also}"
                        f"\n{fix_key}.")
    for path, k, leaf in leaves:
        if isinstance(leaf, torch.Tensor) and tuple(leaf.shape) != entries[k].shape:
            raise SpecError(f"pxform.load_checkpoint({where}): leaf {path!r} has shape "
                            f"{tuple(leaf.shape)} but the checkpoint's {k!r} has shape "
                            f"{entries[k].shape}.\n  Fix: build `like` for the model the "
                            f"checkpoint was saved from (same sizes), or map {path!r} to the "
                            f"right key with key=.")


def _describe(source: Any) -> str:
    if isinstance(source, Mapping):
        return "<mapping>"
    return os.fspath(source)


# ---------------------------------------------------------------- the function


def load_checkpoint(source: Any, like: Any, *, key: KeyMap = None) -> Any:
    """Fill `like` (a pytree, usually a dict, of DTensors, plain tensors or None placeholders,
    as `step.init(...)` or `step.distribute(...)` return them) from a full checkpoint, with no
    rank ever holding the whole model.

    Args:
        source: a file saved with `torch.save` (a state dict, possibly nested dicts, read
            with `mmap=True, weights_only=True`); a `.safetensors` file; a folder of either
            (a Hugging Face model folder: its `*.safetensors.index.json` if it has one,
            else its `.safetensors`, else its `.bin/.pt/.pth` files) or such an index file;
            or an already loaded mapping name -> tensor.
        like: the tree to fill. It is not changed.
        key: the checkpoint key of each leaf, given its dotted pytree path (`"layers.0.w"`
            for `{"layers": [{"w": ...}]}`): a function path -> key, or a dict path -> key
            (paths it lacks keep their own name). Default: the path itself.

    Returns:
        A new tree of the same structure. A DTensor leaf becomes a DTensor with the same
        mesh and placements whose local piece holds the checkpoint's values for exactly
        that piece (Shard splits as torch.chunk does; Partial(sum) puts the value on
        coordinate 0 and zeros elsewhere); a plain tensor leaf gets the whole tensor; a None
        leaf stays None and reads nothing. Values are cast to the leaf's dtype (a bfloat16
        checkpoint loads into float32 master weights) and placed on the leaf's device;
        `requires_grad` follows the leaf. Other leaves (ints, strings) are returned as is.

    Raises:
        SpecError: a leaf's key is not in the checkpoint (None leaves included, so every
            rank of a pipeline agrees; a None leaf may also stand for a subtree, its key a
            prefix of checkpoint keys), no leaf matches any key, or a tensor leaf's shape
            differs from the checkpoint's (only ranks holding the leaf can see its shape).
            Checkpoint keys no leaf reads are fine.

    Files are memory-mapped and only the pages under this rank's slices are read; those
    pages leave the resident set once the tensor is done, so a rank's memory grows by its
    pieces plus about one tensor's slice. No collective is issued.

    Example:
        >>> step = pxform.shard(loss_fn, mesh=pxform.Mesh({"dp": 2, "tp": 2}),
        ...                     in_specs=(param_specs, P("dp")))
        >>> params = step.init(init_fn)              # DTensors, this rank's pieces
        >>> params = pxform.load_checkpoint("model.safetensors", like=params,
        ...                                 key=lambda path: "model." + path)
    """
    where = _describe(source)
    to_key = _key_fn(key)
    paths, leaves, spec = optree.tree_flatten_with_path(like, none_is_leaf=True)
    # the leaves that read the checkpoint: tensors, and None placeholders, whose keys are
    # checked too so that every rank of a pipeline agrees
    wanted = [(i, _dotted(p), leaf) for i, (p, leaf) in enumerate(zip(paths, leaves))
              if leaf is None or isinstance(leaf, torch.Tensor)]
    keyed = [(path, to_key(path), leaf) for _, path, leaf in wanted]
    entries = _entries(source, where)
    _check(keyed, entries, where)
    # reads left per mapped storage: its pages are dropped after the last one (_drop_pages)
    pending = Counter(entries[k].open().untyped_storage().data_ptr()
                      for _, k, leaf in keyed if leaf is not None and entries[k].mapped)
    out = list(leaves)  # a new list: `like` itself is never changed
    for (i, _, _), (path, k, leaf) in zip(wanted, keyed):
        if leaf is None:
            continue
        entry = entries[k]
        out[i] = _load_leaf(leaf, entry, where, path)
        if entry.mapped:
            storage = entry.open().untyped_storage().data_ptr()
            pending[storage] -= 1
            if not pending[storage]:
                _drop_pages(entry.open())
    return optree.tree_unflatten(spec, out)
