"""What `torch.autocast` does to one op: read off torch itself, not a copied list.

Autocast sorts ops into three lists per device: ops it runs in the lower-precision dtype
(matmul, linear, conv, attention), ops it runs in float32 (softmax, norms, losses, exp,
sum), and ops it runs at the widest dtype of their inputs (cat, index_put, addcmul). Every
other op runs on what it is given. Autocast casts only "eligible" inputs: floating tensors
that are not float64.

`autocast_kind` asks torch: it runs the op on fake tensors of the device type under
autocast (fake CUDA tensors work on a CPU-only build, so a laptop reads the GPU lists) and
watches the dtypes that come out:

- float32 inputs give a `dtype` output: "lower";
- `dtype` inputs give a float32 output: "float32";
- mixed inputs work under autocast but fail or come out otherwise without it: "promote".

Example:
    >>> autocast_kind(op, "cuda", torch.bfloat16)     # op: a traced linear
    'lower'
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from pxform.core.ir import DEVICE, Op, Value, map_values

Kind = Literal["lower", "float32", "promote"]

# ops that set their dtype themselves: autocast leaves them alone
_CASTS = {"_to_copy", "to", "type_as", "clone", "copy", "detach", "alias", "lift_fresh_copy"}

_CACHE: dict[tuple[Any, ...], Kind | None] = {}


def eligible(dtype: torch.dtype) -> bool:
    """Does autocast cast a tensor of this dtype? (floating, not float64)"""
    return dtype.is_floating_point and dtype != torch.float64


def autocast_kind(op: Op, device: str, dtype: torch.dtype) -> Kind | None:
    """How `torch.autocast(device, dtype)` runs `op` (module doc); None: as given."""
    if not isinstance(op.target, torch._ops.OpOverload):
        return None
    name = op.target._schema.name.split("::")[-1]
    tensors = [v for v in op.inputs if eligible(v.type.dtype)]
    if name in _CASTS or not tensors:
        return None
    # by shapes, dtypes and which inputs are the same value (not by names): the layers of
    # a model share their answers
    names = [v.name for v in op.inputs]
    key = (op.target, device, dtype, tuple((names.index(v.name), v.type.shape, v.type.dtype)
                                           for v in op.inputs), _static(op))
    if key not in _CACHE:
        _CACHE[key] = _probe(op, device, dtype)
    return _CACHE[key]


def _static(op: Op) -> str:
    """The op's non-tensor arguments, as a cache key."""
    def blank(v: Value) -> str:
        return "T"
    return repr((map_values(op.args, blank), map_values(op.kwargs, blank)))


def _probe(op: Op, device: str, dtype: torch.dtype) -> Kind | None:
    def out_dtypes(choose: Any, enabled: bool) -> list[torch.dtype] | None:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        before = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        try:
            with mode:
                def fake(v: Value) -> torch.Tensor:
                    d = choose(v) if eligible(v.type.dtype) else v.type.dtype
                    return torch.empty(v.type.shape, dtype=d, device=device)

                def fix(a: Any) -> Any:
                    a = map_values(a, fake)
                    return torch.device(device) if a is DEVICE else a

                args = [fix(a) for a in op.args]
                kwargs = {k: fix(v) for k, v in op.kwargs}
                torch.set_autocast_enabled(device, enabled)
                torch.set_autocast_dtype(device, dtype)
                with torch.no_grad():
                    result = op.target(*args, **kwargs)
        except Exception:  # an op fake tensors of this device cannot run: left as given
            return None
        finally:
            torch.set_autocast_enabled(device, before[0])
            torch.set_autocast_dtype(device, before[1])
        flat = result if isinstance(result, (list, tuple)) else [result]
        return [t.dtype for t in flat if isinstance(t, torch.Tensor) and t.is_floating_point()]

    low = out_dtypes(lambda v: torch.float32, True)
    if low and dtype in low:
        return "lower"
    high = out_dtypes(lambda v: dtype, True)
    if high and torch.float32 in high:
        return "float32"
    eligible_inputs = [v for v in op.inputs if eligible(v.type.dtype)]
    if len(eligible_inputs) >= 2:
        first = eligible_inputs[0].name

        def mixed(v: Value) -> torch.dtype:
            return dtype if v.name == first else torch.float32

        on = out_dtypes(mixed, True)
        off = out_dtypes(mixed, False)
        if on is not None and on != off:
            return "promote"
    return None
