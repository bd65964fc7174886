"""What the automatic search answers: a ``Candidate`` mesh with its estimates,
its ``Part``s, and the ``SearchRecord`` of how the search went (no TensorFlow)."""
import collections
import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.ir.outcome import Outcome
from tfpar.planner.memory import SLOTS, Techniques
from tfpar.planner.step_model import Setting

__all__ = ["ALL_TECHNIQUES", "Candidate", "Part", "SearchRecord", "shared_out"]

ALL_TECHNIQUES = ("recompute", "zero", "mixed_precision", "offload")


@dataclasses.dataclass(frozen=True)
class Part:
    """The estimates of one piece of a candidate - a pipeline stage, or a layer
    of a sharded plan (with its ops): busy seconds per step, bytes per device,
    bytes sent per step."""

    seconds: float
    memory_bytes: float
    comm_bytes: float
    ops: Tuple[int, ...] = ()


def shared_out(setting: Setting, groups: int, stage_of: Sequence[int],
               before: Sequence[Part], state: Sequence[float]) -> Tuple[Part, ...]:
    """Parts with ``setting``'s estimates - its micro-batches, memory
    techniques and schedule, as the plan's estimate counts them - shared out
    among the pieces ``before`` (each of stage ``stage_of``, with its
    estimates before them, and ``state`` bytes of its weights, gradients and
    slots): a stage's busy seconds and bytes sent in proportion to its
    pieces' own, and the bytes of a device group's devices (its stages'
    ``s % groups``: interleaved stages share them) - weights, gradients and
    slots, and the rest - in proportion to its pieces' state and
    activations. A stage's pieces add up to the stage, and the pieces on a
    device group's devices to their bytes."""
    group_of = [s % groups for s in stage_of]
    seconds = _shares([p.seconds for p in before], stage_of)
    comm = _shares([p.comm_bytes for p in before], stage_of)
    held = _shares(state, group_of)
    active = _shares([p.memory_bytes - w for p, w in zip(before, state)], group_of)
    return tuple(
        Part(setting.stage_seconds[s] * t,
             setting.state_bytes[g] * h + (setting.memory_bytes[g] - setting.state_bytes[g]) * a,
             setting.stage_comm[s] * c, p.ops)
        for p, s, g, t, c, h, a in zip(before, stage_of, group_of, seconds, comm, held, active))


def _shares(values: Sequence[float], together: Sequence[int]) -> List[float]:
    """Each value's share of the sum of those with its key in ``together``
    (equal shares when they sum to nothing)."""
    sums: Dict[int, float] = collections.defaultdict(float)
    for value, key in zip(values, together):
        sums[key] += value
    counts = collections.Counter(together)
    return [value / sums[key] if sums[key] else 1 / counts[key]
            for value, key in zip(values, together)]


@dataclasses.dataclass(frozen=True)
class SearchRecord:
    """How a search went and what its estimates assume: the feasible
    ``meshes`` (tensor, pipeline) in search order, those it did not plan -
    ``unsearched`` (its ``time_limit_s`` ran out first) and ``pruned``
    (tensor degrees across nodes, once one planned slower than the one
    before) - and the ``seconds`` it took; the device type it costed
    (``hardware``, the slowest of the cluster) and how many, the model's
    compute dtype, and the global batch (``batch_known``: the graph or
    config states it); the memory techniques it was allowed (names); the
    optimizer's slots per weight (``ModelView.optimizer_slots``)."""

    meshes: Tuple[Tuple[int, int], ...]
    unsearched: Tuple[Tuple[int, int], ...]
    pruned: Tuple[Tuple[int, int], ...]
    time_limit_s: float
    seconds: float
    hardware: Hardware
    num_devices: int
    dtype: str
    global_batch: int
    batch_known: bool
    techniques: Tuple[str, ...] = ()
    optimizer_slots: float = SLOTS


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One (data, tensor, pipeline) mesh with its estimates, the stage of every
    op, the sharded layers: (name scope, sharding candidate) for every layer
    that runs in a split TaskGraph (with tensor and pipeline both > 1: every
    layer, and ``split_stages`` its pipeline stage), the estimates of its
    parts (stages, or layers of a sharded plan); its micro-batches per step
    and memory techniques, and the bytes of weights, gradients and optimizer
    slots on its fullest device (``state_bytes``).

    How it was found: ``stage_search`` (with a pipeline) and
    ``sharding_search`` (with a tensor degree), ``search`` (the search's
    record). ``flops``: FLOPs per step, the model's (3 x forward) and those
    its recomputation adds; ``faster_with``: its best setting with every
    memory technique (``ALL_TECHNIQUES``) that fits, when the search was not
    allowed them all and it is faster. ``virtual_stages``: interleaved 1F1B
    with that many stages per device (``stages`` then numbers G V of them,
    ``pipeline`` G); ``bubble_s`` and ``transfer_s``: how much of its step
    is bubble and waiting for transfers (``step_model.Setting``'s), and
    ``busy_s`` the mean busy seconds of its device groups a step;
    ``sequence_parallel``: its split TaskGraphs run sequence parallel
    (``split.sequence_parallel``)."""

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
    micro_batches: int = 1
    techniques: Techniques = Techniques()
    state_bytes: float = 0.0
    schedule: str = "1f1b"
    group_size: int = 1
    stage_search: Optional[Outcome] = None
    sharding_search: Optional[Outcome] = None
    flops: Tuple[float, float] = (0.0, 0.0)
    faster_with: Optional[Setting] = None
    search: Optional[SearchRecord] = None
    stage_memory: Tuple[float, ...] = ()
    virtual_stages: int = 1
    bubble_s: float = 0.0
    transfer_s: float = 0.0
    busy_s: float = 0.0
    sequence_parallel: bool = False

    @property
    def stage_count(self) -> int:
        """Its pipeline stages: a stage per device group, or V interleaved."""
        return self.pipeline * self.virtual_stages

    def describe(self) -> str:
        """'data 4 x tensor 2 x pipeline 2, 8 micro-batches, zero_bubble,
        recompute full' (the schedule when not 1F1B; '..., 2 virtual
        stages, ...' when interleaved)."""
        micro = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
        if self.virtual_stages > 1:
            micro = f", {self.virtual_stages} virtual stages{micro}"
        schedule = {"1f1b": "", "kfkb": f", kfkb k={self.group_size}"}.get(
            self.schedule, f", {self.schedule}")
        used = self.techniques.describe()
        return (f"data {self.data} x tensor {self.tensor} x pipeline {self.pipeline}{micro}"
                + schedule + (", sequence parallel" if self.sequence_parallel else "")
                + (f", {used}" if used != "none" else ""))
