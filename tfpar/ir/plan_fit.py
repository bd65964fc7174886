"""A pinned plan made for more devices than this process has - a cluster's
plan from ``tfpar plan --model``, rehearsed on a workstation - built on the
devices here: its first copies of the model that fit, each TaskGraph split
and staged as planned, with fewer copies (a smaller data-parallel degree).
Numbers do not change with the copies (tfpar computes one device's).

Imports nothing of TensorFlow."""
import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.errors import PlanError
from tfpar.ir.compact import device_ranges
from tfpar.ir.plan import Plan

__all__ = ["fit_to_devices"]


def fit_to_devices(plan: Plan, devices: Sequence[str]) -> Optional[Tuple[Plan, int]]:
    """``plan`` on ``devices``: None when it names only devices here; else
    (the plan keeping its first copies of the model that fit, its devices
    renamed onto ``devices`` in the order it first names them, and the
    number of devices it was made for). Copy k of a TaskGraph is its k-th
    run of ``len(replicas) / data_parallel_degree`` replicas, as the planner
    lays them out.

    Raises:
      PlanError: the plan names devices that are not here although it needs
        no more than are (another host's or job's names), or one copy of the
        model needs more devices than are here.
    """
    named = _named(plan)
    if set(named) <= set(devices):
        return None
    if len(named) <= len(devices):
        unknown = [d for d in named if d not in devices]
        raise PlanError(f"tfpar: the pinned plan uses devices {device_ranges(unknown)} that do "
                        f"not exist here (available: {device_ranges(devices)})")
    copies = _copies(plan)
    kept = 1
    while kept < plan.data_parallel_degree and len(_devices_of(copies[:kept + 1])) <= len(devices):
        kept += 1
    needs = _devices_of(copies[:kept])
    if len(needs) > len(devices):
        raise PlanError(
            f"tfpar: the pinned plan was made for {len(named)} devices; one copy of the model in "
            f"it needs {len(needs)} ({_shape(plan)}), more than the {len(devices)} here: pin a "
            f"plan made for these devices, or one whose tensor x pipeline degree is at most "
            f"{len(devices)}")
    rename = dict(zip(needs, devices))
    task_graphs = []
    for i, tg in enumerate(plan.task_graphs):
        replicas = tuple(tuple(rename[d] for d in r) for copy in copies[:kept] for r in copy[i])
        width = sum(len(r) for r in replicas)
        task_graphs.append(dataclasses.replace(
            tg, replicas=replicas,
            device_count=tg.device_count if tg.strategy == "split" else math.gcd(tg.device_count,
                                                                                  width)))
    return dataclasses.replace(
        plan, task_graphs=tuple(task_graphs), data_parallel_degree=kept,
        batch_shares=plan.batch_shares[:kept],
        estimate=_estimate_of(plan.estimate, named, needs)), len(named)


def _named(plan: Plan) -> List[str]:
    """Every device the plan names, in the order it first names them."""
    return list(dict.fromkeys(d for tg in plan.task_graphs for d in tg.devices))


def _copies(plan: Plan) -> List[List[List[Tuple[str, ...]]]]:
    """Per copy of the model, per TaskGraph, that copy's replicas."""
    copies = plan.data_parallel_degree
    return [[tg.replicas[k * (len(tg.replicas) // copies):(k + 1) * (len(tg.replicas) // copies)]
             for tg in plan.task_graphs] for k in range(copies)]


def _devices_of(copies) -> List[str]:
    """The devices ``copies`` use, in the order they first name them."""
    return list(dict.fromkeys(d for copy in copies for replicas in copy for r in replicas
                              for d in r))


def _shape(plan: Plan) -> str:
    split = max((tg.device_count for tg in plan.task_graphs if tg.strategy == "split"), default=1)
    return f"tensor {split} x {len(plan.task_graphs)} TaskGraphs"


def _estimate_of(estimate: Dict, named: Sequence[str], kept: Sequence[str]) -> Dict:
    """The planned cluster's estimate, its per-device memory that of the
    devices kept."""
    memory = estimate.get("memory_bytes_per_device")
    if not memory or len(memory) != len(named):
        return dict(estimate)
    at = {d: i for i, d in enumerate(named)}
    return {**estimate, "memory_bytes_per_device": [memory[at[d]] for d in kept]}
