"""How step tensors that do not carry the batch rows were computed from them.

A data-parallel copy sees only its rows. A tensor with one entry per row
(batch-major) is put back together by concatenation; anything reduced over the
rows (a loss, an accuracy count, ``tf.shape(x)[0]``) is not, and depends on how
the reduction was made. Two read-only analyses answer that from the graph:

* ``reduction_region``: the ops between a reduced tensor and the batch-major
  tensors it was computed from. Recomputed on the merged rows, they give the
  single-device value of any reduction (sum, mean, count, shape, max...).
* ``loss_scaling``: whether a loss is a mean over the rows (each copy's
  gradient weighs n_u / N) or a sum (each weighs 1), so gradients add up to the
  single-device gradient. A loss that is neither (a batch sum plus a term that
  does not depend on the batch) cannot be split by weighting copies.
"""
import dataclasses
import enum
from typing import Callable, List, Optional, Set, Tuple

from tfpar.compat import tf as internals
from tfpar.compat.tf import ops, tensor_lib, tensor_util

__all__ = ["Region", "Scaling", "loss_scaling", "reduction_region"]

# Ops whose output scales with the batch exactly as their first input does.
_SAME_SCALING = frozenset({
    "Identity", "Snapshot", "Cast", "Neg", "Reshape", "Squeeze", "ExpandDims", "StopGradient",
    "PreventGradient", "EnsureShape", "CheckNumerics", "IdentityN"})
_DIVISIONS = frozenset({"RealDiv", "Div", "DivNoNan", "TrueDiv", "FloorDiv"})
_ADDITIONS = frozenset({"Add", "AddV2", "Sub", "AddN"})


@dataclasses.dataclass(frozen=True)
class Region:
    """``ops`` (topological order) compute the reduced tensor from ``frontier``,
    batch-major tensors; tensors that do not depend on the batch are read as
    they are."""

    ops: List[ops.Operation]
    frontier: List[tensor_lib.Tensor]


# Stateful only to say they may raise: on the merged rows they compute what
# they computed on each replica's (tf-slim's train_op checks its loss so).
_PURE = frozenset({"CheckNumerics", "CheckNumericsV2"})


def reduction_region(t: tensor_lib.Tensor, batch_dependent: Set[ops.Operation],
                     is_rows: Callable[[tensor_lib.Tensor], bool],
                     allowed: Callable[[ops.Operation], bool],
                     inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]]
                     ) -> Tuple[Optional[Region], str]:
    """The region computing ``t`` from batch-major tensors, or (None, why not):
    an op on the way is stateful or not ``allowed`` (backward ops, whose copies
    carry weights of their own). ``inputs_of(op)``: the inputs of ``op`` as
    the script built them."""
    order: List[ops.Operation] = []
    frontier: List[tensor_lib.Tensor] = []
    seen: Set[ops.Operation] = set()
    stack: List[Tuple[ops.Operation, bool]] = [(t.op, False)]
    while stack:
        op, expanded = stack.pop()
        if expanded:
            order.append(op)
            continue
        if op in seen:
            continue
        seen.add(op)
        stateful = internals.is_stateful(op) and op.type not in _PURE
        if stateful or not allowed(op):
            why = "is stateful" if stateful else "is part of the backward pass"
            return None, f"'{op.name}' ({op.type}) {why}"
        stack.append((op, True))
        for x in inputs_of(op):
            if x.op not in batch_dependent:
                continue
            if is_rows(x):
                if x not in frontier:
                    frontier.append(x)
            elif x.op not in seen:
                stack.append((x.op, False))
    return Region(order, frontier), ""


class Kind(enum.Enum):
    CONST = "independent of the batch"
    ROWS = "one value per row"
    SHAPE = "a shape with the batch size"
    SUM = "a sum over the rows"
    MEAN = "a mean over the rows"


@dataclasses.dataclass(frozen=True)
class Scaling:
    """``kind`` is ``"mean"`` or ``"sum"``; ``None`` when unknown, then
    ``culprit`` names the op that makes it so and why, and ``mixed`` says the
    loss is known to be neither (a batch sum plus a batch-independent term)."""

    kind: Optional[str]
    culprit: str = ""
    mixed: bool = False


class _Unknown(Exception):
    def __init__(self, culprit: str, mixed: bool = False):
        super().__init__(culprit)
        self.mixed = mixed


def loss_scaling(y: tensor_lib.Tensor, batch_dependent: Set[ops.Operation],
                 is_rows: Callable[[tensor_lib.Tensor], bool],
                 inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]]) -> Scaling:
    """How loss ``y`` scales with the rows it is computed from (module doc);
    ``inputs_of(op)``: the inputs of ``op`` as the script built them.

    ``tf.gradients`` of a tensor with one value per row differentiates its sum.
    """
    memo = {}

    def kind(x: tensor_lib.Tensor) -> Kind:
        if x.op not in batch_dependent:
            return Kind.CONST
        if is_rows(x):
            return Kind.ROWS
        if x not in memo:
            memo[x] = _transfer(x.op, [kind(i) for i in inputs_of(x.op)])
        return memo[x]

    try:
        found = kind(y)
    except _Unknown as unknown:
        return Scaling(None, str(unknown), unknown.mixed)
    return Scaling("sum" if found in (Kind.ROWS, Kind.SUM) else "mean")


def _transfer(op: ops.Operation, kinds: List[Kind]) -> Kind:
    """Kind of ``op``'s output from its inputs' kinds; raises _Unknown."""
    first = kinds[0] if kinds else Kind.CONST
    if op.type in _SAME_SCALING:
        return first
    if op.type in ("Sum", "Mean"):
        if first is Kind.ROWS:
            return Kind.SUM if op.type == "Sum" else Kind.MEAN
        if first in (Kind.SUM, Kind.MEAN):
            return first
    elif op.type == "Size" and first is Kind.ROWS:
        return Kind.SUM
    elif op.type == "Shape" and first is Kind.ROWS:
        return Kind.SHAPE
    elif op.type in ("StridedSlice", "Prod", "GatherV2") and first is Kind.SHAPE:
        return Kind.SUM if _reads_dimension_zero(op) else Kind.CONST
    elif op.type == "Mul" and Kind.CONST in kinds:
        return next((k for k in kinds if k is not Kind.CONST), Kind.CONST)
    elif op.type in _DIVISIONS and len(kinds) == 2:
        if kinds[1] is Kind.CONST:
            return first
        if kinds == [Kind.SUM, Kind.SUM]:
            return Kind.MEAN
    elif op.type in _ADDITIONS:
        found = set(kinds) - {Kind.CONST}
        if found == {Kind.MEAN}:
            return Kind.MEAN
        if found == {Kind.SUM} and Kind.CONST not in kinds:
            return Kind.SUM
        if found == {Kind.SUM}:
            raise _Unknown(f"'{op.name}' ({op.type}) adds a sum over the batch and a term that "
                           "does not depend on the batch", mixed=True)
    raise _Unknown(f"'{op.name}' ({op.type}) of {' and '.join(k.value for k in kinds)}")


def _reads_dimension_zero(op: ops.Operation) -> bool:
    """A slice / gather of a shape that starts at dimension 0 (a product always does)."""
    if op.type == "Prod":
        return True
    begin = tensor_util.constant_value(op.inputs[1])
    return begin is not None and int(begin.reshape(-1)[0]) == 0
