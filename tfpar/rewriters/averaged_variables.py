"""Variables the training step updates from their own values (BatchNorm's
moving statistics, ``select.averaged_variables``): each version of the step
updates a local copy, and once every version is done the variable takes the
copies' values averaged by the versions' batch shares.

This is MirroredStrategy's rule for Keras' ON_READ / MEAN variables (each
replica updates a copy of its own; reading returns their mean), which for
BatchNorm's updates (linear in the old value) gives the same mean. It holds
for any writer, one tfpar cannot look into included (Keras' update under a
``tf.cond`` on the learning phase), runs once per step, and does not depend on
which version finishes first: two identical runs give identical statistics.
Before, every version applied its own update to the one variable: R times
too far on R versions, and racing where the update assigns.

* ``make_local_copies`` (before the versions are built): a copy of each such
  variable per version, on the version's device, a variable of its own
  outside every collection (never saved, never initialized by the script);
  the versions read and write it where the script reads and writes the
  variable (``local_copy``);
* ``average_local_copies`` (after the gradients are reduced): each copy is set
  from the variable (its stage device's mirror) before its version uses it;
  each mirror is assigned the sum, over the stage's versions, of their batch
  share x their copy (declared ONLY_FIRST_REPLICA: the first version's copy),
  summed across the stage's devices by the gradients' reducer. Ops that
  waited for a writer of the variable also wait for that, and fetching a
  writer runs it.
"""
from typing import Dict, List, Optional, Tuple

from tfpar import fallback
from tfpar.compat.tf import (control_flow_ops, gen_resource_variable_ops, handle_data_util,
                             math_ops, ops, tensor_lib)
from tfpar.rewriters import graph_edit
from tfpar.rewriters.replica_sync import assign_value, read_value
from tfpar.analysis.op_kinds import VARIABLE_TYPES
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["average_local_copies", "local_copy", "make_local_copies", "reroute_to_local_copies"]


def make_local_copies(graph: ops.Graph, rw: RewriteBuilder
                      ) -> Dict[Tuple[int, int], Dict[tensor_lib.Tensor, tensor_lib.Tensor]]:
    """A local copy of every averaged variable per version of its stage:
    (stage, version) -> variable handle -> its copy's (``rw.local_copies``);
    the copy path reroutes version 0's ops to theirs
    (``reroute_to_local_copies``), later versions and function calls read
    them through ``local_copy``."""
    copies: Dict[Tuple[int, int], Dict[tensor_lib.Tensor, tensor_lib.Tensor]] = {}
    for var, averaged in rw.selection.averaged.items():
        if averaged.why.startswith("written inside"):
            fallback.fall_back(
                f"variable '{var.name}' is {averaged.why} and declares no aggregation",
                "its replicas' and micro-batches' updates are averaged (as BatchNorm's moving "
                "statistics are), not summed", "Declare aggregation=tf.VariableAggregation.SUM "
                "on the variable if it accumulates, or MEAN to silence this", graph)
        stage = rw.placement.stage(var)
        for v in range(rw.layout.num_versions(stage)):
            j, m = rw.layout.slot(stage, v)
            copy = _new_variable(graph, var, f"{rw.prefix(stage, j)}/micro_{m}/local",
                                 rw.placement.device(var, j))
            copies.setdefault((stage, v), {})[var.outputs[0]] = copy
    return copies


def local_copy(rw: RewriteBuilder, handle: tensor_lib.Tensor, stage: int,
               version: int) -> Optional[tensor_lib.Tensor]:
    """The local copy version ``version`` of ``stage`` uses where the script
    uses ``handle``, if ``handle`` is an averaged variable's; else None."""
    return rw.local_copies.get((stage, version), {}).get(handle)


def reroute_to_local_copies(rw: RewriteBuilder) -> int:
    """The copy path's version 0 (the original ops) uses its local copies;
    returns the in-place edits made."""
    step = rw.selection.step_ops_set
    edits = 0
    for var in rw.selection.averaged:
        handle = var.outputs[0]
        for op in [c for c in handle.consumers() if c in step]:
            edits += graph_edit.reroute(op, handle, local_copy(
                rw, handle, rw.placement.stage(op), 0))
    return edits


