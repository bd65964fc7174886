"""The (tensor, pipeline) meshes the automatic search plans: those dividing
the devices, then those every replica and stage can be given work (no TensorFlow)."""
from typing import Callable, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.errors import PlanError
from tfpar.planner.model_view import ModelView, stage_units

__all__ = ["candidate_meshes", "feasible_meshes", "meshes_named"]


def meshes_named(meshes: Sequence[Tuple[int, int]]) -> str:
    """'tensor x pipeline 2x1, 4x1, 1x2' (at most 12, then how many more)."""
    named = [f"{t}x{p}" for t, p in meshes[:12]]
    more = f" and {len(meshes) - 12} more" if len(meshes) > 12 else ""
    return "tensor x pipeline " + ", ".join(named) + more



def candidate_meshes(model: ModelView, num_devices: int, pipeline: Optional[int],
            hardware: Hardware) -> List[Tuple[int, int]]:
    """(tensor, pipeline) degrees dividing the devices, tensor degrees only for
    a model whose ops are named; with a pipeline, tensor groups within a node
    (``devices_per_node``: Narayanan et al., SC'21, §3.2, takeaway 1). A
    tensor group is a divisor of a node or whole nodes, never straddling two
    (7 of a node of 8 would)."""
    pipelines = [pipeline] if pipeline else [p for p in range(1, num_devices + 1)
                                             if num_devices % p == 0]
    meshes = [(1, p) for p in pipelines if num_devices % p == 0]
    if model.names is None:
        return meshes
    node = hardware.devices_per_node or num_devices
    tensors = [t for t in range(2, num_devices + 1)
               if num_devices % t == 0 and (node % t == 0 or t % node == 0)]
    meshes += [(t, 1) for t in tensors if (pipeline or 1) == 1]
    meshes += [(t, p) for p in pipelines if p > 1 for t in tensors
               if t <= node and num_devices % (t * p) == 0]
    return meshes



def feasible_meshes(meshes: List[Tuple[int, int]], model: ModelView, num_devices: int,
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

