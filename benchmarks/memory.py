"""Memory transforms on the example GPT: peak memory and step time of each recompute policy
and coshard chunk count, as ratios to the plain model, on one rank and on 2 gloo ranks with
tensor parallelism (Megatron MLPs).

Every variant is the same model (`examples/gpt.py`) with:

    none            no recompute
    recompute       every layer in `pxform.recompute` (save nothing)
    matmuls         every layer in `pxform.recompute(policy="matmuls")`
    names           every layer recomputed, saving its attention output
                    (`pxform.checkpoint_name(h, "attn")`, `policy=["attn"]`)
    coshard-attn-k  attention in `pxform.coshard(chunks=k, dim=(None, 0))`: k batch pieces
    coshard-head-k  the vocabulary head and loss in k batch pieces

Each variant is `pxform.shard(loss, mesh=Mesh({"tp": ranks}))` run with `value_and_grad`.
Peak and saved-for-backward bytes come from `pxform.MemoryMeter` on one step (the slowest
rank's: the largest); step times are medians of interleaved blocks (`harness.interleave`),
all variants in one run, so the ratios to "none" are measured side by side.

    python benchmarks/memory.py                  # GPT "small", batch 16, 1 rank then 2 (TP)
    python benchmarks/memory.py --quick          # smoke run, writes no result
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

CHUNKS = (2, 4)


def variants(cfg: Any) -> dict[str, Any]:
    """Loss functions by variant name; region functions are built once, so their traces
    are cached."""
    import gpt
    import torch.nn.functional as F

    import pxform

    d = cfg.d_model

    def block(p: Any, x: Any) -> Any:
        return gpt.block(p, x, cfg)

    def named_block(p: Any, x: Any) -> Any:
        h = gpt.attention(p, F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"]), cfg)
        x = x + pxform.checkpoint_name(h, "attn")
        return x + gpt.mlp(p, F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"]), cfg)

    def attention(p: Any, h: Any) -> Any:
        return gpt.attention(p, h, cfg)

    def head(params: Any, x: Any, targets: Any) -> Any:
        x = F.layer_norm(x, (d,), params["lnf_w"], params["lnf_b"])
        logits = F.linear(x, params["wte"])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def model(layer: Any, head_fn: Any = head) -> Any:
        def loss(params: Any, batch: Any) -> Any:
            import torch

            t = batch["idx"].shape[1]
            pos = torch.arange(t, device=batch["idx"].device)
            x = F.embedding(batch["idx"], params["wte"]) + F.embedding(pos, params["wpe"])
            for p in params["blocks"]:
                x = layer(p, x)
            return head_fn(params, x, batch["targets"])
        return loss

    def with_attention(att: Any) -> Any:
        def layer(p: Any, x: Any) -> Any:
            x = x + att(p, F.layer_norm(x, (d,), p["ln1_w"], p["ln1_b"]))
            return x + gpt.mlp(p, F.layer_norm(x, (d,), p["ln2_w"], p["ln2_b"]), cfg)
        return layer

    out = {
        "none": model(block),
        "recompute": model(pxform.recompute(block)),
        "matmuls": model(pxform.recompute(block, policy="matmuls")),
        "names": model(pxform.recompute(named_block, policy=["attn"])),
    }
    for k in CHUNKS:
        out[f"coshard-attn-{k}"] = model(with_attention(
            pxform.coshard(attention, chunks=k, dim=(None, 0))))
    for k in CHUNKS:
        out[f"coshard-head-{k}"] = model(block, pxform.coshard(head, chunks=k,
                                                                dim=(None, 0, 0)))
    return out


def tp_specs(params: dict) -> dict:
    from pxform import P

    block = {"fc_w": P("tp", None), "fc_b": P("tp"), "out_w": P(None, "tp")}
    return {k: ([{n: block.get(n) for n in b} for b in v] if k == "blocks" else None)
            for k, v in params.items()}


def rank_main(cfg_name: str, batch_size: int, reps: int, steps: int, warmup: int
              ) -> dict[str, Any]:
    harness.add_paths()
    import gpt
    import torch
    import torch.distributed as dist

    import pxform

    torch.set_num_threads(1)
    ranks = dist.get_world_size()
    cfg = gpt.GPT_CONFIGS[cfg_name]
    params = gpt.init_params(cfg, dtype=torch.float32)
    batch = gpt.make_batch(cfg, batch_size)
    mesh = pxform.Mesh({"tp": ranks})
    specs = (tp_specs(params) if ranks > 1 else None, None)
    steps_by_name = {}
    memory: dict[str, dict[str, int]] = {}
    reference = None
    for name, loss in variants(cfg).items():
        step = pxform.value_and_grad(pxform.shard(loss, mesh=mesh, in_specs=specs))
        for _ in range(warmup):
            value, _ = step(params, batch)
        with pxform.MemoryMeter() as meter:
            meter.track(params, batch)
            step(params, batch)
        s = meter.stats
        memory[name] = {"peak": s.peak_bytes, "saved": s.saved_bytes,
                        "baseline": s.baseline_bytes}
        reference = float(value) if reference is None else reference
        memory[name]["loss_diff"] = abs(float(value) - reference)  # type: ignore[assignment]
        steps_by_name[name] = lambda step=step: step(params, batch)
    times = harness.interleave(steps_by_name, reps, steps, sync=dist.barrier)
    return {"times": times, "memory": memory}


def main() -> None:
    p = harness.parser(__doc__, batch=16, reps=5, steps=2)
    p.add_argument("--max-ranks", type=int, default=2, help="also run on 2 ranks with TP")
    args = harness.parse(p)
    from pxform.tools.testing import World

    result: dict[str, Any] = {"config": args.config, "batch": args.batch, "runs": {}}
    for ranks in sorted({1, args.max_ranks}):
        with World(ranks) as world:
            per_rank = world.run(rank_main, args.config, args.batch, args.reps, args.steps,
                                 args.warmup)
        times = harness.slowest_rank([r["times"] for r in per_rank])
        memory = {n: max((r["memory"][n] for r in per_rank), key=lambda m: m["peak"])
                  for n in per_rank[0]["memory"]}
        base_t = statistics.median(times["none"])
        base = memory["none"]
        rows = {}
        print(f"\nGPT {args.config}, batch {args.batch}, {ranks} rank(s)"
              f"{' (TP)' if ranks > 1 else ''}: ratios to 'none'")
        print(f"  {'variant':<16}{'peak MiB':>10}{'peak':>8}{'saved':>8}{'step ms':>10}"
              f"{'time':>8}  loss diff")
        for name in times:
            m = memory[name]
            t = statistics.median(times[name])
            step_peak = m["peak"] - m["baseline"]
            rows[name] = {
                "peak_bytes": m["peak"], "saved_bytes": m["saved"],
                "peak_ratio": step_peak / max(base["peak"] - base["baseline"], 1),
                "saved_ratio": m["saved"] / max(base["saved"], 1),
                "step_s": t, "time_ratio": t / base_t, "loss_diff": m["loss_diff"],
                "times_s": times[name]}
            print(f"  {name:<16}{m['peak'] / 2**20:>10.2f}{rows[name]['peak_ratio']:>8.2f}"
                  f"{rows[name]['saved_ratio']:>8.2f}{t * 1e3:>10.1f}"
                  f"{rows[name]['time_ratio']:>8.2f}  {m['loss_diff']:.1e}")
        result["runs"][str(ranks)] = rows
    print("\npeak and saved ratios: bytes the step allocates (params excluded), to 'none'")
    if not args.quick:
        print("wrote", harness.write_result("memory", result, args.out))


if __name__ == "__main__":
    main()
