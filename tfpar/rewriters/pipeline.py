"""Lowering a pipeline schedule to control dependencies (Whale §4, Ada-Grouper §4).

The schedule (``ir.schedule.build_schedule``) is data: per stage, the
ordered forward / backward tasks of the micro-batches. A task is the ops of the
version a stage device runs for one micro-batch, in one direction; backward
means backward-phase ops and every step op depending on one
(``stages.backward_dependent``); with the zero-bubble schedule a stage's backward
is two tasks, its input gradients (B) and the rest, its weight gradients (W)
(``_split_weight_gradients``). Consecutive tasks on a stage device are chained
through a NoOp barrier that waits for the earlier task's sinks and that the later
task's sources wait for, so every op of a task runs after every op of the one
before it (tasks that are one function call each: the later call waits on the
earlier one). With one micro-batch there is nothing to order.
"""
from typing import Dict, List, NamedTuple, Sequence, Set, Tuple

from tfpar.compat.tf import control_flow_ops, ops
from tfpar.ir.schedule import in_rounds, round_kind, task_round
from tfpar.ir.recorded import Recorded
from tfpar.rewriters import graph_edit
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.stages import backward_dependent
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["Lowered", "StageTasks", "lower_schedule", "order_tasks", "stage_tasks", "task_ops"]

TaskKey = Tuple[int, int, str, int]  # (stage device j, stage, "F", "B" or "W", micro-batch)
Edge = Tuple[ops.Operation, ops.Operation]  # (op, the op it waits for)


class StageTasks(NamedTuple):
    """The original ops of every stage's tasks (``stage_tasks``).

    Attributes:
      groups: (stage, kind) -> the task's original ops, in graph order.
      controls: step op -> its control inputs as built, less the gates the
        split of a backward into B and W dropped (its new built controls).
    """

    groups: Dict[Tuple[int, str], List[ops.Operation]]
    controls: Dict[ops.Operation, List[ops.Operation]]


class Lowered(NamedTuple):
    """A schedule lowered to control edges (``lower_schedule``).

    Attributes:
      task_ops: (stage device j, stage, kind, micro-batch) -> the ops of that
        task (``task_ops``).
      schedule_edges: the control edges added (``order_tasks``).
    """

    task_ops: Dict[TaskKey, List[ops.Operation]]
    schedule_edges: Set[Edge]


def lower_schedule(rw: RewriteBuilder, schedule: Sequence[Sequence]) -> Lowered:
    """Order every stage device's tasks as ``schedule`` says.

    Args:
      rw: the rewrite after its versions were made (``rw.stage_tasks`` too).
      schedule: ``schedule[s]``: stage s's tasks (``kind``, ``micro_batch``).
    """
    tasks = task_ops(rw)
    edges: Set[Edge] = set()
    if rw.num_micro_batch > 1:
        edges = order_tasks(tasks, schedule, rw.placement.stage_devices,
                            rounds=rw.selection.rounds.count)
    return Lowered(tasks, edges)


def order_tasks(tasks: Dict[TaskKey, List[ops.Operation]], schedule: Sequence[Sequence],
                stage_devices: Sequence[Sequence[str]], scope: str = "pipeline",
                rounds: int = 1) -> Set[Tuple[ops.Operation, ops.Operation]]:
    """Chain the ``tasks`` of every stage device in ``schedule`` order, once
    per round of the step (``ir.schedule.in_rounds``; barriers named
    ``scope/before_...``); with interleaved stages (tasks with a ``slot``),
    the tasks of every stage a device runs, in slot order. Returns the
    control edges added, (op, the op it now waits for)."""
    edges: Set[Tuple[ops.Operation, ops.Operation]] = set()
    for device, keys in _device_orders(in_rounds(schedule, rounds), stage_devices):
        previous = None
        for (j, s, kind, m) in keys:
            members = tasks.get((j, s, kind, m))
            if not members:
                continue
            if previous is not None:
                edges |= _chain(previous, members, device, f"{scope}/before_s{s}_d{j}_{kind}{m}")
            previous = members
    return edges


def _device_orders(schedule: Sequence[Sequence], stage_devices: Sequence[Sequence[str]]
                   ) -> List[Tuple[str, List[TaskKey]]]:
    """(device, the task keys it runs in order) per stage device: its stage's
    list; with interleaved stages (tasks with a ``slot``), per device, the
    tasks of every stage it runs, by slot."""
    lanes: Dict[Tuple, Tuple[str, List[Tuple[int, TaskKey]]]] = {}
    interleaved = any(task.slot >= 0 for stage in schedule for task in stage)
    for s, stage_schedule in enumerate(schedule):
        for j, device in enumerate(stage_devices[s]):
            _, keyed = lanes.setdefault(device if interleaved else (s, j), (device, []))
            keyed += [(task.slot, (j, s, task.kind, task.micro_batch)) for task in stage_schedule]
    return [(device, [key for _, key in (sorted(keyed, key=lambda pair: pair[0])
                                         if interleaved else keyed)])
            for device, keyed in lanes.values()]


