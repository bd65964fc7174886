"""``check.finite_gradients``: every version's gradients checked before they are summed.

Before: each version (replica j of a stage, micro-batch m) of a raw gradient
is read by the ops that weigh and sum it (or, on one device, by the update).

After: every reader reads it through a check beside it: an identity that
waits for an assertion that every value is finite. A failed assertion prints
(no quotes in it: TensorFlow escapes them) the variable, the gradient tensor,
the replica, TaskGraph, stage, micro-batch, device and Horovod rank, then the
step (a counter beside the check, counting from 1 the steps in which that
device computed gradients), and fails the step with TensorFlow's
``InvalidArgumentError``; updates of other variables that did not wait for it
may already have run in that step.
"""
from typing import Dict

from tfpar.compat import tf as internals
from tfpar.compat.tf import (array_ops, constant_op, device_lib, dtypes, gen_math_ops, math_ops,
                             ops, resource_variable_ops, tensor_lib)
from tfpar.rewriters import graph_edit
from tfpar.analysis.op_kinds import gradient_tensors
from tfpar.analysis.stages import host_device
from tfpar.rewriters.rewrite_record import DataParallelRewrite

__all__ = ["check_gradients"]


def check_gradients(graph: ops.Graph, rw: DataParallelRewrite) -> int:
    """Put a check (module docstring) between every version of every floating
    raw gradient of ``rw`` (``data_parallel.DataParallelRewrite``) and its
    readers; returns the number of checks made."""
    counters: Dict[str, tensor_lib.Tensor] = {}
    made = 0
    with graph.as_default(), ops.name_scope(None), ops.name_scope("tfpar_finite_check"):
        for g, var in rw.selection.raw_grads:
            for t in gradient_tensors(g):
                if t.dtype.is_floating:
                    made += _check_versions(rw, t, var, counters)
    return made


def _check_versions(rw: DataParallelRewrite, t: tensor_lib.Tensor, var: ops.Operation,
                    counters: Dict[str, tensor_lib.Tensor]) -> int:
    stage = rw.placement.stage(t.op)
    devices = range(len(rw.placement.stage_devices[stage]))
    made = 0
    for j in devices:
        for m in range(rw.num_micro_batch):
            version = rw.version_tensor(t, rw.layout.version(stage, j, m))
            readers = [(c, k) for c in version.consumers()
                       for k, x in enumerate(c.inputs) if x is version]
            where = (f"replica {j} of TaskGraph {rw.placement.task_graph_names[stage]} "
                     f"(stage {stage}), micro-batch {m}, on {version.device or 'its device'}"
                     + (f", Horovod rank {rw.processes.rank} of {rw.processes.size}"
                        if rw.processes is not None else ""))
            checked = _checked(version, f"the gradient of {var.name} ({t.name})", where,
                               counters)
            for c, k in readers:
                graph_edit.update_input(c, k, checked)
            made += 1
    return made


def _checked(t: tensor_lib.Tensor, what: str, where: str,
             counters: Dict[str, tensor_lib.Tensor]) -> tensor_lib.Tensor:
    """``t``, once every value of it is found finite: one assertion (a raw
    Assert op, which prints its data only when it fails; ``tf.debugging.Assert``
    would guard int64 data with a conditional, a function call per check and
    step) beside ``t`` (``_cpu``), reading the step counted there."""
    with ops.device(t.device):
        finite = math_ops.reduce_all(gen_math_ops.is_finite(t))
    host = _cpu(t.device)
    if host not in counters:
        counters[host] = _step(host)
    with ops.device(host):
        check = internals.raw_assert(finite, [
            f"tfpar: check.finite_gradients: {what} holds NaN or Inf, computed by {where}; the "
            "step failed, and updates of other variables in it may have run: continue from a "
            "checkpoint. The step (counted from 1):", counters[host]])
    with ops.device(t.device), ops.control_dependencies([check]):
        return array_ops.identity(t)


def _cpu(device: str) -> str:
    """``device`` if a CPU (or unplaced), else its host's CPU: where its
    check's assertion and step counter run (Assert has CPU kernels only)."""
    if not device or device_lib.DeviceSpec.from_string(device).device_type == "CPU":
        return device
    return host_device(device)


def _step(host: str) -> tensor_lib.Tensor:
    """This step's number on ``host``: its counter read (0 before its first
    write) plus 1, written back."""
    with ops.init_scope(), ops.device(host):
        counter = resource_variable_ops.ResourceVariable(
            constant_op.constant(0, dtypes.int64), trainable=False, collections=[],
            name="step_counter")
    with ops.device(host):
        step = internals.read_or(counter, 0) + 1
        with ops.control_dependencies([counter.assign(step, read_value=False)]):
            return array_ops.identity(step)
