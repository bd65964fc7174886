"""Read-only views of a captured graph: which ops a replica copies, which
tensors carry the batch, which variables are mirrored. Nothing here mutates.
"""
import collections
import dataclasses
import functools
import weakref
from typing import Dict, Iterable, List, NamedTuple, Optional, Set, Tuple

from tensorflow.python.framework import dtypes, indexed_slices, ops, tensor_shape
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import handle_data_util

from tfpar.hooks.capture import GraphCapture, existing_capture
from tfpar.ir.taskgraph import Phase

__all__ = ["Averaged", "GraphIndex", "Selection", "averaged_variables", "declared_aggregations",
           "gradient_tensors", "is_input", "is_resource_variable", "is_variable",
           "select_replication", "variable_bytes", "variable_writers"]

INPUT_TYPES = frozenset({"Placeholder", "PlaceholderWithDefault", "IteratorGetNext",
                         "IteratorGetNextSync", "OptionalGetValue", "QueueDequeueV2",
                         "QueueDequeueManyV2", "QueueDequeueUpToV2"})
# Ops that make a SparseTensor's components (indices, values, dense shape) of a
# tf.data iterator's variant output: part of the input, their outputs are the batch.
SPARSE_READER_TYPES = frozenset({"DeserializeSparse"})
VARIABLE_TYPES = frozenset({"VarHandleOp", "VariableV2", "Variable"})
READ_ONLY_RESOURCE_TYPES = frozenset({"ReadVariableOp", "VarIsInitializedOp", "ResourceGather",
                                      "ResourceGatherNd", "VariableShape"})
# Lookup tables: one per graph, shared by every copy (a copy on another device
# would be a second, uninitialized table).
TABLE_TYPES = frozenset({"HashTable", "HashTableV2", "MutableHashTable", "MutableHashTableV2",
                         "MutableHashTableOfTensors", "MutableHashTableOfTensorsV2",
                         "MutableDenseHashTable", "MutableDenseHashTableV2",
                         "AnonymousHashTable", "AnonymousMutableHashTable"})
# Ops that only read a reference variable; every other consumer of its ref writes it.
REF_READ_TYPES = frozenset({"Identity", "IsVariableInitialized"})
# Summaries and checkpoint I/O observe the model; they are never copied.
AUX_TYPES = frozenset({
    "ScalarSummary", "HistogramSummary", "ImageSummary", "AudioSummary", "AudioSummaryV2",
    "TensorSummary", "TensorSummaryV2", "MergeSummary", "WriteScalarSummary", "WriteSummary",
    "WriteHistogramSummary", "WriteImageSummary", "WriteAudioSummary", "SaveV2", "Save",
    "SaveSlices", "RestoreV2", "Restore", "RestoreSlice", "MergeV2Checkpoints",
    "ShardedFilename", "ShardedFilespec", "StringJoin"})
# Never copied: variables, inputs, summaries / checkpoint I/O, tables.
_FROZEN_TYPES = VARIABLE_TYPES | INPUT_TYPES | AUX_TYPES | TABLE_TYPES


def is_variable(op: ops.Operation) -> bool:
    """A variable's op: in a graph, the op making it; in a tf.function traced
    from eager code, the placeholder capturing its handle."""
    return op.type in VARIABLE_TYPES or op in _function_captures(op.graph)[0]


def is_resource_variable(op: ops.Operation) -> bool:
    """A variable read and written through its resource handle."""
    return op.type == "VarHandleOp" or op in _function_captures(op.graph)[0]


def is_input(op: ops.Operation) -> bool:
    """An op feeding the batch: a placeholder, iterator or queue read, not a
    tf.function's placeholder standing for a captured outside value, unless
    that value is the step's batch (``GraphCapture.batch_captured``)."""
    if op.type not in INPUT_TYPES:
        return False
    _, captured, batch = _function_captures(op.graph)
    return op not in captured or op in batch


