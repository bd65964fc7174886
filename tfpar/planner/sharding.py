"""Automatic tensor sharding over a layer graph (Rhino §4, TAP §IV): the
search, no TensorFlow. Each layer's candidates and their costs:
``sharding_costs``.

Solvers:
  * ``O3``: the whole-graph ILP of Rhino §4.2 on OR-Tools CP-SAT
    (``sharding_ilp``): one 0-1 variable per (layer, candidate), one per
    (edge, candidate pair) tied to both ends, memory as a constraint.
  * ``O2``: Rhino §4.3: critical layers (no edge jumps over them) cut the
    graph into segments; dynamic programming over the critical layers'
    candidates stitches segments, each solved for every pair of end
    candidates (a chain by dynamic programming, else the ILP, whose unique
    optima variable elimination finds without CP-SAT: ``sharding_ilp``,
    ``elimination``). Segments with
    the same signature — the repeated blocks TAP's pruning finds (§IV-B/C) —
    are solved once and their plan reused, so planning grows with the number
    of distinct blocks, not layers. Memory: Rhino §4.4, the layers with the
    largest weights are forced to sharded candidates until the plan fits.
    O3 starts from O2's plan (a solver hint), so it never returns a worse one.

Each ILP solve gets ``time_limit_s`` (``solving.cp_solver``: deterministic
time on one worker, so segments are solved alike whatever the machine's
load) and none runs past the caller's ``deadline``: a segment left unsolved
takes its first candidates. The plan's ``outcome`` says whether it is
proved optimal and, if not, why (a time limit, or O2's memory heuristic).
"""
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.ir.outcome import Outcome
from tfpar.planner.layers import LayerGraph, critical_positions
from tfpar.planner.sharding_costs import SHARDED, Mesh, Problem, ShardingPlan
from tfpar.planner.sharding_ilp import solve_ilp
from tfpar.planner.solving import left_s

__all__ = ["critical_layers", "plan_sharding"]

SEGMENT_LIMIT_S = 10.0  # per ILP solve, by default
# O3: CP-SAT's portfolio; its LP- and core-based workers prove whole-graph
# optimality in about a second where one worker alone stalls past a few
# transformer layers (segments stay on one worker: small, deterministic).
WHOLE_GRAPH_WORKERS = 8


def plan_sharding(graph: LayerGraph, mesh: Mesh, memory_limit: float, opt_level: str = "O2",
                  time_limit_s: float = SEGMENT_LIMIT_S, split_only: bool = False,
                  gradients: bool = True, solved: Optional[Dict] = None,
                  activations: bool = True, split_heads: bool = False,
                  deadline: Optional[float] = None,
                  sequence_parallel: bool = False) -> Optional[ShardingPlan]:
    """The cheapest candidates for ``graph`` on ``mesh`` (None: nothing fits
    ``memory_limit``: with ``activations`` False, the weights, gradients and
    optimizer slots alone). O3 starts from the O2 plan (a solver hint) and
    tries to prove or beat it. ``time_limit_s``: each ILP solve's;
    ``deadline``: a ``time.monotonic()`` past which none runs.
    ``split_only``, ``gradients``, ``split_heads`` and
    ``sequence_parallel``: see ``Problem``;
    ``solved``: segments already solved (by an earlier call, e.g. another
    pipeline stage of the same mesh), updated with this call's."""
    problem = Problem(graph, mesh, split_only, gradients, activations, split_heads,
                      sequence_parallel)
    allowed = problem.allowed()
    forced = False
    solved = {} if solved is None else solved
    while True:
        chosen, segments = _segments_dp(problem, allowed, solved, time_limit_s, deadline)
        if problem.memory(chosen) <= memory_limit:
            break
        allowed = _force_largest_sharded(problem, allowed, chosen)
        if allowed is None:
            chosen = None
            break
        forced = True
    outcome = _o2_outcome(segments, forced)
    if opt_level == "O3":
        (found, status), = solve_ilp(problem, problem.allowed(), [{}], memory_limit,
                                     time_limit_s, hint=chosen, workers=WHOLE_GRAPH_WORKERS,
                                     deadline=deadline)
        if found is None and (status == "infeasible" or chosen is None):
            return None
        outcome = _o3_outcome(status, outcome)
        chosen = found or chosen
    elif chosen is None:
        return None
    return problem.plan(_follow_free_layers(problem, chosen), outcome.path == "optimal",
                        outcome)


