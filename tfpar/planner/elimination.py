"""Exact minimisation of a sum of integer costs of single variables and of
pairs of variables, by variable elimination (no TensorFlow): bucket
elimination (Dechter 1999) in the (min, +) semiring, each entry also
counting the assignments that reach its minimum, so the caller learns
whether an optimum is unique.

The sharding segments of Rhino §4.3.2 are such sums: a candidate per layer,
a cost per layer and per edge between two layers' candidates. Eliminating a
layer adds its costs to its neighbours' (minimised over its own candidates),
so a transformer block, whose layers form short chains between a few branch
points, costs a few arrays of a few entries; a graph too entangled for that
(a table of more than ``MAX_ENTRIES``) is not eliminated.
"""
import dataclasses
import heapq
from typing import Dict, List, Optional, Sequence, Set, Tuple

import numpy

__all__ = ["MAX_ENTRIES", "unique_minima"]

MAX_ENTRIES = 4096  # the largest table an elimination may make

Pair = Tuple[int, int, Sequence[Sequence[int]]]  # (u, v, cost[value of u][value of v])


@dataclasses.dataclass(frozen=True)
class _Factor:
    """Costs over ``scope`` (variables in increasing order, an axis each):
    the least cost of each assignment and how many assignments of the
    variables eliminated into it reach it (at most 2: one or several)."""

    scope: Tuple[int, ...]
    value: numpy.ndarray
    count: numpy.ndarray


def unique_minima(sizes: Sequence[int], unary: Sequence[Sequence[int]], pairs: Sequence[Pair],
                  fixings: Sequence[Dict[int, int]]) -> List[Optional[List[int]]]:
    """Per fixing (variable -> value; every fixing fixes the same
    variables), the value of every variable (of ``sizes[v]`` values) in the
    assignment minimising the sum of ``unary[v][value]`` and of the
    ``pairs``' costs, when it is the only one reaching that minimum; None
    when several do, or when the graph is too entangled to eliminate."""
    kept = set(fixings[0]) if fixings else set()
    if _loose_tie(unary, pairs, kept):
        return [None] * len(fixings)
    factors = [_Factor((v,), numpy.asarray(costs, dtype=numpy.int64),
                       numpy.ones(len(costs), dtype=numpy.int64))
               for v, costs in enumerate(unary)]
    factors += [_pair(u, v, costs) for u, v, costs in pairs]
    eliminated = _eliminate(sizes, factors, kept)
    if eliminated is None:
        return [None] * len(fixings)
    rest, steps = eliminated
    return [_recovered(rest, steps, fixing) for fixing in fixings]


def _loose_tie(unary: Sequence[Sequence[int]], pairs: Sequence[Pair], kept: Set[int]) -> bool:
    """Whether a variable in no pair, not fixed, reaches its least cost with
    two values (a layer that costs nothing whatever its candidate: a
    constant): then every optimum ties, and eliminating the rest is wasted."""
    paired = {v for u, w, _ in pairs for v in (u, w)}
    return any(v not in paired and v not in kept and costs.count(min(costs)) > 1
               for v, costs in enumerate(unary))


def _pair(u: int, v: int, costs: Sequence[Sequence[int]]) -> _Factor:
    """The factor of a pair's costs, its axes in increasing variable order."""
    value = numpy.asarray(costs, dtype=numpy.int64)
    if u > v:
        u, v, value = v, u, value.T
    return _Factor((u, v), value, numpy.ones(value.shape, dtype=numpy.int64))


def _eliminate(sizes: Sequence[int], factors: List[_Factor], kept: Set[int]):
    """Every variable but ``kept`` eliminated, the one whose table is
    smallest first: (the factors left, over ``kept`` alone; per elimination
    in order, the variable, the scope of its table and its best value for
    each assignment of that scope), or None past ``MAX_ENTRIES``."""
    touching: Dict[int, List[_Factor]] = {v: [] for v in range(len(sizes))}
    neighbours = {v: {v} for v in range(len(sizes))}
    for factor in factors:
        for v in factor.scope:
            touching[v].append(factor)
            neighbours[v].update(factor.scope)
    queue = [(_entries(sizes, neighbours[v]), v) for v in range(len(sizes)) if v not in kept]
    heapq.heapify(queue)
    steps, constants = [], []
    while queue:
        entries, v = heapq.heappop(queue)
        if v not in neighbours or entries != _entries(sizes, neighbours[v]):
            continue  # eliminated, or its table has grown or shrunk since: queued again
        if entries > MAX_ENTRIES:
            return None
        scope = tuple(sorted(neighbours.pop(v) - {v}))
        reduced, best = _minimised(sizes, touching.pop(v), scope, v)
        for u in scope:
            touching[u] = [f for f in touching[u] if v not in f.scope] + [reduced]
            neighbours[u].discard(v)
            neighbours[u].update(scope)
            if u not in kept:
                heapq.heappush(queue, (_entries(sizes, neighbours[u]), u))
        constants += [] if scope else [reduced]
        steps.append((v, scope, best))
    left = {id(f): f for k in kept for f in touching[k]}
    return constants + list(left.values()), steps


def _entries(sizes: Sequence[int], variables: Set[int]) -> int:
    """Entries of a table over ``variables``."""
    entries = 1
    for v in variables:
        entries *= sizes[v]
    return entries


def _minimised(sizes: Sequence[int], factors: Sequence[_Factor], scope: Tuple[int, ...],
               v: int) -> Tuple[_Factor, numpy.ndarray]:
    """``factors`` (each over ``v`` and variables of ``scope``) summed and
    minimised over ``v``: the factor over ``scope``, and v's best value for
    each of its assignments."""
    axes = scope + (v,)
    value, count = 0, 1
    for factor in factors:
        shape = [1] * len(axes)
        for u in factor.scope:
            shape[axes.index(u)] = sizes[u]
        order = sorted(range(len(factor.scope)), key=lambda k: axes.index(factor.scope[k]))
        value = value + factor.value.transpose(order).reshape(shape)
        count = count * factor.count.transpose(order).reshape(shape)
    value = numpy.broadcast_to(value, [sizes[u] for u in axes])
    least = value.min(axis=-1)
    ways = numpy.where(value == least[..., None], count, 0).sum(axis=-1)
    return _Factor(scope, least, numpy.minimum(ways, 2)), value.argmin(axis=-1)


def _recovered(rest: Sequence[_Factor], steps, fixing: Dict[int, int]) -> Optional[List[int]]:
    """The assignment of the least sum with ``fixing``'s values, when it is
    the only one; eliminated variables take their best values, the last
    eliminated first."""
    ways = 1
    for factor in rest:
        ways *= int(factor.count[tuple(fixing[u] for u in factor.scope)])
    if ways > 1:
        return None
    values = dict(fixing)
    for v, scope, best in reversed(steps):
        values[v] = int(best[tuple(values[u] for u in scope)])
    return [values[v] for v in range(len(values))]
