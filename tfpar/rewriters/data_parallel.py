"""Data parallelism, gradient accumulation and pipelines as one rewrite
(Whale §2.1 replicate, §3.1.2 pipeline of TaskGraphs, §3.2.3 bridge layers).

Before: one copy of the forward/backward ops reads the whole fed batch, and the
optimizer applies its gradients.

After, with R pipeline replicas x M micro-batches, each replica a chain of S
stages (S = 1 without a pipeline), stage s replicated ``width[s]`` times within
a pipeline replica (``layout.Layout``, ``stages.Placement``):
  * the batch inputs are cut into pieces (``batch_split``); version v of stage s
    computes the rows of ``layout.pieces(s, v)``;
  * every version of each task (a stage's forward or backward ops) is a call
    of the task's function on its stage device, the original ops being its
    template (``task_functions``); where tasks cannot be functions (split
    stages, reference variables, tasks reading each other both ways) version 0
    is the original ops and version v > 0 a copy of them on its stage device;
    inputs from other stages go through bridges (``bridge``);
  * each stage device runs its versions' forward and backward tasks in the
    order of the pipeline schedule (``pipeline.lower_schedule``);
  * a version's gradients are weighted by its share of the batch, at no cost by
    scaling the seeds its backprop starts from (backprop is linear in them), or,
    for higher-order gradients, by scaling its gradients; each stage device sums
    its versions' gradients, then the sums are summed across the stage's devices
    (``allreduce``), giving the gradient of the global-batch mean loss;
  * with mirrored variables (the collective reducer): the update ops
    (clipping, optimizer) run once per stage device on the reduced gradient
    against that device's copy of the variables (device 0 = originals), and
    every op outside the training step that writes a mirrored variable
    (initializer, Saver restore, assign) is followed by a copy to the other
    devices, so copies never diverge;
  * with shared variables (the local reducer: CPU devices of one process):
    every version reads the original variables and the update ops run once;
  * ops outside the step that read step tensors (summaries) read merged values.
"""
import dataclasses
import functools
from typing import Dict, List, Optional, Tuple

from tfpar.analysis.batch_axes import BatchAxes
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.op_kinds import gradient_tensors
from tfpar.analysis.stages import Placement
from tfpar.compat.tf import ops, tensor_lib
from tfpar.ir.recorded import Recorded
from tfpar.rewriters import graph_edit
from tfpar.rewriters.averaged_variables import (average_local_copies, make_local_copies,
                                               reroute_to_local_copies)
from tfpar.rewriters.batch_sources import (refuse_fixed_blocks, refuse_unsplittable,
                                           worker_sources)
from tfpar.rewriters.batch_split import split_batch, split_sources
from tfpar.rewriters.bridge import Bridges
from tfpar.rewriters.built_edges import BuiltEdges, built_edges
from tfpar.rewriters.gradients import reduce_gradients, scale_seed, scale_seeds
from tfpar.rewriters.layout import Layout
from tfpar.rewriters.merge import merge_step_tensor
from tfpar.rewriters.mirrored import (clone_variables, copy_updates, owner_inputs,
                                      wait_for_earlier_rounds)
from tfpar.rewriters.offload import offload_optimizer
from tfpar.rewriters.pipeline import lower_schedule, stage_tasks, task_ops
from tfpar.rewriters.replica_sums import marked_sums, sum_across_replicas
from tfpar.rewriters.replica_sync import add_replica_sync
from tfpar.rewriters.rewrite_record import DataParallelRewrite, RewriteBuilder
from tfpar.rewriters.select import Selection, select_replication
from tfpar.rewriters.task_calls import (Versions, call_markers, call_versions, outside_tasks,
                                       task_order)
from tfpar.rewriters.tied_weights import reduce_per_stage
from tfpar.rewriters.zero import plan_sharding, refuse_unshardable, shard_updates

__all__ = ["replicate"]


