"""Automatic tensor sharding over a layer graph (Rhino §4, TAP §IV), no TensorFlow.

Mesh: ``devices`` = data x tensor. Every layer picks one candidate (Rhino
§4.2); a candidate reads its input in one layout and writes its output in one:
``B`` rows split over all devices (data parallel), ``W`` whole rows of a
tensor group (replicated over its t devices), ``F`` features split over the
group. Candidates by kind:

  ============  ======  ======  ===========================================
  candidate     input   output  cost besides compute
  ============  ======  ======  ===========================================
  dp            B       B       weights all-reduced over all devices
  column        W       F       weights / t, all-reduced over d
  row           F       W       weights / t; output partial sums all-reduced
  whole         W       W       compute repeated on the t devices
  shards        F       F       elementwise on the shards
  xent          F       W       per-row max and sum all-reduced over t
  vocab         W       W       table rows / t; looked-up rows all-reduced
  heads         F       F       an attention core's op on the group's heads
  ============  ======  ======  ===========================================

``heads`` (``layers.attention_layers``; only with ``split_heads``) reads
``F`` as Megatron does: a column-split Q K V projection gives each device
the Q, K and V columns of its heads (their order in the weight is the
runtime's concern), so the core runs on a group's heads with no collective
and hands the row-split output projection its heads' features.

Resharding an edge costs an all-gather (``B``->``W``, ``F``->``W``) forward and
its transpose backward (Megatron's f / g operators for ``W``->``F``). Step time
is the sum (Rhino's objective); memory per device is weights x4 (weights,
gradients, two optimizer slots) plus the activations kept for backward.

Solvers:
  * ``O3``: the whole-graph ILP of Rhino §4.2 on OR-Tools CP-SAT: one 0-1
    variable per (layer, candidate), one per (edge, candidate pair) tied to
    both ends, memory as a constraint.
  * ``O2``: Rhino §4.3: critical layers (no edge jumps over them) cut the
    graph into segments; dynamic programming over the critical layers'
    candidates stitches segments, each solved for every pair of end
    candidates (a chain by dynamic programming, else the ILP). Segments with
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

from ortools.sat.python import cp_model

from tfpar.cluster.hardware import Hardware
from tfpar.ir.outcome import Outcome
from tfpar.planner.comm import Cost, allgather, allreduce, allreduce_latency
from tfpar.planner.layers import LayerGraph, critical_positions
from tfpar.planner.solving import cp_solver, left_s, status_of

__all__ = ["CANDIDATES", "Mesh", "Problem", "ShardingPlan", "critical_layers", "plan_sharding"]

LAYOUTS = {"dp": ("B", "B"), "column": ("W", "F"), "row": ("F", "W"), "whole": ("W", "W"),
           "shards": ("F", "F"), "xent": ("F", "W"), "vocab": ("W", "W"), "heads": ("F", "F")}
CANDIDATES = {"matmul": ("dp", "column", "row"), "xent": ("dp", "whole", "xent"),
              "elementwise": ("dp", "whole", "shards"), "other": ("dp", "whole"),
              "embedding": ("dp", "whole", "vocab"), "attention": ("dp", "whole", "heads")}
SHARDED = frozenset({"column", "row", "vocab"})  # weights split over the tensor group
STATE_BYTES = 4  # weights, gradients and two optimizer slots per parameter byte
_RESOLUTION = 1e6  # CP-SAT integer steps per largest cost
SEGMENT_LIMIT_S = 10.0  # per ILP solve, by default
# O3: CP-SAT's portfolio; its LP- and core-based workers prove whole-graph
# optimality in about a second where one worker alone stalls past a few
# transformer layers (segments stay on one worker: small, deterministic).
WHOLE_GRAPH_WORKERS = 8


@dataclasses.dataclass(frozen=True)
class Mesh:
    """``devices`` = data x ``tensor``; the global batch, the device type and
    the compute dtype (``hardware.DTYPES``)."""

    devices: int
    tensor: int
    batch: float
    hardware: Hardware
    dtype: str = "fp32"

    @property
    def data(self) -> int:
        return self.devices // self.tensor

    @property
    def group_bandwidth(self) -> float:
        """Within a tensor group (consecutive devices)."""
        return self.hardware.bandwidth(self.tensor)

    @property
    def replica_bandwidth(self) -> float:
        """Among data-parallel replicas (``tensor`` apart)."""
        return self.hardware.bandwidth(self.data, self.tensor)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Candidate per layer and the estimates (whole step and per layer);
    ``optimal`` when the solver proved it, ``outcome`` how it was found."""

    candidates: Tuple[str, ...]
    step_time_s: float
    memory_bytes: float
    comm_bytes: float
    optimal: bool
    layer_costs: Tuple[Cost, ...] = ()
    layer_memory: Tuple[float, ...] = ()
    weight_memory: float = 0.0
    outcome: Optional[Outcome] = None


