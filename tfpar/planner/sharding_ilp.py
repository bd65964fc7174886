"""Rhino §4.2's integer program of a layer graph's sharding on OR-Tools CP-SAT:
a 0-1 variable per (layer, candidate), one per (edge, candidate pair) tied to
both ends, memory as a constraint (no TensorFlow). Without a memory limit
(the segments of Rhino §4.3.2), a fixing whose optimum is unique is found
by variable elimination instead (``elimination``): the one assignment CP-SAT
proves optimal, without building or solving the model."""
from typing import Dict, List, Optional, Sequence, Tuple

from ortools.sat.python import cp_model

from tfpar.planner.elimination import unique_minima
from tfpar.planner.sharding_costs import Problem
from tfpar.planner.solving import add_linear, cp_solver, minimize, status_of

__all__ = ["solve_ilp"]

_RESOLUTION = 1e6  # CP-SAT integer steps per largest cost


class _Costs:
    """The program's layers (``nodes``), their candidates and edges, and its
    objective's integer coefficients: per (layer, candidate) and per (edge,
    candidate pair), in steps of ``_RESOLUTION`` of the largest cost."""

    def __init__(self, problem: Problem, allowed: Sequence[Tuple[str, ...]],
                 nodes: Sequence[int]):
        inside = set(nodes)
        self.nodes = list(nodes)
        self.options = {i: allowed[i] for i in nodes}
        self.edges = [(i, j, size) for j in nodes for i, size in problem.preds[j]
                      if i in inside]
        node = {(i, c): problem.node(i, c).seconds for i in nodes for c in self.options[i]}
        edge = {(e, a, b): problem.reshard(size, a, b, problem.readers[i]).seconds
                for e, (i, j, size) in enumerate(self.edges)
                for a in self.options[i] for b in self.options[j]}
        unit = max(list(node.values()) + list(edge.values()) + [1e-30]) / _RESOLUTION
        self.node = {key: round(cost / unit) for key, cost in node.items()}
        self.edge = {key: round(cost / unit) for key, cost in edge.items()}


def solve_ilp(problem: Problem, allowed: Sequence[Tuple[str, ...]],
              fixings: Sequence[Dict[int, str]], memory_limit: Optional[float],
              time_limit_s: float, nodes: Optional[Sequence[int]] = None,
              hint: Optional[Sequence[str]] = None, workers: int = 1,
              deadline: Optional[float] = None) -> List[Tuple[Optional[List[str]], str]]:
    """Rhino §4.2 over ``nodes`` (all layers when None; edges among them),
    solved once per fixing (the candidates of some layers, given as solver
    assumptions) within ``time_limit_s`` each and ``deadline``, the model
    built once for the fixings that need it; ``hint`` (a candidate per
    layer) is where the solver starts; ``workers`` CP-SAT search workers.
    Without ``memory_limit``, a fixing whose optimum is unique is answered
    by elimination, "optimal" (what CP-SAT proves within its limits).
    Returns per fixing (candidate per layer of ``nodes``, or None) and its
    ``solving.status_of``."""
    costs = _Costs(problem, allowed, range(len(allowed)) if nodes is None else nodes)
    found = (_eliminated(costs, fixings) if memory_limit is None
             else [None] * len(fixings))
    rest = [fixing for fixing, chosen in zip(fixings, found) if chosen is None]
    solved = iter(_solved(problem, costs, rest, memory_limit, time_limit_s, hint, workers,
                          deadline) if rest else ())
    return [(chosen, "optimal") if chosen is not None else next(solved) for chosen in found]


def _eliminated(costs: _Costs, fixings: Sequence[Dict[int, str]]) -> List[Optional[List[str]]]:
    """Per fixing, its unique optimum by variable elimination, else None
    (several tie: which CP-SAT returns is its search's to say)."""
    if any(set(fixing) != set(fixings[0]) for fixing in fixings):
        return [None] * len(fixings)
    position = {i: k for k, i in enumerate(costs.nodes)}
    options = [costs.options[i] for i in costs.nodes]
    unary = [[costs.node[i, c] for c in costs.options[i]] for i in costs.nodes]
    pairs = [(position[i], position[j], [[costs.edge[e, a, b] for b in costs.options[j]]
                                         for a in costs.options[i]])
             for e, (i, j, _) in enumerate(costs.edges)]
    values = [{position[i]: options[position[i]].index(c) for i, c in fixing.items()}
              for fixing in fixings]
    return [None if chosen is None else [choice[k] for choice, k in zip(options, chosen)]
            for chosen in unique_minima([len(o) for o in options], unary, pairs, values)]


def _solved(problem: Problem, costs: _Costs, fixings: Sequence[Dict[int, str]],
            memory_limit: Optional[float], time_limit_s: float,
            hint: Optional[Sequence[str]], workers: int,
            deadline: Optional[float]) -> List[Tuple[Optional[List[str]], str]]:
    """``solve_ilp``'s answers from CP-SAT: the model built once, solved per fixing."""
    nodes, options = costs.nodes, costs.options
    model = cp_model.CpModel()
    pick = {(i, c): model.NewBoolVar(f"x{i}_{c}") for i in nodes for c in options[i]}
    for i in nodes:
        model.AddExactlyOne(pick[i, c] for c in options[i])
    objective = [(costs.node[key], pick[key]) for key in costs.node]
    for e, (i, j, _) in enumerate(costs.edges):
        pair = {(a, b): model.NewBoolVar(f"y{e}_{a}_{b}") for a in options[i] for b in options[j]}
        for a in options[i]:  # sum_b pair[a, b] == pick[i, a]
            add_linear(model, [(1, pair[a, b]) for b in options[j]] + [(-1, pick[i, a])], 0, 0)
        for b in options[j]:
            add_linear(model, [(1, pair[a, b]) for a in options[i]] + [(-1, pick[j, b])], 0, 0)
        objective += [(costs.edge[e, a, b], var) for (a, b), var in pair.items()]
    if memory_limit is not None:
        memory = {key: problem.memory_of(*key, problem.limit_activations) for key in pick}
        scale = max(max(memory.values(), default=0.0), memory_limit, 1.0) / _RESOLUTION
        add_linear(model, [(int(memory[key] / scale), var) for key, var in pick.items()],
                   high=int(memory_limit / scale))
    minimize(model, objective)
    if hint is not None:
        for (i, c), var in pick.items():
            model.AddHint(var, int(hint[i] == c))  # protobuf 5+ takes no bools
    found = []
    for fixing in fixings:
        model.ClearAssumptions()
        model.AddAssumptions([pick[i, c] for i, c in fixing.items()])
        # Thousands of small models a search: presolving them took half of a
        # Llama 3 405B search's 22 s, probing and symmetry detection 12% of
        # the rest, for the same plans.
        solver = cp_solver(time_limit_s, deadline, workers, presolve=False)
        status = status_of(solver.Solve(model)) if solver is not None else "timed out"
        if status not in ("optimal", "feasible"):
            found.append((None, status))
            continue
        solution = solver.ResponseProto().solution
        chosen = [next(c for c in options[i] if solution[pick[i, c].Index()]) for i in nodes]
        found.append((chosen, status))
    return found
