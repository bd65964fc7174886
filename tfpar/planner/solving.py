"""CP-SAT solves within a budget (no TensorFlow).

A solve on one worker is limited in CP-SAT's deterministic time, so the
stage ILP (Rhino §5) and the sharding segments (Rhino §4.3) give the same
answer whatever the machine's load; the search's remaining wall-clock time
(``deadline``) bounds it too, and none starts once it has passed. CP-SAT's
portfolio (several workers: O3) is not deterministic, so it is limited in
wall-clock time.

The searches say how they ended as ``ir.outcome.Outcome``s.
"""
import time
from typing import Optional

from ortools.sat.python import cp_model

__all__ = ["cp_solver", "left_s", "status_of"]


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
