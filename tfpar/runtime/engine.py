"""Glue between the hooks and the rewriters: plan, rewrite once, translate fetches."""
import dataclasses
import logging
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence

from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import ops

from tfpar import fallback
from tfpar.cluster.virtual_device import assign_devices
from tfpar.errors import ClusterError, ConfigError, PlanError
from tfpar.hooks.batch_shapes import relaxed_dataset
from tfpar.hooks.capture import GraphCapture, capture_for, existing_capture, recording_paused
from tfpar.ir.plan import Plan, pinned_plan
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec
from tfpar.planner.stage_costs import stage_costs
from tfpar.planner.from_annotations import plan_from_annotations
from tfpar.planner.grouper import tune_group_size
from tfpar.planner.memory import recomputation
from tfpar.patterns.sharded import SplitContext
from tfpar.ir.schedule import build_schedule
from tfpar.rewriters import graph_edit
from tfpar.rewriters.allreduce import CollectiveKeys, LocalReducer, make_reducer
from tfpar.rewriters.data_parallel import replicate
from tfpar.rewriters.horovod_backend import HorovodProcesses, HorovodReducer
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.op_kinds import is_input, is_resource_variable, is_variable
from tfpar.analysis.model_view import model_view
from tfpar.rewriters.recompute import recompute_ops, recompute_scopes
from tfpar.runtime.precision import applied, applied_option
from tfpar.analysis.stages import Placement, assign_stages, canonical_device, split_op_devices
from tfpar.rewriters.fetch_translation import FetchTranslator
from tfpar.rewriters.finite_check import check_gradients
from tfpar.rewriters.function_outputs import rewire_outputs
from tfpar.runtime.automatic import (Automatic, automatic_plan, cluster_hardware, estimate_of,
                                     part_estimate, pinned_sharding, planned_config,
                                     planned_techniques, planning_batch, refuse_planning_only,
                                     sharded_plan, warn_unbuilt_sharding, with_stage_search)
from tfpar.runtime.balanced import batch_shares, shard_shares
from tfpar.runtime.captured_batches import captured_batch, unsplittable
from tfpar.runtime.cluster import LOST
from tfpar.runtime.context import Runtime, active
from tfpar.runtime.gc_paused import gc_paused
from tfpar.runtime.retune import GroupRetuner
from tfpar.runtime.step_trace import step_timeline

__all__ = ["after_run", "before_run", "loss_scaled", "made_callable", "make_iterator",
           "make_split_context", "plan_for", "ran_before_rewrite", "rewrites_next", "run_failed",
           "run_options", "session_config", "session_target", "setup_capture", "sync_batch_norm"]

log = logging.getLogger("tfpar")
# Graphs already checked for training built before wh.init (warned once each).
_warned_unseen: "weakref.WeakSet[ops.Graph]" = weakref.WeakSet()


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
    ``capture.calls_optimized``, decided by the graph's first session if made
    before the rewrite (the graph trains under tfpar with micro-batches and
    its tasks will be functions: no split scope or automatic plan, which may
    shard; resource variables only), else by the rewrite (with
    micro-batches). Without micro-batches each function has one call per
    device: optimizing each call would cost more than grappler on the step
    graph, which optimizes each function once."""
    capture = existing_capture(graph)
    if capture is None:
        return False
    if capture.calls_optimized is None:
        capture.calls_optimized = allowed and bool(capture.gradient_calls) and not (
            rt.config.get("pipeline.num_micro_batch") == 1
            or capture.split_contexts or rt.config.get("auto.auto_parallel")
            or any(is_variable(op) and not is_resource_variable(op)
                   for op in graph.get_operations()))
    return allowed and capture.calls_optimized


def session_target(target: str) -> str:
    """Sessions without a target run on the cluster's chief server."""
    rt = active()
    if rt is not None and rt.cluster is not None and not target:
        return rt.cluster.server.target
    return target


