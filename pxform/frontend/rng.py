"""Random ops in the IR: which ops draw random numbers, and the tag that makes their numbers
independent of the plan.

pxform draws random numbers from a counter-based stream (`pxform.core.rng`): the value
at a position is a function of (seed, op key, global element index) only. The seed comes
from torch's generator once per call of a step; the op key and the position are fixed here,
at trace time, so nothing a plan does (sharding, microbatches, coshard pieces, recompute,
pipeline stages) can change them:

- the op key is the op's rank among the random ops of the trace (the user's program order);
- the position of an element is its index in the op's output as traced (the global
  shape). Passes that rewrite an op to produce a piece of that output (coshard) append a
  `PieceMap` per dim saying where the piece's elements were.
"""

from __future__ import annotations

from pxform.core.ir import Op
from pxform.core.rng import RandomTag
from pxform.ops import bind

RANDOM = "pxform.random"
"""Tag key of ops that draw random numbers (value: `RandomTag`)."""

INPLACE = "pxform.inplace"
"""Tag key of the functional form of a user's in-place op (`w.normal_()` ->
`normal_functional(w)`): its first input is never read again, so the runtime may write the
result into it instead of allocating (an initialiser then needs no second copy of a
shard)."""

RANDOM_OPS = frozenset({
    "dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout", "native_dropout",
    "bernoulli", "rand", "randn", "randint", "rand_like", "randn_like", "randint_like",
    "normal", "normal_functional", "uniform", "randperm", "exponential", "geometric",
    "log_normal", "cauchy", "random", "multinomial",
})
"""Short names of the aten ops that draw random numbers."""

PLAN_INDEPENDENT = frozenset({
    "dropout", "native_dropout", "feature_dropout", "alpha_dropout", "feature_alpha_dropout",
    "bernoulli", "rand", "rand_like", "randn", "randn_like", "normal", "normal_functional",
    "uniform", "randint", "randint_like", "random", "exponential", "geometric", "log_normal",
    "cauchy", "randperm",
})
"""Random ops the runtime draws from the plan-independent stream (`pxform.core.rng`);
the others (`multinomial`) draw from torch's generator and are refused where ranks would
disagree."""


def is_random(op: Op) -> bool:
    """Does `op` draw random numbers (a dropout that drops nothing does not)?"""
    if op.name not in RANDOM_OPS:
        return False
    if op.name.endswith("dropout"):
        args = bind(op)
        if args.get("p") == 0 or args.get("train") is False:
            return False
    return True


def tag_random(ops: list[Op]) -> list[Op]:
    """`ops` with every random op tagged with its key and traced output shape, in order."""
    out = []
    key = 0
    for op in ops:
        if is_random(op) and op.outputs:
            op = op.replace(tags=op.tags + ((RANDOM, RandomTag(key, op.outputs[0].type.shape)),))
            key += 1
        out.append(op)
    return out
