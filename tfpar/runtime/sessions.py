"""What tfpar gives each session and run: devices and grappler options, the
cluster's target, a deadline, a traced step, and the workers a failed step lost."""
from typing import Optional

from tfpar.compat.tf import config_pb2, context, ops, rewriter_config_pb2
from tfpar.errors import ClusterError
from tfpar.hooks.capture import existing_capture
from tfpar.runtime.graph_state import existing_state, state_of
from tfpar.analysis.op_kinds import is_resource_variable, is_variable
from tfpar.runtime.cluster import LOST
from tfpar.runtime.context import Runtime, active
from tfpar.runtime.precision import applied_option
from tfpar.runtime.measured import measure_due
from tfpar.runtime.report_step import report_due

__all__ = ["run_failed", "run_options", "session_config", "session_target"]


def session_config(config: Optional[config_pb2.ConfigProto],
                   graph: Optional[ops.Graph] = None) -> config_pb2.ConfigProto:
    """The user's ConfigProto plus tfpar's devices (N logical CPUs on a CPU
    host), and grappler's mixed precision if the graphs compute in 16 bits
    (``runtime.precision``). A session of a ``graph`` whose tasks will be
    function calls runs grappler off (unless the user set its options): the
    step graph holds little but calls, and each call optimizes its body when
    instantiated."""
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
    rewriting = merged.graph_options.rewrite_options
    plain = rewriting == rewriter_config_pb2.RewriterConfig()
    precision = applied_option(rt.config, rt.device_type)
    if precision is not None:
        setattr(rewriting, precision, rewriter_config_pb2.RewriterConfig.ON)
    if not rt.config.get("pipeline.task_functions"):
        return merged
    if _calls_optimize(graph if graph is not None else ops.get_default_graph(), rt, plain):
        rewriting.disable_meta_optimizer = True
    elif not rewriting.function_optimization and rt.config.get("pipeline.num_micro_batch") != 1:
        # Grappler's function optimizer reads the body of every call (one per
        # micro-batch and device) to see whether it may inline it, which task
        # functions forbid: start-up would grow with micro-batches. Without
        # micro-batches it stays on: it is what optimizes the bodies here (off,
        # a data-parallel MLP step ran 936 kernels instead of 740, 1.1x slower).
        rewriting.function_optimization = rewriter_config_pb2.RewriterConfig.OFF
    return merged


def _calls_optimize(graph: ops.Graph, rt: Runtime, allowed: bool) -> bool:
    """Whether a new session of ``graph`` leaves graph optimization to its
    task function calls: ``allowed`` (the script set no grappler option) and
    ``GraphState.calls_optimized``, decided by the graph's first session if made
    before the rewrite (the graph trains under tfpar with micro-batches and
    its tasks will be functions: no split scope or automatic plan, which may
    shard; resource variables only), else by the rewrite (with
    micro-batches). Without micro-batches each function has one call per
    device: optimizing each call would cost more than grappler on the step
    graph, which optimizes each function once."""
    capture = existing_capture(graph)
    if capture is None:
        return False
    state = state_of(graph)
    if state.calls_optimized is None:
        state.calls_optimized = allowed and bool(capture.gradient_calls) and not (
            rt.config.get("pipeline.num_micro_batch") == 1
            or capture.split_contexts or rt.config.get("auto.auto_parallel")
            or any(is_variable(op) and not is_resource_variable(op)
                   for op in graph.get_operations()))
    return allowed and state.calls_optimized


def session_target(target: str) -> str:
    """Sessions without a target run on the cluster's chief server."""
    rt = active()
    if rt is not None and rt.cluster is not None and not target:
        return rt.cluster.target
    return target


def run_options(options: Optional[config_pb2.RunOptions],
                graph: Optional[ops.Graph] = None) -> Optional[config_pb2.RunOptions]:
    """The options of a run of ``graph``, whose fetches were just translated:
    in a cluster every step gets a deadline of ``communication.timeout_s``
    (unless the caller set one), so a lost worker fails the step, never hangs
    it; a training step Ada-Grouper's online tuning profiles, the plan report
    (config key ``report``) waits for, or ``measure.after_steps`` names, is traced."""
    rt = active()
    if rt is None:
        return options
    deadline = rt.cluster is not None and not (options is not None and options.timeout_in_ms)
    state = existing_state(graph) if graph is not None else None
    profiled = (state is not None and state.retuner is not None
                and state.rewrite.stepped and state.retuner.profile_due()) or report_due(graph) \
        or measure_due(graph)
    if not (deadline or profiled):
        return options
    bounded = config_pb2.RunOptions()
    if options is not None:
        bounded.CopyFrom(options)
    if deadline:
        bounded.timeout_in_ms = int(rt.config.get("communication.timeout_s") * 1000)
    if profiled:
        bounded.trace_level = config_pb2.RunOptions.FULL_TRACE
    return bounded


def run_failed(error: Exception) -> None:
    """A step failed: in a cluster, name the workers that are gone or do not
    answer (stopped, hung)."""
    rt = active()
    if rt is None or rt.cluster is None:
        return
    lost = rt.cluster.lost_workers(timeout_s=2.0)
    if lost:
        raise ClusterError(rt.cluster.describe(lost, LOST)) from error
