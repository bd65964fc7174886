"""Balanced contiguous partition of a model into pipeline stages (no TensorFlow).

Used when the user gives ``num_task_graph`` but no scopes (Whale Example 4):
forward ops in topological order are cut into that many contiguous stages so
that the most expensive stage is as cheap as possible (the linear partition
problem, solved exactly: binary search on the bottleneck with a greedy check).
Contiguity in a topological order keeps every edge pointing to the same or a
later stage.
"""
from typing import List, Sequence

__all__ = ["balanced_partition"]


def balanced_partition(costs: Sequence[float], num_stages: int) -> List[int]:
    """The stage of each item; stages are contiguous, non-empty when there are
    enough items, and minimise the largest stage cost."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not costs:
        return []
    low, high = max(costs), float(sum(costs))
    for _ in range(100):  # the bottleneck is a segment sum: converge on it
        middle = (low + high) / 2
        if _stages_needed(costs, middle) <= num_stages:
            high = middle
        else:
            low = middle
    stages = _greedy(costs, high)
    return _fill_to(stages, min(num_stages, len(costs)))


def _stages_needed(costs: Sequence[float], bound: float) -> int:
    return _greedy(costs, bound)[-1] + 1


def _greedy(costs: Sequence[float], bound: float) -> List[int]:
    stages, stage, total = [], 0, 0.0
    for cost in costs:
        if total + cost > bound * (1 + 1e-12) and total > 0:
            stage, total = stage + 1, 0.0
        stages.append(stage)
        total += cost
    return stages


def _fill_to(stages: List[int], wanted: int) -> List[int]:
    """Split the stages with the most items until there are ``wanted`` (cutting
    a stage never raises the bottleneck)."""
    while stages[-1] + 1 < wanted:
        counts = [stages.count(s) for s in range(stages[-1] + 1)]
        widest = max(range(len(counts)), key=counts.__getitem__)
        first = stages.index(widest)
        cut = first + counts[widest] // 2
        stages = stages[:cut] + [s + 1 for s in stages[cut:]]
    return stages
