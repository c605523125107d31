"""Memory model coverage: the predicted peak of `pxform.auto`'s plans against the meter,
on models of every family of the zoo (`tests/hf_zoo.py`: small random-init Hugging Face
models, float32, global batch 16), each under six pinned plans on 2 gloo ranks: data
parallelism, with every block recomputed, ZeRO-3, tensor parallelism, and a 2-stage 1F1B
pipeline of 4 microbatches without and with recompute. Writes
`benchmarks/results/memory-zoo-<date>.json` and prints the table that
`docs/benchmarks/memory_zoo.md` shows.

    python benchmarks/memory_zoo.py               # 19 models, about 3 minutes
    python benchmarks/memory_zoo.py vit resnet    # some

Each cell is the rank's signed error, predicted over metered (`plan.report`), the larger of
the two ranks; one AdamW step runs first so the optimizer's state exists
(`tests/auto_workers.py: metered_memory_errors`). The training loop's way: every rank is
handed the global batch as plain tensors.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks"), ROOT]

# (stages, the roles of every block or None, every block recomputed)
PINS: dict[str, tuple[int, tuple | None, bool]] = {
    "dp": (1, (("outer", "dp"),), False),
    "dp+recompute": (1, (("outer", "dp"),), True),
    "zero3": (1, (("outer", "sdp"),), False),
    "tp": (1, (("inner", "tp"),), False),
    "pp2": (2, None, False),
    "pp2+recompute": (2, None, True),
}
MODELS = ("vit", "deit", "beit", "dinov2", "swin", "resnet", "convnext", "mobilenet_v2", "regnet",
          "gpt2", "bert", "llama", "t5", "bart", "distilbert", "roberta", "gpt_neox", "opt",
          "bloom")
SEQ = 32  # tokens per sequence of the text models (positions fit every model's table)
LIMIT = 0.05  # the accuracy benchmark's memory goal


def main() -> None:
    import harness
    import hf_workers as H
    import hf_zoo

    from pxform.tools.testing import WorkerError, World

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(MODELS))
    parser.add_argument("--out", default=harness.RESULTS, help="results folder")
    args = parser.parse_args()
    unknown = sorted(set(args.models) - set(hf_zoo.ZOO))
    if unknown:
        parser.error(f"unknown models {unknown}; the zoo has {sorted(hf_zoo.ZOO)}")
    rows = []
    world = World(2, timeout=600)
    world.start()
    try:
        for name in args.models:
            row: dict = {"model": name, "family": hf_zoo.ZOO[name][0]}
            try:
                errors = world.run(H.run_zoo_memory, name, PINS, SEQ)[0]
                row.update({k: max(e, key=abs) for k, e in errors.items()})
            except WorkerError as exc:  # a model the runtime refuses: recorded, then on
                row["error"] = str(exc).splitlines()[0][:300]
                world.close()
                world = World(2, timeout=600)
                world.start()
            rows.append(row)
            print(row, flush=True)
    finally:
        world.close()
    cells = [r[k] for r in rows for k in PINS if k in r]
    within = sum(abs(e) <= LIMIT for e in cells)
    summary = {"cells": len(cells), "within_5_percent": within,
               "worst": max(cells, key=abs) if cells else None}
    harness.write_result("memory-zoo", {"pins": list(PINS), "seq": SEQ, "batch": 16,
                                        "models": rows, "summary": summary}, args.out)
    print("| model | family | " + " | ".join(PINS) + " |")
    print("|" + "---|" * (len(PINS) + 2))
    for r in rows:
        print(f"| {r['model']} | {r['family']} | " + " | ".join(
            f"{100 * r[k]:+.1f} %" if k in r else "-" for k in PINS) + " |")
    print(f"\n{within} of {len(cells)} plans within {LIMIT:.0%} of the meter")


if __name__ == "__main__":
    main()
