"""Glue between the hooks and the rewriters: plan, rewrite once, translate fetches."""
import dataclasses
import logging
import sys
from typing import Any, Callable, Dict, Optional

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

from tfpar.cluster.hardware import HOST_CPU, Hardware, device_hardware
from tfpar.errors import ClusterError, PlanError
from tfpar.hooks.capture import GraphCapture, capture_for, existing_capture, recording_paused
from tfpar.ir.plan import Plan
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec
from tfpar.planner.auto import search, stage_costs
from tfpar.planner.from_annotations import plan_from_annotations
from tfpar.planner.grouper import tune_group_size
from tfpar.planner.partition import partition_stages
from tfpar.planner.schedule import build_schedule
from tfpar.rewriters import graph_edit
from tfpar.rewriters.allreduce import CollectiveKeys, make_reducer
from tfpar.rewriters.data_parallel import replicate
from tfpar.rewriters.horovod_backend import HorovodProcesses, HorovodReducer
from tfpar.rewriters.select import GraphIndex
from tfpar.rewriters.stages import (Placement, assign_stages, canonical_device, model_view,
                                    split_op_devices)
from tfpar.rewriters.fetch_translation import FetchTranslator
from tfpar.runtime.context import Runtime, active

__all__ = ["before_run", "make_iterator", "plan_for", "run_failed", "run_options", "session_config",
           "session_target"]

log = logging.getLogger("tfpar")


def session_config(config: Optional[config_pb2.ConfigProto]) -> config_pb2.ConfigProto:
    """The user's ConfigProto plus tfpar's devices (N logical CPUs on a CPU host)."""
    rt = active()
    merged = config_pb2.ConfigProto()
    # Like tf.compat.v1.Session: no ConfigProto means the settings made through tf.config.
    merged.CopyFrom(config if config is not None else context.context().config)
    if rt is None:
        return merged
    if rt.cluster is not None:
        merged.MergeFrom(rt.cluster.server_config(rt.device_type, rt.devices_per_worker,
                                                  rt.config.get("communication.timeout_s")))
    elif rt.device_type == "CPU" and len(rt.devices) > 1:
        merged.device_count["CPU"] = max(merged.device_count.get("CPU", 1), len(rt.devices))
    merged.allow_soft_placement = True
    return merged


def session_target(target: str) -> str:
    """Sessions without a target run on the cluster's chief server."""
    rt = active()
    if rt is not None and rt.cluster is not None and not target:
        return rt.cluster.server.target
    return target


def run_options(options: Optional[config_pb2.RunOptions]) -> Optional[config_pb2.RunOptions]:
    """In a cluster every step gets a deadline of ``communication.timeout_s``
    (unless the caller set one), so a lost worker fails the step, never hangs it."""
    rt = active()
    if rt is None or rt.cluster is None or (options is not None and options.timeout_in_ms):
        return options
    bounded = config_pb2.RunOptions()
    if options is not None:
        bounded.CopyFrom(options)
    bounded.timeout_in_ms = int(rt.config.get("communication.timeout_s") * 1000)
    return bounded


def make_iterator(ds, make):
    """``io.shard_dataset``: in a Horovod job each process iterates over its shard
    of the dataset; in a TF_CONFIG cluster the chief makes one iterator per
    worker, on that worker, over its shard (recorded in the capture for the
    rewrite). Shards are whole elements: batches, if the dataset batches."""
    rt = active()
    if rt is None or not rt.config.get("io.shard_dataset"):
        return make(ds)
    if rt.config.get("communication.backend") == "horovod":
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        return make(ds.shard(hvd.size(), hvd.rank()))
    if rt.cluster is None:
        return make(ds)
    count = len(rt.cluster.workers)
    iterator = make(ds.shard(count, 0))
    others = []
    for task in range(1, count):
        with ops.device(rt.cluster.host_cpu(task)):
            others.append(make(ds.shard(count, task)))
    capture = capture_for(ops.get_default_graph())
    capture.worker_iterators[iterator._iterator_resource.op] = others  # pylint: disable=protected-access
    return iterator


