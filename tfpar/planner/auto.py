"""``auto.auto_parallel``: choose data x tensor x pipeline degrees by cost model
(no TensorFlow).

Meshes: for every pipeline degree p dividing the device count K (or the given
``num_task_graph``), data parallelism d = K / p on top; without a pipeline,
every tensor degree t > 1 dividing K, with d = K / t; and tensor x pipeline
meshes with t, p > 1 and d = K / (t p). Only feasible ones: each of the d
replicas gets at least one row of each micro-batch (d x micro-batches <= the
global batch), and p is at most the model's stage units (its runs of repeated
blocks and of ops outside them). A tensor mesh is planned by the
sharding search (``sharding.plan_sharding``: Rhino §4 on the layer graph,
``auto.opt_level`` O2 or O3); a tensor x pipeline mesh by cutting stages as
below and searching each stage's sharding (``_pipelined_sharded``); a
pipeline mesh as follows:
  * stages come from ``partition.partition_stages`` (Rhino's stage ILP);
  * compute: a stage's forward time is its FLOPs per row x the rows of a
    micro-batch / the device's throughput for the model's compute dtype
    (``Hardware.flops_per_s``: peak x efficiency), backward twice that;
  * the schedule (1F1B) is replayed by ``simulate`` with the activation bytes
    crossing each cut as transfer time (alpha-beta model): with fewer
    micro-batches than stages the stages mostly wait for each other (one
    micro-batch: one after the other, the sum of their times);
  * each stage then all-reduces its gradients over its d replicas
    (``comm.allreduce``: 2 (d-1)/d of the bytes, 2 ceil(log2 d) latencies);
  * memory per device: the stage's weights, gradients and two optimizer slots,
    plus the activations of the micro-batches in flight.
The fastest candidate whose memory fits wins (within ``TOLERANCE`` of it,
the one with fewer stages; among those, within ``TENSOR_TOLERANCE``, the
lower tensor degree: the estimates are rough); ``progress``
reports each one as it is planned; ``time_limit_s`` bounds the whole search
(each ILP solve at most ``SOLVE_LIMIT_S``).
"""
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.errors import PlanError
from tfpar.planner.comm import LATENCY_S, allreduce
from tfpar.planner.layers import layer_graph, subgraph
from tfpar.planner.partition import partition_stages
from tfpar.planner.schedule import build_schedule
from tfpar.planner.sharding import STATE_BYTES as BYTES_PER_PARAM_STATE, Mesh, plan_sharding
from tfpar.planner.simulate import simulate

__all__ = ["Candidate", "ModelView", "Part", "StageCosts", "choose", "search", "search_all",
           "stage_costs", "stage_units"]

# Estimates are rough: within TOLERANCE of the fastest, fewer pipeline stages
# win (bubbles and stage balance are where the model errs most); among those,
# the lower tensor degree within TENSOR_TOLERANCE (a split's cost is computed
# from its collectives: a gain of a few percent is noise, one of 9% - Whale's
# 100K-class head on 8 GPUs - is not).
TOLERANCE = 0.1
TENSOR_TOLERANCE = 0.02
SOLVE_LIMIT_S = 10.0  # per ILP solve, within the search's time limit


@dataclasses.dataclass(frozen=True)
class ModelView:
    """The forward ops of a model in topological order.

    Attributes:
      flops: FLOPs per batch row of each op.
      activation_bytes: bytes per row each op's output allocates (none for
        one that is its input's buffer: a reshape).
      param_bytes: bytes of the weights each op reads (counted once).
      edges: (i, j, bytes per row) between ops.
      labels: each op's repeated block (``pruning.block_labels``) or None.
      names, types: op names and types (the sharding search groups ops into
        layers by name scope; without them only pipelines are searched).
      input_bytes: bytes per row each op reads from the model's inputs.
      batch: the global batch the model's inputs declare (None: unknown).
      compute_dtype: the dtype of most of its FLOPs (``hardware.DTYPES``;
        "tf32": float32 that TensorFlow may run as TF32).
    """

    flops: Sequence[float]
    activation_bytes: Sequence[float]
    param_bytes: Sequence[float]
    edges: Sequence[Tuple[int, int, float]]
    labels: Optional[Sequence[Optional[str]]] = None
    names: Optional[Sequence[str]] = None
    types: Optional[Sequence[str]] = None
    input_bytes: Optional[Sequence[float]] = None
    batch: Optional[int] = None
    compute_dtype: str = "fp32"


