"""Choosing k of the kFkB schedule (Ada-Grouper §4), no TensorFlow.

Grouping k micro-batches lets the transfers of a group overlap the compute of
the next, so the pipeline gets shorter as k grows while each stage keeps more
micro-batches' activations alive. Every k in 1..M is replayed by the simulator
(the pipeline-length cost model); candidates whose peak memory (the stage's
fixed bytes plus its activations times the micro-batches in flight) exceeds
the limit are pruned (the memory-limit curve); the shortest remaining pipeline
wins, ties going to the smaller k (less memory).
"""
from typing import Sequence

from tfpar.errors import PlanError
from tfpar.planner.schedule import build_schedule
from tfpar.planner.simulate import simulate

__all__ = ["tune_group_size"]


def tune_group_size(num_micro_batch: int, forward: Sequence[float], backward: Sequence[float],
                    transfer: float, fixed_bytes: Sequence[float],
                    activation_bytes: Sequence[float], memory_limit: float) -> int:
    """The best k for a pipeline of ``len(forward)`` stages.

    Args:
      forward / backward: per stage, time of one micro-batch.
      transfer: delay of a cross-stage transfer.
      fixed_bytes: per stage, memory that does not depend on k (weights...).
      activation_bytes: per stage, activations one micro-batch keeps alive.
      memory_limit: bytes per device.

    Raises:
      PlanError: not even k = 1 fits.
    """
    best = None
    for k in range(1, num_micro_batch + 1):
        result = simulate(build_schedule("kfkb", len(forward), num_micro_batch, k),
                          list(forward), list(backward), transfer)
        peak = max(f + a * n for f, a, n in zip(fixed_bytes, activation_bytes,
                                                 result.peak_in_flight))
        if peak > memory_limit:
            continue
        if best is None or result.length < best[1] - 1e-12:
            best = (k, result.length)
    if best is None:
        raise PlanError("tfpar: pipeline.group_size 'auto': no group size fits the device "
                        f"memory ({memory_limit / 2 ** 30:.3g} GB), not even 1")
    return best[0]
