"""Pipeline schedules as data: generators, validation, communication, text forms, the
simulator's closed forms and the timeline picture. No devices, no processes."""

from __future__ import annotations

import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pxform import schedules
from pxform.core.errors import ScheduleError
from pxform.schedules import (
    NAMES,
    Action,
    Costs,
    add_communication,
    from_csv,
    from_text,
    gpipe,
    grid,
    interleaved,
    nf1b,
    one_f_one_b,
    resolve,
    shifted_critical_path,
    simulate,
    to_csv,
    to_text,
    validate,
    zero_bubble,
)
from pxform.schedules.actions import KINDS


def every_schedule():
    """Every generator over stages 1..6, microbatches 1..12, and its options."""
    for p in range(1, 7):
        for m in range(1, 13):
            yield f"gpipe({p},{m})", gpipe(p, m)
            yield f"one_f_one_b({p},{m})", one_f_one_b(p, m)
            yield f"zero_bubble({p},{m})", zero_bubble(p, m)
            yield f"shifted({p},{m})", shifted_critical_path(p, m)
            for v in (1, 2, 3):
                yield f"interleaved({p},{m},{v})", interleaved(p, m, virtual_stages=v)
            for n in (1, 2, 3):
                yield f"nf1b({p},{m},{n})", nf1b(p, m, forwards=n)


def edit(schedule, rank, fn):
    """A copy of `schedule` with rank `rank`'s list of action texts passed through `fn`."""
    out = {r: list(row) for r, row in schedule.items()}
    texts = ["-" if a is None else str(a) for a in out[rank]]
    out[rank] = [None if t == "-" else Action.parse(t) for t in fn(texts)]
    return out


def swap(texts, a, b):
    i, j = texts.index(a), texts.index(b)
    texts[i], texts[j] = texts[j], texts[i]
    return texts


# ------------------------------------------------------------------ generators


def test_every_generator_is_valid_with_and_without_communication():
    count = 0
    for name, s in every_schedule():
        assert all(a is not None and a.is_compute for row in s.values() for a in row), name
        validate(s)
        validate(add_communication(s))
        count += 1
    assert count == 6 * 12 * 10


def test_generators_have_the_documented_stages_and_placement():
    s = interleaved(4, 8, virtual_stages=3)
    assert {a.stage for row in s.values() for a in row} == set(range(12))
    assert all(a.stage % 4 == r for r, row in s.items() for a in row)
    n = nf1b(4, 8, forwards=3)
    trained = {a.stage for row in n.values() for a in row if a.kind == "B"}
    assert trained == set(range(8, 12))  # only the last sweep has a backward
    assert interleaved(3, 6, virtual_stages=1) == one_f_one_b(3, 6)
    assert nf1b(3, 6, forwards=1) == one_f_one_b(3, 6)
    sc = shifted_critical_path(4, 8)
    assert {a.stage for row in sc.values() for a in row if a.kind == "R"} == {0, 1, 2}
    assert sum(a.kind == "W" for row in zero_bubble(4, 8).values() for a in row) == 32


def test_golden_1f1b_4_stages_8_microbatches():
    # The standard PipeDream-flush picture: rank r warms up with p-r-1 forwards, then
    # alternates (the next forward first), then drains the backwards.
    assert to_text(one_f_one_b(4, 8)) == (
        "rank 0: 0F0 0F1 0F2 0F3 0B0 0F4 0B1 0F5 0B2 0F6 0B3 0F7 0B4 0B5 0B6 0B7\n"
        "rank 1: 1F0 1F1 1F2 1B0 1F3 1B1 1F4 1B2 1F5 1B3 1F6 1B4 1F7 1B5 1B6 1B7\n"
        "rank 2: 2F0 2F1 2B0 2F2 2B1 2F3 2B2 2F4 2B3 2F5 2B4 2F6 2B5 2F7 2B6 2B7\n"
        "rank 3: 3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3 3F4 3B4 3F5 3B5 3F6 3B6 3F7 3B7")


