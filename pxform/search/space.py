"""The search space: device layouts of a stage and per-block options.

A configuration fixes the pipeline degree `p`, the stage mesh and the microbatch count.
The stage mesh has at most two axes, ordered from the slowest link to the fastest (rank
layout row-major, as `pxform.Mesh` lays ranks out):

    outer   groups span `outer x inner` consecutive ranks: across nodes when that exceeds
            a node
    inner   groups of `inner` consecutive ranks: inside a node (inner <= devices per node)

A block option gives each axis a role (Galvatron's decision tree): the outer axis is data
(`dp`) or sharded data (`sdp`); the inner axis is tensor (`tp`), tensor with sequence
parallelism between blocks (`sp`: the values crossing blocks stay split over the axis
along their sequence dim, Megatron-LM's layout), or the same data role as the outer one
(mixing DP and SDP on one block is never better than SDP alone, Galvatron-BMW §3.2, so
that branch is pruned); tensor parallelism across nodes is not offered (its activation
all-reduces on the slow link lose to data parallelism there in every published
configuration). Each option is taken with recompute off and on; one with sharded data and
no recompute is also taken keeping its gathered parameters from forward to backward
(`Option.reshard`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

from pxform.core.mesh import AbstractMesh
from pxform.search.plan import TENSOR_ROLES, strategy_text

OUTER = "outer"
INNER = "inner"
PP = "pp"


@dataclass(frozen=True)
class Option:
    """One block's strategy: a role per stage-mesh axis, recompute, and whether ZeRO-3's
    gathered parameters are freed after forward and gathered again for backward
    (`reshard`, FSDP2's `reshard_after_forward`: True unless the block has an `sdp` axis
    and no recompute, where False keeps them, one copy per microbatch in flight, and saves
    backward's gathers)."""

    roles: tuple[tuple[str, str], ...]   # (axis, "dp" | "sdp" | "tp" | "sp")
    recompute: bool
    reshard: bool = True

    def __post_init__(self) -> None:
        if not self.reshard and (self.recompute or not self.sdp_axes):
            # a recomputed block gathers again in backward anyway; without sdp nothing is
            # gathered: one spelling per strategy, so that equal strategies compare equal
            raise ValueError(f"Option {self.text()}: keeping gathered parameters needs an "
                             f"sdp axis and no recompute")

    def role(self, axis: str) -> str | None:
        return dict(self.roles).get(axis)

    @cached_property
    def data_axes(self) -> tuple[str, ...]:
        return tuple(a for a, r in self.roles if r in ("dp", "sdp"))

    @cached_property
    def sdp_axes(self) -> tuple[str, ...]:
        return tuple(a for a, r in self.roles if r == "sdp")

    @cached_property
    def tensor_axis(self) -> str | None:
        """The axis splitting ops (`tp`, or `sp`: tensor parallel with sequence
        parallelism between blocks)."""
        return next((a for a, r in self.roles if r in TENSOR_ROLES), None)

    @property
    def sequence_parallel(self) -> bool:
        """Whether the values crossing into and out of the block are split over the
        tensor axis along their sequence dim (Megatron's sequence parallelism: norms and
        residual adds on a share of the tokens, an all-gather before the first split
        matmul and a reduce-scatter after the last, in place of an all-reduce)."""
        return any(r == "sp" for _, r in self.roles)

    def text(self) -> str:
        return strategy_text(self.roles, self.recompute, self.reshard)


@dataclass(frozen=True)
class Config:
    """Pipeline degree, stage mesh and microbatches."""

    stages: int
    outer: int
    inner: int
    microbatches: int

    @cached_property
    def stage_mesh(self) -> AbstractMesh:
        axes = [(OUTER, self.outer), (INNER, self.inner)]
        kept = tuple((n, s) for n, s in axes if s > 1)
        return AbstractMesh(kept or ((OUTER, 1),))

    @property
    def devices(self) -> int:
        return self.stages * self.outer * self.inner

    def text(self) -> str:
        return (f"pp={self.stages} {OUTER}={self.outer} {INNER}={self.inner} "
                f"microbatches={self.microbatches}")


def options(config: Config, sequence_parallel: bool = True) -> list[Option]:
    """Every block option on `config`'s stage mesh (module doc); the `sp` role only with
    `sequence_parallel`."""
    o, i = config.outer, config.inner
    combos: list[tuple[tuple[str, str], ...]] = []
    tensor = TENSOR_ROLES if sequence_parallel else ("tp",)
    if o > 1 and i > 1:
        for kind in ("dp", "sdp"):
            combos.append(((OUTER, kind), (INNER, kind)))
            combos += [((OUTER, kind), (INNER, t)) for t in tensor]
    elif o > 1:
        combos += [((OUTER, "dp"),), ((OUTER, "sdp"),)]
    elif i > 1:
        combos += [((INNER, "dp"),), ((INNER, "sdp"),)] + [((INNER, t),) for t in tensor]
    else:
        combos.append(())
    out = [Option(r, rc) for r in combos for rc in (False, True)]
    return out + [Option(r, False, False) for r in combos if any(x == "sdp" for _, x in r)]


def powers_of_two(n: int) -> Iterator[int]:
    k = 1
    while k <= n:
        if n % k == 0:
            yield k
        k *= 2


def configs(devices: int, devices_per_node: int, num_blocks: int, batch: int,
            stages: int | None = None, microbatches: int | None = None,
            microbatching: bool = True) -> list[Config]:
    """The configurations tried (without `microbatching`, when the batch cannot be cut,
    no pipeline): pipeline degrees and inner sizes that are powers of two
    dividing the device count (inner within a node, at most one stage per block), and a
    few microbatch counts per pipeline degree: 1 without a pipeline, else p, 2p, 4p, 8p
    and the largest, one sample per data-parallel replica (all axes data, or the outer
    one only) (Galvatron-BMW's finding: search
    time is dominated by the microbatch dimension, so not every divisor; the largest
    matters at high pipeline degrees, where the 1F1B bubble (p - 1)/(m + p - 1) is still
    big at 4p). The cost model has no per-microbatch efficiency loss beyond collective
    latency, so it favours many small microbatches; real kernels lose efficiency on tiny
    ones.)"""
    out = []
    for p in ([stages] if stages else powers_of_two(devices)):
        if devices % p or p > num_blocks or (p > 1 and not microbatching):
            continue
        rest = devices // p
        for inner in powers_of_two(min(rest, devices_per_node)):
            if rest % inner:
                continue
            outer = rest // inner
            if microbatches:
                counts = [microbatches]
            elif p == 1:
                counts = [1]
            else:
                # and the most there can be: one sample per data-parallel replica
                counts = sorted({p, 2 * p, 4 * p, 8 * p, batch // rest, batch // outer})
                counts = [m for m in counts if p <= m <= batch]
            for m in counts:
                if batch % m == 0:
                    out.append(Config(p, outer, inner, m))
    return out