def plan_sharding(graph: LayerGraph, mesh: Mesh, memory_limit: float, opt_level: str = "O2",
                  time_limit_s: float = SEGMENT_LIMIT_S, split_only: bool = False,
                  gradients: bool = True, solved: Optional[Dict] = None,
                  activations: bool = True, split_heads: bool = False,
                  deadline: Optional[float] = None) -> Optional[ShardingPlan]:
    """The cheapest candidates for ``graph`` on ``mesh`` (None: nothing fits
    ``memory_limit``: with ``activations`` False, the weights, gradients and
    optimizer slots alone). O3 starts from the O2 plan (a solver hint) and
    tries to prove or beat it. ``time_limit_s``: each ILP solve's;
    ``deadline``: a ``time.monotonic()`` past which none runs.
    ``split_only``, ``gradients`` and ``split_heads``: see ``Problem``;
    ``solved``: segments already solved (by an earlier call, e.g. another
    pipeline stage of the same mesh), updated with this call's."""
    problem = Problem(graph, mesh, split_only, gradients, activations, split_heads)
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
        (found, status), = _ilp(problem, problem.allowed(), [{}], memory_limit, time_limit_s,
                                hint=chosen, workers=WHOLE_GRAPH_WORKERS, deadline=deadline)
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


def _follow_free_layers(problem: "Problem", chosen: Sequence[str]) -> List[str]:
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


