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

from tfpar.analysis.graph_index import post_order
from tfpar.compat import tf as internals
from tfpar.compat.tf import ops, tensor_lib, tensor_util

__all__ = ["Region", "Scaling", "is_reduction", "loss_scaling", "reduction_region"]

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
    frontier: List[tensor_lib.Tensor] = []

    def expand(op: ops.Operation):
        stateful = internals.is_stateful(op) and op.type not in _PURE
        if stateful or not allowed(op):
            why = "is stateful" if stateful else "is part of the backward pass"
            return None, f"'{op.name}' ({op.type}) {why}"
        before = []
        for x in inputs_of(op):
            if x.op not in batch_dependent:
                continue
            if is_rows(x):
                if x not in frontier:
                    frontier.append(x)
            else:
                before.append(x.op)
        return before, ""

    order, why = post_order(t.op, expand)
    return (Region(order, frontier), "") if order is not None else (None, why)


class Kind(enum.Enum):
    CONST = "independent of the batch"
    ROWS = "one value per row"
    SHAPE = "a shape with the batch size"
    COUNT = "a count of the rows"
    SUM = "a sum over the rows"
    MEAN = "a mean over the rows"
    REDUCED = "a function of reductions over the rows"
    ONES = "the same value in every row"


_REDUCED = (Kind.COUNT, Kind.SUM, Kind.MEAN, Kind.REDUCED)


@dataclasses.dataclass(frozen=True)
class Scaling:
    """``kind`` is ``"mean"`` or ``"sum"``; ``None`` when unknown, then
    ``culprit`` names the op that makes it so and why, and ``mixed`` says the
    loss is known to be neither (a batch sum plus a batch-independent term),
    ``unnormalized`` that it needs a normalizer that cannot be read
    whole-batch. ``normalizers``: the reductions over the rows every copy must
    read whole (computed on the whole batch) for its loss to be its part of
    one device's (``loss_scaling``)."""

    kind: Optional[str]
    culprit: str = ""
    mixed: bool = False
    unnormalized: bool = False
    normalizers: Tuple[tensor_lib.Tensor, ...] = ()


class _Unknown(Exception):
    def __init__(self, culprit: str, mixed: bool = False, unnormalized: bool = False):
        super().__init__(culprit)
        self.mixed, self.unnormalized = mixed, unnormalized


def loss_scaling(y: tensor_lib.Tensor, batch_dependent: Set[ops.Operation],
                 is_rows: Callable[[tensor_lib.Tensor], bool],
                 inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]],
                 whole_batch: Optional[Callable[[tensor_lib.Tensor], str]] = None) -> Scaling:
    """How loss ``y`` scales with the rows it is computed from (module doc);
    ``inputs_of(op)``: the inputs of ``op`` as the script built them.

    ``tf.gradients`` of a tensor with one value per row differentiates its sum.
    A reduction that divides or multiplies what depends on the rows (a mask's
    sum: ``reduce_sum(l * m) / reduce_sum(m)``, Keras' masked losses) is not
    split by the rows' shares: it is a *normalizer*, which every copy reads
    computed on the whole batch, so that each copy's loss is its part of one
    device's, when ``whole_batch(t)`` says it can be ("" when it can, else
    why not); without ``whole_batch`` such a loss is of unknown kind.
    """
    normalizers: dict = {}
    for _ in range(3):  # until the normalizers used are those assumed
        used: dict = {}
        try:
            found = _kind_of(y, batch_dependent, is_rows, inputs_of,
                             _Normalizing(normalizers, used, whole_batch))
        except _Unknown as unknown:
            return Scaling(None, str(unknown), unknown.mixed, unknown.unnormalized)
        if used.keys() == normalizers.keys():
            break
        normalizers = used
    if found is Kind.REDUCED:
        return Scaling(None, f"'{y.op.name}' ({y.op.type}) is {found.value}")
    return Scaling("sum" if found in (Kind.ROWS, Kind.SUM, Kind.COUNT) else "mean",
                   normalizers=tuple(used))


def is_reduction(t: tensor_lib.Tensor, batch_dependent: Set[ops.Operation],
                 is_rows: Callable[[tensor_lib.Tensor], bool],
                 inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]]) -> bool:
    """``t`` is a reduction over the rows (a sum, count or mean of them, or a
    function of such), not rows, a shape or independent of the batch."""
    try:
        found = _kind_of(t, batch_dependent, is_rows, inputs_of,
                         _Normalizing({}, {}, lambda _: ""))
    except _Unknown:
        return False
    return found in _REDUCED


class _Normalizing:
    """Which reductions are read whole-batch (``loss_scaling``): ``assumed``
    are taken as such (``Kind.CONST``); ``used`` collects those needed."""

    def __init__(self, assumed: dict, used: dict, whole_batch) -> None:
        self.assumed, self.used, self._whole_batch = assumed, used, whole_batch

    def __call__(self, op: ops.Operation, inputs, kinds: List[Kind]) -> List[Kind]:
        """``kinds`` with the reduced ones among ``inputs`` normalized."""
        result = []
        for x, k in zip(inputs, kinds):
            if k in _REDUCED:
                why = ("tfpar reads it whole-batch only in a training step it rewrites"
                       if self._whole_batch is None else self._whole_batch(x))
                if why:
                    raise _Unknown(f"'{op.name}' ({op.type}) divides or multiplies by '{x.name}'"
                                   f", {k.value}, which the replicas must read computed on the "
                                   f"whole batch, and {why}", unnormalized=True)
                self.used[x] = None
                k = Kind.CONST
            result.append(k)
        return result


