"""Timeline pictures of every named pipeline schedule, for docs/schedules.md.

Simulates each schedule of `pxform.schedules.NAMES` on p ranks and m microbatches and
writes `docs/images/schedule-<name>.png`, then prints step time, idle fraction, Merak's
relative bubble and the peak activations per stage. Costs are in units of one forward of a
whole stage, with the ratios the papers assume:

    gpipe, 1f1b   F = 1, B = 2
    interleaved   2 chunks per rank, each F = 1/2, B = 1
    zb            F = B = W = 1 (the zero-bubble paper's handcrafted setting)
    shifted       F = R = 1, B = 2 (Merak's setting)
    nf1b          3 sweeps, F = 1, B = 2 per stage and sweep

    python benchmarks/schedule_pictures.py                  # p=4, m=8, into docs/images
    python benchmarks/schedule_pictures.py -p 4 -m 12 --out /tmp/pictures
"""

from __future__ import annotations

import argparse
import os

from pxform.schedules import NAMES, Costs, plot, resolve, simulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETTINGS: dict[str, tuple[dict[str, int], Costs, str]] = {
    "gpipe": ({}, Costs(forward=1.0, backward=2.0), "GPipe"),
    "1f1b": ({}, Costs(forward=1.0, backward=2.0), "1F1B"),
    "interleaved": ({"virtual_stages": 2}, Costs(forward=0.5, backward=1.0),
                    "interleaved 1F1B, 2 chunks per rank"),
    "zb": ({}, Costs(forward=1.0, backward=1.0, weight=1.0), "ZB-H1"),
    "shifted": ({}, Costs(forward=1.0, backward=2.0, recompute=1.0),
                "Merak shifted critical path (recompute)"),
    "nf1b": ({"forwards": 3}, Costs(forward=1.0, backward=2.0), "3F1B (nnScaler)"),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-p", "--stages", type=int, default=4, help="pipeline ranks")
    parser.add_argument("-m", "--microbatches", type=int, default=8)
    parser.add_argument("--out", default=os.path.join(ROOT, "docs", "images"),
                        help="folder for the PNG files")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    print(f"p={args.stages} ranks, m={args.microbatches} microbatches")
    print(f"{'schedule':<12} {'step':>6} {'idle':>7} {'relative':>9}  peak activations per stage")
    for name in NAMES:
        options, costs, title = SETTINGS[name]
        schedule = resolve(name, args.stages, args.microbatches, **options)
        timeline = simulate(schedule, costs)
        path = os.path.join(args.out, f"schedule-{name}.png")
        plot(timeline, path, title=f"{title}, p={args.stages}, m={args.microbatches}")
        peaks = [timeline.peak_activations[s] for s in sorted(timeline.peak_activations)]
        print(f"{name:<12} {timeline.step_time:>6g} {timeline.bubble_fraction:>7.3f} "
              f"{timeline.relative_bubble:>9.3f}  {peaks}   -> {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