def test_golden_zb_h1_and_shifted_critical_path():
    assert to_text(zero_bubble(3, 4)) == (
        "rank 0: 0F0 0F1 0F2 0B0 0W0 0F3 0B1 0W1 0B2 0W2 0B3 0W3\n"
        "rank 1: 1F0 1F1 1B0 1F2 1B1 1W0 1F3 1B2 1W1 1B3 1W2 1W3\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2W0 2F3 2B3 2W1 2W2 2W3")
    assert to_text(shifted_critical_path(3, 4)) == (
        "rank 0: 0F0 0F1 0F2 0R0 0B0 0F3 0R1 0B1 0R2 0B2 0R3 0B3\n"
        "rank 1: 1F0 1F1 1F2 1R0 1B0 1R1 1B1 1F3 1R2 1B2 1R3 1B3\n"
        "rank 2: 2F0 2B0 2F1 2B1 2F2 2B2 2F3 2B3")


@pytest.mark.parametrize("call, message", [
    (lambda: gpipe(0, 4), "gpipe: stages must be an int >= 1, got 0"),
    (lambda: one_f_one_b(2, -1), "one_f_one_b: microbatches must be an int >= 1, got -1"),
    (lambda: interleaved(2, 4, virtual_stages=0), "virtual_stages must be an int >= 1"),
    (lambda: nf1b(2, 4, forwards=2.0), "nf1b: forwards must be an int >= 1, got 2.0"),
    (lambda: zero_bubble("4", 8), "zero_bubble: stages must be an int >= 1, got '4'"),
    (lambda: shifted_critical_path(True, 8), "stages must be an int >= 1, got True"),
])
def test_generators_check_their_arguments(call, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        call()


# ------------------------------------------------------------------ communication


def test_add_communication_inserts_sends_after_and_receives_before():
    s = add_communication(one_f_one_b(2, 2))
    assert to_text(s) == (
        "rank 0: 0F0 0SF0 0F1 0SF1 0RB0 0B0 0RB1 0B1\n"
        "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1")
    # same-rank neighbours need nothing; forward-only stages get no gradient
    assert to_text(add_communication(gpipe(1, 2))) == to_text(gpipe(1, 2))
    fwd_only = add_communication(nf1b(2, 1, forwards=2))
    texts = {str(a) for row in fwd_only.values() for a in row}
    assert {"1SF0", "2RF0"} <= texts and not {"2SB0", "1RB0"} & texts
    # idle slots are kept, the receive still goes right before its consumer
    idle = add_communication({0: [Action(0, "F", 0), None, Action(0, "B", 0)],
                              1: [None, Action(1, "F", 0), Action(1, "B", 0)]})
    assert to_text(idle) == ("rank 0: 0F0 0SF0 - 0RB0 0B0\n"
                             "rank 1: - 1RF0 1F0 1B0 1SB0")


def test_add_communication_refuses_comm_actions():
    with pytest.raises(ScheduleError, match="already has send/receive actions"):
        add_communication(add_communication(gpipe(2, 2)))


def test_recompute_runs_before_the_gradient_arrives():
    s = add_communication(shifted_critical_path(3, 3))
    row = [str(a) for a in s[1]]
    assert row.index("1R0") < row.index("1RB0") < row.index("1B0")


# ------------------------------------------------------------------ text forms


def with_idle_slots(draw, schedule):
    out = {}
    for rank, row in schedule.items():
        row = list(row)
        for _ in range(draw(st.integers(0, 3))):
            row.insert(draw(st.integers(0, len(row))), None)
        out[rank] = row
    return out


@st.composite
def any_schedule(draw):
    p, m = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    name = draw(st.sampled_from(sorted(NAMES)))
    s = resolve(name, p, m)
    if draw(st.booleans()):
        s = add_communication(s)
    return with_idle_slots(draw, s)


@given(any_schedule())
def test_text_and_csv_round_trip(schedule):
    assert from_text(to_text(schedule)) == schedule
    assert from_csv(to_csv(schedule)) == schedule


@given(st.builds(Action, stage=st.integers(0, 999), kind=st.sampled_from(KINDS),
                 microbatch=st.integers(0, 999)))
def test_action_parse_round_trip(action):
    assert Action.parse(str(action)) == action


def test_text_and_csv_forms():
    s = {0: [Action(0, "F", 0), None, Action(0, "B", 0)], 1: [], 2: [None]}
    assert to_text(s) == "rank 0: 0F0 - 0B0\nrank 1:\nrank 2: -"
    assert to_csv(s) == "0,0F0,,0B0\n1\n2,\n"
    assert from_text("# a comment\n\nrank 1: 1F0\nrank 0:  0F0  -\n") == {
        0: [Action(0, "F", 0), None], 1: [Action(1, "F", 0)]}
    assert from_csv("rank,step 0,step 1\n0,0F0,\n") == {0: [Action(0, "F", 0), None]}


@pytest.mark.parametrize("parse, text, message", [
    (from_text, "rank 0: 0F0\nrank 1: 1F0 1X0", "from_text: line 2: token '1X0' is not an"),
    (from_text, "rank 0: 0F0\nranks 1: 1F0", "line 2 ('ranks 1: 1F0') does not start with"),
    (from_text, "rank 0: 0F0\nrank 0: 0B0", "line 2: rank 0 is listed twice"),
    (from_text, "rank 1: 1F0", "ranks [1] are listed but rank 0 is missing"),
    (from_text, "", "no rank found"),
    (from_csv, "0,0F0\n1,1F0,oops", "from_csv: line 2: token 'oops' is not an action"),
    (from_csv, "0,0F0\nx,1F0", "line 2: the first cell 'x' is not a rank number"),
])
def test_parse_errors_name_the_line_and_token(parse, text, message):
    with pytest.raises(ScheduleError) as err:
        parse(text)
    assert message in str(err.value)


# ------------------------------------------------------------------ validate


def fails(schedule, *fragments):
    with pytest.raises(ScheduleError) as err:
        validate(schedule)
    text = str(err.value)
    assert text.startswith("pxform.schedules.validate: ")
    assert "\n\nstep " in text and "\nrank 0 " in text  # the step-by-rank grid
    for fragment in fragments:
        assert fragment in text, text
    return text


def test_swapped_actions_deadlock_with_the_grid_and_the_waits():
    s = edit(gpipe(2, 2), 0, lambda t: swap(t, "0F1", "0B0"))
    text = fails(s, "deadlock: no rank can run its next action",
                 "rank 0 waits at step 1 (0B0) for 1B0, which rank 1 runs at step 2",
                 "rank 1 waits at step 1 (1F1) for 0F1, which rank 0 runs at step 2",
                 "cycle of waits: rank 0 -> rank 1 -> rank 0")
    assert text.endswith(
        "step      0     1     2     3\n"
        "rank 0   0F0  >0B0<  0F1   0B1\n"
        "rank 1   1F0  >1F1<  1B0   1B1")


def test_cyclic_wait_through_three_ranks():
    # interleaved wraps from rank 2 back to rank 0; holding 0SF0 back until after 3F0
    # makes rank 0 wait on rank 2, which waits on rank 1, which waits on rank 0.
    s = edit(add_communication(interleaved(3, 1, virtual_stages=2)), 0,
             lambda t: [x for x in t if x != "0SF0"][:3] + ["0SF0"]
             + [x for x in t if x != "0SF0"][3:])
    assert [str(a) for a in s[0]][:4] == ["0F0", "3RF0", "3F0", "0SF0"]
    fails(s, "rank 0 waits at step 1 (3RF0) for 2SF0",
          "rank 1 waits at step 0 (1RF0) for 0SF0",
          "cycle of waits: rank 0 -> rank 2 -> rank 1 -> rank 0", ">3RF0<", ">1RF0<")


def test_missing_receive():
    s = edit(add_communication(one_f_one_b(4, 8)), 2, lambda t: [x for x in t if x != "2RF5"])
    fails(s, "misses 2RF5 (the receive paired with 1SF5)", ">1SF5<", ">2F5<")


def test_duplicate_missing_and_misplaced_actions():
    base = one_f_one_b(4, 8)
    fails(edit(base, 0, lambda t: t + ["0F1"]), "0F1 occurs 2 times (steps 1, 16 of rank 0)",
          ">0F1<")
    fails(edit(base, 2, lambda t: [x for x in t if x != "2B5"]),
          "stage 2 has no B for microbatch 5", ">2F5<")
    fails(edit(base, 1, lambda t: [x for x in t if x != "1F3"]),
          "stage 1 has no F for microbatch 3", ">1B3<")
    fails(edit(base, 3, lambda t: t + ["2F9"]), "2F9 is on rank 3, but stage 2 runs on rank 2")
    fails(edit(base, 1, lambda t: swap(t, "1F0", "1B0")),
          "1B0 comes before 1F0 on rank 1: backward before its forward")


def test_trainable_stages_w_and_r_rules():
    base = one_f_one_b(3, 2)
    fails(edit(base, 1, lambda t: [x for x in t if "B" not in x]),
          "stage 1 has no backward but stages [0, 2] do", "must be a suffix")
    zb = zero_bubble(3, 2)
    fails(edit(zb, 1, lambda t: [x for x in t if x != "1W1"]), "stage 1 has no W for "
          "microbatch 1")
    fails(edit(zb, 2, lambda t: swap(t, "2W0", "2B0")),
          "2W0 comes before 2B0 on rank 2: weight gradient before its backward")
    sc = shifted_critical_path(3, 3)
    fails(edit(sc, 0, lambda t: swap(t, "0R1", "0B1")), "0B1 comes before 0R1")
    fails(edit(sc, 0, lambda t: ["0R2"] + [x for x in t if x != "0R2"]),
          "0R2 comes before 0F2 on rank 0: recompute before its forward")
    fwd = nf1b(2, 1, forwards=2)
    fails(edit(fwd, 0, lambda t: ["0F0", "0W0"] + t[1:]), "0W0: W without B")


def test_comm_actions_unmatched_or_misplaced():
    s = add_communication(one_f_one_b(2, 2))
    fails(edit(s, 0, lambda t: t + ["0SB1"]), "0SB1 is not a transfer this schedule needs")
    fails(edit(s, 1, lambda t: swap(t, "1RF1", "1F1")),
          "receive 1RF1 comes after 1F1, which needs it")
    fails(edit(s, 0, lambda t: swap(t, "0SF0", "0F0")),
          "send 0SF0 comes before 0F0, which produces it")


def test_validate_rejects_malformed_input():
    with pytest.raises(ScheduleError, match="non-empty dict"):
        validate({})
    with pytest.raises(ScheduleError, match=r"the ranks are \[0, 2\]; they must be 0..1"):
        validate({0: [Action(0, "F", 0)], 2: []})
    with pytest.raises(ScheduleError, match="rank 0 step 0 is '0F0'; entries are Action"):
        validate({0: ["0F0"]})
    with pytest.raises(ScheduleError, match="has no actions"):
        validate({0: [None]})


def test_grid_marks_and_crops():
    s = one_f_one_b(2, 30)
    text = grid(s, mark=[Action(0, "B", 20)], max_steps=6)
    assert ">0B20<" in text and text.splitlines()[0].startswith("step    ...   39")
    assert len(text.splitlines()[1].split()) == 2 + 6 + 2  # label, 6 cells, two "..."


# ------------------------------------------------------------------ simulate


@pytest.mark.parametrize("p", range(1, 7))
def test_gpipe_and_1f1b_bubble_closed_form(p):
    for m in range(1, 13):
        for costs in (Costs(1.0, 2.0), Costs(1.0, 1.0), Costs(2.0, 3.0)):
            for gen in (gpipe, one_f_one_b):
                t = simulate(gen(p, m), costs)
                assert t.bubble_fraction == pytest.approx((p - 1) / (m + p - 1)), (gen, m)


@pytest.mark.parametrize("p", range(1, 7))
def test_interleaved_bubble_closed_form(p):
    for m in (p, 2 * p, 3 * p):
        for v in (1, 2, 3):
            t = simulate(interleaved(p, m, virtual_stages=v), Costs(1.0 / v, 2.0 / v))
            assert t.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1)), (m, v)