def run_options(options: Optional[config_pb2.RunOptions],
                graph: Optional[ops.Graph] = None) -> Optional[config_pb2.RunOptions]:
    """The options of a run of ``graph``, whose fetches were just translated:
    in a cluster every step gets a deadline of ``communication.timeout_s``
    (unless the caller set one), so a lost worker fails the step, never hangs
    it; a training step Ada-Grouper's online tuning profiles is traced."""
    rt = active()
    if rt is None:
        return options
    deadline = rt.cluster is not None and not (options is not None and options.timeout_in_ms)
    capture = existing_capture(graph) if graph is not None else None
    profiled = (capture is not None and capture.retuner is not None
                and capture.rewrite.stepped and capture.retuner.profile_due())
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


def made_callable(graph: ops.Graph) -> None:
    """A callable (Keras in graph mode) fixes its fetches: online tuning
    cannot move the k of the steps it runs, and is turned off, saying so."""
    capture = existing_capture(graph)
    if capture is not None and capture.retuner is not None and capture.rewrite.stepped:
        _keep_group_size(capture.retuner.group_size, "the training step runs through a Session "
                         "callable (Keras), whose fetches are fixed; online tuning follows "
                         "Session.run steps", graph)
        capture.retuner = None


def _keep_group_size(group_size: int, why: str, graph: ops.Graph) -> None:
    """Say that online tuning (``pipeline.retune_steps``) cannot move k."""
    fallback.fall_back("pipeline.retune_steps (online tuning of kFkB's k)",
                       f"k stays {group_size} as planned: {why}", "Set pipeline.retune_steps to 0 "
                       "to silence this", graph)


def after_run(graph: ops.Graph, run_metadata: Optional[config_pb2.RunMetadata]) -> None:
    """A run of ``graph`` ended: a step profiled for Ada-Grouper's online
    tuning may move k (``runtime.retune``), building that k's pipeline once."""
    capture = existing_capture(graph)
    retuner = capture.retuner if capture is not None else None
    if retuner is None or not retuner.pending or run_metadata is None:
        return
    retuner.pending = False
    try:
        tasks = step_timeline(run_metadata, graph=graph).tasks
    except PlanError:  # the trace holds none of the tasks (the run fetched no step)
        return
    if len(tasks) < 2 * retuner.num_stages * retuner.num_micro_batch:
        return  # not a whole training step (a forward-only fetch): no profile this time
    group_size = retuner.profiled(tasks)
    if group_size is None:
        return
    schedule = build_schedule("kfkb", retuner.num_stages, retuner.num_micro_batch, group_size)
    built = capture.rewrite.use_group_size(group_size, schedule)
    log.info("tfpar: Ada-Grouper moved k %d -> %d after step %d (%s)",
             capture.plan.group_size, group_size, retuner.steps,
             "its pipeline built now, once" if built else "its pipeline was built before")
    capture.plan = dataclasses.replace(capture.plan, group_size=group_size)


def make_iterator(ds, make):
    """Iterators read the dataset with its static batch dimension relaxed
    (``hooks.batch_shapes``). ``io.shard_dataset``: in a Horovod job each
    process iterates over its shard of the dataset; in a TF_CONFIG cluster the
    chief makes one iterator per worker, on that worker, over its shard
    (recorded in the capture for the rewrite). Shards are whole elements:
    batches, if the dataset batches."""
    rt = active()
    if rt is None:
        return make(ds)
    ds, declared = relaxed_dataset(ds)
    iterator, shards = _sharded_iterator(rt, ds, make)
    if declared is not None:  # the global batch: every shard's
        capture = capture_for(ops.get_default_graph())
        capture.declared_batch[iterator._iterator_resource.op.name] = declared * shards  # pylint: disable=protected-access
    return iterator