def replicate(graph: ops.Graph, recorded: Recorded, index: GraphIndex, placement: Placement,
              num_micro_batch: int, reducer_for, schedule,
              processes=None, functions: bool = True, calls_optimized: bool = False, shares=(),
              offload: bool = False, zero: int = 0,
              precision: Optional[str] = None) -> DataParallelRewrite:
    """Rewrite ``graph`` (see module docstring); returns what the rewrite made.
    Each pass reads the ``RewriteBuilder`` and returns what it made, which
    this module alone records in the builder.

    Args:
      index: ``GraphIndex(graph)``, the one ``placement`` was computed on.
      placement: stage devices and the stage of every op.
      num_micro_batch: micro-batches per pipeline replica.
      reducer_for: devices -> the ``allreduce`` reducer summing across them.
      schedule: per stage, the ordered forward/backward tasks of one stage
        device (``ir.schedule.build_schedule``).
      processes: the Horovod job (``horovod_backend.HorovodProcesses``) or None.
      functions: make versions function calls where tasks can be functions.
      calls_optimized: those calls optimize their bodies (``runtime.sessions``).
      shares: per pipeline replica, its integer weight in the batch's rows
        (``Plan.batch_shares``; empty: even; one process only).
      offload: ``memory.offload_optimizer`` (``offload_optimizer``).
      zero: ``memory.zero``, the ZeRO stage (0: none; ``zero``).
      precision: the grappler option computing in 16 bits
        (``runtime.precision``), which task function calls turn on.
    """
    sel = _selection(graph, recorded, index)
    rw = _new_rewrite(sel, placement, num_micro_batch, reducer_for, schedule, processes,
                      precision)
    _place(graph, rw, zero, offload)
    if rw.trivial:
        _stage_tasks(rw, recorded, index)
        rw.task_ops = task_ops(rw)
        return rw.freeze()
    refuse_unsplittable(rw.selection)
    edges = _built_edges(rw, index)
    with graph.as_default(), ops.name_scope(None), ops.name_scope("tfpar"):
        _split_batch(recorded, rw, shares)
        refuse_fixed_blocks(rw.selection, rw.batch_axes.axis)
        _reroute_batch_inputs(rw)
        if rw.mirrored:
            rw.device_maps = clone_variables(graph, rw)
        rw.local_copies = make_local_copies(graph, rw)
        tasks = _stage_tasks(rw, recorded, index)
        marks = marked_sums(rw, recorded)
        order = task_order(graph, rw, tasks, marks) if functions else None
        seeds = _weigh(rw, recorded, index)
        if order is not None:
            _versions_as_calls(graph, rw, recorded, tasks, order, seeds,
                               calls_optimized and not graph.building_function)
            rw.task_ops, rw.schedule_edges = lower_schedule(rw, schedule)
            _updates_read_version_0(rw, edges.raw)
        else:
            _versions_as_copies(graph, rw, edges, marks, reducer_for)
            rw.task_ops, rw.schedule_edges = lower_schedule(rw, schedule)
            for seed in seeds:
                rw.edits += scale_seed(rw, seed, range(len(rw.versions(seed.op)))).edits
        _reduce_and_update(graph, rw, edges, reducer_for)
        _rewire_readers(rw, edges)
    return rw.freeze()


def _selection(graph: ops.Graph, recorded: Recorded, index: GraphIndex) -> Selection:
    """What a replica copies (``select_replication``), but the global step
    (updated once per step) and local / metric variables (shared)."""
    global_steps = {v.op for v in graph.get_collection(ops.GraphKeys.GLOBAL_STEP)}
    global_steps |= {c.global_step.op for c in recorded.apply_calls if c.global_step is not None}
    shared = {v.op for key in (ops.GraphKeys.LOCAL_VARIABLES, ops.GraphKeys.METRIC_VARIABLES)
              for v in graph.get_collection(key)}
    return select_replication(graph, recorded, index, global_steps, shared)


def _new_rewrite(sel: Selection, placement: Placement, num_micro_batch: int, reducer_for,
                 schedule, processes, precision: Optional[str]) -> RewriteBuilder:
    """The builder, empty: gradients summed across stages split into their
    stages' terms (``tied_weights``), one version map per version of each
    stage and one device map per stage device; variables mirrored when the
    reducer mirrors them and some stage has several devices."""
    sel, terms = reduce_per_stage(sel, placement.stage)
    layout = Layout(placement.num_replicas, num_micro_batch, placement.widths)
    stages = range(placement.num_stages)
    return RewriteBuilder(
        placement=placement, layout=layout, selection=sel,
        version_maps=[[{} for _ in range(layout.num_versions(s))] for s in stages],
        device_maps=[[{} for _ in placement.stage_devices[s]] for s in stages],
        mirrored=(reducer_for(placement.stage_devices[0]).mirrors_variables
                  and max(map(len, placement.stage_devices)) > 1), processes=processes,
        weight_tasks=any(task.kind == "W" for tasks in schedule for task in tasks),
        precision=precision, gradient_terms=terms)


def _place(graph: ops.Graph, rw: RewriteBuilder, zero: int, offload: bool) -> None:
    """The originals move to their stage's device 0 (a tf.function's
    variable stays where it was made); ZeRO's sharding is planned, and the
    optimizer offloaded, if asked."""
    sel = rw.selection
    for op in sel.step_ops + sel.update_ops + sel.variables:
        if op.type != "Placeholder":
            graph_edit.set_device(op, rw.placement.device(op))
    if zero:
        refuse_unshardable(zero, rw.mirrored, rw.processes is not None, graph.building_function)
        rw.zero = plan_sharding(sel, rw.placement, zero)
    if offload:
        offload_optimizer(graph, rw)


