"""Plans of `pxform.auto` run on real gloo worlds and match the single-process reference.

Each case plans the tiny GPT (float64) for the world's size, runs `value_and_grad` of the
plan on every rank, and compares loss and every parameter gradient with plain autograd on
one process. Unpinned cases take whatever the search chose; pinned cases force each role
(data parallel, ZeRO-3, tensor parallel, pipeline, recompute), and the lowered program's
collectives show that the role really ran.
"""

from __future__ import annotations

from pathlib import Path

import auto_workers as W
import pytest

from pxform.search import Pin
from pxform.search.pipelines import ScheduleChoice
from pxform.search.space import Option
from pxform.tools.testing import World

TOL = 1e-12


@pytest.fixture(scope="module")
def world2():
    with World(2) as w:
        yield w


@pytest.fixture(scope="module")
def world4():
    with World(4) as w:
        yield w


def _check(results: list[dict]) -> dict:
    first = results[0]
    for r in results:
        assert r["config"] == first["config"] and r["fingerprint"] == first["fingerprint"]
        assert r["loss_err"] < TOL, r
        assert r["grad_err"] < TOL, r
    # every gradient leaf is on some rank (a pipeline returns each on its stage's ranks)
    covered = set().union(*(set(r["have"]) for r in results))
    assert len(covered) == first["num_leaves"]
    return first


def test_searched_plan_runs_on_2_ranks(world2):
    _check(world2.run(W.run_plan, None))


@pytest.mark.parametrize("roles, recompute, forward, backward", [
    # data parallel: the gradient all-reduce only in backward (the loss's mean is
    # all-reduced forward, in every role)
    ((("outer", "dp"),), None, {"all_reduce"}, {"all_reduce"}),
    # ZeRO-3: parameters all-gathered forward, gradients reduce-scattered backward
    ((("outer", "sdp"),), None, {"all_gather"}, {"reduce_scatter"}),
])
def test_pinned_data_roles_on_2_ranks(world2, roles, recompute, forward, backward):
    r = _check(world2.run(W.run_plan, W.pin(1, 2, 1, 1, roles, recompute)))
    assert forward <= set(r["collectives"]["forward"]), r["collectives"]
    assert backward <= set(r["collectives"]["backward"]), r["collectives"]
    if roles[0][1] == "dp":
        assert "all_gather" not in r["collectives"]["forward"]


def test_zero3_keeping_gathered_parameters_per_block_on_2_ranks(world2):
    """A plan whose middle blocks keep ZeRO-3's gathered parameters for backward
    (`BlockPlan.reshard` False) runs with the runtime resharding every parameter but
    theirs (by pytree path), and matches the reference."""
    r = _check(world2.run(W.run_plan, W.pin(1, 2, 1, 1, (("outer", "sdp"),),
                                            reshard=(True, False, False, True))))
    assert r["strategies"] == ["outer=sdp", "outer=sdp +keep-gathered",
                               "outer=sdp +keep-gathered", "outer=sdp"]
    freed = r["reshard"]
    assert isinstance(freed, list) and "wte" in freed, freed
    assert not any(p.startswith(("blocks.0.", "blocks.1.")) for p in freed), freed
    assert {"all_gather"} <= set(r["collectives"]["forward"])
    assert {"reduce_scatter"} <= set(r["collectives"]["backward"])


def test_pinned_tensor_parallel_with_recompute_on_2_ranks(world2):
    r = _check(world2.run(W.run_plan, W.pin(1, 1, 2, 1, (("inner", "tp"),),
                                            (False, True, True, False))))
    assert r["strategies"][1] == "inner=tp +recompute"
    # Megatron's f and g: activations all-reduced forward and backward
    assert "all_reduce" in r["collectives"]["forward"]
    assert "all_reduce" in r["collectives"]["backward"]


def test_pinned_sequence_parallel_with_recompute_on_2_ranks(world2):
    """Sequence parallelism between blocks: values cross blocks split over the tensor
    axis along the sequence, so the blocks' boundaries are all-gathers and
    reduce-scatters, not all-reduces; the result is the reference's."""
    r = _check(world2.run(W.run_plan, W.pin(1, 1, 2, 1, (("inner", "sp"),),
                                            (False, True, False, False))))
    assert r["strategies"][:2] == ["inner=sp", "inner=sp +recompute"]
    assert {"all_gather", "reduce_scatter"} <= set(r["collectives"]["forward"])
    assert {"all_gather", "reduce_scatter"} <= set(r["collectives"]["backward"])


