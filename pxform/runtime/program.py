"""Running a lowered `Program` on this rank, with autograd.

`execute` evaluates a program on local tensors: its fx GraphModule (`module_of(program)`,
built once per program) inside `with_groups(axes, buckets)`. `run_spmd` is what `pxform.shard`
runs: the arguments' local pieces in, the outputs and gradients out as the API gives them
(DTensors where sharded), parameter gradients reduced in buckets during backward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Replicate

from pxform.core.errors import SpecError
from pxform.core.ir import block_name
from pxform.core.layout import Layout
from pxform.lower.spmd import Program
from pxform.passes.propagate import gradient_layout
from pxform.runtime.boundary import (
    is_dtensor,
    leaf_arg_index,
    local_input,
    regroup_grads,
    to_dtensor,
    wrap_output,
)
from pxform.runtime.buckets import BucketStats, GradBuckets, GradSink
from pxform.runtime.collectives import AxisGroups
from pxform.runtime.graph_module import draw_seeds, hook_gradients, module_of, with_groups
from pxform.runtime.mesh import Mesh
from pxform.runtime.prefetch import Prefetch, gather_plan
from pxform.runtime.reshard import Reshard, reshard_after_forward, reshard_when


def execute(program: Program, inputs: Sequence[torch.Tensor], axes: AxisGroups,
            buckets: GradSink | None = None, reshard: Reshard = False) -> list[Any]:
    """Evaluate `program` on local input shards; returns local outputs. With `buckets`,
    gradients of inputs that need a collective are left to `buckets.finish()`. A program
    with random ops draws new seeds from torch's generators (`draw_seeds`: once per call,
    the same on every rank seeded alike). With `reshard`, parameters the program gathers
    (ZeRO-3) are freed after their forward use and gathered again in backward."""
    plan = gather_plan(program)
    prefetch = Prefetch(plan, axes, inputs) if plan.groups else None
    if isinstance(buckets, GradBuckets) and torch.is_grad_enabled():
        module = module_of(program, hooked=True)
        hook_gradients(module, inputs, buckets)
    else:
        module = module_of(program)
    # without parameter gathers there is nothing to reshard: no saved-tensor hooks (they
    # would run Python for every tensor autograd saves)
    with with_groups(axes, buckets, draw_seeds([program]), prefetch), \
            reshard_after_forward(reshard_when(reshard, bool(plan.groups))):
        return list(module(*inputs))


@dataclass(frozen=True)
class SpmdResult:
    """What `run_spmd` returns: the value (outputs as the function returns them, DTensors
    where sharded), the gradients (None without `grad_argnums`) and what the gradient
    buckets did."""

    value: Any
    grads: Any
    bucket_stats: BucketStats | None


def write_state(leaves: Sequence[torch.Tensor], values: Sequence[Any],
                outputs: Sequence[Any], mesh: Mesh) -> None:
    """Write a step's new module state (BatchNorm's running statistics, its batch count)
    into the tensors the caller passed, as the module's in-place update does in eager:
    a full tensor takes the whole value; a DTensor, its own piece of it.

    Example:
        >>> write_state([params["bn.running_mean"]], [new_mean], program.outputs[-1:], mesh)
    """
    with torch.no_grad():
        for leaf, local, out in zip(leaves, values, outputs):
            value = wrap_output(local, out, mesh)
            if is_dtensor(value):
                value = value.full_tensor()  # type: ignore[union-attr]
            if is_dtensor(leaf):
                whole = DTensor.from_local(value, leaf.device_mesh,  # type: ignore[attr-defined]
                                           [Replicate()] * leaf.device_mesh.ndim,  # type: ignore[attr-defined]
                                           run_check=False)
                # replicated to the leaf's placements: each rank keeps its piece, no traffic
                piece = whole.redistribute(leaf.device_mesh,  # type: ignore[attr-defined]
                                           leaf.placements).to_local()  # type: ignore[attr-defined]
                leaf.to_local().copy_(piece)  # type: ignore[attr-defined]
            else:
                leaf.copy_(value)


def run_spmd(program: Program, out_tree: Any, layouts: Sequence[Layout], args: tuple[Any, ...],
             grad_argnums: tuple[int, ...], mesh: Mesh, axes: AxisGroups, bucket_mb: float,
             name: str, reshard: Reshard = True, trainable: Sequence[bool] | None = None,
             state: Sequence[int] = ()) -> SpmdResult:
    """Run `program` on this rank's pieces of `args` (full tensors are sliced, DTensors
    redistributed to `layouts`); with `grad_argnums`, also the gradients of the scalar first
    output with respect to those arguments, laid out like them: DTensors for DTensor
    arguments and for sharded layouts, so `p.grad = g` and torch.optim work directly.
    Parameter-gradient collectives run in buckets of `bucket_mb` MiB during backward.
    With `reshard`, parameters gathered in forward (ZeRO-3) are not kept for backward but
    gathered again there (`pxform.runtime.reshard`). `trainable` (per tensor leaf) leaves
    out of the gradients those it marks False (module buffers, frozen parameters). The
    program's last `len(state)` outputs are the new values of those tensor leaves (module
    buffers a module writes, as BatchNorm's running statistics): they are written into
    the arguments, as eager runs the module (`write_state`), and not returned.

    Example:
        >>> result = run_spmd(program, traced.out_tree, layouts, (params, batch), (0,),
        ...                   mesh, mesh_axes(mesh), 25.0, "shard(loss_fn)")
    """
    leaves, _ = optree.tree_flatten(args, is_leaf=is_dtensor)  # type: ignore[arg-type]
    arg_of_leaf = leaf_arg_index(args)
    local: list[torch.Tensor] = []
    wants: list[bool] = []
    tensor_leaves = [(lf, a) for lf, a in zip(leaves, arg_of_leaf)
                     if isinstance(lf, torch.Tensor)]
    for (leaf, arg_index), layout in zip(tensor_leaves, layouts):
        t = local_input(leaf, layout, axes, mesh.abstract)
        want = (arg_index in grad_argnums and t.dtype.is_floating_point
                and (trainable is None or trainable[len(local)]))
        t = t.detach().requires_grad_(want)
        local.append(t)
        wants.append(want)
    # parameter-gradient collectives go to buckets, launched during backward
    blocks = program.__dict__.get("_input_blocks")  # once per program, not per call
    if blocks is None:
        blocks = program.__dict__["_input_blocks"] = {
            k: block_name(v.name) for k, v in enumerate(program.inputs)}
    buckets = GradBuckets(axes, int(bucket_mb * 2**20), blocks) if grad_argnums else None
    with torch.set_grad_enabled(bool(grad_argnums) or torch.is_grad_enabled()):
        outs = execute(program, local, axes, buckets,
                       reshard=reshard_when(reshard, bool(grad_argnums)))
    num = len(outs) - len(state)  # the function's own outputs; then the new state

    def written(outs: list[Any]) -> list[Any]:
        """The function's outputs, once the state outputs are written back."""
        write_state([tensor_leaves[k][0] for k in state], outs[num:],
                    program.outputs[num:], mesh)
        return outs[:num]

    if not grad_argnums:
        outs = written(outs)
        value = optree.tree_unflatten(out_tree, [
            wrap_output(o, v, mesh) for o, v in zip(outs, program.outputs)])
        return SpmdResult(value, None, None)
    loss = outs[0]
    if not (isinstance(loss, torch.Tensor) and loss.dim() == 0):
        raise SpecError(f"pxform.value_and_grad({name}): the function must return "
                        f"a scalar tensor (its first output), got {type(loss).__name__}")
    needed = [t for t, w in zip(local, wants) if w]
    # a value that does not depend on the arguments has zero gradients
    grads: Any = (torch.autograd.grad(loss, needed, allow_unused=True)
                  if needed and loss.requires_grad else [None] * len(needed))
    assert buckets is not None
    reduced = buckets.finish()  # every bucketed collective has completed here
    # outputs whose all-reduce rode in a bucket (`Convert.output`), and the loss's count
    # (`GlobalCount.final`): the loss was divided by the batch's number of targets M, not
    # the count N of those not ignored, so the loss and every gradient take a factor M / N
    # (exactly 1.0 when nothing is ignored: multiplying by it changes no bit; a tensor, so
    # no device-to-host sync)
    # (state outputs too: a statistic reduced as an output may ride in a bucket)
    outs = written([buckets.values.get(("output", k), o) for k, o in enumerate(outs)])
    count = buckets.values.get(("count", 0))
    factor = None
    # on a CPU count the factor is known without a device sync: when nothing was ignored
    # it is exactly 1.0 and the multiplications (a pass over every gradient) are skipped
    if count is not None and buckets.count_scale is not None and not (
            count.device.type == "cpu" and float(count) == buckets.count_scale):
        factor = buckets.count_scale / count.double()  # in float64: no extra rounding
        outs[0] = outs[0] * factor.to(outs[0].dtype)
    # value_and_grad returns values, not graphs: detached, as on a plain function
    value = optree.tree_unflatten(out_tree, [
        wrap_output(o.detach() if isinstance(o, torch.Tensor) else o, v, mesh)
        for o, v in zip(outs, program.outputs)])
    grad_iter = iter(grads)
    factors: dict[torch.dtype, torch.Tensor] = {}
    wrapped: list[Any] = []
    given = [is_dtensor(leaf) for leaf, _ in tensor_leaves]
    for index, (t, w, layout) in enumerate(zip(local, wants, layouts)):
        if not w:
            wrapped.append(None)
            continue
        g = next(grad_iter)
        if index in buckets.hooked:
            g = None  # autograd's is an expanded zero: the gradient went to the buckets
        ours = g is None and index in reduced  # a bucket's own buffer: may be scaled in place
        if index in reduced:
            g = reduced[index] if g is None else g + reduced[index]
        g = torch.zeros_like(t) if g is None else g
        if factor is not None:
            if g.dtype not in factors:
                factors[g.dtype] = factor.to(g.dtype)
            # autograd's gradients may be expanded views (of a sum's backward): not in place
            g = g.mul_(factors[g.dtype]) if ours else g * factors[g.dtype]
        grad_layout = gradient_layout(layout)
        # like the arguments: DTensors (as `distribute` makes them) get DTensors with
        # the same placements, so `p.grad = g` and torch.optim work on them directly;
        # of full tensors, replicated ones get full tensors, sharded ones DTensors
        wrapped.append(to_dtensor(g, grad_layout, mesh, tensor_leaves[index][0])
                       if given[index] or grad_layout.used_axes() else g)
    return SpmdResult(value, regroup_grads(args, grad_argnums, wrapped), buckets.stats)