_captures_seen: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _function_captures(graph: ops.Graph):
    """(placeholders capturing a variable's handle, every capturing op, the
    placeholders capturing the step's batch: ``GraphCapture.batch_captured``)
    of a tf.function's graph; empty sets for other graphs."""
    if not graph.building_function:
        return frozenset(), frozenset(), frozenset()
    pairs = graph.captures
    known = _captures_seen.get(graph)
    if known is None or known[0] != len(pairs):
        handles = {id(v.handle) for v in graph.variables}
        capture = existing_capture(graph)
        batch = ({id(t) for t in capture.batch_captured} if capture is not None
                 and capture.relaxed else set())  # the first trace's are not inputs yet
        known = _captures_seen[graph] = (
            len(pairs), frozenset(inner.op for outer, inner in pairs if id(outer) in handles),
            frozenset(inner.op for _, inner in pairs),
            frozenset(inner.op for outer, inner in pairs
                      if id(outer) in batch and inner.op.type == "Placeholder"))
    return known[1:]


class GraphIndex:
    """Consumer indexes of a graph, built once per rewrite pass."""

    def __init__(self, graph: ops.Graph) -> None:
        self.graph = graph
        self.ops: List[ops.Operation] = graph.get_operations()
        self.control_consumers: Dict[ops.Operation, List[ops.Operation]] = (
            collections.defaultdict(list))
        for op in self.ops:
            for dep in op.control_inputs:
                self.control_consumers[dep].append(op)

    def descendants(self, sources: Iterable[ops.Operation],
                    control: bool = False) -> Set[ops.Operation]:
        """Ops reachable from ``sources`` along data edges, and control edges
        too when ``control`` (sources excluded)."""
        seen: Set[ops.Operation] = set()
        stack = list(sources)
        while stack:
            op = stack.pop()
            following = [c for t in op.outputs for c in t.consumers()]
            if control:
                following += self.control_consumers.get(op, [])
            for c in following:
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
        return seen


def ancestors(roots: Iterable[ops.Operation], stop) -> Set[ops.Operation]:
    """Ops ``roots`` depend on (data and control edges), roots included,
    not walking through ops for which ``stop(op)`` is true (they are excluded)."""
    seen: Set[ops.Operation] = set()
    stack = [op for op in roots if not stop(op)]
    seen.update(stack)
    while stack:
        op = stack.pop()
        for dep in list(op.control_inputs) + [t.op for t in op.inputs]:
            if dep not in seen and not stop(dep):
                seen.add(dep)
                stack.append(dep)
    return seen


def data_ancestors(roots: Iterable[ops.Operation], within) -> Set[ops.Operation]:
    """``roots`` and the ops they depend on by data edges only, walking
    through ops for which ``within(op)`` is true (a control edge is a wait,
    not a use: ``ancestors`` follows both)."""
    found: Set[ops.Operation] = set()
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op not in found:
            found.add(op)
            stack.extend(t.op for t in op.inputs if within(t.op))
    return found


def variable_bytes(handle: tensor_lib.Tensor) -> int:
    """Bytes of the variable behind ``handle`` (0 if its shape is unknown):
    its op's attributes, or, captured by a tf.function, the handle's
    resource data."""
    op = handle.op
    if op.type != "Placeholder":
        shape, dtype = op.get_attr("shape"), op.get_attr("dtype")
    else:
        shape_and_type = handle_data_util.get_resource_handle_data(handle).shape_and_type[0]
        shape, dtype = shape_and_type.shape, shape_and_type.dtype
    return (tensor_shape.TensorShape(shape).num_elements() or 0) * dtypes.as_dtype(dtype).size


def variable_writers(var_op: ops.Operation) -> List[ops.Operation]:
    """Ops that modify the variable defined by ``var_op`` (a ``tf.cond`` or
    loop whose body only reads it does not)."""
    handle = var_op.outputs[0]
    result = []
    for c in handle.consumers():
        if is_resource_variable(var_op):
            if c.type not in READ_ONLY_RESOURCE_TYPES and _may_write(c, handle):
                result.append(c)
        elif c.type not in REF_READ_TYPES:
            result.append(c)
    return result