def _sharded_iterator(rt: Runtime, ds, make):
    """(the iterator this process reads, how many shards the global batch is
    read in): ``make_iterator``'s ``io.shard_dataset``."""
    if not rt.config.get("io.shard_dataset"):
        return make(ds), 1
    if rt.config.get("communication.backend") == "horovod":
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        return make(ds.shard(hvd.size(), hvd.rank())), hvd.size()
    if rt.cluster is None:
        fallback.fall_back(
            "io.shard_dataset", "this process runs alone (no TF_CONFIG cluster nor Horovod job), "
            "so it reads the whole dataset", "Set io.shard_dataset only for jobs of several "
            "workers or processes", ops.get_default_graph())
        return make(ds), 1
    count = len(rt.cluster.workers)
    iterator = make(ds.shard(count, 0))
    others = []
    for task in range(1, count):
        with ops.device(rt.cluster.host_cpu(task)):
            others.append(make(ds.shard(count, task)))
    capture = capture_for(ops.get_default_graph())
    capture.worker_iterators[iterator._iterator_resource.op] = others  # pylint: disable=protected-access
    return iterator, count


def rewrites_next(graph: ops.Graph) -> bool:
    """Whether the next run of ``graph`` rewrites it (``before_run``)."""
    capture = existing_capture(graph)
    return (active() is not None and capture is not None and bool(capture.gradient_calls)
            and capture.rewrite is None)


def ran_before_rewrite(graph: ops.Graph, carried: int) -> bool:
    """A session ran ``graph`` before tfpar rewrote it (its training step did not
    exist yet: Keras weights= / set_weights / load_weights, an initializer run
    before the optimizer was built). TensorFlow keeps the nodes it already sent
    that session, so a rewrite that changes the step (more than one version)
    needs the session reopened on the rewritten graph, with its ``carried``
    variable values: returns whether it does. Refused when the graph is
    finalized (``MonitoredSession``), where tfpar cannot add the ops it needs."""
    rewrite = capture_for(graph).rewrite
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


def run_failed(error: Exception) -> None:
    """A step failed: in a cluster, name the workers that are gone or do not
    answer (stopped, hung)."""
    rt = active()
    if rt is None or rt.cluster is None:
        return
    lost = rt.cluster.lost_workers(timeout_s=2.0)
    if lost:
        raise ClusterError(rt.cluster.describe(lost, LOST)) from error


def make_split_context(capture: GraphCapture, spec: TaskGraphSpec, rt: Runtime,
                       devices: Optional[Sequence[str]] = None,
                       planned: Optional[Dict[str, str]] = None):
    """The SplitContext of a split TaskGraph: its shard devices, fixed now
    because its variables are built sharded: ``devices``, or its
    VirtualDevice given the TaskGraphs opened so far (Whale §3.2.1); on
    mixed devices, shards in proportion to their speeds, or as a pinned plan
    says (``shard_shares``).
    ``planned`` (a pinned plan's layer -> candidate) forces its column / row
    choices on the dense units named after those layers, unless
    ``split.patterns`` names them."""
    if devices is None:
        devices = assign_devices([(s.name, s.device_count) for s in capture.task_graphs],
                                 rt.devices, rt.config.get("cluster.colocate_split_and_replicate")
                                 ).virtual_devices[-1][0]
    return SplitContext(spec.name, devices, rt.config.get("split.patterns"),
                        capture.sharded_tensors, shard_shares(rt, spec.index, devices),
                        {scope: how for scope, how in (planned or {}).items()
                         if how in ("column", "row")})


def setup_capture(capture: GraphCapture) -> None:
    """A pinned plan that shards layers: they are built split, on the devices
    the plan gives their TaskGraph, as the model is built."""
    rt = active()
    sharding = pinned_sharding(rt)
    if not sharding.get("layers"):
        return
    stages = sharding.get("stages") or {}
    task_graphs = pinned_plan(rt.config).task_graphs

    def context(cap: GraphCapture, spec: TaskGraphSpec):
        if spec.index >= len(task_graphs) or task_graphs[spec.index].strategy != "split":
            raise PlanError(f"tfpar: the pinned plan has no split TaskGraph {spec.index} for the "
                            f"layers being built; the model differs from the one planned")
        return make_split_context(cap, spec, rt, task_graphs[spec.index].replicas[0],
                                  sharding["layers"])
    capture.plan_split_layers({scope: stages.get(scope, 0) for scope in sharding["layers"]},
                              sharding["tensor_degree"], context, pipelined=bool(stages))