@pytest.mark.parametrize("p", range(1, 7))
def test_zero_bubble_has_a_third_of_1f1b_idle_time(p):
    # Qi et al. Table 2: idle (p-1)(F+B-W) against 1F1B's (p-1)(F+B+W); F=B=W=1, m >= p.
    for m in range(p, 13):
        zb = simulate(zero_bubble(p, m), Costs(forward=1.0, backward=1.0, weight=1.0))
        base = simulate(one_f_one_b(p, m), Costs(forward=1.0, backward=1.0, weight=1.0))
        assert zb.step_time - 3 * m == p - 1
        assert base.step_time - 3 * m == 3 * (p - 1)
        assert dict(zb.peak_activations) == {r: p - r for r in range(p)}  # 1F1B's peak


@pytest.mark.parametrize("s", range(2, 7))
def test_shifted_critical_path_relative_bubble(s):
    # Merak's setting: F = R = T, B = 2T, free p2p. Relative bubble = idle time of the
    # busiest stage over its compute time m(F+R+B).
    for m in range(3, 13):
        t = simulate(shifted_critical_path(s, m),
                     Costs(forward=1.0, backward=2.0, recompute=1.0))
        assert t.relative_bubble == pytest.approx(3 * (s - 2) / (4 * m)), m
        assert max(t.busy) == 4 * m
        # 1F1B with the recompute inside the backward (R on the critical path)
        base = simulate(one_f_one_b(s, m), Costs(forward=1.0, backward=3.0))
        assert base.relative_bubble == pytest.approx((s - 1) / m)
        assert t.step_time < base.step_time


