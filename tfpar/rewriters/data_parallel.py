"""Data parallelism and gradient accumulation as one rewrite (Whale §2.1 replicate).

Before: one copy of the forward/backward ops reads the whole fed batch, and the
optimizer applies its gradients.

After, with R replicas x M micro-batches (U = R*M units, unit u = r*M + m):
  * the batch inputs are sliced into U parts (``batch_split``);
  * unit 0 is the original ops, rerouted to slice 0; unit u > 0 is a copy on
    replica r's device reading slice u and replica r's variables;
  * per replica, unit gradients are summed with weights n_u/N, then summed
    across replicas by collective all-reduce (``allreduce``), giving the
    gradient of the global-batch mean loss;
  * the update ops (clipping, optimizer) run once per replica on the reduced
    gradient against replica r's mirrored variables (replica 0 = originals);
  * every op outside the training step that writes a mirrored variable
    (initializer, Saver restore, assign) is followed by a copy to the other
    replicas, so replicas never diverge;
  * ops outside the step that read step tensors (summaries) read merged values.
"""
import collections
import dataclasses
from typing import Dict, List, Optional

from tensorflow.python.framework import dtypes, indexed_slices, ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, control_flow_ops, math_ops, state_ops
from tensorflow.python.ops import gen_resource_variable_ops

from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.rewriters import graph_edit
from tfpar.rewriters.allreduce import CollectiveKeys, all_reduce_sum
from tfpar.rewriters.batch_split import BatchSplit, split_batch
from tfpar.rewriters.merge import merge_units
from tfpar.rewriters.select import (GraphIndex, Selection, gradient_tensors,
                                    select_replication, variable_writers)

__all__ = ["DataParallelRewrite", "add_replica_sync", "replicate", "sync_new_writers"]


