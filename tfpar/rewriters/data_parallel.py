"""Data parallelism, gradient accumulation and pipelines as one rewrite
(Whale §2.1 replicate, §3.1.2 pipeline of TaskGraphs).

Before: one copy of the forward/backward ops reads the whole fed batch, and the
optimizer applies its gradients.

After, with R replicas x M micro-batches (U = R*M units, unit u = r*M + m), each
replica a chain of S stages (S = 1 without a pipeline; ``stages.Placement``):
  * the batch inputs are sliced into U parts (``batch_split``);
  * unit 0 is the original ops, rerouted to slice 0; unit u > 0 is a copy reading
    slice u and replica r's variables, each op on replica r's device of its stage;
  * each stage device runs its units' forward and backward tasks in the order of
    the pipeline schedule (``pipeline.lower_schedule``);
  * unit u's gradients are weighted by n_u/N, at no cost by scaling the seeds
    its backprop starts from (backprop is linear in them), or, for higher-order
    gradients, by scaling its gradients; a replica sums its units' gradients,
    then the sums are summed across the replicas of each stage (``allreduce``),
    giving the gradient of the global-batch mean loss;
  * with mirrored variables (the collective reducer): the update ops
    (clipping, optimizer) run once per replica on the reduced gradient against
    replica r's copy of the variables (replica 0 = originals), and every op
    outside the training step that writes a mirrored variable (initializer,
    Saver restore, assign) is followed by a copy to the other replicas, so
    replicas never diverge;
  * with shared variables (the local reducer: CPU devices of one process):
    every replica reads the original variables and the update ops run once;
  * ops outside the step that read step tensors (summaries) read merged values.
"""
import collections
import dataclasses
import functools
from typing import Dict, List, Optional, Set

from tensorflow.python.framework import dtypes, indexed_slices, ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, control_flow_ops, math_ops, state_ops
from tensorflow.python.ops import gen_resource_variable_ops

from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.rewriters import graph_edit
from tfpar.rewriters.batch_split import BatchSplit, split_batch
from tfpar.rewriters.merge import merge_units
from tfpar.rewriters.pipeline import lower_schedule, task_ops
from tfpar.rewriters.select import (GraphIndex, Selection, gradient_tensors,
                                    select_replication, variable_writers)
from tfpar.rewriters.stages import Placement

__all__ = ["DataParallelRewrite", "add_replica_sync", "replicate", "sync_new_writers"]


