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
A step of ``m`` micro-batches takes what its schedule's closed form says
(``pipeline_length``; ``T_s`` stage ``s``'s seconds per micro-batch, ``T``
the slowest, ``S`` their sum, ``t`` one transfer between stages):
  * 1F1B (PipeDream-flush) and kFkB (Ada-Grouper §4: 1F1B over groups of
    ``k`` micro-batches; GPipe is ``k = m``): ``S + (m - 1) T`` - the first
    micro-batch goes through every stage and back, the others follow at the
    slowest stage's pace (for equal stages, ``(m + p - 1) T``: Narayanan et
    al., SC'21, Eq. 1) - plus ``2 (p - 1) t`` to fill and drain, plus, for
    every group after the first, the part of a round trip ``2 t`` that the
    group's other ``k - 1`` micro-batches do not cover: in 1F1B's steady
    state a stage waits for the gradient of the micro-batch it just sent on,
    which grouping hides (Ada-Grouper's point);
  * ZB-H1 (Qi et al., ICLR 2024, §2.1): the weight gradients (half the
    backward, a third of ``T_s``) fill 1F1B's bubbles - with ``m >= p``
    two thirds of them, ``m T + (S - T) / 3`` for equal stages without
    transfers - and the round trips of the steady state as long as they
    last no longer than a weight gradient.
``tests/test_step_model.py`` holds these to ``simulate``'s replays. Then
every stage all-reduces its gradients over its ``d`` replicas. Stage ``s``
holds the kept activations of its micro-batches in flight (1F1B
``min(p - s, m)``, kFkB ``min(k (p - s), m)``, ZB-H1 ``min(p, m)``: a
deferred weight gradient keeps its micro-batch), the transient bytes of the
one recomputed unit, and its weights, gradients and optimizer slots
(``memory.state_bytes``). An offloaded optimizer adds its host traffic
and update after the stage's all-reduce (``memory.offload_seconds``).
Interleaved 1F1B (``Space.virtual_stages`` V > 1: G V stages on G device
groups) is replayed, not a closed form (``planner.interleaved``); a device
then holds the state of its V stages and its group's peak of activations.
Each setting says how much of its step is bubble (``Setting.bubble_s``: the
step without transfers less the busiest device's compute) and how much
waiting for transfers (``Setting.transfer_s``: the step less the step
without them).
"""
import dataclasses
import itertools
import math
from typing import Iterator, List, Optional, Sequence, Tuple

from tfpar.planner.comm import LATENCY_S, Cost
from tfpar.planner.interleaved import group_peaks, interleaved_length
from tfpar.planner.memory import (MIXED_ACTIVATIONS, RECOMPUTE, SLOTS, Techniques,
                                  offload_seconds, state_bytes)

__all__ = ["KERNELS_PER_OP", "LAUNCH_S", "SCHEDULE_TOLERANCE", "SEARCHED_SCHEDULES", "Setting",
           "Space", "StageModel", "best_setting", "in_flight", "kernel_counts",
           "micro_batch_counts", "pipeline_length", "technique_space"]

# Seconds per kernel: TensorFlow's executor dispatches an op in a few
# microseconds and a CUDA kernel launch takes about 5.
LAUNCH_S = 5e-6
KERNELS_PER_OP = 3
# A schedule other than 1F1B is chosen only when it is this much faster (a
# smaller gain is within what unequal stages change in the replays).
SCHEDULE_TOLERANCE = 0.02
# Searched schedules, the plainest first (equal times: the plainest wins).
SEARCHED_SCHEDULES = ("1f1b", "zero_bubble", "kfkb")


@dataclasses.dataclass(frozen=True)
class StageModel:
    """One stage on each of its devices, per row of a micro-batch (per
    replica): compute and collective seconds, collective bytes; per
    micro-batch latency; bytes of weights per device; gradients all-reduced
    once per step; per ``RECOMPUTE`` mode the activation bytes kept and held
    transiently, and the recomputed share of the forward FLOPs; the
    optimizer's slots per weight."""

    compute_s: float
    collective_s: float
    collective_bytes: float
    latency_s: float
    param_bytes: float
    grads: Cost
    kept: Tuple[float, ...]
    transient: Tuple[float, ...]
    recomputed: Tuple[float, ...]
    optimizer_slots: float = SLOTS

    def seconds(self, rows: float, mode: int, speed_up: float, act_scale: float) -> float:
        """Busy seconds of one micro-batch of ``rows`` (forward and backward)."""
        compute = self.compute_s / speed_up * (1 + self.recomputed[mode] / 3)
        return self.latency_s + rows * (compute + self.collective_s * act_scale)


@dataclasses.dataclass(frozen=True)
class Space:
    """What ``best_setting`` tries: micro-batch counts, memory techniques,
    pipeline schedules (``SEARCHED_SCHEDULES`` names, or "gpipe"), and the kFkB group
    size (None: every divisor of the micro-batch count that can help);
    ``virtual_stages`` V > 1: the stages are G V interleaved ones on G device
    groups (1F1B only; counts multiples of G)."""

    counts: Tuple[int, ...]
    techniques: Tuple[Techniques, ...] = (Techniques(),)
    schedules: Tuple[str, ...] = ("1f1b",)
    group_size: Optional[int] = None
    virtual_stages: int = 1


@dataclasses.dataclass(frozen=True)
class Setting:
    """The estimates of one mesh with ``micro_batches``, ``techniques`` and a
    pipeline ``schedule`` (kFkB's ``group_size``) over ``virtual_stages``
    per device: step seconds, bytes per device (per stage: its device's),
    bytes sent per step (``stage_comm``: each stage's collectives and
    gradients, without the activations sent between stages); of the step,
    the bubble and the waits for transfers (the module docstring; of
    interleaved settings, told apart for the one ``best_setting`` returns,
    the others' waits all counted as bubble: each would cost another replay)."""

    micro_batches: int
    techniques: Techniques
    step_time_s: float
    memory_bytes: Tuple[float, ...]
    comm_bytes: float
    stage_seconds: Tuple[float, ...]
    state_bytes: Tuple[float, ...]
    schedule: str = "1f1b"
    group_size: int = 1
    virtual_stages: int = 1
    bubble_s: float = 0.0
    transfer_s: float = 0.0
    stage_comm: Tuple[float, ...] = ()

    @property
    def peak_memory(self) -> float:
        return max(self.memory_bytes)


def micro_batch_counts(rows_per_replica: int, given: Optional[int]) -> List[int]:
    """The micro-batch counts to try: ``given``, or every divisor of the
    replica's rows (every micro-batch the same size)."""
    if given is not None:
        return [given]
    return [m for m in range(1, rows_per_replica + 1) if rows_per_replica % m == 0]


def technique_space(allowed: Sequence[str], data: int, mixed_precision_helps: bool,
                    precision: Optional[bool] = None) -> List[Techniques]:
    """Every combination of the ``allowed`` techniques ("recompute", "zero",
    "mixed_precision", "offload"; ZeRO only with replicas, mixed precision
    only when the model computes in 32 bits, offload only without replicas,
    which would mirror the weights), the one without any first.
    ``precision``: whether the graph computes in 16 bits whatever the plan
    (``memory.mixed_precision`` set: True), None when the search decides."""
    modes = RECOMPUTE if "recompute" in allowed else ("none",)
    zeros = (0, 1, 2) if "zero" in allowed and data > 1 else (0,)
    precisions = (precision,) if precision is not None else (False, True) if (
        "mixed_precision" in allowed and mixed_precision_helps) else (False,)
    offloads = (False, True) if "offload" in allowed and data == 1 else (False,)
    return [Techniques(*combination) for combination in
            itertools.product(modes, zeros, precisions, offloads)]


def kernel_counts(flops: Sequence[float], activation_bytes: Sequence[float]) -> List[int]:
    """Per op, whether it launches kernels (it computes or allocates): each
    that does costs ``KERNELS_PER_OP`` launches of ``LAUNCH_S`` a micro-batch."""
    return [int(bool(f or a)) for f, a in zip(flops, activation_bytes)]


def pipeline_length(times: Sequence[float], micro: int, transfer: float, schedule: str,
                    group_size: int = 1) -> float:
    """Seconds from a step's first forward to its last backward (the
    module docstring's closed forms): ``times`` per stage of one
    micro-batch, ``transfer`` between neighbouring stages."""
    p, slowest, total = len(times), max(times), sum(times)
    if p == 1:
        return micro * slowest
    if schedule == "zero_bubble":
        weight = slowest / 3  # half the backward, which is two thirds of the time
        filled = (total - slowest) / 3 * (p - 2 + min(micro, p)) / (p - 1)
        return (total + (micro - 1) * slowest - filled
                + 2 * (p - 1 + min(max(micro - 2, 0), p - 1)) * transfer
                + _waits(micro - p, p) * max(0.0, 2 * transfer - weight))
    k = micro if schedule == "gpipe" else group_size
    return (total + (micro - 1) * slowest + 2 * (p - 1) * transfer
            + _waits(math.ceil(micro / k), p) * max(0.0, 2 * transfer - (k - 1) * slowest))


def _waits(groups: int, stages: int) -> int:
    """The groups of a 1F1B step after the first whose backward waits for a
    gradient's round trip: all but one in every ``stages``."""
    return groups - 1 - ((groups - 2) // stages + 1) if groups >= 2 else 0


def in_flight(schedule: str, group_size: int, stages: int, stage: int, micro: int) -> int:
    """Micro-batches whose activations ``stage`` holds at its peak."""
    if schedule == "zero_bubble":
        return min(stages, micro)
    if schedule == "gpipe":
        return micro
    return min(group_size * (stages - stage), micro)


def best_setting(stages: Sequence[StageModel], data: int, rows_per_replica: float, space: Space,
                 cut_bytes: float, transfer_bandwidth: float, speed_up: float,
                 capacity: float) -> Setting:
    """The fastest setting of ``space`` that fits ``capacity`` bytes per
    device (a schedule other than the plainest - 1F1B, then smaller kFkB
    groups - only when ``SCHEDULE_TOLERANCE`` faster; equal times: the
    fewest techniques, then micro-batches), else the one needing the least
    memory. ``cut_bytes``: bytes per row crossing the stage boundaries (one
    transfer carries their mean); ``speed_up``: mixed precision's compute
    speed-up."""
    settings: List[Setting] = []
    cutoff = math.inf  # a fitting setting's step, with the tolerance a plainer one gets
    for micro, tech in itertools.product(space.counts, space.techniques):
        for setting in _settings(stages, data, rows_per_replica, micro, tech, space, cut_bytes,
                                 transfer_bandwidth, speed_up, cutoff):
            settings.append(setting)
            if setting.peak_memory <= capacity:
                cutoff = min(cutoff, setting.step_time_s * (1 + SCHEDULE_TOLERANCE))
    chosen = _chosen(settings, space.schedules, capacity)
    if space.virtual_stages == 1:
        return chosen
    # Its bubble and waits for transfers told apart (one more replay).
    return next(_settings(stages, data, rows_per_replica, chosen.micro_batches,
                          chosen.techniques, space, cut_bytes, transfer_bandwidth, speed_up,
                          waits=True))


def _chosen(settings: Sequence[Setting], schedules: Sequence[str], capacity: float) -> Setting:
    """``best_setting``'s choice among ``settings``."""
    fitting = [s for s in settings if s.peak_memory <= capacity]
    if not fitting:
        return min(settings, key=lambda s: (s.peak_memory, s.step_time_s))
    fastest = min(s.step_time_s for s in fitting)
    order = {name: i for i, name in enumerate(schedules)}

    def plainness(setting: Setting) -> Tuple[int, int]:
        return order[setting.schedule], setting.group_size
    plainest = min(plainness(s) for s in fitting
                   if s.step_time_s <= fastest * (1 + SCHEDULE_TOLERANCE))
    fitting = [s for s in fitting if plainness(s) == plainest]
    fastest = min(s.step_time_s for s in fitting)
    return min((s for s in fitting if s.step_time_s <= fastest * (1 + 1e-9)),
               key=lambda s: (len(s.techniques.names), s.micro_batches))


def _schedules(space: Space, micro: int, times: Sequence[float], transfer: float
               ) -> List[Tuple[str, int]]:
    """(schedule, group size) pairs worth trying for ``micro`` micro-batches
    through stages of ``times``: without a pipeline, one; a searched ZB-H1
    with at least a micro-batch per stage (as Qi et al. define it); kFkB
    with the given group size, else the divisors of ``micro`` from 2 up to
    the first whose other micro-batches cover a round trip (larger ones
    only hold more)."""
    if len(times) == 1:
        return [(space.schedules[0], 1)]
    searched = len(space.schedules) > 1
    pairs = [(name, 1) for name in space.schedules if name != "kfkb"
             and (name != "zero_bubble" or micro >= len(times) or not searched)]
    if "kfkb" in space.schedules and space.group_size is not None:
        pairs.append(("kfkb", space.group_size))
    elif "kfkb" in space.schedules:
        for k in range(min(2, micro), micro + 1):
            if micro % k == 0:
                pairs.append(("kfkb", k))
                if (k - 1) * max(times) >= 2 * transfer:
                    break
    return pairs


def _settings(stages: Sequence[StageModel], data: int, rows_per_replica: float, micro: int,
              tech: Techniques, space: Space, cut_bytes: float, bandwidth: float,
              speed_up: float, cutoff: float = math.inf, waits: bool = False) -> Iterator[Setting]:
    """One setting per schedule of ``space`` (one, 1F1B, without a pipeline
    or with virtual stages: none when even its busiest group's work takes
    longer than ``cutoff``, a step another setting beats, so that its
    schedule is not replayed; its waits for transfers told apart from its
    bubble if ``waits``)."""
    rows = rows_per_replica / micro
    mode = RECOMPUTE.index(tech.recompute)
    speed, scale = (speed_up, MIXED_ACTIVATIONS) if tech.mixed_precision else (1.0, 1.0)
    times = [stage.seconds(rows, mode, speed, scale) for stage in stages]
    p = len(stages)
    transfer = LATENCY_S + cut_bytes * rows * scale / (p - 1) / bandwidth if p > 1 else 0.0
    grads = [stage.grads for stage in stages]  # float32: the variables' dtype
    state = tuple(state_bytes(stage.param_bytes, data, tech.zero, tech.offload,
                              stage.optimizer_slots) for stage in stages)
    comm = tuple(stage.collective_bytes * rows * scale * micro + g.bytes
                 for stage, g in zip(stages, grads))
    sent = sum(comm) + 2 * cut_bytes * rows * scale * micro
    host = [offload_seconds(stage.param_bytes) if tech.offload else 0.0 for stage in stages]
    busy = tuple(t * micro + g.seconds + h for t, g, h in zip(times, grads, host))
    kept = [rows * scale * stage.kept[mode] for stage in stages]
    transient = [rows * scale * stage.transient[mode] for stage in stages]
    if space.virtual_stages > 1:
        setting = _interleaved(space.virtual_stages, micro, tech, times, transfer, sent, busy,
                               state, [g.seconds + h for g, h in zip(grads, host)], kept,
                               transient, cutoff, waits)
        if setting is not None:
            yield dataclasses.replace(setting, stage_comm=comm)
        return
    reduce_s = max(g.seconds + h for g, h in zip(grads, host))
    for name, k in _schedules(space, micro, times, transfer):
        memory = tuple(held + kept[s] * in_flight(name, k, p, s, micro) + transient[s]
                       for s, held in enumerate(state))
        length = pipeline_length(times, micro, transfer, name, k)
        still = pipeline_length(times, micro, 0.0, name, k)
        yield Setting(micro, tech, length + reduce_s, memory, sent, busy, state, name, k,
                      bubble_s=still - micro * max(times), transfer_s=length - still,
                      stage_comm=comm)


def _interleaved(virtual: int, micro: int, tech: Techniques, times: Sequence[float],
                 transfer: float, sent: float, busy: Tuple[float, ...],
                 state: Tuple[float, ...], reduce: Sequence[float], kept: Sequence[float],
                 transient: Sequence[float], cutoff: float = math.inf,
                 waits: bool = False) -> Optional[Setting]:
    """The interleaved 1F1B setting of ``times`` per stage (G V of them,
    stage s on group ``s % G``): each device holds its V stages' state, its
    group's peak of activations and its largest transient, all-reduces its
    stages' gradients (``reduce``: seconds per stage) one after the other.
    None, unreplayed, when its busiest group's work and gradients alone
    take longer than ``cutoff``. ``waits``: its waits for transfers told
    apart from its bubble (replayed without transfers), else counted in it."""
    groups = len(times) // virtual
    members = [range(g, len(times), groups) for g in range(groups)]
    slowest = max(sum(times[s] for s in stages) for stages in members)
    reduce_s = max(sum(reduce[s] for s in stages) for stages in members)
    if micro * slowest + reduce_s > cutoff:
        return None
    held = [sum(state[s] for s in stages) for stages in members]
    device = [h + peak + max(transient[s] for s in stages)
              for h, peak, stages in zip(held, group_peaks(kept, groups, micro), members)]
    length = interleaved_length(times, groups, micro, transfer)
    still = interleaved_length(times, groups, micro, 0.0) if waits else length
    return Setting(micro, tech, length + reduce_s,
                   tuple(device[s % groups] for s in range(len(times))), sent, busy,
                   tuple(held[s % groups] for s in range(len(times))), "1f1b", 1, virtual,
                   bubble_s=still - micro * slowest, transfer_s=length - still)
