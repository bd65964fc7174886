"""Lowering a pipeline schedule to control dependencies (Whale §4, Ada-Grouper §4).

The schedule (``planner.schedule.build_schedule``) is data: per stage, the
ordered forward / backward tasks of the micro-batches. A task is the ops of the
version a stage device runs for one micro-batch, in one direction; backward
means backward-phase ops and every step op depending on one
(``stages.backward_dependent``). Consecutive tasks on a stage device are chained
through a NoOp barrier that waits for the earlier task's sinks and that the later
task's sources wait for, so every op of a task runs after every op of the one
before it (tasks that are one function call each: the later call waits on the
earlier one). With one micro-batch there is nothing to order.
"""
from typing import Dict, List, Sequence, Tuple

from tensorflow.python.framework import ops
from tensorflow.python.ops import control_flow_ops

from tfpar.hooks.capture import GraphCapture
from tfpar.rewriters import graph_edit
from tfpar.rewriters.select import GraphIndex
from tfpar.rewriters.stages import backward_dependent

__all__ = ["lower_schedule", "stage_tasks", "task_ops"]

TaskKey = Tuple[int, int, str, int]  # (stage device j, stage, "F" or "B", micro-batch)


def lower_schedule(rw, capture: GraphCapture, index: GraphIndex,
                   schedule: Sequence[Sequence]) -> None:
    """Order every stage device's tasks as ``schedule`` says; fills ``rw.task_ops``.

    Args:
      rw: the ``DataParallelRewrite`` after its units were cloned.
      schedule: ``schedule[s]``: stage s's tasks (``kind``, ``micro_batch``).
    """
    rw.task_ops = task_ops(rw, capture, index)
    if rw.num_micro_batch == 1:
        return
    for s, tasks in enumerate(schedule):
        for j, device in enumerate(rw.placement.stage_devices[s]):
            previous = None
            for task in tasks:
                members = rw.task_ops.get((j, s, task.kind, task.micro_batch))
                if not members:
                    continue
                if previous is not None:
                    _chain(previous, members, device, f"s{s}_d{j}_{task.kind}{task.micro_batch}")
                previous = members


def stage_tasks(rw, capture: GraphCapture, index: GraphIndex
                ) -> Dict[Tuple[int, str], List[ops.Operation]]:
    """The original ops of every stage's forward ("F") and backward ("B") task,
    keyed (stage, kind), in graph order."""
    backward = backward_dependent(rw.selection.step_ops, capture, index)
    groups: Dict[Tuple[int, str], List[ops.Operation]] = {}
    for op in rw.selection.step_ops:
        groups.setdefault((rw.placement.stage(op), "B" if op in backward else "F"), []).append(op)
    return groups


def task_ops(rw, capture: GraphCapture, index: GraphIndex) -> Dict[TaskKey, List[ops.Operation]]:
    """The ops of every task, keyed (stage device j, stage, kind, micro-batch)
    (a version made by a function call: the call)."""
    result = {}
    for (s, kind), originals in stage_tasks(rw, capture, index).items():
        for v, version_map in enumerate(rw.version_maps[s]):
            j, m = rw.layout.slot(s, v)
            members = [version_map.get(op, op) for op in originals if op not in rw.outside_tasks]
            result[(j, s, kind, m)] = list(dict.fromkeys(members))
    return result


def _chain(before: List[ops.Operation], after: List[ops.Operation], device: str,
           name: str) -> None:
    """Make every op of ``after`` run after every op of ``before``: directly
    when both are one op (a task function's call), else through a barrier."""
    if len(before) == len(after) == 1:
        graph_edit.add_control_input(after[0], before[0])
        return
    inside = set(before)
    sinks = [op for op in before
             if not any(c in inside for t in op.outputs for c in t.consumers())]
    with ops.device(device), ops.control_dependencies(sinks):
        barrier = control_flow_ops.no_op(name=f"pipeline/before_{name}")
    inside = set(after)
    for op in after:
        if not any(t.op in inside for t in op.inputs) and not any(
                c in inside for c in op.control_inputs):
            graph_edit.add_control_input(op, barrier)
