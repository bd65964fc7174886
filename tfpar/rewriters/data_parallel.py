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
from typing import Any, Dict, List, Optional, Set

from tensorflow.python.framework import dtypes, ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.util import nest

from tfpar import fallback
from tfpar.analysis.batch_axes import BatchAxes
from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.rewriters import graph_edit
from tfpar.rewriters.averaged_variables import (average_local_copies, make_local_copies,
                                               reroute_to_local_copies)
from tfpar.rewriters.batch_split import split_batch, split_sources
from tfpar.rewriters.bridge import Bridges
from tfpar.rewriters.gradients import reduce_gradients, scale_seed, scale_seeds
from tfpar.rewriters.layout import Layout
from tfpar.rewriters.merge import merge_step_tensor
from tfpar.rewriters.pipeline import lower_schedule, stage_tasks, task_ops
from tfpar.rewriters.replica_sums import marked_sums, sum_across_replicas
from tfpar.rewriters.replica_sync import add_replica_sync
from tfpar.rewriters.select import GraphIndex, Selection, gradient_tensors, select_replication
from tfpar.rewriters.stages import Placement, host_device
from tfpar.rewriters.task_functions import call_tasks, task_order
from tfpar.rewriters.tied_weights import reduce_per_stage
from tfpar.rewriters.zero import Sharding, plan_sharding, refuse_unshardable, shard_updates

__all__ = ["DataParallelRewrite", "offload_optimizer", "replicate"]