def _built_edges(rw: RewriteBuilder, index: GraphIndex) -> BuiltEdges:
    """The edges as the script built them (``built_edges``), whose inputs and
    control inputs the record keeps (``original_inputs``, ``original_controls``)."""
    edges = built_edges(rw.selection, rw.placement, index)
    rw.original_inputs, rw.original_controls = dict(edges.inputs), dict(edges.controls)
    return edges


def _split_batch(recorded: Recorded, rw: RewriteBuilder, shares) -> None:
    """Cut the batch inputs into the layout's pieces (each worker's own
    reads with ``io.shard_dataset``), find the batch axis of every step
    tensor and make the bridges that hand each version its rows."""
    sel, layout, processes = rw.selection, rw.layout, rw.processes
    sources = worker_sources(recorded, sel, layout.num_pieces)
    if sources is not None:
        split = split_sources(sources, layout.num_pieces)
    else:
        per_replica = layout.num_pieces // layout.num_replicas  # replica-major pieces
        split = split_batch(sel.batch_inputs, layout.num_pieces,
                            processes.share if processes is not None else (0, 1),
                            processes.global_rows() if processes is not None else None,
                            sel.sparse_inputs, [w for w in shares for _ in range(per_replica)])
    rw.batch_axes = BatchAxes(sel.batch_dependent, sel.batch_inputs, rw.built_inputs,
                              lambda op: recorded.differentiates.get(op.name),
                              not_rows={t for group in sel.sparse_inputs for t in group})
    rw.bridges = Bridges(layout, rw.placement, split, rw.version_tensor, sel.batch_dependent,
                         rw.batch_axes.axis)


def _stage_tasks(rw: RewriteBuilder, recorded: Recorded, index: GraphIndex
                 ) -> Dict[Tuple[int, str], List[ops.Operation]]:
    """The original ops of every stage's tasks (``pipeline.stage_tasks``),
    keyed (stage, kind); the control inputs they keep become the built ones."""
    tasks = stage_tasks(rw, recorded, index)
    rw.stage_tasks = tasks.groups
    rw.original_controls.update(tasks.controls)
    return tasks.groups


def _weigh(rw: RewriteBuilder, recorded: Recorded,
           index: GraphIndex) -> List[tensor_lib.Tensor]:
    """How each version weighs its gradients (``gradients.scale_seeds``);
    returns the seeds to scale."""
    weighting = scale_seeds(rw, recorded, index)
    rw.seed_weighted, rw.summed_grads = weighting.seed_weighted, weighting.summed_grads
    rw.edits += weighting.edits
    return weighting.seeds


def _versions_as_calls(graph: ops.Graph, rw: RewriteBuilder, recorded: Recorded,
                       tasks, order: list, seeds, optimized: bool) -> None:
    """Every version of every task is a call of its function
    (``task_calls``), tasks in ``order``, each one's calls recorded before
    later tasks read them; variable reads and constants stay outside."""
    outside = outside_tasks(graph, rw)
    rw.functions, rw.outside_tasks = True, outside.members
    rw.version_values = [[{} for _ in range(rw.layout.num_versions(s))]
                         for s in range(rw.placement.num_stages)]
    _record_versions(rw, outside.versions)
    fetchable = {t for call in recorded.gradient_calls for g in call.grads
                 if g is not None for t in gradient_tensors(g)}
    markers = call_markers(graph, rw, order)
    for key in order:
        made = call_versions(graph, rw, key, tasks[key], seeds, fetchable, markers, optimized)
        _record_versions(rw, made)


def _record_versions(rw: RewriteBuilder, made: Versions) -> None:
    """Keep what versions run and compute for original ops (``made``)."""
    for (stage, v), ops_of in made.maps.items():
        rw.version_maps[stage][v].update(ops_of)
    for (stage, v), values in made.values.items():
        rw.version_values[stage][v].update(values)
    rw.edits += made.edits


def _updates_read_version_0(rw: RewriteBuilder, raw: set) -> None:
    """With task functions, the update ops read version 0's values of step
    tensors (not the template's, which no longer runs), but raw gradients."""
    step = rw.selection.step_ops_set
    for op in rw.selection.update_ops:
        for k, t in enumerate(op.inputs):
            if t.op in step and t not in raw:
                graph_edit.update_input(op, k, rw.version_tensor(t, 0))


def _versions_as_copies(graph: ops.Graph, rw: RewriteBuilder, edges: BuiltEdges,
                        marks: List[ops.Operation], reducer_for) -> None:
    """Versions 1.. of every stage are copies of its ops, reading their local
    copies of averaged variables, other stages' tensors through bridges and
    the replicas' sums of ``marks``."""
    for s in range(rw.placement.num_stages):
        _clone_stage(graph, rw, s)
    rw.edits += reroute_to_local_copies(rw)
    _connect_stages(rw, edges.crossing, edges.crossing_controls)
    rw.edits += sum_across_replicas(rw, marks, reducer_for)


