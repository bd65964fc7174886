"""The edges around the ops a rewrite copies, as the script built them
(``BuiltEdges``): read once, before the rewrite adds ops of its own."""
from typing import Dict, List, NamedTuple, Set, Tuple

from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.op_kinds import gradient_tensors
from tfpar.analysis.stages import Placement
from tfpar.compat.tf import ops, tensor_lib
from tfpar.rewriters.select import Selection

__all__ = ["BuiltEdges", "built_edges"]


class BuiltEdges(NamedTuple):
    """The edges around the copied ops as the script built them, read before
    the rewrite adds ops of its own.

    Attributes:
      copied: step and update ops.
      raw: the raw gradients' tensors.
      outside_readers: (step tensor, op outside ``copied`` reading it, input index).
      control_readers: step, update or sync-writer op -> the ops waiting on it.
      crossing: (step op, input index, step tensor of another stage it reads).
      crossing_controls: (step op, step op of another stage it waits on).
      inputs: step op -> its inputs.
      controls: step op -> its control inputs.
    """

    copied: Set[ops.Operation]
    raw: Set[tensor_lib.Tensor]
    outside_readers: List[Tuple[tensor_lib.Tensor, ops.Operation, int]]
    control_readers: Dict[ops.Operation, List[ops.Operation]]
    crossing: List[Tuple[ops.Operation, int, tensor_lib.Tensor]]
    crossing_controls: List[Tuple[ops.Operation, ops.Operation]]
    inputs: Dict[ops.Operation, List[tensor_lib.Tensor]]
    controls: Dict[ops.Operation, List[ops.Operation]]


def built_edges(sel: Selection, placement: Placement, index: GraphIndex) -> BuiltEdges:
    """The edges around ``sel``'s ops as they are now (``BuiltEdges``)."""
    stage_of = placement.stage
    step = sel.step_ops_set
    copied = step | set(sel.update_ops)
    return BuiltEdges(
        copied=copied, raw={t for g, _ in sel.raw_grads for t in gradient_tensors(g)},
        outside_readers=[(t, c, k) for op in sel.step_ops for t in op.outputs
                         for c in t.consumers() if c not in copied
                         for k, x in enumerate(c.inputs) if x is t],
        control_readers={op: list(index.control_consumers.get(op, ()))
                         for op in sel.step_ops + sel.update_ops + sel.sync_writers},
        crossing=[(c, k, t) for c in sel.step_ops for k, t in enumerate(c.inputs)
                  if t.op in step and stage_of(t.op) != stage_of(c)],
        crossing_controls=[(c, p) for c in sel.step_ops for p in c.control_inputs
                           if p in step and stage_of(p) != stage_of(c)],
        inputs={op: list(op.inputs) for op in sel.step_ops},
        controls={op: list(op.control_inputs) for op in sel.step_ops})
