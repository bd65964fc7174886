"""The cost model of the plan that runs, one for every plan: costed when the
graph is planned (``Predicted``: the planner's stage costs of the ops each
TaskGraph holds, per batch row, on the device the plan assumes), it gives
the plans the search did not make their estimate (``planner.plan_costs``)
and is what measurement compares with (``runtime.measured``)."""
import dataclasses
from typing import Tuple

from tfpar.analysis.analysed import Analysed
from tfpar.cluster.hardware import Hardware
from tfpar.cluster.host_speed import host_cpu
from tfpar.ir.plan import Plan
from tfpar.planner.plan_costs import plan_estimate
from tfpar.planner.stage_costs import StageCosts, stage_costs
from tfpar.planner.step_model import KERNELS_PER_OP, LAUNCH_S, kernel_counts
from tfpar.runtime.automatic import cluster_hardware, planning_batch
from tfpar.runtime.context import Runtime

__all__ = ["Predicted", "costed", "predict", "prediction_hardware"]


@dataclasses.dataclass(frozen=True)
class Predicted:
    """The cost model of a plan's TaskGraphs for one batch row (``costs``),
    on ``hardware``, and the batch it assumes when none is fed (and where
    that batch comes from); per TaskGraph, the seconds of its kernel
    launches per micro-batch (the planner's ``step_model.LAUNCH_S`` per
    kernel, ``KERNELS_PER_OP`` per op that computes or allocates)."""

    costs: StageCosts
    hardware: Hardware
    batch: int
    launch_s: Tuple[float, ...] = ()
    batch_from: str = "assumed"
    compute_dtype: str = "fp32"


def prediction_hardware(rt: Runtime) -> Hardware:
    """The device the prediction assumes: ``cluster.hardware``'s, else on
    CPUs the host's measured matmul throughput (``cluster.host_speed``)."""
    if rt.config.get("cluster.hardware") is None and rt.device_type == "CPU":
        return host_cpu()
    return cluster_hardware(rt)


def predict(analysed: Analysed, rt: Runtime, plan: Plan, stage_of) -> Predicted:
    """The cost model of ``plan``'s TaskGraphs, as ``stage_of`` places the
    model's ops."""
    order, view = analysed.view
    hardware = prediction_hardware(rt)
    stages = [stage_of.get(op, 0) for op in order]
    costs = stage_costs(view, stages, len(plan.task_graphs), 1.0, hardware)
    kernels = [0] * len(plan.task_graphs)
    for stage, count in zip(stages, kernel_counts(view.flops, view.activation_bytes)):
        kernels[stage] += count
    batch_from = ("auto.global_batch" if rt.config.get("auto.global_batch") else
                  "the model's inputs" if view.batch else
                  "assumed: neither the model's inputs nor auto.global_batch declare one")
    return Predicted(costs, hardware, planning_batch(rt, view),
                     tuple(KERNELS_PER_OP * LAUNCH_S * k for k in kernels), batch_from,
                     view.compute_dtype)


def costed(plan: Plan, predicted: Predicted) -> Plan:
    """``plan`` with the estimate of ``predicted`` for its assumed batch, and
    each TaskGraph's."""
    hw, dtype = predicted.hardware, predicted.compute_dtype
    devices = {d for tg in plan.task_graphs for d in tg.devices}
    assumptions = {
        "device": hw.name, "devices": len(devices), "devices_per_node": hw.devices_per_node,
        "compute_dtype": dtype, "peak_dtype": hw.peak_name(dtype), "peak_tflops": hw.peak(dtype),
        "efficiency": hw.efficiency, "memory_gbps": hw.memory_gbps, "memory_gb": hw.memory_gb,
        "optimizer_slots": predicted.costs.optimizer_slots, "global_batch": predicted.batch,
        "batch_from": predicted.batch_from}
    estimate, parts = plan_estimate(plan, predicted.costs, predicted.launch_s, predicted.batch,
                                    hw, assumptions)
    return dataclasses.replace(
        plan, estimate={**plan.estimate, **estimate},
        task_graphs=tuple(dataclasses.replace(tg, estimate=part)
                          for tg, part in zip(plan.task_graphs, parts)))