@dataclasses.dataclass
class DataParallelRewrite:
    """What ``replicate`` did; read by fetch translation and tests.

    Attributes:
      placement: stage devices; stage of every op.
      layout: the rows of every version of every stage.
      selection: the ops/variables/inputs that were copied.
      version_maps: ``version_maps[s][v]``: original op of stage s -> its
        version v (empty for v = 0, the originals): its copy, or the call of
        its task's function.
      version_values: ``version_values[s][v]``: tensor of stage s -> its
        value in version v, for versions made by function calls (their
        results); empty for copies.
      functions: versions are function calls (``task_functions``).
      outside_tasks: step ops that run outside the task functions, once per
        stage device (variable reads).
      device_maps: ``device_maps[s][j]``: original variable / update op of stage
        s -> its copy on stage device j (mirrored variables only; j = 0 empty).
      bridges: the batch pieces, version weights and cross-stage tensors.
      reduced: raw gradient tensor -> reduced gradient per stage device.
      sync_ops: writer op -> op that runs it and copies the result to replicas.
      mirrored: stage devices hold their own copies of the variables.
      merged: step tensor -> merged tensor, filled on demand.
      seed_weighted: step ops downstream of scaled gradient seeds: their
        versions' values are already multiplied by the version weight.
      summed_grads: raw gradients of batch-sum losses, whose versions weigh 1
        (when gradients, not seeds, are weighted).
      gradient_terms: raw gradient tensor that is one stage's term of a
        variable's gradient summed across stages -> that gradient's tensor
        (``tied_weights``).
      original_inputs: step op -> its inputs as the script built them (the
        rewrite reroutes the originals' to their rows and stages).
      original_controls: step op -> its control inputs as the script built them.
      batch_axes: which axis of each step tensor holds the batch rows
        (``analysis.batch_axes.BatchAxes``).
      weight_tasks: each stage's backward is two tasks, input gradients ("B")
        and weight gradients ("W"): the schedule runs W tasks (zero-bubble).
      stage_tasks: (stage, kind) -> the original ops of that task
        (``pipeline.stage_tasks``).
      task_ops: (stage device j, stage, "F"/"B"/"W", micro-batch) -> the ops of
        that pipeline task (``pipeline.task_ops``).
      schedule_edges: the control edges (op, op it waits for) that order the
        tasks as the schedule says (``pipeline.order_tasks``).
      processes: the Horovod job this process is part of
        (``horovod_backend.HorovodProcesses``), or None.
      zero: which device owns each variable's optimizer state
        (``zero.Sharding``, ``memory.zero``), or None.
      precision: the grappler option computing in 16 bits, which task
        function calls turn on (``runtime.precision``), or None.
      local_copies: (stage, version) -> averaged variable's handle -> the
        handle of the version's local copy (``averaged_variables``).
      edits: number of in-place edits of original ops.
    """

    placement: Placement
    layout: Layout
    selection: Selection
    version_maps: List[List[Dict[ops.Operation, ops.Operation]]]
    device_maps: List[List[Dict[ops.Operation, ops.Operation]]]
    version_values: List[List[Dict[tensor_lib.Tensor, tensor_lib.Tensor]]] = dataclasses.field(
        default_factory=list)
    functions: bool = False
    outside_tasks: Set[ops.Operation] = dataclasses.field(default_factory=set)
    bridges: Optional[Bridges] = None
    reduced: Dict[tensor_lib.Tensor, List[tensor_lib.Tensor]] = dataclasses.field(default_factory=dict)
    sync_ops: Dict[ops.Operation, ops.Operation] = dataclasses.field(default_factory=dict)
    mirrored: bool = True
    merged: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dataclasses.field(default_factory=dict)
    seed_weighted: Set[ops.Operation] = dataclasses.field(default_factory=set)
    summed_grads: Set[tensor_lib.Tensor] = dataclasses.field(default_factory=set)
    gradient_terms: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dataclasses.field(
        default_factory=dict)
    original_inputs: Dict[ops.Operation, List[tensor_lib.Tensor]] = dataclasses.field(
        default_factory=dict)
    original_controls: Dict[ops.Operation, List[ops.Operation]] = dataclasses.field(
        default_factory=dict)
    batch_axes: Any = None
    weight_tasks: bool = False
    stage_tasks: Dict[tuple, List[ops.Operation]] = dataclasses.field(default_factory=dict)
    task_ops: Dict[tuple, List[ops.Operation]] = dataclasses.field(default_factory=dict)
    schedule_edges: Set[tuple] = dataclasses.field(default_factory=set)
    processes: Any = None
    zero: Optional[Sharding] = None
    precision: Optional[str] = None
    local_copies: Dict[tuple, Dict[tensor_lib.Tensor, tensor_lib.Tensor]] = dataclasses.field(
        default_factory=dict)
    edits: int = 0
    _copies: Dict[tuple, Dict] = dataclasses.field(default_factory=dict)

    @property
    def num_micro_batch(self) -> int:
        return self.layout.num_micro_batch

    @property
    def trivial(self) -> bool:
        """One version of everything in one process: the graph runs as built."""
        return self.layout.num_pieces == 1 and self.processes is None

    @property
    def synced(self) -> bool:
        """Writes of variables outside training must be copied (to mirrored
        copies, or to other processes)."""
        return self.mirrored or self.processes is not None

    def versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every version of a step op, in batch order."""
        return [m.get(op, op) for m in self.version_maps[self.placement.stage(op)]]

    def replica_versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every stage device's copy of an update op or variable (just ``op``
        when the devices share variables, or for a ZeRO slot)."""
        if not self.mirrored or (self.zero is not None and op in self.zero.slots):
            return [op]
        maps = self.device_maps[self.placement.stage(op)]
        return [m.get(op, op) if j else op for j, m in enumerate(maps)]

    def built_inputs(self, op: ops.Operation) -> List[tensor_lib.Tensor]:
        """``op``'s inputs as the script built them (before the rewrite rerouted
        the originals to their rows and stages)."""
        return self.original_inputs.get(op, op.inputs)

    def built_controls(self, op: ops.Operation) -> List[ops.Operation]:
        """``op``'s control inputs as the script built them."""
        return self.original_controls.get(op, op.control_inputs)

    def version_tensor(self, t: tensor_lib.Tensor, version: int) -> tensor_lib.Tensor:
        """Step tensor ``t`` as version ``version`` computes it.

        Raises:
          PlanError: the version is a function call that does not return it
            (``task_functions.call_tasks`` says which tensors it returns).
        """
        if t.op not in self.selection.step_ops_set or not (version or self.functions):
            return t
        stage = self.placement.stage(t.op)
        if not self.functions:
            return self.version_maps[stage][version][t.op].outputs[t.value_index]
        value = self.version_values[stage][version].get(t)
        if value is None:
            raise PlanError(
                f"tfpar: '{t.name}' ({t.op.type}) is computed inside a task function of "
                f"TaskGraph '{self.placement.task_graph_names[stage]}' and is not one of its "
                "results (tensors other ops read when tfpar rewrote the graph, forward tensors "
                "holding batch rows, what tf.gradients returned), so its per-micro-batch values "
                "cannot be fetched; to fetch it, set pipeline.task_functions to false")
        return value

    def variable_copies(self, stage: int, device: int) -> Dict:
        """Original variable handle -> the copy stage device ``device`` of
        ``stage`` reads."""
        key = (stage, device)
        if key not in self._copies:
            self._copies[key] = _variable_copies(self, stage, device)
        return self._copies[key]

    def prefix(self, stage: int, device: int) -> str:
        """Name scope of what stage device ``device`` of ``stage`` runs."""
        return (f"replica_{device}" if self.placement.num_stages == 1
                else f"stage_{stage}/replica_{device}")

    def merged_tensor(self, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
        """``t`` (a step tensor) merged over versions (``merge``). Builds ops on
        first use."""
        if t not in self.merged:
            self.merged[t] = merge_step_tensor(self, t)
        return self.merged[t]


def replicate(graph: ops.Graph, capture: GraphCapture, index: GraphIndex, placement: Placement,
              num_micro_batch: int, reducer_for, schedule,
              processes=None, functions: bool = True, shares=(),
              offload: bool = False, zero: int = 0,
              precision: Optional[str] = None) -> DataParallelRewrite:
    """Rewrite ``graph`` (see module docstring).

    Args:
      index: ``GraphIndex(graph)``, the one ``placement`` was computed on.
      placement: stage devices and the stage of every op.
      num_micro_batch: micro-batches per pipeline replica.
      reducer_for: devices -> the ``allreduce`` reducer summing across them.
      schedule: per stage, the ordered forward/backward tasks of one stage
        device (``ir.schedule.build_schedule``).
      processes: the Horovod job (``horovod_backend.HorovodProcesses``) or None.
      functions: make versions function calls where tasks can be functions.
      shares: per pipeline replica, its integer weight in the batch's rows
        (``Plan.batch_shares``; empty: even; one process only).
      offload: ``memory.offload_optimizer`` (``offload_optimizer``).
      zero: ``memory.zero``, the ZeRO stage (0: none; ``zero``).
      precision: the grappler option computing in 16 bits
        (``runtime.precision``), which task function calls turn on.
    """
    global_steps = {v.op for v in graph.get_collection(ops.GraphKeys.GLOBAL_STEP)}
    global_steps |= {c.global_step.op for c in capture.apply_calls if c.global_step is not None}
    shared = {v.op for key in (ops.GraphKeys.LOCAL_VARIABLES, ops.GraphKeys.METRIC_VARIABLES)
              for v in graph.get_collection(key)}
    sel, terms = reduce_per_stage(select_replication(graph, capture, index, global_steps, shared),
                                  placement.stage)
    layout = Layout(placement.num_replicas, num_micro_batch, placement.widths)
    stages = range(placement.num_stages)
    rw = DataParallelRewrite(
        placement=placement, layout=layout, selection=sel,
        version_maps=[[{} for _ in range(layout.num_versions(s))] for s in stages],
        device_maps=[[{} for _ in placement.stage_devices[s]] for s in stages],
        mirrored=(reducer_for(placement.stage_devices[0]).mirrors_variables
                  and max(map(len, placement.stage_devices)) > 1), processes=processes,
        weight_tasks=any(task.kind == "W" for tasks in schedule for task in tasks),
        precision=precision, gradient_terms=terms)
    for op in sel.step_ops + sel.update_ops + sel.variables:
        if op.type != "Placeholder":  # a tf.function's variable stays where it was made
            graph_edit.set_device(op, placement.device(op))
    if zero:
        refuse_unshardable(zero, rw.mirrored, processes is not None, graph.building_function)
        rw.zero = plan_sharding(sel, placement, zero)
    if offload:
        offload_optimizer(graph, rw)
    if rw.trivial:
        rw.task_ops = task_ops(rw, capture, index)
        return rw
    if not sel.batch_inputs:
        raise PlanError(
            "tfpar: found no batch input to split into replicas / micro-batches: feed the "
            "model through a tf.compat.v1.placeholder or a tf.data iterator")
    _refuse_unsplittable(sel.batch_inputs, sel.sparse_inputs)
    step = sel.step_ops_set
    rw.original_inputs = {op: list(op.inputs) for op in sel.step_ops}
    rw.original_controls = {op: list(op.control_inputs) for op in sel.step_ops}
    copied = step | set(sel.update_ops)
    raw = {t for g, _ in sel.raw_grads for t in gradient_tensors(g)}
    # Snapshot edges before tfpar adds ops of its own.
    outside_readers = [(t, c, k) for op in sel.step_ops for t in op.outputs
                       for c in t.consumers() if c not in copied
                       for k, x in enumerate(c.inputs) if x is t]
    control_readers = {op: list(index.control_consumers.get(op, ()))
                       for op in sel.step_ops + sel.update_ops + sel.sync_writers}
    crossing = [(c, k, t) for c in sel.step_ops for k, t in enumerate(c.inputs)
                if t.op in step and placement.stage(t.op) != placement.stage(c)]
    crossing_controls = [(c, p) for c in sel.step_ops for p in c.control_inputs
                         if p in step and placement.stage(p) != placement.stage(c)]
    with graph.as_default(), ops.name_scope(None), ops.name_scope("tfpar"):
        sources = _worker_sources(capture, sel, layout.num_pieces)
        if sources is not None:
            split = split_sources(sources, layout.num_pieces)
        else:
            per_replica = layout.num_pieces // layout.num_replicas  # replica-major pieces
            split = split_batch(sel.batch_inputs, layout.num_pieces,
                                processes.share if processes is not None else (0, 1),
                                processes.global_rows() if processes is not None else None,
                                sel.sparse_inputs, [w for w in shares for _ in range(per_replica)])
        rw.batch_axes = BatchAxes(sel.batch_dependent, sel.batch_inputs, rw.built_inputs,
                                  lambda op: capture.differentiates.get(op.name),
                                  not_rows={t for group in sel.sparse_inputs for t in group})
        rw.bridges = Bridges(layout, placement, split, rw.version_tensor, sel.batch_dependent,
                             rw.batch_axes.axis)
        _reroute_batch_inputs(rw, step)
        if rw.mirrored:
            _clone_variables(graph, rw)
        make_local_copies(graph, rw)
        tasks = stage_tasks(rw, capture, index)
        marks = marked_sums(rw, capture)
        order = _task_order_or_say(graph, rw, tasks, marks) if functions else None
        seeds = scale_seeds(rw, capture, index)
        if order is not None:
            rw.functions = True
            rw.version_values = [[{} for _ in range(layout.num_versions(s))] for s in stages]
            call_tasks(graph, rw, tasks, order, seeds,
                       {t for call in capture.gradient_calls for g in call.grads
                        if g is not None for t in gradient_tensors(g)},
                       capture.calls_optimized and not graph.building_function)
            lower_schedule(rw, capture, index, schedule)
            for op in sel.update_ops:  # they read version 0's values, not the template's
                for k, t in enumerate(op.inputs):
                    if t.op in step and t not in raw:
                        graph_edit.update_input(op, k, rw.version_tensor(t, 0))
        else:
            for s in stages:
                _clone_stage(graph, rw, s)
            reroute_to_local_copies(rw)
            _connect_stages(rw, crossing, crossing_controls)
            sum_across_replicas(rw, marks, reducer_for)
            lower_schedule(rw, capture, index, schedule)
            for seed in seeds:
                scale_seed(rw, seed, range(len(rw.versions(seed.op))))
        reduce_gradients(rw, raw, reducer_for)
        average_local_copies(graph, rw, reducer_for, control_readers)
        if rw.mirrored:
            _copy_updates(graph, rw)
        if rw.zero is not None:
            shard_updates(graph, rw, functools.partial(_owner_inputs, rw))
        _wire_control_edges(rw, control_readers, step, copied)
        for t, c, k in outside_readers:
            if t not in raw:
                graph_edit.update_input(c, k, rw.merged_tensor(t))
                rw.edits += 1
        if rw.synced:
            for writer in sel.sync_writers:
                add_replica_sync(rw, writer, control_readers[writer])
    return rw


def _refuse_unsplittable(batch_inputs, sparse_inputs) -> None:
    """Batch inputs keep their batch dimension unknown (``hooks.batch_shapes``
    relaxes placeholders and tf.data iterators made after ``wh.init``); one
    that fixes it (a queue's dequeue, a source made before ``wh.init``) let
    TensorFlow build its size into the graph, which copies on fewer rows would
    silently contradict. Composite inputs other than SparseTensors (a ragged
    tensor from an iterator arrives as one variant tensor) cannot be cut by
    rows yet."""
    sparse = {t for group in sparse_inputs for t in group}
    for t in batch_inputs:
        if t.dtype == dtypes.variant:
            consumers = ", ".join(f"'{c.name}' ({c.type})" for c in t.consumers()[:3])
            raise PlanError(
                f"tfpar: batch input '{t.name}' ({t.op.type}) is a composite tensor (a "
                f"ragged tensor or other composite from a tf.data iterator, read by {consumers}); "
                "tfpar cannot cut it into replicas / micro-batches by rows yet. Make it dense "
                "or a SparseTensor in the input pipeline (Dataset.map)")
        if t not in sparse and t.shape.rank and t.shape[0] is not None:
            queue = t.op.type.startswith("QueueDequeue")
            raise PlanError(
                f"tfpar: batch input '{t.name}' ({t.op.type}) has the static batch size "
                f"{t.shape[0]}, which TensorFlow built into the ops that read it; tfpar cannot "
                "split it over replicas / micro-batches. " + (
                    "Queue-based input (tf.train.batch, slice_input_producer) fixes it: read "
                    "the data with tf.data instead (Dataset.from_tensor_slices(...).batch(n))"
                    if queue else "Create it after wh.init(), or with its batch dimension "
                    "unknown (placeholder([None, ...]))"))


def offload_optimizer(graph: ops.Graph, rw: DataParallelRewrite) -> None:
    """``memory.offload_optimizer`` (ZeRO-Offload, Ren et al. 2021, keeps the
    optimizer on the host): the variables and the update ops run on the host
    CPU of their stage's device. An update op must run where every variable it
    writes lives, so the weights move with their slots; the step reads them
    (one copy to the device), and sends its summed gradients to the host once.

    Raises:
      PlanError: mirrored variables (a copy per device would mean a copy per
        device on the host) or a tf.function's variables (made before the
        rewrite, where they stay).
    """
    if rw.mirrored:
        raise PlanError("tfpar: memory.offload_optimizer keeps one copy of each variable on "
                        "the host, but this plan mirrors variables on every device of a stage "
                        "(communication.backend 'collective', several processes or GPUs): "
                        "use it with pipelines, or with data parallelism on the CPU devices "
                        "of one process")
    if graph.building_function:
        raise PlanError("tfpar: memory.offload_optimizer cannot move the variables of a "
                        "tf.function step: they were made before tfpar rewrote the step; "
                        "build the model in a graph (TF1 style or Keras in graph mode)")
    for op in rw.selection.update_ops + rw.selection.variables:
        graph_edit.set_device(op, host_device(rw.placement.device(op)))


def _worker_sources(capture: GraphCapture, sel: Selection, num_pieces: int):
    """With ``io.shard_dataset`` in a cluster: per worker, the batch inputs as
    read by that worker's own iterator (worker 0: the originals), or None."""
    if not capture.worker_iterators:
        return None
    batch_inputs = sel.batch_inputs
    if sel.sparse_inputs:
        raise PlanError(f"tfpar: io.shard_dataset cannot split the SparseTensor input "
                        f"'{sel.sparse_inputs[0][0].name}' yet; turn io.shard_dataset off (every "
                        "worker then reads the global batch and takes its rows)")
    workers = 1 + len(next(iter(capture.worker_iterators.values())))
    if num_pieces % workers:
        raise PlanError(f"tfpar: io.shard_dataset splits the rows of {workers} workers into "
                        f"{num_pieces} replicas x micro-batches; use a multiple of {workers}")
    sources = [list(batch_inputs)] + [[] for _ in range(workers - 1)]
    read = {}
    for t in batch_inputs:
        resource = t.op.inputs[0].op if t.op.type.startswith("IteratorGetNext") else None
        if resource not in capture.worker_iterators:
            raise PlanError(f"tfpar: with io.shard_dataset in a cluster every batch input must "
                            f"come from a tf.data iterator; '{t.name}' does not")
        if t.op not in read:
            read[t.op] = []
            for iterator in capture.worker_iterators[resource]:
                with ops.device(iterator._iterator_resource.device):  # pylint: disable=protected-access
                    read[t.op].append(nest.flatten(iterator.get_next()))
        for worker, outputs in enumerate(read[t.op], start=1):
            sources[worker].append(outputs[t.value_index])
    return sources


def _reroute_batch_inputs(rw: DataParallelRewrite, step) -> None:
    """The originals (version 0 of each stage) read their stage's first rows."""
    for i, t in enumerate(rw.selection.batch_inputs):
        for c in t.consumers():
            if c in step:
                rw.edits += graph_edit.reroute(c, t, rw.bridges.batch_input(i, rw.placement.stage(c), 0))


def _clone_variables(graph: ops.Graph, rw: DataParallelRewrite) -> None:
    """Mirrored: a copy of each stage's variables on its stage devices 1.."""
    placement = rw.placement
    for stage, devices in enumerate(placement.stage_devices):
        variables = [v for v in rw.selection.variables if placement.stage(v) == stage
                     and len(rw.replica_versions(v)) > 1]  # not a ZeRO slot
        for j in range(1, len(devices)):
            rw.device_maps[stage][j] = graph_edit.clone_ops(
                graph, variables, rw.prefix(stage, j) + "/variables",
                functools.partial(placement.device, index=j), {})


def _clone_stage(graph: ops.Graph, rw: DataParallelRewrite, stage: int) -> None:
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


def _task_order_or_say(graph: ops.Graph, rw: DataParallelRewrite, tasks,
                       marks: List[ops.Operation]) -> Optional[list]:
    """The order to define the task functions in (``task_functions.task_order``);
    where tasks cannot be functions (also with ``marks``, sums over the
    replicas: ``replica_sums``), None, said (``fallback``) when copies grow
    with micro-batches (with one micro-batch a copy per replica costs what a
    call per replica does)."""
    order, why = task_order(rw, tasks)
    if marks:
        order, why = None, (f"'{marks[0].name}' sums batch statistics over the replicas "
                            "(synchronized batch norm), between the calls of one task")
    if order is None and rw.num_micro_batch > 1:
        fallback.fall_back(
            "pipeline.task_functions: each replica and micro-batch of a TaskGraph as a call of "
            "its task functions",
            f"they are copies of its ops (graph size and start-up grow with them), because {why}",
            "To ask for copies (and silence this), set pipeline.task_functions to false", graph)
    return order


def _variable_copies(rw: DataParallelRewrite, stage: int, device: int) -> Dict:
    """Original variable handle -> the copy stage device ``device`` reads."""
    result = {}
    for var in rw.selection.variables:
        owner = rw.placement.stage(var)
        peer = rw.layout.peer(device, stage, owner)
        if peer and var in rw.device_maps[owner][peer]:  # not a ZeRO slot
            result[var.outputs[0]] = rw.device_maps[owner][peer][var].outputs[0]
    return result


def _connect_stages(rw: DataParallelRewrite, crossing, crossing_controls) -> None:
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


def _copy_updates(graph: ops.Graph, rw: DataParallelRewrite) -> None:
    """Stage device j > 0 runs its own copy of the update ops of its stage on the
    reduced gradients and its copies of the variables (all but ZeRO's owned
    updates)."""
    owned = rw.zero.owned_ops if rw.zero is not None else set()
    for stage, devices in enumerate(rw.placement.stage_devices):
        update_ops = [op for op in rw.selection.update_ops
                      if rw.placement.stage(op) == stage and op not in owned]
        for j in range(1, len(devices)) if update_ops else ():
            rw.device_maps[stage][j].update(graph_edit.clone_ops(
                graph, update_ops, rw.prefix(stage, j) + "/update",
                functools.partial(rw.placement.device, index=j),
                _device_inputs(rw, stage, j)))


def _device_inputs(rw: DataParallelRewrite, stage: int, j: int) -> Dict:
    """Tensor an update op of ``stage`` reads from outside the update ops ->
    the one stage device j's copy reads: its variables, its peers' reduced
    gradients and step tensors."""
    placement, layout = rw.placement, rw.layout
    step = rw.selection.step_ops_set
    imap = dict(rw.variable_copies(stage, j))
    # The originals read device 0's reduced gradients: copies read their peer's.
    for grad, red in rw.reduced.items():
        imap[red[0]] = red[layout.peer(j, stage, placement.stage(grad.op))]
    for op in rw.selection.update_ops:
        for t in op.inputs if placement.stage(op) == stage else ():
            if t.op in step and t not in imap:
                owner = placement.stage(t.op)
                v = layout.version(owner, layout.peer(j, stage, owner), 0)
                imap[t] = rw.version_tensor(t, v)
    return imap


def _owner_inputs(rw: DataParallelRewrite, stage: int, j: int):
    """Tensor an original update op of ``stage`` reads -> the one stage device
    j's copies read (``zero.shard_updates``)."""
    imap, copies = _device_inputs(rw, stage, j), rw.device_maps[stage][j]
    return lambda t: (copies[t.op].outputs[t.value_index] if t.op in copies
                      else imap.get(t, t))


def _wire_control_edges(rw: DataParallelRewrite, control_readers, step, copied) -> None:
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
