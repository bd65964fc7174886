"""A TF2 step whose batch is a tensor captured from eager code (issue 48 item 5).

Horovod's synthetic benchmark makes its batch eagerly
(``data = tf.random.uniform([N, ...])``) and its ``tf.function`` step reads
it without arguments: TensorFlow captures such tensors into the step's graph
(a placeholder fed the value at every call; a constant when it has at most
128 values). A step that reads no batch through its arguments or iterators
takes for its batch the tensors of eager code (not variables) of rank >= 1
that its losses are computed from, when they share their leading dimension
(data and labels do; read with a table or a positional encoding of another
length, which is the batch cannot be told). Its first trace is then traced
again with them captured with dimension 0 unknown (``hooks.tf_patches``),
and that trace is parallelised as if they were its arguments when each loss
is a mean or a sum over their rows (``analysis.batch_reductions``, along the
rows ``analysis.batch_axes`` follows). Otherwise the step runs as traced, on
one device, and says why.
"""
from typing import Any, List, Tuple

from tfpar.analysis.batch_axes import BatchAxes
from tfpar.analysis.batch_reductions import loss_scaling
from tfpar.compat.tf import dtypes, ops
from tfpar.hooks.capture import GraphCapture
from tfpar.analysis.graph_index import GraphIndex, ancestors
from tfpar.analysis.op_kinds import is_input

__all__ = ["captured_batch", "unsplittable"]


def captured_batch(graph: ops.Graph, capture: GraphCapture) -> Tuple[List[Any], str]:
    """(the eager tensors the first trace ``graph`` of a step reads as its
    batch, ""): none when an argument or iterator feeds it one; or
    ([], why no batch can be told)."""
    losses = [y.op for call in capture.gradient_calls for y in call.ys if hasattr(y, "op")]
    read = ancestors(losses, lambda op: False)
    if any(is_input(op) and any(t.shape.rank != 0 for t in op.outputs) for op in read):
        return [], ""
    captured = [(outer, inner) for outer, inner in graph.captures
                if inner.op in read and outer.dtype != dtypes.resource and inner.shape.rank]
    if not captured:
        return [], ("its losses read no batch: no argument, iterator or tensor captured from "
                    "eager code")
    if len({outer.shape[0] for outer, _ in captured}) > 1:
        return [], ("the tensors it captures from eager code differ in their leading "
                    f"dimension ({_described(inner for _, inner in captured)}), so tfpar "
                    "cannot tell which are its batch")
    return [outer for outer, _ in captured], ""


def unsplittable(graph: ops.Graph, capture: GraphCapture) -> str:
    """Why the relaxed trace ``graph`` of a step whose batch is captured
    (``GraphCapture.batch_captured``) cannot be split by its rows: a loss
    that is not a mean or a sum over them; "" when it can."""
    sources = [t for op in graph.get_operations() if is_input(op) for t in op.outputs
               if t.shape.rank != 0]
    dependent = GraphIndex(graph).descendants({t.op for t in sources}, control=True)
    axes = BatchAxes(dependent, sources, lambda op: op.inputs,
                     lambda op: capture.differentiates.get(op.name))
    for call in capture.gradient_calls:
        for y in call.ys:
            scaling = loss_scaling(y, dependent, axes.holds_rows, lambda op: op.inputs)
            if scaling.kind is None:
                return (f"its loss '{y.name}' is not a mean or a sum over the rows of the "
                        f"tensors it captures from eager code ({_described(sources)}): "
                        f"{scaling.culprit}")
    return ""


def _described(tensors) -> str:
    """Captured tensors by their shape and first reader."""
    return ", ".join(f"{t.shape.as_list()} read by '{t.consumers()[0].name}'"
                     if t.consumers() else str(t.shape.as_list()) for t in tensors)
