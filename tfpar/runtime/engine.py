"""The runtime the hooks call (``hooks.tf_patches.install`` looks each seam
up on this module at every call): it rewrites a graph once, before its first
run (``before_run``), and hands the other seams to the modules they belong to."""
import dataclasses
import logging
from typing import Any, Callable, Optional

from tfpar import fallback
from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture, existing_capture, recording_paused
from tfpar.ir.plan import Plan
from tfpar.ir.recorded import Recorded
from tfpar.rewriters import graph_edit
from tfpar.rewriters.allreduce import CollectiveKeys, LocalReducer, make_reducer
from tfpar.rewriters.data_parallel import replicate
from tfpar.rewriters.fetch_translation import FetchTranslator
from tfpar.rewriters.finite_check import check_gradients
from tfpar.rewriters.horovod_backend import HorovodProcesses, HorovodReducer
from tfpar.analysis.analysed import Analysed
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.stages import Placement, canonical_device, split_op_devices
from tfpar.runtime import tf2_functions
from tfpar.runtime.built_before_init import warn_unseen_training
from tfpar.runtime.context import Runtime, active
from tfpar.runtime.gc_paused import gc_paused
from tfpar.runtime.graph_state import GraphState, existing_state, state_of
from tfpar.runtime.iterators import eager_dataset, make_iterator
from tfpar.runtime import online_tuning
from tfpar.runtime.online_tuning import keep_group_size, made_callable
from tfpar.runtime.planning import Planned, group_costs, planned
from tfpar.runtime.precision import applied, applied_option
from tfpar.runtime.recomputation import recompute_configured
from tfpar.runtime import measured
from tfpar.runtime.measured_calls import measured_call
from tfpar.runtime.report_step import after_step, rewrite_report
from tfpar.runtime.retune import GroupRetuner
from tfpar.runtime.sessions import run_failed, run_options, session_config, session_target
from tfpar.runtime.sharded import sharded_plan, warn_unbuilt_sharding
from tfpar.runtime.split_contexts import check_forced_units, setup_capture
from tfpar.runtime.techniques import prepared
from tfpar.runtime.tf2_functions import (before_call, function_gradients, keras_3_steps,
                                         retrace_failed, retraces_relaxed)

# The seams, as ``hooks.seams`` documents them.
__all__ = ["after_run", "before_call", "before_run", "eager_dataset", "function_gradients",
           "keras_3_steps", "loss_scaled", "made_callable",
           "make_iterator", "measured_call", "ran_before_rewrite", "retrace_failed",
           "retraces_relaxed",
           "rewrite_function", "rewrites_next", "rewritten", "run_failed", "run_options",
           "session_config", "session_target", "setup_capture", "sync_batch_norm"]

log = logging.getLogger("tfpar")


def after_run(graph: ops.Graph, run_metadata, feed_dict=None) -> None:
    """A run of ``graph`` (fed ``feed_dict``) ended: online tuning may move k;
    the first traced training step writes the plan report (config key
    ``report``); the ``measure.after_steps``-th is set against the cost model,
    and the report, if any, written again with it."""
    online_tuning.after_run(graph, run_metadata)
    after_step(graph, run_metadata)
    if measured.after_step(graph, run_metadata, feed_dict) is not None:
        rewrite_report(graph, run_metadata)


def rewrites_next(graph: ops.Graph) -> bool:
    """Whether the next run of ``graph`` rewrites it (``before_run``)."""
    capture, state = existing_capture(graph), existing_state(graph)
    return (active() is not None and capture is not None and bool(capture.gradient_calls)
            and (state is None or state.rewrite is None))


def rewritten(graph: ops.Graph) -> bool:
    """Whether tfpar has rewritten ``graph``."""
    state = existing_state(graph)
    return state is not None and state.rewrite is not None


def ran_before_rewrite(graph: ops.Graph, carried: int) -> bool:
    """A session ran ``graph`` before tfpar rewrote it (its training step did not
    exist yet: Keras weights= / set_weights / load_weights, an initializer run
    before the optimizer was built). TensorFlow keeps the nodes it already sent
    that session, so a rewrite that changes the step (more than one version)
    needs the session reopened on the rewritten graph, with its ``carried``
    variable values: returns whether it does. Refused when the graph is
    finalized (``MonitoredSession``), where tfpar cannot add the ops it needs."""
    rewrite = state_of(graph).rewrite
    if rewrite is None or rewrite.rewrite.trivial:
        return False
    if graph.finalized:
        raise PlanError(
            "tfpar: this session ran the graph before its training step was built, and the "
            "graph is finalized: build the training step before the session is created")
    fallback.fall_back(
        "a session that ran the graph before its training step was built, to run the step",
        f"it is reopened on the parallel graph with its {carried} variables' values; the state "
        "of the iterators and lookup tables it held starts anew", "Build the training step "
        "before the session's first run, or initialize iterators and tables after it", graph)
    return True


