"""The cost model of the plan that runs, one for every plan: costed when the
graph is planned (``Predicted``: the planner's stage costs of the ops each
TaskGraph holds, per batch row, on the device the plan assumes), it gives
the plans the search did not make their estimate (``planner.plan_costs``)
and is what measurement compares with (``runtime.measured``)."""
import dataclasses
from typing import Tuple

from tfpar.analysis.analysed import Analysed
from tfpar.cluster.hardware import Hardware
from tfpar.ir.plan import Plan
from tfpar.planner.plan_costs import plan_estimate
from tfpar.planner.stage_costs import StageCosts, stage_costs
from tfpar.planner.step_model import KERNELS_PER_OP, LAUNCH_S, kernel_counts
from tfpar.runtime.automatic import cluster_hardware, planning_batch
from tfpar.runtime.context import Runtime
from tfpar.runtime.stated import assumptions, batch_from

__all__ = ["Predicted", "costed", "predict"]


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


def predict(analysed: Analysed, rt: Runtime, plan: Plan, stage_of) -> Predicted:
    """The cost model of ``plan``'s TaskGraphs, as ``stage_of`` places the
    model's ops."""
    order, view = analysed.view
    hardware = cluster_hardware(rt)  # the search's and the summary's device
    batch, said_batch = planning_batch(rt, view), batch_from(rt, bool(view.batch))
    stages = [stage_of.get(op, 0) for op in order]
    costs = stage_costs(view, stages, len(plan.task_graphs), 1.0, hardware)
    kernels = [0] * len(plan.task_graphs)
    for stage, count in zip(stages, kernel_counts(view.flops, view.activation_bytes)):
        kernels[stage] += count
    return Predicted(costs, hardware, batch, tuple(KERNELS_PER_OP * LAUNCH_S * k for k in kernels),
                     said_batch, view.compute_dtype)


def costed(plan: Plan, predicted: Predicted) -> Plan:
    """``plan`` with the estimate of ``predicted`` for its assumed batch, and
    each TaskGraph's."""
    devices = {d for tg in plan.task_graphs for d in tg.devices}
    said = assumptions(predicted.hardware, predicted.compute_dtype, len(devices),
                       predicted.costs.optimizer_slots, predicted.batch, predicted.batch_from)
    estimate, parts = plan_estimate(plan, predicted.costs, predicted.launch_s, predicted.batch,
                                    predicted.hardware, said)
    return dataclasses.replace(
        plan, estimate={**plan.estimate, **estimate},
        task_graphs=tuple(dataclasses.replace(tg, estimate=part)
                          for tg, part in zip(plan.task_graphs, parts)))
