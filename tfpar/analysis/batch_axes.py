"""Which axis of a step tensor carries the batch rows.

The batch inputs carry the rows on axis 0. The axis follows them through the
ops that move it (an einsum such as ``be,bd->ebd`` puts it on axis 1, a
transpose permutes it, ``expand_dims`` / ``stack`` shift it) and keeps its
place through elementwise ops, matmuls, concatenations and slices along other
axes (a split TaskGraph's shards of ``[experts, batch, ...]`` tensors) and
reshapes that keep a leading batch; a reduction over it, or an op whose effect
on it is unknown, leaves none. Bridges between TaskGraphs and fetch merging cut
and join tensors along this axis (Whale §3.2.3 bridges along the batch).
"""
from typing import Callable, Dict, List, Optional, Set

from tfpar.compat.tf import ops, tensor_lib, tensor_util

__all__ = ["BatchAxes"]

# Ops whose output carries the batch where their (broadcast) inputs do.
_ELEMENTWISE = frozenset("""
    Abs Add AddN AddV2 BiasAdd Cast Ceil Cos DivNoNan Elu Equal Erf Exp Floor FloorDiv
    FloorMod Greater GreaterEqual Identity IsFinite LeakyRelu Less LessEqual Log Log1p
    LogicalAnd LogicalNot LogicalOr Maximum Minimum Mul Neg NotEqual OnesLike Pow RealDiv
    Reciprocal Relu Relu6 Round Rsqrt Selu Select SelectV2 Sigmoid Sign Sin Softplus Softsign
    Sqrt Square SquaredDifference Sub Tanh TrueDiv ZerosLike Snapshot StopGradient
    PreventGradient EnsureShape CheckNumerics Softmax LogSoftmax""".split())


class BatchAxes:
    """``axis(t)``: the batch axis of step tensor ``t``, or None.

    Args:
      batch_dependent: ops downstream of the batch inputs.
      sources: the batch inputs (rows on axis 0).
      inputs_of: the inputs of an op as the script built them.
      differentiated: backward op -> the forward op whose gradient it helps
        compute, or None. A gradient has the layout of the forward tensor it
        is the gradient of: a backward tensor no rule places takes the axis of
        the forward op's tensors of the same shape.
      not_rows: sources that do not hold rows on axis 0 (a SparseTensor's
        components: the rows are its dense shape's dimension 0).
    """

    def __init__(self, batch_dependent: Set[ops.Operation], sources: List[tensor_lib.Tensor],
                 inputs_of: Callable[[ops.Operation], List[tensor_lib.Tensor]],
                 differentiated: Callable[[ops.Operation], Optional[ops.Operation]],
                 not_rows: Set[tensor_lib.Tensor] = frozenset()) -> None:
        self._dependent = batch_dependent
        self._axes: Dict[tensor_lib.Tensor, Optional[int]] = {
            t: None if t in not_rows else 0 for t in sources}
        self._inputs_of = inputs_of
        self._differentiated = differentiated

    def holds_rows(self, t: tensor_lib.Tensor) -> bool:
        return self.axis(t) is not None

    def axis(self, t: tensor_lib.Tensor) -> Optional[int]:
        stack = [t]
        while stack:  # inputs first, without recursion (deep models)
            top = stack[-1]
            if top in self._axes:
                stack.pop()
                continue
            if top.op not in self._dependent:
                self._axes[top] = None
                stack.pop()
                continue
            pending = [x for x in self._inputs_of(top.op) if x not in self._axes]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            self._axes[top] = axis = self._rule(top)
            forward = self._differentiated(top.op) if axis is None else None
            # Only a forward op's own tensors (not another backward op's: nested
            # gradients would chain back through the whole backward pass).
            if forward is not None and self._differentiated(forward) is None:
                self._axes[top] = self._like_forward(top, forward)
        return self._axes[t]

    def _like_forward(self, t: tensor_lib.Tensor, forward: ops.Operation) -> Optional[int]:
        """The batch axis shared by ``forward``'s tensors shaped like ``t``
        (exactly, else compatibly: a weight's gradient, shaped like the
        weight, holds no rows however compatible it is with the output)."""
        tensors = [x for x in list(self._inputs_of(forward)) + list(forward.outputs)
                   if x.shape.rank == t.shape.rank and x.shape.is_compatible_with(t.shape)]
        exact = [x for x in tensors if x.shape.as_list() == t.shape.as_list()]
        found = {self.axis(x) for x in exact or tensors} - {None}
        return found.pop() if len(found) == 1 else None

    def _rule(self, t: tensor_lib.Tensor) -> Optional[int]:
        op = t.op
        inputs = self._inputs_of(op)
        axes = [self._axes[x] for x in inputs]
        rank = t.shape.rank
        if op.type in _ELEMENTWISE:
            return _broadcast_axis(inputs, axes, rank)
        if op.type == "Einsum":
            return _einsum_axis(op, axes)
        if op.type in ("MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3"):
            return _matmul_axis(op, inputs, axes, rank)
        if op.type == "Transpose":
            perm = tensor_util.constant_value(inputs[1])
            if perm is not None and axes[0] is not None:
                return list(perm).index(axes[0])
        if op.type == "ExpandDims":
            dim = tensor_util.constant_value(inputs[1])
            if dim is not None and axes[0] is not None and rank is not None:
                dim = int(dim) % rank
                return axes[0] + (1 if dim <= axes[0] else 0)
        if op.type == "Pack" and axes and all(a == axes[0] for a in axes) and axes[0] is not None:
            dim = op.get_attr("axis") % rank
            return axes[0] + (1 if dim <= axes[0] else 0)
        if op.type == "ConcatV2":
            dim = tensor_util.constant_value(inputs[-1])
            known = [a for a in axes[:-1] if a is not None]
            if dim is not None and known and all(a == known[0] for a in known) \
                    and int(dim) % rank != known[0]:
                return known[0]
        if op.type == "Reshape":
            return 0 if axes[0] == 0 and _leading_unknown(t) == 0 else None
        if op.type == "Slice" and axes[0]:  # off axis 0: the rule below does not see it
            return _slice_axis(inputs, axes)
        if any(a not in (None, 0) for a in axes):
            return None  # an op this model does not know, moving a batch off axis 0
        return _leading_unknown(t)