def task_graph_specs(capture: GraphCapture, rt: Runtime, automatic: Optional[Automatic]):
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
    """The plan for ``graph``: as annotated, or as the planner chose (no
    rewrite; a plan that shards layers even when this graph was built before
    it was known, so that it can be pinned)."""
    plan, index, _, _ = _planned(graph, capture, rt)
    automatic = capture.automatic[1] if capture.automatic is not None else None
    if automatic is not None and automatic.best is not automatic.runnable:
        return sharded_plan(automatic, rt, index, capture)
    return plan


def _planned(graph: ops.Graph, capture: GraphCapture, rt: Runtime):
    """The plan, with the graph index and the stage of every op it rests on
    (the rewrite uses the same ones), and, when Ada-Grouper chose k, the
    costs it chose by (``_group_costs``; else None)."""
    index = GraphIndex(graph)
    automatic = automatic_plan(index, capture, rt)
    specs = task_graph_specs(capture, rt, automatic)
    stage_of = assign_stages(index, capture, len(specs), [s.name for s in specs],
                             automatic.tags if automatic is not None else None)
    plan = plan_from_annotations(specs, rt.devices, planned_config(rt, automatic),
                                 _stats(graph, capture, index, stage_of, len(specs)), graph)
    if automatic is not None and automatic.runnable is not None:
        runnable = automatic.runnable
        plan = dataclasses.replace(plan, estimate=estimate_of(runnable, rt), task_graphs=tuple(
            dataclasses.replace(tg, estimate=part_estimate([part]))
            for tg, part in zip(plan.task_graphs, runnable.parts)))
    plan = with_stage_search(plan, automatic)
    group_costs = None
    if plan.schedule == "kfkb" and plan.group_size == "auto":
        group_costs = _group_costs(index, capture, rt, plan, stage_of)
        costs, memory_limit = group_costs
        plan = dataclasses.replace(plan, group_size=tune_group_size(
            plan.num_micro_batch, costs.forward_s, costs.backward_s, costs.transfer_s,
            costs.fixed_bytes, costs.activation_bytes, memory_limit))
    shares = batch_shares(index, capture, rt, plan)
    if shares:
        plan = dataclasses.replace(plan, batch_shares=shares)
    return dataclasses.replace(plan, notes=fallback.notes(graph)), index, stage_of, group_costs


def _check_recompute(rt: Runtime) -> None:
    """``memory.recompute`` is not for plans the planner makes: its estimates
    would not count it (the planner chooses recomputation itself, from
    ``auto.memory_techniques``, and applies what it chose)."""
    if rt.config.get("auto.auto_parallel"):
        raise PlanError("tfpar: memory.recompute is applied to graphs the planner did not "
                        "plan: with auto.auto_parallel, list 'recompute' in "
                        "auto.memory_techniques instead (the planner then recomputes what "
                        "memory needs, and counts it), or remove the key")


def _recompute_planned(graph: ops.Graph, capture: GraphCapture, index: GraphIndex,
                       mode: str) -> None:
    """The plan's recomputation (Korthikanti et al., ``planner.memory``):
    ``full`` recomputes every repeated block (``ModelView.labels``, name
    scopes), as ``memory.recompute`` would; ``selective`` every attention
    core, outputs included."""
    order, view = model_view(index, capture)
    with graph_edit.unfinalized(graph), recording_paused():
        if mode == "full":
            recompute_scopes(graph, capture, sorted({label for label in view.labels if label}))
            return
        groups: Dict[str, List[ops.Operation]] = {}
        for op, unit in zip(order, recomputation(view).unit["selective"]):
            if unit >= 0:
                groups.setdefault(f"attention_core_{unit}", []).append(op)
        recompute_ops(graph, capture, groups)