def test_peak_activations():
    assert dict(simulate(one_f_one_b(4, 8), Costs(1.0, 2.0)).peak_activations) == {
        0: 4, 1: 3, 2: 2, 3: 1}
    assert dict(simulate(gpipe(4, 8), Costs(1.0, 2.0)).peak_activations) == {
        0: 8, 1: 8, 2: 8, 3: 8}
    peaks = simulate(nf1b(4, 8, forwards=3), Costs(1.0, 2.0)).peak_activations
    assert [peaks[s] for s in range(12)] == [1] * 8 + [4, 3, 2, 1]
    # recompute drops activations after F: only the microbatch between R and B is held
    shifted = simulate(shifted_critical_path(4, 8), Costs(1.0, 2.0, recompute=1.0))
    assert dict(shifted.peak_activations) == {0: 1, 1: 1, 2: 1, 3: 1}


def test_simulate_durations_events_and_p2p():
    t = simulate(zero_bubble(2, 1), Costs(forward=1.0, backward=2.0, weight=0.5))
    durations = {str(e.action): e.duration for e in t.events}
    assert durations == {"0F0": 1.0, "1F0": 1.0, "1B0": 2.0, "0B0": 2.0, "1W0": 0.5,
                         "0W0": 0.5}  # B is the input gradient only when W exists
    assert simulate(gpipe(1, 1), Costs(1.0, 2.0, weight=0.5)).step_time == 3.5
    assert simulate(gpipe(2, 1), Costs(1.0, 2.0, p2p=0.25)).step_time == 6.5
    per_stage = Costs(forward=[1.0, 2.0], backward=[2.0, 4.0], p2p=[0.5, 0.0])
    # p2p[s] is the time of a transfer sent by stage s: 0.5 forward, 0.0 back
    assert simulate(gpipe(2, 1), per_stage).step_time == 1 + 0.5 + 2 + 4 + 0.0 + 2
    # receives model the same transfer as direct dependencies with p2p
    for s in (one_f_one_b(3, 5), interleaved(2, 4), shifted_critical_path(3, 4)):
        costs = Costs(1.0, 2.0, weight=0.5, p2p=0.3)
        with_comm = simulate(add_communication(s), costs)
        assert with_comm.step_time == pytest.approx(simulate(s, costs).step_time)
        receive = next(e for e in with_comm.events if e.action.kind == "RF")
        assert receive.end >= receive.start
    assert t.busy == (3.5, 3.5) and t.ranks == 2


