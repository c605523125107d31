"""Dim signatures: how an op's tensor dims relate, and so how it behaves under sharding.

A signature is einsum-like text, one term per tensor dim, inputs before `->`:

    linear   "b k, n k, n -> b n"
    softmax  "a ^c -> a ^c"            # ^c: splitting c needs communication
    reshape  "a (h e) -> a h e"        # a merged dim: its major label h may be split
    add      "a 1 c, a b c -> a b c"   # 1: a size-1 dim that broadcasts
    loss     "n ^c, n -> ()"           # (): a scalar

Reading it for sharding (DESIGN.md §4): splitting a label that reaches an output shards that
output; splitting a label that appears only in inputs (a contracted or reduced label, `k`
above) makes the outputs partial sums; `^` labels are never split; within a merged term only
the major label may be split (splitting a minor one would give a strided, not contiguous,
shard). `linear` lists the groups of inputs in which the op is jointly linear, which is what
lets partial sums flow through it (add: `{0, 1}`; mul: `{0}` and `{1}`; gelu: none).

Signatures here are concrete: batch-like ellipses are expanded to one label per dim and
every label has a size, so a signature also infers its outputs' shapes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pxform.core.errors import RuleError

Term = tuple[str, ...]
"""One tensor dim: its labels, major to minor. `()` is a size-1 (broadcast) dim."""

_TOKEN = re.compile(r"\(([^)]*)\)|(\S+)")


@dataclass(frozen=True, slots=True)
class Signature:
    """A concrete dim signature with label sizes.

    Example:
        >>> sig = Signature.parse("b k, n k -> b n", b=8, k=16, n=32)
        >>> sig.output_shapes()
        ((8, 32),)
        >>> sorted(sig.contracted())
        ['k']
    """

    inputs: tuple[tuple[Term, ...], ...]
    outputs: tuple[tuple[Term, ...], ...]
    sizes: tuple[tuple[str, int], ...]
    fixed: frozenset[str] = frozenset()
    linear: tuple[frozenset[int], ...] = ()

    def __post_init__(self) -> None:
        known = dict(self.sizes)
        for tensor in self.inputs + self.outputs:
            for term in tensor:
                for label in term:
                    if label not in known:
                        raise RuleError(f"Signature {self}: label {label!r} has no size")
        for group in self.linear:
            for i in group:
                if not 0 <= i < len(self.inputs):
                    raise RuleError(f"Signature {self}: linear group names input {i}, but "
                                    f"there are {len(self.inputs)} inputs")

    @staticmethod
    def make(inputs: Sequence[Sequence[Sequence[str]]],
             outputs: Sequence[Sequence[Sequence[str]]], sizes: dict[str, int],
             fixed: set[str] | frozenset[str] = frozenset(),
             linear: Sequence[set[int] | frozenset[int]] = ()) -> Signature:
        """Build a signature from lists; unused sizes are dropped, so rules may over-supply."""
        used = {lb for t in [*inputs, *outputs] for term in t for lb in term}
        return Signature(
            tuple(tuple(tuple(term) for term in t) for t in inputs),
            tuple(tuple(tuple(term) for term in t) for t in outputs),
            tuple(sorted((k, int(v)) for k, v in sizes.items() if k in used)),
            frozenset(fixed) & frozenset(used),
            tuple(frozenset(g) for g in linear),
        )

    @staticmethod
    def parse(text: str, linear: tuple[frozenset[int], ...] = (), **sizes: int) -> Signature:
        """Parse the text form; `sizes` gives every label's size."""
        if "->" not in text:
            raise RuleError(f"Signature.parse: {text!r} has no '->'")
        lhs, rhs = text.split("->")
        fixed: set[str] = set()

        def tensors(side: str) -> list[list[Term]]:
            out: list[list[Term]] = []
            for part in side.split(","):
                part = part.strip()
                if part == "()":
                    out.append([])
                    continue
                terms: list[Term] = []
                for merged, single in _TOKEN.findall(part):
                    names = merged.split() if merged else [single]
                    labels = []
                    for name in names:
                        if name == "1":
                            continue
                        if name.startswith("^"):
                            name = name[1:]
                            fixed.add(name)
                        labels.append(name)
                    terms.append(tuple(labels))
                out.append(terms)
            return out

        ins, outs = tensors(lhs), tensors(rhs)
        return Signature.make(ins, outs, sizes, fixed, linear)

    def size(self, label: str) -> int:
        for k, v in self.sizes:
            if k == label:
                return v
        raise KeyError(label)

    def term_size(self, term: Term) -> int:
        return math.prod(self.size(lb) for lb in term)

    def input_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.term_size(t) for t in ts) for ts in self.inputs)

    def output_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(self.term_size(t) for t in ts) for ts in self.outputs)

    def labels(self) -> list[str]:
        """All labels, in order of first appearance."""
        seen: dict[str, None] = {}
        for tensor in self.inputs + self.outputs:
            for term in tensor:
                for lb in term:
                    seen.setdefault(lb, None)
        return list(seen)

    def contracted(self) -> frozenset[str]:
        """Splittable labels that reach no output: splitting one makes the outputs partial."""
        out_labels = {lb for t in self.outputs for term in t for lb in term}
        return frozenset(lb for lb in self.splittable() if lb not in out_labels)

    def splittable(self) -> frozenset[str]:
        """Labels that may be split: not `^`, and never a minor part of a merged dim."""
        minor = {lb for t in self.inputs + self.outputs for term in t for lb in term[1:]}
        return frozenset(lb for lb in self.labels() if lb not in self.fixed and lb not in minor)

    def __str__(self) -> str:
        def fmt_term(term: Term) -> str:
            names = ["^" + lb if lb in self.fixed else lb for lb in term]
            if not names:
                return "1"
            return names[0] if len(names) == 1 else "(" + " ".join(names) + ")"

        def fmt(tensors: tuple[tuple[Term, ...], ...]) -> str:
            return ", ".join(" ".join(fmt_term(t) for t in ts) if ts else "()" for ts in tensors)

        return f"{fmt(self.inputs)} -> {fmt(self.outputs)}"


class LabelMaker:
    """Hands out fresh labels a, b, c, ... z, a1, b1, ... for one rule application."""

    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n = 0

    def __call__(self) -> str:
        n, self._n = self._n, self._n + 1
        letter = chr(ord("a") + n % 26)
        return letter if n < 26 else f"{letter}{n // 26}"

    def many(self, count: int) -> list[str]:
        return [self() for _ in range(count)]
