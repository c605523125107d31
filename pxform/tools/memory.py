"""Memory meter: how many bytes one training step needs on this rank.

`MemoryMeter` is a context manager that measures the memory a region of code allocates;
`memory_report` runs one step of a function under it on every rank and gathers the results.

Method
------
On CPU the allocator keeps no statistics, so the meter counts tensor storages itself. It
pushes a `TorchDispatchMode`, which sees every aten op *below* autograd: forward ops, every op
of the backward pass (run by the autograd engine under the same mode stack), recomputation
inside `torch.utils.checkpoint` and functional collectives. For each tensor an op returns it
looks at the tensor's `untyped_storage()`. A storage it has not seen before (and that is not
a storage of one of the op's inputs, i.e. the output is not a view or an in-place result) is
a new allocation: its `nbytes()` is added to the live count and a `weakref.finalize` on the
storage subtracts it again when the storage dies. PyTorch keeps a storage's Python object
alive as long as the C++ storage lives (PyObject preservation), so the finalizer fires when
the memory is really freed, also when only autograd still holds the tensor.

On CUDA the caching allocator already counts: the baseline is `torch.cuda.memory_allocated`
at entry and the peak is `torch.cuda.max_memory_allocated` after resetting the peak stats at
entry. The dispatch mode is still used, only to notice the start of the backward pass.

What the numbers mean
---------------------
* `baseline_bytes`: memory that existed before the region and that the region reads. On CPU,
  the storages of the tensors passed to `MemoryMeter.track` (the parameters and the batch);
  on CUDA everything allocated at entry.
* `peak_bytes`: baseline plus the largest amount of region-allocated memory alive at once.
* `saved_bytes`: region-allocated memory alive when the first op of the first backward pass
  runs. At that moment the forward pass is over and what is still alive is essentially what
  autograd saved for backward (the activations), so this is the number activation
  checkpointing reduces. 0 when no backward pass ran.
* `end_bytes`: region-allocated memory still alive at exit (gradients, outputs kept).

Limits (CPU): scratch buffers a kernel allocates and frees internally (not returned from an
aten op) are not seen; ops running under a tensor subclass's `__torch_dispatch__` (e.g.
DTensor) are seen at the subclass level, so their local outputs count but their internal
temporaries do not. Storages on other devices (and fake/meta tensors) are ignored. Dispatch
modes are per thread, so ops that threads other than the entering one (and the autograd
engine's) run are not seen.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

from pxform.core.units import format_bytes, format_table
from pxform.runtime import world
from pxform.transforms.grad import value_and_grad

__all__ = ["MemoryMeter", "MemoryReport", "MemoryStats", "memory_report"]


def _human(n: int) -> str:
    """`n` bytes in binary units with two decimals: `512 B`, `1.50 KiB`, `3.00 GiB`."""
    return format_bytes(n, decimals=2)


@dataclass(frozen=True)
class MemoryStats:
    """One rank's memory over one measured region.

    Example:
        >>> with MemoryMeter() as meter:
        ...     y = torch.ones(1024).sin()
        >>> meter.stats.end_bytes
        4096
        >>> print(meter.stats)
        rank 0 cpu: baseline 0 B, peak 8.00 KiB, saved 0 B, end 4.00 KiB
    """

    rank: int  # torch.distributed rank, 0 when not initialised
    device: str  # "cpu" or e.g. "cuda:0"
    baseline_bytes: int  # memory that existed before the region and that it reads
    peak_bytes: int  # baseline + the most region-allocated bytes alive at once
    saved_bytes: int  # region-allocated bytes alive when backward started (activations)
    end_bytes: int  # region-allocated bytes still alive at exit (e.g. gradients)

    def __str__(self) -> str:
        return (f"rank {self.rank} {self.device}: baseline {_human(self.baseline_bytes)}, "
                f"peak {_human(self.peak_bytes)}, saved {_human(self.saved_bytes)}, "
                f"end {_human(self.end_bytes)}")


def _graph_task_id() -> int:
    # -1 outside the autograd engine; a task id while it runs a backward pass (also on the
    # engine's device threads, which inherit the dispatch mode stack).
    get = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if get is None else int(get())


def tensors_of(tree: Any) -> list[torch.Tensor]:
    """The plain tensors (storage owners) in a pytree; subclasses such as DTensor are opened
    into their inner tensors, modules into their parameters and buffers."""
    out: list[torch.Tensor] = []
    stack = list(optree.tree_leaves(tree, none_is_leaf=False))
    while stack:
        x = stack.pop()
        if isinstance(x, torch.nn.Module):
            stack.extend(x.parameters())
            stack.extend(x.buffers())
        elif isinstance(x, torch.Tensor):
            if is_traceable_wrapper_subclass(x):
                names, _ = x.__tensor_flatten__()  # type: ignore[attr-defined]
                stack.extend(getattr(x, name) for name in names)
            else:
                out.append(x)
    return out


def _storage(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse tensors, storage-less subclasses
        return None


class _Alloc:
    """One storage allocated inside the region: its size and its finalizer."""

    __slots__ = ("nbytes", "fin")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self.fin: weakref.finalize | None = None


# a storage resized in place: the runtime frees a collective's temporary this way
# (`pxform.runtime.collectives.free_now`), FSDP2 its unsharded parameters
_RESIZE_STORAGE = torch.ops.inductor.resize_storage_bytes_.default


class _MeterMode(TorchDispatchMode):
    """Forwards every op; on CPU counts the storages the op creates, and on all devices notes
    when the backward pass starts."""

    def __init__(self, meter: MemoryMeter) -> None:
        super().__init__()
        self.meter = meter

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        meter = self.meter
        if meter._saved is None and _graph_task_id() != -1:
            meter._backward_started()
        out = func(*args, **kwargs)
        if meter._counting:
            if func is _RESIZE_STORAGE:
                meter._resized(args[0])  # returns nothing: its tensor's storage changed
            else:
                meter._count(args, kwargs, out)
        return out


class MemoryMeter:
    """Context manager measuring the memory this process allocates inside it.

    Args:
        device: the device to measure, `"cpu"` (also for `None`) or a CUDA device
            (`"cuda"` means the current one). A CPU meter counts only CPU storages.

    Example:
        >>> with MemoryMeter() as meter:
        ...     meter.track(params, batch)   # optional: their tensors count as baseline
        ...     loss, grads = pxform.value_and_grad(step)(params, batch)
        >>> print(meter.stats.peak_bytes)

    The meter can be used again after exit (each entry starts from zero), but not entered
    twice at once. Meters nest: an inner meter measures a part of an outer one's region.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        dev = torch.device("cpu" if device is None else device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"MemoryMeter: cannot measure device {dev}; use 'cpu' or 'cuda'")
        self.device = dev
        self._counting = dev.type == "cpu"  # CPU: count storages; CUDA: allocator stats
        self._lock = threading.RLock()  # ops may run on the engine's threads too
        self._mode: _MeterMode | None = None
        self._result: MemoryStats | None = None
        self._reset()

    def _reset(self) -> None:
        self._rank = _rank()
        self._baseline = 0
        self._live = 0  # bytes of region-allocated storages alive, as of the last drain
        self._max_live = 0
        self._saved: int | None = None  # set when the first backward op runs
        # id(storage) -> record. Keyed by id: the finalizer drops the entry while the storage
        # is being destroyed, before its id can be reused.
        self._allocs: dict[int, _Alloc] = {}
        # Finalizers only append here (atomic under the GIL, safe during garbage collection
        # on any thread); the op handler, holding the lock, subtracts them from `_live`.
        self._freed: list[int] = []
        self._tracked: dict[int, weakref.finalize] = {}

    # -- context manager ---------------------------------------------------------------

    def __enter__(self) -> MemoryMeter:
        if self._mode is not None:
            raise RuntimeError("MemoryMeter is already entered; use a new meter to nest")
        self._reset()
        self._result = None
        if not self._counting:
            self._baseline = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._mode = _MeterMode(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._mode is not None
        try:
            self._mode.__exit__(*exc)
        finally:
            self._mode = None
            self._result = self._snapshot()
            # Detach every finalizer: storages that outlive the region must not call back
            # into the meter later (and the meter must not keep their records alive).
            for table in (self._allocs, self._tracked):
                while table:
                    _, item = table.popitem()
                    fin = item.fin if isinstance(item, _Alloc) else item
                    if fin is not None:
                        fin.detach()
            self._freed.clear()

    # -- public --------------------------------------------------------------------------

    def track(self, *trees: Any) -> None:
        """Count the tensors in `trees` (pytrees, modules) as baseline: memory that existed
        before the region and that it reads. Their storages are never counted as allocations;
        a storage shared by several tensors counts once. On CUDA the baseline is everything
        allocated at entry, so this only documents intent.

        Example:
            >>> with MemoryMeter() as meter:
            ...     meter.track(model, batch)
            ...     loss = model(batch).sum()
        """
        if self._mode is None:
            raise RuntimeError("MemoryMeter.track must be called inside the `with` block")
        if not self._counting:
            return
        with self._lock:
            for t in tensors_of(trees):
                st = _storage(t)
                if st is None or st.device.type != self.device.type:
                    continue
                key = id(st)
                # already counted (allocated inside the region, or tracked before): once only
                if key in self._tracked or key in self._allocs:
                    continue
                fin = weakref.finalize(st, self._tracked.pop, key, None)
                fin.atexit = False
                self._tracked[key] = fin
                self._baseline += st.nbytes()

    @property
    def stats(self) -> MemoryStats:
        """The measurement: final after exit, the values so far inside the region.

        Example:
            >>> with MemoryMeter() as meter:
            ...     y = torch.ones(256)
            ...     print(meter.stats.end_bytes)   # 1024, still alive
        """
        if self._result is not None:
            return self._result
        if self._mode is None:
            raise RuntimeError("MemoryMeter.stats: the meter has not been entered")
        return self._snapshot()

    # -- internals -------------------------------------------------------------------------

    def _drain(self) -> None:
        freed = self._freed
        while freed:
            self._live -= freed.pop()

    def _current(self) -> int:
        """Region-allocated bytes alive now."""
        if self._counting:
            self._drain()
            return self._live
        return max(0, torch.cuda.memory_allocated(self.device) - self._baseline)

    def _snapshot(self) -> MemoryStats:
        with self._lock:
            live = self._current()
            if self._counting:
                peak = self._baseline + max(self._max_live, live)
            else:
                peak = max(torch.cuda.max_memory_allocated(self.device), self._baseline + live)
            return MemoryStats(rank=self._rank, device=str(self.device),
                               baseline_bytes=self._baseline, peak_bytes=peak,
                               saved_bytes=self._saved or 0, end_bytes=live)

    def _backward_started(self) -> None:
        with self._lock:
            if self._saved is None:
                self._saved = self._current()

    def _on_free(self, key: int) -> None:
        # Runs when a counted storage dies, possibly inside garbage collection on any thread:
        # only atomic container operations here, no lock (the thread holding it may be the
        # one collecting).
        rec = self._allocs.pop(key, None)
        if rec is not None:
            self._freed.append(rec.nbytes)

    def _resized(self, t: Any) -> None:
        """`t`'s storage was resized in place: a counted storage counts its new size."""
        st = _storage(t) if isinstance(t, torch.Tensor) else None
        if st is None:
            return
        with self._lock:
            self._drain()
            rec = self._allocs.get(id(st))
            if rec is not None:
                n = st.nbytes()
                self._live += n - rec.nbytes
                rec.nbytes = n
                self._max_live = max(self._max_live, self._live)

    def _count(self, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> None:
        outs = tensors_of(out)
        if not outs:
            return
        inputs: set[int] | None = None  # storages of the op's inputs, computed on demand
        dev = self.device.type
        with self._lock:
            self._drain()
            for t in outs:
                st = _storage(t)
                if st is None or st.device.type != dev:
                    continue
                key = id(st)
                rec = self._allocs.get(key)
                if rec is not None:
                    # a storage counted before: an in-place op or `out=` may have resized it
                    n = st.nbytes()
                    if n != rec.nbytes:
                        self._live += n - rec.nbytes
                        rec.nbytes = n
                    continue
                if key in self._tracked:
                    continue
                if inputs is None:
                    inputs = {id(s) for s in map(_storage, tensors_of((args, kwargs)))
                              if s is not None}
                if key in inputs:  # a view of, or an in-place result on, an input
                    continue
                rec = _Alloc(st.nbytes())
                fin = weakref.finalize(st, self._on_free, key)
                fin.atexit = False
                rec.fin = fin
                self._allocs[key] = rec
                self._live += rec.nbytes
            self._max_live = max(self._max_live, self._live)


def _rank() -> int:
    return world.rank()


@dataclass(frozen=True)
class MemoryReport:
    """Memory of one training step on every rank.

    Example:
        >>> report = pxform.memory_report(step, params, batch)
        >>> report.peak_bytes        # the largest peak over the ranks
        >>> print(report)            # one row per rank
    """

    ranks: tuple[MemoryStats, ...]  # ordered by rank; length 1 without torch.distributed

    @property
    def peak_bytes(self) -> int:
        """The largest `peak_bytes` over the ranks."""
        return max(s.peak_bytes for s in self.ranks)

    @property
    def saved_bytes(self) -> int:
        """The largest `saved_bytes` over the ranks."""
        return max(s.saved_bytes for s in self.ranks)

    def __str__(self) -> str:
        head = ("rank", "device", "baseline", "peak", "saved", "end")
        rows = [(str(s.rank), s.device, _human(s.baseline_bytes), _human(s.peak_bytes),
                 _human(s.saved_bytes), _human(s.end_bytes)) for s in self.ranks]
        # text columns left-aligned, numbers right-aligned
        return "\n".join(format_table([head, *rows], align="rlrrrr"))


def memory_report(fn: Callable[..., Any], *args: Any, argnums: int | tuple[int, ...] = 0,
                  grad: bool = True) -> MemoryReport:
    """Measure the memory of one step of `fn(*args)` on every rank.

    With `grad=True` the step is `pxform.value_and_grad(fn, argnums)(*args)` (forward and
    backward); with `grad=False` it is `fn(*args)` under `torch.no_grad()`. `args` count as
    baseline. The device measured is the CUDA device of the first CUDA tensor in `args`, else
    the CPU. When the default `torch.distributed` process group is initialised the stats
    are gathered with `all_gather_object`, so every rank must call this.

    Example:
        >>> report = pxform.memory_report(step, params, batch)
        >>> print(report)
        rank  device  baseline      peak     saved       end
           0  cpu     1.02 MiB  3.52 MiB  1.50 MiB  1.02 MiB
    """
    device: torch.device | str = "cpu"
    for t in tensors_of(args):
        if t.device.type == "cuda":
            device = t.device
            break
    with MemoryMeter(device) as meter:
        meter.track(args)
        if grad:
            result = value_and_grad(fn, argnums)(*args)
        else:
            with torch.no_grad():
                result = fn(*args)
    del result  # after exit, so the outputs (gradients) count in end_bytes
    stats = meter.stats
    ranks = tuple(sorted(world.gather_objects(stats), key=lambda s: s.rank))
    return MemoryReport(ranks=ranks)
