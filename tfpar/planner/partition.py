"""Cutting a model into pipeline stages when the user gives ``num_task_graph``
but no scopes (Whale Example 4); no TensorFlow.

``partition_stages``: the forward ops, in topological order, are coarsened into
contiguous chunks — runs of the same repeated block (``pruning.block_labels``,
TAP Algorithm 1; at most ``MAX_BLOCK_RUNS``) when given, so stages break
between blocks, else runs ending at Rhino's critical nodes (§4.3.1), at most
``MAX_NODES``, else equal runs;
the first whose chunks each cost no more than a stage may — and Rhino's stage
ILP (``pipeline_ilp``, Rhino §5; within the caller's time limit) assigns chunks to
stages, minimising the bytes crossing stages within a balance tolerance
(``SLACK`` above the most balanced contiguous cut's, so the slowest stage is
never slower than it must be); on chunks in a chain (a transformer's
blocks) ``chain_partition`` solves the same problem exactly by dynamic
programming. If the ILP finds nothing in time, ``balanced_partition`` cuts
the chunks (or, with fewer chunks than stages, the items) into contiguous
stages whose most expensive one is as cheap as possible
(the linear partition problem, solved exactly: binary search on the bottleneck
with a greedy check). Contiguity in a topological order keeps every edge
pointing to the same or a later stage. ``StageCut`` says which of these ran
and why.
"""
import collections
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

import networkx as nx

from tfpar.ir.outcome import Outcome
from tfpar.planner.layers import critical_positions
from tfpar.planner.pipeline_ilp import stage_ilp

__all__ = ["StageCut", "balanced_partition", "chain_partition", "partition_stages"]

MAX_NODES = 128
# Runs of blocks are kept up to this many (a 1T GPT has 128 blocks and two
# runs around them): cut elsewhere, stages would split blocks unevenly; a
# chain of them is cut by dynamic programming, not the ILP.
MAX_BLOCK_RUNS = 1024
EPSILON = 0.25  # stage imbalance tolerance of the ILP, at most
SLACK = 0.02  # ... above the most balanced contiguous cut's


@dataclasses.dataclass(frozen=True)
class StageCut:
    """The stage of each item, and how it was found (``ir.outcome.Outcome``:
    "optimal" by the chain's DP or the proved ILP, "feasible" when the ILP
    stopped at its time limit, "balanced cut" otherwise - saying why)."""

    stages: List[int]
    outcome: Outcome


def partition_stages(costs: Sequence[float], edges: Sequence[Tuple[int, int, float]],
                     num_stages: int, time_limit_s: float,
                     labels: Optional[Sequence[Optional[str]]] = None,
                     deadline: Optional[float] = None) -> StageCut:
    """The stages of items (``costs`` in topological order; ``edges`` (i, j,
    bytes) between items, i < j; ``labels`` an optional block per item).
    ``time_limit_s``: the stage ILP's (deterministic); ``deadline``: a
    ``time.monotonic()`` past which the ILP does not run."""
    if not costs:
        return StageCut([], Outcome("optimal", "nothing to cut"))
    chunk = _chunks(costs, labels, edges, num_stages)
    dag = _chunk_dag(costs, edges, chunk)
    chunk_costs = [dag.nodes[c]["comp"] for c in sorted(dag)]
    by_chunk = balanced_partition(chunk_costs, num_stages)
    tolerance = _tolerance(chunk_costs, by_chunk, num_stages)
    balanced = "balanced partition"
    if dag.number_of_nodes() < num_stages:
        return StageCut(balanced_partition(costs, num_stages), Outcome(
            "balanced cut", balanced, f"{dag.number_of_nodes()} chunks for {num_stages} "
            "stages, too few for the stage ILP"))
    if _is_chain(dag):
        exact = chain_partition(chunk_costs, [dag.edges[c, c + 1]["bytes"]
                                              for c in sorted(dag)[:-1]], num_stages,
                                (1 + tolerance) * sum(chunk_costs) / num_stages)
        if exact is None:
            return _cut(by_chunk, chunk, Outcome("balanced cut", balanced,
                                                  "no chain cut within the balance tolerance"))
        return _cut(exact, chunk, Outcome("optimal", "chain DP"))
    solved = stage_ilp(dag, num_stages, tolerance, time_limit_s, deadline,
                       hint=dict(zip(sorted(dag), by_chunk)))
    limit = f"its time limit ({time_limit_s:.3g} s of CP-SAT's deterministic time)"
    if solved.stages is not None:
        why = "" if solved.status == "optimal" else f"stopped at {limit}"
        return _cut([solved.stages[c] for c in sorted(dag)], chunk,
                    Outcome(solved.status, "stage ILP", why, timed_out=bool(why)))
    timed_out = solved.status == "timed out"
    why = (f"the stage ILP found no assignment within {limit}" if timed_out else
           "the stage ILP has no assignment within the balance tolerance")
    return _cut(by_chunk, chunk, Outcome("balanced cut", balanced, why, timed_out))


