"""Hardware-aware load balance inside a TaskGraph (Whale §3.3.1, Algorithm 1); no
TensorFlow.

Replicas of a TaskGraph on devices of different speeds wait for the slowest at
the step's synchronization barrier. Whale keeps the global batch and gives
device i the load ratio L_i closest to its share of the cluster's FLOP rate,
``DF_i / sum(DF)``, subject to its memory ``DM_i``: Formula 1, solved by
Algorithm 1 (memory-constraint load balancing).
"""
import dataclasses
from typing import Sequence, Tuple

__all__ = ["Balance", "balance_load", "integer_shares", "step_time"]

RESOLUTION = 1000  # integer batch weights: parts per RESOLUTION of the fastest device's


@dataclasses.dataclass(frozen=True)
class Balance:
    """Attributes: ratios (L_i, summing to 1); fits (every device within its memory)."""

    ratios: Tuple[float, ...]
    fits: bool


def balance_load(flops_per_s: Sequence[float], memory_bytes: Sequence[float],
                 batch_bytes: float, fixed_bytes: float = 0.0) -> Balance:
    """Whale's Algorithm 1: load ratios initialised in proportion to each
    device's FLOP rate (lines 3-10); then, while a device is out of memory and
    another has room, load moves from the device with the highest memory
    utilization (``peak``) to the one with room and the lowest FLOP
    utilization (``valley``, ties by memory utilization; lines 11-18). A
    device's memory is ``fixed_bytes`` (what it holds whatever its load:
    weights, gradients, optimizer slots) plus its ratio of ``batch_bytes``
    (activations of the whole global batch; Whale's L_i * TG_mem is the case
    ``fixed_bytes`` 0). ``shift_load`` moves as much as the peak needs and the
    valley can take; a valley that can take nothing leaves the free devices,
    a peak that fits leaves the out-of-memory ones (the paper pops the peak
    after any successful shift; here it stays while it is still over, so its
    remaining excess can go to the next valley)."""
    total = sum(flops_per_s)
    ratios = [df / total for df in flops_per_s]
    room = [(dm - fixed_bytes) / batch_bytes if batch_bytes > 0 else float("inf")
            for dm in memory_bytes]  # the largest ratio each device holds
    oom = [i for i, r in enumerate(ratios) if r > room[i]]
    free = [i for i, r in enumerate(ratios) if r <= room[i]]

    def flop_util(i):
        return ratios[i] / flops_per_s[i]

    def mem_util(i):
        return ratios[i] / room[i] if room[i] > 0 else float("inf")

    while oom and free:
        peak = max(oom, key=mem_util)
        valley = min(free, key=lambda i: (flop_util(i), mem_util(i)))
        shift = min(ratios[peak] - max(room[peak], 0.0), room[valley] - ratios[valley])
        if shift <= 0:
            free.remove(valley)
            continue
        ratios[peak] -= shift
        ratios[valley] += shift
        if ratios[peak] <= room[peak]:
            oom.remove(peak)
    fits = all(r <= room[i] for i, r in enumerate(ratios)) and all(x >= 0 for x in room)
    return Balance(tuple(ratios), fits)


def integer_shares(ratios: Sequence[float]) -> Tuple[int, ...]:
    """Integer batch weights in proportion to ``ratios`` (at least 1 each):
    a replica gets rows ``n * weight / sum(weights)``, rounded down at its
    boundaries; () when the ratios are even (rows cut as without balance)."""
    largest = max(ratios)
    weights = tuple(max(1, round(RESOLUTION * r / largest)) for r in ratios)
    return () if len(set(weights)) == 1 else weights


def step_time(ratios: Sequence[float], flops_per_s: Sequence[float], flops: float) -> float:
    """The compute time of a step of ``flops`` split by ``ratios``: the
    slowest device's, where every replica waits (the synchronization barrier)."""
    return max(r * flops / df for r, df in zip(ratios, flops_per_s))
