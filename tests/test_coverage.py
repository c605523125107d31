"""The coverage suite (issue 20): small random-init Hugging Face models of every family
(decoder LMs, encoder LMs, encoder-decoders, vision transformers, CNNs, mixtures of experts;
`tests/hf_zoo.py`, no downloads), each traced, run data parallel and under `pxform.auto` on
2 gloo ranks against one process (loss and every gradient), and its `auto` plan lowered
for 64 devices on an abstract mesh. `python benchmarks/coverage.py` prints the same
as the table in `docs/models.md`.

float64 where the model allows (HF computes decoder losses in float32, so those agree to
float32 precision); the MoE models run float32 (their grouped kernels take no float64)."""

from __future__ import annotations

import warnings

import hf_workers as H
import hf_zoo
import pytest
import torch

import pxform
from pxform.tools.testing import World

pytest.importorskip("transformers")

NAMES = sorted(hf_zoo.ZOO)


@pytest.fixture(scope="module")
def world2():
    with World(2, timeout=300) as w:
        yield w


def test_the_zoo_covers_every_family_with_30_models():
    assert len(NAMES) >= 30
    assert {hf_zoo.ZOO[n][0] for n in NAMES} == set(hf_zoo.FAMILIES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", ["dp", "auto"])
@pytest.mark.heavy
def test_every_model_matches_one_process(world2, mode):
    """One test per mode over all models (a failing model is named with its error), so the
    world starts once and a sweep is not 80 separate tests' overhead."""
    failures = []
    for name in NAMES:
        tol = 1e-4 if H.zoo_dtype(name) == "float32" else 1e-5
        results = world2.run(H.run_zoo, name, mode, H.zoo_dtype(name))
        for r in results:
            if not r["ok"]:
                failures.append(f"{name}: {r['error'][:300]}")
                break
            if r["loss_err"] > tol or r["grad_err"] > tol:
                failures.append(f"{name}: loss error {r['loss_err']:.2e}, gradient error "
                                f"{r['grad_err']:.2e} ({r.get('config', 'dp')})")
                break
        else:
            # every trainable leaf has its gradient on some rank (a pipeline splits them)
            missing = set(results[0]["need"]) - {k for r in results for k in r["have"]}
            assert not missing, (name, sorted(missing))
            assert not any(r["warnings"] for r in results), (name, results[0]["warnings"])
    assert not failures, "\n".join(failures)


@pytest.mark.timeout(600)
@pytest.mark.heavy
def test_every_plan_lowers_for_64_devices():
    """`auto` lowers its plan on the abstract mesh before returning it (issue 20, item 7),
    so a plan coming back at all is the check; a batch of 64 gives 64 devices room. Every
    other model of the zoo (alphabetically; every model, on 4 devices too, in
    `benchmarks/coverage.py`), for the suite's time: all of them took 100 s of a suite that
    must stay under 30 minutes on a slower 2-core machine (2026-12-01)."""
    failures = []
    for name in NAMES[::2]:
        model, inputs = hf_zoo.build(name, dtype=torch.float32, batch=64)
        fn, params = pxform.module_fn(model)

        def loss(params, inputs, fn=fn):
            return fn(params, **inputs).loss

        for devices in (64,):
            step = pxform.auto(loss, mesh=devices, memory_budget="4GiB", hardware="a100-40gb")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", pxform.PxformWarning)
                    step.plan(params, inputs)
            except pxform.PxformError as exc:
                failures.append(f"{name} on {devices}: {str(exc)[:300]}")
    assert not failures, "\n".join(failures)


def test_a_cnn_whose_stages_differ_gets_a_block_per_layer(world2):
    """Issue 20, item 6: ResNet's stages differ in width (no repeated run), yet each layer
    is a block, so the search plans per layer and a pipeline can cut between them."""
    from pxform.passes.cuts import graph_blocks

    model, inputs = hf_zoo.build("resnet")
    fn, params = pxform.module_fn(model)
    traced = pxform.trace(lambda p, i: fn(p, **i).loss, params, inputs)
    batch = {v.name for v in traced.graph.inputs if not v.name.startswith("arg0")}
    labels = [b.label for b in graph_blocks(traced.graph, batch)]
    assert labels[1:] == ["resnet.encoder.stages.0.layers.0",
                          "resnet.encoder.stages.1.layers.0"], labels
    assert labels[0].startswith("embed")
    results = world2.run(H.run_zoo, "resnet", "pipeline")
    for r in results:
        assert r["ok"], r.get("error")
        assert r["config"].startswith("pp=2 "), r["config"]
        assert r["loss_err"] < 1e-12 and r["grad_err"] < 1e-12, r
    missing = set(results[0]["need"]) - {k for r in results for k in r["have"]}
    assert not missing


@pytest.mark.parametrize("name", ["gemma", "gemma2"])
def test_gemmas_rmsnorm_cast_does_not_keep_it_from_a_pipeline(world2, name):
    """Gemma's RMSNorm ends `out.type_as(x)`, x the layer's input: a cast that reads x for
    its dtype alone. Its rule had x gathered whole, so `auto` refused every pipeline for
    Gemma ("needs the whole batch at once") and the zoo's plans for it never had stages;
    pinned to 2 stages it now plans them, runs, and matches one process."""
    failures = _pipeline_failures(world2, (name,), "pipeline", 1e-5, 1e-5)
    assert not failures, "\n".join(failures)


def test_encoders_with_padding_masks_are_pipelined(world2):
    """HF's encoders build their attention mask by indexing the padding mask with
    `arange(batch)` (`transformers.masking_utils`): a value of global row positions, so
    the mask was read whole and `auto` refused every pipeline for them ("needs the whole
    batch at once"). Traced as per-row indexing (`pxform.frontend.rows`), each
    microbatch reads its own rows: pinned to 2 stages they plan, run, and match one
    process (the zoo's masks differ from row to row)."""
    failures = _pipeline_failures(world2, ("albert", "bert", "distilbert", "electra",
                                           "mpnet", "roberta"), "pipeline", 1e-12)
    assert not failures, "\n".join(failures)


def _pipeline_failures(world: World, names: tuple[str, ...], mode: str,
                       loss_tol: float, grad_tol: float = 1e-12) -> list[str]:
    """Per zoo model of `names` run under `mode` (`H.run_zoo`) that failed, did not plan
    2 stages, missed one process's loss by more than `loss_tol` or its gradients by
    more than `grad_tol`, or left a gradient on no rank: a line naming it."""
    failures = []
    for name in names:
        results = world.run(H.run_zoo, name, mode)
        for r in results:
            if not r["ok"]:
                failures.append(f"{name}: {r['error'][:300]}")
                break
            if not r["config"].startswith("pp=2 ") or r["loss_err"] > loss_tol \
                    or r["grad_err"] > grad_tol:
                failures.append(f"{name}: {r['config']}, {r['loss_err']:.1e}, "
                                f"{r['grad_err']:.1e}")
                break
        else:
            missing = set(results[0]["need"]) - {k for r in results for k in r["have"]}
            if missing:
                failures.append(f"{name}: no rank has the gradients of {sorted(missing)}")
    return failures


def test_language_models_with_padding_masks_are_pipelined(world2):
    """A causal (or seq2seq) model given a padding mask builds it the same way: every
    decoder of the zoo was refused a pipeline with one before. With a mask that differs
    from row to row, pinned to 2 stages: planned, run, and one process's loss (HF computes
    it in float32) and gradients."""
    failures = _pipeline_failures(world2, ("bloom", "gpt2", "llama", "opt", "t5"),
                                  "padded pipeline", 1e-6)
    assert not failures, "\n".join(failures)


def test_stochastic_depth_follows_pxforms_stream(world2):
    """Issue 20's "one vision transformer matches to 2e-3 only under data parallel": Swin
    (and BEiT) in training mode drop residual branches at random (stochastic depth, 0.1 by
    default). pxform draws those numbers from its counter-based stream, so every plan gives
    its own one-process run's result; eager draws from torch's generator, so it differs by
    the dropped branches: 1.7e-3 here. Model in eval mode (or drop_path_rate=0): exact."""
    for r in world2.run(H.run_train_mode, "swin"):
        assert r["parallel"] == r["one_rank"], r
        assert abs(r["parallel"] - r["eager"]) > 1e-4, r


def test_a_plan_that_does_not_lower_is_named():
    """The check `auto` runs before returning a plan (`_fails_to_lower`): None for its own
    plan; for a plan that does not lower here (made for another function), the reason."""
    g = torch.Generator().manual_seed(0)
    params = {"w1": torch.randn(16, 16, generator=g), "w2": torch.randn(16, 16, generator=g)}
    batch = torch.randn(8, 16, generator=g)

    def one(params, x):
        return (x @ params["w1"]).tanh().sum()

    def two(params, x):
        return (x @ params["w1"] @ params["w2"]).sum()

    kw = dict(mesh=4, memory_budget="1GiB", hardware="a100-40gb")
    first, second = pxform.auto(one, **kw), pxform.auto(two, **kw)
    plan = first.plan(params, batch)
    graph, names, _ = first._graph((params, batch))
    assert first._fails_to_lower(plan, (params, batch), graph.inputs, names) is None
    graph, names, _ = second._graph((params, batch))
    why = second._fails_to_lower(plan, (params, batch), graph.inputs, names)
    assert why is not None and "another function" in why, why
