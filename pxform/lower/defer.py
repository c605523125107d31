"""Deferred gradient reductions: a partial gradient stays partial until it reaches a
parameter, whose reduction runs in a gradient bucket (DDP's one all-reduce per bucket).

The conversion rule reduces a gradient where the value's layout says it is replicated: a
replicated value read by a batch-split op (GPT's position embedding, added to every
sequence) gets a partial gradient that its conversion all-reduces in the middle of
backward, on its own, outside the buckets. Every op's backward is linear in the incoming
gradient, and an op that splits nothing over the axis runs the same backward on every rank
of it, so sending it a gradient that is partial over the axis gives input gradients that
are partial over the axis too: the sum over the axis can be taken later, further up. So the
reduction moves up, through ops that split nothing over its axis, until it meets a program
input (a parameter: its conversion's reduction joins a gradient bucket) or a value with no
gradient.

It moves only where every path up ends so: a value read by other ops too would need its
partial gradient added to their replicated ones, and an op with two inputs would turn one
reduction into two. Where it cannot move all the way, nothing changes.

Example:
    >>> program = defer_reductions(program)    # `lower` does this
    >>> # before: %2.1 = convert(%2)  # fwd: identity | bwd: all_reduce(dp)
    >>> # after:  %wpe.d1 = convert(%wpe)  # fwd: identity | bwd: all_reduce(dp)  (bucketed)
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

from pxform.core.ir import Value
from pxform.core.layout import Layout, Relayout, Step
from pxform.lower.spmd import CallInstr, ConvertInstr, Instr, Program
from pxform.passes.propagate import layout_of

# how far up one reduction is followed before giving up (chains of replicated ops are short)
_MAX_DEPTH = 64


def defer_reductions(program: Program) -> Program:
    """`program` with every gradient all-reduce that can move up to parameters moved
    there (module doc). Programs without such reductions come back unchanged."""
    instrs = list(program.instrs)
    k = len(instrs) - 1
    changed = False
    facts: _Facts | None = None  # rebuilt only after the instructions change
    while k >= 0:
        c = instrs[k]
        if isinstance(c, ConvertInstr) and _ends_in_reduction(c, program):
            axis = c.backward.steps[-1].axis
            facts = facts or _Facts(program, instrs)
            if facts.convert_feasible(k, axis, 0):
                instrs = facts.apply(k, axis)
                facts = None
                changed = True
                k = min(k, len(instrs) - 1)  # insertions were all before k: rescan from k
                continue
        k -= 1
    if not changed:
        return program
    return dataclasses.replace(program, instrs=tuple(instrs))


def _ends_in_reduction(c: ConvertInstr, program: Program) -> bool:
    steps = c.backward.steps
    return bool(steps) and steps[-1].kind == "all_reduce" and \
        program.mesh.axis_size(steps[-1].axis) > 1


class _Facts:
    """Who defines and who reads each local value of one version of the instructions."""

    def __init__(self, program: Program, instrs: list[Instr]) -> None:
        self.program = program
        self.instrs = instrs
        self.inputs = {v.name: v for v in program.inputs}
        self.values: dict[str, Value] = dict(self.inputs)
        self.defined_by: dict[str, int] = {}
        self.readers: dict[str, set[int]] = defaultdict(set)
        for k, instr in enumerate(instrs):
            if isinstance(instr, ConvertInstr):
                self.readers[instr.src].add(k)
                self.defined_by[instr.dst.name] = k
                self.values[instr.dst.name] = instr.dst
            else:
                for _, local in instr.inputs:
                    self.readers[local].add(k)
                for v in instr.outputs:
                    self.defined_by[v.name] = k
                    self.values[v.name] = v
        self.outputs = {o.name for o in program.outputs if isinstance(o, Value)}
        self.fresh = 0

    def _floating(self, name: str) -> bool:
        v = self.values.get(name)
        return v is not None and (v.type.dtype.is_floating_point or v.type.dtype.is_complex)

    def _unsplit(self, call: CallInstr, axis: str) -> bool:
        """Does the op split nothing over `axis` (same work on every rank of it)?"""
        layouts = [layout_of(self.values[local].type) for _, local in call.inputs
                   if local in self.values]
        layouts += [layout_of(v.type) for v in call.outputs]
        return all(axis not in lay.used_axes() for lay in layouts)

    def convert_feasible(self, k: int, axis: str, depth: int) -> bool:
        """Can the reduction over `axis` ending conversion `k`'s backward move up to
        parameters? All readers of its source must end in that reduction too."""
        c = self.instrs[k]
        assert isinstance(c, ConvertInstr)
        return self._value_feasible(c.src, axis, depth)

    def _value_feasible(self, src: str, axis: str, depth: int) -> bool:
        if depth > _MAX_DEPTH or src in self.outputs or src in self.inputs:
            return False  # an input's conversion is bucketed already
        for r in self.readers[src]:
            reader = self.instrs[r]
            if not (isinstance(reader, ConvertInstr) and reader.backward.steps
                    and reader.backward.steps[-1] == _reduce(axis)):
                return False
        producer = self.defined_by.get(src)
        return producer is not None and self._producer_feasible(producer, axis, depth, False)

    def _producer_feasible(self, producer: int, axis: str, depth: int,
                           no_grad_ends: bool) -> bool:
        """Can op `producer` take an output gradient partial over `axis` and pass it on up?
        An op without gradient ends the path (`no_grad_ends`: that counts as success)."""
        call = self.instrs[producer]
        if not isinstance(call, CallInstr):
            return False
        if not call.op.grad:
            return no_grad_ends  # no gradient goes further up
        if not self._unsplit(call, axis):
            return False
        return all(self._input_feasible(local, producer, axis, depth + 1)
                   for local in self._grad_inputs(call))

    def _grad_inputs(self, call: CallInstr) -> list[str]:
        return list(dict.fromkeys(local for _, local in call.inputs if self._floating(local)))

    def _input_feasible(self, local: str, consumer: int, axis: str, depth: int) -> bool:
        """Can op `consumer` hand `local` a gradient partial over `axis`?"""
        if local in self.inputs:
            return True  # a parameter: a conversion into the buckets is inserted
        if self.readers[local] != {consumer} or local in self.outputs:
            return False
        producer = self.defined_by.get(local)
        if producer is None:
            return False
        instr = self.instrs[producer]
        if isinstance(instr, ConvertInstr):
            if any(s.axis == axis for s in instr.backward.steps):
                return False
            if instr.src in self.inputs:
                return True  # the conversion of a parameter: its reduction is bucketed
            # the conversion will end in the reduction: it must move on up from there
            src = instr.src
            if depth > _MAX_DEPTH or src in self.outputs or \
                    self.readers[src] != {producer}:
                return False
            above = self.defined_by.get(src)
            return above is not None and self._producer_feasible(above, axis, depth, True)
        # a conversion ending in the reduction is inserted before the consumer; it must
        # move on up into the producer
        return self._producer_feasible(producer, axis, depth, True)

    def apply(self, k: int, axis: str) -> list[Instr]:
        """Move the reduction ending conversion `k` (feasible) one op up: drop it from
        every reader of the source, add it to the producer's inputs' conversions."""
        c = self.instrs[k]
        assert isinstance(c, ConvertInstr)
        out = list(self.instrs)
        for r in self.readers[c.src]:
            reader = out[r]
            assert isinstance(reader, ConvertInstr)
            out[r] = dataclasses.replace(reader, backward=_without_last(reader.backward, axis))
        producer = self.defined_by[c.src]
        call = out[producer]
        assert isinstance(call, CallInstr)
        inserted: list[ConvertInstr] = []
        renamed: dict[str, str] = {}
        for local in self._grad_inputs(call):
            d = self.defined_by.get(local)
            if local not in self.inputs and d is not None and \
                    isinstance(out[d], ConvertInstr) and self.readers[local] == {producer}:
                conv = out[d]
                assert isinstance(conv, ConvertInstr)
                out[d] = dataclasses.replace(conv, backward=_with_reduction(conv.backward, axis))
                continue
            v = self.values[local]
            lay = layout_of(v.type)
            self.fresh += 1
            name = f"{local}.d{self.fresh}"
            while name in self.values:
                self.fresh += 1
                name = f"{local}.d{self.fresh}"
            dst = Value(name, v.type)
            grad = Layout(lay.dims)
            inserted.append(ConvertInstr(local, dst, Relayout(lay, lay, ()),
                                         _with_reduction(Relayout(grad, grad, ()), axis)))
            renamed[local] = name
        if renamed:
            out[producer] = dataclasses.replace(
                call, inputs=tuple((n, renamed.get(local, local)) for n, local in call.inputs))
        return out[:producer] + list(inserted) + out[producer:]


def _reduce(axis: str) -> Step:
    return Step("all_reduce", axis)


def _without_last(r: Relayout, axis: str) -> Relayout:
    assert r.steps and r.steps[-1] == _reduce(axis)
    dst = Layout(r.dst.dims, r.dst.partial | {axis})
    return Relayout(r.src, dst, r.steps[:-1], r.volume, r.cost)


def _with_reduction(r: Relayout, axis: str) -> Relayout:
    src = Layout(r.src.dims, r.src.partial | {axis})
    return Relayout(src, r.dst, (*r.steps, _reduce(axis)), r.volume, r.cost)
