"""Reductions over the rows that a loss divides or multiplies by.

A loss normalised by a count computed from the batch (a mask's sum:
``reduce_sum(l * m) / reduce_sum(m)``; Keras' masked losses, which weigh each
unmasked entry by ``size(mask) / reduce_sum(mask)``) is not split by the rows:
a copy that divides its rows' sum by its own count weighs its tokens by that
count, not the batch's. Read whole-batch (computed once on the whole batch,
the same in every copy) such a *normalizer* makes each copy's loss its part of
one device's. It can be, when it is computed from the batch inputs and
constants alone (a mask of the tokens, a weights feature): ``whole_batch``
finds those ops. Nothing here mutates.
"""
import dataclasses
from typing import Callable, Dict, Iterator, List, Optional, Set

from tfpar.analysis.graph_index import post_order
from tfpar.analysis.op_kinds import READ_ONLY_RESOURCE_TYPES, REF_READ_TYPES, is_variable
from tfpar.compat import tf as internals
from tfpar.compat.tf import ops, tensor_lib

__all__ = ["WholeBatch", "reductions_into_rows", "whole_batch"]

# Ops of a tensor's shape, not its values: where the model computes that
# tensor, they read the shape of one it is combined with elementwise.
SHAPE_ONLY = frozenset({"OnesLike", "ZerosLike", "Shape", "Size"})
# Ops combining values elementwise: a reduction over the rows read by one of
# them, next to the rows, weighs each row by something its copy computed.
_VALUE_OPS = frozenset({"Mul", "RealDiv", "Div", "DivNoNan", "TrueDiv", "Add", "AddV2", "Sub",
                        "Maximum", "Minimum", "SquaredDifference", "MulNoNan"})


@dataclasses.dataclass(frozen=True)
class WholeBatch:
    """How to compute a tensor on the whole batch.

    Attributes:
      ops: the ops to copy, in topological order, reading the batch inputs
        whole (what does not depend on the batch is read as it is).
      partners: op of ``SHAPE_ONLY`` -> the tensor whose shape it reads
        instead of its input's, which the model computes:
        ``broadcast_weights``' ``weights * ones_like(losses)`` takes the
        shape of ``weights``, which the elementwise product says is the same.
    """

    ops: List[ops.Operation]
    partners: Dict[ops.Operation, tensor_lib.Tensor]

    def inputs_of(self, op: ops.Operation, inputs_of) -> List[tensor_lib.Tensor]:
        """What the copy of ``op`` reads."""
        inputs = list(inputs_of(op))
        return [self.partners[op]] + inputs[1:] if op in self.partners else inputs


def whole_batch(t: tensor_lib.Tensor, sources: Set[tensor_lib.Tensor],
                batch_dependent: Set[ops.Operation],
                inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]],
                axis_of: Callable[[tensor_lib.Tensor], Optional[int]]):
    """(``WholeBatch`` of ``t``, "") or (None, why it is not computed from the
    batch inputs ``sources`` and constants alone: the stateful op on the way,
    a variable's read)."""
    source_ops = {x.op for x in sources}

    def within(op: ops.Operation) -> bool:
        return op in batch_dependent and op not in source_ops

    partners: Dict[ops.Operation, tensor_lib.Tensor] = {}

    def expand(op: ops.Operation):
        inputs = inputs_of(op)
        if op.type in SHAPE_ONLY and inputs and _model_computed(inputs[0], within, inputs_of):
            partner = _partner(op, inputs[0], inputs_of, axis_of,
                               lambda: _rows_alike(inputs[0], sources, within, inputs_of))
            if partner is None:
                return None, (f"'{op.name}' ({op.type}) reads the shape of '{inputs[0].name}', "
                              "which the model computes")
            partners[op] = partner
            inputs = [partner]
        elif internals.is_stateful(op):
            return None, f"'{op.name}' ({op.type}) on the way from the batch is stateful"
        read = next((x for x in inputs if not within(x.op) and _reads_variable(x.op)), None)
        if read is not None:
            return None, (f"'{op.name}' ({op.type}) reads '{read.name}', a variable's value "
                          "(the count depends on the model)")
        return [x.op for x in inputs if x not in sources and within(x.op)], ""

    order, why = post_order(t.op, expand)
    return (WholeBatch(order, partners), "") if order is not None else (None, why)


