"""Side tables recording, per tf.Graph, the TaskGraph and phase of every op.

Hooks only record here; analysis and the rewriters read these tables later,
as one read-only ``Recorded`` (``docs/how-it-works.md``): an op's TaskGraph,
phase and replica identity live in side tables, never parsed from op names.
"""
import contextlib
import dataclasses
import threading
import types
import weakref
from typing import Any, Callable, Container, Dict, List, Optional, Set, Tuple

from tfpar.ir.recorded import ApplyCall, GradientCall, Recorded
from tfpar.ir.taskgraph import Phase, Strategy, TaskGraphSpec

__all__ = ["GraphCapture", "capture_for", "constant_op", "existing_capture",
           "layer_of", "recording_paused", "reset_captures", "set_capture_setup"]


def _new(factory):
    """A field whose default is a new ``factory()`` for each capture."""
    return dataclasses.field(default_factory=factory)


@dataclasses.dataclass(eq=False, repr=False)
class GraphCapture:
    """What tfpar learnt about one graph while the user built it (fields
    grouped by concern; what the runtime decides for it is its
    ``runtime.graph_state``).

    Attributes:
      task_graphs: scopes opened in this graph, in order.
      op_task_graph: op name -> TaskGraph index, for ops created inside a scope.
      op_phase: op name -> Phase for ops created in backward/apply phases
        (forward ops are absent).
      gradient_calls / apply_calls: the training API calls seen.
    """

    # -- what the hooks record as the model is built -----------------------------
    task_graphs: List[TaskGraphSpec] = _new(list)
    op_task_graph: Dict[str, int] = _new(dict)
    op_phase: Dict[str, Phase] = _new(dict)
    # Backward op name -> the forward op tf.gradients differentiated when it
    # made it (its gradient has that op's inputs' and outputs' layouts).
    differentiates: Dict[str, Any] = _new(dict)
    # Op name of a recomputed forward copy (``memory.recompute``) -> the
    # name of the forward op it copies, whose stage it runs in.
    copied_from: Dict[str, str] = _new(dict)
    gradient_calls: List[GradientCall] = _new(list)
    apply_calls: List[ApplyCall] = _new(list)
    # Batch sources declared with a static batch, built with it relaxed
    # (``batch_shapes``): op or iterator name -> the declared size.
    declared_batch: Dict[str, int] = _new(dict)
    # Variable op name -> its declared tf.VariableAggregation name ('SUM',
    # 'MEAN', 'ONLY_FIRST_REPLICA'), where declared (``variable_aggregation``).
    aggregations: Dict[str, str] = _new(dict)
    # Names of the identities whose value the rewrite sums over the replicas
    # of a micro-batch (``sync_batch_norm.replica_sum``, forward and backward).
    replica_sums: Set[str] = _new(set)
    # (indices, values, dense shape) of SparseTensors made of fed
    # placeholders (``sparse_placeholder``): split by rows, as one input.
    sparse_feeds: List[Any] = _new(list)
    # fp16 mixed precision: the graph's ``loss_scaling.LossScale``.
    loss_scale: Any = None
    # inside an apply_gradients another one called (its calls are the outer one's)
    applying: bool = False
    # io.shard_dataset in a TF_CONFIG cluster: the chief's iterator op ->
    # the iterators the other workers read their shards with.
    worker_iterators: Dict[Any, List[Any]] = _new(dict)

    # -- split scopes and default strategies ------------------------------------
    # TaskGraph index -> patterns.sharded.SplitContext of each split scope,
    # and the sharded tensors they share.
    split_contexts: Dict[int, Any] = _new(dict)
    sharded_tensors: Dict[Any, Any] = _new(dict)
    # wh.set_default_strategy: (Strategy, device_count) for unscoped ops, which
    # then form implicit TaskGraphs, one per run of ops between scopes.
    default_strategy: Any = None

    # -- TF2 steps ---------------------------------------------------------------
    # A tf.function that trains, traced with static batch arguments: it is
    # traced again with them relaxed (``relaxed`` in that trace's capture),
    # and this trace is left as it is.
    retrace: bool = False
    relaxed: bool = False
    # The eager tensors a tf.function step reads as its batch (no argument
    # or iterator feeds it one: ``runtime.captured_batches``), chosen in
    # its first trace; its relaxed trace captures them with dimension 0 unknown.
    batch_captured: List[Any] = _new(list)
    # In the relaxed trace's capture: the first trace's function, kept alive as long as
    # this trace (TensorFlow empties a dropped function's graph, and the variables it
    # made, a Keras 3 optimizer's, read their initial values from it).
    first_trace: Any = None

    # -- open scopes and phases (this class's own bookkeeping) -------------------
    _scopes: List[int] = _new(list)
    # Key of a reopened scope -> its TaskGraph index (``open_scope``).
    _keyed: Dict[Any, int] = _new(dict)
    _implicit: Optional[int] = None
    _phases: List[Phase] = _new(list)
    # A pinned plan's sharded layers (name scopes), their tensor degree and
    # the SplitContext factory; the split TaskGraph open while they build.
    _planned_split: Any = None
    _open_planned: Optional[int] = None
    _open_stage: int = 0

    # -- what the analysis and the rewriters read ---------------------------------
    def recorded(self) -> Recorded:
        """The tables the graph is analysed and rewritten by, read-only."""
        view = types.MappingProxyType
        return Recorded(
            op_task_graph=view(self.op_task_graph), op_phase=view(self.op_phase),
            differentiates=view(self.differentiates), copied_from=view(self.copied_from),
            gradient_calls=tuple(self.gradient_calls), apply_calls=tuple(self.apply_calls),
            declared_batch=view(self.declared_batch), aggregations=view(self.aggregations),
            replica_sums=frozenset(self.replica_sums), sparse_feeds=tuple(self.sparse_feeds),
            worker_iterators=view(self.worker_iterators))

    def record_copies(self, copied_from: Dict[str, str]) -> None:
        """Record recomputed copies (op name -> the forward op it copies, whose
        stage it runs in) as backward ops (``rewriters.recompute``)."""
        for copy, original in copied_from.items():
            self.op_phase[copy] = Phase.BACKWARD
            self.copied_from[copy] = original

    # -- recording -----------------------------------------------------------------
    def record_op(self, op: Any, differentiated: Any = None) -> None:
        """Tag a new op with its phase and TaskGraph. A backward op joins the
        TaskGraph of the forward op it differentiates (``differentiated``), or
        else of its first tagged input (gradient sums, seeds); other ops join
        the innermost open scope."""
        phase = self._phases[-1] if self._phases else None
        if phase is not None:
            self.op_phase[op.name] = phase
        task_graph = None
        if phase == Phase.BACKWARD and differentiated is not None:
            self.differentiates[op.name] = differentiated
        if phase == Phase.BACKWARD:
            sources = [differentiated] if differentiated is not None else []
            sources += [t.op for t in op.inputs]
            task_graph = next((self.op_task_graph[s.name] for s in sources
                               if s.name in self.op_task_graph), None)
        if task_graph is None and self._scopes:
            task_graph = self._scopes[-1]
        if task_graph is None and phase is None and self._planned_split is not None:
            task_graph = self._planned_task_graph(op.name, closing=True,
                                                  constant=constant_op(op))
        if task_graph is None and phase is None:
            task_graph = self._implicit_task_graph()
        if task_graph is not None:
            self.op_task_graph[op.name] = task_graph

    def _implicit_task_graph(self) -> Optional[int]:
        """The implicit TaskGraph of a forward op built outside every scope under
        a default strategy (none once training ops exist: savers, summaries)."""
        if self.default_strategy is None or self.gradient_calls:
            return None
        if self._implicit is None:
            strategy, count = self.default_strategy
            self._implicit = len(self.task_graphs)
            self.task_graphs.append(TaskGraphSpec(
                index=self._implicit, name=f"default_{self._implicit}", strategy=strategy,
                device_count=count, implicit=True))
        return self._implicit

    def plan_split_layers(self, layers: Dict[str, int], device_count: int,
                          make_context: Callable[["GraphCapture", TaskGraphSpec], Any],
                          pipelined: bool = False) -> None:
        """Build ``layers`` (name scope or op name -> pipeline stage) split over
        ``device_count`` devices, as a pinned auto plan chose: a split
        TaskGraph per run of them (and per stage). Other ops replicate on as
        many devices (implicit TaskGraphs, nested data parallelism around both),
        or, ``pipelined`` (every layer split, one TaskGraph per stage), join the
        open split TaskGraph."""
        self._planned_split = (layers, device_count, make_context, pipelined)
        self.default_strategy = None if pipelined else (Strategy.REPLICATE, device_count)

    def _planned_task_graph(self, name: str, closing: bool,
                            constant: bool = False) -> Optional[int]:
        """The split TaskGraph of the planned layer holding ``name`` (opened by
        the first of a run of such layers of one stage). A forward op outside
        them ends the run (``closing``), unless a split pattern is building it,
        the plan is pipelined or it is a ``constant`` (``constant_op``)."""
        if self._scopes or self.gradient_calls:
            return None
        layers, count, make_context, pipelined = self._planned_split
        open_ = self._open_planned
        scope = layer_of(name, layers)
        if scope is None:
            if open_ is not None and (pipelined or constant or self.split_contexts[open_].busy):
                return open_
            if closing:
                self._open_planned = None
            return None
        if open_ is None or self._open_stage != layers[scope]:
            spec = TaskGraphSpec(index=len(self.task_graphs), name=f"split_{len(self.task_graphs)}",
                                 strategy=Strategy.SPLIT, device_count=count, implicit=True)
            self.task_graphs.append(spec)
            self.split_contexts[spec.index] = make_context(self, spec)
            self._open_planned, self._implicit = spec.index, None
            self._open_stage = layers[scope]
        return self._open_planned

    def open_scope(self, strategy: Strategy, device_count: Optional[int],
                   name: Optional[str], key: Any = None) -> TaskGraphSpec:
        """Open a new TaskGraph, or reopen the one opened before with ``key``
        (a scope entered in eager code, reopened around each of its layers)."""
        index = self._keyed.get(key) if key is not None else None
        if index is None:
            index = len(self.task_graphs)
            self.task_graphs.append(TaskGraphSpec(
                index=index, name=name or f"{strategy.value}_{index}", strategy=strategy,
                device_count=device_count))
            if key is not None:
                self._keyed[key] = index
        self._scopes.append(index)
        self._implicit = None
        return self.task_graphs[index]

    def close_scope(self) -> None:
        self._scopes.pop()

    @contextlib.contextmanager
    def phase(self, phase: Phase):
        self._phases.append(phase)
        try:
            yield
        finally:
            self._phases.pop()

    @property
    def in_scope(self) -> bool:
        return bool(self._scopes)

    def innermost(self) -> Tuple[Optional[TaskGraphSpec], Any]:
        """The innermost open scope's TaskGraph and the key it was opened with
        (None: a new scope); (None, None) outside scopes."""
        if not self._scopes:
            return None, None
        index = self._scopes[-1]
        return (self.task_graphs[index],
                next((key for key, i in self._keyed.items() if i == index), None))

    def current_split(self, name_scope: str = "") -> Any:
        """The SplitContext of the open split scope, or of the planned split
        layer ``name_scope`` is in, or None."""
        if self._scopes:
            return self.split_contexts.get(self._scopes[-1])
        if self._planned_split is None or not name_scope:
            return None
        index = self._planned_task_graph(name_scope, closing=False)
        return None if index is None else self.split_contexts[index]


