"""`pxform.value_and_grad`: `(value, grads)` of a scalar function.

On a `pxform.shard`-transformed function the backward pass runs by autograd over the
lowered per-rank program (its conversions carry the gradient collectives), and gradients
come back laid out like the arguments (DTensors). `torch.func.grad` cannot be used there:
it does not work across collectives. On a plain function it is ordinary autograd.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from pxform.core.errors import PxformError
from pxform.frontend.trace import collect_buffers
from pxform.transforms.base import Executable


def value_and_grad(fn: Callable[..., Any], argnums: int | tuple[int, ...] = 0,
                   has_aux: bool = False) -> Callable[..., tuple[Any, Any]]:
    """Return a function computing `fn(*args)` and its gradient w.r.t. `args[argnums]`.

    Args:
        fn: returns a scalar tensor, or `(scalar, aux)` with `has_aux=True`.
        argnums: which positional arguments to differentiate (an int or a tuple).
        has_aux: `fn` returns `(value, aux)`; the result is `((value, aux), grads)`.

    Example:
        >>> loss, grads = pxform.value_and_grad(loss_fn)(params, batch)
        >>> grads["w1"].shape == params["w1"].shape
        True
    """
    nums = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    name = getattr(fn, "__name__", "fn")

    def wrapped(*args: Any) -> tuple[Any, Any]:
        for n in nums:
            if not 0 <= n < len(args):
                raise PxformError(f"pxform.value_and_grad({name}): argnums {nums} but the "
                                  f"function was called with {len(args)} arguments")
        if isinstance(fn, Executable):  # shard, pipeline, auto: they run per rank
            value, grads = fn.run(args, nums)
            if has_aux and not (isinstance(value, tuple) and len(value) == 2):
                raise PxformError(f"pxform.value_and_grad({name}, has_aux=True): the function "
                                  f"must return (value, aux), got {type(value).__name__}")
            if not has_aux and not isinstance(value, torch.Tensor):
                raise PxformError(f"pxform.value_and_grad({name}): the function must return "
                                  f"a scalar tensor, got {type(value).__name__}; return "
                                  f"(value, aux) with has_aux=True")
            return value, grads
        return _plain(fn, args, nums, has_aux, name)

    wrapped.__name__ = f"value_and_grad({name})"
    return wrapped


def _plain(fn: Callable[..., Any], args: tuple[Any, ...], nums: tuple[int, ...],
           has_aux: bool, name: str) -> tuple[Any, Any]:
    args = list(args)  # type: ignore[assignment]
    leaves_per_arg = {}
    for n in nums:
        # PyTorch's mark of a trainable tensor: where some floating leaf of the argument
        # requires grad, only those are differentiated (frozen parameters and module
        # buffers are not); an argument of plain tensors has every floating leaf
        floating = [x for x in optree.tree_leaves(args[n])  # type: ignore[index]
                    if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
        marked = any(x.requires_grad for x in floating)

        def prep(x: Any, marked: bool = marked) -> Any:
            if isinstance(x, torch.Tensor) and x.dtype.is_floating_point \
                    and (x.requires_grad or not marked):
                return x.detach().requires_grad_(True)
            if isinstance(x, torch.Tensor):
                return x.detach()
            return x

        args[n] = optree.tree_map(prep, args[n])  # type: ignore[index]
        leaves_per_arg[n] = optree.tree_leaves(args[n])  # type: ignore[index]
    with torch.enable_grad(), collect_buffers() as buffers:
        out = fn(*args)
    state = {id(b) for b in buffers}  # module buffers `module_fn` read: never trainable
    value, aux = (out if has_aux else (out, None))
    if not (isinstance(value, torch.Tensor) and value.dim() == 0):
        raise PxformError(f"pxform.value_and_grad({name}): the function must return a scalar "
                          f"tensor, got {getattr(value, 'shape', type(value).__name__)}")

    def wants(x: Any) -> bool:
        return isinstance(x, torch.Tensor) and x.requires_grad and id(x) not in state

    wanted = [x for n in nums for x in leaves_per_arg[n] if wants(x)]
    # a value that does not depend on the arguments has zero gradients
    grads = iter(torch.autograd.grad(value, wanted, allow_unused=True)
                 if wanted and value.requires_grad else [None] * len(wanted))
    per_arg = []
    for n in nums:
        def pick(x: Any) -> Any:
            if wants(x):
                g = next(grads)
                return torch.zeros_like(x) if g is None else g
            return None

        per_arg.append(optree.tree_map(pick, args[n]))  # type: ignore[index]
    grads_out = per_arg[0] if len(per_arg) == 1 else tuple(per_arg)
    return ((value.detach(), aux) if has_aux else value.detach()), grads_out
