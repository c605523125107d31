"""Lowering the example GPT for a 1,024-rank mesh in one process (fake process group); run in
a fresh process by test_large_world.py, since it initialises torch.distributed."""

from __future__ import annotations

import torch

from pxform import P


def lower_gpt_1024(rank: int) -> dict:
    import gpt

    import pxform
    from pxform.lower.spmd import CallInstr, ConvertInstr
    from pxform.runtime.graph_module import module_of
    from pxform.tools.testing import fake_world

    cfg = gpt.GPTConfig(vocab_size=50304, seq_len=2048, num_layers=2, num_heads=32,
                        d_model=2048)
    params = gpt.init_params(cfg, device="meta")
    ids = torch.empty(128, 2048, dtype=torch.long, device="meta")
    batch = {"idx": ids, "targets": ids}

    def block_spec() -> dict:
        # ZeRO-3 over sdp for every parameter; Megatron MLP over tp
        spec = {k: P("sdp") for k in params["blocks"][0]}
        spec.update(fc_w=P("tp", "sdp"), fc_b=P("tp"), out_w=P("sdp", "tp"))
        return spec

    pspec = {"wte": P("sdp"), "wpe": P("sdp"), "lnf_w": P("sdp"), "lnf_b": P("sdp"),
             "blocks": [block_spec() for _ in params["blocks"]]}

    def gpt_loss(p, b):
        return gpt.loss_fn(p, b, cfg)

    with fake_world(1024, rank=rank):
        mesh = pxform.Mesh({"dp": 16, "sdp": 8, "tp": 8})
        step = pxform.shard(gpt_loss, mesh=mesh,
                            in_specs=(pspec, {"idx": P(("dp", "sdp")),
                                              "targets": P(("dp", "sdp"))}))
        program = step.lower(params, batch)
        pxform.check(program)  # every op's local shapes, on meta tensors
        inputs = {v.name: list(program.local_shape(v)) for v in program.inputs}
        return {
            "coordinate": mesh.coordinate(),
            "inputs": inputs,
            "ops": sum(isinstance(i, CallInstr) for i in program.instrs),
            "converts": sum(isinstance(i, ConvertInstr) for i in program.instrs),
            "loss": str(program.outputs[0].type),
            "module_nodes": len(module_of(program).graph.nodes),
        }