def _broadcast_axis(inputs, axes, rank) -> Optional[int]:
    """Numpy broadcasting aligns trailing dimensions."""
    found = {a + (rank - x.shape.rank) for x, a in zip(inputs, axes)
             if a is not None and rank is not None and x.shape.rank is not None}
    return found.pop() if len(found) == 1 else None


def _slice_axis(inputs, axes) -> Optional[int]:
    """A slice keeps the batch axis of its input when it keeps every row."""
    axis, begin, size = axes[0], *(tensor_util.constant_value(x) for x in inputs[1:])
    if begin is None or size is None:
        return None
    return axis if begin[axis] == 0 and size[axis] == -1 else None


def _einsum_axis(op, axes) -> Optional[int]:
    equation = op.get_attr("equation").decode().replace(" ", "")
    if "->" not in equation or "." in equation:
        return None
    sources, output = equation.split("->")
    letters = {spec[a] for spec, a in zip(sources.split(","), axes) if a is not None}
    if len(letters) != 1:
        return None
    letter = letters.pop()
    return output.index(letter) if letter in output else None


def _matmul_axis(op, inputs, axes, rank) -> Optional[int]:
    """Rows of ``a`` (not transposed) stay rows; leading batch dimensions stay."""
    a_axis = axes[0]
    a_rank = inputs[0].shape.rank
    adjoint = op.get_attr("transpose_a") if op.type == "MatMul" else op.get_attr("adj_x")
    if a_axis is None or a_rank is None or rank is None:
        return None
    if a_axis < a_rank - 2:  # a leading (batch-matmul) dimension
        return a_axis + (rank - a_rank)
    if a_axis == a_rank - 2 and not adjoint:
        return rank - 2
    return None


def _leading_unknown(t: tensor_lib.Tensor) -> Optional[int]:
    """Rows on axis 0 when dimension 0 is unknown at build time (the batch
    dimension is, ``hooks.batch_shapes``)."""
    shape = t.shape
    return 0 if shape.rank and shape[0] is None else None