def rewrite_function(graph: ops.Graph) -> None:
    """A tf.function traced from eager code (``tf2_functions``), rewritten by
    this module's ``before_run`` as it is at the time."""
    tf2_functions.rewrite_function(graph, before_run)


def sync_batch_norm() -> bool:
    """``batch_norm.sync``: every BatchNormalization layer made now sums its
    statistics over the replicas."""
    rt = active()
    return rt is not None and rt.config.get("batch_norm.sync")


def loss_scaled(graph: ops.Graph) -> bool:
    """Whether ``graph``'s gradients are loss-scaled: fp16 mixed precision
    (``hooks.loss_scaling``), in graphs, not tf.function steps.

    Raises:
      PlanError: fp16 in a tf.function step.
    """
    rt = active()
    if rt is None or applied(rt.config, rt.device_type) != "fp16":
        return False
    if graph.building_function:
        raise PlanError("tfpar: memory.mixed_precision 'fp16' cannot loss-scale a tf.function "
                        "step (tfpar builds loss scaling into graphs as they are built); use "
                        "'bf16', or a Keras LossScaleOptimizer with mixed_float16 layers")
    return True


def before_run(graph: ops.Graph) -> Optional[Callable[[Any], Any]]:
    """Rewrite ``graph`` once (if it trains under tfpar); return its fetch translator."""
    rt = active()
    capture = existing_capture(graph)
    if rt is not None:
        warn_unseen_training(graph)
    if rt is None or capture is None or not capture.gradient_calls:
        return None
    state = state_of(graph)
    if state.rewrite is None:
        with gc_paused():
            _rewrite(graph, capture, rt)
    elif len(capture.gradient_calls) > state.rewritten_calls:
        _built_after_rewrite(graph, capture, state)
    return state.rewrite


def _built_after_rewrite(graph: ops.Graph, capture: GraphCapture, state: GraphState) -> None:
    """Gradients built after tfpar rewrote ``graph`` (a second model trained
    in Keras' one graph) run as built: say so, in the plan's notes too."""
    later = capture.gradient_calls[state.rewritten_calls:]
    losses = ", ".join(f"'{y.name}'" for call in later for y in call.ys if hasattr(y, "name"))
    fallback.fall_back(
        f"data parallelism for the gradients of {losses}, built after tfpar rewrote this graph "
        "for its first training step", "they, and the updates they feed, run as built, on one "
        "device", "Build every training step before the graph first runs, or build and train each "
        "model in a tf.Graph of its own", graph)
    state.plan = dataclasses.replace(state.plan, notes=fallback.notes(graph))