def run_failed(error: Exception) -> None:
    """A step failed: in a cluster, name the workers that are gone."""
    rt = active()
    if rt is None or rt.cluster is None:
        return
    missing = rt.cluster.missing_workers(timeout_s=2.0)
    if missing:
        raise ClusterError(rt.cluster.describe_missing(missing, "is unreachable")) from error


@dataclasses.dataclass(frozen=True)
class _Automatic:
    """Stages tfpar chose itself: op name -> stage, and the search's pick
    (``auto.auto_parallel``) or None (``num_task_graph`` alone)."""

    count: int
    tags: Dict[str, int]
    candidate: Any = None


def _automatic(graph: ops.Graph, index: GraphIndex, capture: GraphCapture,
               rt: Runtime) -> Optional[_Automatic]:
    """The automatic partition of an unannotated model (cached per graph version):
    ``auto.auto_parallel`` searches data x pipeline degrees by cost model;
    ``num_task_graph`` alone cuts that many stages (Whale Examples 3 and 4)."""
    cfg = rt.config
    auto, count = cfg.get("auto.auto_parallel"), cfg.get("auto.num_task_graph")
    if not auto and (capture.task_graphs or rt.default_strategy is not None
                     or not count or count < 2):
        return None
    if auto and (capture.task_graphs or rt.default_strategy is not None):
        raise PlanError("tfpar: auto.auto_parallel plans the whole model; remove the "
                        "wh.replicate / wh.split scopes and set_default_strategy, or the key")
    cached = capture.automatic
    if cached is not None and cached[0] == graph.version:
        return cached[1]
    order, view = model_view(index, capture)
    time_limit = min(cfg.get("auto.search_time_limit_s"), 10.0)
    if auto:
        candidate = search(view, len(rt.devices), _hardware(rt), cfg.get("auto.global_batch"),
                           cfg.get("pipeline.num_micro_batch"), count, time_limit,
                           progress=lambda line: print(line, file=sys.stderr))
        stages, count = candidate.stages, candidate.pipeline
    else:
        candidate = None
        stages = partition_stages(view.flops, view.edges, count, time_limit, view.labels)
    result = _Automatic(count, {op.name: s for op, s in zip(order, stages)}, candidate)
    capture.automatic = (graph.version, result)
    return result


def _hardware(rt: Runtime) -> Hardware:
    """The slowest, smallest device of ``cluster.hardware`` (a generic host CPU
    when unset)."""
    devices = device_hardware(rt.config.get("cluster.hardware"), len(rt.devices))
    if not devices:
        return HOST_CPU
    return Hardware("cluster", min(d.tflops for d in devices), min(d.memory_gb for d in devices),
                    min(d.intra_node_gbps for d in devices))


def task_graph_specs(capture: GraphCapture, rt: Runtime, automatic: Optional[_Automatic]):
    """The graph's TaskGraphs; the whole model is one when nothing is annotated,
    or the automatic partition's one-device stages."""
    if capture.task_graphs:
        return list(capture.task_graphs)
    if automatic is not None and automatic.count > 1:
        return [TaskGraphSpec(i, f"stage_{i}", Strategy.REPLICATE, 1, implicit=True)
                for i in range(automatic.count)]
    if rt.default_strategy is not None:
        strategy, count = rt.default_strategy
        return [TaskGraphSpec(0, "default", strategy, count, implicit=True)]
    return [TaskGraphSpec(0, "replicate_all", Strategy.REPLICATE, None, implicit=True)]


