"""The cost model of tensor sharding over a layer graph (Rhino §4, TAP §IV), no TensorFlow.

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

``heads`` (``layers.attention_layers``; with ``split_heads``, or in a keras
MultiHeadAttention of at least t heads, which tfpar builds so:
``Layer.heads``) reads
``F`` as Megatron does: a column-split Q K V projection gives each device
the Q, K and V columns of its heads (their order in the weight is the
runtime's concern), so the core runs on a group's heads with no collective
and hands the row-split output projection its heads' features.

Resharding an edge (``Problem.edge``) costs its move forward and its
gradient's move back: an all-gather into ``W`` (from ``B`` or ``F``), a slice
out of ``W`` (free), both between ``B`` and ``F``. A ``column`` layer's input
gradient is a sum of the group's partial products: all-reduced back to a
``W`` producer (Megatron's f operator; Shoeybi et al. 2019, §3), reduce-
scattered back to a ``B`` or ``F`` one, once per producer: its column
readers sum their partials first (Q, K and V reading one layer norm), so
each edge carries its share (exact when every reader of the producer is a
``column`` layer). Likewise a producer's forward all-gather is made once
and read by all its readers: each edge carries its share (exact when
every reader gathers). With the ``row`` all-reduce (g), a Megatron transformer
layer costs its four all-reduces per step. Step time
is the sum (Rhino's objective); memory per device is weights x4 (weights,
gradients, two optimizer slots) plus the activations kept for backward.

Sequence parallelism (``Problem.sequence_parallel``; Korthikanti et al. 2022,
§4.2.2) keeps 1/t of what a tensor group otherwise keeps whole on each of
its t devices between a row-parallel output and the next column-parallel
input (``Problem.sliced``, the regions the rewrite slices): the kept output
of a ``row`` layer, and of every ``whole`` elementwise or ``other`` layer
(layer norms, dropout, residual adds) one of whose inputs is so kept (the
model does not tell a layer with a sequence axis from one without), and
those ``whole`` layers compute on their slice. A region does not cross into
a pipeline stage: the stage receives whole rows. Its communication is the
``row`` all-reduce's: a reduce-scatter and an all-gather move the same
bytes. The search, choosing layers one at a time, assumes every such layer
is in a region (``may_slice``); the plan's estimates count the regions.
"""
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.ir.outcome import Outcome
from tfpar.planner.comm import Cost, allgather, allreduce, allreduce_latency
from tfpar.planner.layers import LayerGraph

__all__ = ["CANDIDATES", "LAYOUTS", "Mesh", "Problem", "SHARDED",
           "ShardingPlan"]

LAYOUTS = {"dp": ("B", "B"), "column": ("W", "F"), "row": ("F", "W"), "whole": ("W", "W"),
           "shards": ("F", "F"), "xent": ("F", "W"), "vocab": ("W", "W"), "heads": ("F", "F")}
CANDIDATES = {"matmul": ("dp", "column", "row"), "xent": ("dp", "whole", "xent"),
              "elementwise": ("dp", "whole", "shards"), "other": ("dp", "whole"),
              "embedding": ("dp", "whole", "vocab"), "attention": ("dp", "whole", "heads")}
SHARDED = frozenset({"column", "row", "vocab"})  # weights split over the tensor group


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
    """Candidate per layer and the estimates (whole step and per layer; of
    its bytes, ``layer_weights`` those of weights, gradients and optimizer
    slots); ``optimal`` when the solver proved it, ``outcome`` how it was found."""

    candidates: Tuple[str, ...]
    step_time_s: float
    memory_bytes: float
    comm_bytes: float
    optimal: bool
    layer_costs: Tuple[Cost, ...] = ()
    layer_memory: Tuple[float, ...] = ()
    weight_memory: float = 0.0
    outcome: Optional[Outcome] = None
    layer_weights: Tuple[float, ...] = ()