@dataclasses.dataclass(frozen=True)
class Part:
    """The estimates of one piece of a candidate - a pipeline stage, or a layer
    of a sharded plan (with its ops): busy seconds per step, bytes per device,
    bytes sent per step."""

    seconds: float
    memory_bytes: float
    comm_bytes: float
    ops: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One (data, tensor, pipeline) mesh with its estimates, the stage of every
    op, the sharded layers: (name scope, sharding candidate) for every layer
    that runs in a split TaskGraph (with tensor and pipeline both > 1: every
    layer, and ``split_stages`` its pipeline stage), and the estimates of its
    parts (stages, or layers of a sharded plan)."""

    data: int
    pipeline: int
    stages: Tuple[int, ...]
    step_time_s: float
    memory_bytes: float
    comm_bytes: float
    tensor: int = 1
    split_scopes: Tuple[Tuple[str, str], ...] = ()
    parts: Tuple[Part, ...] = ()
    split_stages: Tuple[int, ...] = ()


def search(model: ModelView, num_devices: int, hardware: Hardware, global_batch: int,
           num_micro_batch: int, pipeline: Optional[int] = None, time_limit_s: float = 10.0,
           progress: Callable[[str], None] = lambda line: None,
           opt_level: str = "O2", batch_known: bool = True) -> Candidate:
    """The fastest candidate that fits ``hardware``'s memory (``search_all``
    then ``choose``)."""
    return choose(search_all(model, num_devices, hardware, global_batch, num_micro_batch,
                             pipeline, time_limit_s, progress, opt_level, batch_known), hardware)


def search_all(model: ModelView, num_devices: int, hardware: Hardware, global_batch: int,
               num_micro_batch: int, pipeline: Optional[int] = None, time_limit_s: float = 10.0,
               progress: Callable[[str], None] = lambda line: None,
               opt_level: str = "O2", batch_known: bool = True) -> List[Candidate]:
    """A candidate per mesh, planned within ``time_limit_s`` in all
    (``batch_known``: ``global_batch`` is the real one, not an assumed size,
    so meshes that leave a replica without rows are left out)."""
    capacity = hardware.memory_gb * 2 ** 30
    pipelines = [pipeline] if pipeline else range(1, num_devices + 1)
    meshes = [(1, p) for p in pipelines if num_devices % p == 0]
    if model.names is not None:
        meshes += [(t, 1) for t in range(2, num_devices + 1)
                   if num_devices % t == 0 and (pipeline or 1) == 1]
        meshes += [(t, p) for p in pipelines for t in range(2, num_devices // max(p, 1) + 1)
                   if p > 1 and num_devices % (t * p) == 0]
    meshes = _feasible(meshes, model, num_devices, global_batch if batch_known else None,
                       num_micro_batch, progress)
    layers = layer_graph(model) if any(t > 1 for t, _ in meshes) else None
    cuts: Dict[int, List[int]] = {}  # pipeline degree -> stage of each op, cut once

    def stages_of(p: int, time_limit_s: float) -> List[int]:
        if p not in cuts:
            cuts[p] = partition_stages(model.flops, model.edges, p, time_limit_s, model.labels) \
                if p > 1 else [0] * len(model.flops)
        return cuts[p]
    start = time.monotonic()
    deadline = start + time_limit_s
    candidates = []
    for number, (t, p) in enumerate(meshes, 1):
        left = deadline - time.monotonic()
        if left <= 0 and candidates:
            progress(f"tfpar auto: search time limit reached after {number - 1} of "
                     f"{len(meshes)} meshes")
            break
        solve_limit = min(max(left, 1.0), SOLVE_LIMIT_S)
        if t > 1 and p > 1:
            candidate = _pipelined_sharded(model, layers, stages_of(p, solve_limit),
                                           (num_devices // (t * p), t, p), hardware,
                                           global_batch, num_micro_batch, capacity,
                                           opt_level, solve_limit)
        elif t > 1:
            candidate = _sharded(layers, Mesh(num_devices, t, global_batch, hardware,
                                              model.compute_dtype),
                                 capacity, opt_level, solve_limit)
        else:
            candidate = _estimate(model, stages_of(p, solve_limit), p,
                                  max(num_devices // p, 1), hardware, global_batch,
                                  num_micro_batch if p > 1 else 1)
        if candidate is None:
            progress(f"tfpar auto [{number}/{len(meshes)}] tensor {t} x pipeline {p}: no "
                     f"sharded plan fits or beats data parallelism "
                     f"({time.monotonic() - start:.1f} s)")
            continue
        candidates.append(candidate)
        progress(f"tfpar auto [{number}/{len(meshes)}] data {candidate.data} x tensor "
                 f"{candidate.tensor} x pipeline {p}: step {candidate.step_time_s * 1e3:.3f} ms, "
                 f"memory/device {candidate.memory_bytes / 2 ** 20:.1f} MiB "
                 f"({time.monotonic() - start:.1f} s)")
    return candidates


def stage_units(model: ModelView) -> int:
    """How many stages the model can be cut into: its runs of ops of one
    repeated block (a transformer layer) and of ops outside blocks, each op
    its own unit when there are no blocks."""
    if not model.labels:
        return len(model.flops)
    runs = [label for i, label in enumerate(model.labels)
            if i == 0 or label is None or label != model.labels[i - 1]]
    return len(runs)


def _feasible(meshes: List[Tuple[int, int]], model: ModelView, num_devices: int,
              global_batch: Optional[int], num_micro_batch: int,
              progress: Callable[[str], None]) -> List[Tuple[int, int]]:
    """The (tensor, pipeline) meshes whose every replica gets a row of each
    micro-batch (d x micro-batches <= the global batch, when known) and whose
    stages do not outnumber the model's ``stage_units``.

    Raises:
      PlanError: no mesh is feasible, saying why.
    """
    units = stage_units(model)
    short = {(t, p) for t, p in meshes if global_batch is not None
             and num_devices // (t * p) * (num_micro_batch if p > 1 else 1) > global_batch}
    deep = {(t, p) for t, p in meshes if p > units}
    reasons = ([f"{len(short)} would leave a replica x micro-batch without a row of the "
                f"batch of {global_batch}"] if short else []) + (
        [f"{len(deep)} would have more stages than the model's {units} layers"] if deep else [])
    kept = [mesh for mesh in meshes if mesh not in short and mesh not in deep]
    if reasons:
        progress(f"tfpar auto: {len(meshes) - len(kept)} of {len(meshes)} meshes left out: "
                 + "; ".join(reasons))
    if not kept:
        raise PlanError(f"tfpar: auto.auto_parallel has no feasible mesh of {num_devices} "
                        f"devices: {'; '.join(reasons)}. Use fewer devices "
                        "(cluster.num_devices), a larger batch, or fewer micro-batches "
                        "(pipeline.num_micro_batch)")
    return kept


def choose(candidates: Sequence[Candidate], hardware: Hardware) -> Candidate:
    """The fastest of ``candidates`` whose memory fits.

    Raises:
      PlanError: none fits, naming the smallest memory need.
    """
    capacity = hardware.memory_gb * 2 ** 30
    fitting = [c for c in candidates if c.memory_bytes <= capacity]
    if not fitting:
        if not candidates:
            raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits "
                            f"{hardware.name}'s {hardware.memory_gb:g} GB per device")
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits {hardware.name}'s "
                        f"{hardware.memory_gb:g} GB per device; the smallest needs "
                        f"{least.memory_bytes / 2 ** 30:.3g} GB (data {least.data} x tensor "
                        f"{least.tensor} x pipeline {least.pipeline})")
    fastest = min(c.step_time_s for c in fitting)
    near = [c for c in fitting if c.step_time_s <= fastest * (1 + TOLERANCE)]
    stages = min(c.pipeline for c in near)
    near = [c for c in near if c.pipeline == stages]
    fastest = min(c.step_time_s for c in near)
    return min((c for c in near if c.step_time_s <= fastest * (1 + TENSOR_TOLERANCE)),
               key=lambda c: (c.tensor, c.step_time_s))


def _sharded(layers, mesh: Mesh, capacity: float, opt_level: str,
             time_limit_s: float) -> Optional[Candidate]:
    """The sharding search's plan on ``mesh`` as a candidate (None when it
    fits nowhere or shards nothing: then it is plain data parallelism)."""
    plan = plan_sharding(layers, mesh, capacity, opt_level, time_limit_s)
    if plan is None or all(c == "dp" for c in plan.candidates):
        return None
    split = tuple((scope, c) for layer, c in zip(layers.layers, plan.candidates) if c != "dp"
                  for scope in layer.scopes)
    parts = tuple(Part(cost.seconds, memory, cost.bytes, layer.ops)
                  for layer, cost, memory in zip(layers.layers, plan.layer_costs,
                                                 plan.layer_memory))
    count = sum(len(layer.ops) for layer in layers.layers)
    return Candidate(data=mesh.data, pipeline=1, stages=(0,) * count,
                     step_time_s=plan.step_time_s, memory_bytes=plan.memory_bytes,
                     comm_bytes=plan.comm_bytes, tensor=mesh.tensor, split_scopes=split,
                     parts=parts)


def _pipelined_sharded(model: ModelView, layers, op_stages: Sequence[int],
                       mesh: Tuple[int, int, int], hardware: Hardware, global_batch: int,
                       micro: int, capacity: float, opt_level: str,
                       time_limit_s: float) -> Optional[Candidate]:
    """A 3-D mesh (data d, tensor t, pipeline p): the stages ``op_stages``
    (of ``partition_stages``), each on its own d x t devices with every layer split
    over groups of t (``split_only`` sharding search per stage, on one
    micro-batch's rows, gradients apart); stage times replayed as a 1F1B
    pipeline; each stage's weights all-reduced over its d replicas per step."""
    d, t, p = mesh
    stage_of = [op_stages[layer.ops[0]] for layer in layers.layers]  # non-decreasing
    rows = global_batch / micro
    plans = []
    for s in range(p):
        members = [i for i, stage in enumerate(stage_of) if stage == s]
        if not members:
            return None
        plan = plan_sharding(subgraph(layers, members),
                             Mesh(d * t, t, rows, hardware, model.compute_dtype),
                             capacity, opt_level, time_limit_s, split_only=True, gradients=False)
        if plan is None:
            return None
        plans.append((members, plan))
    cut = sum(size for i, j, size in layers.edges if stage_of[i] != stage_of[j]) * rows / d
    transfer = LATENCY_S + cut / (p - 1) / hardware.bandwidth(t * p)
    result = simulate(build_schedule("1f1b", p, micro), [plan.step_time_s / 3 for _, plan in plans],
                      [2 * plan.step_time_s / 3 for _, plan in plans], transfer)
    grads = [allreduce(d, plan.weight_memory / BYTES_PER_PARAM_STATE,
                       hardware.bandwidth(d * t * p)) for _, plan in plans]
    memory = [plan.weight_memory + (plan.memory_bytes - plan.weight_memory) * peak
              for (_, plan), peak in zip(plans, result.peak_in_flight)]
    parts, split, stages = [], [], []
    for s, (members, plan) in enumerate(plans):
        for i, c, cost, mem in zip(members, plan.candidates, plan.layer_costs, plan.layer_memory):
            layer = layers.layers[i]
            parts.append(Part(cost.seconds * micro, mem, cost.bytes * micro, layer.ops))
            split += [(scope, c) for scope in layer.scopes]
            stages += [s] * len(layer.scopes)
    op_stage = [0] * len(model.flops)
    for i, layer in enumerate(layers.layers):
        for op in layer.ops:
            op_stage[op] = stage_of[i]
    return Candidate(data=d, pipeline=p, stages=tuple(op_stage),
                     step_time_s=result.length + max(g.seconds for g in grads),
                     memory_bytes=max(memory),
                     comm_bytes=sum(part.comm_bytes for part in parts) + cut * micro * 2
                     + sum(g.bytes for g in grads), tensor=t, split_scopes=tuple(split),
                     parts=tuple(parts), split_stages=tuple(stages))


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per stage: forward time of one micro-batch (backward is twice it), the
    bytes of its weights, the activations one micro-batch keeps alive; the delay
    of one cross-stage transfer; bytes crossing stages per micro-batch."""

    forward_s: Tuple[float, ...]
    param_bytes: Tuple[float, ...]
    activation_bytes: Tuple[float, ...]
    transfer_s: float
    cut_bytes: float

    @property
    def backward_s(self) -> Tuple[float, ...]:
        return tuple(2 * f for f in self.forward_s)

    @property
    def fixed_bytes(self) -> Tuple[float, ...]:
        return tuple(BYTES_PER_PARAM_STATE * b for b in self.param_bytes)


def stage_costs(model: ModelView, stages: Sequence[int], num_stages: int, rows: float,
                hardware: Hardware) -> StageCosts:
    """The cost model of ``stages`` (stage of each op) for micro-batches of ``rows``."""
    speed = hardware.flops_per_s(model.compute_dtype)
    bandwidth = hardware.bandwidth(num_stages)  # neighbouring stages, consecutive devices
    forward = [0.0] * num_stages
    params = [0.0] * num_stages
    activations = [0.0] * num_stages
    for i, stage in enumerate(stages):
        forward[stage] += model.flops[i] * rows / speed
        params[stage] += model.param_bytes[i]
        activations[stage] += model.activation_bytes[i] * rows
    cut = sum(size for i, j, size in model.edges if stages[i] != stages[j]) * rows
    transfer = LATENCY_S + cut / max(num_stages - 1, 1) / bandwidth if num_stages > 1 else 0.0
    return StageCosts(tuple(forward), tuple(params), tuple(activations), transfer, cut)


def _estimate(model: ModelView, stages: Sequence[int], p: int, d: int, hardware: Hardware,
              global_batch: int, micro: int) -> Candidate:
    """The pipeline (or, with ``p`` 1, data parallel) candidate of ``stages``."""
    costs = stage_costs(model, stages, p, global_batch / d / micro, hardware)
    result = simulate(build_schedule("1f1b", p, micro), list(costs.forward_s),
                      list(costs.backward_s), costs.transfer_s)
    bandwidth = hardware.bandwidth(p * d)  # a stage's replicas are strided over all devices
    grads = [allreduce(d, b, bandwidth) for b in costs.param_bytes]
    memory = [costs.fixed_bytes[s] + costs.activation_bytes[s] * result.peak_in_flight[s]
              for s in range(p)]
    parts = tuple(Part(micro * (costs.forward_s[s] + costs.backward_s[s]) + grads[s].seconds,
                       memory[s], grads[s].bytes) for s in range(p))
    return Candidate(data=d, pipeline=p, stages=tuple(stages),
                     step_time_s=result.length + max(g.seconds for g in grads),
                     memory_bytes=max(memory),
                     comm_bytes=sum(g.bytes for g in grads) + costs.cut_bytes * micro * 2,
                     parts=parts)

