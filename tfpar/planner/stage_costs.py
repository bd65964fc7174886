"""The cost model of a pipeline's stages from a model's ops: compute, weights,
activations and the transfers between stages (no TensorFlow)."""
import dataclasses
from typing import List, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.planner.comm import LATENCY_S
from tfpar.planner.model_view import ModelView, sent_bytes, timed
from tfpar.planner.memory import state_per_weight

__all__ = ["StageCosts", "stage_costs", "stage_members"]


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per stage: forward time of one micro-batch (backward is twice it), the
    bytes of its weights, the activations one micro-batch keeps alive; the delay
    of one cross-stage transfer; bytes crossing stages per micro-batch; the
    optimizer's slots per weight."""

    forward_s: Tuple[float, ...]
    param_bytes: Tuple[float, ...]
    activation_bytes: Tuple[float, ...]
    transfer_s: float
    cut_bytes: float
    optimizer_slots: float

    @property
    def backward_s(self) -> Tuple[float, ...]:
        return tuple(2 * f for f in self.forward_s)

    @property
    def fixed_bytes(self) -> Tuple[float, ...]:
        return tuple(state_per_weight(self.optimizer_slots) * b for b in self.param_bytes)



def stage_costs(model: ModelView, stages: Sequence[int], num_stages: int, rows: float,
                hardware: Hardware) -> StageCosts:
    """The cost model of ``stages`` (stage of each op) for micro-batches of ``rows``."""
    model = timed(model, hardware)
    speed = hardware.flops_per_s(model.compute_dtype)
    bandwidth = hardware.link(num_stages)  # neighbouring stages, consecutive devices
    forward = [0.0] * num_stages
    params = [0.0] * num_stages
    activations = [0.0] * num_stages
    for i, stage in enumerate(stages):
        forward[stage] += model.flops[i] * rows / speed
        params[stage] += model.param_bytes[i]
        activations[stage] += model.kept[i] * rows
    cut = sent_bytes(model.edges, stages) * rows
    transfer = LATENCY_S + cut / max(num_stages - 1, 1) / bandwidth if num_stages > 1 else 0.0
    return StageCosts(tuple(forward), tuple(params), tuple(activations), transfer, cut,
                      model.optimizer_slots)


def stage_members(stage_of: Sequence[int], num_stages: int) -> List[List[int]]:
    """The items of each stage, in order, from each item's stage."""
    members: List[List[int]] = [[] for _ in range(num_stages)]
    for i, stage in enumerate(stage_of):
        members[stage].append(i)
    return members