def test_simulate_checks_its_inputs():
    with pytest.raises(ScheduleError, match="pxform.schedules.simulate: stage 0 has no F"):
        simulate({0: [Action(0, "B", 0)]}, Costs(1.0, 1.0))
    with pytest.raises(ValueError, match="forward has 3 entries but the schedule has 2 stages"):
        simulate(gpipe(2, 2), Costs(forward=[1.0, 1.0, 1.0], backward=1.0))
    with pytest.raises(ValueError, match="backward must be a number >= 0"):
        Costs(forward=1.0, backward=-1.0)


# ------------------------------------------------------------------ resolve


def test_resolve_accepts_names_callables_text_csv_and_dicts():
    assert resolve("1F1B", 4, 8) == one_f_one_b(4, 8)
    assert resolve("interleaved", 2, 4, virtual_stages=3) == interleaved(2, 4, 3)
    assert resolve("nf1b", 2, 4, forwards=2) == nf1b(2, 4, 2)
    assert resolve(zero_bubble, 3, 4) == zero_bubble(3, 4)
    assert resolve(interleaved, 2, 4, virtual_stages=3) == interleaved(2, 4, 3)
    text = "# GPipe, by hand\n" + to_text(gpipe(2, 3))
    assert resolve(text, 2, 3) == resolve(to_csv(gpipe(2, 3)), 2, 3) == gpipe(2, 3)
    with_comm = add_communication(gpipe(2, 3))
    assert resolve(with_comm, 2, 3) is with_comm  # used as given