def _rewrite(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> None:
    """Analyse and plan ``graph``, rewrite it, and keep what was decided in
    its ``GraphState`` (the plan, the rewrite's fetch translator, the tuner)."""
    state = state_of(graph)
    recompute_configured(graph, capture, rt)
    ready = prepared(graph, capture, rt)
    made = planned(ready.analysed, capture, rt, ready.automatic)  # the copies' stages too
    plan, analysed = made.plan, made.analysed
    warn_unbuilt_sharding(ready.automatic)
    check_forced_units(capture, rt)
    # What runs is unsharded; what current_plan() shows, to pin, is not.
    state.sharded_plan = sharded_plan(ready.automatic, rt, analysed.index, capture)
    placement = _placement(plan, analysed.index, made.stage_of)
    if state.calls_optimized is None:  # no session yet (see sessions._calls_optimize)
        state.calls_optimized = plan.num_micro_batch > 1
    rewrite = _parallelised(analysed, rt, plan, placement, ready.techniques,
                            state.calls_optimized)
    state.plan = dataclasses.replace(plan, notes=fallback.notes(graph))  # the rewrite's too
    state.rewritten_calls = len(capture.gradient_calls)
    state.rewrite = FetchTranslator(graph, rewrite, recording_paused, plan.group_size,
                                    _train_ops(analysed.recorded))
    state.retuner = _retuner(made, rt)
    state.predicted = made.predicted if measured.measures(rt) else None
    log.info("tfpar rewrote the graph:\n%s", plan.summary())


def _train_ops(recorded: Recorded):
    """The ops the optimizers returned (``apply_gradients``' train ops)."""
    return frozenset(getattr(call.train_op, "op", call.train_op) for call in recorded.apply_calls
                     if call.train_op is not None)


def _parallelised(analysed: Analysed, rt: Runtime, plan: Plan, placement: Placement,
                  techniques, calls_optimized: bool):
    """The rewrite of the graph as ``plan`` places it (``rewriters.data_parallel``),
    its gradients checked if ``check.finite_gradients``: what it needs is
    decided first, so that a refusal comes before the graph changes."""
    cfg = rt.config
    graph, recorded, index = analysed.graph, analysed.recorded, analysed.index
    checked = cfg.get("check.finite_gradients")
    if checked:
        _refuse_loss_scaled_check(rt)
    reducer_for = _reducers(graph, rt)
    horovod = cfg.get("communication.backend") == "horovod"
    zero = cfg.get("memory.zero") or _planned_zero(techniques, reducer_for,
                                                   placement.stage_devices[0])
    # One micro-batch needs no schedule; otherwise the plan's was validated.
    schedule = [] if plan.num_micro_batch == 1 else plan.task_schedule()[0]
    with graph_edit.unfinalized(graph), recording_paused():
        rewrite = replicate(graph, recorded, index, placement, plan.num_micro_batch,
                            reducer_for, schedule,
                            HorovodProcesses(cfg.get("io.shard_dataset")) if horovod else None,
                            functions=cfg.get("pipeline.task_functions"),
                            calls_optimized=calls_optimized,
                            shares=plan.batch_shares,
                            offload=cfg.get("memory.offload_optimizer") or techniques.offload,
                            zero=zero, precision=applied_option(cfg, rt.device_type))
        if checked:
            checks = check_gradients(graph, rewrite)
            fallback.note(f"tfpar: check.finite_gradients: {checks} gradient tensors (every "
                          "replica's and micro-batch's) are checked for NaN and Inf before "
                          "they are summed", graph)
    return rewrite


def _placement(plan: Plan, index: GraphIndex, stage_of) -> Placement:
    """Where the plan puts each TaskGraph's replicas, and each op."""
    split_groups = {s: [tuple(canonical_device(d) for d in g) for g in tg.replicas]
                    for s, tg in enumerate(plan.task_graphs) if tg.strategy == "split"}
    return Placement(
        stage_devices=[[group[0] for group in tg.replicas] for tg in plan.task_graphs],
        num_replicas=plan.data_parallel_degree, stage_of=stage_of,
        task_graph_names=[tg.name for tg in plan.task_graphs], split_groups=split_groups,
        op_devices=split_op_devices(index, stage_of, split_groups))


def _reducers(graph: ops.Graph, rt: Runtime):
    """devices -> the reducer summing gradients over them
    (``communication.backend``), all sharing one set of collective keys."""
    cfg = rt.config
    keys = CollectiveKeys()
    horovod = cfg.get("communication.backend") == "horovod"

    def reducer_for(devices):
        if graph.building_function:  # variables live outside: no mirrors in it
            local = LocalReducer(list(devices))
            return HorovodReducer(local) if horovod else local
        local = make_reducer("auto" if horovod else cfg.get("communication.backend"),
                             devices, rt.device_type, keys,
                             fusion_bytes=cfg.get("communication.fusion_mb") * 2 ** 20,
                             timeout_s=cfg.get("communication.timeout_s"))
        return HorovodReducer(local) if horovod else local
    return reducer_for


def _refuse_loss_scaled_check(rt: Runtime) -> None:
    """``check.finite_gradients`` (``rewriters.finite_check``) is refused on a
    loss-scaled graph (fp16).

    Raises:
      PlanError: the graph is loss-scaled, where non-finite gradients are
        expected and the step is skipped.
    """
    if applied(rt.config, rt.device_type) == "fp16":
        raise PlanError("tfpar: check.finite_gradients would fail the steps fp16 loss scaling "
                        "skips on purpose (their gradients overflow, and the loss scale halves): "
                        "use one or the other")


def _planned_zero(techniques, reducer_for, devices) -> int:
    """The plan's ZeRO stage, if its replicas (on ``devices``) mirror
    variables: replicas sharing one copy of each (the CPUs of one process)
    have nothing to shard."""
    if techniques.zero and not reducer_for(devices).mirrors_variables:
        log.info("tfpar: the plan's ZeRO-%d is not needed: its replicas share one copy of "
                 "each variable", techniques.zero)
        return 0
    return techniques.zero


def _retuner(made: Planned, rt: Runtime) -> Optional[GroupRetuner]:
    """Ada-Grouper's online tuner (``runtime.retune``), for a kFkB pipeline
    whose k is 'auto' and ``pipeline.retune_steps`` is not 0, starting from
    the costs ``planning.planned`` tuned k by (a pinned plan's k: costed here)."""
    cfg, plan, graph = rt.config, made.plan, made.analysed.graph
    every = cfg.get("pipeline.retune_steps")
    if not (every and plan.schedule == "kfkb" and cfg.get("pipeline.group_size") == "auto"
            and plan.num_micro_batch > 1 and len(plan.task_graphs) > 1):
        return None
    why = None
    if graph.building_function:
        why = ("the step is a tf.function, which online tuning does not re-trace; it tunes "
               "steps run by Session.run (TF1 loops, MonitoredTrainingSession, Estimator)")
    elif cfg.get("communication.backend") == "horovod":
        why = "each Horovod process runs its own session, and they would each choose a k"
    if why is not None:
        keep_group_size(plan.group_size, why, graph)
        return None
    stage, memory_limit = made.costs or group_costs(made.analysed, rt, plan, made.stage_of)
    return GroupRetuner(plan.num_micro_batch, len(plan.task_graphs), plan.group_size,
                        stage.fixed_bytes, stage.activation_bytes, memory_limit, every,
                        cfg.get("pipeline.retune_tolerance"))
