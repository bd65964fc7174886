"""Translate what the user fetches into what the parallel graph computes."""
import collections
import contextlib
import types
from typing import Any, Callable, ContextManager, Dict, FrozenSet, Mapping, Optional

from tfpar.compat.tf import control_flow_ops, ops, tensor_lib
from tfpar.rewriters import graph_edit
from tfpar.rewriters.merge import merge_step_tensor
from tfpar.rewriters.rewrite_record import DataParallelRewrite
from tfpar.rewriters.replica_sync import sync_new_writers
from tfpar.rewriters.schedule_versions import ScheduleVersion

__all__ = ["FetchTranslator"]


class FetchTranslator:
    """Callable mapping a ``Session.run`` fetch structure to parallel fetches.

    * a step tensor (loss, logits) -> merged over replicas and micro-batches;
    * a raw gradient -> the reduced gradient;
    * a step or update op -> a group running every copy of it;
    * a variable writer outside training (initializer) -> writer + replica sync;
    * anything else is fetched as is. Strings (``"loss:0"``) are translated too.

    Ops the user builds after the rewrite (between runs) are adopted first: those
    writing mirrored variables get replica syncs, and those reading step tensors
    or raw gradients read the merged / reduced ones instead. What it builds
    (merged tensors, syncs, groups) it keeps itself: the rewrite's record
    does not change after the rewrite.

    A pipeline may run another kFkB group size than the rewrite's
    (``use_group_size``): fetches then go to that version's copies.

    ``unrecorded()`` keeps the ops it adds out of the hooks' records
    (``hooks.capture.recording_paused``). ``train_ops``: the ops the
    optimizers returned (a run of one of them alone is a training step).

    Attributes:
      stepped: the last translated fetches run the training step.
    """

    def __init__(self, graph: ops.Graph, rewrite: DataParallelRewrite,
                 unrecorded: Callable[[], ContextManager], group_size: Optional[int] = None,
                 train_ops: FrozenSet[ops.Operation] = frozenset()) -> None:
        self._graph = graph
        self.rewrite = rewrite
        self._unrecorded = unrecorded
        self._step = rewrite.selection.step_ops_set
        self._update = set(rewrite.selection.update_ops)
        self._train_ops = train_ops
        self._groups: Dict[ops.Operation, ops.Operation] = {}
        # Step tensor -> merged tensor; writer -> its sync: the rewrite's, then ours.
        self._merged: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dict(rewrite.merged)
        self._syncs: Dict[ops.Operation, ops.Operation] = dict(rewrite.sync_ops)
        self._known_ops = len(graph.get_operations())
        self._version = graph.version
        self.versions: Dict[Optional[int], Optional[ScheduleVersion]] = {group_size: None}
        self._current: Optional[ScheduleVersion] = None
        self.stepped = False

    def __call__(self, fetches: Any) -> Any:
        self.stepped = False
        if self.rewrite.trivial:  # nothing to translate; a training step may still run
            _map_fetches(self._notice_step, fetches)
            return fetches
        with self._editing():
            if self._graph.version != self._version:
                self._adopt(self._graph.get_operations()[self._known_ops:])
            translated = _map_fetches(self._translate, fetches)
            self._known_ops = len(self._graph.get_operations())
            self._version = self._graph.version
        return translated

    def use_group_size(self, group_size: int, schedule) -> bool:
        """Run the pipeline as kFkB with ``group_size`` from now on (its
        ``schedule``); its version is built the first time. True if built."""
        built = group_size not in self.versions
        if built:
            with self._editing():
                self.versions[group_size] = ScheduleVersion(
                    self._graph, self.rewrite, schedule, f"tfpar_k{group_size}")
                self._known_ops = len(self._graph.get_operations())
                self._version = self._graph.version
        self._current = self.versions[group_size]
        return built

    @property
    def task_ops(self) -> Dict[tuple, list]:
        """The pipeline tasks that run now (``DataParallelRewrite.task_ops``)."""
        return self._current.task_ops if self._current else self.rewrite.task_ops

    @property
    def sync_ops(self) -> Mapping[ops.Operation, ops.Operation]:
        """Writer -> the op that runs it and completes it (``DataParallelRewrite.sync_ops``,
        and the syncs of writers built after the rewrite)."""
        return types.MappingProxyType(self._syncs)

    def copied_ops(self) -> Dict[ops.Operation, ops.Operation]:
        """Copy -> op of the rewrite, over every version built."""
        return {copy: op for version in self.versions.values() if version is not None
                for op, copy in version.copies.items()}

    @contextlib.contextmanager
    def _editing(self):
        """Adding ops to the (maybe finalized) graph, unrecorded."""
        with graph_edit.unfinalized(self._graph), self._graph.as_default(), self._unrecorded():
            yield

    def _element(self, fetch: Any) -> Any:
        """The graph element a fetch given by name names (None: none), else
        ``fetch``."""
        if not isinstance(fetch, (str, bytes)):
            return fetch
        try:
            return self._graph.as_graph_element(fetch)
        except (KeyError, ValueError, TypeError):
            return None

    def _notice_step(self, fetch: Any) -> Any:
        """``fetch``, noting whether it runs the training step (``stepped``)."""
        element = self._element(fetch)
        if isinstance(element, (ops.Operation, tensor_lib.Tensor)):
            self.stepped |= self._steps(getattr(element, "op", element))
        return fetch

    def _steps(self, op: ops.Operation) -> bool:
        return op in self._step or op in self._update or op in self._train_ops

    def _translate(self, fetch: Any) -> Any:
        if isinstance(fetch, (str, bytes)):
            element = self._element(fetch)
            if element is None:
                return fetch
            new = self._translate(element)
            return fetch if new is element else new.name
        new = self._translate_element(fetch)
        return self._current.element(new) if self._current is not None else new

    def _translate_element(self, fetch: Any) -> Any:
        if isinstance(fetch, (ops.Operation, tensor_lib.Tensor)):
            self.stepped |= self._steps(fetch if isinstance(fetch, ops.Operation) else fetch.op)
        if isinstance(fetch, ops.Operation):
            return self._translate_op(fetch)
        if isinstance(fetch, tensor_lib.Tensor):
            if fetch in self.rewrite.reduced:
                return self.rewrite.reduced[fetch][0]
            if fetch.op in self._step:
                return self._merged_tensor(fetch)
        return fetch

    def _merged_tensor(self, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
        """``t`` (a step tensor) merged over versions (``merge``), built on first use."""
        if t not in self._merged:
            self._merged[t] = merge_step_tensor(self.rewrite, t)
        return self._merged[t]

    def _translate_op(self, op: ops.Operation) -> ops.Operation:
        if op in self._syncs:
            return self._syncs[op]
        if op in self._step or op in self._update:
            if op not in self._groups:
                versions = (self.rewrite.versions(op) if op in self._step
                            else self.rewrite.replica_versions(op))
                with ops.name_scope(None), ops.name_scope("tfpar"):
                    self._groups[op] = control_flow_ops.group(*versions, name="all_copies")
            return self._groups[op]
        return op

    def _adopt(self, new_ops) -> None:
        self._syncs.update(sync_new_writers(self._graph, self.rewrite, new_ops, self._syncs))
        for op in new_ops:
            for k, t in enumerate(op.inputs):
                if t in self.rewrite.reduced:
                    graph_edit.update_input(op, k, self.rewrite.reduced[t][0])
                elif t.op in self._step:
                    graph_edit.update_input(op, k, self._merged_tensor(t))


def _map_fetches(fn, fetches):
    """Apply ``fn`` to every leaf of a Session.run fetch structure (lists,
    tuples, namedtuples, dicts with any keys: MonitoredSession keys its fetches
    by hook objects, which ``tf.nest`` cannot sort)."""
    if isinstance(fetches, collections.defaultdict):
        result = collections.defaultdict(fetches.default_factory)
        result.update((k, _map_fetches(fn, v)) for k, v in fetches.items())
        return result
    if isinstance(fetches, dict):
        return type(fetches)((k, _map_fetches(fn, v)) for k, v in fetches.items())
    if isinstance(fetches, tuple) and hasattr(fetches, "_fields"):
        return type(fetches)(*(_map_fetches(fn, v) for v in fetches))
    if isinstance(fetches, (list, tuple)):
        return type(fetches)(_map_fetches(fn, v) for v in fetches)
    return fn(fetches)