@pytest.mark.parametrize("args, kwargs, error, message", [
    (("gpipe", 2, 4), {"virtual_stages": 2}, ValueError,
     "schedule 'gpipe' takes no option 'virtual_stages'; it takes none"),
    (("nf1b", 2, 4), {"virtual_stages": 2}, ValueError, "it takes forwards"),
    (("zigzag", 2, 4), {}, ValueError, "'zigzag' is not a schedule name"),
    (("rank 0: 0F0 0B0", 2, 1), {}, ScheduleError, "has 1 ranks and 1 microbatches, but the "
     "pipeline has 2 ranks"),
    (("rank 0: 0F0 0B0", 1, 1), {"forwards": 2}, ValueError, "apply only to a named"),
    (({0: [Action(0, "B", 0)]}, 1, 1), {}, ScheduleError, "resolve: stage 0 has no F"),
    ((42, 1, 1), {}, TypeError, "got int"),
])
def test_resolve_errors(args, kwargs, error, message):
    with pytest.raises(error) as err:
        resolve(*args, **kwargs)
    assert message in str(err.value)


# ------------------------------------------------------------------ plot


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "1f1b.png"
    schedules.plot(simulate(interleaved(4, 8), Costs(0.5, 1.0)), path, title="interleaved")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    svg = tmp_path / "zb.svg"
    schedules.plot(simulate(zero_bubble(2, 2), Costs(1.0, 1.0, 1.0)), svg)
    assert b"<svg" in svg.read_bytes()
    with pytest.raises(ValueError, match="use one of .png, .svg, .pdf"):
        schedules.plot(simulate(gpipe(1, 1), Costs(1.0, 1.0)), tmp_path / "x.gif")


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install 'pxform\[plot\]'"):
        schedules.plot(simulate(gpipe(1, 1), Costs(1.0, 1.0)), tmp_path / "x.png")


def _pair_sequences(schedule):
    from pxform.schedules.validate import message
    num = len(schedule)
    seqs: dict = {}
    for rank in sorted(schedule):
        for a in schedule[rank]:
            m = message(a, num) if a is not None else None
            if m is not None:
                side = "send" if a.kind in ("SF", "SB") else "receive"
                seqs.setdefault((m[0], m[1], side), []).append(m[2])
    return seqs


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "interleaved", "zb", "shifted", "nf1b"])
@pytest.mark.parametrize("stages, microbatches", [(2, 2), (2, 4), (3, 6), (4, 4), (4, 8)])
def test_transfers_are_posted_in_the_same_order_on_both_ends(name, stages, microbatches):
    """NCCL matches point-to-point messages by order (no tags): between every two ranks the
    receives must follow the sends' order, for every generator."""
    from pxform.schedules import add_communication, resolve
    options = {"interleaved": {"virtual_stages": 2}, "nf1b": {"forwards": 2}}.get(name, {})
    schedule = add_communication(resolve(name, stages, microbatches, **options))
    seqs = _pair_sequences(schedule)
    pairs = {(src, dst) for src, dst, _ in seqs}
    for src, dst in pairs:
        assert seqs.get((src, dst, "send")) == seqs.get((src, dst, "receive")), (src, dst)


