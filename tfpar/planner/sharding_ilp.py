"""Rhino §4.2's integer program of a layer graph's sharding on OR-Tools CP-SAT:
a 0-1 variable per (layer, candidate), one per (edge, candidate pair) tied to
both ends, memory as a constraint (no TensorFlow)."""
from typing import Dict, List, Optional, Sequence, Tuple

from ortools.sat.python import cp_model

from tfpar.planner.sharding_costs import Problem
from tfpar.planner.solving import add_linear, cp_solver, minimize, status_of

__all__ = ["solve_ilp"]

_RESOLUTION = 1e6  # CP-SAT integer steps per largest cost


def solve_ilp(problem: Problem, allowed: Sequence[Tuple[str, ...]],
              fixings: Sequence[Dict[int, str]], memory_limit: Optional[float],
              time_limit_s: float, nodes: Optional[Sequence[int]] = None,
              hint: Optional[Sequence[str]] = None, workers: int = 1,
              deadline: Optional[float] = None) -> List[Tuple[Optional[List[str]], str]]:
    """Rhino §4.2 over ``nodes`` (all layers when None; edges among them),
    built once and solved once per fixing (the candidates of some layers,
    given as solver assumptions) within ``time_limit_s`` each and
    ``deadline``; ``hint`` (a candidate per layer) is where the solver
    starts; ``workers`` CP-SAT search workers. Returns per fixing (candidate
    per layer of ``nodes``, or None) and its ``solving.status_of``."""
    nodes = list(range(len(allowed))) if nodes is None else list(nodes)
    inside = set(nodes)
    options = {i: allowed[i] for i in nodes}
    edges = [(i, j, size) for j in nodes for i, size in problem.preds[j] if i in inside]
    node_cost = {(i, c): problem.node(i, c).seconds for i in nodes for c in options[i]}
    edge_cost = {(e, a, b): problem.reshard(size, a, b, problem.readers[i]).seconds
                 for e, (i, j, size) in enumerate(edges) for a in options[i] for b in options[j]}
    unit = max(list(node_cost.values()) + list(edge_cost.values()) + [1e-30]) / _RESOLUTION
    model = cp_model.CpModel()
    pick = {(i, c): model.NewBoolVar(f"x{i}_{c}") for i in nodes for c in options[i]}
    for i in nodes:
        model.AddExactlyOne(pick[i, c] for c in options[i])
    objective = [(round(cost / unit), pick[key]) for key, cost in node_cost.items()]
    for e, (i, j, _) in enumerate(edges):
        pair = {(a, b): model.NewBoolVar(f"y{e}_{a}_{b}") for a in options[i] for b in options[j]}
        for a in options[i]:  # sum_b pair[a, b] == pick[i, a]
            add_linear(model, [(1, pair[a, b]) for b in options[j]] + [(-1, pick[i, a])], 0, 0)
        for b in options[j]:
            add_linear(model, [(1, pair[a, b]) for a in options[i]] + [(-1, pick[j, b])], 0, 0)
        objective += [(round(edge_cost[e, a, b] / unit), var) for (a, b), var in pair.items()]
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