def _kind_of(y: tensor_lib.Tensor, batch_dependent, is_rows, inputs_of,
             normalize: _Normalizing) -> Kind:
    memo = {}

    def kind(x: tensor_lib.Tensor) -> Kind:
        if x in normalize.assumed:
            normalize.used[x] = None
            return Kind.CONST
        if x.op not in batch_dependent:
            return Kind.CONST
        if is_rows(x):
            return Kind.ONES if _same_per_row(x, batch_dependent, inputs_of) else Kind.ROWS
        if x not in memo:
            inputs = inputs_of(x.op)
            memo[x] = _transfer(x.op, [kind(i) for i in inputs],
                                lambda kinds, which: _normalized(x.op, inputs, kinds, which,
                                                                 normalize))
        return memo[x]

    return kind(y)


def _normalized(op, inputs, kinds: List[Kind], which, normalize: _Normalizing) -> List[Kind]:
    """``kinds`` with those at the positions ``which`` normalized."""
    picked = normalize(op, [inputs[i] for i in which], [kinds[i] for i in which])
    result = list(kinds)
    for i, k in zip(which, picked):
        result[i] = k
    return result


def _transfer(op: ops.Operation, kinds: List[Kind], normalized) -> Kind:
    """Kind of ``op``'s output from its inputs' kinds; raises _Unknown. An op
    computing only from what does not depend on the batch does not (built
    under ``tf.control_dependencies`` on a step op, it waits on the batch).
    ``normalized(kinds, positions)``: ``kinds`` with the reductions at those
    positions read whole-batch (or _Unknown)."""
    if all(k is Kind.CONST for k in kinds):
        return Kind.CONST
    if op.type == "Sum" and kinds[0] is Kind.ONES:
        return Kind.COUNT  # tf.compat.v1.losses' number of present entries
    kinds = [Kind.ROWS if k is Kind.ONES else k for k in kinds]
    first = kinds[0]
    if op.type in _SAME_SCALING:
        return first
    if op.type in ("Sum", "Mean"):
        if first is Kind.ROWS:
            return Kind.SUM if op.type == "Sum" else Kind.MEAN
        if first in _REDUCED:
            return first
    elif op.type == "Size" and first is Kind.ROWS:
        return Kind.COUNT
    elif op.type == "Shape" and first is Kind.ROWS:
        return Kind.SHAPE
    elif op.type in ("StridedSlice", "Prod", "GatherV2") and first is Kind.SHAPE:
        return Kind.COUNT if _reads_dimension_zero(op) else Kind.CONST
    elif op.type == "Mul":
        if sum(k is not Kind.CONST for k in kinds) > 1:
            kinds = normalized(kinds, [i for i, k in enumerate(kinds) if k in _REDUCED])
        if sum(k is not Kind.CONST for k in kinds) == 1:
            return next(k for k in kinds if k is not Kind.CONST)
    elif op.type in _DIVISIONS and len(kinds) == 2:
        if kinds[1] is Kind.CONST:
            return first
        if first in (Kind.SUM, Kind.COUNT) and kinds[1] is Kind.COUNT:
            return Kind.MEAN if first is Kind.SUM else Kind.CONST
        if kinds[1] in _REDUCED:
            return _transfer(op, normalized(kinds, [1]), normalized)
    elif op.type in _ADDITIONS:
        found = set(Kind.SUM if k is Kind.COUNT else k for k in kinds) - {Kind.CONST}
        if found == {Kind.MEAN}:
            return Kind.MEAN
        if found == {Kind.SUM} and Kind.CONST not in kinds:
            return Kind.SUM
        if found == {Kind.SUM}:
            raise _Unknown(f"'{op.name}' ({op.type}) adds a sum over the batch and a term that "
                           "does not depend on the batch", mixed=True)
    if Kind.ROWS not in kinds and Kind.SHAPE not in kinds:
        return Kind.REDUCED
    raise _Unknown(f"'{op.name}' ({op.type}) of {' and '.join(k.value for k in kinds)}")


def _same_per_row(x: tensor_lib.Tensor, batch_dependent, inputs_of) -> bool:
    """``x`` (rows) holds the same value in every row: ``ones_like`` of rows
    (``Fill`` of their shape in a graph), times values that do not depend on
    the batch."""
    op = x.op
    inputs = [i for i in inputs_of(op) if i.op in batch_dependent]
    if op.type in ("OnesLike", "ZerosLike") or (op.type == "Fill" and inputs_of(op)[1] not in inputs):
        return True
    if op.type in _SAME_SCALING or op.type == "Mul":
        return bool(inputs) and all(_same_per_row(i, batch_dependent, inputs_of)
                                    for i in inputs[:1 if op.type != "Mul" else None])
    return False


def _reads_dimension_zero(op: ops.Operation) -> bool:
    """A slice / gather of a shape that starts at dimension 0 (a product always does)."""
    if op.type == "Prod":
        return True
    begin = tensor_util.constant_value(op.inputs[1])
    return begin is not None and int(begin.reshape(-1)[0]) == 0