def test_searched_plan_runs_on_4_ranks(world4):
    _check(world4.run(W.run_plan, None))


def test_the_conversion_costs_are_measured_on_4_ranks(world4):
    """`runtime_costs` measures `relayout_wait_share` and `all_to_all_share` on any even
    world: the reference transformer tensor and sequence parallel over pairs of ranks,
    data parallel across the pairs. With 2 devices per node, tensor parallelism over all
    4 ranks has no plan (the inner axis stays within a node), and calibrating failed.
    The all-to-alls' share is the preset's latencies: 3 against a ring all-reduce's 6.
    The mean compute before a run of conversions (`relayout_gap_s`) is the model's, the
    same on every rank, and positive (its ops 10,000 times slower than the preset's).
    The profile keeps `WAIT_SHARE_CARRIED` of the share fitted on the reference's pairs
    (`carried_wait_share`)."""
    from pxform.tools.runtime_costs import WAIT_SHARE_CARRIED

    got = world4.run(W.relayout_costs)
    assert all(isinstance(x, float) and x >= 0.0 for pair in got for x in pair), got
    assert all(r[0] == pytest.approx(WAIT_SHARE_CARRIED * r[3], abs=1e-12) for r in got), got
    assert got[0][1] == pytest.approx(0.5, abs=0.01), got
    assert got[0][2] > 0 and all(r[2] == got[0][2] for r in got), got


def test_pipeline_of_tensor_parallel_stages_on_4_ranks(world4):
    r = _check(world4.run(W.run_plan, W.pin(2, 1, 2, 4, (("inner", "tp"),))))
    assert r["config"].startswith("pp=2 outer=1 inner=2 microbatches=4")


@pytest.mark.parametrize("schedule", [ScheduleChoice("zb"), ScheduleChoice("interleaved", 2),
                                      ScheduleChoice("shifted")],
                         ids=["zero-bubble", "interleaved", "shifted"])
def test_searched_schedules_run_as_planned_on_2_ranks(world2, schedule):
    """A plan under zero-bubble, interleaved or shifted runs that schedule (W actions; two
    chunks per rank, stage s on rank s % 2; an early recompute R on stage 0 only) and
    matches the single-process reference."""
    results = world2.run(W.run_plan, W.pin(2, 1, 1, 4, None, schedule=schedule))
    r = _check(results)
    assert r["config"].endswith(f"schedule={schedule.text()}"), r["config"]
    kinds = {kind for _, kind in r["actions"]}
    if schedule.split:
        assert "W" in kinds and max(r["stage_of_block"]) == 1
    elif schedule.name == "shifted":
        assert max(r["stage_of_block"]) == 1
        last = {kind for _, kind in results[1]["actions"]}
        assert "R" in kinds and "R" not in last, (kinds, last)
    else:
        assert "W" not in kinds and r["stage_of_block"] == [0, 1, 2, 3]
        assert {s for s, _ in r["actions"]} == {0, 2}  # rank 0 runs stages 0 and 2


def test_zero3_outer_tensor_inner_with_recompute_on_4_ranks(world4):
    r = _check(world4.run(W.run_plan, W.pin(1, 2, 2, 1, (("outer", "sdp"), ("inner", "tp")),
                                            (True, False, True, False))))
    assert {"all_gather"} <= set(r["collectives"]["forward"])
    assert {"reduce_scatter"} <= set(r["collectives"]["backward"])


def test_distribute_lays_arguments_out_per_the_plan(world2):
    results = world2.run(W.run_distributed, W.pin(1, 2, 1, 1, (("outer", "sdp"),)))
    for r in results:
        assert r["loss_err"] < TOL
        # ZeRO-3: every weight matrix is a DTensor split over the data axis
        assert "('blocks', 0, 'fc_w')" in r["placements"]
        assert "Shard(dim=0)" in r["placements"]["('blocks', 0, 'fc_w')"]


