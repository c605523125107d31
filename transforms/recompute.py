"""`pxform.recompute` and `pxform.checkpoint_name`: trade compute for activation memory.

Inside a pxform transform (`shard`, `pipeline`, `value_and_grad` of those) a recompute
region only annotates the trace; the lowering and runtime (`pxform.lower.regions`,
`pxform.runtime.graph_module`) run the region under activation checkpointing: its
activations are dropped after forward and recomputed in backward, except those the policy
saves. Collectives inside the region (tensor parallelism, ZeRO-3 gathers) run again on
recompute. Called eagerly on plain tensors, the function is traced once per signature and
run the same way on this process, so the single-process reference uses the same code path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import optree
import torch

from pxform.frontend.regions import (
    RECOMPUTE,
    Policy,
    RecomputeTag,
    make_policy,
    mark,
    next_region,
    tagging,
)
from pxform.frontend.trace import is_tracing
from pxform.transforms.base import Region


@dataclass(frozen=True, eq=False)
class Recomputed(Region):
    """`pxform.recompute(fn, policy)`: the activations `fn` makes are dropped after forward
    and made again in backward, but for those `policy` saves."""

    label: ClassVar[str] = "recompute"

    fn: Any
    policy: Policy
    _cache: dict = field(default_factory=dict, repr=False)

    def options_text(self) -> str:
        return f", policy={self.policy}"

    def traced_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tag = RecomputeTag(next_region(), self.policy, getattr(self.fn, "__name__", "fn"))
        with tagging(RECOMPUTE, tag, f"pxform.{self.__name__}"):
            return self.fn(*args, **kwargs)


def recompute(fn: Any, policy: Any = None) -> Recomputed:
    """Run `fn` with activation recomputation: the activations it produces are dropped after
    forward and recomputed in backward.

    Args:
        fn: a pure function of pytrees of tensors (typically one layer).
        policy: what to keep instead of recomputing:
            None or "nothing": save nothing but the region's inputs (the default);
            "matmuls": save the outputs of matmul-like ops (linear, matmul, bmm, einsum,
                attention), so recompute redoes only the cheap ops between them;
            a list of names: save the values marked `pxform.checkpoint_name(x, name)`;
            a function `op -> bool` over IR ops (`pxform.Op`: `.name`, `.module`,
            `.outputs`): save the outputs of ops for which it returns True.

    Regions nest by merging into the outermost. The transform composes with `shard` (the
    region's collectives run again on recompute) and `pipeline` (per stage and microbatch).

    Example:
        >>> block_ckpt = pxform.recompute(block, policy="matmuls")
        >>> def loss_fn(params, x):
        ...     for p in params["blocks"]:
        ...         x = block_ckpt(p, x)
        ...     return x.pow(2).mean()
        >>> loss, grads = pxform.value_and_grad(loss_fn)(params, x)
    """
    name = getattr(fn, "__name__", "fn")
    return Recomputed(fn, make_policy(policy, f"pxform.recompute({name})"))


def checkpoint_name(x: Any, name: str) -> Any:
    """Name `x` (a tensor or a pytree of tensors) for a recompute policy: inside
    `pxform.recompute(fn, policy=[name, ...])` the op producing it keeps its output.
    Returns `x` (outside a trace, `x` itself).

    Example:
        >>> def block(p, x):
        ...     h = pxform.checkpoint_name(attention(p, x), "attn")
        ...     return mlp(p, h)
        >>> pxform.recompute(block, policy=["attn"])
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"pxform.checkpoint_name: name must be a non-empty string, got {name!r}")
    if not is_tracing():
        return x
    return optree.tree_map(lambda t: mark(t, "name:" + name) if isinstance(t, torch.Tensor)
                           else t, x)
