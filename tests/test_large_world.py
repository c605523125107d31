"""Programs for worlds far larger than this machine lower with the right local shapes: the
example GPT on a 1,024-rank mesh (dp 16 x sdp 8 x tp 8) under a fake process group, and
`pxform.check` catching a program whose layouts or shapes are wrong."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import multiprocessing as mp

import pytest
import spmd_workers as W

import pxform
from pxform import AbstractMesh, P


def _in_fresh_process(fn, *args):
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result(timeout=600)


@pytest.mark.heavy
def test_gpt_lowers_for_1024_ranks():
    import large_world

    r = _in_fresh_process(large_world.lower_gpt_1024, 77)
    assert r["coordinate"] == {"dp": 1, "sdp": 1, "tp": 5}  # 77 = 1*64 + 1*8 + 5
    shapes = r["inputs"]
    assert shapes["wte"] == [50304 // 8, 2048]
    assert shapes["blocks.0.fc_w"] == [8192 // 8, 2048 // 8]
    assert shapes["blocks.1.out_w"] == [2048 // 8, 8192 // 8]
    assert shapes["blocks.0.fc_b"] == [1024] and shapes["blocks.0.ln1_w"] == [256]
    assert shapes["idx"] == [1, 2048]  # 128 sequences over dp x sdp = 128 ranks
    assert r["ops"] == 52 and r["converts"] > 0
    assert r["loss"] == "f32[]"  # the loss comes back replicated
    assert r["module_nodes"] > r["ops"]


def _mlp_program():
    params, batch = W.big_mlp_args(batch=8)
    step = pxform.shard(W.mlp_loss, mesh=AbstractMesh({"dp": 2, "tp": 2}),
                        in_specs=({"w1": P("tp"), "b1": P("tp"), "w2": P("tp")},
                                  {"x": P("dp"), "y": P("dp")}))
    return step.lower(params, batch)


def test_check_accepts_lowered_programs_and_rejects_corrupted_ones():
    from pxform.core.ir import TensorType
    from pxform.lower.spmd import CallInstr, ConvertInstr

    program = _mlp_program()
    pxform.check(program)
    instrs = list(program.instrs)
    # an op whose output claims a layout no strategy gives
    k = next(i for i, x in enumerate(instrs) if isinstance(x, CallInstr)
             and x.op.name == "linear")
    call = instrs[k]
    out = call.outputs[0]
    wrong = dataclasses.replace(out, type=TensorType(out.type.shape, out.type.dtype,
                                                     P("dp", None), frozenset()))
    bad = dataclasses.replace(program, instrs=tuple(
        instrs[:k] + [dataclasses.replace(call, outputs=(wrong,))] + instrs[k + 1:]))
    with pytest.raises(pxform.GraphCheckError, match="not a strategy of linear"):
        pxform.check(bad)
    # a conversion whose steps do not reach the layout it claims
    j = next(i for i, x in enumerate(instrs) if isinstance(x, ConvertInstr)
             and x.forward.steps)
    conv = instrs[j]
    broken = dataclasses.replace(conv, forward=dataclasses.replace(conv.forward, steps=()))
    bad = dataclasses.replace(program, instrs=tuple(instrs[:j] + [broken] + instrs[j + 1:]))
    with pytest.raises(pxform.GraphCheckError, match="the steps end at"):
        pxform.check(bad)