# Ops running functions on their inputs: attributes naming the functions, and
# how many inputs come before those the functions take.
_FUNCTIONAL = {"If": (("then_branch", "else_branch"), 1),
               "StatelessIf": (("then_branch", "else_branch"), 1),
               "Case": (("branches",), 1), "StatelessCase": (("branches",), 1),
               "While": (("cond", "body"), 0), "StatelessWhile": (("cond", "body"), 0),
               "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0)}


def _may_write(op: ops.Operation, handle: tensor_lib.Tensor) -> bool:
    """Whether ``op``, which reads the resource ``handle``, may write it: any op
    but a function-running one whose functions only read it (looked into,
    nested ones too; a function tfpar cannot see counts as writing)."""
    if op.type not in _FUNCTIONAL:
        return True
    attrs, skip = _FUNCTIONAL[op.type]
    positions = [k - skip for k, t in enumerate(op.inputs) if t is handle and k >= skip]
    for attr in attrs:
        value = op.get_attr(attr)
        for fn in value if isinstance(value, list) else [value]:
            defined = op.graph._get_function(fn.name)  # pylint: disable=protected-access
            body = getattr(defined, "graph", None)
            if body is None:
                return True
            for k in positions:
                inner = body.inputs[k]
                if any(c.type not in READ_ONLY_RESOURCE_TYPES and _may_write(c, inner)
                       for c in inner.consumers()):
                    return True
    return False


@dataclasses.dataclass
class Selection:
    """What data parallelism copies.

    Attributes:
      step_ops: forward + backward ops copied per replica and micro-batch,
        in graph order.
      update_ops: ops between the raw gradients and the variable updates
        (clipping, optimizer), copied once per replica.
      variables: variable ops mirrored per replica.
      batch_inputs: tensors from feeds / iterators entering ``step_ops``;
        split along dimension 0, except the components of ``sparse_inputs``.
      raw_grads: (gradient, variable op) pairs reduced across units.
      sync_writers: ops outside the training step that write a mirrored
        variable (initializers, restores, user assigns).
      batch_dependent: ops downstream of the batch inputs.
      backward: the step ops ``tf.gradients`` made.
      sparse_inputs: (indices, values, dense shape) of every SparseTensor
        batch input, split by rows (of its dense shape's dimension 0).
      averaged: variable ops the step writes from their own values (moving
        averages: BatchNorm's statistics), each with why it is one and the
        step ops writing it (``averaged_variables``): every version of the
        step updates a local copy, averaged into the variable once per step
        (``rewriters.averaged_variables``). Mirrored like trained ones.
    """

    step_ops: List[ops.Operation]
    update_ops: List[ops.Operation]
    variables: List[ops.Operation]
    batch_inputs: list
    raw_grads: list
    sync_writers: List[ops.Operation]
    batch_dependent: Set[ops.Operation]
    backward: Set[ops.Operation] = dataclasses.field(default_factory=set)
    sparse_inputs: List[tuple] = dataclasses.field(default_factory=list)
    averaged: Dict[ops.Operation, "Averaged"] = dataclasses.field(default_factory=dict)

    @functools.cached_property
    def step_ops_set(self) -> Set[ops.Operation]:
        """``step_ops`` as a set (read-only)."""
        return set(self.step_ops)


def _var_op_of(x) -> Optional[ops.Operation]:
    op = getattr(x, "op", None)
    return op if op is not None and is_variable(op) else None


def select_replication(graph: ops.Graph, capture: GraphCapture, index: GraphIndex,
                       global_step_ops: Set[ops.Operation],
                       unmirrored: Set[ops.Operation]) -> Selection:
    """Choose the ops, variables and inputs one data-parallel replica copies.

    Args:
      global_step_ops: variable ops updated once per step (the global step).
      unmirrored: variable ops shared by every replica (metric accumulators).
    """
    phase = capture.op_phase
    def frozen(op):
        return op.type in _FROZEN_TYPES

    # Forward + backward: what the losses and gradients need, and what the batch feeds.
    roots = []
    raw_grads = []
    for call in capture.gradient_calls:
        roots.extend(y.op for y in call.ys if hasattr(y, "op"))
        for x, g in zip(call.xs, call.grads):
            if g is None:
                continue
            tensors = [g.values, g.indices] if isinstance(g, indexed_slices.IndexedSlices) else [g]
            roots.extend(t.op for t in tensors)
            var_op = _var_op_of(x)
            if var_op is not None and var_op not in global_step_ops:
                raw_grads.append((g, var_op))
    needed = ancestors(roots, frozen)
    # Batch sources are the feeds / iterators the losses read (not, say, a Saver's
    # filename placeholder); whatever descends from them depends on the batch.
    inputs = {t.op for op in needed for t in op.inputs if is_input(t.op)}
    sparse_readers = {op for op in needed if op.type in SPARSE_READER_TYPES
                      and op.inputs[0].op in inputs}
    inputs |= sparse_readers
    # Control edges count: tf.gradients' tuple() NoOps wait on a unit's gradients.
    batch_dependent = index.descendants(inputs, control=True)
    raw_grad_ops = {t.op for g, _ in raw_grads for t in gradient_tensors(g)}
    # Side outputs of the batch (accuracy, predictions) are per unit too, but what
    # consumes the raw gradients (clipping) acts on the reduced ones instead.
    side = batch_dependent - index.descendants(raw_grad_ops, control=True)
    step = {op for op in needed | side if phase.get(op.name, Phase.FORWARD) != Phase.APPLY
            and not frozen(op) and op not in sparse_readers}
    # Accumulators (streaming metrics: keras' total / count) are variables the
    # step itself writes by adding what does not depend on them. Every unit adds
    # to the one shared copy; reads of them the losses do not need (the
    # metric's value) run once, after every unit. The step's other writes are
    # moving averages.
    trained = {var for _, var in raw_grads}
    averaged = averaged_variables(step, global_step_ops | trained,
                                  declared_aggregations(graph, capture))
    accumulators = {v for op in step for v in _written_variables(op)} - global_step_ops - set(
        averaged)
    late = {op for op in step - needed if op.type in READ_ONLY_RESOURCE_TYPES | REF_READ_TYPES
            and any(t.op in accumulators for t in op.inputs)}
    step -= late | index.descendants(late, control=True)

    # Updates: ancestors of apply-phase writers, cut at raw gradients and step ops.
    initializers = {v.initializer for v in _all_variables(graph)}
    apply_writers = []
    for op in index.ops:
        if phase.get(op.name) != Phase.APPLY or op in initializers:
            continue
        written = [t.op for t in op.inputs if is_variable(t.op)]
        if any(v not in global_step_ops for v in written) and op in _writers_of(written):
            apply_writers.append(op)
    update = ancestors(apply_writers, lambda op: frozen(op) or op in step or op in raw_grad_ops)

    used_vars = {t.op for op in step | update for t in op.inputs if is_variable(t.op)}
    variables = [op for op in index.ops if op in used_vars and op not in global_step_ops
                 and op not in unmirrored and op not in accumulators]
    copied = step | update
    sync_writers = [w for v in variables for w in variable_writers(v) if w not in copied]
    batch_inputs = []
    seen = set()
    for op in index.ops:
        if op not in step:
            continue
        for t in op.inputs:
            if (t.op not in step and t.op in batch_dependent | inputs and t not in seen
                    and t.op not in copied and t.shape.rank != 0):
                seen.add(t)
                batch_inputs.append(t)
    order = {op: i for i, op in enumerate(index.ops)}
    sparse_inputs = [tuple(op.outputs) for op in sorted(sparse_readers, key=order.get)]
    sparse_inputs += [group for group in capture.sparse_feeds
                      if any(t in seen for t in group)]
    return Selection(
        step_ops=sorted(step, key=order.get), update_ops=sorted(update, key=order.get),
        variables=variables, batch_inputs=batch_inputs, raw_grads=raw_grads,
        sync_writers=sorted(set(sync_writers), key=order.get), batch_dependent=batch_dependent,
        backward={op for op in step if phase.get(op.name) == Phase.BACKWARD},
        sparse_inputs=sparse_inputs, averaged=averaged)


# Writes of a whole value, and of an increment, by resource and reference.
_SET_TYPES = frozenset({"AssignVariableOp", "Assign"})
_ADD_TYPES = frozenset({"AssignAddVariableOp", "AssignSubVariableOp", "AssignAdd", "AssignSub"})


class Averaged(NamedTuple):
    """Why a variable's updates are averaged, and the step ops writing it."""

    why: str
    writers: Tuple[ops.Operation, ...]


def averaged_variables(step: Set[ops.Operation], excluded: Set[ops.Operation],
                       declared: Dict[ops.Operation, str]) -> Dict[ops.Operation, Averaged]:
    """The variables ``step`` writes (but ``excluded``: the global step and
    what gradients train) whose versions' updates are averaged, not
    summed (DESIGN.md; MirroredStrategy's rule for Keras' ON_READ variables),
    each with why: declared MEAN (or ONLY_FIRST_REPLICA: the first version's
    update is kept), or undeclared and written from its own value (an
    exponential moving average, ``assign_sub((v - batch_mean) * decay)``, or
    a whole value assigned: the fused BatchNorm kernel's running mean), or
    written inside an op tfpar cannot look into (a ``tf.cond``): a guess the
    rewrite says. Declared SUM, or undeclared increments that do not read the
    variable (a metric's total and count), are accumulators."""
    writers: Dict[ops.Operation, List[ops.Operation]] = collections.defaultdict(list)
    for op in sorted(step, key=lambda op: op.name):
        for var in _written_variables(op):
            if var not in excluded:
                writers[var].append(op)
    found = {}
    for var, ops_ in writers.items():
        kind, why = declared.get(var), None
        if kind in ("MEAN", "ONLY_FIRST_REPLICA"):
            why = f"declared {kind}"
        elif kind is None:
            opaque = [w for w in ops_ if w.type not in _SET_TYPES | _ADD_TYPES]
            if opaque:
                why = f"written inside {opaque[0].type} '{opaque[0].name}'"
            elif any(w.type in _SET_TYPES or _reads(w.inputs[1], var, step) for w in ops_):
                why = "written from its own value"
        if why is not None:
            found[var] = Averaged(why, tuple(ops_))
    return found


def _reads(value: tensor_lib.Tensor, var: ops.Operation, step: Set[ops.Operation]) -> bool:
    """Whether ``value``, a step tensor, is computed from a read of ``var``."""
    reads = READ_ONLY_RESOURCE_TYPES | REF_READ_TYPES
    return any(t.op is var for op in data_ancestors(
        [value.op], lambda op: op in step or op.type in reads) for t in op.inputs)


def declared_aggregations(graph: ops.Graph, capture: GraphCapture) -> Dict[ops.Operation, str]:
    """Variable op -> its declared ``tf.VariableAggregation`` name, where
    declared: recorded as the graph made it, or for a tf.function, read from
    the variables it captured (the op is the placeholder of their handle)."""
    if not graph.building_function:
        return {graph.get_operation_by_name(name): kind
                for name, kind in capture.aggregations.items()}
    inner = {id(outer): placeholder.op for outer, placeholder in graph.captures}
    return {inner[id(v.handle)]: v.aggregation.name for v in graph.variables
            if id(v.handle) in inner and v.aggregation.name != "NONE"}


def _written_variables(op: ops.Operation) -> List[ops.Operation]:
    """Variable ops that ``op`` writes."""
    return [t.op for t in op.inputs if is_variable(t.op)
            and op in variable_writers(t.op)]


def _writers_of(var_ops) -> Set[ops.Operation]:
    return {w for v in var_ops for w in variable_writers(v)}


def gradient_tensors(g) -> list:
    """The tensors of a gradient: itself, or an IndexedSlices' values and indices."""
    return [g.values, g.indices] if isinstance(g, indexed_slices.IndexedSlices) else [g]


def _all_variables(graph: ops.Graph) -> list:
    seen, result = set(), []
    for key in (ops.GraphKeys.GLOBAL_VARIABLES, ops.GraphKeys.LOCAL_VARIABLES):
        for v in graph.get_collection(key):
            if id(v) not in seen:
                seen.add(id(v))
                result.append(v)
    return result