@pytest.mark.parametrize("stages", [1, 2], ids=["zero3", "pipeline"])
def test_what_training_loops_rely_on(world2, stages):
    the_pin = W.pin(1, 2, 1, 1, (("outer", "sdp"),)) if stages == 1 else \
        W.pin(2, 1, 1, 2, None)
    results = world2.run(W.run_training_api, the_pin)
    for r in results:
        assert not r["aliased"]  # distribute copies: the caller's tensors stay as they were
        assert r["mismatched"] == []
        assert r["ranks"] == [(0, 0), (1, stages - 1)]
        assert all(t > 0 for t in r["times"]) and all(s > 0 for s in r["state"])
        assert all(p > s for p, s in zip(r["peaks"], r["state"]))
        assert "predicted vs measured" in r["text"] and "worst rank" in r["text"]
    if stages == 1:
        assert [r["held"] for r in results] == [results[0]["leaves"]] * 2
    else:
        # each pipeline rank holds its stage's leaves; the tied embedding both
        held = [r["held"] for r in results]
        assert all(0 < h < results[0]["leaves"] for h in held)
        assert sum(held) == results[0]["leaves"] + 1


# The memory model against the meter (`docs/benchmarks/accuracy.md`): GPT "small" on 2
# ranks. Data parallel, ZeRO-3, recompute and a 2-stage pipeline are within the 5 %
# goal (the model before the meter check was off by +14 % to +32 % on the first three and
# short on the pipeline's last stage, which holds the tied embedding too); tensor and
# sequence parallelism too (held to 15 % until the forty-second session; -9 % when the
# model missed runtime buffers). Pipelines under every schedule are held to
# 5 %: before the model counted the tensors the executor's sends keep to the end of the
# step (each F's boundary outputs, each B's input gradients), the received output
# gradient and, under zero-bubble, the weight ops' outputs kept from F to W that no op
# saves, 1F1B with 8 microbatches was -5 %, zero-bubble -9 % and interleaved -11 %.
# Held-out shapes besides (the forty-second session): a wider GPT with 3 layers
# (`WIDE`: its ZeRO-3 step was -4.2 % with one block's gathered parameters on top of the
# op at work, its 2-microbatch pipeline's last stage +8.7 %, its interleaved
# pipeline's last rank -8.5 % and its recomputed tensor-parallel step +5.6 %), and a
# narrow one with 6 layers and a large vocabulary
# (`VOCAB`: 1F1B's and the shifted schedule's first stage +6 %, ZeRO-3 +3 %); and a third
# looked at only after those were fixed (`SHORT`: 2 layers of width 256 at 128 tokens,
# its 2-microbatch pipeline's first stage +5.7 % with each op's transient on top of what
# the ops after it saved and backward had freed).
WIDE = {"num_layers": 3, "d_model": 192, "num_heads": 6, "seq_len": 96}
VOCAB = {"num_layers": 6, "d_model": 96, "num_heads": 4, "vocab_size": 4096}
SHORT = {"num_layers": 2, "d_model": 256, "num_heads": 8, "seq_len": 128}


@pytest.mark.slow
@pytest.mark.parametrize("name, the_pin, limit", [
    ("dp", W.pin(1, 2, 1, 1, (("outer", "dp"),), (False,) * 6), 0.05),
    ("zero3", W.pin(1, 2, 1, 1, (("outer", "sdp"),), (False,) * 6), 0.05),
    ("zero3 kept", W.pin(1, 2, 1, 1, (("outer", "sdp"),), (False,) * 6,
                         reshard=(True,) + (False,) * 4 + (True,)), 0.05),
    ("dp+recompute", W.pin(1, 2, 1, 1, (("outer", "dp"),), (True,) * 6), 0.05),
    ("tp", W.pin(1, 1, 2, 1, (("inner", "tp"),), (False,) * 6), 0.05),
    ("sp", W.pin(1, 1, 2, 1, (("inner", "sp"),), (False,) * 6), 0.05),
    ("pp2 m2", W.pin(2, 1, 1, 2, None, schedule=ScheduleChoice()), 0.05),
    ("pp2 m8", W.pin(2, 1, 1, 8, None, schedule=ScheduleChoice()), 0.05),
    ("pp2 m4 zb", W.pin(2, 1, 1, 4, None, schedule=ScheduleChoice("zb")), 0.05),
    ("pp2 m8 zb", W.pin(2, 1, 1, 8, None, schedule=ScheduleChoice("zb")), 0.05),
    ("pp2 m4 interleaved", W.pin(2, 1, 1, 4, None,
                                 schedule=ScheduleChoice("interleaved", 2)), 0.05),
    ("pp2 m8 interleaved", W.pin(2, 1, 1, 8, None,
                                 schedule=ScheduleChoice("interleaved", 2)), 0.05),
    ("pp2 m4 shifted", W.pin(2, 1, 1, 4, None, schedule=ScheduleChoice("shifted")), 0.05),
], ids=["dp", "zero3", "zero3-kept", "dp+recompute", "tp", "sp", "pp2-m2", "pp2-m8", "pp2-m4-zb",
        "pp2-m8-zb", "pp2-m4-interleaved", "pp2-m8-interleaved", "pp2-m4-shifted"])
