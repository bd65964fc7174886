"""The plan of a captured graph: its TaskGraphs, as annotated or as the
planner chose, with Ada-Grouper's k and the batch shares of mixed devices."""
import dataclasses
from typing import Dict, Optional, Tuple

from tfpar import fallback
from tfpar.compat.tf import ops
from tfpar.hooks.capture import GraphCapture
from tfpar.ir.plan import Plan
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec
from tfpar.planner.stage_costs import stage_costs
from tfpar.planner.from_annotations import plan_from_annotations
from tfpar.planner.grouper import tune_group_size
from tfpar.analysis.analysed import Analysed
from tfpar.analysis.op_kinds import READ_ONLY_RESOURCE_TYPES, VARIABLE_TYPES
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.stages import assign_stages, stage_sizes
from tfpar.runtime.automatic import (Automatic, automatic_plan, cluster_hardware, part_estimate,
                                     planned_config, planning_batch, with_stage_search)
from tfpar.runtime.balanced import batch_shares
from tfpar.runtime.context import Runtime
from tfpar.runtime.prediction import Predicted, costed, predict
from tfpar.runtime.sharded import sharded_plan
from tfpar.runtime.stated import estimate_of

__all__ = ["Planned", "analysed_now", "group_costs", "plan_for", "planned", "plans_for",
           "task_graph_specs"]


@dataclasses.dataclass(frozen=True)
class Planned:
    """What planning decided for one rewrite pass: the plan, the analysis it
    rests on (the rewrite reads the same one), each op's TaskGraph, the cost
    model of its TaskGraphs (``runtime.prediction``), and, when Ada-Grouper
    chose k, the costs it chose by (``group_costs``)."""

    plan: Plan
    analysed: Analysed
    stage_of: Dict[ops.Operation, int]
    predicted: Predicted
    costs: Optional[tuple] = None


def task_graph_specs(capture: GraphCapture, rt: Runtime, automatic: Optional[Automatic]):
    """The graph's TaskGraphs; the whole model is one when nothing is annotated,
    or the automatic partition's one-device stages."""
    if capture.task_graphs:
        return [_replicated_if_unsharded(capture, spec) for spec in capture.task_graphs]
    if automatic is not None and automatic.count > 1:
        return [TaskGraphSpec(i, f"stage_{i}", Strategy.REPLICATE, 1, implicit=True)
                for i in range(automatic.count)]
    if rt.default_strategy is not None:
        strategy, count = rt.default_strategy
        return [TaskGraphSpec(0, "default", strategy, count, implicit=True)]
    return [TaskGraphSpec(0, "replicate_all", Strategy.REPLICATE, None, implicit=True)]


# Ops that hold, read or reshape data without computing on it.
_PLUMBING = frozenset({"Const", "Identity", "IdentityN", "NoOp", "Shape", "Reshape", "Squeeze",
                       "ExpandDims", "StridedSlice", "Pack", "Unpack", "ConcatV2", "Cast",
                       "Fill", "Transpose", "AssignVariableOp", "Assign"}) | VARIABLE_TYPES | READ_ONLY_RESOURCE_TYPES


def _replicated_if_unsharded(capture: GraphCapture, spec: TaskGraphSpec) -> TaskGraphSpec:
    """A ``wh.split`` scope the script opened in which nothing was sharded
    (no ShardingUnit: convolutions, pooling, normalization alone) runs
    replicated on its devices instead of whole on the first: said
    (``fall_back``), refused under ``strict``. Other TaskGraphs as they are."""
    ctx = capture.split_contexts.get(spec.index)
    if ctx is None or spec.implicit or ctx.decisions or ctx.made_shards:
        return spec
    graph = ctx.graph
    kinds = sorted({graph.get_operation_by_name(name).type
                    for name, index in capture.op_task_graph.items()
                    if index == spec.index and name not in capture.op_phase
                    and "Initializer/" not in name} - _PLUMBING)
    fallback.fall_back(
        f"wh.split TaskGraph '{spec.name}', to shard its layers over {ctx.size} devices",
        "nothing in it is a layer or op tfpar shards (Dense, EinsumDense, MultiHeadAttention, "
        "an embedding lookup, a matmul or einsum of split weights, a softmax cross-entropy; "
        f"its ops: {', '.join(kinds[:8]) + (', ...' if len(kinds) > 8 else '') or 'none'}), "
        f"so it is replicated instead: data parallel over its devices, with one device's "
        "numbers", f"Put a layer tfpar shards in the scope, or make it "
        f"wh.replicate({spec.device_count if spec.device_count is not None else ''}) to "
        "silence this", graph)
    return dataclasses.replace(spec, strategy=Strategy.REPLICATE)


