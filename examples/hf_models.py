"""Train a Hugging Face model (GPT-2, BERT or Llama) under `pxform.auto` on several ranks.

What it shows: an unmodified `transformers` model becomes a pure function of a dict of
tensors (`pxform.module_fn`); `pxform.auto` searches a parallel plan for that function
(data parallel, ZeRO-3, tensor parallel, pipeline stages, recompute) under a memory budget
and runs it on the ranks `torchrun` starts. The model is built on `meta`; each rank
initialises only its pieces with the model's own initialisation (`pxform.module_init` and
`step.init`), laid out per the plan as DTensors; the gradients come back as DTensors with
the same placements, and a stock `torch.optim.AdamW` updates them. Each rank's optimizer
holds only the parameters its part of the plan computes with: with pipeline stages a rank
holds None for the layers of the other stages, and gets None gradients for them.

The models are small random-init configs built here (no download, no tokenizer): 2 layers,
hidden 64, vocabulary 128, 16-token sequences. The batches are seeded and deterministic
(the same on every rank and in every run): arithmetic progressions of token ids with a
random start and stride, which context predicts. GPT-2 and Llama learn the next token (their
loss falls visibly within ten steps); BERT fills in masked tokens of padded rows, with an
attention mask (a harder task: its loss moves slowly at this size).

The default budget (`--memory 1GiB`) on the default hardware preset makes the search choose
an interesting plan even for these tiny models; rank 0 prints it (`plan.explain()`). BERT's
padding mask mixes every row of the batch into one function, so the search plans no
pipeline for it (that is expected, not an error).

`--check` also trains the same number of steps on one process (rank 0, plain
`pxform.value_and_grad` on full tensors, the same AdamW), prints both loss curves side by
side and compares them step by step, then the first step's gradients and the parameter
updates, within tolerances for the dtype; it exits non-zero on a mismatch. HF computes its
loss in float32 even for a float64 model, so float64 runs agree to about float32 precision.

Run (CPU, gloo; on GPUs it uses NCCL, one GPU per rank):

    torchrun --nproc-per-node 2 examples/hf_models.py --model llama --steps 10
    torchrun --nproc-per-node 4 examples/hf_models.py --model gpt2 --steps 10 --check
    torchrun --nproc-per-node 2 examples/hf_models.py --model bert --dtype float64 --check
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

import pxform

VOCAB = 128
"""Vocabulary of the small configs. Token 0 is padding and `VOCAB - 1` is BERT's [MASK],
so real tokens are 1 .. VOCAB - 2."""
SEQ = 16
"""Tokens per sequence."""
PAD_ID = 0
MASK_ID = VOCAB - 1
MODELS = ("gpt2", "bert", "llama")

# Agreement of the distributed run with the single-process one, per dtype, all relative:
# (loss per step, to its value; first-step gradients, worst element to the largest
# gradient; parameter updates after the last step, as one vector, see `compare`). The
# gradients are checked on their own because Adam is blind to their scale: a gradient off
# by a constant factor would train the same. float64 models are not float64 throughout:
# HF computes the loss in float32 (its loss functions cast the logits with `.float()`) and
# Llama its RMSNorm, so they agree to about float32 precision (measured on 2 and 4 ranks,
# searched and pinned plans: loss 1e-7, gradients 5e-8, updates 2e-6 for float64; 2e-7,
# 3e-7 and 4e-5 for float32). A gradient twice too large gives 7e-4 on the updates, a
# tensor left out of the optimizer 2e-2.
TOLERANCES: dict[torch.dtype, tuple[float, float, float]] = {
    torch.float64: (1e-5, 1e-5, 1e-4),
    torch.float32: (1e-4, 1e-4, 1e-3),
}


@dataclass(frozen=True)
class Run:
    """What a training run produced, as full tensors on the CPU, by parameter name."""

    curve: list[float]
    """The loss of every step (before that step's update)."""
    first_grads: dict[str, torch.Tensor]
    """The gradients of the first step."""
    final: dict[str, torch.Tensor]
    """The parameters after the last step."""


@dataclass(frozen=True)
class Args:
    """Command-line options (see `parse_args`)."""

    model: str
    steps: int
    batch: int
    lr: float
    dtype: torch.dtype
    hardware: str
    memory: str
    check: bool
    seed: int


def parse_args(argv: list[str] | None = None) -> Args:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="llama")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8,
                        help="global batch (sequences per step); the plan splits it")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--hardware", default="a100-40gb",
                        help="a hardware preset, or a profile written by `pxform calibrate`")
    parser.add_argument("--memory", default="1GiB", help="memory budget per device")
    parser.add_argument("--check", action="store_true",
                        help="also train on one process (rank 0) and compare the loss "
                             "curves, first-step gradients and parameter updates")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    if a.steps < 1 or a.batch < 1:
        parser.error("--steps and --batch must be positive")
    return Args(a.model, a.steps, a.batch, a.lr, getattr(torch, a.dtype), a.hardware,
                a.memory, a.check, a.seed)


