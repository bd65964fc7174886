"""Choosing k of the kFkB schedule (Ada-Grouper §4, §5.2), no TensorFlow.

Grouping k micro-batches lets the transfers of a group overlap the compute of
the next, so the pipeline gets shorter as k grows while each stage keeps more
micro-batches' activations alive. Every k in 1..M is replayed by the simulator
(the pipeline-length cost model); candidates whose peak memory (the stage's
fixed bytes plus its activations times the micro-batches in flight) exceeds
the limit are pruned (the memory-limit curve); the shortest remaining pipeline
wins, ties going to the smaller k (less memory).

Online (§5.2, §5.4), the same choice is made again from a profiled step: its
stage times and its cross-stage transfer time (``profile_pipeline``).
"""
import dataclasses
import statistics
from typing import Dict, List, Sequence, Tuple

from tfpar.errors import PlanError
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import TimedTask, simulate, task_dependencies

__all__ = ["PipelineProfile", "group_lengths", "preferred_group_size", "profile_pipeline",
           "tune_group_size"]


def tune_group_size(num_micro_batch: int, forward: Sequence[float], backward: Sequence[float],
                    transfer: float, fixed_bytes: Sequence[float],
                    activation_bytes: Sequence[float], memory_limit: float,
                    tolerance: float = 0.0) -> int:
    """The best k for a pipeline of ``len(forward)`` stages: the smallest k
    whose pipeline is at most ``tolerance`` (a fraction) longer than the
    shortest that fits.

    Args:
      forward / backward: per stage, time of one micro-batch.
      transfer: delay of a cross-stage transfer.
      fixed_bytes: per stage, memory that does not depend on k (weights...).
      activation_bytes: per stage, activations one micro-batch keeps alive.
      memory_limit: bytes per device.
      tolerance: how much longer a smaller k may be and still be preferred
        (it keeps fewer activations alive).

    Raises:
      PlanError: not even k = 1 fits.
    """
    lengths = group_lengths(num_micro_batch, forward, backward, transfer, fixed_bytes,
                            activation_bytes, memory_limit)
    if not lengths:
        raise PlanError("tfpar: pipeline.group_size 'auto': no group size fits the device "
                        f"memory ({memory_limit / 2 ** 30:.3g} GB), not even 1")
    return preferred_group_size(lengths, tolerance)


def preferred_group_size(lengths: Dict[int, float], tolerance: float = 0.0) -> int:
    """The smallest k of ``lengths`` (k -> pipeline length) at most
    ``tolerance`` longer than the shortest."""
    shortest = min(lengths.values())
    return min(k for k, length in lengths.items()
               if length <= shortest * (1 + tolerance) + 1e-12)


def group_lengths(num_micro_batch: int, forward: Sequence[float], backward: Sequence[float],
                  transfer: float, fixed_bytes: Sequence[float],
                  activation_bytes: Sequence[float], memory_limit: float) -> Dict[int, float]:
    """k -> simulated pipeline length, for every k whose peak memory fits."""
    lengths = {}
    for k in range(1, num_micro_batch + 1):
        result = simulate(build_schedule("kfkb", len(forward), num_micro_batch, k),
                          list(forward), list(backward), transfer)
        peak = max(f + a * n for f, a, n in zip(fixed_bytes, activation_bytes,
                                                 result.peak_in_flight))
        if peak <= memory_limit:
            lengths[k] = result.length
    return lengths


@dataclasses.dataclass(frozen=True)
class PipelineProfile:
    """What a profiled step says about the pipeline (seconds).

    Attributes:
      forward / backward: per stage, mean time of one micro-batch's task.
      transfer: median cross-stage transfer time, over the transfers a task
        waited for (0.0 when no task waited for one).
      samples: how many transfers were waited for.
      length: the step's pipeline length (first task start to last task end).
    """

    forward: Tuple[float, ...]
    backward: Tuple[float, ...]
    transfer: float
    samples: int
    length: float


def profile_pipeline(tasks: Sequence[TimedTask], num_stages: int) -> PipelineProfile:
    """Profile a pipeline from its timed tasks (one device per stage, a traced
    step; Ada-Grouper §5.2 profiles stage times and end-to-end cross-stage
    transfers).

    A task that waited for a transfer started when the transfer arrived: its
    start minus the end of the task that sent it is the transfer time. It
    waited if its sender ended after the task before it on its device did (or
    it is its device's first task); otherwise the transfer may have been hidden
    and only bounds the time from above, so it is not counted.
    """
    ends: Dict[tuple, float] = {}
    by_stage: List[List[TimedTask]] = [[] for _ in range(num_stages)]
    for t in tasks:
        ends[(t.stage, t.task.kind, t.task.micro_batch)] = t.end
        by_stage[t.stage].append(t)
    samples = []
    for stage, timed in enumerate(by_stage):
        timed.sort(key=lambda t: t.start)
        for i, t in enumerate(timed):
            free = timed[i - 1].end if i else float("-inf")
            for key, crosses in task_dependencies(stage, t.task, num_stages):
                if crosses and key in ends and ends[key] > free:
                    samples.append(max(0.0, t.start - ends[key]))
    return PipelineProfile(
        forward=tuple(_mean_duration(timed, "F") for timed in by_stage),
        backward=tuple(_mean_duration(timed, "B") for timed in by_stage),
        transfer=statistics.median(samples) if samples else 0.0, samples=len(samples),
        length=max(t.end for t in tasks) - min(t.start for t in tasks))


def _mean_duration(timed: Sequence[TimedTask], kind: str) -> float:
    durations = [t.end - t.start for t in timed if t.task.kind == kind]
    return statistics.fmean(durations) if durations else 0.0
