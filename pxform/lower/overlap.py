"""Overlapping a tensor-parallel block's collectives with its compute (Merak's sub-pipelined
tensor parallelism, torch's async TP): the pieces of a `coshard(..., overlap=True)` region
are interleaved so that one piece's collectives run while another piece computes.

`pxform.passes.coshard` writes the region as one copy per piece, piece after piece, each op
carrying its `PieceTag`. After lowering, each piece's instructions fall into segments. A
new segment starts where the piece waits for a forward collective (after the all-reduce of
a row-parallel matmul, the reduce-scatter or all-gather of sequence parallelism), and at a
conversion whose backward runs a collective (Megatron's f before a column-parallel
matmul). Piece c's segment s is placed at step s + c, and within a step the later piece
first, so at every step the collectives just launched by one piece run under the next
piece's compute:

    piece 0:  A0 [ar]      B0 [ar]      C0
    piece 1:        A1 [ar]      B1 [ar]      C1
    order:    A0  A1  B0  B1  C0  C1     (each B waits for its own A's all-reduce)

Autograd runs backward in about the reverse order of forward (by sequence number among
the nodes that are ready), so a backward collective launched at the start of B1's backward
runs under B0's and is waited for in A1's.

Those conversions become `asynchronous`: the runtime launches their collectives and returns
(`pxform.runtime.collectives`); the first op that reads the result waits for it, in forward
and in backward. The pieces compute exactly what they computed in turn, so the result does
not change; the order is a topological one of the same instructions, found by a priority
queue, so no instruction runs before its inputs whatever the segments say.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections import defaultdict

from pxform.core.layout import LOCAL_STEPS
from pxform.frontend.regions import PIECE, PieceTag
from pxform.lower.spmd import CallInstr, ConvertInstr, Instr, Program, defines, reads


def interleave(program: Program) -> Program:
    """`program` with the pieces of each overlapping coshard region interleaved and their
    conversions asynchronous (see the module doc); unchanged without such regions.

    Example:
        >>> program = interleave(defer_reductions(lower(graph, mesh, layouts, strategies)))
        >>> print(program.as_text())   # ... = convert_async(%mm.c0)  # fwd: all_reduce(tp)
    """
    instrs = list(program.instrs)
    piece = _pieces(instrs)
    if not piece:
        return program
    for region in sorted({t.region for t in piece.values()}):
        span = [k for k, t in piece.items() if t.region == region]
        lo, hi = min(span), max(span) + 1
        instrs[lo:hi] = _interleaved(instrs[lo:hi], [piece.get(k) for k in range(lo, hi)],
                                     program)
    return dataclasses.replace(program, instrs=tuple(instrs))


def _pieces(instrs: list[Instr]) -> dict[int, PieceTag]:
    """The piece of every instruction of an overlapping region: an op's own tag; a
    conversion takes the piece of the first instruction that reads it (the lowering places
    it just before)."""
    if not any(isinstance(i, CallInstr) and i.op.tag(PIECE) is not None for i in instrs):
        return {}
    first_reader: dict[str, int] = {}
    for k in range(len(instrs) - 1, -1, -1):
        for name in reads(instrs[k]):
            first_reader[name] = k
    piece: dict[int, PieceTag] = {}
    for k in range(len(instrs) - 1, -1, -1):
        instr = instrs[k]
        if isinstance(instr, CallInstr):
            tag = instr.op.tag(PIECE)
        else:
            reader = first_reader.get(instr.dst.name)
            tag = piece.get(reader) if reader is not None else None
        if tag is not None:
            piece[k] = tag
    return piece


def _moves(instr: ConvertInstr, program: Program, backward: bool) -> bool:
    steps = (instr.backward if backward else instr.forward).steps
    return any(s.kind not in LOCAL_STEPS and program.mesh.axis_size(s.axis) > 1
               for s in steps)


def _interleaved(span: list[Instr], tags: list[PieceTag | None], program: Program
                 ) -> list[Instr]:
    """One region's instructions in the staggered order, with the conversions of values
    its pieces compute made asynchronous."""
    made: dict[str, int] = {}  # value -> the piece that computes it
    segment: dict[int, int] = {}
    pending: dict[int, set[str]] = defaultdict(set)  # per piece: results not yet waited for
    seg: dict[int, int] = defaultdict(int)
    out = list(span)
    for k, (instr, tag) in enumerate(zip(span, tags)):
        if tag is None:
            continue
        c = tag.piece
        forward = backward = False
        if isinstance(instr, ConvertInstr) and made.get(instr.src) == c:
            forward, backward = _moves(instr, program, False), _moves(instr, program, True)
        # a new segment where the piece waits for a forward collective, and where a
        # conversion's backward collective will run: backward runs the segments in reverse,
        # so the other pieces' segments in between then compute while it runs
        if pending[c] & set(reads(instr)) or backward:
            seg[c] += 1
            pending[c].clear()
        segment[k] = seg[c]
        if isinstance(instr, ConvertInstr) and (forward or backward):
            out[k] = dataclasses.replace(instr, asynchronous=True)
            if forward:
                pending[c].add(instr.dst.name)
        for v in defines(instr):
            made[v.name] = c
    # a topological order of the span by (step, later piece first, original position);
    # an instruction of no piece keeps the priority of the one before it
    keys: list[tuple[int, int, int]] = []
    last = (0, 0)
    for k, tag in enumerate(tags):
        if tag is not None:
            last = (segment[k] + tag.piece, -tag.piece)
        keys.append((*last, k))
    defined_at = {v.name: k for k, instr in enumerate(out) for v in defines(instr)}
    waiting = [0] * len(out)
    readers: dict[int, list[int]] = defaultdict(list)
    for k, instr in enumerate(out):
        for j in {defined_at[n] for n in reads(instr) if n in defined_at}:
            waiting[k] += 1
            readers[j].append(k)
    ready = [keys[k] for k in range(len(out)) if not waiting[k]]
    heapq.heapify(ready)
    order: list[Instr] = []
    while ready:
        k = heapq.heappop(ready)[2]
        order.append(out[k])
        for r in readers[k]:
            waiting[r] -= 1
            if not waiting[r]:
                heapq.heappush(ready, keys[r])
    assert len(order) == len(out), "interleave: the region's instructions form a cycle"
    return order