def analysed_now(graph: ops.Graph, capture: GraphCapture) -> Analysed:
    """The analysis of ``graph`` as it stands, with what ``capture`` recorded."""
    return Analysed(GraphIndex(graph), capture.recorded())


def plan_for(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> Plan:
    """The plan for ``graph``: as annotated, or as the planner chose (no
    rewrite; a plan that shards layers even when this graph was built before
    it was known, so that it can be pinned)."""
    runs, pick = plans_for(graph, capture, rt)
    return pick or runs


def plans_for(graph: ops.Graph, capture: GraphCapture,
              rt: Runtime) -> Tuple[Plan, Optional[Plan]]:
    """(the plan ``graph`` runs as built, the search's plan to pin when it
    shards layers this graph was built without, else None); no rewrite."""
    analysed = analysed_now(graph, capture)
    automatic = automatic_plan(analysed, capture, rt)
    made = planned(analysed, capture, rt, automatic)
    return made.plan, sharded_plan(automatic, rt, analysed.index, capture)


def planned(analysed: Analysed, capture: GraphCapture, rt: Runtime,
            automatic: Optional[Automatic]) -> Planned:
    """The plan of the graph ``analysed`` as it stands, with the search's
    result (``runtime.automatic``) that it runs, if any."""
    graph, index, recorded = analysed.graph, analysed.index, analysed.recorded
    specs = task_graph_specs(capture, rt, automatic)
    stage_of = assign_stages(index, recorded, len(specs), [s.name for s in specs],
                             automatic.tags if automatic is not None else None)
    chosen = automatic.runnable if automatic is not None else None
    stats = {**stage_sizes(index, stage_of, len(specs)),
             "split": {i: (ctx.devices, ctx.decisions, ctx.shares)
                       for i, ctx in capture.split_contexts.items()
                       if specs[i].strategy == Strategy.SPLIT}}
    plan = plan_from_annotations(specs, rt.devices, planned_config(rt, automatic), stats,
                                 graph, chosen.virtual_stages if chosen is not None else None)
    if automatic is not None and automatic.runnable is not None:
        runnable = automatic.runnable
        plan = dataclasses.replace(
            plan, estimate=estimate_of(runnable, rt, automatic.candidates, plan.task_graphs),
            task_graphs=tuple(
                dataclasses.replace(tg, estimate=part_estimate([part]))
                for tg, part in zip(plan.task_graphs, runnable.parts)))
    plan = with_stage_search(plan, automatic)
    costs = None
    if plan.schedule == "kfkb" and plan.group_size == "auto":
        costs = group_costs(analysed, rt, plan, stage_of)
        stage, memory_limit = costs
        plan = dataclasses.replace(plan, group_size=tune_group_size(
            plan.num_micro_batch, stage.forward_s, stage.backward_s, stage.transfer_s,
            stage.fixed_bytes, stage.activation_bytes, memory_limit))
    shares = batch_shares(analysed, rt, plan)
    if shares:
        plan = dataclasses.replace(plan, batch_shares=shares)
    predicted = predict(analysed, rt, plan, stage_of)
    if plan.estimate.get("step_time_s") is None:  # not the search's: the same model costs it
        plan = costed(plan, predicted)
    return Planned(dataclasses.replace(plan, notes=fallback.notes(graph)), analysed, stage_of,
                   predicted, costs)


def group_costs(analysed: Analysed, rt: Runtime, plan: Plan, stage_of):
    """The pipeline's stage costs for choosing Ada-Grouper's k
    (``planner.grouper``), and the memory per device."""
    order, view = analysed.view
    rows = planning_batch(rt, view) / plan.data_parallel_degree / plan.num_micro_batch
    hardware = cluster_hardware(rt)
    costs = stage_costs(view, [stage_of.get(op, 0) for op in order], len(plan.task_graphs),
                        rows, hardware)
    return costs, hardware.memory_gb * 2 ** 30