def _chunk_dag(costs: Sequence[float], edges: Sequence[Tuple[int, int, float]],
               chunk: Sequence[int]) -> nx.DiGraph:
    """The chunks as nodes (``comp``: their items' costs) and the bytes
    between them as edges (``bytes``)."""
    comp: Dict[int, float] = collections.defaultdict(float)
    for c, cost in zip(chunk, costs):
        comp[c] += cost
    sent: Dict[Tuple[int, int], float] = collections.defaultdict(float)
    for i, j, volume in edges:
        if chunk[i] != chunk[j]:
            sent[chunk[i], chunk[j]] += volume
    dag = nx.DiGraph()
    dag.add_nodes_from((c, {"comp": cost}) for c, cost in comp.items())
    dag.add_edges_from((a, b, {"bytes": volume}) for (a, b), volume in sent.items())
    return dag


def _cut(by_chunk: Sequence[int], chunk: Sequence[int], outcome: Outcome) -> StageCut:
    """Items' stages from their chunks' (chunks are numbered 0, 1, ...)."""
    return StageCut([by_chunk[c] for c in chunk], outcome)


def _is_chain(dag: nx.DiGraph) -> bool:
    """Whether chunk k sends only to chunk k + 1 (a transformer's blocks)."""
    order = sorted(dag)
    return dag.number_of_edges() == len(order) - 1 and all(
        dag.has_edge(a, b) for a, b in zip(order, order[1:]))


