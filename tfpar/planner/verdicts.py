"""Why each searched candidate lost to the chosen one, as rows a plan keeps
(its estimate's ``candidates``) and its report shows (no TensorFlow)."""
from typing import Any, Dict, List, Optional, Sequence

from tfpar.cluster.hardware import Hardware
from tfpar.ir.compact import plain
from tfpar.planner.candidate import Candidate
from tfpar.planner.choice import TENSOR_TOLERANCE, TOLERANCE
from tfpar.planner.memory import SLOTS, state_parts

__all__ = ["candidate_rows", "memory_parts"]

_GB = 2 ** 30


def memory_parts(candidate: Candidate) -> Dict[str, float]:
    """Bytes on the candidate's fullest device: weights, gradients and
    optimizer slots (its ``state_bytes`` split as the memory model counts
    them) and the activations and buffers that make up the rest."""
    tech = candidate.techniques
    slots = candidate.search.optimizer_slots if candidate.search is not None else SLOTS
    parts = state_parts(candidate.state_bytes, candidate.data, tech.zero, tech.offload, slots)
    parts["activations"] = max(candidate.memory_bytes - candidate.state_bytes, 0.0)
    return parts


def candidate_rows(candidates: Sequence[Candidate], chosen: Candidate,
                   hardware: Hardware) -> List[Dict[str, Any]]:
    """One row per candidate (mesh, schedule, virtual stages per device,
    micro-batches, techniques, estimated step and memory, the seconds of
    its step that are bubble and waits for transfers, ``why`` it lost or
    "chosen"), then one per mesh of the search that gave none, saying why."""
    capacity = hardware.memory_gb * _GB
    fitting = [c for c in candidates if c.memory_bytes <= capacity]
    fastest = min((c.step_time_s for c in fitting), default=None)
    rows = [{"data": c.data, "tensor": c.tensor, "pipeline": c.pipeline,
             "schedule": c.schedule, "group_size": c.group_size,
             "virtual_stages": c.virtual_stages, "bubble_s": c.bubble_s,
             "transfer_s": c.transfer_s, "micro_batches": c.micro_batches,
             "techniques": c.techniques.describe(),
             "step_time_s": c.step_time_s, "memory_bytes": c.memory_bytes,
             "why": "chosen" if c is chosen else _why(c, chosen, capacity, fastest)}
            for c in candidates]
    record = chosen.search
    if record is None:
        return rows
    planned = {(c.tensor, c.pipeline) for c in candidates}
    for tensor, pipeline in record.meshes:
        if (tensor, pipeline) in planned:
            continue
        why = ("not searched: auto.search_time_limit_s ran out first"
               if (tensor, pipeline) in record.unsearched else
               "left out: a tensor degree across nodes, after the one before it planned slower"
               if (tensor, pipeline) in record.pruned else
               "no sharded plan of this mesh fits or beats data parallelism")
        rows.append({"data": record.num_devices // (tensor * pipeline), "tensor": tensor,
                     "pipeline": pipeline, "why": why})
    return rows


def _interleaving(c: Candidate, chosen: Candidate) -> str:
    """What interleaving changed between ``c`` and ``chosen`` when they are
    one mesh with different virtual stages: each one's bubble and waits for
    transfers (else nothing)."""
    if (c.data, c.tensor, c.pipeline) != (chosen.data, chosen.tensor, chosen.pipeline) \
            or c.virtual_stages == chosen.virtual_stages:
        return ""

    def terms(x: Candidate) -> str:
        return (f"{x.virtual_stages} virtual stage{'s' if x.virtual_stages > 1 else ''}: "
                f"bubble {plain(x.bubble_s * 1e3, 3)} ms, waits for transfers "
                f"{plain(x.transfer_s * 1e3, 3)} ms")
    return f" ({terms(c)}; chosen {terms(chosen)})"


def _why(c: Candidate, chosen: Candidate, capacity: float, fastest: Optional[float]) -> str:
    """Why ``c`` lost to ``chosen`` (``planner.choice.choose``'s rules)."""
    if c.memory_bytes > capacity:
        return (f"does not fit: needs {c.memory_bytes / _GB:.1f} GB, "
                f"{(c.memory_bytes - capacity) / _GB:.1f} GB over {capacity / _GB:g} GB")
    if c.step_time_s > chosen.step_time_s:
        return f"slower by {c.step_time_s / chosen.step_time_s - 1:.1%}" + _interleaving(c, chosen)
    if fastest is not None and c.step_time_s <= fastest * (1 + TOLERANCE) \
            and c.stage_count > chosen.stage_count:
        return (f"within {TOLERANCE:.0%} of the fastest, where fewer pipeline stages win "
                "(bubbles and stage balance are where estimates err most)"
                + _interleaving(c, chosen))
    if c.tensor > chosen.tensor and c.stage_count == chosen.stage_count:
        return (f"within {TENSOR_TOLERANCE:.0%} of the chosen one, where the lower tensor "
                "degree wins")
    if c.virtual_stages > chosen.virtual_stages:
        return (f"within {TENSOR_TOLERANCE:.0%} of the chosen one, where fewer virtual stages "
                "win" + _interleaving(c, chosen))
    return "shards layers of a graph built before its plan existed (see the notes)"
