"""The IR types, the printer and `check` (which must reject corrupted graphs)."""

from __future__ import annotations

import pytest
import torch

import pxform
from pxform.core.errors import GraphCheckError
from pxform.core.ir import Op, TensorType, Value


def small_graph():
    def fn(w, x):
        return torch.relu(x @ w).sum()

    return pxform.trace(fn, torch.randn(3, 4), torch.randn(2, 3)).graph


def test_tensor_type_prints_shapes_specs_and_partials():
    assert str(TensorType((8, 1024), torch.float32)) == "f32[8,1024]"
    assert str(TensorType((8, 1024), torch.bfloat16, pxform.P("dp", "tp"))) == "bf16[8@dp,1024@tp]"
    assert str(TensorType((8,), torch.int64, pxform.P(("dp", "tp")))) == "i64[8@dp@tp]"
    assert str(TensorType((), torch.float32, partial=frozenset({"tp", "dp"}))) == "f32[]{+dp,+tp}"


def test_partition_spec_is_validated():
    assert pxform.P("dp", None).axes_of(0) == ("dp",)
    assert pxform.P(["dp", "tp"]).axes_of(0) == ("dp", "tp")
    # an axis on two dims is reported where the spec meets a tensor and a mesh (shard's
    # check_spec), with the argument's path: see test_shard's error tests
    assert pxform.P("dp", ("tp", "dp")).repeated_axes() == {"dp": [0, 1]}
    with pytest.raises(TypeError, match="entry 1 is 3; each entry must be None, a mesh axis"):
        pxform.P("dp", 3)


def test_ir_is_frozen_and_replace_returns_new_graph():
    g = small_graph()
    with pytest.raises(AttributeError):
        g.ops = ()  # type: ignore[misc]
    g2 = g.replace(name="other")
    assert g2.name == "other" and g.name == "fn" and g2.ops is g.ops
    assert pxform.core.ir.Op.__slots__  # slotted


def test_check_accepts_traced_graph():
    pxform.check(small_graph())


def test_check_rejects_wrong_output_type():
    g = small_graph()
    op = g.ops[0]
    bad_value = Value(op.outputs[0].name, TensorType((2, 5), torch.float32))
    bad = g.replace(ops=(op.replace(outputs=(bad_value,)),) + g.ops[1:])
    with pytest.raises(GraphCheckError, match=r"check: op 0 \(matmul at .*\) declares outputs "
                                              r"\(f32\[2,5\]\) but its rule gives \(f32\[2,4\]\)"):
        pxform.check(bad)


def test_check_rejects_wrong_dtype():
    g = small_graph()
    op = g.ops[1]
    bad_value = Value(op.outputs[0].name, TensorType((2, 4), torch.float64))
    bad = g.replace(ops=(g.ops[0], op.replace(outputs=(bad_value,))) + g.ops[2:])
    with pytest.raises(GraphCheckError, match=r"declares outputs \(f64\[2,4\]\) but its rule "
                                              r"gives \(f32\[2,4\]\)"):
        pxform.check(bad)


def test_check_rejects_use_before_definition():
    g = small_graph()
    swapped = (g.ops[1], g.ops[0]) + g.ops[2:]
    with pytest.raises(GraphCheckError, match=r"op 0 \(relu.*\) reads %0, which is not defined "
                                              r"before it"):
        pxform.check(g.replace(ops=swapped))


def test_check_rejects_double_definition():
    g = small_graph()
    relu = g.ops[1]
    clash = relu.replace(outputs=(Value(g.ops[0].outputs[0].name, relu.outputs[0].type),))
    with pytest.raises(GraphCheckError, match=r"value %0 is defined twice"):
        pxform.check(g.replace(ops=(g.ops[0], clash) + g.ops[2:]))


def test_check_rejects_input_read_with_wrong_type():
    g = small_graph()
    op = g.ops[0]
    wrong = Value(g.inputs[1].name, TensorType((2, 9), torch.float32))
    bad = op.replace(args=(wrong, op.args[1]))
    with pytest.raises(GraphCheckError, match=r"reads %x as f32\[2,9\], but it was defined as "
                                              r"f32\[2,3\]"):
        pxform.check(g.replace(ops=(bad,) + g.ops[1:]))


def test_check_rejects_input_shape_the_rule_does_not_accept():
    g = small_graph()
    relu = g.ops[1]
    # relu reads %0 (f32[2,4]); claim it reads a value of another shape defined earlier
    fake_in = Value(g.inputs[0].name, g.inputs[0].type)  # %w: f32[3,4]
    bad = relu.replace(args=(fake_in,))
    with pytest.raises(GraphCheckError, match=r"op 1 \(relu.*\) declares outputs \(f32\[2,4\]\) "
                                              r"but its rule gives \(f32\[3,4\]\)"):
        pxform.check(g.replace(ops=(g.ops[0], bad) + g.ops[2:]))


def test_check_rejects_undefined_output():
    g = small_graph()
    ghost = Value("ghost", TensorType((), torch.float32))
    with pytest.raises(GraphCheckError, match=r"graph output %ghost is not defined"):
        pxform.check(g.replace(outputs=(ghost,)))


def test_op_printing_and_accessors():
    g = small_graph()
    op = g.ops[0]
    assert isinstance(op, Op) and op.target is torch.ops.aten.matmul.default
    assert str(op) == "%0: f32[2,4] = matmul(%x, %w)"
    assert op.inputs == (g.inputs[1], g.inputs[0])
    assert set(g.users()["0"]) == {g.ops[1]}
    assert g.producers()["1"] is g.ops[1]