@dataclasses.dataclass
class DataParallelRewrite:
    """What ``replicate`` did; read by fetch translation and tests.

    Attributes:
      devices: device of each replica.
      num_micro_batch: micro-batches per replica.
      selection: the ops/variables/inputs that were copied.
      unit_maps: per unit, original step op -> its copy (unit 0: identity).
      replica_maps: per replica, original update/variable op -> copy.
      split: the batch slices and unit weights (None when nothing was split).
      reduced: raw gradient tensor -> reduced gradient per replica.
      sync_ops: writer op -> op that runs it and copies the result to replicas.
      merged: step tensor -> merged tensor, filled on demand.
      edits: number of in-place edits of original ops.
    """

    devices: List[str]
    num_micro_batch: int
    selection: Selection
    unit_maps: List[Dict[ops.Operation, ops.Operation]]
    replica_maps: List[Dict[ops.Operation, ops.Operation]]
    split: Optional[BatchSplit] = None
    reduced: Dict[tensor_lib.Tensor, List[tensor_lib.Tensor]] = dataclasses.field(default_factory=dict)
    sync_ops: Dict[ops.Operation, ops.Operation] = dataclasses.field(default_factory=dict)
    merged: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dataclasses.field(default_factory=dict)
    edits: int = 0

    @property
    def num_units(self) -> int:
        return len(self.devices) * self.num_micro_batch

    def unit_versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every unit's copy of a step op (unit order)."""
        return [m.get(op, op) if u else op for u, m in enumerate(self.unit_maps)]

    def replica_versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every replica's copy of an update op or variable."""
        return [m.get(op, op) if r else op for r, m in enumerate(self.replica_maps)]

    def merged_tensor(self, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
        """``t`` (a step tensor) merged over units: batch-major concatenated,
        others averaged with unit weights. Builds ops on first use."""
        if t not in self.merged:
            versions = [op.outputs[t.value_index] for op in self.unit_versions(t.op)]
            static = self.selection.batch_inputs[0].shape[0]
            self.merged[t] = merge_units(t, versions, self.split.weights,
                                         self.selection.batch_dependent, static)
        return self.merged[t]


def replicate(graph: ops.Graph, capture: GraphCapture, devices: List[str],
              num_micro_batch: int, *, keys: CollectiveKeys, fusion_bytes: float,
              hint: str, timeout_s: float) -> DataParallelRewrite:
    """Rewrite ``graph`` for data parallelism over ``devices`` with
    ``num_micro_batch`` micro-batches per replica (see module docstring)."""
    index = GraphIndex(graph)
    global_steps = {v.op for v in graph.get_collection(ops.GraphKeys.GLOBAL_STEP)}
    global_steps |= {c.global_step.op for c in capture.apply_calls if c.global_step is not None}
    shared = {v.op for key in (ops.GraphKeys.LOCAL_VARIABLES, ops.GraphKeys.METRIC_VARIABLES)
              for v in graph.get_collection(key)}
    sel = select_replication(graph, capture, index, global_steps, shared)
    num_replicas = len(devices)
    rw = DataParallelRewrite(devices=list(devices), num_micro_batch=num_micro_batch,
                             selection=sel, unit_maps=[{}] * (num_replicas * num_micro_batch),
                             replica_maps=[{} for _ in range(num_replicas)])
    for op in sel.step_ops + sel.update_ops + sel.variables:
        graph_edit.set_device(op, devices[0])
    if rw.num_units == 1:
        return rw
    if not sel.batch_inputs:
        raise PlanError(
            "tfpar: data parallelism found no batch input: feed the model through a "
            "tf.compat.v1.placeholder or a tf.data iterator so tfpar can split the batch")
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
            if r:
                rw.replica_maps[r] = graph_edit.clone_ops(
                    graph, sel.variables, f"replica_{r}/variables", devices[r], {})
            for m in range(num_micro_batch):
                u = r * num_micro_batch + m
                if u == 0:
                    continue
                # Unit 0 already reads slice 0: copies read slice u instead.
                imap = {split.parts[i][0]: split.parts[i][u] for i in range(len(split.parts))}
                imap.update({v.outputs[0]: rw.replica_maps[r][v].outputs[0]
                             for v in sel.variables if r})
                unit_maps[u] = graph_edit.clone_ops(
                    graph, sel.step_ops, f"replica_{r}/micro_{m}", devices[r], imap)
        _sequence_micro_batches(rw, raw)
        _reduce_gradients(rw, raw, keys=keys, fusion_bytes=fusion_bytes, hint=hint,
                          timeout_s=timeout_s)
        _copy_updates(graph, rw)
        _wire_control_edges(rw, control_readers, step, copied)
        for t, c, k in outside_readers:
            if t not in raw:
                graph_edit.update_input(c, k, rw.merged_tensor(t))
                rw.edits += 1
        if num_replicas > 1:
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


def _sequence_micro_batches(rw: DataParallelRewrite, raw) -> None:
    """Micro-batch m+1 of a replica starts after micro-batch m's gradients exist,
    so only one micro-batch's activations are alive at a time."""
    grad_ops = sorted({t.op for t in raw}, key=lambda op: op.name)
    split_parts = {p for parts in rw.split.parts for p in parts}
    for r in range(len(rw.devices)):
        for m in range(1, rw.num_micro_batch):
            u = r * rw.num_micro_batch + m
            prev = [rw.unit_versions(op)[u - 1] for op in grad_ops]
            for op in rw.unit_maps[u].values():
                if any(x in split_parts for x in op.inputs):
                    for dep in prev:
                        graph_edit.add_control_input(op, dep)


def _reduce_gradients(rw: DataParallelRewrite, raw, **collective) -> None:
    """Weighted sum over a replica's micro-batches, then all-reduce across replicas."""
    num_replicas, mb = len(rw.devices), rw.num_micro_batch
    dense = [g for g, _ in rw.selection.raw_grads if not isinstance(g, indexed_slices.IndexedSlices)]
    sparse = [g for g, _ in rw.selection.raw_grads if isinstance(g, indexed_slices.IndexedSlices)]
    consumers = {t: [(c, k) for c in t.consumers() for k, x in enumerate(c.inputs) if x is t]
                 for t in raw}
    local = []
    for r, device in enumerate(rw.devices):
        with ops.device(device):
            per_grad = []
            for g in dense:
                versions = [op.outputs[g.value_index] for op in rw.unit_versions(g.op)]
                terms = [versions[r * mb + m] * math_ops.cast(rw.split.weights[r * mb + m], g.dtype)
                         for m in range(mb)]
                per_grad.append(terms[0] if mb == 1 else math_ops.add_n(terms))
            local.append(per_grad)
    summed = all_reduce_sum(local, rw.devices, **collective) if num_replicas > 1 and dense else local
    for i, g in enumerate(dense):
        rw.reduced[g] = [summed[r][i] for r in range(num_replicas)]
    for g in sparse:
        _reduce_sparse(rw, g, **collective)
    step = set(rw.selection.step_ops)
    for t in raw:
        for c, k in consumers[t]:
            if c not in step:
                graph_edit.update_input(c, k, rw.reduced[t][0])
                rw.edits += 1


def _reduce_sparse(rw: DataParallelRewrite, g: indexed_slices.IndexedSlices, *, keys, fusion_bytes,
                   hint, timeout_s) -> None:
    """IndexedSlices: weighted values and their indices are concatenated over
    units; across replicas they are all-gathered (duplicates are summed by the
    optimizer, as for any IndexedSlices gradient)."""
    from tensorflow.python.ops import collective_ops  # local: only sparse models need it
    num_replicas, mb = len(rw.devices), rw.num_micro_batch
    values = [op.outputs[g.values.value_index] for op in rw.unit_versions(g.values.op)]
    indices = [op.outputs[g.indices.value_index] for op in rw.unit_versions(g.indices.op)]
    per_replica = []
    for r, device in enumerate(rw.devices):
        with ops.device(device):
            us = range(r * mb, (r + 1) * mb)
            v = array_ops.concat([values[u] * math_ops.cast(rw.split.weights[u], values[u].dtype)
                                  for u in us], 0)
            i = array_ops.concat([indices[u] for u in us], 0)
            per_replica.append((v, i))
    if num_replicas > 1:
        group = keys.group()
        gathered = []
        for part in range(2):
            instance = keys.instance()
            outs = []
            for r, device in enumerate(rw.devices):
                with ops.device(device), keys.after_previous(device):
                    outs.append(collective_ops.all_gather_v2(
                        per_replica[r][part], group_size=num_replicas, group_key=group,
                        instance_key=instance, communication_hint=hint, timeout=timeout_s))
                keys.launched(device, outs[-1].op)
            gathered.append(outs)
        per_replica = list(zip(gathered[0], gathered[1]))
    rw.reduced[g.values] = [v for v, _ in per_replica]
    rw.reduced[g.indices] = [i for _, i in per_replica]


def _copy_updates(graph: ops.Graph, rw: DataParallelRewrite) -> None:
    """Replica r > 0 runs its own copy of the update ops on the reduced gradients."""
    sel = rw.selection
    step = set(sel.step_ops)
    for r in range(1, len(rw.devices)):
        imap = {v.outputs[0]: rw.replica_maps[r][v].outputs[0] for v in sel.variables}
        # The originals already read replica 0's reduced gradients: copies read replica r's.
        imap.update({red[0]: red[r] for red in rw.reduced.values()})
        for op in sel.update_ops:
            for t in op.inputs:
                if t.op in step and t not in imap:
                    imap[t] = rw.unit_versions(t.op)[r * rw.num_micro_batch].outputs[t.value_index]
        rw.replica_maps[r].update(graph_edit.clone_ops(
            graph, sel.update_ops, f"replica_{r}/update",
            rw.devices[r], imap))


def _wire_control_edges(rw: DataParallelRewrite, control_readers, step, copied) -> None:
    """An op waiting on a copied op also waits on every copy of it."""
    mb = rw.num_micro_batch
    for x in rw.selection.step_ops:
        versions = rw.unit_versions(x)
        for c in control_readers[x]:
            if c in step:
                continue
            if c in copied:
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
        with ops.device(rw.devices[0]), ops.control_dependencies([writer]):
            if var.type == "VarHandleOp":
                value = gen_resource_variable_ops.read_variable_op(var.outputs[0], dtype)
            else:
                value = array_ops.identity(var.outputs[0])
        for r, copy in enumerate(rw.replica_versions(var)[1:], start=1):
            with ops.device(rw.devices[r]):
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
    if len(rw.devices) < 2 or not new_ops:
        return
    fresh = set(new_ops)
    index = GraphIndex(graph)
    with graph.as_default():
        for var in rw.selection.variables:
            for writer in variable_writers(var):
                if writer in fresh and writer not in rw.sync_ops:
                    readers = [c for c in index.control_consumers.get(writer, ()) if c in fresh]
                    add_replica_sync(rw, writer, readers)
