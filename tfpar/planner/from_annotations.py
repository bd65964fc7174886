"""Plan from the user's scopes (no search): VirtualDevices + simple estimates."""
import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

from tfpar import fallback
from tfpar.cluster.hardware import device_hardware
from tfpar.cluster.virtual_device import assign_devices
from tfpar.config import Config
from tfpar.errors import PlanError
from tfpar.ir.compact import device_ranges
from tfpar.ir.plan import Plan, TaskGraphPlan, pinned_plan
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec
from tfpar.planner.balance import well_formed_shares
from tfpar.ir.schedule import SCHEDULES

__all__ = ["plan_from_annotations"]


def plan_from_annotations(specs: Sequence[TaskGraphSpec], devices: Sequence[str],
                          config: Config, stats: Dict[str, Sequence[int]],
                          graph: Any = None, virtual_stages: Optional[int] = None) -> Plan:
    """Turn annotated TaskGraphs into a Plan: one TaskGraph is data parallelism
    (with gradient accumulation when micro-batched); several form a pipeline,
    one stage per TaskGraph in creation order (Whale §3.1.2), replicated whole
    when the devices allow (nested data parallelism, Whale §3.2.1).

    Args:
      specs: the TaskGraphs (one implicit replicate TaskGraph when unannotated).
      devices: available devices.
      config: tfpar config (pipeline settings, sharing, a pinned plan).
      stats: per TaskGraph, ``num_ops`` and ``param_bytes`` (trainable, one copy);
        ``split`` maps a split TaskGraph's index to (the devices its shards were
        built on, its chosen patterns, its shard shares).
      graph: the graph planned: devices the scopes' TaskGraphs share without
        asking, or leave idle, are said of it (``fallback``).
      virtual_stages: stages per device group the automatic search chose
        (None: ``pipeline.virtual_stages``).

    Raises:
      PlanError: the annotations need a feature this build does not provide yet,
        or a pinned plan does not fit the model / devices.
    """
    pinned = pinned_plan(config)
    if pinned is not None:
        tgs = _pinned_task_graphs(pinned, specs, devices, stats.get("split", {}))
        num_micro_batch, schedule, group_size, virtual = (
            pinned.num_micro_batch, pinned.schedule, pinned.group_size, pinned.virtual_stages)
    else:
        virtual = virtual_stages or config.get("pipeline.virtual_stages")
        tgs = _annotated_task_graphs(specs, devices, config, stats.get("split", {}), virtual)
        if graph is not None:  # interleaved stages share devices as asked
            _say_devices(tgs, devices, config.get("cluster.colocate_split_and_replicate")
                         or virtual > 1, graph)
        num_micro_batch = config.get("pipeline.num_micro_batch")
        schedule, group_size = config.get("pipeline.schedule"), config.get("pipeline.group_size")
        schedule = "1f1b" if schedule == "auto" else schedule
    _check_pipeline(tgs, num_micro_batch, schedule, virtual)
    tgs = [dataclasses.replace(tg, num_ops=stats["num_ops"][i], param_bytes=stats["param_bytes"][i])
           for i, tg in enumerate(tgs)]
    # Copies of the whole model; a TaskGraph with more replicas than that splits
    # each copy's rows further (bridge layers between it and its neighbours).
    r = math.gcd(*(len(tg.replicas) for tg in tgs))
    shares = pinned.batch_shares if pinned is not None else ()
    if shares and not well_formed_shares(shares, r):
        raise PlanError(f"tfpar: the plan's batch_shares {list(shares)} must be one int >= 1 per "
                        f"replica of the model ({r})")
    # The search's estimate of a pinned plan; others are costed by the runtime
    # (``runtime.prediction``), which reads the graph.
    estimate = dict(pinned.estimate) if pinned is not None else {}
    return Plan(task_graphs=tuple(tgs), data_parallel_degree=r, num_micro_batch=num_micro_batch,
                schedule=schedule, group_size=group_size, estimate=estimate,
                sharding=dict(pinned.sharding) if pinned is not None else {},
                batch_shares=shares, virtual_stages=virtual)


def _annotated_task_graphs(specs, devices, config, split, virtual: int) -> List[TaskGraphPlan]:
    """Each device of a replicate TaskGraph's VirtualDevices runs one replica;
    each VirtualDevice of a split TaskGraph runs one sharded replica (with
    ``virtual`` stages per device group: dealt round-robin)."""
    requests = [(s.name, s.device_count) for s in specs]
    share = config.get("cluster.colocate_split_and_replicate")
    assignment = assign_devices(requests, devices, share, virtual)
    hardware = device_hardware(config.get("cluster.hardware"), len(devices))
    # A split TaskGraph's devices are fixed as it is built (its variables are
    # made sharded there), before the scopes after it are known: kept.
    if (hardware is not None and len(specs) > 1 and config.get("balance.hardware_aware")
            and not split):
        devices = _by_memory_for_stages(devices, hardware, assignment)
        assignment = assign_devices(requests, devices, share, virtual)
    tgs = []
    for spec, vds in zip(specs, assignment.virtual_devices):
        if spec.strategy == Strategy.SPLIT:
            built, patterns, shares = split.get(spec.index, (list(vds[0]), {}, ()))
            if list(vds[0]) != list(built):
                raise PlanError(
                    f"tfpar: split TaskGraph '{spec.name}' was built on {list(built)}, but the "
                    f"scopes opened after it move it to {list(vds[0])}; set "
                    "cluster.colocate_split_and_replicate or reorder the scopes")
            tgs.append(TaskGraphPlan(name=spec.name, strategy=spec.strategy.value,
                                     device_count=len(vds[0]), replicas=tuple(vds),
                                     patterns=dict(patterns), shard_shares=tuple(shares)))
        else:
            tgs.append(TaskGraphPlan(name=spec.name, strategy=spec.strategy.value,
                                     device_count=len(vds[0]),
                                     replicas=tuple((d,) for vd in vds for d in vd)))
    return tgs


