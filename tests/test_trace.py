"""Tracing: IR vs eager (values and gradients), golden IR, static leaves, argument checks,
constants, in-place ops, no_grad regions, module paths, source lines and op errors."""

from __future__ import annotations

import os
import re

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

import pxform
from pxform.core.errors import SignatureMismatchError, TraceError, UnsupportedOpError

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")


def mlp_loss(params, batch):
    h = F.gelu(F.linear(batch["x"], params["w1"], params["b1"]))
    out = h @ params["w2"]
    return ((out - batch["y"]) ** 2).mean()


def mlp_args(dtype=torch.float64):
    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(32, 16, generator=g, dtype=dtype).requires_grad_(),
        "b1": torch.randn(32, generator=g, dtype=dtype).requires_grad_(),
        "w2": torch.randn(32, 8, generator=g, dtype=dtype).requires_grad_(),
    }
    batch = {"x": torch.randn(4, 16, generator=g, dtype=dtype),
             "y": torch.randn(4, 8, generator=g, dtype=dtype)}
    return params, batch


def assert_same_values_and_grads(fn, traced, params, *rest):
    ref = fn(params, *rest)
    got = traced(params, *rest)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    leaves = [p for p in params.values() if p.requires_grad] if isinstance(params, dict) else params
    g_ref = torch.autograd.grad(ref, leaves)
    g_got = torch.autograd.grad(got, leaves)
    for a, b in zip(g_got, g_ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_mlp_matches_eager_values_and_gradients():
    params, batch = mlp_args()
    traced = pxform.trace(mlp_loss, params, batch)
    pxform.check(traced.graph)
    assert_same_values_and_grads(mlp_loss, traced, params, batch)


def test_golden_ir_of_small_mlp():
    params, batch = mlp_args(torch.float32)
    text = str(pxform.trace(mlp_loss, params, batch))
    with open(os.path.join(GOLDEN, "mlp.ir.txt")) as f:
        assert text == f.read().rstrip("\n")


def test_op_table_rows_and_totals():
    params, batch = mlp_args(torch.float32)
    table = pxform.trace(mlp_loss, params, batch).op_table()
    linear_row = next(line for line in table.splitlines() if " linear " in line)
    # linear: 2*4*16*32 multiply-adds + 4*32 bias adds; output 4x32 f32
    assert "a b, c b, c -> a c" in linear_row
    assert "4.22 k" in linear_row and "512 B" in linear_row
    assert table.splitlines()[-1].startswith("total: 6 ops")
    by_target = pxform.trace(mlp_loss, params, batch).op_table(by="target")
    assert "aten.linear.default" in by_target and "aten.matmul.default" in by_target


def test_trace_from_meta_and_run_on_real():
    params, batch = mlp_args(torch.float32)
    meta = {k: torch.empty_like(v, device="meta") for k, v in params.items()}
    meta_batch = {k: torch.empty_like(v, device="meta") for k, v in batch.items()}
    traced = pxform.trace(mlp_loss, meta, meta_batch)
    assert_same_values_and_grads(mlp_loss, traced, params, batch)


def test_trace_from_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    params, batch = mlp_args(torch.float32)
    with FakeTensorMode() as mode:
        fake = {k: mode.from_tensor(v) for k, v in params.items()}
        fake_batch = {k: mode.from_tensor(v) for k, v in batch.items()}
    traced = pxform.trace(mlp_loss, fake, fake_batch)
    assert_same_values_and_grads(mlp_loss, traced, params, batch)


def test_pytree_outputs_and_static_leaves():
    def fn(params, x, scale, mode):
        y = x @ params[0] * scale
        if mode == "double":
            y = y * 2
        return {"y": y, "n": 3, "parts": (y.sum(), y.mean())}

    params = [torch.randn(3, 5)]
    x = torch.randn(2, 3)
    traced = pxform.trace(fn, params, x, 0.5, "double")
    out = traced(params, x, 0.5, "double")
    ref = fn(params, x, 0.5, "double")
    assert out["n"] == 3
    torch.testing.assert_close(out["y"], ref["y"])
    torch.testing.assert_close(out["parts"][1], ref["parts"][1])
    with pytest.raises(SignatureMismatchError, match=re.escape(
            "non-tensor argument mode is 'single' but was 'double' when traced")):
        traced(params, x, 0.5, "single")


def test_argument_mismatch_messages_name_the_path():
    params, batch = mlp_args(torch.float32)
    traced = pxform.trace(mlp_loss, params, batch)
    bad = dict(batch, x=torch.randn(5, 16))
    with pytest.raises(SignatureMismatchError) as err:
        traced(params, bad)
    assert str(err.value) == (
        "pxform.trace(mlp_loss): argument batch['x'] is f32[5,16] but was traced as f32[4,16]."
        "\n  Fix: pass a tensor of shape [4, 16] and dtype torch.float32, or trace again for "
        "the new shape.")
    with pytest.raises(SignatureMismatchError, match="called with arguments of structure"):
        traced(params, {"x": batch["x"]})


def test_captured_real_tensor_becomes_constant():
    table = torch.arange(6.0).reshape(2, 3)

    def fn(x):
        return x * table + torch.tensor(1.5)

    x = torch.randn(2, 3)
    traced = pxform.trace(fn, x)
    assert len(traced.graph.constants) == 2
    pxform.check(traced.graph)
    torch.testing.assert_close(traced(x), fn(x))


def test_captured_meta_tensor_is_a_clear_error():
    table = torch.empty(2, 3, device="meta")
    with pytest.raises(TraceError, match=r"(?s)tracing failed: .*two devices.*Fix: the function "
                                         r"uses a tensor on the meta device .* pass it as an"):
        pxform.trace(lambda x: x * table, torch.randn(2, 3))


def test_inplace_on_local_is_functionalised():
    def fn(x):
        y = x * 2
        y.add_(1)
        y.mul_(3)
        return y

    x = torch.randn(4, requires_grad=True)
    traced = pxform.trace(fn, x)
    assert [op.name for op in traced.graph.ops] == ["mul", "add", "mul"]
    pxform.check(traced.graph)
    torch.testing.assert_close(traced(x), fn(x))


def test_inplace_on_argument_is_refused():
    def fn(x):
        x.add_(1)
        return x * 2

    with pytest.raises(TraceError, match=r"aten.add_.Tensor mutates the function's argument %x "
                                         r"in place at .*test_trace.py:\d+ in fn"):
        pxform.trace(fn, torch.randn(4))


def test_no_grad_region_is_kept():
    def fn(w, x):
        with torch.no_grad():
            scale = (x @ w).abs().amax()
        return ((x @ w) / scale).sum()

    w = torch.randn(3, 3, requires_grad=True)
    x = torch.randn(2, 3)
    traced = pxform.trace(fn, w, x)
    assert [op.grad for op in traced.graph.ops[:3]] == [False, False, False]
    assert "[no_grad]" in str(traced)
    (g_ref,) = torch.autograd.grad(fn(w, x), [w])
    (g_got,) = torch.autograd.grad(traced(w, x), [w])
    torch.testing.assert_close(g_got, g_ref)


def masked_scores(w, x, mask):
    """HF's padding mask as `transformers.masking_utils` builds it: the 2-D mask indexed
    with broadcast row and key positions (row b of the result is row b of the mask)."""
    rows = torch.arange(mask.shape[0])[:, None, None, None]
    keys = torch.arange(mask.shape[1])[None, None, None, :]
    keep = mask.bool()[rows, keys]                                   # [B, 1, 1, S]
    scores = (x @ w) @ x.transpose(1, 2)                             # [B, S, S]
    return scores.unsqueeze(1).masked_fill(~keep, -1e4).softmax(-1).sum()


def test_a_row_lookup_by_position_becomes_per_row_indexing():
    """`mask[arange(B)[:, None, None, None], keys]` reads row b for row b: traced, it is
    `mask[:, keys]` with the size-1 dim squeezed (`pxform.frontend.rows`), so the batch
    dim passes through and a pipeline's microbatch reads its own rows; the arange of the
    traced batch is gone. Values and gradients are eager's, exactly."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 8, generator=g), torch.randn(4, 6, 8, generator=g)
    mask = torch.ones(4, 6, dtype=torch.long).tril(2)
    traced = pxform.trace(masked_scores, w, x, mask)
    ops = traced.graph.ops
    index = next(op for op in ops if op.name == "index")
    assert index.args[1][0] is None and str(index.outputs[0].type) == "b8[4,1,1,1,6]"
    assert [op.name for op in ops if op.name == "arange"] == ["arange"]  # the keys' only
    squeeze = next(op for op in ops if op.inputs and op.inputs[0] == index.outputs[0])
    assert squeeze.name == "squeeze" and str(squeeze.outputs[0].type) == "b8[4,1,1,6]"
    w.requires_grad_()
    ref, got = masked_scores(w, x, mask), traced(w, x, mask)
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    torch.testing.assert_close(torch.autograd.grad(got, w), torch.autograd.grad(ref, w),
                               rtol=0, atol=0)


@pytest.mark.parametrize("rows", [lambda n: torch.arange(1, n + 1) - 1,
                                  lambda n: torch.arange(n).flip(0),
                                  lambda n: torch.arange(n - 1)])
def test_a_row_lookup_by_other_positions_is_left_as_traced(rows):
    """Only `arange(n)` over the whole first dim (from 0, step 1) is the identity on the
    rows: other positions (shifted, reversed, fewer) stay an index the propagation
    reads whole."""
    mask = torch.ones(4, 6, dtype=torch.bool).tril(2)

    def fn(mask):
        r = rows(mask.shape[0])[:, None, None, None]
        return mask[r, torch.arange(6)[None, None, None, :]]

    traced = pxform.trace(fn, mask)
    index = next(op for op in traced.graph.ops if op.name == "index")
    assert index.args[1][0] is not None
    assert torch.equal(traced(mask), fn(mask))


def test_unknown_op_error_names_op_and_user_line():
    def fn(x):
        y = x + 1
        return torch.linalg.cross(y, y)  # no rule for linalg_cross

    with pytest.raises(UnsupportedOpError) as err:
        pxform.trace(fn, torch.rand(4, 3))
    msg = str(err.value)
    assert msg.startswith("pxform.trace: op aten.linalg_cross.default (linalg_cross) has "
                          "no sharding rule (called at ")
    assert re.search(r"test_trace.py:\d+ in fn: return torch.linalg.cross\(y, y\)", msg)
    assert "@pxform.ops.register_rule(torch.ops.aten.linalg_cross.default)" in msg
    assert "allow_fallback=True" in msg


def test_fallback_runs_replicated_and_reports():
    def fn(x):
        return torch.linalg.cross(x + 1, x).sum()

    x = torch.rand(4, 3)
    with pytest.warns(pxform.PxformWarning, match=r"1 ops have no sharding rule and will run "
                                                  r"replicated: linalg_cross at .*test_trace"):
        traced = pxform.trace(fn, x, allow_fallback=True)
    assert [op.name for op in traced.fallbacks] == ["linalg_cross"]
    sig = pxform.ops.rule_info(traced.fallbacks[0]).signature
    assert sig.splittable() == frozenset()
    pxform.check(traced.graph)
    torch.testing.assert_close(traced(x), fn(x))
    assert "1 ops run replicated by the fallback: linalg_cross" in traced.summary()


def test_registering_a_rule_makes_an_op_traceable():
    from pxform.ops.pointwise import pointwise_info
    from pxform.ops.registry import _RULES

    target = torch.ops.aten.special_bessel_j0.default  # a rule derived, not registered
    assert target not in _RULES
    pxform.register_rule(target)(lambda op: pointwise_info(op))
    try:
        traced = pxform.trace(lambda x: torch.special.bessel_j0(x), torch.rand(4))
        assert str(pxform.ops.rule_info(traced.graph.ops[0]).signature) == "a -> a"
        with pytest.raises(pxform.RuleError, match="already has a rule"):
            pxform.register_rule(target)(lambda op: pointwise_info(op))
    finally:
        _RULES.pop(target)


def test_data_dependent_control_flow_is_a_clear_error():
    def fn(x):
        if x.sum() > 0:
            return x
        return -x

    with pytest.raises(TraceError, match=r"pxform.trace\(fn\): tracing failed: .*\n  Fix: "
                                         r"control flow or shapes that depend on tensor values"):
        pxform.trace(fn, torch.randn(3))


def test_module_fn_records_module_paths_and_traces_on_meta():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.fc = torch.nn.Linear(8, 8)
            self.register_buffer("scale", torch.full((8,), 2.0))

        def forward(self, x):
            return self.fc(self.norm(x)) * self.scale

    with torch.device("meta"):
        model = torch.nn.Sequential(Block(), Block())
    fn, params = pxform.module_fn(model)
    assert set(params) >= {"0.fc.weight", "0.scale", "1.norm.bias"}
    assert not params["0.scale"].requires_grad
    traced = pxform.trace(fn, params, torch.empty(2, 8, device="meta"))
    # buffers are read through `detach`: state, never differentiated
    detached = [op.inputs[0].name for op in traced.graph.ops if op.name == "detach"]
    assert detached == ["arg0.scale", "arg1.scale"]
    assert traced.buffers == {k for k, v in enumerate(traced.graph.inputs)
                              if v.name in detached}
    modules = [op.module for op in traced.graph.ops if op.name != "detach"]
    assert modules == ["0.norm", "0.fc", "0", "1.norm", "1.fc", "1"]
    assert "# 1.fc" in str(traced)
    # the same function runs on materialised parameters
    real = torch.nn.Sequential(Block(), Block())
    fn_real, real_params = pxform.module_fn(real)
    x = torch.randn(2, 8)
    traced_real = pxform.trace(fn_real, real_params, x)
    torch.testing.assert_close(traced_real(real_params, x), real(x))


def test_source_lines_point_at_user_code():
    params, batch = mlp_args(torch.float32)
    traced = pxform.trace(mlp_loss, params, batch)
    sources = [op.source for op in traced.graph.ops]
    assert all(re.match(r"tests/test_trace.py:\d+ in mlp_loss: ", s) for s in sources), sources
    assert sources[0].endswith('F.gelu(F.linear(batch["x"], params["w1"], params["b1"]))')


def test_returning_an_unflattenable_object_is_a_clear_error():
    class Out:
        def __init__(self, loss):
            self.loss = loss

    with pytest.raises(TraceError, match=r"output is a Out, which pxform cannot flatten"):
        pxform.trace(lambda x: Out(x.sum()), torch.randn(3))


def test_cache_key_depends_on_shapes_dtypes_and_static_leaves():
    from pxform.frontend.trace import cache_key

    x = torch.randn(2, 3)
    assert cache_key((x, 1), {}) == cache_key((torch.zeros(2, 3), 1), {})
    assert cache_key((x, 1), {}) != cache_key((x, 2), {})
    assert cache_key((x,), {}) != cache_key((x.double(),), {})
    assert cache_key((x,), {}) != cache_key((torch.randn(3, 3),), {})


def test_library_tensor_caches_are_skipped_while_tracing():
    """The trace runs with `torch.compiler.is_compiling()` True, as non-strict export does,
    so a library's cache of tensors (HF's `compile_compatible_method_lru_cache`) is not
    filled with one trace's fake tensors: the next trace and eager calls stay correct."""
    cache: dict[int, torch.Tensor] = {}

    def table(n):
        if torch.compiler.is_compiling():
            return torch.arange(n, dtype=torch.float32)
        return cache.setdefault(n, torch.arange(n, dtype=torch.float32))

    def f(x):
        return (x + table(x.shape[0])).sum()

    x = torch.ones(3)
    first = pxform.trace(f, x)
    second = pxform.trace(f, x)
    assert not cache and not torch.compiler.is_compiling()
    assert float(first(x)) == float(second(x)) == float(f(x)) == 6.0


