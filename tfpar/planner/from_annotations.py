"""Plan from the user's scopes (no search): VirtualDevices + simple estimates."""
from typing import Dict, Sequence

from tfpar.cluster.virtual_device import assign_devices
from tfpar.config import Config
from tfpar.errors import PlanError
from tfpar.ir.plan import Plan, TaskGraphPlan
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec

__all__ = ["plan_from_annotations"]


def plan_from_annotations(specs: Sequence[TaskGraphSpec], devices: Sequence[str],
                          config: Config, stats: Dict[str, int]) -> Plan:
    """Turn annotated TaskGraphs into a Plan.

    Args:
      specs: the TaskGraphs (one implicit replicate TaskGraph when unannotated).
      devices: available devices.
      config: tfpar config (pipeline settings, sharing, a pinned plan).
      stats: ``num_ops`` and ``param_bytes`` (trainable, one copy) of the model.

    Raises:
      PlanError: the annotations need a feature this build does not provide yet,
        or a pinned plan does not fit the model / devices.
    """
    if len(specs) != 1 or specs[0].strategy != Strategy.REPLICATE:
        kinds = ", ".join(f"{s.name}={s.strategy.value}" for s in specs)
        raise PlanError(
            f"tfpar: only a single replicate TaskGraph (data parallelism) is supported by "
            f"this build; the model declares [{kinds}]. Pipelines of several TaskGraphs "
            "and split scopes are not implemented yet")
    spec = specs[0]
    pinned = config.plan
    if pinned is not None:
        tg = _pinned_task_graph(Plan.from_dict(pinned), spec, devices)
        num_micro_batch = Plan.from_dict(pinned).num_micro_batch
    else:
        assignment = assign_devices([(spec.name, spec.device_count)], devices,
                                    config.get("cluster.colocate_split_and_replicate"))
        replicas = tuple((d,) for vd in assignment.virtual_devices[0] for d in vd)
        tg = TaskGraphPlan(name=spec.name, strategy=spec.strategy.value,
                           device_count=len(assignment.virtual_devices[0][0]),
                           replicas=replicas)
        num_micro_batch = config.get("pipeline.num_micro_batch")
    tg = TaskGraphPlan(name=tg.name, strategy=tg.strategy, device_count=tg.device_count,
                       replicas=tg.replicas, num_ops=stats.get("num_ops", 0),
                       param_bytes=stats.get("param_bytes", 0))
    r = len(tg.replicas)
    grad_bytes = stats.get("param_bytes", 0)
    estimate = {
        "step_time_s": None,  # no cost model for annotated plans yet
        "memory_bytes_per_device": [2 * grad_bytes] * r,  # weights + gradients
        "comm_bytes": int(2 * (r - 1) / r * grad_bytes) if r > 1 else 0,  # ring all-reduce
    }
    return Plan(task_graphs=(tg,), data_parallel_degree=r, num_micro_batch=num_micro_batch,
                schedule=config.get("pipeline.schedule"),
                group_size=config.get("pipeline.group_size"), estimate=estimate)


def _pinned_task_graph(plan: Plan, spec: TaskGraphSpec, devices: Sequence[str]) -> TaskGraphPlan:
    if len(plan.task_graphs) != 1:
        raise PlanError(f"tfpar: the pinned plan has {len(plan.task_graphs)} TaskGraphs but "
                        f"the model has 1 ('{spec.name}')")
    tg = plan.task_graphs[0]
    unknown = [d for d in tg.devices if d not in devices]
    if unknown:
        raise PlanError(f"tfpar: pinned plan TaskGraph '{tg.name}' uses devices {unknown} "
                        f"that do not exist; available: {list(devices)}")
    if tg.strategy != spec.strategy.value:
        raise PlanError(f"tfpar: pinned plan TaskGraph '{tg.name}' has strategy "
                        f"'{tg.strategy}' but the model's is '{spec.strategy.value}'")
    return tg
