"""Running a lowered `Program` on this rank's local tensors, with autograd.

The program runs as its fx GraphModule (`Program.graph_module`, built once per program)
inside `bind(axes, buckets)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pxform.lower.spmd import Program
from pxform.runtime.buckets import GradSink
from pxform.runtime.collectives import AxisGroups
from pxform.runtime.graph_module import bind


def execute(program: Program, inputs: Sequence[torch.Tensor], axes: AxisGroups,
            buckets: GradSink | None = None) -> list[Any]:
    """Evaluate `program` on local input shards; returns local outputs. With `buckets`,
    gradients of inputs that need a collective are left to `buckets.finish()`."""
    with bind(axes, buckets):
        return list(program.graph_module(*inputs))
