"""Keeping copies of variables equal: after an op outside training writes a
variable (initializer, ``Saver.restore``, ``assign``), its value is copied to
the other stage devices' mirrored copies and, in a Horovod job, broadcast from
rank 0 (see ``data_parallel``)."""
from typing import Dict, Mapping

from tfpar.compat.tf import (array_ops, control_flow_ops, dtypes, gen_resource_variable_ops,
                             handle_data_util, ops, state_ops, tensor_lib)
from tfpar.rewriters import graph_edit
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.variables import variable_writers

__all__ = ["add_replica_sync", "assign_value", "read_value", "sync_new_writers"]


def read_value(var: ops.Operation) -> tensor_lib.Tensor:
    """The value of the variable made by ``var`` (resource or reference; a
    tf.function's captured handle too)."""
    handle = var.outputs[0]
    if handle.dtype == dtypes.resource:
        dtype = (var.get_attr("dtype") if var.type == "VarHandleOp" else
                 handle_data_util.get_resource_handle_data(handle).shape_and_type[0].dtype)
        return gen_resource_variable_ops.read_variable_op(handle, dtypes.as_dtype(dtype))
    return array_ops.identity(handle)


def assign_value(var: ops.Operation, value: tensor_lib.Tensor) -> ops.Operation:
    """An op writing ``value`` into the variable made by ``var``."""
    if var.outputs[0].dtype == dtypes.resource:
        return gen_resource_variable_ops.assign_variable_op(var.outputs[0], value)
    return state_ops.assign(var.outputs[0], value).op


def add_replica_sync(rw, writer: ops.Operation, readers) -> ops.Operation:
    """After ``writer`` changes a mirrored variable, copy it to every stage device
    (and, in a Horovod job, from rank 0 to every process); ``readers`` wait
    for that. Returns the op running ``writer`` and the copies."""
    assigns = []
    for var in (t.op for t in writer.inputs if t.op in set(rw.selection.variables)):
        copies = rw.replica_versions(var)
        if rw.processes is None and len(copies) == 1:
            continue  # one copy (a ZeRO slot on its owner)
        with ops.device(rw.placement.device(var)), ops.control_dependencies([writer]):
            value = read_value(var)
            if rw.processes is not None:
                value = rw.processes.broadcast(value)
        for j, copy in enumerate(copies if rw.processes is not None else copies[1:],
                                 start=0 if rw.processes is not None else 1):
            with ops.device(rw.placement.device(var, j)):
                assigns.append(assign_value(copy, value))
    sync = control_flow_ops.group(writer, *assigns, name="sync")
    for reader in readers:
        graph_edit.add_control_input(reader, sync)
    return sync


def sync_new_writers(graph: ops.Graph, rw, new_ops,
                     syncs: Mapping[ops.Operation, ops.Operation]
                     ) -> Dict[ops.Operation, ops.Operation]:
    """Add replica syncs for mirrored-variable writers among ``new_ops`` (ops
    built after the rewrite ``rw``, e.g. a Saver made after the first run),
    and make new ops waiting on a writer wait on its sync (``syncs``: the
    writers synced so far). Returns the syncs made, writer -> sync."""
    made: Dict[ops.Operation, ops.Operation] = {}
    if not rw.synced or not new_ops:
        return made
    fresh = set(new_ops)
    index = GraphIndex(graph)
    with graph.as_default():
        for var in rw.selection.variables:
            for writer in variable_writers(var):
                if writer in fresh and writer not in syncs and writer not in made:
                    readers = [c for c in index.control_consumers.get(writer, ()) if c in fresh]
                    made[writer] = add_replica_sync(rw, writer, readers)
    for op in new_ops:  # new ops waiting on an old writer (Keras' initializer group)
        for dep in op.control_inputs:
            sync = made.get(dep, syncs.get(dep))
            if sync is not None and sync is not op:
                graph_edit.add_control_input(op, sync)
    return made
