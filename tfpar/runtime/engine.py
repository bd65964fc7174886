"""Glue between the hooks and the rewriters: plan, rewrite once, translate fetches."""
import logging
from typing import Any, Callable, Optional

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

from tfpar.errors import ConfigError, PlanError
from tfpar.hooks.capture import GraphCapture, existing_capture, recording_paused
from tfpar.ir.plan import Plan
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec
from tfpar.planner.from_annotations import plan_from_annotations
from tfpar.rewriters import graph_edit
from tfpar.rewriters.allreduce import CollectiveKeys, make_reducer
from tfpar.rewriters.data_parallel import replicate
from tfpar.rewriters.fetch_translation import FetchTranslator
from tfpar.runtime.context import Runtime, active

__all__ = ["before_run", "plan_for", "session_config"]

log = logging.getLogger("tfpar")


def session_config(config: Optional[config_pb2.ConfigProto]) -> config_pb2.ConfigProto:
    """The user's ConfigProto plus tfpar's devices (N logical CPUs on a CPU host)."""
    rt = active()
    merged = config_pb2.ConfigProto()
    # Like tf.compat.v1.Session: no ConfigProto means the settings made through tf.config.
    merged.CopyFrom(config if config is not None else context.context().config)
    if rt is None:
        return merged
    if rt.device_type == "CPU" and len(rt.devices) > 1:
        merged.device_count["CPU"] = max(merged.device_count.get("CPU", 1), len(rt.devices))
    merged.allow_soft_placement = True
    return merged


def task_graph_specs(capture: GraphCapture, rt: Runtime):
    """The graph's TaskGraphs; the whole model is one when nothing is annotated."""
    if capture.task_graphs:
        return list(capture.task_graphs)
    if rt.default_strategy is not None:
        strategy, count = rt.default_strategy
        return [TaskGraphSpec(0, "default", strategy, count, implicit=True)]
    return [TaskGraphSpec(0, "replicate_all", Strategy.REPLICATE, None, implicit=True)]


def plan_for(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> Plan:
    """The plan for ``graph`` as annotated (no rewrite)."""
    if rt.config.get("auto.auto_parallel"):
        raise PlanError("tfpar: auto.auto_parallel (planner search) is not implemented in "
                        "this build; annotate with wh.replicate or drop the key")
    if rt.config.get("communication.backend") == "horovod":
        raise ConfigError("tfpar: communication.backend 'horovod' is not implemented in this "
                          "build; use 'auto' or 'collective'")
    trainable = graph.get_collection(ops.GraphKeys.TRAINABLE_VARIABLES)
    param_bytes = sum(v.shape.num_elements() * v.dtype.size for v in trainable
                      if v.shape.is_fully_defined())
    stats = {"num_ops": len(graph.get_operations()), "param_bytes": int(param_bytes)}
    return plan_from_annotations(task_graph_specs(capture, rt), rt.devices, rt.config, stats)


def before_run(graph: ops.Graph) -> Optional[Callable[[Any], Any]]:
    """Rewrite ``graph`` once (if it trains under tfpar); return its fetch translator."""
    rt = active()
    capture = existing_capture(graph)
    if rt is None or capture is None or not capture.gradient_calls:
        return None
    if capture.rewrite is None:
        plan = plan_for(graph, capture, rt)
        devices = [group[0] for group in plan.task_graphs[0].replicas]
        cfg = rt.config
        with graph_edit.unfinalized(graph), recording_paused():
            reducer = make_reducer(
                cfg.get("communication.backend"), devices, rt.device_type, CollectiveKeys(),
                fusion_bytes=cfg.get("communication.fusion_mb") * 2 ** 20,
                timeout_s=cfg.get("communication.timeout_s"))
            rewrite = replicate(graph, capture, devices, plan.num_micro_batch, reducer)
        capture.plan = plan
        capture.rewrite = FetchTranslator(graph, rewrite)
        log.info("tfpar rewrote the graph:\n%s", plan.summary())
    return capture.rewrite