def test_receives_move_earlier_to_follow_the_senders_order():
    # nF1B on 2 ranks: rank 1 sends stage 1's forwards, then stage 3's gradients; rank 0
    # needed 2B0's gradient before 2F2's activation, so those receives come earlier now
    from pxform.schedules import add_communication, nf1b, to_text
    text = to_text(add_communication(nf1b(2, 4, forwards=2)))
    assert "2RF1 2F1 2SF1 2RF2 2RF3 2RB0 2B0" in text


def test_validate_refuses_receives_out_of_the_senders_order():
    from pxform.schedules import from_text, validate
    bad = from_text("rank 0: 0F0 0SF0 0F1 0SF1 0RB1 0RB0 0B0 0B1\n"
                    "rank 1: 1RF0 1F0 1B0 1SB0 1RF1 1F1 1B1 1SB1")
    with pytest.raises(ScheduleError, match=r"rank 0 posts 0RB1 where rank 1's next "
                                            r"message is 1SB0: messages between two "
                                            r"ranks must be received in the order"):
        validate(bad)


# ---------------------------------------------------------------- Timer and held


@given(st.sampled_from(["gpipe", "1f1b", "zb", "interleaved", "shifted"]),
       st.integers(1, 5), st.integers(1, 9), st.randoms(use_true_random=False))
def test_timer_equals_simulate(name, p, m, rnd):
    """The search's compiled timer gives `simulate`'s step time for every generator and
    unequal per-stage costs, p2p and the sync waits included; so does `simulate` of the
    schedule with its transfer actions."""
    sched = schedules.resolve(name, p, m, **({"virtual_stages": 2} if name == "interleaved"
                                             else {}))
    timer = schedules.Timer(sched)
    n = timer.stages
    f, b, w, r, p2p, fs, bs = ([rnd.uniform(0.1, 2.0) for _ in range(n)] for _ in range(7))
    want = simulate(sched, Costs(f, b, weight=w, recompute=r, p2p=p2p)).step_time
    assert timer.step_time(f, b, w, r, p2p) == pytest.approx(want, rel=1e-12)
    costs = Costs(f, b, weight=w, recompute=r, p2p=p2p, forward_sync=fs, backward_sync=bs)
    synced = simulate(sched, costs).step_time
    assert timer.step_time(f, b, w, r, p2p, fs, bs) == pytest.approx(synced, rel=1e-12)
    assert synced >= want - 1e-12
    if p > 1:
        comm = schedules.add_communication(sched)
        assert simulate(comm, costs).step_time == pytest.approx(synced, rel=1e-9)


def test_a_sync_wait_costs_where_a_stage_meets_its_input_only():
    """`forward_sync` and `backward_sync` are charged in full where a receiving action's
    rank and its input are ready at once (equal stages: 1F1B's steady state), and nothing
    where one side waits for the other by far (a stage twice as slow as its peer gets
    its inputs early, and its peer waits for its gradients)."""
    sched = schedules.one_f_one_b(2, 8)
    timer = schedules.Timer(sched)
    sync = [0.01, 0.01]
    equal, equal_synced = (timer.step_time([1.0, 1.0], [2.0, 2.0], forward_sync=x,
                                           backward_sync=x) for x in (None, sync))
    assert equal_synced > equal + 0.05  # 8 microbatches meet their peers every step
    slow, slow_synced = (timer.step_time([1.0, 2.0], [2.0, 4.0], forward_sync=x,
                                         backward_sync=x) for x in (None, sync))
    assert slow_synced == pytest.approx(slow, abs=1e-12)
    assert schedules.expected_later(3.0, 3.0, 0.5) == pytest.approx(3.5)
    assert schedules.expected_later(3.0, 1.0, 0.5) == pytest.approx(3.0294, abs=1e-4)
    assert schedules.expected_later(3.0, -2.0, 0.5) == pytest.approx(3.0, abs=1e-4)
    assert schedules.expected_later(1.0, 3.0, 0.0) == 3.0