@pytest.mark.heavy
def test_predicted_memory_matches_the_meter(world2, name, the_pin, limit):
    errors = world2.run(W.run_memory_accuracy, the_pin)
    worst = max((e for rank in errors for e in rank), key=abs)
    assert abs(worst) <= limit, (name, errors)


@pytest.mark.slow
@pytest.mark.parametrize("name, shape, the_pin", [
    ("wide zero3", WIDE, W.pin(1, 2, 1, 1, (("outer", "sdp"),), (False,) * 5)),
    ("wide zero3 kept", WIDE, W.pin(1, 2, 1, 1, (("outer", "sdp"),), (False,) * 5,
                                    reshard=(False,) * 5)),
    ("wide tp", WIDE, W.pin(1, 1, 2, 1, (("inner", "tp"),), (False,) * 5)),
    ("wide tp+recompute", WIDE, W.pin(1, 1, 2, 1, (("inner", "tp"),), (True,) * 5)),
    ("wide pp2 m2", WIDE, W.pin(2, 1, 1, 2, None, schedule=ScheduleChoice())),
    ("wide pp2 m8 interleaved", WIDE, W.pin(2, 1, 1, 8, None,
                                            schedule=ScheduleChoice("interleaved", 2))),
    ("vocab zero3", VOCAB, W.pin(1, 2, 1, 1, (("outer", "sdp"),), (False,) * 8)),
    ("vocab pp2 m8", VOCAB, W.pin(2, 1, 1, 8, None, schedule=ScheduleChoice())),
    ("vocab pp2 m8 shifted", VOCAB, W.pin(2, 1, 1, 8, None,
                                          schedule=ScheduleChoice("shifted"))),
    ("short pp2 m2", SHORT, W.pin(2, 1, 1, 2, None, schedule=ScheduleChoice())),
    ("short tp+recompute", SHORT, W.pin(1, 1, 2, 1, (("inner", "tp"),), (True,) * 4)),
], ids=["wide-zero3", "wide-zero3-kept", "wide-tp", "wide-tp-recompute", "wide-pp2-m2",
        "wide-pp2-m8-interleaved", "vocab-zero3", "vocab-pp2-m8", "vocab-pp2-m8-shifted",
        "short-pp2-m2", "short-tp-recompute"])
@pytest.mark.heavy
def test_predicted_memory_matches_the_meter_on_held_out_shapes(world2, name, shape, the_pin):
    errors = world2.run(W.run_memory_accuracy, the_pin, shape)
    worst = max((e for rank in errors for e in rank), key=abs)
    assert abs(worst) <= 0.05, (name, errors)


# Zero-bubble's W asks autograd from every weight op's outputs for its weight inputs, and
# the runtime counts an embedding's lookup of the token ids as a weight op
# (`pxform.lower.mpmd._weight_ops`, and the sum with the positions' lookup as another):
# the first stage keeps both lookups of every microbatch in flight to its W. The model
# had taken the lookups for weights (made from parameters alone, the ids being integers):
# that stage came out 2.3 % under the meter on `SHORT`. And the last stage's W makes the
# tied embedding's gradient too, in its pool beside the stage's own: left out, that stage
# came out 2.8 % under on `VOCAB1K` (5 layers of width 160 at 48 tokens, vocabulary 1,024;
# the forty-sixth session's held-out shape). And that stage peaks in the W after its last
# B, with the input gradients of its last two B's still sending (`schedules.at_peak`):
# counted as one, it came out 1.3 % under on `SHORT`.
VOCAB1K = {"num_layers": 5, "d_model": 160, "num_heads": 8, "seq_len": 48,
           "vocab_size": 1024}


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [("short", SHORT), ("vocab1k", VOCAB1K)])
def test_a_zero_bubble_pipeline_is_metered_with_what_its_w_actions_keep(world2, name, shape):
    zb = W.pin(2, 1, 1, 8, None, schedule=ScheduleChoice("zb"))
    errors = world2.run(W.run_memory_accuracy, zb, shape)
    worst = max((e for rank in errors for e in rank), key=abs)
    assert abs(worst) <= 0.01, (name, errors)