def _check_forced_units(capture: GraphCapture, rt: Runtime) -> None:
    """Every ShardingUnit ``split.patterns`` names exists in this graph."""
    forced = rt.config.get("split.patterns") or {}
    known = {name for ctx in capture.split_contexts.values() for name in ctx.decisions}
    unknown = sorted(set(forced) - known)
    if unknown:
        raise ConfigError(
            f"split.patterns names {', '.join(map(repr, unknown))}, but no ShardingUnit of this "
            f"graph is called so; its units (layer names as in their variables, or op kinds "
            f"numbered _1, _2...): {', '.join(sorted(known)) or 'none (no wh.split scope)'}")


def _group_costs(index: GraphIndex, capture: GraphCapture, rt: Runtime, plan: Plan, stage_of):
    """The pipeline's stage costs for choosing Ada-Grouper's k
    (``planner.grouper``), and the memory per device."""
    order, view = model_view(index, capture)
    rows = planning_batch(rt, view) / plan.data_parallel_degree / plan.num_micro_batch
    hardware = cluster_hardware(rt)
    costs = stage_costs(view, [stage_of.get(op, 0) for op in order], len(plan.task_graphs),
                        rows, hardware)
    return costs, hardware.memory_gb * 2 ** 30


def _retuner(graph: ops.Graph, capture: GraphCapture, rt: Runtime, plan: Plan,
             index: GraphIndex, stage_of, group_costs) -> Optional[GroupRetuner]:
    """Ada-Grouper's online tuner (``runtime.retune``), for a kFkB pipeline
    whose k is 'auto' and ``pipeline.retune_steps`` is not 0; ``group_costs``:
    what ``_planned`` tuned k by (None: a pinned plan's k, costed here)."""
    cfg = rt.config
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
        _keep_group_size(plan.group_size, why, graph)
        return None
    costs, memory_limit = group_costs or _group_costs(index, capture, rt, plan, stage_of)
    return GroupRetuner(plan.num_micro_batch, len(plan.task_graphs), plan.group_size,
                        costs.fixed_bytes, costs.activation_bytes, memory_limit, every,
                        cfg.get("pipeline.retune_tolerance"))


def _stats(graph: ops.Graph, capture: GraphCapture, index: GraphIndex, stage_of,
           num_task_graphs: int):
    """Per TaskGraph: ops (as placed: backward and updates with their forward
    TaskGraph) and trainable bytes."""
    num_ops = [0] * num_task_graphs
    for op in index.ops:
        num_ops[stage_of.get(op, 0)] += 1
    param_bytes = [0] * num_task_graphs
    for op, v in _trainable_variables(graph):
        if v.shape.is_fully_defined():
            param_bytes[stage_of.get(op, 0)] += v.shape.num_elements() * v.dtype.size
    split = {i: (ctx.devices, ctx.decisions, ctx.shares)
             for i, ctx in capture.split_contexts.items()}
    return {"num_ops": num_ops, "param_bytes": param_bytes, "split": split}


def _trainable_variables(graph: ops.Graph) -> list:
    """(op, variable) per trainable variable of ``graph``: its collection's, or
    for a TF2 step, the variables it reads (their op: the handle it captured)."""
    if not graph.building_function:
        return [(v.op, v) for v in graph.get_collection(ops.GraphKeys.TRAINABLE_VARIABLES)]
    inner = {id(outer): placeholder for outer, placeholder in graph.captures}
    return [(inner[id(v.handle)].op, v) for v in graph.variables
            if v.trainable and id(v.handle) in inner]


def unseen_training(graph: ops.Graph) -> Optional[str]:
    """The name of an optimizer update op of ``graph`` that tfpar did not see
    being built (the model was built before ``wh.init``), or None."""
    capture = existing_capture(graph)
    if capture is not None and capture.apply_calls:
        return None
    return next((op.name for op in graph.get_operations()
                 if op.type.startswith(_UPDATE_PREFIXES)), None)