def test_grouped_mm_traces_as_dense_dispatch():
    """`F.grouped_mm` (HF mixture-of-experts' default experts) has no usable fake kernel
    for float32 on CPU; the trace writes it out as every row against every expert, keeping
    the row's own group's result. Rows past the last offset belong to no group."""
    grouped_mm = getattr(torch.nn.functional, "grouped_mm", None)
    if grouped_mm is None:
        pytest.skip("this torch has no grouped_mm")
    g = torch.Generator().manual_seed(0)
    a = torch.randn(10, 8, generator=g, requires_grad=True)  # rows 16-byte aligned
    b = torch.randn(3, 8, 4, generator=g, requires_grad=True)
    offs = torch.tensor([3, 7, 9], dtype=torch.int32)

    def f(a, b, offs):
        return grouped_mm(a, b, offs=offs)

    traced = pxform.trace(f, a, b, offs)
    assert "einsum" in {op.name for op in traced.graph.ops}
    got, ref = traced(a, b, offs), f(a, b, offs)
    torch.testing.assert_close(got[:9], ref[:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[9], torch.zeros(4))
    ga = torch.autograd.grad(got[:9].square().sum(), (a, b))
    gr = torch.autograd.grad(ref[:9].square().sum(), (a, b))
    # the kernel leaves the gradient of rows past the last offset unwritten; ours is zero
    torch.testing.assert_close(ga[0][:9], gr[0][:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(ga[0][9], torch.zeros(8))
    torch.testing.assert_close(ga[1], gr[1], rtol=1e-5, atol=1e-5)


def test_an_in_place_write_through_a_reshape_view_is_written_back():
    """Funnel writes `positional_attn *= cls_mask` into a reshape of a fresh tensor. A
    reshape that was a view when traced is written back like any view; one that copied
    made a fresh tensor, which the write changes alone (as eager)."""
    def through_view(x, m):
        y = x * 2
        v = y.reshape(4, 6)  # contiguous: a view of y
        v *= m
        return y.sum()

    def through_copy(x, m):
        y = x * 2
        v = y.t().reshape(6, 4)  # a copy
        v *= m.t()
        return v.sum() + y.sum()

    x, m = torch.randn(2, 12), torch.randn(4, 6)
    for fn in (through_view, through_copy):
        torch.testing.assert_close(pxform.trace(fn, x, m)(x, m), fn(x, m))


@st.composite
def _strided(draw):
    """A tensor of up to 4 dims, permuted and perhaps narrowed or strided (strides a view
    must respect), and a shape of its element count to view it as."""
    rank = draw(st.integers(1, 4))
    t = torch.empty(draw(st.lists(st.integers(1, 4), min_size=rank, max_size=rank)))
    t = t.permute(draw(st.permutations(list(range(rank)))))
    d = draw(st.integers(0, rank - 1))
    if draw(st.booleans()) and t.shape[d] > 1:
        t = t.narrow(d, 0, t.shape[d] - 1)
    if draw(st.booleans()) and t.shape[-1] > 2:
        t = t[..., ::2]  # (a run of dims laid out together whose innermost stride is 2)
    factors = []
    n = t.numel()
    for p in (2, 3):
        while n % p == 0:
            factors.append(p)
            n //= p
    wanted: list[int] = []
    for f in draw(st.permutations(factors)):
        if wanted and draw(st.booleans()):
            wanted[-1] *= f
        else:
            wanted.append(f)
    ones = draw(st.integers(0, 2))
    return t, wanted + [1] * ones or [1]


@given(_strided())
def test_view_possible_agrees_with_torch(case):
    """The trace decides from sizes and strides alone whether a reshape-like op returned a
    view (`_view_possible`; running `Tensor.view` on the traced value fails under a
    caller's fake mode): it agrees with `Tensor.view` on permuted and narrowed tensors, and
    `_contiguous` with `Tensor.is_contiguous`."""
    from pxform.frontend.trace import _contiguous, _view_possible

    t, wanted = case
    try:
        t.view(wanted)
        expected = True
    except RuntimeError:
        expected = False
    assert _view_possible(list(t.shape), list(t.stride()), wanted) is expected
    # and `contiguous` returns the tensor itself where torch calls it contiguous
    assert _contiguous(list(t.shape), list(t.stride())) is t.is_contiguous()
