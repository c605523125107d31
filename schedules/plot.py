"""`plot`: a timeline picture of a simulated schedule, like the figures of the pipeline
papers: a row per rank (rank 0 on top), a box per compute action from its start to its end,
coloured by kind, the microbatch number inside. With several stages per rank (interleaved,
nF1B) later chunks are drawn lighter.

matplotlib is an optional dependency (`pip install 'pxform[plot]'`); it is imported only when
`plot` is called, and only its object API is used (no pyplot state, no display needed).
"""

from __future__ import annotations

import os
from typing import Any

from pxform.schedules.simulate import Timeline

_COLOURS = {"F": "#4C72B0", "B": "#55A868", "W": "#8172B2", "R": "#DD8452"}
_NAMES = {"F": "forward", "B": "backward", "W": "weight gradient", "R": "recompute"}
_FORMATS = (".png", ".svg", ".pdf")


def _lighter(hex_colour: str, amount: float) -> tuple[float, float, float]:
    rgb = [int(hex_colour[k:k + 2], 16) / 255 for k in (1, 3, 5)]
    return (rgb[0] + (1 - rgb[0]) * amount, rgb[1] + (1 - rgb[1]) * amount,
            rgb[2] + (1 - rgb[2]) * amount)


def plot(timeline: Timeline, path: str | os.PathLike[str], title: str | None = None) -> None:
    """Draw `timeline` to `path`; the extension picks the format (.png, .svg or .pdf).

    Raises:
        ImportError: matplotlib is not installed (the message has the fix).
        ValueError: the extension is not one of the formats above.

    Example:
        >>> from pxform.schedules import Costs, one_f_one_b, simulate
        >>> t = simulate(one_f_one_b(4, 8), Costs(1.0, 2.0))
        >>> plot(t, "1f1b.png", title="1F1B")  # doctest: +SKIP
    """
    ext = os.path.splitext(os.fspath(path))[1].lower()
    if ext not in _FORMATS:
        raise ValueError(f"pxform.schedules.plot: {os.fspath(path)!r} has extension "
                         f"{ext or '(none)'!r}; use one of {', '.join(_FORMATS)}")
    try:
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch, Rectangle
    except ImportError as missing:
        raise ImportError("pxform.schedules.plot needs matplotlib: pip install 'pxform[plot]' "
                          "(or pip install matplotlib)") from missing

    ranks = max(timeline.ranks, 1)
    compute = [e for e in timeline.events if e.action.is_compute and e.duration > 0]
    chunks = 1 + max((e.action.stage // ranks for e in compute), default=0)
    span = timeline.step_time or 1.0
    shortest = min((e.duration for e in compute), default=1.0)
    width = min(max(6.0, 0.32 * span / shortest), 40.0)
    fig: Any = Figure(figsize=(width, 0.55 * ranks + 1.4))
    ax = fig.subplots()
    points_per_unit = width * 72 * 0.8 / span
    for e in compute:
        kind, chunk = e.action.kind, e.action.stage // ranks
        colour = _lighter(_COLOURS[kind], 0.45 * chunk / max(chunks - 1, 1))
        y = ranks - 1 - e.rank
        ax.add_patch(Rectangle((e.start, y), e.duration, 0.8, facecolor=colour,
                               edgecolor="white", linewidth=0.6))
        box_points = e.duration * points_per_unit
        label = str(e.action.microbatch)
        size = min(9.0, box_points / (0.62 * len(label) + 0.4))
        if size >= 4.0:
            ax.text(e.start + e.duration / 2, y + 0.4, label, ha="center", va="center",
                    fontsize=size, color="white" if chunk == 0 else "black")
    ax.set_xlim(0, span)
    ax.set_ylim(-0.1, ranks - 0.1)
    ax.set_yticks([ranks - 1 - r + 0.4 for r in range(ranks)])
    ax.set_yticklabels([f"rank {r}" for r in range(ranks)])
    ax.set_xlabel("time")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    kinds = [k for k in _COLOURS if any(e.action.kind == k for e in compute)]
    ax.legend(handles=[Patch(color=_COLOURS[k], label=_NAMES[k]) for k in kinds],
              loc="upper center", bbox_to_anchor=(0.5, -0.35 if ranks < 3 else -0.2),
              ncol=len(kinds), frameon=False, fontsize=8)
    summary = (f"step {timeline.step_time:g}, idle {100 * timeline.bubble_fraction:.1f}%")
    ax.set_title(f"{title}  ({summary})" if title else summary, fontsize=10)
    fig.tight_layout()
    fig.savefig(os.fspath(path), dpi=120)