def average_local_copies(graph: ops.Graph, rw: RewriteBuilder, reducer_for,
                         control_readers) -> Dict[ops.Operation, ops.Operation]:
    """Set every local copy before its version, and average them into the
    variable after (module docstring). ``control_readers``: op -> the ops
    the script made wait for it. Returns, per writer of an averaged
    variable, the op that runs its versions and the average after them."""
    syncs: Dict[ops.Operation, ops.Operation] = {}
    for var, averaged in rw.selection.averaged.items():
        stage = rw.placement.stage(var)
        devices = [rw.placement.device(var, j)
                   for j in range(len(rw.placement.stage_devices[stage]))]
        terms: List[List[tensor_lib.Tensor]] = [[] for _ in devices]
        for v in range(rw.layout.num_versions(stage)):
            j = rw.layout.slot(stage, v)[0]
            with ops.device(devices[j]):
                final = _run_on_copy(rw, var, stage, v, j)
                weight = (float(v == 0) if averaged.why == "declared ONLY_FIRST_REPLICA"
                          else rw.bridges.weight(stage, v))
                terms[j].append(final * math_ops.cast(weight, final.dtype))
        assigns = _assign_sums(rw, var, stage, devices, terms, reducer_for(devices))
        done = control_flow_ops.group(*assigns, name="averaged")
        for writer in averaged.writers:
            syncs[writer] = control_flow_ops.group(
                done, *rw.versions(writer), name="averaged_writes")
        step = rw.selection.step_ops_set
        for op in _downstream(averaged.writers, step, control_readers):
            for reader in control_readers.get(op, ()):
                if reader not in step:
                    for reader_j in rw.replica_versions(reader):
                        graph_edit.add_control_input(reader_j, done)
    return syncs


def _downstream(writers, step, control_readers) -> List[ops.Operation]:
    """``writers`` and the step ops after them (Keras groups its updates'
    identities): what the script waits for to know the variable updated."""
    found, stack = set(writers), list(writers)
    while stack:
        op = stack.pop()
        for c in [c for t in op.outputs for c in t.consumers()] + control_readers.get(op, []):
            if c in step and c not in found:
                found.add(c)
                stack.append(c)
    return sorted(found, key=lambda op: op.name)


def _run_on_copy(rw: RewriteBuilder, var: ops.Operation, stage: int, version: int,
                 j: int) -> tensor_lib.Tensor:
    """Set version ``version``'s copy of ``var`` from stage device ``j``'s
    mirror before the version uses it; return its value after."""
    copy = local_copy(rw, var.outputs[0], stage, version)
    users = list(copy.consumers())
    mirror = (rw.variable_copies(stage, j).get(var.outputs[0], var.outputs[0]) if rw.mirrored
              else var.outputs[0])
    prime = assign_value(copy.op, read_value(mirror.op))
    for user in users:
        graph_edit.add_control_input(user, prime)
    with ops.control_dependencies(users):
        return read_value(copy.op)


def _assign_sums(rw: RewriteBuilder, var: ops.Operation, stage: int, devices: List[str],
                 terms: List[List[tensor_lib.Tensor]], reducer) -> List[ops.Operation]:
    """Each stage device's mirror of ``var`` := the sum of every device's
    ``terms`` (``reducer`` across devices, and processes)."""
    sums = []
    for device, device_terms in zip(devices, terms):
        with ops.device(device):
            sums.append([device_terms[0] if len(device_terms) == 1
                         else math_ops.add_n(device_terms)])
    if len(devices) > 1 or getattr(reducer, "cross_process", False):
        sums = reducer.sum(sums)
    assigns = []
    for j, mirror in enumerate(rw.replica_versions(var)):  # one, where devices share it
        with ops.device(devices[j]):
            assigns.append(assign_value(mirror, sums[j][0]))
    return assigns


def _new_variable(graph: ops.Graph, var: ops.Operation, name: str,
                  device: str) -> tensor_lib.Tensor:
    """The handle of a new variable on ``device`` shaped like ``var`` (a
    graph's variable op, or a tf.function's captured handle), outside every
    collection."""
    if var.type in VARIABLE_TYPES:
        return graph_edit.clone_ops(graph, [var], name, device, {})[var].outputs[0]
    data = handle_data_util.get_resource_handle_data(var.outputs[0]).shape_and_type[0]
    with ops.device(device):
        return gen_resource_variable_ops.var_handle_op(
            dtype=data.dtype, shape=data.shape, shared_name=graph.unique_name(name), name=name)
