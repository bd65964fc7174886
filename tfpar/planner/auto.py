"""``auto.auto_parallel``: choose the data x pipeline degrees by cost model (no
TensorFlow). A first slice of the planner: tensor sharding is not searched.

For every pipeline degree p dividing the device count K (or the given
``num_task_graph``), with data parallelism d = K / p on top:
  * stages come from ``partition.partition_stages`` (Rhino's stage ILP);
  * compute: a stage's forward time is its FLOPs per row x the rows of a
    micro-batch / the device's throughput, backward twice that;
  * the schedule (1F1B) is replayed by ``simulate`` with the activation bytes
    crossing each cut as transfer time (alpha-beta model);
  * each stage then all-reduces its gradients over its d replicas (ring:
    2 (d-1)/d of the bytes, 2 (d-1) latencies);
  * memory per device: the stage's weights, gradients and two optimizer slots,
    plus the activations of the micro-batches in flight.
The fastest candidate whose memory fits wins (within 10%, the one with fewer
stages: the estimates are rough); ``progress`` reports each one.
"""
import dataclasses
from typing import Callable, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.errors import PlanError
from tfpar.planner.partition import partition_stages
from tfpar.planner.schedule import build_schedule
from tfpar.planner.simulate import simulate

__all__ = ["Candidate", "ModelView", "StageCosts", "search", "stage_costs"]

LATENCY_S = 10e-6   # alpha of the alpha-beta model, per message
BYTES_PER_PARAM_STATE = 4  # weights + gradients + two optimizer slots, float32 each
TOLERANCE = 0.1


@dataclasses.dataclass(frozen=True)
class ModelView:
    """The forward ops of a model in topological order.

    Attributes:
      flops: FLOPs per batch row of each op.
      activation_bytes: bytes per row each op outputs.
      param_bytes: bytes of the weights each op reads (counted once).
      edges: (i, j, bytes per row) between ops.
      labels: each op's repeated block (``pruning.block_labels``) or None.
    """

    flops: Sequence[float]
    activation_bytes: Sequence[float]
    param_bytes: Sequence[float]
    edges: Sequence[Tuple[int, int, float]]
    labels: Optional[Sequence[Optional[str]]] = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One (data, pipeline) choice with its estimates and stage of every op."""

    data: int
    pipeline: int
    stages: Tuple[int, ...]
    step_time_s: float
    memory_bytes: float
    comm_bytes: float


def search(model: ModelView, num_devices: int, hardware: Hardware, global_batch: int,
           num_micro_batch: int, pipeline: Optional[int] = None, time_limit_s: float = 10.0,
           progress: Callable[[str], None] = lambda line: None) -> Candidate:
    """The fastest candidate that fits ``hardware``'s memory.

    Raises:
      PlanError: no candidate fits, naming the smallest memory need.
    """
    degrees = [pipeline] if pipeline else [p for p in range(1, num_devices + 1)
                                           if num_devices % p == 0 and p <= len(model.flops)]
    candidates = []
    for p in degrees:
        candidate = _estimate(model, p, max(num_devices // p, 1), hardware, global_batch,
                              num_micro_batch if p > 1 else 1, time_limit_s)
        candidates.append(candidate)
        progress(f"tfpar auto: data {candidate.data} x pipeline {p}: step "
                 f"{candidate.step_time_s * 1e3:.3f} ms, memory/device "
                 f"{candidate.memory_bytes / 2 ** 20:.1f} MiB")
    capacity = hardware.memory_gb * 2 ** 30
    fitting = [c for c in candidates if c.memory_bytes <= capacity]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits {hardware.name}'s "
                        f"{hardware.memory_gb:g} GB per device; the smallest needs "
                        f"{least.memory_bytes / 2 ** 30:.3g} GB (pipeline {least.pipeline})")
    fastest = min(c.step_time_s for c in fitting)
    # Estimates are rough: within TOLERANCE of the fastest, fewer stages win.
    return min((c for c in fitting if c.step_time_s <= fastest * (1 + TOLERANCE)),
               key=lambda c: (c.pipeline, c.step_time_s))


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
    speed = hardware.tflops * 1e12
    bandwidth = hardware.intra_node_gbps * 1e9
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


def _estimate(model: ModelView, p: int, d: int, hardware: Hardware, global_batch: int,
              micro: int, time_limit_s: float) -> Candidate:
    stages = partition_stages(model.flops, model.edges, p, time_limit_s, model.labels) \
        if p > 1 else [0] * len(model.flops)
    costs = stage_costs(model, stages, p, global_batch / d / micro, hardware)
    result = simulate(build_schedule("1f1b", p, micro), list(costs.forward_s),
                      list(costs.backward_s), costs.transfer_s)
    bandwidth = hardware.intra_node_gbps * 1e9
    allreduce = [_ring_allreduce_s(b, d, bandwidth) for b in costs.param_bytes]
    memory = max(costs.fixed_bytes[s] + costs.activation_bytes[s] * result.peak_in_flight[s]
                 for s in range(p))
    comm = sum(2 * (d - 1) / d * b for b in costs.param_bytes) + costs.cut_bytes * micro * 2
    return Candidate(data=d, pipeline=p, stages=tuple(stages),
                     step_time_s=result.length + max(allreduce), memory_bytes=memory,
                     comm_bytes=comm)


def _ring_allreduce_s(size: float, n: int, bandwidth: float) -> float:
    if n < 2:
        return 0.0
    return 2 * (n - 1) * LATENCY_S + 2 * (n - 1) / n * size / bandwidth
