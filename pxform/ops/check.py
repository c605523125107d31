"""Checking a traced graph against the op rules (`pxform.check(graph)`): SSA form, and
every op's input and output types as its rule and torch say."""

from __future__ import annotations

from pxform.core.errors import GraphCheckError
from pxform.core.ir import Graph, Op, TensorType, Value
from pxform.ops.registry import infer_types, meta_types, rule_info


def check_graph(graph: Graph) -> None:
    """Verify that `graph` is in SSA form and that every op's types agree with its rule.

    Checks: value names are unique; every value an op reads is defined before it; outputs
    are defined; every op has a rule (or is a reported fallback), its inputs have the shapes
    its dim signature expects, and its outputs have the shapes the signature predicts and
    the dtypes the op produces (found by running it on meta tensors).

    Raises:
        GraphCheckError: naming the op, its position and what disagrees.

    Example:
        >>> check_graph(pxform.trace(fn, *args).graph)   # silent when the graph is well formed
    """
    defined: dict[str, Value] = {}

    def define(v: Value, where: str) -> None:
        if v.name in defined:
            raise GraphCheckError(f"check: value %{v.name} is defined twice (again by {where}); "
                                  f"SSA form needs one definition per value")
        defined[v.name] = v

    for v in graph.inputs:
        define(v, "a graph input")
    for c in graph.constants:
        define(c.value, "a constant")
        if TensorType.of(c.data) != c.value.type:
            raise GraphCheckError(f"check: constant {c.value} is declared {c.value.type} but "
                                  f"holds {TensorType.of(c.data)}")
    for i, op in enumerate(graph.ops):
        where = f"op {i} ({op.name}{_at(op)})"
        for v in op.inputs:
            if v.name not in defined:
                raise GraphCheckError(f"check: {where} reads {v}, which is not defined before it")
            if defined[v.name] != v:
                raise GraphCheckError(f"check: {where} reads {v} as {v.type}, but it was "
                                      f"defined as {defined[v.name].type}")
        expected_in = rule_info(op).signature.input_shapes()
        got_in = tuple(v.type.shape for v in op.inputs)
        if expected_in != got_in:
            raise GraphCheckError(
                f"check: {where} reads inputs of shapes {[list(s) for s in got_in]} but its "
                f"rule's signature expects {[list(s) for s in expected_in]}")
        got = tuple(TensorType(v.type.shape, v.type.dtype) for v in op.outputs)
        for source, expected in (("its rule", infer_types(op)), ("torch", meta_types(op))):
            if tuple(expected) != got:
                raise GraphCheckError(
                    f"check: {where} declares outputs ({', '.join(map(str, got))}) but "
                    f"{source} gives ({', '.join(map(str, expected))})")
        for v in op.outputs:
            define(v, where)
    for o in graph.outputs:
        if isinstance(o, Value) and defined.get(o.name) != o:
            raise GraphCheckError(f"check: graph output {o} is not defined by any op or input")


def _at(op: Op) -> str:
    return f" at {op.source}" if op.source else ""
