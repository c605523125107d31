"""Repeated module calls traced once (`pxform.frontend.reuse`, `trace(reuse_layers=...)`):
the IR is the same op for op with and without it, on every model of the zoo and on modules
built to tempt a wrong copy; copies happen where layers repeat."""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

import pxform

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from examples import factories  # noqa: E402


def _ops(traced: pxform.Traced) -> list[tuple]:
    """Each op as comparable text, constants by value (a copied call reads the constant
    its recording lifted, which has the same value)."""
    constants = {c.value.name: c.data for c in traced.graph.constants}

    def arg(a):
        if hasattr(a, "name") and getattr(a, "name", None) in constants:
            t = constants[a.name]
            fake = isinstance(t, torch._subclasses.FakeTensor)
            return ("const", t.dtype, tuple(t.shape), None if fake else t.tolist())
        if isinstance(a, (list, tuple)):
            return tuple(arg(x) for x in a)
        return repr(a)

    regions: dict[str, str] = {}  # region ids count across traces: by first appearance

    def tags(op):
        text = repr(op.tags)
        return re.sub(r"#(\d+)", lambda m: "#" + regions.setdefault(m.group(1),
                                                                     str(len(regions))), text)

    return [(str(op.target), tuple(arg(a) for a in op.args), repr(op.kwargs),
             tuple(str(o.type) for o in op.outputs), op.module, op.source, tags(op), op.grad)
            for op in traced.graph.ops]


def _both(fn, *args):
    """(traced without copies, traced with them)."""
    return (pxform.trace(fn, *args, reuse_layers=False),
            pxform.trace(fn, *args, reuse_layers=True))


def _assert_same(off: pxform.Traced, on: pxform.Traced) -> None:
    a, b = _ops(off), _ops(on)
    assert len(a) == len(b)
    for k, (x, y) in enumerate(zip(a, b)):
        assert x == y, f"op {k} differs:\n  traced: {x}\n  copied: {y}"
    assert [str(v) for v in off.graph.outputs] == [str(v) for v in on.graph.outputs]
    assert off.state == on.state and off.buffers == on.buffers
    assert off.copied_calls == 0


def _loss(model: torch.nn.Module):
    forward, params = pxform.module_fn(model)

    def loss(params, batch):
        return forward(params, **batch).loss

    return loss, params


# ---------------------------------------------------------------- real models

@pytest.mark.timeout(300)
@pytest.mark.heavy
def test_every_zoo_model_traces_the_same_ir_with_calls_copied():
    pytest.importorskip("transformers")
    from tests import hf_zoo

    copied = {}
    for name in hf_zoo.ZOO:
        model, inputs = hf_zoo.build(name, dtype=torch.float32)
        loss, params = _loss(model)
        off, on = _both(loss, params, inputs)
        try:
            _assert_same(off, on)
        except AssertionError as exc:
            raise AssertionError(f"{name}: {exc}") from None
        copied[name] = on.copied_calls
    # two identical layers: the second is copied (submodules of the first too)
    for name in ("gpt2", "llama", "bert", "mistral", "t5", "vit"):
        assert copied.get(name, 0) >= 1, (name, copied)


def test_a_model_in_train_mode_with_dropout_keeps_its_random_keys():
    pytest.importorskip("transformers")
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=32, n_head=4, vocab_size=64, n_positions=32, use_cache=False)).train()
    loss, params = _loss(model)
    ids = torch.randint(0, 64, (2, 8))
    off, on = _both(loss, params, {"input_ids": ids, "labels": ids})
    _assert_same(off, on)
    assert on.copied_calls >= 3
    keys = [op.tag("pxform.random").key for op in on.graph.ops if op.tag("pxform.random")]
    assert keys == list(range(len(keys))) and len(keys) >= 12


def test_the_example_gpt_as_a_module_copies_95_of_96_blocks_and_keeps_its_loss():
    fn, args = factories.gpt_module("small", batch=4)
    off, on = _both(fn, *args)
    _assert_same(off, on)
    assert on.copied_calls >= 3  # blocks 2-4 (and nothing refused them)
    # the oracle: the traced program computes the module's loss and gradients
    params, batch = args
    leaves = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    got = on(leaves, batch)
    got.backward()
    ref_params = {k: v.detach().clone().requires_grad_() for k, v in params.items()}
    ref = fn(ref_params, batch)
    ref.backward()
    torch.testing.assert_close(got, ref)
    for k in params:
        torch.testing.assert_close(leaves[k].grad, ref_params[k].grad, msg=k)
    big_fn, big_args = factories.gpt3_175b_module(batch=8, seq=64)
    assert pxform.trace(big_fn, *big_args).copied_calls == 95


def test_recompute_regions_around_copied_calls_keep_their_own_tags():
    from examples import gpt

    class RecomputedGPT(gpt.GPT):
        """Each block call inside its own `pxform.recompute` region (a new region id per
        call: a copied call takes the region open around it, not its recording's)."""

        def forward(self, idx, targets):
            params = {name: t for name, t in self.named_parameters() if "." not in name}
            params["blocks"] = list(self.blocks)

            def trunk(blocks, x):
                for b in blocks:
                    x = pxform.recompute(b)(x)
                return x

            return gpt.loss_fn(params, {"idx": idx, "targets": targets}, self.cfg, trunk)

    cfg = gpt.GPT_CONFIGS["small"]
    forward, params = pxform.module_fn(RecomputedGPT(cfg))
    batch = gpt.make_batch(cfg, 4)
    off, on = _both(lambda p, b: forward(p, b["idx"], b["targets"]), params, batch)
    _assert_same(off, on)
    assert on.copied_calls >= 3
    regions = {dict(op.tags).get("pxform.recompute") for op in on.graph.ops}
    assert len(regions - {None}) == 4  # one per block, copied ones included


