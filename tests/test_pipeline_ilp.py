"""Rhino §5 stage ILP equals brute force on small DAGs (no TensorFlow)."""
import itertools
import math
import random
import time

import networkx as nx
import pytest

from tfpar.planner.pipeline_ilp import _integers, stage_ilp


def brute_force(dag, stages, epsilon):
    """Least cut bytes over every assignment the ILP allows (same bounds, same
    stage capacity, every stage used, no edge going back)."""
    nodes = list(nx.topological_sort(dag))
    weight = dict(zip(nodes, _integers([dag.nodes[n]["comp"] for n in nodes])))
    size = dict(zip(dag.edges, _integers([dag.edges[e]["bytes"] for e in dag.edges])))
    balanced = sum(weight.values()) / stages
    capacity = max(math.floor((1 + epsilon) * balanced), max(weight.values()))
    best = None
    for assignment in itertools.product(range(stages), repeat=len(nodes)):
        b = dict(zip(nodes, assignment))
        if any(b[j] < b[i] for i, j in dag.edges) or len(set(assignment)) < stages:
            continue
        if any(sum(weight[n] for n in nodes if b[n] == s) > capacity for s in range(stages)):
            continue
        if any(b[n] < math.floor(sum(weight[a] for a in nx.ancestors(dag, n)) / balanced
                                 - epsilon) or
               b[n] > stages - 1 - math.floor(sum(weight[d] for d in nx.descendants(dag, n))
                                              / balanced - epsilon) for n in nodes):
            continue
        cost = sum(size[e] for e in dag.edges if b[e[0]] != b[e[1]])
        best = cost if best is None else min(best, cost)
    return best


def diamond_chain():
    """a -> (b, c) -> d -> e -> f, with a heavy tensor on d -> e."""
    dag = nx.DiGraph()
    for n, comp in zip("abcdef", [1, 2, 2, 1, 3, 1]):
        dag.add_node(n, comp=comp)
    for (i, j), size in zip(["ab", "ac", "bd", "cd", "de", "ef"], [4, 4, 2, 2, 9, 1]):
        dag.add_edge(i, j, bytes=size)
    return dag


def random_dag(seed, n=7):
    rng = random.Random(seed)
    dag = nx.DiGraph()
    for i in range(n):
        dag.add_node(i, comp=rng.randint(1, 5))
    for j in range(1, n):
        for i in rng.sample(range(j), k=min(j, rng.randint(1, 2))):
            dag.add_edge(i, j, bytes=rng.randint(1, 9))
    return dag


@pytest.mark.parametrize("dag", [diamond_chain()] + [random_dag(s) for s in range(4)],
                         ids=["diamond"] + [f"random{s}" for s in range(4)])
@pytest.mark.parametrize("stages,epsilon", [(2, 0.5), (3, 0.5), (2, 0.2), (3, 2.0)])
def test_cut_bytes_equal_brute_force(dag, stages, epsilon):
    assignment = stage_ilp(dag, stages, epsilon).stages
    expected = brute_force(dag, stages, epsilon)
    if expected is None:
        assert assignment is None
        return
    size = dict(zip(dag.edges, _integers([dag.edges[e]["bytes"] for e in dag.edges])))
    assert all(assignment[j] >= assignment[i] for i, j in dag.edges)
    assert sum(size[e] for e in dag.edges if assignment[e[0]] != assignment[e[1]]) == expected
    weight = dict(zip(dag.nodes, _integers([dag.nodes[n]["comp"] for n in dag.nodes])))
    balanced = sum(weight.values()) / stages
    for stage in range(stages):  # every stage used and within the tolerance
        load = sum(w for n, w in weight.items() if assignment[n] == stage)
        assert 0 < load <= max((1 + epsilon) * balanced, max(weight.values()))


def test_too_few_nodes_or_stages():
    assert stage_ilp(diamond_chain(), 7) == (None, "too few nodes")
    assert stage_ilp(diamond_chain(), 0) == (None, "too few nodes")


def wide_dag(seed=3, n=120):
    """120 nodes, each fed by 1-3 of the 10 before it: too many cuts for
    CP-SAT to prove the best one in a fraction of a second."""
    rng = random.Random(seed)
    dag = nx.DiGraph()
    for i in range(n):
        dag.add_node(i, comp=rng.randint(1, 50))
    for j in range(1, n):
        for i in rng.sample(range(max(0, j - 10), j), k=min(j, rng.randint(1, 3))):
            dag.add_edge(i, j, bytes=rng.randint(1, 100))
    return dag


def test_the_stage_ilp_says_whether_it_proved_its_cut():
    """Before, a solution the time limit cut short came back as if it were
    optimal (FEASIBLE taken for OPTIMAL), and nothing found as None alike
    for "no such cut" and "no time"."""
    assert stage_ilp(diamond_chain(), 2, 0.5).status == "optimal"
    short = stage_ilp(wide_dag(), 8, 0.04, time_limit_s=0.2)
    assert short.status == "feasible" and len(short.stages) == 120
    assert stage_ilp(diamond_chain(), 2, 0.5, deadline=time.monotonic() - 1) == (None, "timed out")
    assert stage_ilp(diamond_chain(), 3, 0.0).status == "infeasible"
    assert brute_force(diamond_chain(), 3, 0.0) is None


def test_a_solve_cut_short_gives_the_same_cut_every_time():
    """CP-SAT's deterministic time bounds the solve, not the wall clock: the
    same cut whatever the machine's load (before, 2 s of wall clock)."""
    first, second = (stage_ilp(wide_dag(), 8, 0.04, time_limit_s=0.2) for _ in range(2))
    assert first.status == "feasible" and first == second
