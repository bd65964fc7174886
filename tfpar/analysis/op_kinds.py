"""Kinds of ops in a captured graph: inputs feeding the batch, variables
(reference or resource, or a tf.function's captured handles), reads, tables
and summaries; and the tensors of a gradient. Nothing here mutates."""
import weakref

from tfpar.compat.tf import indexed_slices, ops

__all__ = ["AUX_TYPES", "INPUT_TYPES", "READ_ONLY_RESOURCE_TYPES", "REF_READ_TYPES",
           "SPARSE_READER_TYPES", "TABLE_TYPES", "VARIABLE_TYPES", "gradient_tensors",
           "is_input", "is_resource_variable", "is_variable", "reads_as_batch"]

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
# A tf.function's trace with its batch relaxed -> ids of the eager tensors it
# reads as its batch (``reads_as_batch``).
_batch_read: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def reads_as_batch(graph: ops.Graph, tensors) -> None:
    """``graph``, a step traced with its batch relaxed, reads ``tensors``
    (``GraphCapture.batch_captured``) as its batch: the placeholders capturing
    them are inputs (the runtime says so before it reads the graph)."""
    _batch_read[graph] = {id(t) for t in tensors}
    _captures_seen.pop(graph, None)


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
        batch = _batch_read.get(graph, set())  # the first trace's are not inputs yet
        known = _captures_seen[graph] = (
            len(pairs), frozenset(inner.op for outer, inner in pairs if id(outer) in handles),
            frozenset(inner.op for _, inner in pairs),
            frozenset(inner.op for outer, inner in pairs
                      if id(outer) in batch and inner.op.type == "Placeholder"))
    return known[1:]


def gradient_tensors(g) -> list:
    """The tensors of a gradient: itself, or an IndexedSlices' values and indices."""
    return [g.values, g.indices] if isinstance(g, indexed_slices.IndexedSlices) else [g]
