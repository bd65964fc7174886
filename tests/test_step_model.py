"""The step model's pipeline schedules (issue 17: the schedule is searched):
closed-form lengths and activations in flight against ``simulate``'s replays,
and ``best_setting`` choosing 1F1B, ZB-H1 or kFkB as their costs say."""
import random

import pytest

from tfpar.planner.comm import LATENCY_S, Cost
from tfpar.planner.memory import Techniques
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import simulate
from tfpar.planner.step_model import (SEARCHED_SCHEDULES, Space, StageModel, best_setting,
                                      in_flight, pipeline_length)

# (schedule, kFkB group size): every schedule the runtime builds.
KINDS = [("1f1b", 1), ("zero_bubble", 1), ("kfkb", 2), ("kfkb", 3), ("gpipe", 1)]


def replay(kind, group, times, micro, transfer):
    """``simulate``'s length of ``times`` per stage (forward a third)."""
    return simulate(build_schedule(kind, len(times), micro, group), [t / 3 for t in times],
                    [2 * t / 3 for t in times], transfer).length


def grid():
    for stages in (2, 3, 4, 8, 16):
        for micro in sorted({1, 2, stages, 2 * stages + 1, 4 * stages + 2}):
            for share in (0.0, 0.01, 0.05, 0.5, 1.0):  # transfer / stage time
                yield stages, micro, share


@pytest.mark.parametrize("kind, group", KINDS)
def test_closed_forms_are_the_replayed_lengths_of_equal_stages(kind, group):
    for stages, micro, share in grid():
        times = [3.0] * stages
        assert pipeline_length(times, micro, 3.0 * share, kind, group) == pytest.approx(
            replay(kind, group, times, micro, 3.0 * share), rel=1e-9), (stages, micro, share)


@pytest.mark.parametrize("kind, group", KINDS)
def test_closed_forms_stay_near_the_replays_of_unequal_stages(kind, group):
    """Stages within 10% of each other (``partition_stages`` balances them),
    transfers up to a sixth of a stage: within 12% and never below the
    replay (the slowest stage paces every micro-batch)."""
    rng = random.Random(17)
    for stages, micro, share in grid():
        times = [3.0 * rng.uniform(0.9, 1.1) for _ in range(stages)]
        transfer = max(times) * min(share, 1 / 6)
        closed, replayed = (pipeline_length(times, micro, transfer, kind, group),
                            replay(kind, group, times, micro, transfer))
        assert replayed * (1 - 1e-9) <= closed <= replayed * 1.12, (stages, micro, share)


@pytest.mark.parametrize("kind, group", KINDS)
def test_activations_in_flight_are_the_replayed_peaks(kind, group):
    for stages in (1, 2, 3, 4, 8):
        for micro in range(1, 3 * stages + 3):
            peaks = simulate(build_schedule(kind, stages, micro, group), 1.0, 2.0).peak_in_flight
            assert [in_flight(kind, group, stages, s, micro) for s in range(stages)] == peaks


def stage(compute=3.0, params=0.0):
    """A stage of ``compute`` seconds per row keeping a byte per row."""
    return StageModel(compute, 0.0, 0.0, 0.0, params, Cost(), (1.0, 1.0, 1.0), (0.0,) * 3,
                      (0.0,) * 3)


def pick(stages, micro, cut_bytes=0.0, capacity=1e30, schedules=SEARCHED_SCHEDULES):
    """``best_setting`` of one replica of ``micro`` rows, a row a micro-batch."""
    return best_setting([stage()] * stages, 1, float(micro),
                        Space((micro,), (Techniques(),), schedules), cut_bytes, 1.0, 1.0,
                        capacity)


@pytest.mark.parametrize("kind, group", KINDS)
def test_a_setting_is_its_schedules_replayed_step(kind, group):
    stages, micro, cut = 4, 8, 3 * 0.2
    setting = pick(stages, micro, cut, schedules=(kind,)) if kind != "kfkb" else \
        best_setting([stage()] * stages, 1, 8.0, Space((micro,), schedules=("kfkb",),
                                                       group_size=group), cut, 1.0, 1.0, 1e30)
    assert (setting.schedule, setting.group_size) == (kind, group)
    transfer = LATENCY_S + cut / (stages - 1)
    assert setting.step_time_s == pytest.approx(replay(kind, group, [3.0] * stages, micro,
                                                       transfer), rel=1e-9)
    assert setting.memory_bytes == tuple(in_flight(kind, group, stages, s, micro)
                                         for s in range(stages))


def test_fast_links_choose_zero_bubble():
    """ZB-H1 fills 1F1B's bubbles with weight gradients at 1F1B's first-stage
    memory: 8 stages of 16 micro-batches take 16 T + 7 T / 3, not 23 T."""
    best = pick(8, 16)
    assert best.schedule == "zero_bubble"
    assert best.step_time_s == pytest.approx((16 + 7 / 3) * 3.0, rel=1e-4)
    assert best.peak_memory == pick(8, 16, schedules=("1f1b",)).peak_memory == 8


def test_1f1b_when_the_others_gain_less_than_the_tolerance():
    """2 stages of 64 micro-batches: ZB-H1 saves 2/3 of a micro-batch of 65."""
    assert pick(2, 64).schedule == "1f1b"


def test_slow_links_choose_the_smallest_group_that_hides_them():
    """Transfers of a stage's time: 1F1B and ZB-H1 wait for gradients'
    round trips, kFkB (Ada-Grouper) hides them behind the group's other
    micro-batches - k = 3 covers 2 T - and holds k times 1F1B's activations;
    with room for only 2 x 1F1B's, k = 2 is the fastest that fits."""
    cut = 3 * (3.0 - LATENCY_S)  # a transfer of T over 3 boundaries
    best = pick(4, 12, cut)
    assert (best.schedule, best.group_size) == ("kfkb", 3)
    assert best.step_time_s < 0.9 * pick(4, 12, cut, schedules=("1f1b", "zero_bubble")).step_time_s
    assert best.memory_bytes == (12, 9, 6, 3)
    tight = pick(4, 12, cut, capacity=8)
    assert (tight.schedule, tight.group_size, tight.peak_memory) == ("kfkb", 2, 8)


def test_one_stage_has_no_schedule_to_choose():
    best = pick(1, 8)
    assert (best.schedule, best.step_time_s, best.memory_bytes) == ("1f1b", 24.0, (1.0,))