def constant_op(op: Any) -> bool:
    """A batch-free constant (``tf.nn.silu``'s ``beta``; an identity or cast
    of constants): it joins the run of planned split layers it is made in
    instead of ending it, as the plan's TaskGraphs count it
    (``runtime.sharded.sharded_plan``)."""
    return op.type == "Const" or (op.type in ("Identity", "Cast") and bool(op.inputs)
                                  and all(constant_op(t.op) for t in op.inputs))


def layer_of(name: str, layers: Container[str]) -> Optional[str]:
    """The one of ``layers`` that ``name`` (an op or name scope) is or is inside."""
    parts = name.split("/")
    return next((prefix for prefix in ("/".join(parts[:depth])
                                       for depth in range(1, len(parts) + 1))
                  if prefix in layers), None)


_captures: "weakref.WeakKeyDictionary[Any, GraphCapture]" = weakref.WeakKeyDictionary()
_paused = threading.local()
_setup: Optional[Callable[[GraphCapture], None]] = None


def set_capture_setup(setup: Optional[Callable[[GraphCapture], None]]) -> None:
    """``setup`` prepares every new capture (the runtime applies a pinned plan)."""
    global _setup
    _setup = setup


def capture_for(graph: Any) -> GraphCapture:
    """The capture of ``graph``, created (and set up) on first use."""
    cap = _captures.get(graph)
    if cap is None:
        cap = _captures[graph] = GraphCapture()
        if _setup is not None:
            _setup(cap)
    return cap


def existing_capture(graph: Any) -> Optional[GraphCapture]:
    return _captures.get(graph)


def is_paused() -> bool:
    return getattr(_paused, "depth", 0) > 0


@contextlib.contextmanager
def recording_paused():
    """Ops created inside (tfpar's own rewrites) are not recorded as user ops."""
    _paused.depth = getattr(_paused, "depth", 0) + 1
    try:
        yield
    finally:
        _paused.depth -= 1


def reset_captures(graph: Any = None) -> None:
    """Forget what was recorded for ``graph`` (every graph when None)."""
    if graph is None:
        _captures.clear()
    else:
        _captures.pop(graph, None)
