"""Versions of a pipeline for other kFkB group sizes (Ada-Grouper §5.4).

Ada-Grouper keeps one version of the pipeline per group size k and switches
between them online, without moving buffers. A TensorFlow session ignores
edits to ops it has run, so the tasks already built cannot be re-ordered; a
version is instead a copy, as new ops, of every op of the step that depends
on a pipeline task (the tasks, and what reads them: gradient sums,
all-reduces, updates, merged fetches), with its tasks ordered by its own
schedule (``pipeline.order_tasks``). Ops that do not depend on a task
(variables, the batch and its pieces, iterators) are shared, so the versions
train the same variables. Fetches are translated to the version's copies,
copied on demand for fetches it has not seen.
"""
from typing import Any, Dict, List, Sequence, Set

from tfpar.compat.tf import ops, tensor_lib
from tfpar.rewriters import graph_edit
from tfpar.rewriters.pipeline import order_tasks
from tfpar.rewriters.rewrite_record import DataParallelRewrite

__all__ = ["ScheduleVersion"]


class ScheduleVersion:
    """The pipeline of ``rw`` with its tasks ordered by ``schedule``.

    Args:
      graph: the rewritten graph.
      rw: the ``DataParallelRewrite`` (its ``task_ops`` and ``schedule_edges``
        are version 0's).
      schedule: the version's schedule (``ir.schedule.build_schedule``).
      name: name scope of the copies.

    Attributes:
      copies: op of version 0 -> its copy in this version.
      task_ops: like ``rw.task_ops``, this version's.
    """

    def __init__(self, graph: ops.Graph, rw: DataParallelRewrite, schedule: Sequence[Sequence],
                 name: str) -> None:
        self._graph = graph
        self._name = name
        self._skipped: Set[tuple] = set(rw.schedule_edges)
        self._tasks = {op for members in rw.task_ops.values() for op in members}
        self._depends: Dict[ops.Operation, bool] = {}
        self.copies: Dict[ops.Operation, ops.Operation] = {}
        self._copy(sorted(self._tasks, key=lambda op: op.name))
        self.task_ops = {key: [self.copies[op] for op in members]
                         for key, members in rw.task_ops.items()}
        order_tasks(self.task_ops, schedule, rw.placement.stage_devices, f"{name}/pipeline",
                    rw.selection.rounds.count)

    def element(self, fetch: Any) -> Any:
        """This version's op or tensor for ``fetch`` (an op or tensor of version
        0); what does not depend on a task is shared, and returned as is."""
        if isinstance(fetch, ops.Operation):
            return self._version_of(fetch)
        if isinstance(fetch, tensor_lib.Tensor):
            return self._version_of(fetch.op).outputs[fetch.value_index]
        return fetch

    def _version_of(self, op: ops.Operation) -> ops.Operation:
        if not self._depends_on_task(op):
            return op
        if op not in self.copies:
            self._copy([op])
        return self.copies[op]

    def _controls(self, op: ops.Operation) -> List[ops.Operation]:
        """``op``'s control inputs but those ordering version 0's tasks."""
        return [dep for dep in op.control_inputs if (op, dep) not in self._skipped]

    def _parents(self, op: ops.Operation) -> List[ops.Operation]:
        return [t.op for t in op.inputs] + self._controls(op)

    def _depends_on_task(self, root: ops.Operation) -> bool:
        """``root`` is a task or reads one, through data or control inputs
        (memoized; a loop's back edge counts as not depending)."""
        memo, open_ops = self._depends, set()
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if op in memo or (op in open_ops and not expanded):
                continue
            if op in self._tasks or expanded:
                memo[op] = op in self._tasks or any(memo.get(p, False)
                                                    for p in self._parents(op))
                continue
            open_ops.add(op)
            stack.append((op, True))
            stack += [(p, False) for p in self._parents(op) if p not in memo]
        return memo[root]

    def _copy(self, targets: Sequence[ops.Operation]) -> None:
        """Copy ``targets`` and every op they need that depends on a task and
        is not copied yet."""
        needed, seen, stack = [], set(), list(targets)
        while stack:
            op = stack.pop()
            if op in seen or op in self.copies or not self._depends_on_task(op):
                continue
            seen.add(op)
            needed.append(op)
            stack += self._parents(op)
        input_map = {t: self.copies[t.op].outputs[t.value_index]
                     for op in needed for t in op.inputs if t.op in self.copies}
        self.copies.update(graph_edit.clone_ops(
            self._graph, needed, self._name, None, input_map, controls_of=self._controls,
            control_map=self.copies))
