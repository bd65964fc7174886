"""Ada-Grouper's choice of k (no TensorFlow)."""
import pytest

from tfpar.errors import PlanError
from tfpar.planner.grouper import tune_group_size

TWO_STAGES = dict(forward=[1.0, 1.0], backward=[2.0, 2.0], fixed_bytes=[0.0, 0.0],
                  activation_bytes=[1.0, 1.0])


def test_without_communication_one_f_one_b_is_as_short_and_smallest():
    assert tune_group_size(8, transfer=0.0, memory_limit=100.0, **TWO_STAGES) == 1


def test_slow_transfers_favour_larger_groups():
    # Simulated lengths for k = 1, 2, 3 .. 8 with transfer 3: 51, 36, then 33.
    assert tune_group_size(8, transfer=3.0, memory_limit=100.0, **TWO_STAGES) == 3


def test_memory_limit_prunes_large_groups():
    # k = 2 keeps 4 micro-batches in flight on stage 0; k = 3 keeps 6.
    assert tune_group_size(8, transfer=3.0, memory_limit=5.0, **TWO_STAGES) == 2
    with pytest.raises(PlanError, match="no group size fits"):
        tune_group_size(8, transfer=3.0, memory_limit=1.0, **TWO_STAGES)
