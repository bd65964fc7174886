"""Ada-Grouper's choice of k (no TensorFlow): the shortest simulated kFkB
pipeline whose peak activation memory fits, ties to the smaller k."""
import pytest

from tfpar.errors import PlanError
from tfpar.planner.grouper import tune_group_size
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import simulate

TWO_STAGES = dict(forward=[1.0, 1.0], backward=[2.0, 2.0], fixed_bytes=[0.0, 0.0],
                  activation_bytes=[1.0, 1.0])


def replayed(transfer, micro=8):
    """k -> (length, peak micro-batches in flight) of the two-stage pipeline."""
    return {k: (r.length, max(r.peak_in_flight)) for k in range(1, micro + 1)
            for r in [simulate(build_schedule("kfkb", 2, micro, k), [1.0, 1.0], [2.0, 2.0],
                               transfer)]}


def test_without_communication_one_f_one_b_is_as_short_and_smallest():
    lengths = {length for length, _ in replayed(0.0).values()}
    assert len(lengths) == 1  # every k is as short: the least memory wins
    assert tune_group_size(8, transfer=0.0, memory_limit=100.0, **TWO_STAGES) == 1


def test_slow_transfers_favour_larger_groups():
    runs = replayed(3.0)
    shortest = min(length for length, _ in runs.values())
    assert runs[1][0] > runs[2][0] > shortest  # grouping hides the transfers
    expected = min(k for k, (length, _) in runs.items() if length == shortest)
    assert tune_group_size(8, transfer=3.0, memory_limit=100.0, **TWO_STAGES) == expected > 1


def test_memory_limit_prunes_large_groups():
    runs = replayed(3.0)
    fitting = {k: length for k, (length, peak) in runs.items() if peak <= 5}
    expected = min(fitting, key=lambda k: (fitting[k], k))
    assert max(fitting) < 8 and expected == max(fitting)  # the limit binds
    assert tune_group_size(8, transfer=3.0, memory_limit=5.0, **TWO_STAGES) == expected
    with pytest.raises(PlanError, match="no group size fits"):
        tune_group_size(8, transfer=3.0, memory_limit=1.0, **TWO_STAGES)
