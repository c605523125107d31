"""`module_init`: an `nn.Module` built on `meta` as an initialiser function.

FSDP2 and torchtitan build a model on `meta`, shard it, move it to devices with `to_empty`
and then call `init_weights`. pxform needs none of those steps: `module_init(model)` is a
function returning the model's parameters and buffers (the dict `pxform.module_fn` takes),
and `step.init(module_init(model))` runs it where the parameters live, each rank computing
only its own pieces.

The function runs the module's own initialisation on fresh tensors swapped into the
module (`torch.nn.utils.stateless`), so the module is never changed:

- a Hugging Face model: `initialize_weights()` (its `_init_weights` per submodule, which
  also computes buffers such as rotary frequencies);
- a module with `init_weights()` (torchtitan's convention): that;
- otherwise every submodule's `reset_parameters()` (what `nn.Linear`, `nn.Embedding`,
  `nn.LayerNorm` define), as FSDP's default `param_init_fn` does.

In-place init calls (`nn.init.normal_`, `weight[pad].zero_()`) are functionalised by the
trace. A tensor the initialisation never writes would hold garbage: it is refused with its
name and the fix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from pxform.core.errors import TraceError

_HF_FLAG = "_is_hf_initialized"


def module_init(module: torch.nn.Module) -> Callable[[], dict[str, torch.Tensor]]:
    """An initialiser for `module` (typically built on `meta`): a function of no arguments
    returning `{qualified name: tensor}` for every parameter and buffer, with the values
    the module's own initialisation gives (module doc), as `pxform.module_fn` names them.

    Example:
        >>> with torch.device("meta"):
        ...     model = LlamaForCausalLM(config)
        >>> fn, params = pxform.module_fn(model)
        >>> step = pxform.shard(loss_of(fn), mesh=mesh, in_specs=(zero3(params), P("dp")))
        >>> params = step.init(pxform.module_init(model))   # each rank: its shards only
    """
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"pxform.module_init: expected an nn.Module, got "
                        f"{type(module).__name__}")
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in module.named_parameters()}
    shapes.update((name, (tuple(t.shape), t.dtype)) for name, t in module.named_buffers())
    label = type(module).__name__

    def init() -> dict[str, torch.Tensor]:
        tensors = {name: torch.empty(shape, dtype=dtype) for name, (shape, dtype)
                   in shapes.items()}
        versions = {name: t._version for name, t in tensors.items()}
        from torch.nn.utils.stateless import _reparametrize_module

        with _reparametrize_module(module, tensors, tie_weights=True, strict=False), \
                _hf_flags_kept(module), torch.no_grad():
            _run_init(module)
        unset = [name for name, t in tensors.items() if t._version == versions[name]]
        if unset:
            shown = ", ".join(f"{n} ({_type_text(tensors[n])})" for n in unset[:5])
            more = f" and {len(unset) - 5} more" if len(unset) > 5 else ""
            raise TraceError(
                f"pxform.module_init({label}): the module's initialisation never sets "
                f"{shown}{more}; they would hold whatever memory held.\n  Fix: give the "
                f"owning module a reset_parameters() (or the model an init_weights()) that "
                f"sets them, or load them with pxform.load_checkpoint(path, like=params).")
        return tensors

    init.__name__ = f"init_{label}"
    init.__qualname__ = init.__name__
    return init


def _run_init(module: torch.nn.Module) -> None:
    """The module's own initialisation (module doc)."""
    if callable(getattr(module, "initialize_weights", None)) and hasattr(module, "config"):
        module.initialize_weights()  # type: ignore[operator]  # HF: _init_weights per submodule
        return
    if callable(getattr(module, "init_weights", None)):
        module.init_weights()  # type: ignore[operator]
        return
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None)
        if callable(reset):
            reset()


@contextmanager
def _hf_flags_kept(module: torch.nn.Module) -> Iterator[None]:
    """Hugging Face marks modules and tensors it initialised (`_is_hf_initialized`) and
    skips them next time; the marks are removed afterwards, so every call of the
    initialiser (every trace) initialises everything again."""
    before = {id(m) for m in module.modules() if hasattr(m, _HF_FLAG)}
    try:
        yield
    finally:
        for m in module.modules():
            if id(m) not in before and hasattr(m, _HF_FLAG):
                try:
                    delattr(m, _HF_FLAG)
                except AttributeError:
                    pass


def _type_text(t: Any) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