def _o2_outcome(segments: str, forced: bool) -> Outcome:
    """How O2 ended: ``segments``, its worst segment's status; ``forced``:
    Rhino §4.4's memory heuristic ran."""
    method = "O2 segments"
    if segments != "optimal":
        what = ("stopped at their time limit" if segments == "feasible"
                else "ran out of time, and took their first candidates")
        return Outcome("feasible", method, f"segment ILPs {what}", timed_out=True)
    if forced:
        return Outcome("feasible", method, "memory forced the layers with the largest weights "
                       "to sharded candidates (Rhino §4.4), which O2 does not prove optimal; "
                       "auto.opt_level O3 solves it with memory as a constraint")
    return Outcome("optimal", method)


def _o3_outcome(status: str, o2: Outcome) -> Outcome:
    """How O3's whole-graph ILP ended (``o2``: the plan it started from)."""
    method = "O3 whole-graph ILP"
    if status == "optimal":
        return Outcome("optimal", method)
    if status == "feasible":
        return Outcome("feasible", method, "stopped at its time limit", timed_out=True)
    return dataclasses.replace(o2, why="the O3 ILP found nothing within its time limit: "
                               "O2's plan", timed_out=True)


def _follow_free_layers(problem: Problem, chosen: Sequence[str]) -> List[str]:
    """Layers whose every candidate is free (constants: no compute, weights or
    bytes in or out) take their first consumer's candidate, so they do not cut
    a run of split layers into several TaskGraphs. The costs do not change."""
    chosen = list(chosen)
    allowed = problem.allowed()
    consumers: Dict[int, List[int]] = {}
    for i, j, _ in problem.graph.edges:
        consumers.setdefault(i, []).append(j)
    for i in reversed(range(len(chosen))):
        layer = problem.graph.layers[i]
        free = not (layer.flops or layer.param_bytes or layer.activation_bytes
                    or layer.input_bytes or layer.out_bytes
                    or any(size for _, size in problem.preds[i]))
        follow = [chosen[j] for j in consumers.get(i, ()) if chosen[j] in allowed[i]]
        if free and follow:
            chosen[i] = follow[0]
    return chosen



def critical_layers(graph: LayerGraph) -> List[int]:
    """Layers every path from the first to the last passes (Rhino §4.3.1),
    through edges of some bytes per row: a batch-free tensor that every
    layer reads (a causal mask built once) costs nothing to reshard
    (``Problem.preds`` leaves it out), and would otherwise leave no critical
    layer between its first and last reader."""
    return critical_positions(len(graph.layers), [e for e in graph.edges if e[2]])


def _segments_dp(problem: Problem, allowed: Sequence[Tuple[str, ...]], cache: Dict,
                 time_limit_s: float, deadline: Optional[float]) -> Tuple[List[str], str]:
    """Rhino §4.3.2: DP over critical layers, segments between them solved once
    per signature (TAP's plan reuse) and kept in ``cache``. Returns the
    candidates and the worst status of a segment's solves: "optimal",
    "feasible" or "timed out" (a segment left unsolved)."""
    graph = problem.graph
    critical = critical_layers(graph)
    first = critical[0]
    best = {c: problem.node(first, c).seconds for c in allowed[first]}
    used, came_from = [], []  # per segment: its table, and end candidate -> start's
    for start, end in zip(critical, critical[1:]):
        key = _segment_key(problem, allowed, start, end)
        if key not in cache:
            cache[key] = _solve_segment(problem, allowed, start, end, time_limit_s, deadline)
        table = cache[key]
        used.append(table)
        step = {b: min(((cost + table[a, b][0], a) for a, cost in best.items()),
                       key=lambda x: x[0]) for b in allowed[end]}
        best = {b: cost for b, (cost, _) in step.items()}
        came_from.append({b: a for b, (_, a) in step.items()})
    statuses = {entry[2] for table in used for entry in table.values()}
    worst = next((s for s in ("timed out", "feasible") if s in statuses), "optimal")
    last = min(best, key=best.get)
    pieces = []
    for table, back in zip(reversed(used), reversed(came_from)):
        pieces.append(table[back[last], last][1])
        last = back[last]
    return [last] + [c for piece in reversed(pieces) for c in piece], worst


