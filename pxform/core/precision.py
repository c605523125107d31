"""Mixed precision as a policy: which dtype parameters are used in, which dtype ops compute
in, and which dtype gradients are reduced in (FSDP2's `MixedPrecisionPolicy` plus autocast).

    step = pxform.shard(loss_fn, mesh=mesh, in_specs=..., precision=pxform.Precision())

The policy changes the traced program, not the tensors the user holds:

- parameters keep their storage dtype (float32 master weights, stepped by a plain
  `torch.optim` optimizer, whose state is float32 too);
- ops compute as `torch.autocast(device, dtype=compute_dtype)` would run them: matmuls,
  linear layers, convolutions and attention in `compute_dtype`; the ops autocast keeps in
  float32 (softmax, norms, losses, exp, sums) in float32; ops that mix dtypes at the
  widest. The lists are torch's own, read off autocast for `autocast_device` (the device
  the plan is for; "cuda" by default, whatever machine traces);
- a parameter is cast where it is used, on its local shard: ZeRO-3 gathers the cast
  shard (half the bytes, as FSDP2 does);
- parameter gradients are reduced in `reduce_dtype` and returned in the parameter's dtype.

The trace inserts every cast as an explicit `_to_copy` op, so the IR, the plan, the cost
model and the lowered program all see the dtypes that run.

float16 is refused: it needs dynamic loss scaling with overflow checks agreed across ranks,
which pxform does not provide. bfloat16 has float32's exponent range and needs none.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import torch

from pxform.core.errors import PxformError

_FLOATING = (torch.float32, torch.float64, torch.bfloat16)


@dataclass(frozen=True)
class Precision:
    """A mixed-precision policy (module doc).

    Attributes:
        param_dtype: the dtype every floating parameter is cast to where it is used
            (FSDP2's `param_dtype`); None leaves parameters in their storage dtype, and the
            ops that compute in `compute_dtype` cast them there, on the shard. Parameters
            are the leaves of the first argument (`pipeline` and `auto`: of the arguments
            that are not the batch).
        compute_dtype: the dtype autocast's lower-precision ops (matmul, linear, conv,
            attention) compute in; None turns autocast off (only `param_dtype` casts).
        reduce_dtype: the dtype parameter gradients are summed across ranks in (FSDP2's
            `reduce_dtype`), and over a pipeline's microbatches; None: the parameter's
            dtype. It applies to the parameters the policy casts (every parameter a
            matmul, conv or attention reads, or all with `param_dtype`); a parameter read
            as stored (a norm's weight) is reduced in its own dtype.
        output_dtype: the dtype floating outputs of the function are cast to; None leaves
            them as computed (a loss from `cross_entropy` is float32 under autocast).
        autocast_device: whose autocast op lists decide which ops run in float32: "cuda"
            (the lists GPU clusters use, on any machine) or "cpu".
        float32_ops: aten op names (e.g. "gelu") also kept in float32.
        compute_ops: aten op names (e.g. "softmax") run in `compute_dtype` although the
            lists keep them in float32.

    Example:
        >>> policy = pxform.Precision()                 # bf16 compute, f32 reductions
        >>> step = pxform.shard(loss_fn, mesh=mesh, in_specs=specs, precision=policy)
        >>> pxform.Precision(compute_dtype=torch.bfloat16, float32_ops=("gelu",))
    """

    param_dtype: torch.dtype | None = None
    compute_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    autocast_device: str = "cuda"
    float32_ops: tuple[str, ...] = field(default=())
    compute_ops: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "reduce_dtype", "output_dtype"):
            dtype = getattr(self, name)
            if dtype is None:
                continue
            if dtype == torch.float16:
                raise PxformError(
                    f"pxform.Precision: {name}=torch.float16 is refused: float16 training "
                    f"needs dynamic loss scaling with overflow checks agreed across all "
                    f"ranks, which pxform does not provide, and without it small gradients "
                    f"underflow to zero silently.\n  Fix: use torch.bfloat16 (float32's "
                    f"exponent range, no loss scaling needed).")
            if dtype not in _FLOATING:
                raise PxformError(
                    f"pxform.Precision: {name}={dtype} is not a supported floating dtype.\n"
                    f"  Fix: use one of torch.bfloat16, torch.float32, torch.float64, or "
                    f"None.")
        if self.autocast_device not in ("cuda", "cpu"):
            raise PxformError(
                f"pxform.Precision: autocast_device={self.autocast_device!r}; pxform reads "
                f"autocast's op lists for 'cuda' or 'cpu'.\n  Fix: pass one of those.")
        both = set(self.float32_ops) & set(self.compute_ops)
        if both:
            raise PxformError(
                f"pxform.Precision: ops {sorted(both)} are in both float32_ops and "
                f"compute_ops.\n  Fix: name each op in one of them.")
        object.__setattr__(self, "float32_ops", tuple(self.float32_ops))
        object.__setattr__(self, "compute_ops", tuple(self.compute_ops))

    def to_json(self) -> dict[str, Any]:
        """The policy as JSON-able data (dtypes by name), as a saved `Plan` holds it.

        Example:
            >>> pxform.Precision.from_json(pxform.Precision().to_json()) == pxform.Precision()
            True
        """
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.dtype):
                value = str(value).removeprefix("torch.")
            out[f.name] = value
        return out

    @staticmethod
    def from_json(data: dict[str, Any]) -> Precision:
        """The policy `to_json` wrote."""
        kwargs: dict[str, Any] = {}
        for f in fields(Precision):
            if f.name not in data:
                continue
            value = data[f.name]
            if f.name.endswith("_dtype") and value is not None:
                dtype = getattr(torch, value, None)
                if not isinstance(dtype, torch.dtype):
                    raise PxformError(f"pxform.Precision.from_json: {f.name}={value!r} is "
                                      f"not a torch dtype name.")
                value = dtype
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        return Precision(**kwargs)

    def __str__(self) -> str:
        def name(d: torch.dtype | None) -> str:
            return "-" if d is None else str(d).removeprefix("torch.")

        text = (f"Precision(param={name(self.param_dtype)}, "
                f"compute={name(self.compute_dtype)}, reduce={name(self.reduce_dtype)}, "
                f"output={name(self.output_dtype)}, lists={self.autocast_device}")
        if self.float32_ops:
            text += f", float32_ops={list(self.float32_ops)}"
        if self.compute_ops:
            text += f", compute_ops={list(self.compute_ops)}"
        return text + ")"
