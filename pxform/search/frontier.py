"""Dynamic programming over a chain of blocks, keeping the (time, memory) frontier.

TensorOpt's FT-LDP: for each block k and each of its options s, keep every plan of blocks
0..k ending in s that no other such plan beats in both time and memory (the Pareto
frontier). Block k+1 with option s' extends each kept plan ending in s by the block's own
cost and the re-layout cost between s and s'; the new frontier of s' is what survives
pruning. Galvatron's memory-indexed DP (min time per memory budget) is the same frontier
read at one memory value.

Costs are additive and memory contributions non-negative, so a plan over `limit` can be
dropped as soon as it appears. With `quantum > 0`, only the fastest plan of each memory
bucket of that width is kept, which bounds the frontier's size (the search uses 1/256 of
the budget); memory values stay exact, so every reported plan is within the budget, and a
dropped plan is never more than one bucket smaller than a kept faster one. Tests use 0.

Example:
    >>> times = [np.array([1.0, 3.0]), np.array([1.0, 3.0])]
    >>> mems = [np.array([4.0, 1.0]), np.array([4.0, 1.0])]
    >>> [(p.time, p.memory, p.choices) for p in chain_frontier(times, mems)]
    [(6.0, 2.0, (1, 1)), (4.0, 5.0, (1, 0)), (2.0, 8.0, (0, 0))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Point:
    """One plan of the frontier: total time, total memory, and the option of each block."""

    time: float
    memory: float
    choices: tuple[int, ...]


def chain_frontier(times: Sequence[np.ndarray], mems: Sequence[np.ndarray],
                   trans_time: Sequence[np.ndarray | None] | None = None,
                   trans_mem: Sequence[np.ndarray | None] | None = None,
                   quantum: float = 0.0, limit: float = math.inf) -> list[Point]:
    """The Pareto frontier of a chain (module doc), sorted by memory.

    Args:
        times, mems: per block, an array with one entry per option.
        trans_time, trans_mem: per block k >= 1, a matrix [options of k-1, options of k]
            added when block k-1 takes the row and block k the column (None: free).
        quantum: memory rounding (0: exact).
        limit: plans using more memory are dropped.
    """
    n = len(times)
    if n == 0:
        return [Point(0.0, 0.0, ())]
    # per block, every kept plan of blocks 0..k in one set of flat arrays, grouped by the
    # block's option and by memory within it: (time, memory, option, index of the plan
    # of block k-1 it extends). The search prunes thousands of small frontiers; one
    # array operation per block over all its options, instead of one per option, is
    # what keeps that cheap.
    t = np.asarray(times[0], dtype=float)
    m = np.asarray(mems[0], dtype=float)
    ok = m <= limit
    s = np.flatnonzero(ok)
    layers = [(t[ok], m[ok], s, np.zeros(len(s), dtype=np.int64))]
    for k in range(1, n):
        t_prev, m_prev, s_prev, _ = layers[-1]
        if len(t_prev) == 0:
            return []
        tk = np.asarray(times[k], dtype=float)
        mk = np.asarray(mems[k], dtype=float)
        # [option of block k, plan of block k-1]
        t_all = tk[:, None] + t_prev[None, :]
        m_all = mk[:, None] + m_prev[None, :]
        tt = trans_time[k] if trans_time is not None else None
        tm = trans_mem[k] if trans_mem is not None else None
        if tt is not None:
            t_all = t_all + tt[s_prev, :].T
        if tm is not None:
            m_all = m_all + tm[s_prev, :].T
        layers.append(_prune_rows(t_all, m_all, limit, quantum))
    # merge the end options: one frontier over every plan of the last block
    t_end, m_end, _, _ = layers[-1]
    if len(t_end) == 0:
        return []
    _, _, _, at = _prune_rows(t_end[None, :], m_end[None, :], limit, quantum)
    out = []
    for i in at:
        point = (float(t_end[i]), float(m_end[i]))
        choices = []
        for _, _, opt, parent in reversed(layers):
            choices.append(int(opt[i]))
            i = parent[i]
        out.append(Point(*point, tuple(reversed(choices))))
    return out


def _prune_rows(t: np.ndarray, m: np.ndarray, limit: float, quantum: float = 0.0
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per row of `t` and `m` (an option of the block; columns: the plans it extends),
    the points no other point of the row beats in both time and memory (ties: the first
    column), by memory; with `quantum`, only the fastest point of each memory bucket of
    that width. Returns them flat, row by row: (time, memory, row, column)."""
    ok = m <= limit
    # points over the limit sort last in their row, where they beat nothing
    order = np.lexsort((t, np.where(ok, m, math.inf)), axis=-1)
    rows = np.arange(len(t))[:, None]
    t, m, keep = t[rows, order], m[rows, order], ok[rows, order]
    best = np.minimum.accumulate(t, axis=-1)
    keep[:, 1:] &= t[:, 1:] < best[:, :-1]
    row, pos = np.nonzero(keep)
    col = order[row, pos]
    t, m = t[row, pos], m[row, pos]
    if quantum > 0 and len(t) > 1:
        # times fall as memory rises: the last point of a bucket is its fastest
        bucket = np.floor(m / quantum)
        last = np.ones(len(t), dtype=bool)
        last[:-1] = (bucket[1:] != bucket[:-1]) | (row[1:] != row[:-1])
        t, m, row, col = t[last], m[last], row[last], col[last]
    return t, m, row, col
