"""Op-level sharding strategies, generated from dim signatures.

For each mesh axis an op may (DESIGN.md §4, as DTensor's einsum strategies do per axis):

- replicate: every input and output is whole on this axis;
- split a splittable label: inputs and outputs whose dims carry the label are sharded on
  it; if no output carries it (a contracted or reduced label), the outputs are partial sums
  over the axis, and an input without the label that is added into the result (it shares a
  linear group with an input that has the label, like a bias) must be partial too, so that
  it is counted once;
- pass partial sums through a linear group: the group's inputs are partial, the others
  replicated, and the outputs partial (add of two partials; a view of a partial).

The product over axes gives the op's strategies; axes that split the same label split it
in mesh order (outer axis major). Strategies whose splits do not divide the sizes are left
out.
"""

from __future__ import annotations

import functools
import itertools
import math
from dataclasses import dataclass

from pxform.core.ir import Op
from pxform.core.layout import Layout
from pxform.core.mesh import AbstractMesh
from pxform.ops.registry import rule_info
from pxform.ops.signature import Signature

REPLICATE = ("replicate",)


@dataclass(frozen=True, slots=True)
class Strategy:
    """What an op does on each mesh axis, and the layouts it needs and produces.

    `choices[i]` pairs a mesh axis with `("replicate",)`, `("split", label)` or
    `("partial", group)` where `group` indexes `Signature.linear`.
    """

    choices: tuple[tuple[str, tuple], ...]
    inputs: tuple[Layout, ...]
    outputs: tuple[Layout, ...]

    def __str__(self) -> str:
        parts = []
        for axis, choice in self.choices:
            if choice[0] == "split":
                parts.append(f"{axis}: split {choice[1]}")
            elif choice[0] == "partial":
                parts.append(f"{axis}: partial via {sorted(choice[1])}")
            else:
                parts.append(f"{axis}: replicate")
        return "; ".join(parts)

    def is_replicated(self) -> bool:
        return all(c == REPLICATE for _, c in self.choices)


def strategies(op: Op | Signature, mesh: AbstractMesh) -> list[Strategy]:
    """Every valid strategy of `op` (or of a signature) on `mesh`.

    Example:
        >>> [str(s) for s in strategies(linear_op, AbstractMesh({"tp": 2}))][:3]
        ['tp: replicate', 'tp: split a', 'tp: split b']
    """
    sig = op if isinstance(op, Signature) else rule_info(op).signature
    options: list[tuple] = [REPLICATE]
    options += [("split", lb) for lb in sorted(sig.splittable(), key=sig.labels().index)]
    options += [("partial", group) for group in sig.linear]
    out = []
    for combo in itertools.product(options, repeat=len(mesh.names)):
        strategy = build_strategy(sig, mesh, combo)
        if strategy is not None:
            out.append(strategy)
    return out


@functools.lru_cache(maxsize=1 << 15)  # the search asks for the same few again and again
def build_strategy(sig: Signature, mesh: AbstractMesh, combo: tuple) -> Strategy | None:
    """The strategy making choice `combo[i]` on mesh axis `i` (`REPLICATE`, `("split",
    label)` or `("partial", group)`); None when a split does not divide its dim."""
    splits: dict[str, list[str]] = {}  # label -> axes splitting it, outer to inner
    for axis, choice in zip(mesh.names, combo):
        if choice[0] == "split":
            splits.setdefault(choice[1], []).append(axis)
    for label, axes in splits.items():
        if sig.size(label) % math.prod(mesh.axis_size(a) for a in axes):
            return None
    out_labels = {lb for t in sig.outputs for term in t for lb in term}

    def layout(tensor: tuple, index: int | None) -> Layout:
        dims = tuple(tuple(splits.get(term[0], ())) if term else () for term in tensor)
        partial = set()
        has = {lb for term in tensor for lb in term}
        for axis, choice in zip(mesh.names, combo):
            if choice[0] == "partial":
                if index is None or index in choice[1]:
                    partial.add(axis)
            elif choice[0] == "split" and choice[1] not in out_labels:
                label = choice[1]
                if index is None:
                    partial.add(axis)  # outputs of a contraction are partial sums
                elif label not in has and _added_into(sig, index, label):
                    partial.add(axis)
        return Layout(dims, frozenset(partial))

    inputs = tuple(layout(t, i) for i, t in enumerate(sig.inputs))
    outputs = tuple(layout(t, None) for t in sig.outputs)
    return Strategy(tuple(zip(mesh.names, combo)), inputs, outputs)


def _added_into(sig: Signature, index: int, label: str) -> bool:
    """Is input `index` (which lacks `label`) added to terms that carry `label`? True when
    it shares a linear group with an input that has the label (bias of linear/addmm)."""
    for group in sig.linear:
        if index in group and any(
                label in {lb for term in sig.inputs[j] for lb in term} for j in group):
            return True
    return False


def strategy_for(op: Op, mesh: AbstractMesh, combo: tuple) -> Strategy:
    """`op`'s strategy making choice `combo[i]` on mesh axis `i`; when that does not fit
    (a split that does not divide), the strategy agreeing with `combo` on most axes (the
    first such in `strategies` order, so the result is deterministic).

    Example:
        >>> strategy_for(linear_op, AbstractMesh({"dp": 2, "tp": 2}),
        ...              (("split", "b"), ("split", "n")))
    """
    s = build_strategy(rule_info(op).signature, mesh, combo)
    if s is not None:
        return s
    best: tuple[int, Strategy] | None = None
    for cand in strategies(op, mesh):
        score = sum(1 for (_, c), w in zip(cand.choices, combo) if c == w)
        if best is None or score > best[0]:
            best = (score, cand)
    assert best is not None  # replicating everywhere always fits
    return best[1]


def choice_text(choice: tuple) -> str:
    """A per-axis choice as plans store it: "r" (replicate), "s:<label>" (split the
    label), "p:<i>,<j>" (partial through linear group <i>,<j>).

    Example:
        >>> choice_text(("split", "b")), choice_text(("partial", frozenset({0, 1})))
        ('s:b', 'p:0,1')
    """
    if choice[0] == "split":
        return f"s:{choice[1]}"
    if choice[0] == "partial":
        return "p:" + ",".join(str(i) for i in sorted(choice[1]))
    return "r"


def parse_choice(text: str) -> tuple:
    """The choice `choice_text` wrote.

    Raises:
        ValueError: `text` is not a choice.
    """
    if text == "r":
        return REPLICATE
    kind, _, rest = text.partition(":")
    if kind == "s" and rest:
        return ("split", rest)
    if kind == "p" and rest:
        return ("partial", frozenset(int(i) for i in rest.split(",")))
    raise ValueError(f"{text!r} is not a strategy choice (r, s:<label> or p:<i>,<j>)")