def chain_partition(costs: Sequence[float], cut_bytes: Sequence[float], num_stages: int,
                     capacity: float) -> Optional[List[int]]:
    """The stage ILP's answer on a chain, exactly and fast: the contiguous
    stages (each at most ``capacity``) whose cuts send the fewest bytes
    (``cut_bytes[k]``: between chunks k and k + 1), by dynamic programming
    over (stages, chunks); None when none fits."""
    count = len(costs)
    prefix = [0.0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)
    limit = capacity * (1 + 1e-9)
    inf = float("inf")
    best = [[inf] * (count + 1) for _ in range(num_stages + 1)]
    start = [[0] * (count + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for stage in range(1, num_stages + 1):
        for end in range(stage, count - (num_stages - stage) + 1):
            sent = cut_bytes[end - 1] if end < count else 0.0
            first = end - 1
            while first >= stage - 1 and prefix[end] - prefix[first] <= limit:
                if best[stage - 1][first] + sent < best[stage][end]:
                    best[stage][end] = best[stage - 1][first] + sent
                    start[stage][end] = first
                first -= 1
    if best[num_stages][count] == inf:
        return None
    stages, end = [0] * count, count
    for stage in range(num_stages, 0, -1):
        first = start[stage][end]
        stages[first:end] = [stage - 1] * (end - first)
        end = first
    return stages


def _tolerance(costs: Sequence[float], stages: Sequence[int], num_stages: int) -> float:
    """The ILP's imbalance tolerance: ``SLACK`` above the most balanced
    contiguous cut's (``stages``), at most ``EPSILON``. Rhino's objective
    (fewest bytes crossing stages) then never buys a slower stage than
    needed: in a chain of equal blocks every cut sends the same bytes, and
    the slowest stage sets a pipeline's pace."""
    loads = [0.0] * (max(stages) + 1)
    for stage, cost in zip(stages, costs):
        loads[stage] += cost
    even = sum(costs) / num_stages
    return min(EPSILON, max(loads) / even - 1 + SLACK) if even > 0 else EPSILON


def _chunks(costs: Sequence[float], labels: Optional[Sequence[Optional[str]]],
            edges: Sequence[Tuple[int, int, float]], num_stages: int) -> List[int]:
    """Chunk of each item, the first of these whose chunks each cost no more
    than a stage may (``_balanceable``): runs of equal labels (items outside
    blocks run together); runs ending at critical items (no edge jumps over
    them, Rhino §4.3.1: cutting there cuts one tensor), merged to at most
    ``MAX_NODES``; equal runs (always)."""
    count = len(costs)
    if labels is not None and any(labels):
        chunk = _runs(count, {i for i in range(1, count) if labels[i] != labels[i - 1]})
        if 1 < chunk[-1] + 1 <= MAX_BLOCK_RUNS and _balanceable(costs, chunk, num_stages):
            return chunk
    ends = critical_positions(count, edges)
    if len(ends) > 2:
        per_chunk = math.ceil(len(ends) / MAX_NODES)
        chunk = _runs(count, {end + 1 for end in ends[per_chunk - 1::per_chunk]})
        if _balanceable(costs, chunk, num_stages):
            return chunk
    size = math.ceil(count / MAX_NODES)
    return [i // size for i in range(count)]


def _balanceable(costs: Sequence[float], chunk: Sequence[int], num_stages: int) -> bool:
    """Whether no chunk costs more than a stage may (an even share within
    ``EPSILON``): a model whose blocks form one chunk (a ResNet's units,
    labelled alike, between inputs that feed its end) is cut inside it,
    not into empty stages."""
    totals = [0.0] * (chunk[-1] + 1)
    for c, cost in zip(chunk, costs):
        totals[c] += cost
    return max(totals) <= (1 + EPSILON) * sum(costs) / num_stages


def _runs(count: int, starts) -> List[int]:
    """Run number of each of ``count`` items, a new run at every item in ``starts``."""
    chunk, current = [], 0
    for i in range(count):
        current += i in starts
        chunk.append(current)
    return chunk


def balanced_partition(costs: Sequence[float], num_stages: int) -> List[int]:
    """The stage of each item; stages are contiguous, non-empty when there are
    enough items, and minimise the largest stage cost."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {num_stages}")
    if not costs:
        return []
    low, high = max(costs), float(sum(costs))
    for _ in range(100):  # the bottleneck is a segment sum: converge on it
        middle = (low + high) / 2
        if _stages_needed(costs, middle) <= num_stages:
            high = middle
        else:
            low = middle
    stages = _greedy(costs, high)
    return _fill_to(stages, min(num_stages, len(costs)))


def _stages_needed(costs: Sequence[float], bound: float) -> int:
    return _greedy(costs, bound)[-1] + 1


def _greedy(costs: Sequence[float], bound: float) -> List[int]:
    stages, stage, total = [], 0, 0.0
    for cost in costs:
        if total + cost > bound * (1 + 1e-12) and total > 0:
            stage, total = stage + 1, 0.0
        stages.append(stage)
        total += cost
    return stages


def _fill_to(stages: List[int], wanted: int) -> List[int]:
    """Split the stages with the most items until there are ``wanted`` (cutting
    a stage never raises the bottleneck)."""
    while stages[-1] + 1 < wanted:
        counts = [stages.count(s) for s in range(stages[-1] + 1)]
        widest = max(range(len(counts)), key=counts.__getitem__)
        first = stages.index(widest)
        cut = first + counts[widest] // 2
        stages = stages[:cut] + [s + 1 for s in stages[cut:]]
    return stages