@dataclasses.dataclass
class DataParallelRewrite:
    """What ``replicate`` did; read by fetch translation and tests.

    Attributes:
      placement: devices of every (replica, stage); stage of every op.
      num_micro_batch: micro-batches per replica.
      selection: the ops/variables/inputs that were copied.
      unit_maps: per unit, original step op -> its copy (unit 0: identity).
      replica_maps: per replica, original update/variable op -> copy.
      split: the batch slices and unit weights (None when nothing was split).
      reduced: raw gradient tensor -> reduced gradient per replica.
      sync_ops: writer op -> op that runs it and copies the result to replicas.
      mirrored: replicas hold their own copies of the variables (else they
        share the originals and ``replica_maps`` are empty).
      merged: step tensor -> merged tensor, filled on demand.
      seed_weighted: step ops downstream of scaled gradient seeds: their unit
        values are already multiplied by the unit weight.
      task_ops: (replica, stage, "F"/"B", micro-batch) -> the ops of that
        pipeline task (``pipeline.task_ops``).
      edits: number of in-place edits of original ops.
    """

    placement: Placement
    num_micro_batch: int
    selection: Selection
    unit_maps: List[Dict[ops.Operation, ops.Operation]]
    replica_maps: List[Dict[ops.Operation, ops.Operation]]
    split: Optional[BatchSplit] = None
    reduced: Dict[tensor_lib.Tensor, List[tensor_lib.Tensor]] = dataclasses.field(default_factory=dict)
    sync_ops: Dict[ops.Operation, ops.Operation] = dataclasses.field(default_factory=dict)
    mirrored: bool = True
    merged: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dataclasses.field(default_factory=dict)
    seed_weighted: Set[ops.Operation] = dataclasses.field(default_factory=set)
    task_ops: Dict[tuple, List[ops.Operation]] = dataclasses.field(default_factory=dict)
    edits: int = 0

    @property
    def num_replicas(self) -> int:
        return self.placement.num_replicas

    @property
    def num_units(self) -> int:
        return self.num_replicas * self.num_micro_batch

    def unit_versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every unit's copy of a step op (unit order)."""
        return [m.get(op, op) if u else op for u, m in enumerate(self.unit_maps)]

    def replica_versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every replica's copy of an update op or variable (just ``op`` when
        the replicas share variables)."""
        if not self.mirrored:
            return [op]
        return [m.get(op, op) if r else op for r, m in enumerate(self.replica_maps)]

    def merged_tensor(self, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
        """``t`` (a step tensor) merged over units: batch-major concatenated,
        others averaged with unit weights. Builds ops on first use."""
        if t not in self.merged:
            versions = [op.outputs[t.value_index] for op in self.unit_versions(t.op)]
            static = self.selection.batch_inputs[0].shape[0]
            self.merged[t] = merge_units(t, versions, self.split.weights,
                                         self.selection.batch_dependent, static,
                                         weighted=t.op in self.seed_weighted)
        return self.merged[t]


def replicate(graph: ops.Graph, capture: GraphCapture, index: GraphIndex, placement: Placement,
              num_micro_batch: int, reducers, schedule) -> DataParallelRewrite:
    """Rewrite ``graph`` (see module docstring).

    Args:
      index: ``GraphIndex(graph)``, the one ``placement`` was computed on.
      placement: devices of every (replica, stage) and the stage of every op.
      num_micro_batch: micro-batches per replica.
      reducers: per stage, the ``allreduce`` reducer over that stage's devices.
      schedule: per stage, the ordered forward/backward tasks of a replica
        (``planner.schedule.build_schedule``).
    """
    global_steps = {v.op for v in graph.get_collection(ops.GraphKeys.GLOBAL_STEP)}
    global_steps |= {c.global_step.op for c in capture.apply_calls if c.global_step is not None}
    shared = {v.op for key in (ops.GraphKeys.LOCAL_VARIABLES, ops.GraphKeys.METRIC_VARIABLES)
              for v in graph.get_collection(key)}
    sel = select_replication(graph, capture, index, global_steps, shared)
    num_replicas = placement.num_replicas
    rw = DataParallelRewrite(placement=placement, num_micro_batch=num_micro_batch,
                             selection=sel, unit_maps=[{}] * (num_replicas * num_micro_batch),
                             replica_maps=[{} for _ in range(num_replicas)],
                             mirrored=reducers[0].mirrors_variables and num_replicas > 1)
    for op in sel.step_ops + sel.update_ops + sel.variables:
        graph_edit.set_device(op, placement.device(op))
    if rw.num_units == 1:
        rw.task_ops = task_ops(rw, capture, index)
        return rw
    if not sel.batch_inputs:
        raise PlanError(
            "tfpar: found no batch input to split into replicas / micro-batches: feed the "
            "model through a tf.compat.v1.placeholder or a tf.data iterator")
    step = set(sel.step_ops)
    copied = step | set(sel.update_ops)
    raw = {t for g, _ in sel.raw_grads for t in gradient_tensors(g)}
    # Snapshot consumers before tfpar adds ops of its own.
    outside_readers = [(t, c, k) for op in sel.step_ops for t in op.outputs
                       for c in t.consumers() if c not in copied
                       for k, x in enumerate(c.inputs) if x is t]
    control_readers = {op: list(index.control_consumers.get(op, ()))
                       for op in sel.step_ops + sel.update_ops + sel.sync_writers}
    unit_maps = rw.unit_maps = [{} for _ in range(rw.num_units)]
    with graph.as_default(), ops.name_scope(None), ops.name_scope("tfpar"):
        rw.split = split = split_batch(sel.batch_inputs, rw.num_units)
        for i, t in enumerate(sel.batch_inputs):
            for c in t.consumers():
                if c in step:
                    rw.edits += _reroute(c, t, split.parts[i][0])
        for r in range(num_replicas):
            on_replica = functools.partial(placement.device, replica=r)
            if r and rw.mirrored:
                rw.replica_maps[r] = graph_edit.clone_ops(
                    graph, sel.variables, f"replica_{r}/variables", on_replica, {})
            for m in range(num_micro_batch):
                u = r * num_micro_batch + m
                if u == 0:
                    continue
                # Unit 0 already reads slice 0: copies read slice u instead.
                imap = {split.parts[i][0]: split.parts[i][u] for i in range(len(split.parts))}
                imap.update({v.outputs[0]: rw.replica_maps[r][v].outputs[0]
                             for v in sel.variables if r and rw.mirrored})
                unit_maps[u] = graph_edit.clone_ops(
                    graph, sel.step_ops, f"replica_{r}/micro_{m}", on_replica, imap)
        lower_schedule(rw, capture, index, schedule)
        _scale_seeds(rw, capture, index)
        _reduce_gradients(rw, raw, reducers)
        if rw.mirrored:
            _copy_updates(graph, rw)
        _wire_control_edges(rw, control_readers, step, copied)
        for t, c, k in outside_readers:
            if t not in raw:
                graph_edit.update_input(c, k, rw.merged_tensor(t))
                rw.edits += 1
        if rw.mirrored:
            for writer in sel.sync_writers:
                add_replica_sync(rw, writer, control_readers[writer])
    return rw


def _reroute(consumer: ops.Operation, old: tensor_lib.Tensor, new: tensor_lib.Tensor) -> int:
    count = 0
    for k, x in enumerate(consumer.inputs):
        if x is old:
            graph_edit.update_input(consumer, k, new)
            count += 1
    return count


def _scale_seeds(rw: DataParallelRewrite, capture: GraphCapture, index: GraphIndex) -> None:
    """Weight unit u's backprop by n_u/N by scaling the seeds it starts from.

    Sets ``rw.seed_weighted``: every step op downstream of a seed, whose unit
    values then equal the global-batch backprop restricted to the unit's rows
    (so fetched gradients merge by concatenation or plain sums). Leaves it empty,
    and gradients are weighted instead, when a seed is unknown or a
    differentiated tensor depends on a seed (higher-order gradients, where the
    backprop is no longer linear in the seed)."""
    seeds = {s for call in capture.gradient_calls for s in call.seeds}
    if not seeds or not all(isinstance(s, tensor_lib.Tensor) for s in seeds):
        return
    step = set(rw.selection.step_ops)
    downstream = {op for op in index.descendants({s.op for s in seeds}) if op in step}
    if any(getattr(y, "op", None) in downstream or getattr(y, "op", None) in
           {s.op for s in seeds} for call in capture.gradient_calls for y in call.ys):
        return
    rw.seed_weighted = downstream
    mb = rw.num_micro_batch
    for u in range(rw.num_units):
        unit_ops = set(rw.unit_maps[u].values()) if u else step
        for seed in sorted(seeds, key=lambda t: t.name):
            seed_u = (rw.unit_versions(seed.op)[u].outputs[seed.value_index]
                      if seed.op in step else seed)
            readers = [c for c in seed_u.consumers() if c in unit_ops]
            with ops.device(rw.placement.device(seed.op, u // mb)):
                scaled = seed_u * math_ops.cast(rw.split.weights[u], seed.dtype)
                for c in readers:
                    rw.edits += _reroute(c, seed_u, scaled)


def _unit_terms(rw: DataParallelRewrite, t: tensor_lib.Tensor, r: int,
                weigh: bool = True) -> List[tensor_lib.Tensor]:
    """Replica r's units' versions of ``t``, each weighted by n_u/N if ``weigh``."""
    mb = rw.num_micro_batch
    versions = [op.outputs[t.value_index] for op in rw.unit_versions(t.op)][r * mb:(r + 1) * mb]
    if not weigh or t.op in rw.seed_weighted:
        return versions
    return [v * math_ops.cast(rw.split.weights[r * mb + m], t.dtype)
            for m, v in enumerate(versions)]


def _reduce_gradients(rw: DataParallelRewrite, raw, reducers) -> None:
    """Weighted sum over a replica's micro-batches, then summed across the
    replicas of each stage (IndexedSlices: values and indices concatenated,
    then gathered; duplicates are summed by the optimizer, as for any
    IndexedSlices gradient)."""
    consumers = {t: [(c, k) for c in t.consumers() for k, x in enumerate(c.inputs) if x is t]
                 for t in raw}
    by_stage = collections.defaultdict(list)
    for g, _ in rw.selection.raw_grads:
        by_stage[rw.placement.stage(gradient_tensors(g)[0].op)].append(g)
    for stage, grads in sorted(by_stage.items()):
        _reduce_stage_gradients(rw, grads, reducers[stage])
    step = set(rw.selection.step_ops)
    for t in raw:
        for c, k in consumers[t]:
            if c not in step:
                graph_edit.update_input(c, k, rw.reduced[t][0])
                rw.edits += 1


def _reduce_stage_gradients(rw: DataParallelRewrite, grads, reducer) -> None:
    dense = [g for g in grads if not isinstance(g, indexed_slices.IndexedSlices)]
    sparse = [g for g in grads if isinstance(g, indexed_slices.IndexedSlices)]
    dense_local, sparse_local = [], []
    for r in range(rw.num_replicas):
        with ops.device(rw.placement.device(gradient_tensors(grads[0])[0].op, r)):
            dense_local.append([_sum(_unit_terms(rw, g, r)) for g in dense])
            sparse_local.append(
                [array_ops.concat(_unit_terms(rw, g.values, r), 0) for g in sparse]
                + [array_ops.concat(_unit_terms(rw, g.indices, r, weigh=False), 0)
                   for g in sparse])
    if rw.num_replicas > 1:
        dense_local = reducer.sum(dense_local) if dense else dense_local
        sparse_local = reducer.gather(sparse_local) if sparse else sparse_local
    replicas = range(rw.num_replicas)
    for i, g in enumerate(dense):
        rw.reduced[g] = [dense_local[r][i] for r in replicas]
    for i, g in enumerate(sparse):
        rw.reduced[g.values] = [sparse_local[r][i] for r in replicas]
        rw.reduced[g.indices] = [sparse_local[r][len(sparse) + i] for r in replicas]


def _sum(terms: List[tensor_lib.Tensor]) -> tensor_lib.Tensor:
    return terms[0] if len(terms) == 1 else math_ops.add_n(terms)


def _copy_updates(graph: ops.Graph, rw: DataParallelRewrite) -> None:
    """Replica r > 0 runs its own copy of the update ops on the reduced gradients."""
    sel = rw.selection
    step = set(sel.step_ops)
    for r in range(1, rw.num_replicas):
        imap = {v.outputs[0]: rw.replica_maps[r][v].outputs[0] for v in sel.variables}
        # The originals already read replica 0's reduced gradients: copies read replica r's.
        imap.update({red[0]: red[r] for red in rw.reduced.values()})
        for op in sel.update_ops:
            for t in op.inputs:
                if t.op in step and t not in imap:
                    imap[t] = rw.unit_versions(t.op)[r * rw.num_micro_batch].outputs[t.value_index]
        rw.replica_maps[r].update(graph_edit.clone_ops(
            graph, sel.update_ops, f"replica_{r}/update",
            functools.partial(rw.placement.device, replica=r), imap))


def _wire_control_edges(rw: DataParallelRewrite, control_readers, step, copied) -> None:
    """An op waiting on a copied op also waits on every copy of it."""
    mb = rw.num_micro_batch
    for x in rw.selection.step_ops:
        versions = rw.unit_versions(x)
        for c in control_readers[x]:
            if c in step:
                continue
            if c in copied and rw.mirrored:
                for r, c_r in enumerate(rw.replica_versions(c)):
                    for dep in versions[r * mb:(r + 1) * mb]:
                        graph_edit.add_control_input(c_r, dep)
            else:
                for dep in versions[1:]:
                    graph_edit.add_control_input(c, dep)
    for x in rw.selection.update_ops:
        for c in control_readers[x]:
            if c not in copied:
                for dep in rw.replica_versions(x)[1:]:
                    graph_edit.add_control_input(c, dep)


def add_replica_sync(rw: DataParallelRewrite, writer: ops.Operation, readers) -> None:
    """After ``writer`` changes a mirrored variable, copy it to every replica."""
    assigns = []
    for var in (t.op for t in writer.inputs if t.op in set(rw.selection.variables)):
        dtype = dtypes.as_dtype(var.get_attr("dtype"))
        with ops.device(rw.placement.device(var)), ops.control_dependencies([writer]):
            if var.type == "VarHandleOp":
                value = gen_resource_variable_ops.read_variable_op(var.outputs[0], dtype)
            else:
                value = array_ops.identity(var.outputs[0])
        for r, copy in enumerate(rw.replica_versions(var)[1:], start=1):
            with ops.device(rw.placement.device(var, r)):
                if var.type == "VarHandleOp":
                    assigns.append(gen_resource_variable_ops.assign_variable_op(
                        copy.outputs[0], value))
                else:
                    assigns.append(state_ops.assign(copy.outputs[0], value).op)
    sync = control_flow_ops.group(writer, *assigns, name="sync")
    for reader in readers:
        graph_edit.add_control_input(reader, sync)
    rw.sync_ops[writer] = sync


def sync_new_writers(graph: ops.Graph, rw: DataParallelRewrite, new_ops) -> None:
    """Add replica syncs for mirrored-variable writers among ``new_ops`` (ops
    built after the rewrite, e.g. a Saver made after the first run)."""
    if not rw.mirrored or not new_ops:
        return
    fresh = set(new_ops)
    index = GraphIndex(graph)
    with graph.as_default():
        for var in rw.selection.variables:
            for writer in variable_writers(var):
                if writer in fresh and writer not in rw.sync_ops:
                    readers = [c for c in index.control_consumers.get(writer, ()) if c in fresh]
                    add_replica_sync(rw, writer, readers)