def _segment_key(problem: Problem, allowed, start: int, end: int) -> Tuple:
    layers = problem.graph.layers[start:end + 1]
    edges = tuple((i - start, j - start, size) for j in range(start + 1, end + 1)
                  for i, size in problem.preds[j])
    return (tuple(layer.identity for layer in layers), edges, tuple(allowed[start:end + 1]),
            tuple(problem.readers[start:end + 1]), problem.mesh, problem.split_only,
            problem.gradients, problem.sequence_parallel)


def _solve_segment(problem: Problem, allowed, start: int, end: int, time_limit_s: float,
                   deadline: Optional[float]):
    """(candidate of start, of end) -> (cost of the segment past ``start``,
    candidates of the layers after ``start``, "optimal", "feasible" or
    "timed out": its layers' first candidates, unsolved, as once the
    ``deadline`` has passed, when the ILP is not even built)."""
    inner = list(range(start + 1, end))
    chain = all(problem.preds[j] and [i for i, _ in problem.preds[j]] == [j - 1]
                for j in range(start + 1, end + 1))
    pairs = [(a, b) for a in allowed[start] for b in allowed[end]]
    if chain:
        solved = [(_chain_dp(problem, allowed, start, end, a, b), "optimal") for a, b in pairs]
    else:
        fixings = [{start: a, end: b} for a, b in pairs]
        found = (solve_ilp(problem, allowed, fixings, None, time_limit_s,
                           [start] + inner + [end], deadline=deadline) if left_s(deadline) > 0
                 else [(None, "timed out")] * len(pairs))
        solved = [(chosen[1:], status) if chosen else
                  ([allowed[k][0] for k in inner] + [b], "timed out")
                  for (chosen, status), (_, b) in zip(found, pairs)]
    table = {}
    for (a, b), (chosen, status) in zip(pairs, solved):
        candidate_of = dict(zip(range(start, end + 1), [a] + chosen))
        cost = sum(problem.layer_cost(j, candidate_of).seconds for j in range(start + 1, end + 1))
        table[a, b] = (cost, chosen, status)
    return table


def _chain_dp(problem: Problem, allowed, start: int, end: int, a: str, b: str) -> List[str]:
    """Candidates of layers start+1..end of a chain, start's and end's fixed."""
    size = {j: problem.preds[j][0][1] for j in range(start + 1, end + 1)}
    readers = {j: problem.readers[problem.preds[j][0][0]] for j in range(start + 1, end + 1)}
    best = {a: (0.0, [])}
    for j in range(start + 1, end + 1):
        options = (b,) if j == end else allowed[j]
        best = {c: min(((cost + problem.reshard(size[j], p, c, readers[j]).seconds
                         + problem.node(j, c).seconds, path + [c])
                        for p, (cost, path) in best.items()), key=lambda x: x[0])
                for c in options}
    return best[b][1]


def _force_largest_sharded(problem: Problem, allowed, chosen) -> Optional[List[Tuple[str, ...]]]:
    """Rhino §4.4: the layers with the largest weights not yet sharded (all of
    that size, so repeated blocks move together) may only be sharded; None when
    no such layer is left."""
    layers = problem.graph.layers
    open_ = {i for i, c in enumerate(chosen) if c not in SHARDED and layers[i].param_bytes
             and SHARDED & set(allowed[i])}
    if not open_:
        return None
    largest = max(layers[i].param_bytes for i in open_)
    return [tuple(c for c in options if c in SHARDED)
            if i in open_ and layers[i].param_bytes == largest else options
            for i, options in enumerate(allowed)]