_UPDATE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")


def built_before_init_message(op_name: str) -> str:
    return (f"tfpar: this graph trains ('{op_name}') but was built before wh.init(): tfpar "
            "did not see it being built and cannot parallelise it; it runs unchanged. Call "
            "wh.init() before building the model")


def rewrite_function(graph: ops.Graph) -> None:
    """A tf.function traced from eager code, before TensorFlow makes it a
    function: if it trains (tfpar recorded its gradients), it is planned and
    rewritten like a graph, and returns the merged values of what it returned
    (``rewriters.function_outputs``). Its variables stay where they are (one
    copy, outside the function): replicas read them and their summed
    gradients update them once."""
    rt = active()
    capture = existing_capture(graph)
    if rt is None or capture is None or not capture.gradient_calls:
        return
    if _plan_changes_nothing(rt):  # the step as traced is the plan: not retraced nor rewritten
        with graph.as_default():
            rt.function_plan = plan_for(graph, capture, rt)
        return
    static = _static_batch_inputs(graph)
    if not capture.relaxed:
        captured, why = captured_batch(graph, capture)
        if why:
            _train_on_one_device(rt, graph, why, _PASS_THE_BATCH)
            return
        if captured:
            log.info("tfpar: the tf.function %r reads its batch from tensors captured from "
                     "eager code (shapes %s): their rows are split over the replicas",
                     graph.name, ", ".join(str(t.shape.as_list()) for t in captured))
        if static or captured:
            capture.batch_captured = captured
            capture.retrace = True  # traced again, batch relaxed; that trace is rewritten
            return
    why = unsplittable(graph, capture) if capture.batch_captured else ""
    if why:
        _train_on_one_device(rt, graph, why, "Make each loss a mean or a sum over the rows of "
                             "the batch (of per-example losses) for tfpar to split it")
        return
    if static:
        _train_on_one_device(rt, graph, (
            f"it reads a batch of static size ({static[0].name}: {static[0].shape}), which "
            "TensorFlow built into the step"), "Make the dataset or iterator after wh.init()")
        return
    present = len(context.context().list_logical_devices(rt.device_type))
    if present < len(rt.devices):
        _train_on_one_device(rt, graph, (
            f"TensorFlow's eager context has {present} {rt.device_type} device(s) and the plan "
            f"{len(rt.devices)}"), "Call wh.init() before the script runs its first TensorFlow "
            "op (logical CPU devices can only be made then)")
        return
    with graph.as_default():
        translate = before_run(graph)
        if translate is not None:
            rewire_outputs(graph, translate)
            rt.function_plan = capture.plan


_PASS_THE_BATCH = ("Pass the batch to the step as arguments (step(x, y)), or read it from a "
                   "tf.data iterator in the step, for tfpar to split it")


def _train_on_one_device(rt: Runtime, graph: Optional[ops.Graph], why: str,
                         remedy: str) -> None:
    """Say, once per function (``graph``; None: eager code), that its step
    runs as traced, on one device."""
    name = graph.name if graph is not None else None
    if name in rt.warned_one_device:
        return
    rt.warned_one_device.add(name)
    where = "eager code" if name is None else f"the tf.function {name!r}"
    unchecked = (" (and check.finite_gradients does not check its gradients)"
                 if rt.config.get("check.finite_gradients") else "")
    fallback.fall_back(f"{where}, data parallel over {len(rt.devices)} devices",
                       f"it trains on one device, as it would without tfpar{unchecked}: {why}",
                       remedy, graph)


def _plan_changes_nothing(rt: Runtime) -> bool:
    """One device in one process, whole batches, no check to add: any plan runs
    the step as it is."""
    return (len(rt.devices) == 1 and rt.cluster is None
            and rt.config.get("communication.backend") != "horovod"
            and rt.config.get("pipeline.num_micro_batch") == 1
            and not rt.config.get("check.finite_gradients"))


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


