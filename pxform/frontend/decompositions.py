"""Ops the trace writes out in other ops (make_fx's `decomposition_table`), because they
cannot be traced on fake tensors as they are, or their data-dependent meaning has a static
dense form whose ops have sharding rules.

- `aten._grouped_mm` (`torch.nn.functional.grouped_mm`, the default experts implementation
  of HF mixture-of-experts models): rows of the input grouped by cumulative offsets, each
  group multiplied by its own weight. Its meta kernel wants bfloat16 CUDA-style inputs, and
  the groups' sizes depend on the routing. Written as dense dispatch: every row against
  every expert (`einsum`), the row's own expert's result kept by a one-hot mask made from
  the offsets with comparisons. The same numbers (summed in another order), the FLOPs of
  all experts; expert parallelism is later work. HF's own fallback op for it
  (`transformers::grouped_mm_fallback`, taken under compilation) is written out the same way.

Example:
    >>> gm = make_fx(fn, decomposition_table=decompositions(), pre_dispatch=True)(*fakes)
"""

from __future__ import annotations

from typing import Any

import torch

aten = torch.ops.aten


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None
                ) -> torch.Tensor:
    """`aten._grouped_mm` for a 2-D input `(rows, k)`, 3-D weights `(groups, k, n)` and
    `offs` (the groups' cumulative ends): dense dispatch. Rows past the last offset belong to
    no group and come out zero (the kernel leaves them unwritten; HF masks them). Other
    layouts (3-D inputs, 2-D weights) are the batched and backward forms: as `bmm`/`mm`."""
    if offs is None:  # no groups: a plain batched product
        out = torch.bmm(mat_a, mat_b) if mat_a.dim() == 3 else mat_a @ mat_b
    elif mat_a.dim() == 2 and mat_b.dim() == 3:
        rows = torch.arange(mat_a.shape[0], device=mat_a.device)
        group = (offs.unsqueeze(0) <= rows.unsqueeze(1)).sum(1)  # each row's group
        experts = torch.arange(mat_b.shape[0], device=mat_a.device)
        mask = (group.unsqueeze(1) == experts.unsqueeze(0)).to(mat_a.dtype)  # (rows, groups)
        every = torch.einsum("sk,ekn->sen", mat_a, mat_b)
        out = (every * mask.unsqueeze(2)).sum(1)
    else:
        raise NotImplementedError(
            f"pxform: grouped_mm of a {mat_a.dim()}-D input and {mat_b.dim()}-D weights with "
            f"offsets has no dense form yet (2-D inputs and 3-D weights have).")
    if bias is not None:
        out = out + bias
    return out.to(out_dtype) if out_dtype is not None else out


DECOMPOSITIONS: dict[Any, Any] = {}
if hasattr(aten, "_grouped_mm"):
    DECOMPOSITIONS[aten._grouped_mm.default] = _grouped_mm


def decompositions() -> dict[Any, Any]:
    """`DECOMPOSITIONS`, and the library ops registered by now that have the same meaning:
    HF's `transformers::grouped_mm_fallback` (its experts' path under compilation, which the
    trace is: `pxform.frontend.trace._compiling`)."""
    table = dict(DECOMPOSITIONS)
    try:
        fallback = torch.ops.transformers.grouped_mm_fallback.default
    except (AttributeError, RuntimeError):  # transformers not imported, or another version
        return table
    table[fallback] = _grouped_mm
    return table
