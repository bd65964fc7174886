"""Pipeline stage assignment as an integer program (Rhino §5), solved with CP-SAT.

Nodes of a DAG get stages ``B_i`` in ``[0, d)``. For every edge (i, j):
``B_j - B_i >= 0`` (a consumer is never in an earlier stage), and a 0-1 variable
``F_ij`` marks a cut with the big-M constraints ``F_ij <= B_j - B_i <= M F_ij``
(``M = d - 1``). The objective is the communication volume
``sum F_ij * bytes_ij`` (Rhino §5.1).

Bound tightening (Rhino §5.2) keeps stages balanced: with ``t = sum comp / d``
the time of a perfectly balanced stage, node i cannot start before its
ancestors' work is done, ``B_i >= floor(sum_{A_i} comp / t - eps)``, and must
leave room for its descendants, ``B_i <= d - 1 - floor(sum_{D_i} comp / t - eps)``
(the paper prints this bound as ``ceil((comp_i + sum_{D_i} comp) / t + eps)``;
we use its mirror image of the lower bound, which is what "latest start"
means). We also bound every stage's work by ``(1 + eps) t`` and require every
stage to be used, so the cheapest cut never buys imbalance.

CP-SAT's limit is deterministic time (``solving.cp_solver``): the same cut
whatever the machine's load. It starts from a ``hint`` (the most balanced
contiguous cut), so a solution cut short by the limit is no worse than it.
"""
import math
from typing import Dict, Hashable, List, NamedTuple, Optional

import networkx as nx
from ortools.sat.python import cp_model

from tfpar.planner.solving import add_linear, cp_solver, minimize, status_of

__all__ = ["StageSolution", "stage_ilp"]

_SCALE = 1000  # CP-SAT needs integers: costs are scaled to the largest one


class StageSolution(NamedTuple):
    """node -> stage (None: none found), and the solve's ``solving.status_of``
    ("too few nodes": fewer nodes than stages, not solved)."""

    stages: Optional[Dict[Hashable, int]]
    status: str


def stage_ilp(dag: nx.DiGraph, num_stages: int, epsilon: float = 0.5,
              time_limit_s: float = 10.0, deadline: Optional[float] = None,
              hint: Optional[Dict[Hashable, int]] = None) -> StageSolution:
    """Stage of every node of ``dag`` minimising the bytes crossing stages.

    Args:
      dag: nodes with ``comp`` (time or FLOPs), edges with ``bytes``.
      num_stages: d.
      epsilon: imbalance tolerance (fraction of a balanced stage).
      time_limit_s: CP-SAT's deterministic time limit.
      deadline: ``time.monotonic()`` past which it does not run (None: none).
      hint: node -> stage to start from.
    """
    nodes = list(nx.topological_sort(dag))
    if num_stages < 1 or len(nodes) < num_stages:
        return StageSolution(None, "too few nodes")
    comp = _integers([dag.nodes[n].get("comp", 0.0) for n in nodes])
    weight = dict(zip(nodes, comp))
    balanced = max(sum(comp) / num_stages, 1e-9)
    model = cp_model.CpModel()
    stage = {}
    for n in nodes:
        before = sum(weight[a] for a in nx.ancestors(dag, n))
        after = sum(weight[d] for d in nx.descendants(dag, n))
        low = max(0, math.floor(before / balanced - epsilon))
        high = min(num_stages - 1, num_stages - 1 - math.floor(after / balanced - epsilon))
        stage[n] = model.NewIntVar(min(low, high), max(low, high), f"B_{len(stage)}")
    volume = _integers([dag.edges[e].get("bytes", 0.0) for e in dag.edges])
    cuts = []
    for (i, j), size in zip(dag.edges, volume):
        cut = model.NewBoolVar(f"F_{len(cuts)}")
        add_linear(model, [(1, stage[j]), (-1, stage[i]), (-1, cut)], low=0)
        add_linear(model, [(1, stage[j]), (-1, stage[i]), (1 - num_stages, cut)], high=0)
        cuts.append((size, cut))
    _balance(model, nodes, stage, weight, num_stages, math.floor((1 + epsilon) * balanced))
    minimize(model, cuts)
    for n, s in (hint or {}).items():
        model.AddHint(stage[n], s)
    solver = cp_solver(time_limit_s, deadline)
    status = status_of(solver.Solve(model)) if solver is not None else "timed out"
    if status not in ("optimal", "feasible"):
        return StageSolution(None, status)
    return StageSolution({n: solver.Value(stage[n]) for n in nodes}, status)


def _balance(model, nodes, stage, weight, num_stages: int, capacity: int) -> None:
    """Every stage holds at most ``capacity`` work and at least one node."""
    member: List[List] = [[] for _ in range(num_stages)]
    for n in nodes:
        flags = [model.NewBoolVar("") for _ in range(num_stages)]
        model.AddExactlyOne(flags)
        add_linear(model, [(1, stage[n])] + [(-s, flag) for s, flag in enumerate(flags)], 0, 0)
        for s, flag in enumerate(flags):
            member[s].append((weight[n], flag))
    for s in range(num_stages):
        add_linear(model, member[s], high=max(capacity, max(weight.values())))
        model.AddBoolOr([flag for _, flag in member[s]])


def _integers(values: List[float]) -> List[int]:
    top = max(values, default=0.0) or 1.0
    return [int(round(_SCALE * v / top)) for v in values]
