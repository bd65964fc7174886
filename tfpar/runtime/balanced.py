"""A plan's batch shares and a split TaskGraph's shard shares on mixed devices
(``balance.hardware_aware``; Whale §3.3.1 intra-TaskGraph balance,
``planner.balance``)."""
from typing import List, Sequence, Tuple

from tfpar import fallback
from tfpar.cluster.hardware import Hardware, device_hardware, slowest
from tfpar.errors import PlanError
from tfpar.ir.plan import Plan, pinned_plan
from tfpar.planner.stage_costs import stage_costs
from tfpar.planner.balance import balance_load, integer_shares, well_formed_shares
from tfpar.analysis.analysed import Analysed
from tfpar.analysis.stages import canonical_device
from tfpar.runtime.automatic import planning_batch
from tfpar.runtime.context import Runtime

__all__ = ["batch_shares", "shard_shares"]


def batch_shares(analysed: Analysed, rt: Runtime, plan: Plan) -> Tuple[int, ...]:
    """Each replica of the model's weight in the global batch: its rows in
    proportion to its single-precision FLOP rate (a replica runs as fast as
    its slowest stage; a stage of w devices per replica, as w of its slowest),
    within its memory when the plan is one TaskGraph (its weights, gradients
    and slots whatever its rows, plus its rows' activations: Algorithm 1).
    Empty (even rows) on like devices, with one replica, with the balance off,
    and in multi-process jobs (every process cuts its own batch)."""
    hardware = device_hardware(rt.config.get("cluster.hardware"), len(rt.devices))
    if (hardware is None or plan.data_parallel_degree == 1 or plan.batch_shares
            or not rt.config.get("balance.hardware_aware")):
        return ()
    by_device = dict(zip(rt.devices, hardware))
    replicas = [_replica_devices(plan, r, by_device) for r in range(plan.data_parallel_degree)]
    speeds = [_replica_speed(stages) for stages in replicas]
    memory = [min(hw.memory_gb for stage in stages for group in stage for hw in group) * 2 ** 30
              for stages in replicas]
    if len(set(speeds)) == 1 and len(set(memory)) == 1:
        return ()
    if rt.cluster is not None or rt.config.get("communication.backend") == "horovod":
        fallback.fall_back(
            "balance.hardware_aware on mixed cluster.hardware", "the replicas take even rows: "
            "in a job of several processes each process cuts its own batch", "Run the mixed "
            "devices in one process for rows by speed, or set balance.hardware_aware false to "
            "silence this", analysed.graph)
        return ()
    batch_bytes = fixed_bytes = 0.0
    if len(plan.task_graphs) == 1:
        order, view = analysed.view
        rows = planning_batch(rt, view) / plan.num_micro_batch
        costs = stage_costs(view, [0] * len(order), 1, rows, slowest(hardware))
        batch_bytes, fixed_bytes = costs.activation_bytes[0], costs.fixed_bytes[0]
    return integer_shares(balance_load(speeds, memory, batch_bytes, fixed_bytes).ratios)


def shard_shares(rt: Runtime, index: int, devices: Sequence[str]) -> Tuple[int, ...]:
    """Each device's weight in every dimension split TaskGraph ``index`` on
    ``devices`` cuts: a pinned plan's ``shard_shares`` for it, else its
    single-precision FLOP rate, so every shard of a layer takes as long
    (Whale §3.3.1, Formula 1's ratios). Shards are made as the model is
    built, before its size is known, so memory does not move them. Empty
    (even shards) on like devices or with the balance off."""
    plan = pinned_plan(rt.config)
    pinned = plan.task_graphs if plan is not None else ()
    shares = pinned[index].shard_shares if index < len(pinned) else ()
    if shares:
        if not well_formed_shares(shares, len(devices)):
            raise PlanError(f"tfpar: the plan's shard_shares {list(shares)} of TaskGraph "
                            f"'{pinned[index].name}' must be one int >= 1 per device "
                            f"({len(devices)})")
        return shares
    hardware = device_hardware(rt.config.get("cluster.hardware"), len(rt.devices))
    if hardware is None or not rt.config.get("balance.hardware_aware"):
        return ()
    by_device = {canonical_device(d): hw for d, hw in zip(rt.devices, hardware)}
    return integer_shares([by_device[canonical_device(d)].flops_per_s("fp32") for d in devices])


def _replica_devices(plan: Plan, replica: int, by_device) -> List[List[List[Hardware]]]:
    """Per stage, the hardware of each device group replica ``replica`` runs on."""
    stages = []
    for tg in plan.task_graphs:
        per_replica = len(tg.replicas) // plan.data_parallel_degree
        groups = tg.replicas[replica * per_replica:(replica + 1) * per_replica]
        stages.append([[by_device[d] for d in group] for group in groups])
    return stages


def _replica_speed(stages: Sequence[Sequence[Sequence[Hardware]]]) -> float:
    return min(len(stage) * min(len(group) * min(hw.flops_per_s("fp32") for hw in group)
                                for group in stage)
               for stage in stages)