def retraces_relaxed(graph: ops.Graph) -> bool:
    """Whether the tf.function just traced into ``graph`` trains with a static
    batch size: it is traced again with its arguments' batch dimension unknown."""
    capture = existing_capture(graph)
    return capture is not None and capture.retrace


def _static_batch_inputs(graph: ops.Graph) -> list:
    """A FuncGraph's batch inputs (arguments, iterator reads: not captures)
    with a known dimension 0."""
    return [t for op in graph.get_operations() if is_input(op) for t in op.outputs
            if t.shape.rank and t.shape[0] is not None]


def function_gradients(graph: ops.Graph) -> None:
    """Gradients tfpar does not record (a tf.GradientTape in eager code, a
    tf.function in a graph-mode script): their step runs on one device."""
    rt = active()
    if rt is None:
        return
    eager = context.executing_eagerly()
    step = graph
    while getattr(getattr(step, "outer_graph", None), "building_function", False):
        step = step.outer_graph  # the loop body's (or inner function's) step
    if eager:
        why, remedy = ("tfpar parallelises graphs and tf.functions called from eager code, not "
                       "eager gradients"), "Take the gradients in a tf.function step"
    elif ops.executing_eagerly_outside_functions():  # within a TF2 step
        why = ("its gradients are taken inside a loop, branch or tf.function within the step "
               "(a `for` over a dataset inside the tf.function is a loop); tfpar parallelises "
               "a step's top level")
        remedy = ("Iterate the dataset in Python or call next(iterator) in the step, and leave "
                  "the functions it calls undecorated")
    else:
        why = ("tfpar parallelises a tf.function called from eager code, not one built into "
               "a graph")
        remedy = "Use tf.gradients or an optimizer's minimize there"
    _train_on_one_device(rt, None if eager else step, why, remedy)


def before_run(graph: ops.Graph) -> Optional[Callable[[Any], Any]]:
    """Rewrite ``graph`` once (if it trains under tfpar); return its fetch translator."""
    rt = active()
    capture = existing_capture(graph)
    if rt is not None and graph not in _warned_unseen:
        _warned_unseen.add(graph)
        unseen = unseen_training(graph)
        if unseen is not None:
            fallback.fall_back(f"data parallelism for this graph's training ('{unseen}')",
                               "it was built before wh.init(), so tfpar did not see it being "
                               "built and runs it unchanged", "Call wh.init() before building "
                               "the model", graph)
    if rt is None or capture is None or not capture.gradient_calls:
        return None
    if capture.rewrite is None:
        with gc_paused():
            _rewrite(graph, capture, rt)
    elif len(capture.gradient_calls) > capture.rewritten_calls:
        _built_after_rewrite(graph, capture)
    return capture.rewrite


def _built_after_rewrite(graph: ops.Graph, capture: GraphCapture) -> None:
    """Gradients built after tfpar rewrote ``graph`` (a second model trained
    in Keras' one graph) run as built: say so, in the plan's notes too."""
    later = capture.gradient_calls[capture.rewritten_calls:]
    losses = ", ".join(f"'{y.name}'" for call in later for y in call.ys if hasattr(y, "name"))
    fallback.fall_back(
        f"data parallelism for the gradients of {losses}, built after tfpar rewrote this graph "
        "for its first training step", "they, and the updates they feed, run as built, on one "
        "device", "Build every training step before the graph first runs, or build and train each "
        "model in a tf.Graph of its own", graph)
    capture.plan = dataclasses.replace(capture.plan, notes=fallback.notes(graph))