def _reads_variable(op: ops.Operation) -> bool:
    """A variable, or a read of one."""
    return (is_variable(op) or op.type in READ_ONLY_RESOURCE_TYPES
            or (op.type in REF_READ_TYPES and op.inputs and is_variable(op.inputs[0].op)))


def _model_computed(x: tensor_lib.Tensor, within, inputs_of) -> Optional[ops.Operation]:
    """An op on the way from the batch to ``x`` that is stateful or reads a
    variable, if any, not looking past shape-only ops."""
    seen: Set[ops.Operation] = set()
    stack = [x.op] if within(x.op) else []
    while stack:
        op = stack.pop()
        if op in seen:
            continue
        seen.add(op)
        inputs = inputs_of(op)
        if internals.is_stateful(op) or any(not within(i.op) and _reads_variable(i.op)
                                            for i in inputs):
            return op
        if op.type not in SHAPE_ONLY:
            stack += [i.op for i in inputs if within(i.op)]
    return None


def _partner(op: ops.Operation, x: tensor_lib.Tensor, inputs_of, axis_of,
             rows_alike: Callable[[], Iterator[tensor_lib.Tensor]]
             ) -> Optional[tensor_lib.Tensor]:
    """A tensor with ``x``'s shape (the same rank and batch axis 0, the same
    other dimensions) that an elementwise op combines with what ``op`` makes
    of ``x``'s shape (``ones_like(x)``, or ``Fill`` of ``Shape(x)`` in a graph);
    else, where ``x``'s other dimensions are known, one of ``rows_alike()`` (computed
    from the batch inputs alone, which all have the batch's rows) of its shape and
    dtype: Keras 3's losses divide by the size of the per-example losses they
    compute, ``[batch]`` like the labels they cast."""
    made = [c.outputs[0] for c in op.outputs[0].consumers() if c.type == "Fill"] or op.outputs
    for reader in [c for t in made for c in t.consumers() if c.type in _VALUE_OPS]:
        for y in inputs_of(reader):
            if y not in made and _alike(x, y, axis_of):
                return y
    if not x.shape[1:].is_fully_defined():
        return None
    return next((y for y in rows_alike() if y.dtype == x.dtype and _alike(x, y, axis_of)),
                None)


def _rows_alike(x: tensor_lib.Tensor, sources, within, inputs_of
                ) -> Iterator[tensor_lib.Tensor]:
    """The tensors ``x`` is computed from, nearest first, that the batch inputs alone
    compute (the batch inputs among them too)."""
    seen: Set[ops.Operation] = {x.op}
    queue = [x.op]
    while queue:
        for y in inputs_of(queue.pop(0)):
            if y.op in seen:
                continue
            seen.add(y.op)
            if y in sources:
                yield y
            elif within(y.op):
                queue.append(y.op)
                if not internals.is_stateful(y.op) and not _model_computed(y, within, inputs_of):
                    yield y


def _alike(x: tensor_lib.Tensor, y: tensor_lib.Tensor, axis_of) -> bool:
    """Whether ``y`` has ``x``'s rank, batch axis 0 like it, and its other dimensions."""
    return bool(y.shape.rank == x.shape.rank and y.shape.rank
                and axis_of(y) == axis_of(x) == 0
                and y.shape.as_list()[1:] == x.shape.as_list()[1:])


def reductions_into_rows(y: tensor_lib.Tensor, batch_dependent: Set[ops.Operation],
                         is_rows: Callable[[tensor_lib.Tensor], bool],
                         inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]],
                         backward: Set[ops.Operation]) -> List[tensor_lib.Tensor]:
    """The reductions over the rows that ops computing loss ``y``'s rows read
    next to them (``_VALUE_OPS``): a per-row weight made of a count, the
    rows' mean... (batch norm's statistics too: only those computed from the
    batch inputs can be read whole-batch), in graph order of their readers."""
    found: Dict[tensor_lib.Tensor, None] = {}
    seen: Set[ops.Operation] = set()
    stack = [y.op]
    while stack:
        op = stack.pop()
        if op in seen or op not in batch_dependent or op in backward:
            continue
        seen.add(op)
        inputs = inputs_of(op)
        if op.type in _VALUE_OPS and any(is_rows(x) for x in op.outputs):
            found.update((x, None) for x in inputs
                         if x.op in batch_dependent and not is_rows(x) and x.op not in backward
                         and x.shape.rank is not None and x.dtype.is_floating)
        stack += [x.op for x in inputs]
    return list(found)
