"""Regularizers and constraints of split weights.

A weight split across the devices of a split TaskGraph keeps what the user
asked of it on one device:

* a regularizer gives the value it has on the whole weight: additive ones
  (keras ``L1``, ``L2``, ``L1L2``: a sum over elements) are summed over the
  shards, each computed on its shard's device; any other one is applied to the
  shards' concatenation (gathered on the first device);
* a constraint is carried by every shard (``shard.constraint``; keras
  optimizers apply it after each update), so it must act on each shard alone:
  elementwise constraints (``NonNeg``, clipping) and the norm constraints
  (``MaxNorm``, ``MinMaxNorm``, ``UnitNorm``) along axes that are not split.
  Any other raises a ShardingError naming the weight's owner; it is never
  dropped.
"""
from typing import Optional, Sequence, Tuple

from tfpar.compat.keras import constraints, regularizers
from tfpar.compat.tf import array_ops, dtypes, func_graph, math_ops, ops, tensor_lib, variables_lib
from tfpar.errors import ShardingError

__all__ = ["NO_REGULARIZER", "check_constraint", "describe", "keeps_whole", "regularization_loss",
           "whole_axes"]

# Regularizers whose value on a weight is the sum of their values on its slices.
_ADDITIVE = (regularizers.L1, regularizers.L2, regularizers.L1L2)
# Constraints that normalise along their ``axis``.
_NORMS = (constraints.MaxNorm, constraints.MinMaxNorm, constraints.UnitNorm)
# Op types that map each element on its own (with scalar operands).
_ELEMENTWISE = frozenset("""
    Abs Add AddV2 Cast Ceil ClipByValue Div DivNoNan Equal Exp Floor FloorDiv Greater
    GreaterEqual Identity Less LessEqual Log LogicalAnd LogicalNot LogicalOr Maximum Minimum Mul
    Neg NotEqual OnesLike Pow RealDiv Relu Relu6 Round Rsqrt Select SelectV2 Sigmoid Sign Sqrt
    Square Sub Tanh ZerosLike""".split())


def NO_REGULARIZER(_):  # pylint: disable=invalid-name
    """Passed to ``get_variable`` so that TensorFlow neither applies the variable
    scope's regularizer to each slice nor skips ours: tfpar adds the whole
    weight's loss itself (TensorFlow ignores a regularizer returning None)."""
    return None


def describe(obj) -> str:
    """``MaxNorm(max_value=2, axis=0)`` for keras objects, else the name."""
    get_config = getattr(obj, "get_config", None)
    config = get_config() if callable(get_config) else None
    if isinstance(config, dict):
        return f"{type(obj).__name__}({', '.join(f'{k}={v!r}' for k, v in config.items())})"
    return getattr(obj, "__name__", None) or type(obj).__name__


def whole_axes(constraint, shape: Sequence[int], dtype=None) -> Tuple[int, ...]:
    """The axes of a weight of ``shape`` that ``constraint`` needs whole (a
    shard split along one of them cannot be constrained alone): none for an
    elementwise constraint, a norm constraint's axes, else every axis."""
    rank = len(shape)
    if constraint is None or not rank:
        return ()
    if type(constraint) in _NORMS:
        axes = constraint.axis if isinstance(constraint.axis, (list, tuple)) else [constraint.axis]
        return tuple(sorted({int(a) % rank for a in axes}))
    return () if _elementwise(constraint, shape, dtype) else tuple(range(rank))


def keeps_whole(unit, splits) -> bool:
    """A pattern splitting weight -> axis (``splits``; None: whole) splits no
    axis that a constraint of ``unit``'s layer needs whole (``sizes["whole"]``)."""
    whole = unit.sizes.get("whole", {})
    return all(axis is None or axis not in whole.get(weight, ())
               for weight, axis in splits.items())


def check_constraint(owner: str, constraint, shape: Sequence[int], axis: int, dtype=None) -> None:
    """Raise a ShardingError naming ``owner`` (``"layer 'fc': kernel_constraint"``)
    when ``constraint`` cannot act on the shards of a weight split along ``axis``."""
    whole = whole_axes(constraint, shape, dtype)
    if axis % len(shape) not in whole:
        return
    if type(constraint) in _NORMS:
        reason = (f"it normalises along axes {list(whole)} and the shards split axis "
                  f"{axis % len(shape)}")
    else:
        reason = "it is not elementwise (or tfpar cannot tell: it failed on a probe tensor)"
    raise ShardingError(
        f"wh.split cannot split {owner} {describe(constraint)} (a weight of shape "
        f"{list(shape)} split along axis {axis % len(shape)}): {reason}. Each shard applies "
        f"the constraint alone, so tfpar supports elementwise constraints (NonNeg, clipping) "
        f"and MaxNorm / MinMaxNorm / UnitNorm along an axis that is not split; build this "
        f"layer outside wh.split or change the constraint")


def regularization_loss(ctx, regularizer, variable, axis: int) -> Optional[tensor_lib.Tensor]:
    """``regularizer``'s value on the whole of ``variable``: a partitioned
    variable or a TF2 ``SplitWeight`` split along ``axis`` (slices on their
    devices, ``ctx.device_of``) or a whole one."""
    with ctx.building():
        if isinstance(variable, variables_lib.Variable):
            with ops.device(variable.device):
                return regularizer(variable)
        parts = list(variable)
        if type(regularizer) in _ADDITIVE:
            values = []
            for part in parts:
                with ops.device(ctx.device_of(part)):
                    values.append(regularizer(part))
            with ops.device(ctx.devices[0]):
                return math_ops.add_n(values)
        reads = []
        for part in parts:
            with ops.device(ctx.device_of(part)):
                reads.append(part.value())
        with ops.device(ctx.devices[0]):
            return regularizer(array_ops.concat(reads, axis))


def _elementwise(constraint, shape: Sequence[int], dtype) -> bool:
    """Whether ``constraint`` maps each element on its own: applied to a probe in
    a scratch function graph (no TaskGraph records it), every op between the
    probe and the result is elementwise with scalar other operands."""
    graph = func_graph.FuncGraph("tfpar_constraint_probe")
    with graph.as_default():
        probe = array_ops.placeholder(dtypes.as_dtype(dtype or dtypes.float32), list(shape))
        try:
            out = ops.convert_to_tensor(constraint(probe))
        except Exception:  # pylint: disable=broad-except
            return False  # e.g. it only takes variables or reads the user's graph: cannot tell
    if out is probe:
        return True
    if out.graph is not graph or not out.shape.is_compatible_with(probe.shape):
        return False
    depends = {probe.op}
    for op in graph.get_operations():  # creation order is topological
        if any(t.op in depends for t in op.inputs):
            depends.add(op)
    if out.op not in depends:
        return False
    stack, seen = [out.op], set()
    while stack:
        op = stack.pop()
        if op in seen or op is probe.op:
            continue
        seen.add(op)
        if op.type not in _ELEMENTWISE:
            return False
        for t in op.inputs:
            if t.op in depends:
                stack.append(t.op)
            elif t.shape.num_elements() != 1:
                return False
    return True