def test_timer_refuses_comm_actions_and_wrong_lengths():
    with pytest.raises(ScheduleError, match="send/receive"):
        schedules.Timer(schedules.add_communication(schedules.one_f_one_b(2, 2)))
    stuck = {0: [Action(0, "F", 0), Action(0, "B", 0)], 1: [Action(1, "B", 0),
                                                          Action(1, "F", 0)]}
    with pytest.raises(ScheduleError, match="deadlocks"):
        schedules.Timer(stuck)
    with pytest.raises(ValueError, match="forward has 1 entries but the schedule has 2"):
        schedules.Timer(schedules.one_f_one_b(2, 2)).step_time([1.0], [1.0, 1.0])


def test_held_counts_what_the_executor_keeps():
    # 1F1B: stage s holds p - s; zero-bubble keeps each graph until its W: p everywhere
    assert schedules.held(schedules.one_f_one_b(4, 8)) == (4, 3, 2, 1)
    assert schedules.held(schedules.one_f_one_b(4, 2)) == (2, 2, 2, 1)
    assert schedules.held(schedules.zero_bubble(4, 8)) == (4, 4, 4, 4)
    # GPipe holds every microbatch; shifted recomputes, holding one between R and B
    assert schedules.held(schedules.gpipe(3, 5)) == (5, 5, 5)
    assert schedules.held(schedules.shifted_critical_path(4, 8))[:3] == (1, 1, 1)
    # interleaved on 2 ranks x 2 chunks, 4 microbatches: rank 0 peaks holding 3 of
    # chunk 0 and 2 of chunk 2 (Megatron's warm-up of 2(p - 1) + (v - 1)p = 4, plus one)
    # microbatches between B and W: zero-bubble's stage s keeps s + 1; none without W
    assert schedules.awaiting_weights(schedules.zero_bubble(4, 8)) == (1, 2, 3, 4)
    assert schedules.awaiting_weights(schedules.one_f_one_b(4, 8)) == (0, 0, 0, 0)
    got = schedules.held(schedules.interleaved(2, 4, virtual_stages=2))
    assert got[0] + got[2] == 5 and got[1] + got[3] == 3, got


def test_a_rank_with_several_stages_peaks_where_their_activations_weigh_most():
    """`at_peak(schedule, weights)`: interleaved's second rank holds 3 microbatches of its
    first chunk and none of its last at one moment, 2 and 1 at another. Counted alike the
    later of the tied moments is its peak; with the last chunk light (a GPT head beside a
    layer) the moment with 3 of the heavy chunk is. The weights change nothing for a
    rank with one stage."""
    s = schedules.interleaved(2, 8, virtual_stages=2)
    alike = [h for h, _, _ in schedules.at_peak(s)]
    assert alike == [4, 2, 1, 1]
    light_head = [h for h, _, _ in schedules.at_peak(s, [1.0, 1.0, 1.0, 0.1])]
    assert light_head == [4, 3, 1, 0]
    # the bytes held at the chosen moment are the most of any moment: 3 x 1.0 > 2 + 0.1
    assert light_head[1] * 1.0 + light_head[3] * 0.1 > alike[1] * 1.0 + alike[3] * 0.1
    one = schedules.one_f_one_b(4, 8)
    assert schedules.at_peak(one, [1.0, 5.0, 0.2, 3.0]) == schedules.at_peak(one)


@pytest.mark.parametrize("name, p, m", [("1f1b", 2, 8), ("zb", 4, 8), ("interleaved", 2, 8),
                                        ("interleaved", 4, 16), ("shifted", 4, 8)])
def test_a_peak_walk_asked_at_several_weights_is_at_peak_each_time(name, p, m):
    """`peak_walk` works a schedule's transfers out once and walks it per weights (the
    search asks an interleaved schedule's counts at several stage weights): the same
    counts as `at_peak` at every weights."""
    schedule = schedules.NAMES[name](p, m)
    walk = schedules.peak_walk(schedule)
    stages = schedules.rules.shape_of(schedule).stages
    for weights in (None, [1.0] * stages, [1.0 + (s % 3) for s in range(stages)],
                    [0.1 if s == stages - 1 else 1.0 for s in range(stages)]):
        assert walk(weights) == schedules.at_peak(schedule, weights)