def _say_devices(tgs: Sequence[TaskGraphPlan], devices: Sequence[str], share: bool,
                 graph: Any) -> None:
    """Say (``fallback``) that TaskGraphs share devices they asked for one by
    one (their requests add up to more than exist), and which devices no
    TaskGraph uses."""
    k, counts = len(devices), [tg.device_count for tg in tgs]
    if not share and sum(counts) > k and min(counts) < k:
        runs: List[List[TaskGraphPlan]] = []
        for tg in tgs:
            if runs and runs[-1][-1].devices == tg.devices:
                runs[-1].append(tg)
            else:
                runs.append([tg])
        fallback.fall_back(
            f"{len(tgs)} TaskGraphs asking for {sum(counts)} devices in all, on {k}",
            "they share devices: " + "; ".join(
                ", ".join(f"'{tg.name}'" for tg in run) + f" on {device_ranges(run[0].devices, devices)}"
                for run in runs),
            f"For devices of their own, use {sum(counts)} devices (cluster.num_devices) or "
            "fewer scopes", graph)
    used = {d for tg in tgs for d in tg.devices}
    idle = [d for d in devices if d not in used]
    if idle:
        fallback.fall_back(
            f"{k} devices", f"{device_ranges(idle, devices)} left idle: one copy of the model uses "
            f"{len(used)}, and {k} is not a multiple of {len(used)}, so the model is not "
            "replicated on the rest (nested data parallelism)",
            f"Use a multiple of {len(used)} devices (cluster.num_devices), or ask for the idle "
            "ones in a scope (a larger replicate(n))", graph)


def _by_memory_for_stages(devices: Sequence[str], hardware, assignment) -> List[str]:
    """Reorder ``devices`` so that, re-assigned, earlier pipeline stages get the
    devices with more memory (Whale §3.3.2: early stages keep more micro-batches'
    activations alive). Stage-major slots take devices by memory, descending."""
    position = {d: i for i, d in enumerate(devices)}
    slots = [position[d] for vds in assignment.virtual_devices for vd in vds for d in vd]
    if len(set(slots)) < len(slots):  # TaskGraphs share devices: nothing to order
        return list(devices)
    slots += [p for p in range(len(devices)) if p not in set(slots)]  # unused last
    ranked = sorted(range(len(devices)), key=lambda i: -hardware[i].memory_gb)
    reordered = list(devices)
    for slot, i in zip(slots, ranked):
        reordered[slot] = devices[i]
    return reordered


def _check_pipeline(tgs: Sequence[TaskGraphPlan], num_micro_batch: int, schedule: str,
                    virtual: int) -> None:
    if len(tgs) == 1 and num_micro_batch == 1:
        return
    if schedule not in SCHEDULES:
        raise PlanError(f"tfpar: pipeline.schedule '{schedule}' is not implemented in this "
                        f"build; choose one of {', '.join(SCHEDULES)}")
    groups = len(tgs) // virtual
    if virtual > 1 and (schedule != "1f1b" or num_micro_batch % groups):
        raise PlanError(
            f"tfpar: pipeline.virtual_stages {virtual} interleaves 1F1B (Narayanan et al. "
            f"SC'21 §2.2) in rounds of one micro-batch per device group: it needs schedule "
            f"'1f1b' (got '{schedule}') and pipeline.num_micro_batch a multiple of the "
            f"{groups} groups (got {num_micro_batch})")


def _pinned_task_graphs(plan: Plan, specs: Sequence[TaskGraphSpec], devices: Sequence[str],
                        split) -> List[TaskGraphPlan]:
    """The pinned TaskGraphs, checked against the model's; split TaskGraphs
    report the patterns the matcher built."""
    if len(plan.task_graphs) != len(specs):
        raise PlanError(f"tfpar: the pinned plan has {len(plan.task_graphs)} TaskGraphs but "
                        f"the model has {len(specs)} ({', '.join(s.name for s in specs)})")
    for tg, spec in zip(plan.task_graphs, specs):
        unknown = [d for d in tg.devices if d not in devices]
        if unknown:
            raise PlanError(f"tfpar: pinned plan TaskGraph '{tg.name}' uses devices "
                            f"{device_ranges(unknown)} that do not exist; available: "
                            f"{device_ranges(devices)}")
        if tg.strategy != spec.strategy.value:
            raise PlanError(f"tfpar: pinned plan TaskGraph '{tg.name}' has strategy "
                            f"'{tg.strategy}' but the model's is '{spec.strategy.value}'")
    return [dataclasses.replace(tg, patterns=dict(split[spec.index][1]),
                                shard_shares=tuple(split[spec.index][2]))
            if spec.index in split else tg for tg, spec in zip(plan.task_graphs, specs)]