class Problem:
    """Costs of one layer graph on one mesh; ``split_only``: every layer runs in
    a split TaskGraph (a pipeline stage of a 3-D mesh), so no ``dp``;
    ``gradients``: count the gradient all-reduces (a pipeline stage's, once
    per step, are counted by its caller); ``limit_activations``: whether the
    memory limit counts activations (else weights, gradients and slots);
    ``split_heads``: attention cores may run on a group's heads (``heads``);
    ``sequence_parallel``: the module docstring's."""

    def __init__(self, graph: LayerGraph, mesh: Mesh, split_only: bool = False,
                 gradients: bool = True, limit_activations: bool = True,
                 split_heads: bool = False, sequence_parallel: bool = False):
        self.graph, self.mesh = graph, mesh
        self.sequence_parallel = sequence_parallel
        self.split_only, self.gradients = split_only, gradients
        self.limit_activations, self.split_heads = limit_activations, split_heads
        self.rows_device = mesh.batch / mesh.devices
        self.rows_group = mesh.batch / mesh.data
        # Edges of no bytes per row (batch-free tensors: masks, position
        # ranges) cost nothing whatever the layouts (``edge``): left out, so
        # they tie no segment of the search to another (``critical_positions``).
        self.preds: List[List[Tuple[int, float]]] = [[] for _ in graph.layers]
        self.readers = [0] * len(graph.layers)
        for i, j, size in graph.edges:
            if size:
                self.preds[j].append((i, size))
                self.readers[i] += 1
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
        allowed = [options if self._by_heads(layer) else tuple(c for c in options if c != "heads")
                   for options, layer in zip(allowed, self.graph.layers)]
        return [options[1:] for options in allowed] if self.split_only else allowed

    def _by_heads(self, layer) -> bool:
        """Whether tfpar's split builds ``layer``'s core by heads on this
        mesh: a keras MultiHeadAttention of at least one head per device;
        raw ops (``split_heads``) whose heads the devices divide."""
        if layer.keras_heads:
            return layer.heads >= self.mesh.tensor
        return self.split_heads and layer.heads % self.mesh.tensor == 0 and layer.heads > 0

    def rows(self, candidate: str, kept: bool = False, sliced: bool = False) -> float:
        """Rows per device a layer with ``candidate`` computes on or, ``kept``,
        keeps outputs of (row and vocab keep whole rows of partial sums);
        ``sliced``: in a sequence-parallel region, whose kept outputs and
        ``whole`` computations are 1/t of those."""
        if candidate == "dp":
            return self.rows_device
        if candidate == "whole" or kept and candidate in ("row", "vocab"):
            rows = self.rows_group
        else:
            rows = self.rows_group / self.mesh.tensor
        return rows / self.mesh.tensor if sliced and (kept or candidate == "whole") else rows

    def may_slice(self, i: int, candidate: str) -> bool:
        """Whether sequence parallelism can keep layer i's output split along
        the sequence as ``candidate`` (``sliced`` says whether it does: the
        search, choosing a layer at a time, assumes it)."""
        return self.sequence_parallel and self.mesh.tensor > 1 and (
            candidate == "row" or candidate == "whole"
            and self.graph.layers[i].kind in ("elementwise", "other"))

    def node(self, i: int, candidate: str, sliced: Optional[bool] = None) -> Cost:
        """Compute (forward + backward = 3 x forward) and communication of
        layer i; ``sliced`` (default ``may_slice``): a ``whole`` layer then
        computes on its sequence slice."""
        sliced = self.may_slice(i, candidate) if sliced is None else sliced
        key = (self.klass[i], candidate, sliced)
        if key not in self._nodes:
            self._nodes[key] = self._node(i, candidate, sliced)
        return self._nodes[key]

    def _node(self, i: int, candidate: str, sliced: bool) -> Cost:
        layer, mesh = self.graph.layers[i], self.mesh
        t, bandwidth = mesh.tensor, mesh.group_bandwidth
        compute = Cost(3 * layer.flops * self.rows(candidate, sliced=sliced)
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
        extra = self.edge(layer.input_bytes, "B", LAYOUTS[candidate][0],
                          float(candidate == "column"))
        if candidate in ("row", "vocab"):  # partial sums of whole rows
            extra += allreduce(t, layer.out_bytes * self.rows_group, bandwidth)
        elif candidate == "xent":
            extra += allreduce(t, 8 * self.rows_group, bandwidth) * 2
        return compute + grads + extra

    def compute_seconds(self, chosen: Sequence[str]) -> float:
        """Forward and backward compute of the layers as ``chosen`` (no collectives)."""
        speed = self.mesh.hardware.flops_per_s(self.mesh.dtype)
        return sum(3 * layer.flops * self.rows(c, sliced=cut)
                   for layer, c, cut in zip(self.graph.layers, chosen, self.sliced(chosen))
                   ) / speed

    def edge(self, size: float, out_layout: str, in_layout: str,
             partial: float = 0.0, share: float = 1.0) -> Cost:
        """Resharding ``size`` bytes per row forward and its gradient back;
        ``share``: this edge's share of the producer's forward gather (its
        readers read one gathered copy); ``partial``: the consumer's input
        gradient is a sum of partials (a ``column`` layer's), reduced on the
        way back, this edge's share of the reduction (module docstring)."""
        if not size:
            return Cost()
        t, total, bandwidth = self.mesh.tensor, size * self.rows_group, self.mesh.group_bandwidth
        if not partial:
            back = self._move(size, in_layout, out_layout)
        elif out_layout == "W":
            back = allreduce(t, total, bandwidth) * partial
        else:  # a reduce-scatter moves what an all-gather does
            back = allgather(t, total, bandwidth) * partial
        return self._move(size, out_layout, in_layout) * share + back

    def _move(self, size: float, source: str, target: str) -> Cost:
        """``size`` bytes per row from layout ``source`` to ``target``, one way."""
        if source == target or target != "W" and source == "W":  # a slice
            return Cost()
        return allgather(self.mesh.tensor, size * self.rows_group, self.mesh.group_bandwidth)

    def memory_of(self, i: int, candidate: str, activations: bool = True,
                  sliced: Optional[bool] = None) -> float:
        """Layer i's bytes per device as ``candidate``; ``sliced`` (default
        ``may_slice``): its kept output split along the sequence."""
        sliced = self.may_slice(i, candidate) if sliced is None else sliced
        key = (self.klass[i], candidate, activations, sliced)
        if key not in self._memory:
            self._memory[key] = self._layer_memory(i, candidate, activations, sliced)
        return self._memory[key]

    def _layer_memory(self, i: int, candidate: str, activations: bool, sliced: bool) -> float:
        layer, t = self.graph.layers[i], self.mesh.tensor
        weights = layer.param_bytes / (t if candidate in SHARDED else 1)
        if not activations:
            return self.graph.state_per_weight * weights
        return (self.graph.state_per_weight * weights
                + layer.activation_bytes * self.rows(candidate, kept=True, sliced=sliced))

    def sliced(self, chosen: Sequence[str]) -> List[bool]:
        """Per layer, whether sequence parallelism keeps its output split
        along the sequence: a ``row`` layer's, and a ``whole`` elementwise or
        ``other`` layer's that reads one (the module docstring's regions)."""
        sliced: List[bool] = []
        for j, candidate in enumerate(chosen):
            sliced.append(self.may_slice(j, candidate) and (
                candidate == "row" or any(sliced[i] for i, _ in self.preds[j])))
        return sliced

    def layer_memory(self, chosen: Sequence[str], activations: bool = True) -> List[float]:
        """Bytes per device of each layer as ``chosen``."""
        return [self.memory_of(i, c, activations, cut)
                for i, (c, cut) in enumerate(zip(chosen, self.sliced(chosen)))]

    def memory(self, chosen: Sequence[str]) -> float:
        """Bytes per device the memory limit applies to."""
        return sum(self.layer_memory(chosen, self.limit_activations))

    def reshard(self, size: float, producer: str, consumer: str, readers: int = 1) -> Cost:
        """The edge between a layer with candidate ``producer`` (read by
        ``readers`` layers) and one with ``consumer``."""
        return self.edge(size, LAYOUTS[producer][1], LAYOUTS[consumer][0],
                         (consumer == "column") / readers, 1 / readers)

    def layer_cost(self, j: int, candidate_of, sliced: Optional[bool] = None) -> Cost:
        """Layer j's cost with the resharding of its inputs (``candidate_of``:
        layer -> candidate, for j and its producers; ``sliced``: ``node``'s)."""
        mine = candidate_of[j]
        sliced = self.may_slice(j, mine) if sliced is None else sliced
        inputs = tuple((size, candidate_of[i], self.readers[i]) for i, size in self.preds[j])
        key = (self.klass[j], mine, inputs, sliced)
        if key not in self._costs:
            self._costs[key] = sum((self.reshard(size, theirs, mine, readers)
                                    for size, theirs, readers in inputs),
                                   self.node(j, mine, sliced))
        return self._costs[key]

    def layer_costs(self, chosen: Sequence[str]) -> List[Cost]:
        """Each layer's cost as ``chosen``, sequence-parallel regions as they are."""
        return [self.layer_cost(j, chosen, cut) for j, cut in enumerate(self.sliced(chosen))]

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
        memory = self.layer_memory(chosen)
        weights = self.layer_memory(chosen, activations=False)
        return ShardingPlan(tuple(chosen), step.seconds, sum(memory), step.bytes, optimal,
                            tuple(costs), tuple(memory), sum(weights), outcome, tuple(weights))



def _sum_costs(costs: Sequence[Cost]) -> Cost:
    """The sum of ``costs`` (summed field by field: they are many)."""
    return Cost(*map(sum, zip(*costs))) if costs else Cost()

