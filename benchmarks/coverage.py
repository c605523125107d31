"""Model coverage: every model of the zoo (`tests/hf_zoo.py`, small random-init Hugging Face
models of six families) traced, run data parallel and under `pxform.auto` on 2 gloo ranks
against one process, and its `auto` plan made (so lowered on the abstract mesh) for 4 and 64
devices. Writes `benchmarks/results/coverage-<date>.json` and prints the table that
`docs/models.md` shows.

    python benchmarks/coverage.py                 # all models, about 5 minutes on 2 cores
    python benchmarks/coverage.py gpt2 resnet     # some
    python benchmarks/coverage.py --census        # the op census only (a minute)

The census counts, of ATen's core opset (`torch.Tag.core`), the ops with a sharding rule,
and of the ops the models emit when traced, those with one.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(ROOT, "tests"), os.path.join(ROOT, "benchmarks"), ROOT]


def plans(name: str) -> dict[int, str]:
    """The `auto` plan's configuration for 4 and 64 devices (batch 64), or its error."""
    import hf_zoo
    import torch

    import pxform

    model, inputs = hf_zoo.build(name, dtype=torch.float32, batch=64)
    fn, params = pxform.module_fn(model)

    def loss(params, inputs):
        return fn(params, **inputs).loss

    out = {}
    for devices in (4, 64):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[devices] = pxform.auto(loss, mesh=devices, memory_budget="4GiB",
                                           hardware="a100-40gb").plan(params, inputs
                                                                      ).config_text()
        except pxform.PxformError as exc:
            out[devices] = "FAIL " + str(exc).splitlines()[0][:120]
    return out


def census(models: list[str]) -> dict:
    """The op census: of ATen's core opset (`torch.Tag.core`), how many ops have a sharding
    rule; of the ops the zoo's models emit when traced, how many (a model whose trace needs
    the fallback counts its ops without rules)."""
    import hf_workers as H
    import hf_zoo
    import torch

    import pxform
    from pxform.ops import has_rule

    core = [getattr(packet, o) for name in dir(torch.ops.aten)
            if hasattr(packet := getattr(torch.ops.aten, name, None), "overloads")
            for o in packet.overloads()
            if torch.Tag.core in getattr(getattr(packet, o), "tags", ())]
    seen: set = set()
    for name in models:
        model, inputs = hf_zoo.build(name, dtype=getattr(torch, H.zoo_dtype(name)))
        fn, params = pxform.module_fn(model)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            traced = pxform.trace(lambda p, i, fn=fn: fn(p, **i).loss, params, inputs,
                                  allow_fallback=True)
        seen |= {op.target for op in traced.graph.ops}
    return {"core": len(core), "core_with_rules": sum(has_rule(t) for t in core),
            "core_without": sorted(str(t) for t in core if not has_rule(t)),
            "seen": len(seen), "seen_with_rules": sum(has_rule(t) for t in seen)}


def main() -> None:
    import harness
    import hf_workers as H
    import hf_zoo

    from pxform.tools.testing import World

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=sorted(hf_zoo.ZOO))
    parser.add_argument("--out", default=harness.RESULTS, help="results folder")
    parser.add_argument("--census", action="store_true", help="only the op census")
    args = parser.parse_args()
    counts = census(args.models)
    print(f"ATen core opset: {counts['core_with_rules']}/{counts['core']} ops have rules "
          f"({100 * counts['core_with_rules'] / counts['core']:.1f} %); without: "
          + ", ".join(counts["core_without"]))
    print(f"ops the models emit: {counts['seen_with_rules']}/{counts['seen']} have rules")
    if args.census:
        return
    rows = []
    with World(2, timeout=600) as world:
        for name in args.models:
            row: dict = {"model": name, "family": hf_zoo.ZOO[name][0],
                         "dtype": H.zoo_dtype(name)}
            for mode in ("dp", "auto"):
                results = world.run(H.run_zoo, name, mode, row["dtype"])
                bad = [r for r in results if not r["ok"]]
                if bad:
                    row[mode] = "FAIL " + bad[0]["error"].splitlines()[0][:120]
                    continue
                err = max(max(r["loss_err"], r["grad_err"]) for r in results)
                row[mode] = f"{err:.0e}"
                if mode == "auto":
                    row["plan2"] = results[0]["config"].split(" schedule")[0]
            row.update({f"plan{k}": v.split(" schedule")[0] for k, v in plans(name).items()})
            rows.append(row)
            print(row, flush=True)
    harness.write_result("coverage", {"models": rows, "census": counts}, args.out)
    print("| model | family | dtype | DP, 2 ranks: max error | auto, 2 ranks: max error "
          "| plan, 2 | plan, 4 | plan, 64 |")
    print("|" + "---|" * 8)
    for r in rows:
        print(f"| {r['model']} | {r['family']} | {r['dtype']} | {r['dp']} | {r['auto']} | "
              f"{r.get('plan2', '-')} | {r.get('plan4', '-')} | {r.get('plan64', '-')} |")
    ok = sum(not str(r["auto"]).startswith("FAIL") for r in rows)
    print(f"\nauto on 2 ranks: {ok}/{len(rows)} models match one process")


if __name__ == "__main__":
    main()