def _check_finite(graph: ops.Graph, rewrite, rt: Runtime) -> None:
    """``check.finite_gradients`` (``rewriters.finite_check``), said in the plan.

    Raises:
      PlanError: the graph is loss-scaled (fp16), where non-finite gradients
        are expected and the step is skipped.
    """
    if applied(rt.config, rt.device_type) == "fp16":
        raise PlanError("tfpar: check.finite_gradients would fail the steps fp16 loss scaling "
                        "skips on purpose (their gradients overflow, and the loss scale halves): "
                        "use one or the other")
    checks = check_gradients(graph, rewrite)
    fallback.note(f"tfpar: check.finite_gradients: {checks} gradient tensors (every replica's "
                  "and micro-batch's) are checked for NaN and Inf before they are summed", graph)


def _planned_zero(techniques, reducer_for, devices) -> int:
    """The plan's ZeRO stage, if its replicas (on ``devices``) mirror
    variables: replicas sharing one copy of each (the CPUs of one process)
    have nothing to shard."""
    if techniques.zero and not reducer_for(devices).mirrors_variables:
        log.info("tfpar: the plan's ZeRO-%d is not needed: its replicas share one copy of "
                 "each variable", techniques.zero)
        return 0
    return techniques.zero


def _rewrite(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> None:
    """Plan ``graph`` and rewrite it (``capture.plan``, ``capture.rewrite``)."""
    if rt.config.get("memory.recompute"):
        _check_recompute(rt)
        with graph_edit.unfinalized(graph), recording_paused():
            recompute_scopes(graph, capture, rt.config.get("memory.recompute"))
    plan, index, stage_of, group_costs = _planned(graph, capture, rt)
    automatic = capture.automatic[1] if capture.automatic is not None else None
    refuse_planning_only(automatic, rt)
    techniques = planned_techniques(automatic, rt)
    if techniques.recompute != "none":
        _recompute_planned(graph, capture, index, techniques.recompute)
        plan, index, stage_of, group_costs = _planned(graph, capture, rt)  # copies' stages too
    warn_unbuilt_sharding(capture)
    _check_forced_units(capture, rt)
    if automatic is not None and automatic.best is not automatic.runnable:
        # What runs is unsharded; what current_plan() shows, to pin, is not.
        capture.sharded_plan = sharded_plan(automatic, rt, index, capture)
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
        if graph.building_function:  # variables live outside: no mirrors in it
            return LocalReducer(list(devices))
        local = make_reducer("auto" if horovod else cfg.get("communication.backend"),
                             devices, rt.device_type, keys,
                             fusion_bytes=cfg.get("communication.fusion_mb") * 2 ** 20,
                             timeout_s=cfg.get("communication.timeout_s"))
        return HorovodReducer(local) if horovod else local
    # One micro-batch needs no schedule; otherwise the plan's was validated.
    schedule = [] if plan.num_micro_batch == 1 else build_schedule(
        plan.schedule, placement.num_stages, plan.num_micro_batch, plan.group_size)
    if capture.calls_optimized is None:  # no session yet (see _calls_optimize)
        capture.calls_optimized = plan.num_micro_batch > 1
    with graph_edit.unfinalized(graph), recording_paused():
        rewrite = replicate(graph, capture, index, placement, plan.num_micro_batch,
                            reducer_for, schedule,
                            HorovodProcesses(cfg.get("io.shard_dataset")) if horovod else None,
                            functions=cfg.get("pipeline.task_functions"),
                            shares=plan.batch_shares,
                            offload=cfg.get("memory.offload_optimizer") or techniques.offload,
                            zero=cfg.get("memory.zero") or _planned_zero(
                                techniques, reducer_for, placement.stage_devices[0]),
                            precision=applied_option(cfg, rt.device_type))
        if cfg.get("check.finite_gradients"):
            _check_finite(graph, rewrite, rt)
    capture.plan = dataclasses.replace(plan, notes=fallback.notes(graph))  # the rewrite's too
    capture.rewritten_calls = len(capture.gradient_calls)
    capture.rewrite = FetchTranslator(graph, rewrite, plan.group_size)
    capture.retuner = _retuner(graph, capture, rt, plan, index, stage_of, group_costs)
    log.info("tfpar rewrote the graph:\n%s", plan.summary())