class Problem:
    """Costs of one layer graph on one mesh; ``split_only``: every layer runs in
    a split TaskGraph (a pipeline stage of a 3-D mesh), so no ``dp``;
    ``gradients``: count the gradient all-reduces (a pipeline stage's, once
    per step, are counted by its caller); ``limit_activations``: whether the
    memory limit counts activations (else weights, gradients and slots);
    ``split_heads``: attention cores may run on a group's heads (``heads``)."""

    def __init__(self, graph: LayerGraph, mesh: Mesh, split_only: bool = False,
                 gradients: bool = True, limit_activations: bool = True,
                 split_heads: bool = False):
        self.graph, self.mesh = graph, mesh
        self.split_only, self.gradients = split_only, gradients
        self.limit_activations, self.split_heads = limit_activations, split_heads
        self.rows_device = mesh.batch / mesh.devices
        self.rows_group = mesh.batch / mesh.data
        self.preds: List[List[Tuple[int, float]]] = [[] for _ in graph.layers]
        for i, j, size in graph.edges:
            self.preds[j].append((i, size))
        # Costs depend on a layer's identity, not its position: a model's
        # repeated blocks are costed once (``layer_cost``, ``memory_of``).
        self.klass = graph.classes
        self._nodes: Dict[Tuple, Cost] = {}
        self._costs: Dict[Tuple, Cost] = {}
        self._memory: Dict[Tuple, float] = {}

    def allowed(self) -> List[Tuple[str, ...]]:
        if self.mesh.tensor == 1:
            return [("dp",)] * len(self.graph.layers)
        allowed = [CANDIDATES[layer.kind] if layer.kind != "elementwise" or not layer.param_bytes
                   else ("dp", "whole") for layer in self.graph.layers]
        if not self.split_heads:
            allowed = [tuple(c for c in options if c != "heads") for options in allowed]
        return [options[1:] for options in allowed] if self.split_only else allowed

    def rows(self, candidate: str, kept: bool = False) -> float:
        """Rows per device a layer with ``candidate`` computes on or, ``kept``,
        keeps outputs of (row and vocab keep whole rows of partial sums)."""
        if candidate == "dp":
            return self.rows_device
        if candidate == "whole" or kept and candidate in ("row", "vocab"):
            return self.rows_group
        return self.rows_group / self.mesh.tensor

    def node(self, i: int, candidate: str) -> Cost:
        """Compute (forward + backward = 3 x forward) and communication of layer i."""
        key = (self.klass[i], candidate)
        if key not in self._nodes:
            self._nodes[key] = self._node(i, candidate)
        return self._nodes[key]

    def _node(self, i: int, candidate: str) -> Cost:
        layer, mesh = self.graph.layers[i], self.mesh
        t, bandwidth = mesh.tensor, mesh.group_bandwidth
        compute = Cost(3 * layer.flops * self.rows(candidate)
                       / mesh.hardware.flops_per_s(mesh.dtype))
        if not self.gradients:
            grads = Cost()
        elif candidate in SHARDED:
            grads = allreduce(mesh.data, layer.param_bytes / t, mesh.replica_bandwidth,
                              latency=False)
        else:
            grads = allreduce(mesh.devices, layer.param_bytes,
                              mesh.hardware.bandwidth(mesh.devices), latency=False)
        # The model's inputs arrive split by rows (data parallelism feeds them);
        # a split layer gathers them (labels and ids are never feature-split).
        extra = self.edge(layer.input_bytes, "B", "B" if candidate == "dp" else "W")
        if candidate in ("row", "vocab"):  # partial sums of whole rows
            extra += allreduce(t, layer.out_bytes * self.rows_group, bandwidth)
        elif candidate == "xent":
            extra += allreduce(t, 8 * self.rows_group, bandwidth) * 2
        return compute + grads + extra

    def compute_seconds(self, chosen: Sequence[str]) -> float:
        """Forward and backward compute of the layers as ``chosen`` (no collectives)."""
        speed = self.mesh.hardware.flops_per_s(self.mesh.dtype)
        return sum(3 * layer.flops * self.rows(c) for layer, c in zip(self.graph.layers, chosen)
                   ) / speed

    def edge(self, size: float, out_layout: str, in_layout: str) -> Cost:
        """Resharding ``size`` bytes per row, forward and backward."""
        if out_layout == in_layout or not size:
            return Cost()
        if "W" not in (out_layout, in_layout):  # through whole rows
            return self.edge(size, out_layout, "W") + self.edge(size, "W", in_layout)
        t, total, bandwidth = self.mesh.tensor, size * self.rows_group, self.mesh.group_bandwidth
        gather = allgather(t, total, bandwidth)
        return {("B", "W"): gather * 2, ("W", "B"): gather, ("F", "W"): gather,
                ("W", "F"): allreduce(t, total, bandwidth)}[out_layout, in_layout]

    def memory_of(self, i: int, candidate: str, activations: bool = True) -> float:
        key = (self.klass[i], candidate, activations)
        if key not in self._memory:
            self._memory[key] = self._layer_memory(i, candidate, activations)
        return self._memory[key]

    def _layer_memory(self, i: int, candidate: str, activations: bool) -> float:
        layer, t = self.graph.layers[i], self.mesh.tensor
        weights = layer.param_bytes / (t if candidate in SHARDED else 1)
        if not activations:
            return STATE_BYTES * weights
        return STATE_BYTES * weights + layer.activation_bytes * self.rows(candidate, kept=True)

    def memory(self, chosen: Sequence[str]) -> float:
        """Bytes per device the memory limit applies to."""
        return sum(self.memory_of(i, c, self.limit_activations) for i, c in enumerate(chosen))

    def reshard(self, size: float, producer: str, consumer: str) -> Cost:
        """The edge between a layer with candidate ``producer`` and one with ``consumer``."""
        return self.edge(size, LAYOUTS[producer][1], LAYOUTS[consumer][0])

    def layer_cost(self, j: int, candidate_of) -> Cost:
        """Layer j's cost with the resharding of its inputs (``candidate_of``:
        layer -> candidate, for j and its producers)."""
        mine = candidate_of[j]
        inputs = tuple((size, candidate_of[i]) for i, size in self.preds[j])
        key = (self.klass[j], mine, inputs)
        if key not in self._costs:
            self._costs[key] = sum((self.reshard(size, theirs, mine) for size, theirs in inputs),
                                   self.node(j, mine))
        return self._costs[key]

    def layer_costs(self, chosen: Sequence[str]) -> List[Cost]:
        return [self.layer_cost(j, chosen) for j in range(len(chosen))]

    def objective(self, chosen: Sequence[str]) -> Cost:
        """What the solvers minimise: layers' costs plus resharding edges."""
        return _sum_costs(self.layer_costs(chosen))

    def _bucket_latency(self, chosen: Sequence[str]) -> Cost:
        """Gradients go in fused buckets: one latency per all-reduce group."""
        mesh, latency = self.mesh, 0.0
        if not self.gradients:
            return Cost()
        if any(c not in SHARDED and self.graph.layers[i].param_bytes for i, c in enumerate(chosen)):
            latency += allreduce_latency(mesh.devices)
        if any(c in SHARDED for c in chosen):
            latency += allreduce_latency(mesh.data)
        return Cost(latency)

    def plan(self, chosen: Sequence[str], optimal: bool,
             outcome: Optional[Outcome] = None) -> ShardingPlan:
        costs = self.layer_costs(chosen)
        step = _sum_costs(costs) + self._bucket_latency(chosen)
        memory = [self.memory_of(i, c) for i, c in enumerate(chosen)]
        weights = sum(self.memory_of(i, c, activations=False) for i, c in enumerate(chosen))
        return ShardingPlan(tuple(chosen), step.seconds, sum(memory), step.bytes, optimal,
                            tuple(costs), tuple(memory), weights, outcome)


