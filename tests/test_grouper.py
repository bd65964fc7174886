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
    """Without transfers stage 1 is never idle once F0 reaches it: every k
    takes 1 + 8 x (1 + 2) + 2 = 27 (its 24 of work, then stage 0's last
    backward), and the least memory, k = 1, wins."""
    assert {k: length for k, (length, _) in replayed(0.0).items()} == {
        k: 1 + 8 * (1 + 2) + 2 for k in range(1, 9)}
    assert tune_group_size(8, transfer=0.0, memory_limit=100.0, **TWO_STAGES) == 1


def test_slow_transfers_favour_larger_groups():
    """Transfers of 3: no step is shorter than 1 + 3 + 8 x (1 + 2) + 3 + 2
    = 33 (F0 reaches stage 1 at 4, which then has 24 of work; the last
    gradient reaches stage 0 3 later, and its backward takes 2). 1F1B (k =
    1) runs F m+2 on stage 0 only once B m is back, a round of 1 + 3 + 1 +
    2 + 3 + 2 = 12 every two micro-batches: F6 ends at 37, and B7 at 51.
    Groups of 2 hide part of the transfers (36), groups of 3 or more all
    of them: k = 3, the smallest reaching the bound, wins."""
    bound = 1 + 3 + 8 * (1 + 2) + 3 + 2
    assert {k: length for k, (length, _) in replayed(3.0).items()} == {
        1: 51, 2: 36, **{k: bound for k in range(3, 9)}}
    assert tune_group_size(8, transfer=3.0, memory_limit=100.0, **TWO_STAGES) == 3


def test_memory_limit_prunes_large_groups():
    """Stage 0 holds 2k micro-batches at its peak (at most the 8): a group
    in warm-up and the next group's forwards before its first backward. At
    1 byte each a limit of 5 leaves k = 1 (51) and k = 2 (36): 2 wins; a
    limit of 1 leaves nothing."""
    assert {k: peak for k, (_, peak) in replayed(3.0).items()} == {
        k: min(2 * k, 8) for k in range(1, 9)}
    assert tune_group_size(8, transfer=3.0, memory_limit=5.0, **TWO_STAGES) == 2
    with pytest.raises(PlanError, match="no group size fits"):
        tune_group_size(8, transfer=3.0, memory_limit=1.0, **TWO_STAGES)