def stage_tasks(rw: RewriteBuilder, recorded: Recorded, index: GraphIndex) -> StageTasks:
    """The original ops of every stage's forward ("F"), backward ("B") and,
    with ``rw.weight_tasks``, weight-gradient ("W") task of each round of the
    step (``ir.schedule.round_kind``), keyed (stage, kind), in graph order
    (``StageTasks``); made once per rewrite (it edits the graph)."""
    backward = backward_dependent(rw.selection.step_ops, recorded, index)
    groups: Dict[Tuple[int, str], List[ops.Operation]] = {}
    rounds = rw.selection.rounds.of
    for op in rw.selection.step_ops:
        kind = round_kind("B" if op in backward else "F", rounds.get(op, 0))
        groups.setdefault((rw.placement.stage(op), kind), []).append(op)
    controls = _split_weight_gradients(rw, groups) if rw.weight_tasks else {}
    return StageTasks(groups, controls)


def _split_weight_gradients(rw: RewriteBuilder, groups: Dict[Tuple[int, str], List[ops.Operation]]
                            ) -> Dict[ops.Operation, List[ops.Operation]]:
    """Split each stage's backward task (zero-bubble schedules, Qi et al. 2024
    §2): B keeps what the stages before it wait for, the ops that what they
    read from it is computed from; W the rest, the weight gradients. Only data
    inputs link a B op to W: ``tf.gradients``' gates (a NoOp every gradient of
    an op waits on, GATE_OP) order but compute nothing, and B ops stop waiting
    on a gate left in W. Any other control input from W moves into B, with
    what it reads. Returns the control inputs of the ops that stopped
    waiting on gates."""
    step = rw.selection.step_ops_set
    stage = rw.placement.stage
    read_across = {src for c in rw.selection.step_ops
                   for src in [t.op for t in rw.built_inputs(c)] + rw.built_controls(c)
                   if src in step and stage(src) != stage(c)}
    controls: Dict[ops.Operation, List[ops.Operation]] = {}
    for s, kind in [key for key in groups if task_round(key[1])[0] == "B"]:
        backward = groups.pop((s, kind))
        step_round = task_round(kind)[1]
        members = set(backward)
        needed: set = set()
        stack = [op for op in backward if op in read_across]
        while stack:
            op = stack.pop()
            if op not in needed:
                needed.add(op)
                stack += [t.op for t in rw.built_inputs(op) if t.op in members]
                stack += [p for p in rw.built_controls(op) if p in members and p.type != "NoOp"]
        for op in needed:
            built = rw.built_controls(op)
            gates = [p for p in built if p in members and p not in needed]
            for gate in gates:
                graph_edit.remove_control_input(op, gate)
            if gates:
                controls[op] = [p for p in built if not any(p is gate for gate in gates)]
        for base, ops_of_kind in (("B", [op for op in backward if op in needed]),
                                  ("W", [op for op in backward if op not in needed])):
            if ops_of_kind:
                groups[(s, round_kind(base, step_round))] = ops_of_kind
    return controls


def task_ops(rw: RewriteBuilder) -> Dict[TaskKey, List[ops.Operation]]:
    """The ops of every task of ``rw.stage_tasks``, keyed (stage device j,
    stage, kind, micro-batch) (a version made by a function call: the call)."""
    result = {}
    for (s, kind), originals in rw.stage_tasks.items():
        for v, version_map in enumerate(rw.version_maps[s]):
            j, m = rw.layout.slot(s, v)
            members = [version_map.get(op, op) for op in originals if op not in rw.outside_tasks]
            result[(j, s, kind, m)] = list(dict.fromkeys(members))
    return result


def _chain(before: List[ops.Operation], after: List[ops.Operation], device: str,
           name: str) -> Set[Tuple[ops.Operation, ops.Operation]]:
    """Make every op of ``after`` run after every op of ``before``: directly
    when both are one op (a task function's call), else through a barrier;
    returns the control edges added."""
    if len(before) == len(after) == 1:
        return _waits(after[0], before[0])
    inside = set(before)
    sinks = [op for op in before
             if not any(c in inside for t in op.outputs for c in t.consumers())]
    with ops.device(device), ops.control_dependencies(sinks):
        barrier = control_flow_ops.no_op(name=name)
    inside = set(after)
    edges: Set[Tuple[ops.Operation, ops.Operation]] = set()
    for op in after:
        if not any(t.op in inside for t in op.inputs) and not any(
                c in inside for c in op.control_inputs):
            edges |= _waits(op, barrier)
    return edges


def _waits(op: ops.Operation, dep: ops.Operation) -> Set[Tuple[ops.Operation, ops.Operation]]:
    """Make ``op`` wait for ``dep``; the edge, if it is new."""
    if dep in op.control_inputs:
        return set()
    graph_edit.add_control_input(op, dep)
    return {(op, dep)}