def _reduce_and_update(graph: ops.Graph, rw: RewriteBuilder, edges: BuiltEdges,
                       reducer_for) -> None:
    """Reduce the gradients and the averaged variables' local copies, then
    copy the update ops to the mirrors and shard them (ZeRO)."""
    reduced = reduce_gradients(rw, edges.raw, reducer_for)
    rw.reduced, rw.edits = reduced.tensors, rw.edits + reduced.edits
    rw.sync_ops.update(average_local_copies(graph, rw, reducer_for, edges.control_readers))
    if rw.mirrored:
        for (stage, j), copies in copy_updates(graph, rw).items():
            rw.device_maps[stage][j].update(copies)
        wait_for_earlier_rounds(rw)
    if rw.zero is not None:
        copies = shard_updates(graph, rw, functools.partial(owner_inputs, rw))
        rw.zero = dataclasses.replace(rw.zero, copies=copies)


def _rewire_readers(rw: RewriteBuilder, edges: BuiltEdges) -> None:
    """Ops outside the step wait on every version and read merged values
    (raw gradients stay: they were reduced); writes of mirrored variables
    outside the step are copied to the replicas."""
    _wire_control_edges(rw, edges.control_readers, rw.selection.step_ops_set, edges.copied)
    for t, c, k in edges.outside_readers:
        if t not in edges.raw:
            if t not in rw.merged:
                rw.merged[t] = merge_step_tensor(rw, t)
            graph_edit.update_input(c, k, rw.merged[t])
            rw.edits += 1
    if rw.synced:
        for writer in rw.selection.sync_writers:
            rw.sync_ops[writer] = add_replica_sync(rw, writer, edges.control_readers[writer])


def _reroute_batch_inputs(rw: RewriteBuilder) -> None:
    """The originals (version 0 of each stage) read their stage's first rows."""
    step = rw.selection.step_ops_set
    for i, t in enumerate(rw.selection.batch_inputs):
        for c in t.consumers():
            if c in step:
                rw.edits += graph_edit.reroute(c, t, rw.bridges.batch_input(i, rw.placement.stage(c), 0))


def _clone_stage(graph: ops.Graph, rw: RewriteBuilder, stage: int) -> None:
    """Versions 1.. of ``stage``'s step ops on their stage devices; inputs from
    other stages are connected later."""
    sel, layout, placement = rw.selection, rw.layout, rw.placement
    stage_ops = [op for op in sel.step_ops if placement.stage(op) == stage]
    for v in range(1, layout.num_versions(stage)):
        j, m = layout.slot(stage, v)
        imap = {rw.bridges.batch_input(i, stage, 0): rw.bridges.batch_input(i, stage, v)
                for i in range(len(sel.batch_inputs))}
        if rw.mirrored:
            imap.update(rw.variable_copies(stage, j))
        imap.update(rw.local_copies.get((stage, v), {}))
        rw.version_maps[stage][v] = graph_edit.clone_ops(
            graph, stage_ops, f"{rw.prefix(stage, j)}/micro_{m}",
            functools.partial(placement.device, index=j), imap)


def _connect_stages(rw: RewriteBuilder, crossing, crossing_controls) -> None:
    """Every version reads other stages' tensors for its own rows (bridges) and
    waits on their ops of its own unit."""
    stage_of = rw.placement.stage
    for c, k, t in crossing:
        for v, c_v in enumerate(rw.versions(c)):
            new = rw.bridges.tensor(t, stage_of(c), v)
            if c_v.inputs[k] is not new:
                graph_edit.update_input(c_v, k, new)
                rw.edits += 1 if v == 0 else 0
    for c, p in crossing_controls:
        producer_versions = rw.versions(p)
        for v, c_v in enumerate(rw.versions(c)):
            unit = rw.layout.unit(stage_of(c), v)
            for source in rw.layout.unit_versions(stage_of(p), unit):
                graph_edit.add_control_input(c_v, producer_versions[source])


def _wire_control_edges(rw: RewriteBuilder, control_readers, step, copied) -> None:
    """An op waiting on a copied op also waits on every copy of it (on every
    call of its task instead, with functions: the template no longer runs)."""
    for x in rw.selection.step_ops:
        versions = rw.versions(x)
        for c in control_readers[x]:
            if c in step:
                continue
            for c_j in rw.replica_versions(c) if c in copied else [c]:
                for dep in versions:
                    graph_edit.add_control_input(c_j, dep)
                if rw.functions:
                    graph_edit.remove_control_input(c_j, x)
    for x in rw.selection.update_ops:
        for c in control_readers[x]:
            if c not in copied:
                for dep in rw.replica_versions(x)[1:]:
                    graph_edit.add_control_input(c, dep)
