"""What ``tf.compat.v1.get_variable`` makes inside a split scope: a
partitioned variable whose slice i lives on device i (``ShardedVariable``),
each slice initialised to its part of what the full variable would get."""
from typing import Sequence

import numpy as np
from tfpar.compat.tf import (array_ops, dtypes, init_ops, ops, tensor_conversion_registry,
                             tensor_lib, variable_scope, variables_lib)
from tfpar.errors import ShardingError
from tfpar.patterns.sharded import SplitContext
from tfpar.patterns.weights import NO_REGULARIZER, check_constraint, regularization_loss

__all__ = ["ShardedVariable", "check_shardable", "sharded_variable", "slicing_initializer"]


def check_shardable(name: str, shape: Sequence[int], axis: int, count: int) -> None:
    """A ShardingError naming the weight when its ``axis`` is too small for one
    slice per device."""
    if int(shape[axis]) < count:
        raise ShardingError(
            f"tfpar: wh.split cannot cut '{name}' (shape {list(shape)}) into {count} slices "
            f"along axis {axis}: it has {shape[axis]}; split over at most {shape[axis]} devices")



class ShardedVariable:
    """What ``tf.compat.v1.get_variable`` returns inside a split scope: a
    partitioned variable split along its first dimension (vocabulary, experts,
    input features), or its last where a pinned plan splits its layer by
    columns, slice i on device i. Read as a tensor it is a sharded
    tensor, so embedding lookups, matmuls and einsums on it use patterns."""

    def __init__(self, partitioned: variables_lib.PartitionedVariable, ctx: SplitContext,
                 axis: int = 0):
        self._partitioned = partitioned
        self._ctx = ctx
        self._axis = axis

    name = property(lambda self: self._partitioned.name)
    shape = property(lambda self: self._partitioned.get_shape())
    dtype = property(lambda self: self._partitioned.dtype)
    op = property(lambda self: list(self._partitioned)[0].op)

    def get_shape(self):
        return self.shape

    def __iter__(self):
        return iter(self._partitioned)

    def value(self) -> tensor_lib.Tensor:
        """The full view of the slices (registered as split along their axis)."""
        reads = []
        for part in self._partitioned:
            with ops.device(self._ctx.device_of(part)):
                reads.append(part.value())
        return self._ctx.sharded(reads, self._axis)


tensor_conversion_registry.register_tensor_conversion_function(
    ShardedVariable, lambda v, dtype=None, name=None, as_ref=False: v.value())


def sharded_variable(ctx: SplitContext, name: str, shape: Sequence[int], axis: int,
                     dtype, initializer=None, getter=None, constraint=None, regularizer=None,
                     owner: str = "", **kwargs) -> variables_lib.PartitionedVariable:
    """A variable of full ``shape`` split along ``axis`` into one slice per device
    (uneven when the size does not divide), slice i on device i.

    ``constraint`` (else the variable scope's) is carried by every slice, so it
    must act on each alone (``weights.check_constraint``, naming ``owner``).
    ``regularizer`` (else the scope's) is what ``get_variable`` would get: its
    value for the whole variable joins the REGULARIZATION_LOSSES collection
    when the variable is made. ``kwargs`` go to ``getter``."""
    parts = [1] * len(shape)
    parts[axis] = ctx.size
    getter = getter or variable_scope.get_variable
    scope = variable_scope.get_variable_scope()
    constraint = constraint if constraint is not None else scope.constraint
    regularizer = regularizer if regularizer is not None else scope.regularizer
    if dtype is None and isinstance(initializer, tensor_lib.Tensor):
        dtype = initializer.dtype.base_dtype
    if initializer is None:
        initializer = scope.initializer or _default_initializer(dtype)
    check_constraint(owner or f"variable '{name}'", constraint, shape, axis, dtype)
    check_shardable(name, shape, axis, ctx.size)
    with ctx.creating_shards(shape, axis) as creation:
        partitioned = getter(name, shape=list(shape), dtype=dtype,
                             initializer=slicing_initializer(initializer),
                             partitioner=lambda shape, dtype: parts, constraint=constraint,
                             regularizer=NO_REGULARIZER, **kwargs)
    if creation.created and regularizer is not None:
        with ops.name_scope(f"{name}/Regularizer/"):
            loss = regularization_loss(ctx, regularizer, partitioned, axis)
        if loss is not None:
            ops.add_to_collection(ops.GraphKeys.REGULARIZATION_LOSSES, loss)
    return partitioned


def _default_initializer(dtype):
    """What ``get_variable`` draws a variable of ``dtype`` from when neither
    the call nor the variable scope names an initializer."""
    if dtypes.as_dtype(dtype or dtypes.float32).is_floating:
        return init_ops.glorot_uniform_initializer()
    return init_ops.zeros_initializer()


def slicing_initializer(initializer):
    """An initializer that, for a slice, yields that slice of what
    ``initializer`` gives the full variable: numpy values and constants are cut;
    a tensor is sliced inside the slice's own creation (so on its device); any
    other initializer (random ones) draws the full variable once, when the
    first slice is made, and every slice keeps its part. One draw where one
    device makes one keeps the seeds single-device: TensorFlow numbers a
    graph's unseeded random ops in order, and a keras initializer takes its
    seed from Python's ``random`` at its first draw."""
    value = initializer
    if isinstance(initializer, tensor_lib.Tensor):
        return lambda shape, dtype=None, partition_info=None: array_ops.slice(
            initializer, partition_info.var_offset, shape)
    if isinstance(initializer, init_ops.Constant):
        value = initializer.value
    if not isinstance(value, (np.ndarray, list, tuple, float, int)):
        return _drawn_once(initializer)
    array = np.asarray(value)
    if array.ndim == 0:
        return init_ops.constant_initializer(array.item())

    def init(shape, dtype=None, partition_info=None):
        offset = partition_info.var_offset if partition_info is not None else [0] * len(shape)
        index = tuple(slice(o, o + s) for o, s in zip(offset, shape))
        return array[index].astype(dtype.as_numpy_dtype if dtype is not None else array.dtype)
    return init


def _drawn_once(initializer):
    drawn = []

    def init(shape, dtype=None, partition_info=None):
        if partition_info is None:
            return initializer(shape, dtype=dtype)
        if not drawn:
            drawn.append(initializer(partition_info.full_shape, dtype=dtype))
        return array_ops.slice(drawn[0], partition_info.var_offset, shape)
    return init
