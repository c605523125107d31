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
    # per block, per option: (time, mem, parent option, parent index) arrays
    layers: list[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = []
    first = []
    for s in range(len(times[0])):
        t = np.array([times[0][s]], dtype=float)
        m = np.array([mems[0][s]], dtype=float)
        keep = m <= limit
        first.append((t[keep], m[keep], np.zeros(keep.sum(), dtype=np.int64),
                      np.zeros(keep.sum(), dtype=np.int64)))
    layers.append(first)
    for k in range(1, n):
        prev = layers[-1]
        tt = trans_time[k] if trans_time is not None else None
        tm = trans_mem[k] if trans_mem is not None else None
        # every kept plan of block k-1, whatever its option, in one set of arrays
        t_prev = np.concatenate([x[0] for x in prev])
        m_prev = np.concatenate([x[1] for x in prev])
        s_prev = np.concatenate([np.full(len(x[0]), s, dtype=np.int64)
                                 for s, x in enumerate(prev)])
        i_prev = np.concatenate([np.arange(len(x[0]), dtype=np.int64) for x in prev])
        cur = []
        for s2 in range(len(times[k])):
            if len(t_prev) == 0:
                cur.append(_empty())
                continue
            t_all = t_prev + times[k][s2]
            m_all = m_prev + mems[k][s2]
            if tt is not None:
                t_all = t_all + tt[s_prev, s2]
            if tm is not None:
                m_all = m_all + tm[s_prev, s2]
            cur.append(_prune(t_all, m_all, s_prev, i_prev, limit, quantum))
        layers.append(cur)
    # merge the end options
    ends = []
    for s, (t, m, _, _) in enumerate(layers[-1]):
        ends.append((t, m, np.full(len(t), s, dtype=np.int64), np.arange(len(t))))
    if not any(len(e[0]) for e in ends):
        return []
    t, m, s_end, i_end = (np.concatenate([e[j] for e in ends]) for j in range(4))
    t, m, s_end, i_end = _prune(t, m, s_end, i_end, limit, quantum)
    out = []
    for tv, mv, s, i in zip(t, m, s_end, i_end):
        choices = [int(s)]
        for k in range(n - 1, 0, -1):
            _, _, parents, where = layers[k][int(s)]
            s, i = parents[i], where[i]
            choices.append(int(s))
        out.append(Point(float(tv), float(mv), tuple(reversed(choices))))
    return out


def _empty() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    z = np.zeros(0)
    return z, z, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)


def _prune(t: np.ndarray, m: np.ndarray, p: np.ndarray, i: np.ndarray, limit: float,
           quantum: float = 0.0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Keep the points no other point beats in both time and memory (ties: the first);
    with `quantum`, only the fastest point of each memory bucket of that width."""
    ok = m <= limit
    t, m, p, i = t[ok], m[ok], p[ok], i[ok]
    if len(t) <= 1:
        return t, m, p, i
    order = np.lexsort((t, m))  # by memory, then time
    t, m, p, i = t[order], m[order], p[order], i[order]
    best = np.minimum.accumulate(t)
    keep = np.ones(len(t), dtype=bool)
    keep[1:] = t[1:] < best[:-1]
    t, m, p, i = t[keep], m[keep], p[keep], i[keep]
    if quantum > 0 and len(t) > 1:
        # times fall as memory rises: the last point of a bucket is its fastest
        bucket = np.floor(m / quantum)
        last = np.ones(len(t), dtype=bool)
        last[:-1] = bucket[1:] != bucket[:-1]
        t, m, p, i = t[last], m[last], p[last], i[last]
    return t, m, p, i