# A profile of this kind of machine (2 gloo ranks; the forty-fifth session's accuracy run
# c) makes the tensor axis split attention's heads, its query, key and value re-laid out
# into copies of their own, where the a100-40gb preset keeps attention whole. The model
# had counted the projection's whole output besides those copies (the wide shape +5.9 %)
# and missed the copy the output projection saves of attention's output, which comes out
# in the kernel's own layout there (a 4-head short shape -3.1 % once the first was fixed).
CPU_PROFILE = str(Path(__file__).parent / "golden" / "cpu-x2-profile.json")
SHORT4 = {**SHORT, "num_heads": 4}


@pytest.mark.slow
@pytest.mark.parametrize("name, shape", [("wide", WIDE), ("short4", SHORT4)])
def test_a_tensor_parallel_attention_on_re_laid_out_copies_is_metered_as_predicted(
        world2, name, shape):
    tp = W.pin(1, 1, 2, 1, (("inner", "tp"),), (False,) * (shape["num_layers"] + 2))
    errors = world2.run(W.run_memory_accuracy, tp, shape, CPU_PROFILE)
    worst = max((e for rank in errors for e in rank), key=abs)
    assert abs(worst) <= 0.02, (name, errors)


def test_a_recomputed_stack_on_its_input_keeps_every_layers_input(world2):
    """A recomputed block keeps its checkpoint's inputs. The search walks a block kind's
    first block for all of them, and the first layer of a stack on the input reads the
    batch where the others read the layer before: priced from that layer's reads, every
    layer of a recomputed residual MLP kept nothing, 13-34 % under the meter (data
    parallel -13 %, tensor parallel -34 %, ZeRO-3 -23 %; the fifty-third session)."""
    layers = 8

    def every(roles: tuple) -> tuple:
        return (Option(roles, True),) * (layers + 1)  # (the layers, the loss)

    pins = {"dp": Pin(stages=1, outer=2, inner=1, microbatches=1,
                      block_options=every((("outer", "dp"),))),
            "tp": Pin(stages=1, outer=1, inner=2, microbatches=1,
                      block_options=every((("inner", "tp"),))),
            "zero3": Pin(stages=1, outer=2, inner=1, microbatches=1,
                         block_options=every((("outer", "sdp"),)))}
    errors = world2.run(W.run_stack_memory, pins, layers, 128, 4096)[0]
    worst = {name: max(e, key=abs) for name, e in errors.items()}
    assert all(abs(e) <= 0.05 for e in worst.values()), worst


@pytest.mark.parametrize("the_pin", [W.pin(1, 2, 1, 1, (("outer", "dp"),)),
                                     W.pin(2, 1, 1, 4, None, schedule=ScheduleChoice("1f1b"))],
                         ids=["dp", "pp2"])
def test_unfreezing_after_planning_warns_once_with_the_plan_repriced(world2, the_pin):
    """Progressive unfreezing: the plan was made with the embeddings frozen, and the
    step after they are unfrozen trains them (its gradients match one process), but the
    plan's layouts and its predicted peak were for the old marks. That step warns, once,
    naming the parameters and giving the plan re-priced for the new marks; steps before
    and after it do not."""
    results = world2.run(W.run_unfrozen, the_pin)
    for r in results:
        before, changed, after = r["warnings"]
        assert before == [] and after == [], r["warnings"]
        assert r["grad_err"] < 1e-9, r
    # every rank that holds the embeddings warns, the pipeline's last stage (the head
    # reads the tied embedding) too
    warned = [r["warnings"][1] for r in results if r["warnings"][1]]
    assert warned
    for texts in warned:
        (text,) = texts
        assert "pxform.auto(loss_fn): the requires_grad marks of the parameters changed " \
               "since the plan was made:" in text, text
        assert "trained now that were frozen (" in text and "wte" in text, text
        assert "re-priced for the new marks:" in text, text
        assert "within the 40 GiB budget" in text, text
        assert "Fix: to plan for the new marks, make a new pxform.auto(...)" in text, text
    # and the embeddings' gradients come back where they are held
    assert any(all(r["embedding_grads"]) for r in results)
