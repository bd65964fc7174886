"""A mesh's step time and memory for every micro-batch count and memory
technique (no TensorFlow): the search solves a mesh's stages (and their
sharding) once, as ``StageModel``s affine in the rows of a micro-batch, and
``best_setting`` then tries each setting in a few operations.

Per micro-batch of ``r`` rows (per replica), stage ``s`` busies its devices
for ``T_s = latency + r (compute x (1 + recomputed share / 3) + collectives)``,
the latency counting ``LAUNCH_S`` for each of its kernels (three per forward
op that computes or allocates: its forward and two backward) and the
latencies of its collectives - what makes many small micro-batches cost
more than a few large ones
(forward one third of the compute, backward two thirds: Narayanan et al.,
SC'21, §3.5; recomputation runs the recomputed share of the forward again).
Mixed precision speeds the compute up as ``roofline.low_precision_speed_up``
says (FLOPs at the fp16 peak, half the memory traffic) and halves the
activations and what is sent (activations between stages and within tensor
groups, 16-bit gradients between replicas).
A step of ``m`` micro-batches under 1F1B (PipeDream-flush) takes
``sum_s T_s + (m - 1) max_s T_s + 2 (p - 1) transfer``: the first micro-batch
goes through every stage and back, the others follow at the slowest stage's
pace (for equal stages, ``(m + p - 1) T``: Narayanan et al., Eq. 1), then
every stage all-reduces its gradients over its ``d`` replicas. Stage ``s``
holds ``min(p - s, m)`` micro-batches' kept activations (1F1B's warm-up),
the transient bytes of the one recomputed unit, and its weights, gradients
and optimizer slots (``memory.state_bytes``).
"""
import dataclasses
import itertools
from typing import List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.planner.comm import LATENCY_S, Cost
from tfpar.planner.memory import RECOMPUTE, Techniques, state_bytes

__all__ = ["KERNELS_PER_OP", "LAUNCH_S", "Setting", "StageModel", "best_setting",
           "micro_batch_counts", "technique_space"]

# Seconds per kernel: TensorFlow's executor dispatches an op in a few
# microseconds and a CUDA kernel launch takes about 5.
LAUNCH_S = 5e-6
KERNELS_PER_OP = 3


@dataclasses.dataclass(frozen=True)
class StageModel:
    """One stage on each of its devices, per row of a micro-batch (per
    replica): compute and collective seconds, collective bytes; per
    micro-batch latency; bytes of weights per device; gradients all-reduced
    once per step; per ``RECOMPUTE`` mode the activation bytes kept and held
    transiently, and the recomputed share of the forward FLOPs."""

    compute_s: float
    collective_s: float
    collective_bytes: float
    latency_s: float
    param_bytes: float
    grads: Cost
    kept: Tuple[float, ...]
    transient: Tuple[float, ...]
    recomputed: Tuple[float, ...]

    def seconds(self, rows: float, mode: int, speed_up: float, act_scale: float) -> float:
        """Busy seconds of one micro-batch of ``rows`` (forward and backward)."""
        compute = self.compute_s / speed_up * (1 + self.recomputed[mode] / 3)
        return self.latency_s + rows * (compute + self.collective_s * act_scale)


@dataclasses.dataclass(frozen=True)
class Setting:
    """The estimates of one mesh with ``micro_batches`` and ``techniques``:
    step seconds, bytes per device (per stage), bytes sent per step."""

    micro_batches: int
    techniques: Techniques
    step_time_s: float
    memory_bytes: Tuple[float, ...]
    comm_bytes: float
    stage_seconds: Tuple[float, ...]
    state_bytes: Tuple[float, ...]

    @property
    def peak_memory(self) -> float:
        return max(self.memory_bytes)


def micro_batch_counts(rows_per_replica: int, given: Optional[int]) -> List[int]:
    """The micro-batch counts to try: ``given``, or every divisor of the
    replica's rows (every micro-batch the same size)."""
    if given is not None:
        return [given]
    return [m for m in range(1, rows_per_replica + 1) if rows_per_replica % m == 0]


def technique_space(allowed: Sequence[str], data: int, mixed_precision_helps: bool
                    ) -> List[Techniques]:
    """Every combination of the ``allowed`` techniques ("recompute", "zero",
    "mixed_precision"; ZeRO only with replicas, mixed precision only when
    the model computes in 32 bits), the one without any first."""
    modes = RECOMPUTE if "recompute" in allowed else ("none",)
    zeros = (0, 1, 2) if "zero" in allowed and data > 1 else (0,)
    precisions = (False, True) if "mixed_precision" in allowed and mixed_precision_helps \
        else (False,)
    return [Techniques(mode, zero, mixed) for mode, zero, mixed in
            itertools.product(modes, zeros, precisions)]


def best_setting(stages: Sequence[StageModel], data: int, rows_per_replica: float,
                 counts: Sequence[int], techniques: Sequence[Techniques], cut_bytes: float,
                 transfer_bandwidth: float, speed_up: float, capacity: float) -> Setting:
    """The fastest setting that fits ``capacity`` bytes per device (equal
    times: the fewest techniques, then micro-batches), else the one needing
    the least memory. ``cut_bytes``: bytes per row crossing the stage
    boundaries (one transfer carries their mean); ``speed_up``: mixed
    precision's compute speed-up."""
    settings = [_setting(stages, data, rows_per_replica, m, tech, cut_bytes, transfer_bandwidth,
                         speed_up) for m in counts for tech in techniques]
    fitting = [s for s in settings if s.peak_memory <= capacity]
    if not fitting:
        return min(settings, key=lambda s: (s.peak_memory, s.step_time_s))
    fastest = min(s.step_time_s for s in fitting)
    return min((s for s in fitting if s.step_time_s <= fastest * (1 + 1e-9)),
               key=lambda s: (len(s.techniques.names), s.micro_batches))


def _setting(stages: Sequence[StageModel], data: int, rows_per_replica: float, micro: int,
             tech: Techniques, cut_bytes: float, bandwidth: float, speed_up: float) -> Setting:
    rows = rows_per_replica / micro
    mode = RECOMPUTE.index(tech.recompute)
    speed, scale = (speed_up, 0.5) if tech.mixed_precision else (1.0, 1.0)
    times = [stage.seconds(rows, mode, speed, scale) for stage in stages]
    p = len(stages)
    transfer = LATENCY_S + cut_bytes * rows * scale / (p - 1) / bandwidth if p > 1 else 0.0
    length = sum(times) + (micro - 1) * max(times) + 2 * (p - 1) * transfer
    grads = [stage.grads * scale for stage in stages]
    state = tuple(state_bytes(stage.param_bytes, data, tech.zero) for stage in stages)
    memory = tuple(held + rows * scale * (stage.kept[mode] * min(p - s, micro)
                                          + stage.transient[mode])
                   for s, (held, stage) in enumerate(zip(state, stages)))
    sent = sum(stage.collective_bytes * rows * scale * micro + g.bytes
               for stage, g in zip(stages, grads)) + 2 * cut_bytes * rows * scale * micro
    return Setting(micro, tech, length + max(g.seconds for g in grads), memory, sent,
                   tuple(t * micro + g.seconds for t, g in zip(times, grads)), state)
