"""Meshes, spec checks and the re-layout planner. Every plan is executed on a simulated mesh
(tests/simworld.py) and must land exactly on the target layout."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from simworld import apply, assemble_check, distribute

from pxform import P
from pxform.core.errors import SpecError
from pxform.core.layout import AxisCost, Layout, plan_relayout
from pxform.core.mesh import AbstractMesh, check_spec

MESH = AbstractMesh({"dp": 2, "tp": 4})


def steps(src, dst, shape=(8, 16), mesh=MESH, **kw):
    return [str(s) for s in plan_relayout(shape, 4, src, dst, mesh, **kw).steps]


def test_mesh_basics_and_errors():
    assert MESH.names == ("dp", "tp") and MESH.size == 8 and str(MESH) == "Mesh(dp=2, tp=4)"
    with pytest.raises(ValueError, match="axis 'dp' appears twice"):
        AbstractMesh((("dp", 2), ("dp", 2)))
    with pytest.raises(ValueError, match="axis 'tp' has size 0; sizes are integers >= 1"):
        AbstractMesh({"tp": 0})


def test_check_spec_messages():
    ok = dict(fn="shard(loss_fn)", path="params['w1']")
    check_spec(P(None, "tp"), (16, 8), MESH, **ok)
    with pytest.raises(SpecError) as err:
        check_spec(P(None, "tp"), (16, 6), MESH, **ok)
    assert str(err.value) == (
        "shard(loss_fn): params['w1'] (shape [16, 6], spec P(None, 'tp'), Mesh(dp=2, tp=4)): "
        "dim 1 has size 6, which is not divisible by 4 (tp=4).\n  Fix: make dim 1 a multiple "
        "of 4, or shard it over fewer or smaller axes.")
    with pytest.raises(SpecError, match=r"mesh axis 'pp' \(dim 0\) is not in the mesh.\n  Fix: "
                                        r"use one of \['dp', 'tp'\]"):
        check_spec(P("pp"), (16, 8), MESH, **ok)
    with pytest.raises(SpecError, match=r"the spec has 3 entries but the tensor has rank 2.\n"
                                        r"  Fix: give at most one entry per dim, e.g. "
                                        r"P\('dp', None\)"):
        check_spec(P("dp", None, "tp"), (16, 8), MESH, **ok)
    with pytest.raises(SpecError, match=r"not divisible by 8 \(dp=2 x tp=4\)"):
        check_spec(P(("dp", "tp")), (12, 8), MESH, **ok)


def test_single_collectives_are_chosen():
    rep = Layout.replicated(2)
    assert steps(Layout.of(P(), 2, {"tp"}), rep) == ["all_reduce(tp)"]
    assert steps(Layout.of(P(), 2, {"tp"}), Layout.of(P(None, "tp"), 2)) == \
        ["reduce_scatter(tp, dim 1)"]
    assert steps(Layout.of(P("dp"), 2), Layout.of(P(None, "dp"), 2)) == \
        ["all_to_all(dp, dim 0 -> 1)"]
    assert steps(Layout.of(P(None, "tp"), 2), rep) == ["all_gather(tp, dim 1)"]
    assert steps(rep, Layout.of(P("tp", "dp"), 2)) in (
        ["slice(tp, dim 0)", "slice(dp, dim 1)"], ["slice(dp, dim 1)", "slice(tp, dim 0)"])
    assert steps(rep, rep) == []


def test_gathers_innermost_axis_first():
    # dim 0 split over (dp, tp): gathering tp first keeps each piece contiguous
    assert steps(Layout.of(P(("dp", "tp")), 2), Layout.replicated(2)) == \
        ["all_gather(tp, dim 0)", "all_gather(dp, dim 0)"]


def test_volumes_follow_ring_formulas():
    shape, itemsize = (8, 16), 4
    full = 8 * 16 * itemsize
    r = plan_relayout(shape, itemsize, Layout.of(P(), 2, {"tp"}), Layout.replicated(2), MESH)
    assert r.volume == (("tp", 2 * full * 3 / 4),)
    r = plan_relayout(shape, itemsize, Layout.of(P(None, "tp"), 2), Layout.replicated(2), MESH)
    assert r.volume_of("tp") == (full / 4) * 3  # each rank receives the other 3 quarters
    r = plan_relayout(shape, itemsize, Layout.of(P(), 2, {"dp"}), Layout.of(P("dp"), 2), MESH)
    assert r.volume_of("dp") == full / 2 and r.volume_of("tp") == 0


def test_per_axis_costs_steer_the_plan():
    # With a very slow dp link, a Partial over tp that must become replicated is all-reduced
    # on tp alone; with equal links and a big tensor, the planner may shrink it over dp first.
    src, dst = Layout.of(P(), 2, {"tp"}), Layout.replicated(2)
    slow_dp = {"dp": AxisCost(latency=1.0, seconds_per_byte=1.0)}
    assert steps(src, dst, shape=(4096, 4096), costs=slow_dp) == ["all_reduce(tp)"]


def test_unfit_layouts_are_refused():
    with pytest.raises(SpecError, match=r"splits dim 0 of size 6 4 ways"):
        plan_relayout((6, 8), 4, Layout.replicated(2), Layout.of(P("tp"), 2), MESH)
    with pytest.raises(SpecError, match=r"uses axis 'pp', which is not in Mesh\(dp=2, tp=4\)"):
        plan_relayout((8, 8), 4, Layout.of(P("pp"), 2), Layout.replicated(2), MESH)


# ---------------------------------------------------------------- property: plans execute

MESHES = [AbstractMesh({"x": 2}), AbstractMesh({"x": 4}), AbstractMesh({"x": 2, "y": 2}),
          AbstractMesh({"x": 2, "y": 3}), AbstractMesh({"x": 2, "y": 2, "z": 2})]


@st.composite
def layouts(draw, mesh, rank):
    dims: list[tuple[str, ...]] = [() for _ in range(rank)]
    partial = set()
    for a in mesh.names:
        choice = draw(st.integers(-2, rank - 1))
        if choice == -1:
            partial.add(a)
        elif choice >= 0:
            dims[choice] = dims[choice] + (a,)
    return Layout(tuple(dims), frozenset(partial))


@settings(max_examples=150)
@given(st.data(), st.sampled_from(MESHES), st.integers(1, 3))
def test_every_plan_lands_on_its_target(data, mesh, rank):
    # sizes divisible by every axis product, so every layout fits
    unit = math.prod(mesh.shape)
    shape = tuple(unit * data.draw(st.integers(1, 2)) for _ in range(rank))
    src = data.draw(layouts(mesh, rank))
    dst = data.draw(layouts(mesh, rank))
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16)))
    full = torch.randn(shape, generator=gen, dtype=torch.float64)
    local = distribute(full, src, mesh, gen)
    plan = plan_relayout(shape, 8, src, dst, mesh)
    for step in plan.steps:
        local = apply(step, local, mesh)
    assemble_check(full, local, dst, mesh)