def _sum_costs(costs: Sequence[Cost]) -> Cost:
    """The sum of ``costs`` (summed field by field: they are many)."""
    return Cost(*map(sum, zip(*costs))) if costs else Cost()


def _ilp(problem: Problem, allowed: Sequence[Tuple[str, ...]], fixings: Sequence[Dict[int, str]],
         memory_limit: Optional[float], time_limit_s: float,
         nodes: Optional[Sequence[int]] = None, hint: Optional[Sequence[str]] = None,
         workers: int = 1, deadline: Optional[float] = None
         ) -> List[Tuple[Optional[List[str]], str]]:
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
    edge_cost = {(e, a, b): problem.reshard(size, a, b).seconds
                 for e, (i, j, size) in enumerate(edges) for a in options[i] for b in options[j]}
    unit = max(list(node_cost.values()) + list(edge_cost.values()) + [1e-30]) / _RESOLUTION
    model = cp_model.CpModel()
    pick = {(i, c): model.NewBoolVar(f"x{i}_{c}") for i in nodes for c in options[i]}
    for i in nodes:
        model.AddExactlyOne(pick[i, c] for c in options[i])
    objective = [round(cost / unit) * pick[key] for key, cost in node_cost.items()]
    for e, (i, j, _) in enumerate(edges):
        pair = {(a, b): model.NewBoolVar(f"y{e}_{a}_{b}") for a in options[i] for b in options[j]}
        for a in options[i]:
            model.Add(sum(pair[a, b] for b in options[j]) == pick[i, a])
        for b in options[j]:
            model.Add(sum(pair[a, b] for a in options[i]) == pick[j, b])
        objective += [round(edge_cost[e, a, b] / unit) * var for (a, b), var in pair.items()]
    if memory_limit is not None:
        memory = {key: problem.memory_of(*key, problem.limit_activations) for key in pick}
        scale = max(max(memory.values(), default=0.0), memory_limit, 1.0) / _RESOLUTION
        model.Add(sum(int(memory[key] / scale) * var for key, var in pick.items())
                  <= int(memory_limit / scale))
    model.Minimize(sum(objective))
    if hint is not None:
        for (i, c), var in pick.items():
            model.AddHint(var, hint[i] == c)
    found = []
    for fixing in fixings:
        model.ClearAssumptions()
        model.AddAssumptions([pick[i, c] for i, c in fixing.items()])
        solver = cp_solver(time_limit_s, deadline, workers)
        status = status_of(solver.Solve(model)) if solver is not None else "timed out"
        if status not in ("optimal", "feasible"):
            found.append((None, status))
            continue
        chosen = [next(c for c in options[i] if solver.Value(pick[i, c])) for i in nodes]
        found.append((chosen, status))
    return found


def critical_layers(graph: LayerGraph) -> List[int]:
    """Layers every path from the first to the last passes (Rhino §4.3.1)."""
    return critical_positions(len(graph.layers), graph.edges)


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
            problem.mesh, problem.split_only, problem.gradients)


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
        found = (_ilp(problem, allowed, fixings, None, time_limit_s, [start] + inner + [end],
                      deadline=deadline) if left_s(deadline) > 0
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
    best = {a: (0.0, [])}
    for j in range(start + 1, end + 1):
        options = (b,) if j == end else allowed[j]
        best = {c: min(((cost + problem.reshard(size[j], p, c).seconds
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
