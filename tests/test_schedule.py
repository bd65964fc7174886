"""Pipeline schedules, their simulation and Chrome traces (no TensorFlow needed)."""
import itertools
import json

import pytest

from tfpar.ir.schedule import SCHEDULES, Task, build_schedule, validate_schedule
from tfpar.ir.simulate import simulate
from tfpar.ir.trace import chrome_trace, write_chrome_trace

GRID = list(itertools.product(range(1, 5), range(1, 9)))  # (num_stages, num_micro_batch)


def tasks(text):
    return [Task(word[0], int(word[1:])) for word in text.split()]


def as_text(schedule):
    return [" ".join(map(str, stage)) for stage in schedule]


# ---------------------------------------------------------------- schedules

def test_task_str():
    assert str(Task("F", 3)) == "F3" and str(Task("B", 12)) == "B12"


def test_gpipe_p2_m3():
    assert as_text(build_schedule("gpipe", 2, 3)) == ["F0 F1 F2 B0 B1 B2"] * 2


def test_1f1b_p2_m4():
    assert as_text(build_schedule("1f1b", 2, 4)) == [
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_1f1b_p3_m4():
    assert as_text(build_schedule("1f1b", 3, 4)) == [
        "F0 F1 F2 B0 F3 B1 B2 B3",
        "F0 F1 B0 F2 B1 F3 B2 B3",
        "F0 B0 F1 B1 F2 B2 F3 B3",
    ]


def test_zero_bubble_h1_p4_m8():
    """ZB-H1 (Qi et al. 2024, Fig. 3 top): 1F1B's F/B order; W m just before
    F m+4; in the cool-down a W after each B; the last stage defers most."""
    assert as_text(build_schedule("zero_bubble", 4, 8)) == [
        "F0 F1 F2 F3 B0 W0 F4 B1 W1 F5 B2 W2 F6 B3 W3 F7 B4 W4 B5 W5 B6 W6 B7 W7",
        "F0 F1 F2 B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 F6 B4 W3 F7 B5 W4 B6 W5 B7 W6 W7",
        "F0 F1 B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 F6 B5 W3 F7 B6 W4 B7 W5 W6 W7",
        "F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 F6 B6 W3 F7 B7 W4 W5 W6 W7",
    ]
    for zero_bubble, one_f_one_b in zip(build_schedule("zero_bubble", 4, 8),
                                        build_schedule("1f1b", 4, 8)):
        assert [t for t in zero_bubble if t.kind != "W"] == one_f_one_b


def test_1f1b_fewer_micro_batches_than_stages():
    assert as_text(build_schedule("1f1b", 4, 2)) == [
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 F1 B0 B1",
        "F0 B0 F1 B1",
    ]


def test_kfkb_p2_m4_k2():
    assert as_text(build_schedule("kfkb", 2, 4, group_size=2)) == [
        "F0 F1 F2 F3 B0 B1 B2 B3",
        "F0 F1 B0 B1 F2 F3 B2 B3",
    ]


def test_kfkb_last_group_smaller():
    assert as_text(build_schedule("kfkb", 3, 5, group_size=2)) == [
        "F0 F1 F2 F3 F4 B0 B1 B2 B3 B4",
        "F0 F1 F2 F3 B0 B1 F4 B2 B3 B4",
        "F0 F1 B0 B1 F2 F3 B2 B3 F4 B4",
    ]


@pytest.mark.parametrize("p,m", GRID)
def test_kfkb_extremes(p, m):
    assert build_schedule("kfkb", p, m, group_size=1) == build_schedule("1f1b", p, m)
    for k in (m, m + 1, 2 * m + 3):
        assert build_schedule("kfkb", p, m, group_size=k) == build_schedule("gpipe", p, m)


@pytest.mark.parametrize("kind", SCHEDULES)
@pytest.mark.parametrize("p,m", GRID)
def test_built_schedules_are_valid(kind, p, m):
    for k in range(1, m + 1):
        schedule = build_schedule(kind, p, m, group_size=k)
        assert len(schedule) == p
        validate_schedule(schedule, m)


def test_1f1b_and_gpipe_ignore_group_size():
    """group_size is kFkB's alone: given k = 3 (or 0, which kFkB refuses),
    1F1B, GPipe and zero-bubble run their own orders (by hand: 1F1B warms
    stage 0 up with one forward; ZB-H1 puts W m before F m+2), while kFkB
    runs groups {0, 1, 2}, {3}."""
    expected = {  # (kind, group_size): each stage's tasks
        ("1f1b", 3): ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
        ("gpipe", 0): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"],
        ("zero_bubble", 3): ["F0 F1 B0 W0 F2 B1 W1 F3 B2 W2 B3 W3",
                             "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"],
        ("kfkb", 3): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 B0 B1 B2 F3 B3"],
    }
    for (kind, k), stages in expected.items():
        assert as_text(build_schedule(kind, 2, 4, group_size=k)) == stages, f"{kind}, k = {k}"
    with pytest.raises(ValueError, match="group_size must be an int >= 1, got 0"):
        build_schedule("kfkb", 2, 4, group_size=0)


@pytest.mark.parametrize("bad,match", [
    ([], "no stages"),
    ([tasks("F0 F1 B0")], "stage 0"),                       # B1 missing
    ([tasks("F0 F1 B0 B1"), tasks("F0 F0 B0 B1")], "stage 1"),  # F0 twice, F1 missing
    ([tasks("F0 F1 B0 B1 B1")], "stage 0"),                 # B1 twice
    ([tasks("F0 F1 B0 B1 F2 B2")], "stage 0"),              # micro-batch 2 out of range
    ([tasks("F0 B1 F1 B0")], "B1 before F1"),
    ([tasks("F0 F1 B0 W0 B1 W1"), tasks("F0 F1 B0 B1 W1")], "stage 1"),  # W0 missing
    ([tasks("F0 F1 W0 B0 B1 W1")], "W0 before B0"),
])
def test_validate_schedule_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        validate_schedule(bad, 2)


def test_unknown_kind():
    with pytest.raises(ValueError, match="'zb'.*gpipe, 1f1b, kfkb, zero_bubble"):
        build_schedule("zb", 2, 4)


@pytest.mark.parametrize("kwargs,name", [
    ({"num_stages": 0}, "num_stages"),
    ({"num_stages": 2.0}, "num_stages"),
    ({"num_micro_batch": -1}, "num_micro_batch"),
    ({"num_micro_batch": True}, "num_micro_batch"),
    ({"group_size": 0}, "group_size"),
    ({"group_size": "2"}, "group_size"),
])
def test_bad_arguments(kwargs, name):
    args = {"kind": "kfkb", "num_stages": 2, "num_micro_batch": 4, "group_size": 2, **kwargs}
    with pytest.raises(ValueError, match=name) as err:
        build_schedule(**args)
    assert repr(kwargs[name]) in str(err.value)


# ---------------------------------------------------------------- simulation

@pytest.mark.parametrize("p,m", GRID)
def test_zero_bubble_has_a_third_of_1f1bs_idle_time_at_1f1bs_memory(p, m):
    """Qi et al. §2.1 with T_F = T_B = T_W: ZB-H1 idles (p-1) T per stage where
    1F1B idles (p-1)(T_F + T_B + T_W), bubble fraction (p-1)/(3m+p-1) vs
    (p-1)/(m+p-1), once there are as many micro-batches as stages (fewer
    leave fewer W to fill with); no stage holds more micro-batches than
    1F1B's first."""
    one_f_one_b = simulate(build_schedule("1f1b", p, m), 1.0, 2.0)
    zero_bubble = simulate(build_schedule("zero_bubble", p, m), 1.0, 2.0)
    if m >= p:
        assert zero_bubble.length == pytest.approx(3 * m + p - 1)
        assert zero_bubble.bubble_fraction == pytest.approx((p - 1) / (3 * m + p - 1))
    assert zero_bubble.length <= one_f_one_b.length - (p > 1)
    assert one_f_one_b.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert len(zero_bubble.tasks) == 3 * p * m
    assert max(zero_bubble.peak_in_flight) == max(one_f_one_b.peak_in_flight) == min(p, m)


def test_zero_bubble_weight_share_and_dependencies():
    """A W task takes ``weight_share`` of the backward and starts after its B;
    only F and B tasks send tensors to other stages."""
    result = simulate(build_schedule("zero_bubble", 2, 2), 1.0, 4.0, weight_share=0.25)
    ends = {(t.stage, str(t.task)): t for t in result.tasks}
    for (stage, name), t in ends.items():
        if name[0] == "W":
            assert t.end - t.start == pytest.approx(1.0)
            assert t.start >= ends[(stage, "B" + name[1:])].end
        elif name[0] == "B":
            assert t.end - t.start == pytest.approx(3.0)
    assert {x.kind for x in result.transfers} == {"F", "B"}
    with pytest.raises(ValueError, match="weight_share"):
        simulate(build_schedule("zero_bubble", 2, 2), 1.0, 4.0, weight_share=1.5)


@pytest.mark.parametrize("kind", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,m", GRID)
@pytest.mark.parametrize("f,b", [(1.0, 2.0), (1.0, 1.0), (3.0, 1.0)])
def test_closed_forms(kind, p, m, f, b):
    result = simulate(build_schedule(kind, p, m), f, b)
    assert result.length == pytest.approx((m + p - 1) * (f + b))
    assert result.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
    assert len(result.tasks) == 2 * p * m
    if kind == "gpipe":
        assert result.peak_in_flight[0] == m
    else:
        assert result.peak_in_flight == [min(p - s, m) for s in range(p)]
        assert max(result.peak_in_flight) <= p


def test_kfkb_peak_in_flight_p2_m4_k2():
    # Stage 0 runs F0 F1 F2 F3 B0 ..: all four forwards finish before B0 -> 4.
    # Stage 1 runs F0 F1 B0 B1 F2 F3 ..: at most two in flight -> 2.
    result = simulate(build_schedule("kfkb", 2, 4, group_size=2), 1.0, 1.0)
    assert result.peak_in_flight == [4, 2]
    # Same length as 1F1B here: stage 1 is busy 1..9 without a gap, then B3 on stage 0.
    assert result.length == pytest.approx(10.0)


def test_kfkb_peak_in_flight_p3_m8_k2():
    # Stage 0: 2 warm-up groups (F0..F3), then group 2 (F4 F5) before B0 -> 6.
    result = simulate(build_schedule("kfkb", 3, 8, group_size=2), 1.0, 2.0)
    assert result.peak_in_flight == [6, 4, 2]


@pytest.mark.parametrize("p,m", GRID)
def test_kfkb_peak_in_flight_grows_with_group_size(p, m):
    peaks = [simulate(build_schedule("kfkb", p, m, group_size=k), 1.0, 2.0).peak_in_flight[0]
             for k in range(1, m + 2)]
    assert peaks == sorted(peaks)
    assert peaks[0] == min(p, m) and peaks[-1] == m


def test_per_stage_times_slowest_stage_dominates():
    # f = [1, 3], b = [2, 6]; 1F1B with p=2, M=4:
    #   stage 0: F0 F1 B0 F2 B1 F3 B2 B3     stage 1: F0 B0 F1 B1 F2 B2 F3 B3
    # s0 F0 [0,1], F1 [1,2]; s1 F0 [1,4], B0 [4,10]; s0 B0 [10,12], F2 [12,13];
    # s1 F1 [10,13], B1 [13,19]; s0 B1 [19,21], F3 [21,22]; s1 F2 [19,22], B2 [22,28];
    # s0 B2 [28,30]; s1 F3 [28,31], B3 [31,37]; s0 B3 [37,39].
    # Length 39 = M * (3 + 6) on stage 1 + F0 (1) before it + B3 (2) after it on stage 0.
    result = simulate(build_schedule("1f1b", 2, 4), [1, 3], [2, 6])
    assert result.length == pytest.approx(39.0)
    assert result.bubble_fraction == pytest.approx(1 - (4 * 3 + 4 * 9) / (2 * 39))
    times = {(t.stage, str(t.task)): (t.start, t.end) for t in result.tasks}
    assert times[(1, "B0")] == (4.0, 10.0)
    assert times[(0, "F3")] == (21.0, 22.0)
    assert times[(0, "B3")] == (37.0, 39.0)


def test_transfer_p2_m1_exact():
    f, b, c = 1.0, 2.0, 0.5
    result = simulate(build_schedule("1f1b", 2, 1), f, b, transfer_time=c)
    assert result.length == pytest.approx(f + c + f + b + c + b)
    assert [(x.src_stage, x.dst_stage, x.micro_batch, x.kind, x.start, x.end)
            for x in result.transfers] == [(0, 1, 0, "F", 1.0, 1.5), (1, 0, 0, "B", 4.5, 5.0)]


@pytest.mark.parametrize("p,m", GRID)
def test_transfer_lower_bound(p, m):
    f, b, c = 1.0, 2.0, 0.25
    result = simulate(build_schedule("1f1b", p, m), f, b, transfer_time=c)
    assert result.length >= (m + p - 1) * (f + b) + 2 * (p - 1) * c - 1e-9
    assert len(result.transfers) == 2 * (p - 1) * m


def test_tasks_respect_dependencies_and_stage_order():
    schedule = build_schedule("kfkb", 3, 5, group_size=2)
    result = simulate(schedule, [1, 2, 1.5], [2, 3, 1], transfer_time=0.5)
    end = {(t.stage, t.task.kind, t.task.micro_batch): t.end for t in result.tasks}
    for t in result.tasks:
        m = t.task.micro_batch
        if t.task.kind == "F" and t.stage > 0:
            assert t.start >= end[(t.stage - 1, "F", m)] + 0.5
        if t.task.kind == "B":
            assert t.start >= end[(t.stage, "F", m)]
            if t.stage < 2:
                assert t.start >= end[(t.stage + 1, "B", m)] + 0.5
    for s in range(3):
        row = [t for t in result.tasks if t.stage == s]
        assert [t.task for t in row] == schedule[s]
        assert all(a.end <= b.start for a, b in zip(row, row[1:]))


def test_single_stage_has_no_bubble():
    result = simulate(build_schedule("1f1b", 1, 3), 1.0, 2.0)
    assert result.length == pytest.approx(9.0)
    assert result.bubble_fraction == pytest.approx(0.0)
    assert result.transfers == []


def test_deadlock_raises():
    # Stage 0 wants B0 (needs B0 from stage 1) before F1; stage 1 wants F1 (from stage 0)
    # before B0: neither can go on.
    schedule = [tasks("F0 B0 F1 B1"), tasks("F0 F1 B0 B1")]
    with pytest.raises(ValueError, match="deadlock") as err:
        simulate(schedule, 1.0, 1.0)
    message = str(err.value)
    assert "stage 0 at B0 (waits for B0 on stage 1)" in message
    assert "stage 1 at F1 (waits for F1 on stage 0)" in message


@pytest.mark.parametrize("kwargs,match", [
    ({"forward_time": [1.0]}, "forward_time has 1 entries for 2 stages"),
    ({"backward_time": -1.0}, "backward_time"),
    ({"backward_time": [1.0, -2.0]}, r"backward_time\[1\]"),
    ({"transfer_time": "1"}, "transfer_time"),
])
def test_simulate_bad_times(kwargs, match):
    args = {"forward_time": 1.0, "backward_time": 1.0, **kwargs}
    with pytest.raises(ValueError, match=match):
        simulate(build_schedule("1f1b", 2, 2), **args)


def test_simulate_rejects_malformed_schedule():
    with pytest.raises(ValueError, match="stage 1"):
        simulate([tasks("F0 B0"), tasks("F0")], 1.0, 1.0)


# ---------------------------------------------------------------- chrome trace

def test_chrome_trace_events():
    result = simulate(build_schedule("1f1b", 2, 3), [1, 2], [2, 3], transfer_time=0.5)
    trace = chrome_trace(result, stage_names=["/gpu:0", "/gpu:1"], time_unit_us=1000.0)
    events = trace["traceEvents"]
    task_events = [e for e in events if e["ph"] == "X" and e["cat"] != "transfer"]
    assert len(task_events) == len(result.tasks) == 12
    for event, timed in zip(task_events, result.tasks):
        assert event["name"] == str(timed.task)
        assert event["tid"] == timed.stage
        assert event["ts"] == pytest.approx(timed.start * 1000.0)
        assert event["dur"] == pytest.approx((timed.end - timed.start) * 1000.0)
        assert event["args"] == {"stage": timed.stage, "micro_batch": timed.task.micro_batch,
                                 "kind": timed.task.kind}
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    assert names == {0: "/gpu:0", 1: "/gpu:1", 2: "transfer 0->1", 3: "transfer 1->0"}
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert process[0]["args"]["name"] == "tfpar pipeline schedule"
    transfer_events = [e for e in events if e["ph"] == "X" and e["cat"] == "transfer"]
    assert len(transfer_events) == len(result.transfers) == 6
    assert all(e["dur"] == pytest.approx(500.0) for e in transfer_events)
    assert {e["tid"] for e in transfer_events} == {2, 3}


def test_chrome_trace_default_names_and_bad_names():
    result = simulate(build_schedule("gpipe", 2, 2), 1.0, 1.0)
    trace = chrome_trace(result)
    names = [e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"]
    assert names[:2] == ["stage 0", "stage 1"]
    with pytest.raises(ValueError, match="stage_names"):
        chrome_trace(result, stage_names=["only one"])


def test_write_chrome_trace(tmp_path):
    trace = chrome_trace(simulate(build_schedule("kfkb", 3, 4, group_size=2), 1.0, 2.0))
    path = write_chrome_trace(trace, str(tmp_path / "schedule.json"))
    assert path == str(tmp_path / "schedule.json")
    with open(path) as f:
        assert json.load(f) == trace
