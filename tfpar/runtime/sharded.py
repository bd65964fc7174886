"""The plan to show and pin when the search's pick shards layers of a graph
built without them (``runtime.automatic``: what runs is its best unsharded
plan): the TaskGraphs a build with the pick pinned makes."""
import dataclasses
from typing import Dict, List, Optional, Tuple

from tfpar import fallback
from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture, constant_op, layer_of
from tfpar.ir.compact import plain
from tfpar.ir.plan import Plan
from tfpar.ir.taskgraph import Phase, Strategy, TaskGraphSpec
from tfpar.planner.from_annotations import plan_from_annotations
from tfpar.analysis.graph_index import GraphIndex
from tfpar.runtime.automatic import Automatic, chosen_pipeline, part_estimate
from tfpar.runtime.context import Runtime
from tfpar.runtime.stated import estimate_of

__all__ = ["sharded_plan", "warn_unbuilt_sharding"]


def sharded_plan(automatic: Optional[Automatic], rt: Runtime, index: GraphIndex,
                 capture: GraphCapture) -> Optional[Plan]:
    """The search's pick when it shards layers this graph was built without
    (None otherwise), with the TaskGraphs a build with it pinned makes
    (``_runs``): split runs over ``tensor`` devices, the others replicated
    on as many (nested data parallelism)."""
    if automatic is None or not automatic.shards_unbuilt:
        return None
    best = automatic.best
    layers = dict(best.split_scopes)
    position = {op: i for i, op in enumerate(automatic.order)}
    runs = _runs(automatic, index, capture, layers, position)
    specs = [TaskGraphSpec(i, f"{'split' if split else 'default'}_{i}",
                           Strategy.SPLIT if split else Strategy.REPLICATE, best.tensor,
                           implicit=True) for i, (split, _) in enumerate(runs)]
    stats = {"num_ops": [len(members) for _, members in runs],
             "param_bytes": [int(sum(automatic.param_bytes[position[op]] for op in members
                                     if op in position)) for _, members in runs]}
    config = rt.config.replace({"plan": None, "cluster.colocate_split_and_replicate":
                                not best.split_stages, **chosen_pipeline(best)})
    plan = plan_from_annotations(specs, rt.devices, config, stats,
                                 virtual_stages=best.virtual_stages)
    part_of = {automatic.order[i]: part for part in best.parts for i in part.ops}
    task_graphs = tuple(
        dataclasses.replace(
            tg, patterns={scope: layers[scope] for scope in (layer_of(op.name, layers)
                                                             for op in members if op in position)
                          if scope is not None}
            if split else {},
            estimate=part_estimate({id(part_of[op]): part_of[op]
                                     for op in members if op in part_of}.values()))
        for tg, (split, members) in zip(plan.task_graphs, runs))
    sharding = {"tensor_degree": best.tensor, "layers": layers}
    if best.sequence_parallel:
        sharding["sequence_parallel"] = True
    if best.split_stages:
        sharding["stages"] = {scope: stage for (scope, _), stage
                              in zip(best.split_scopes, best.split_stages)}
    return dataclasses.replace(plan, task_graphs=task_graphs,
                               estimate=estimate_of(best, rt, automatic.candidates, task_graphs),
                               sharding=sharding, notes=fallback.notes(index.graph))


def _runs(automatic: Automatic, index: GraphIndex, capture: GraphCapture,
          layers: Dict[str, str], position: Dict[ops.Operation, int]
          ) -> List[Tuple[bool, List[ops.Operation]]]:
    """(split, ops) per TaskGraph of the pick. With a pipeline: a split one
    per stage. Without: the ops built before the first backward op (inputs
    and weights included), in creation order, cut into runs in and out of
    the sharded layers (constants and ops nothing reads stay in a split run:
    tf.nn.silu's beta, the dead identity of its result)."""
    best = automatic.best
    if best.split_stages:
        return [(True, [op for op in automatic.order if best.stages[position[op]] == s])
                for s in range(best.pipeline * best.virtual_stages)]
    runs: List[Tuple[bool, List[ops.Operation]]] = []
    backward = next((i for i, op in enumerate(index.ops)
                     if capture.op_phase.get(op.name) == Phase.BACKWARD), len(index.ops))
    for op in index.ops[:backward]:
        if op.name in capture.op_phase:
            continue
        split = layer_of(op.name, layers) is not None or bool(runs and runs[-1][0] and (
            constant_op(op) or not any(t.consumers() for t in op.outputs)))
        if not runs or runs[-1][0] != split:
            runs.append((split, []))
        runs[-1][1].append(op)
    return runs


def warn_unbuilt_sharding(automatic: Optional[Automatic]) -> None:
    """The search's pick (``automatic``) shards layers of a graph built
    unsharded: run the best plan that does not (a fallback), or fail when
    none fits."""
    if automatic is None or not automatic.shards_unbuilt:
        return
    best = automatic.best
    what = (f"the planner shards {', '.join(scope for scope, _ in best.split_scopes)} over "
            f"{best.tensor} devices (estimated {plain(best.step_time_s * 1e3, 3)} ms/step), but this "
            "graph was built before the plan existed")
    how = ("run the script itself (its planning pass pins the plan) or pin "
           "wh.current_plan(to_pin=True).to_json() as the config's 'plan'")
    if automatic.runnable is None:
        raise PlanError(f"tfpar: {what}, and no plan without sharding fits the devices' "
                        f"memory; {how}")
    fallback.fall_back(what, f"it runs the best plan without sharding "
                       f"({automatic.runnable.describe()}, "
                       f"{plain(automatic.runnable.step_time_s * 1e3, 3)} ms/step)",
                       f"To shard, {how}", automatic.order[0].graph)