def build_model(name: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """A small HF model (built on meta by the caller: shapes only; `pxform.module_init`
    gives its initial weights)."""
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    small: dict[str, Any] = dict(hidden_size=64, num_attention_heads=4,
                                 intermediate_size=128, num_hidden_layers=2)
    model: torch.nn.Module
    if name == "gpt2":
        cfg: Any = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB,
                                           n_positions=64, bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(cfg)
    elif name == "bert":
        cfg = transformers.BertConfig(vocab_size=VOCAB, max_position_embeddings=64,
                                      pad_token_id=PAD_ID, **small)
        model = transformers.BertForMaskedLM(cfg)
    elif name == "llama":
        cfg = transformers.LlamaConfig(vocab_size=VOCAB, max_position_embeddings=64,
                                       num_key_value_heads=2, **small)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {MODELS}")
    # eval(): no dropout, so the step is a deterministic function that the distributed
    # and single-process runs can be compared on (and that pxform can trace once)
    return model.to(dtype).eval()


def make_batch(name: str, step: int, batch: int, seed: int) -> dict[str, torch.Tensor]:
    """The batch of one step: a function of (seed, step) only, so every rank and the
    single-process check see the same tokens. Sequences are progressions
    `start, start + stride, ...` (mod the real tokens): learnable from context."""
    g = torch.Generator().manual_seed(seed * 100_003 + step)
    start = torch.randint(0, VOCAB - 2, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    ids = 1 + (start + stride * torch.arange(SEQ)) % (VOCAB - 2)
    if name != "bert":
        # causal LM: HF shifts the labels itself
        return {"input_ids": ids, "labels": ids.clone()}
    # masked LM over padded rows: each row keeps SEQ/2 .. SEQ real tokens
    length = torch.randint(SEQ // 2, SEQ + 1, (batch, 1), generator=g)
    real = torch.arange(SEQ) < length
    masked = (torch.rand(batch, SEQ, generator=g) < 0.25) & real
    masked[:, 1] = True  # at least one label per row (a row of -100 only is a 0/0 loss)
    return {
        "input_ids": torch.where(masked, MASK_ID, torch.where(real, ids, PAD_ID)),
        "labels": torch.where(masked, ids, -100),
        "attention_mask": real.long(),
    }


def rank0_print(*what: Any) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*what, flush=True)


def train_distributed(args: Args, loss: Any, params: dict[str, torch.Tensor],
                      init_fn: Any, trainable: set[str], device: torch.device) -> Run:
    """Search a plan on the parameters' shapes (`params` are on meta), initialise them
    where they live per the plan (`step.init`) and train. The result is the same on every
    rank (its gradients only with `--check`: gathering them costs collectives)."""
    world = dist.get_world_size()
    step = pxform.auto(loss, mesh=world, memory_budget=args.memory, hardware=args.hardware)
    first = to_device(make_batch(args.model, 0, args.batch, args.seed), device)
    plan = step.plan(params, first)  # fake tensors: the same plan on every rank
    rank0_print(plan.explain())
    if plan.stages > 1:
        rank0_print(f"\n{plan.stages} pipeline stages: each rank trains only the parameters "
                    f"its stage reads (step.holds); the others get None gradients")
    elif args.model == "bert":
        rank0_print("\nno pipeline: BERT's padding mask mixes the whole batch into one "
                    "function, which microbatches cannot split (expected)")
    rank0_print()
    # each rank initialises only its own pieces, with the model's own initialisation
    # (`_init_weights`, rotary frequencies included); in a pipeline a rank gets None for
    # the other stages' leaves
    torch.manual_seed(args.seed)
    dparams = step.init(init_fn)
    held = {k: v is not None for k, v in dparams.items()}
    mine = [k for k in dparams if held[k] and k in trainable]
    opt = torch.optim.AdamW([dparams[k] for k in mine], lr=args.lr)
    rank0_print(f"rank 0 holds {len(mine)} of {len(trainable)} trainable parameters; "
                f"step 0's time includes lowering the plan to this rank's program")
    curve: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    for i in range(args.steps):
        inputs = to_device(make_batch(args.model, i, args.batch, args.seed), device)
        start = time.perf_counter()
        value, grads = pxform.value_and_grad(step)(dparams, inputs)
        if i == 0 and args.check:
            first_grads = gather_held({k: grads[k] for k in mine}, held)
        for k in mine:
            # DTensor gradients with the parameters' placements: the optimizer updates
            # each rank's shard in place, as under FSDP2
            if grads[k] is not None:
                dparams[k].grad = grads[k]
        opt.step()
        opt.zero_grad(set_to_none=True)
        elapsed = time.perf_counter() - start
        curve.append(float(value))
        rank0_print(f"step {i:3d}  loss {curve[-1]:.6f}  {elapsed * 1e3:8.1f} ms")
    return Run(curve, first_grads, gather_held(dparams, held))


def gather_held(tensors: dict[str, Any], held: dict[str, bool]) -> dict[str, torch.Tensor]:
    """Full tensors on every rank, each taken from a rank that holds it: under a pipeline a
    rank's copy of another stage's parameters is never updated, and its gradient is None."""
    full = pxform.gather(tensors)  # collective: every rank, every DTensor
    mine = {k: v.detach().cpu() for k, v in full.items() if held[k] and v is not None}
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    out: dict[str, torch.Tensor] = {}
    for part in everyone:
        for k, v in part.items():
            out.setdefault(k, v)
    return out


def train_reference(args: Args, loss: Any, params: dict[str, torch.Tensor],
                    trainable: set[str], device: torch.device) -> Run:
    """The same training on one process: plain autograd on full tensors, the same AdamW."""
    params = {k: v.detach().clone().to(device) for k, v in params.items()}
    opt = torch.optim.AdamW([params[k] for k in params if k in trainable], lr=args.lr)
    grad_of = pxform.value_and_grad(loss)
    curve: list[float] = []
    first_grads: dict[str, torch.Tensor] = {}
    for i in range(args.steps):
        inputs = to_device(make_batch(args.model, i, args.batch, args.seed), device)
        value, grads = grad_of(params, inputs)
        if i == 0:
            first_grads = {k: grads[k].cpu() for k in trainable if grads[k] is not None}
        for k in trainable:
            if grads[k] is not None:
                params[k].grad = grads[k]
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(float(value))
    return Run(curve, first_grads, {k: v.cpu() for k, v in params.items()})


def compare(args: Args, dist_run: Run, ref_run: Run, initial: dict[str, torch.Tensor],
            trainable: set[str]) -> bool:
    """Print both loss curves side by side, then how far the first step's gradients and
    the parameter updates are apart; True when all agree within `TOLERANCES`."""
    loss_tol, grad_tol, update_tol = TOLERANCES[args.dtype]
    ok = True
    print(f"\ncheck against one process ({str(args.dtype).removeprefix('torch.')}; "
          f"tolerances: loss {loss_tol:g}, gradients {grad_tol:g}, updates {update_tol:g}, "
          f"all relative):")
    print(f"{'step':>4}  {'distributed':>14}  {'one process':>14}  {'rel diff':>9}")
    for i, (a, b) in enumerate(zip(dist_run.curve, ref_run.curve)):
        rel = abs(a - b) / max(abs(b), 1e-12)
        bad = not rel <= loss_tol  # NaN fails too
        ok &= not bad
        print(f"{i:4d}  {a:14.8f}  {b:14.8f}  {rel:9.2e}{'  MISMATCH' if bad else ''}")

    for what, got in [("first-step gradients", dist_run.first_grads),
                      ("final parameters", dist_run.final)]:
        missing = sorted(trainable - set(got))
        if missing:  # a gradient or an update that no rank produced
            print(f"{what}: {len(missing)} missing from every rank, e.g. {missing[:3]}")
            ok = False
    names = sorted(trainable & set(dist_run.first_grads) & set(dist_run.final))

    # gradients: the worst element, relative to the largest gradient
    scale = max(float(ref_run.first_grads[k].abs().max()) for k in names)
    err, where = _worst({k: dist_run.first_grads[k] - ref_run.first_grads[k] for k in names})
    bad = not err <= grad_tol * scale
    ok &= not bad
    print(f"first-step gradients: max |difference| {err / scale:.3g} x the largest gradient "
          f"({where}){'  MISMATCH' if bad else ''}")

    # updates, as one vector: Adam divides each gradient by its own running size, so an
    # element whose true gradient is 0 (a key bias: softmax ignores it) moves by an
    # arbitrary fraction of lr driven by rounding noise, differently in each run. Such
    # elements are few, so the whole update vector still agrees closely, while a missed
    # or wrong update of any tensor stands out.
    d_dist = {k: dist_run.final[k].to(initial[k].dtype) - initial[k] for k in names}
    d_ref = {k: ref_run.final[k] - initial[k] for k in names}
    diff = torch.cat([(d_dist[k] - d_ref[k]).flatten() for k in names]).norm()
    rel = float(diff / torch.cat([d_ref[k].flatten() for k in names]).norm())
    bad = not rel <= update_tol
    ok &= not bad
    worst, where = _worst({k: d_dist[k] - d_ref[k] for k in names})
    print(f"final parameters: |update difference| / |update| {rel:.3g}; worst element "
          f"{worst / args.lr:.3g} x lr ({where}){'  MISMATCH' if bad else ''}")
    print(f"check {'passed' if ok else 'FAILED'}")
    return ok


def _worst(diffs: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest |element| over all tensors and the name of its tensor (NaN counts as
    the largest)."""
    worst, where = 0.0, "-"
    for k, d in diffs.items():
        m = float(d.abs().max())
        if not m <= worst:
            worst, where = m, k
    return worst, where


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        print("run under torchrun, e.g. torchrun --nproc-per-node 2 examples/hf_models.py "
              "--model llama --steps 10", file=sys.stderr)
        return 2
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)  # the ranks share the machine's cores
        dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        # built on meta: no rank holds the whole model; module_init runs its own
        # initialisation later, on each rank's pieces only
        with torch.device("meta"):
            model = build_model(args.model, args.dtype, args.seed)
        fn, params = pxform.module_fn(model)
        init_fn = pxform.module_init(model)
        # buffers (position ids, rotary frequencies) come without requires_grad: train
        # only what the model calls parameters
        trainable = {k for k, v in params.items() if v.requires_grad}
        params = {k: v.detach() for k, v in params.items()}

        def loss(params: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]
                 ) -> torch.Tensor:
            return fn(params, **inputs).loss

        loss.__name__ = f"{args.model}_loss"
        rank0_print(f"{args.model}: {sum(params[k].numel() for k in trainable):,} parameters, "
                    f"{args.dtype}, batch {args.batch} x {SEQ} tokens, "
                    f"{dist.get_world_size()} ranks ({dist.get_backend()})\n")
        run = train_distributed(args, loss, params, init_fn, trainable, device)
        ok = True
        if args.check:
            if rank == 0:  # the others wait for the verdict
                # the same initial weights on one process: pxform's 1-rank run of the
                # initialiser (its random numbers are the same under every plan)
                torch.manual_seed(args.seed)
                initial = {k: v.cpu() for k, v in pxform.trace(init_fn)().items()}
                ref = train_reference(args, loss, initial, trainable, device)
                ok = compare(args, run, ref, initial, trainable)
            # every rank exits with the verdict, so torchrun reports one outcome
            verdict = [ok]
            dist.broadcast_object_list(verdict, src=0)
            ok = bool(verdict[0])
        return 0 if ok else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # not sys.exit: see pxform.exit_worker (a gloo thread can abort a clean exit)
    pxform.exit_worker(main())
