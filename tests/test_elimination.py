"""Variable elimination (``planner.elimination``) finds the unique optimum of
a sum of single and pairwise integer costs, and says when there is none; the
sharding segments it answers are CP-SAT's answers (``sharding_ilp``)."""
import itertools
import random

import pytest

from tfpar.planner import elimination, sharding_ilp
from tfpar.planner.elimination import unique_minima
from tfpar.planner.sharding_costs import Mesh, Problem

from test_sharding_search import DEVICE, random_graph


def _random_problem(seed):
    """Up to 7 variables of 1-3 values, chains and a few cross edges, costs
    drawn from few values (so optima often tie)."""
    rng = random.Random(seed)
    count = rng.randint(2, 7)
    sizes = [rng.randint(1, 3) for _ in range(count)]
    unary = [[rng.randint(0, 4) for _ in range(size)] for size in sizes]
    edges = {(i, i + 1) for i in range(count - 1)}
    edges |= {tuple(sorted(rng.sample(range(count), 2))) for _ in range(rng.randint(0, 4))}
    pairs = [(v, u, [[rng.randint(0, 4) for _ in range(sizes[u])] for _ in range(sizes[v])])
             if rng.random() < 0.5 else
             (u, v, [[rng.randint(0, 4) for _ in range(sizes[v])] for _ in range(sizes[u])])
             for u, v in sorted(edges)]
    return sizes, unary, pairs


def _total(unary, pairs, values):
    return (sum(costs[values[v]] for v, costs in enumerate(unary))
            + sum(costs[values[u]][values[v]] for u, v, costs in pairs))


@pytest.mark.parametrize("seed", range(60))
def test_elimination_finds_the_unique_optimum_or_says_it_ties(seed):
    sizes, unary, pairs = _random_problem(seed)
    fixed = (0, len(sizes) - 1)
    fixings = [dict(zip(fixed, values))
               for values in itertools.product(range(sizes[0]), range(sizes[-1]))]
    for fixing, found in zip(fixings, unique_minima(sizes, unary, pairs, fixings)):
        every = [values for values in itertools.product(*map(range, sizes))
                 if all(values[v] == value for v, value in fixing.items())]
        least = min(_total(unary, pairs, values) for values in every)
        best = [list(values) for values in every if _total(unary, pairs, values) == least]
        assert found == (best[0] if len(best) == 1 else None)


def test_a_graph_too_entangled_is_not_eliminated(monkeypatch):
    """Eliminating a chain's end makes a table of two variables; any
    variable of a triangle, one of three (2 x 2 x 2 entries)."""
    differ = [[0, 1], [1, 0]]
    chain = [(0, 1, differ), (1, 2, differ)]
    monkeypatch.setattr(elimination, "MAX_ENTRIES", 4)
    assert unique_minima([2] * 3, [[0, 1]] * 3, chain, [{}]) == [[0, 0, 0]]
    assert unique_minima([2] * 3, [[0, 1]] * 3, chain + [(0, 2, differ)], [{}]) == [None]


def test_a_variable_that_costs_nothing_whatever_its_value_ties_every_optimum():
    """A layer in no edge whose candidates cost the same (a constant): every
    optimum ties, told before anything is eliminated."""
    sizes, pairs = [2, 2, 2], [(0, 1, [[0, 2], [2, 0]])]
    fixings = [{0: 0}, {0: 1}]
    assert unique_minima(sizes, [[0, 1], [1, 0], [3, 3]], pairs, fixings) == [None, None]
    assert unique_minima(sizes, [[0, 1], [1, 0], [3, 4]], pairs, fixings) == [[0, 0, 0],
                                                                             [1, 1, 0]]


@pytest.mark.parametrize("seed,count,skips", [(0, 6, 2), (1, 8, 3), (2, 9, 4), (3, 7, 5)])
def test_segments_eliminated_are_the_ones_cp_sat_solves(seed, count, skips):
    """Every fixing of a segment's ends: the candidates elimination gives
    where the optimum is unique, CP-SAT's where it ties, are CP-SAT's."""
    graph = random_graph(seed, count, skips)
    problem = Problem(graph, Mesh(devices=4, tensor=2, batch=32, hardware=DEVICE))
    allowed = problem.allowed()
    first, last = 0, count - 1
    fixings = [{first: a, last: b} for a in allowed[first] for b in allowed[last]]
    nodes = range(count)
    by_cp_sat = sharding_ilp._solved(problem, sharding_ilp._Costs(problem, allowed, nodes),
                                     fixings, None, 10.0, None, 1, None)
    assert sharding_ilp.solve_ilp(problem, allowed, fixings, None, 10.0, nodes) == by_cp_sat
