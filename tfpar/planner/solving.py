"""CP-SAT solves within a budget (no TensorFlow).

A solve on one worker is limited in CP-SAT's deterministic time, so the
stage ILP (Rhino §5) and the sharding segments (Rhino §4.3) give the same
answer whatever the machine's load; the search's remaining wall-clock time
(``deadline``) bounds it too, and none starts once it has passed. CP-SAT's
portfolio (several workers: O3) is not deterministic, so it is limited in
wall-clock time.

The searches say how they ended as ``ir.outcome.Outcome``s.

``add_linear`` and ``minimize`` write the linear constraints and objectives
of the models straight into their protos, as CP-SAT's expression API writes
them (``model.Add(low <= sum(c x) <= high)``, ``model.Minimize(sum(c x))``:
the last term first, terms of coefficient 0 left out): the same models, so
the same solutions, without the API's flattening of each expression in
Python, which took a third of a large model's search (the sharding
segments' thousands of small models, ``benchmarks/plan_scale.py``).
"""
import time
from typing import Optional, Sequence, Tuple

from ortools.sat.python import cp_model

__all__ = ["add_linear", "cp_solver", "left_s", "minimize", "status_of"]

Terms = Sequence[Tuple[int, cp_model.IntVar]]  # (coefficient, variable)


def left_s(deadline: Optional[float]) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value; None: none)."""
    return float("inf") if deadline is None else deadline - time.monotonic()


def cp_solver(limit_s: float, deadline: Optional[float] = None, workers: int = 1,
              presolve: bool = True) -> Optional[cp_model.CpSolver]:
    """A solver limited to ``limit_s`` (deterministic time on one worker,
    wall-clock on several) and to ``deadline``; None once it has passed.
    ``presolve``: CP-SAT's presolve, probing and symmetry detection (off for
    many small models, where they cost more than they save)."""
    left = left_s(deadline)
    if left <= 0:
        return None
    solver = cp_model.CpSolver()
    solver.parameters.num_search_workers = workers
    solver.parameters.cp_model_presolve = presolve
    if not presolve:
        solver.parameters.cp_model_probing_level = 0
        solver.parameters.symmetry_level = 0
    if workers == 1:
        solver.parameters.max_deterministic_time = limit_s
        if left != float("inf"):
            solver.parameters.max_time_in_seconds = left
    else:
        solver.parameters.max_time_in_seconds = min(limit_s, left)
    return solver


def status_of(code: int) -> str:
    """A CP-SAT status as "optimal", "feasible", "infeasible" or "timed out"
    (no solution found within the limits)."""
    return {cp_model.OPTIMAL: "optimal", cp_model.FEASIBLE: "feasible",
            cp_model.INFEASIBLE: "infeasible", cp_model.UNKNOWN: "timed out"}.get(
                code, "invalid model")


def add_linear(model: cp_model.CpModel, terms: Terms, low: int = cp_model.INT_MIN,
               high: int = cp_model.INT_MAX) -> None:
    """``low <= sum(coefficient x variable) <= high`` over ``terms``, as
    ``model.Add`` writes it (a constant sum: a constraint true or false)."""
    written = [(c, var) for c, var in reversed(terms) if c]
    if not written:
        model.Add(low <= 0 <= high)
        return
    linear = model.Proto().constraints.add().linear
    linear.vars.extend(var.Index() for _, var in written)
    linear.coeffs.extend(c for c, _ in written)
    linear.domain.extend((low, high))


def minimize(model: cp_model.CpModel, terms: Terms) -> None:
    """The objective sum(coefficient x variable) over ``terms``, minimised, as
    ``model.Minimize`` writes it."""
    objective = model.Proto().objective
    for c, var in reversed(terms):
        if c:
            objective.vars.append(var.Index())
            objective.coeffs.append(c)
    objective.scaling_factor = 1