# ---------------------------------------------------------------- modules that tempt a wrong copy

class Layer(torch.nn.Module):
    def __init__(self, index: int, every: int | None = None, side_effect: bool = False,
                 lift: bool = False) -> None:
        super().__init__()
        self.index = index  # read only when `every` is set
        self.every = every
        self.side_effect = side_effect
        self.lift = lift
        self.calls = 0
        self.w = torch.nn.Parameter(torch.randn(8, 8) / 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(F.linear(x, self.w))
        if self.every is not None and self.index % self.every == self.every - 1:
            y = y * 3.0  # every `every`-th layer differs: decided by the attribute read
        if self.side_effect:
            self.calls += 1
        if self.lift:
            y = y * torch.tensor(0.5)  # a lifted constant, shared by the copies
        return x + y


class Stack(torch.nn.Module):
    def __init__(self, layers: list[torch.nn.Module]) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _trace_stack(layers: list[torch.nn.Module]) -> tuple[pxform.Traced, pxform.Traced]:
    model = Stack(layers)
    forward, params = pxform.module_fn(model)
    return _both(forward, params, torch.randn(4, 8))


def test_a_layer_whose_forward_reads_its_index_is_copied_only_where_the_value_matches():
    off, on = _trace_stack([Layer(i, every=3) for i in range(6)])
    _assert_same(off, on)
    muls = [op for op in on.graph.ops if op.name == "mul"]
    assert len(muls) == 2  # layers 2 and 5 only
    # the index is read, so layers with different indices are never copied from each other
    assert on.copied_calls == 0


def test_an_attribute_the_forward_never_reads_does_not_stop_the_copy():
    off, on = _trace_stack([Layer(i) for i in range(6)])
    _assert_same(off, on)
    # layer 0 reads the input (no grad), layer 1 an activation (grad): both are traced
    assert on.copied_calls == 4


def test_a_forward_that_writes_an_attribute_is_traced_every_time():
    layers = [Layer(i, side_effect=True) for i in range(4)]
    off, on = _trace_stack(layers)
    _assert_same(off, on)
    assert on.copied_calls == 0
    assert [layer.calls for layer in layers] == [2, 2, 2, 2]  # once per trace, every layer


def test_lifted_constants_are_shared_by_the_copies():
    off, on = _trace_stack([Layer(i, lift=True) for i in range(4)])
    _assert_same(off, on)
    assert on.copied_calls == 2


class Captures(torch.nn.Module):
    """Reads a tensor that is neither an argument nor its own parameter."""

    def __init__(self, box: dict) -> None:
        super().__init__()
        self.box = box
        self.w = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.box["bias"]


class Passes(torch.nn.Module):
    """Returns its input as one output and a view of it as another."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.view(-1)


def test_calls_that_read_outside_tensors_or_return_their_inputs_are_traced():
    box: dict = {}

    def fn(params, x):
        box["bias"] = torch.zeros(8)
        a, b = Captures(box), Captures(box)
        torch.func.functional_call(a, {"w": params["w1"]}, (x,))
        box["bias"] = x.sum(0)  # a new tensor each call: a copy would read the old one
        y = torch.func.functional_call(a, {"w": params["w1"]}, (x,))
        box["bias"] = y.sum(0)
        z = torch.func.functional_call(b, {"w": params["w2"]}, (y,))
        p = Passes()
        u, v = p(z)
        u2, v2 = p(z * 2)
        return (u + u2).sum() + (v * v2).sum()

    params = {"w1": torch.randn(8, 8), "w2": torch.randn(8, 8)}
    off, on = _both(fn, params, torch.randn(4, 8))
    _assert_same(off, on)
    assert on.copied_calls == 0


def test_batch_norm_in_train_mode_is_traced_every_time_and_writes_its_statistics():
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(8, 8),
                                                      torch.nn.BatchNorm1d(8))
                                  for _ in range(3)]).train()
    forward, params = pxform.module_fn(model)
    off, on = _both(lambda p, x: forward(p, x).sum(), params, torch.randn(4, 8))
    _assert_same(off, on)
    assert len(on.state) == 9  # mean, var and count of each norm, written back
    # the third Linear is copied from the second (the first reads the input, which does
    # not require grad); the norms write their statistics and are never copied
    assert on.copied_calls == 1


def test_turning_it_off_traces_every_call():
    fn, args = factories.gpt_module("tiny", batch=2)
    assert pxform.trace(fn, *args, reuse_layers=False).copied_calls == 0
    traced = pxform.trace(fn, *args)
    assert traced.copied_calls == 1
    assert "1 module calls copied" in traced.summary()


def test_the_hooks_are_removed_after_a_trace_even_one_that_fails():
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    before = (PythonKeyTracer.__dict__["call_module"], torch.nn.Module.__dict__["__setattr__"])

    class Bad(torch.nn.Module):
        def forward(self, x):
            return x if x.sum() > 0 else -x  # data-dependent: the trace fails

    forward, params = pxform.module_fn(Stack([Layer(0), Bad()]))
    with pytest.raises(pxform.TraceError):
        pxform.trace(forward, params, torch.randn(4, 8))
    assert "__getattribute__" not in torch.nn.Module.__dict__
    assert (PythonKeyTracer.__dict__["call_module"],
            torch.nn.Module.__dict__["__setattr__"]) == before