def plan_for(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> Plan:
    """The plan for ``graph``: as annotated, or as the planner chose (no rewrite)."""
    return _planned(graph, capture, rt)[0]


def _planned(graph: ops.Graph, capture: GraphCapture, rt: Runtime):
    """The plan, with the graph index and the stage of every op it rests on
    (the rewrite uses the same ones)."""
    index = GraphIndex(graph)
    automatic = _automatic(graph, index, capture, rt)
    specs = task_graph_specs(capture, rt, automatic)
    stage_of = assign_stages(index, capture, len(specs), [s.name for s in specs],
                             automatic.tags if automatic is not None else None)
    plan = plan_from_annotations(specs, rt.devices, rt.config,
                                 _stats(graph, capture, index, stage_of, len(specs)))
    if automatic is not None and automatic.candidate is not None:
        best = automatic.candidate
        plan = dataclasses.replace(plan, estimate={
            "step_time_s": best.step_time_s,
            "memory_bytes_per_device": [best.memory_bytes] * len(rt.devices),
            "comm_bytes": best.comm_bytes})
    if plan.schedule == "kfkb" and plan.group_size == "auto":
        plan = dataclasses.replace(plan, group_size=_group_size(index, capture, rt, plan, stage_of))
    return plan, index, stage_of


def _group_size(index: GraphIndex, capture: GraphCapture, rt: Runtime, plan: Plan,
                stage_of) -> int:
    """Ada-Grouper's k for this pipeline, from the cost model (``planner.grouper``)."""
    count = len(plan.task_graphs)
    order, view = model_view(index, capture)
    rows = rt.config.get("auto.global_batch") / plan.data_parallel_degree / plan.num_micro_batch
    hardware = _hardware(rt)
    costs = stage_costs(view, [stage_of.get(op, 0) for op in order], count, rows, hardware)
    return tune_group_size(plan.num_micro_batch, costs.forward_s, costs.backward_s,
                           costs.transfer_s, costs.fixed_bytes, costs.activation_bytes,
                           hardware.memory_gb * 2 ** 30)


def _stats(graph: ops.Graph, capture: GraphCapture, index: GraphIndex, stage_of,
           num_task_graphs: int):
    """Per TaskGraph: ops (as placed: backward and updates with their forward
    TaskGraph) and trainable bytes."""
    num_ops = [0] * num_task_graphs
    for op in index.ops:
        num_ops[stage_of.get(op, 0)] += 1
    param_bytes = [0] * num_task_graphs
    for v in graph.get_collection(ops.GraphKeys.TRAINABLE_VARIABLES):
        if v.shape.is_fully_defined():
            param_bytes[stage_of.get(v.op, 0)] += v.shape.num_elements() * v.dtype.size
    split = {i: (ctx.devices, ctx.decisions) for i, ctx in capture.split_contexts.items()}
    return {"num_ops": num_ops, "param_bytes": param_bytes, "split": split}


def before_run(graph: ops.Graph) -> Optional[Callable[[Any], Any]]:
    """Rewrite ``graph`` once (if it trains under tfpar); return its fetch translator."""
    rt = active()
    capture = existing_capture(graph)
    if rt is None or capture is None or not capture.gradient_calls:
        return None
    if capture.rewrite is None:
        plan, index, stage_of = _planned(graph, capture, rt)
        cfg = rt.config
        names = [tg.name for tg in plan.task_graphs]
        split_groups = {s: [tuple(canonical_device(d) for d in g) for g in tg.replicas]
                        for s, tg in enumerate(plan.task_graphs) if tg.strategy == "split"}
        placement = Placement(
            stage_devices=[[group[0] for group in tg.replicas] for tg in plan.task_graphs],
            num_replicas=plan.data_parallel_degree, stage_of=stage_of, task_graph_names=names,
            split_groups=split_groups,
            op_devices=split_op_devices(index, stage_of, split_groups))
        keys = CollectiveKeys()

        horovod = cfg.get("communication.backend") == "horovod"

        def reducer_for(devices):
            local = make_reducer("auto" if horovod else cfg.get("communication.backend"),
                                 devices, rt.device_type, keys,
                                 fusion_bytes=cfg.get("communication.fusion_mb") * 2 ** 20,
                                 timeout_s=cfg.get("communication.timeout_s"))
            return HorovodReducer(local) if horovod else local
        # One micro-batch needs no schedule; otherwise the plan's was validated.
        schedule = [] if plan.num_micro_batch == 1 else build_schedule(
            plan.schedule, placement.num_stages, plan.num_micro_batch, plan.group_size)
        with graph_edit.unfinalized(graph), recording_paused():
            rewrite = replicate(graph, capture, index, placement, plan.num_micro_batch,
                                reducer_for, schedule,
                                HorovodProcesses(cfg.get("io.shard_dataset")) if horovod else None)
        capture.plan = plan
        capture.rewrite = FetchTranslator(graph, rewrite)
        log.info("tfpar rewrote the graph:\n%s", plan.summary())
    return capture.rewrite
