"""Hardware-aware load balance inside a TaskGraph (Whale §3.3.1, Algorithm 1); no
TensorFlow.

Replicas of a TaskGraph on devices of different speeds wait for the slowest at
the step's synchronization barrier. Whale keeps the global batch and gives
device i the load ratio L_i closest to its share of the cluster's FLOP rate,
``DF_i / sum(DF)``, subject to its memory ``DM_i``: Formula 1, solved by
Algorithm 1 (memory-constraint load balancing).
"""
import dataclasses
import itertools
from typing import List, Sequence, Tuple

__all__ = ["Balance", "balance_load", "balance_stages", "integer_shares", "step_time",
           "well_formed_shares"]

RESOLUTION = 1000  # integer batch weights: parts per RESOLUTION of the fastest device's
BISECTIONS = 60  # of the slowest stage's time, from the whole model on the slowest device


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


def well_formed_shares(shares: Sequence, count: int) -> bool:
    """Whether pinned ``shares`` are integer weights (>= 1), one for each of
    ``count`` parts."""
    return len(shares) == count and all(isinstance(w, int) and w >= 1 for w in shares)


def step_time(ratios: Sequence[float], flops_per_s: Sequence[float], flops: float) -> float:
    """The compute time of a step of ``flops`` split by ``ratios``: the
    slowest device's, where every replica waits (the synchronization barrier)."""
    return max(r * flops / df for r, df in zip(ratios, flops_per_s))


def balance_stages(costs: Sequence[float], fixed_bytes: Sequence[float],
                   activation_bytes: Sequence[float], in_flight: Sequence[int],
                   flops_per_s: Sequence[float], memory_bytes: Sequence[float]
                   ) -> Tuple[List[int], bool]:
    """Whale §3.3.2, inter-TaskGraph balance: items (ops in topological
    order, with their ``costs`` in FLOPs, the bytes they hold whatever the
    batch and their activations per micro-batch) cut into contiguous stages,
    stage i on devices of rate ``flops_per_s[i]`` and memory
    ``memory_bytes[i]`` (ordered by memory, most first) keeping
    ``in_flight[i]`` micro-batches' activations. Algorithm 1 on the cuts:
    load ratios start at each stage's share of the FLOP rate (the contiguous
    cut whose slowest stage, cost / rate, is fastest: ``_fastest_cuts``);
    then, while a stage is out of memory and another has room, items move
    from the peak (highest memory utilization) towards the valley (lowest
    FLOP utilization, ties by memory), one across each cut between them,
    while that frees memory on the peak and every stage they pass through
    still fits; a valley that takes none leaves the free stages. Returns
    each item's stage and whether every stage fits."""
    n, count = len(costs), len(flops_per_s)
    cuts = _fastest_cuts(list(itertools.accumulate(costs, initial=0.0)), flops_per_s)

    def bounds(i):
        return (cuts[i - 1] if i else 0), (cuts[i] if i < count - 1 else n)

    def mem_util(i):
        lo, hi = bounds(i)
        held = sum(fixed_bytes[lo:hi]) + in_flight[i] * sum(activation_bytes[lo:hi])
        return held / memory_bytes[i]

    def flop_util(i):
        lo, hi = bounds(i)
        return sum(costs[lo:hi]) / flops_per_s[i]

    oom = [i for i in range(count) if mem_util(i) > 1]
    free = [i for i in range(count) if mem_util(i) <= 1]
    while oom and free:
        peak = max(oom, key=mem_util)
        valley = min(free, key=lambda i: (flop_util(i), mem_util(i)))
        before = mem_util(peak)
        if not _shift(cuts, peak, valley, n, lambda: mem_util(peak) < before and all(
                mem_util(i) <= 1 for i in range(min(peak, valley), max(peak, valley) + 1)
                if i != peak)):
            free.remove(valley)
        elif mem_util(peak) <= 1:
            oom.remove(peak)
            free.append(peak)
    stages = [0] * n
    for i in range(count):
        lo, hi = bounds(i)
        stages[lo:hi] = [i] * (hi - lo)
    return stages, all(mem_util(i) <= 1 for i in range(count))


def _fastest_cuts(prefix: Sequence[float], rates: Sequence[float]) -> List[int]:
    """The cuts of items (``prefix``: their cumulative costs) into
    ``len(rates)`` non-empty contiguous stages minimising the slowest stage's
    cost / rate: bisection on that bound, each stage taking as many items as
    it can within it (which, the rates fixed in order, is feasible whenever
    any cut is)."""
    n, count = len(prefix) - 1, len(rates)

    def greedy(bound):
        cuts, start = [], 0
        for i, rate in enumerate(rates[:-1]):
            end, last = start + 1, n - (count - 1 - i)  # one item left a later stage
            while end < last and prefix[end + 1] - prefix[start] <= bound * rate:
                end += 1
            cuts.append(end)
            start = end
        return cuts if prefix[n] - prefix[start] <= bound * rates[-1] else None

    low, high = 0.0, prefix[n] / min(rates)
    for _ in range(BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if greedy(middle) is None else (low, middle)
    return greedy(high)


def _shift(cuts: List[int], peak: int, valley: int, n: int, fits) -> bool:
    """Move one item from stage ``peak`` towards ``valley`` across every cut
    between them (each stage on the way gives one at one end and takes one at
    the other); undone, False, when a stage would be left empty or ``fits()``
    fails."""
    between = range(peak, valley) if valley > peak else range(valley, peak)
    step = -1 if valley > peak else 1
    for i in between:
        cuts[i] += step
    edges = [0] + cuts + [n]
    if any(b <= a for a, b in zip(edges, edges[1:])) or not fits():
        for i in between:
            cuts[i] -= step
        return False
    return True
