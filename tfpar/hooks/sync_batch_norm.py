"""Synchronized batch normalization: batch statistics over every replica's
rows (``batch_norm.sync: true`` for every Keras BatchNormalization layer, or
Keras' own ``BatchNormalization(synchronized=True)``, which tfpar's replicas
honour as MirroredStrategy's do).

Keras computes a synchronized layer's statistics in
``_sync_calculate_mean_and_var`` from all-reduced sums; without a
distribution strategy its all-reduce sums one replica. Under tfpar the sums
(of the rows, of their squares, and the row count) pass through
``replica_sum`` instead: a marked identity whose gradient is marked too, which
the rewrite replaces by a sum over the replicas of the same micro-batch
(``rewriters.replica_sums``). So the mean and variance each replica
normalizes with, and their gradients, are the whole batch's: with one
micro-batch the numbers are one device's.

Keras 3's layers (``keras_3``), synchronized or under ``batch_norm.sync``,
take their statistics the same way in their ``_moments`` (they have no
fused kernel).

A layer ``batch_norm.sync`` synchronizes that one device would run with the
fused kernel (Keras' choice for 4D and 5D inputs unless told otherwise)
computes unfused, as Keras' synchronized layers do, but keeps the fused
kernel's moving variance: the kernel averages the batch variance with
Bessel's correction, n / (n - 1) times the variance it normalizes with (n
the values per channel, over every replica). Without it the statistics of a
layer over few values (MobileNetV2's 1x1 maps at 32x32 inputs, 8 per
channel) moved 8/7 times less than on one device. Keras' own synchronized
layers are unfused on one device too, and keep the batch's variance.
"""
from tfpar.compat.keras import batch_normalization, keras_3
from tfpar import fallback
from tfpar.compat.tf import (array_ops, context, custom_gradient, distribute_lib, math_ops,
                              ops)
from tfpar.hooks import capture as cap_lib

__all__ = ["add_sync_batch_norm_patches", "replica_sum"]


def add_sync_batch_norm_patches(patches, sync_all) -> None:
    """Make every BatchNormalization synchronized while ``sync_all()``, and
    synchronized ones sum over tfpar's replicas."""
    base = batch_normalization.BatchNormalizationBase
    patches.add(base, "__init__", lambda original: _synchronizing(original, sync_all))
    patches.add(base, "_sync_calculate_mean_and_var", _over_replicas)
    patches.add(base, "_assign_moving_average", _with_fused_variance)
    keras3 = keras_3()
    if keras3 is not None:
        patches.add(keras3.batch_normalization, "_moments",
                    lambda original: _over_replicas_3(original, sync_all))


def _synchronizing(original, sync_all):
    def __init__(self, *args, **kwargs):
        synchronizing = sync_all() and not kwargs.get("synchronized")
        fused = kwargs.get("fused")
        if synchronizing:
            kwargs["synchronized"] = True
            if fused:  # a kernel choice; the fused kernel cannot sync
                kwargs["fused"] = None
        original(self, *args, **kwargs)
        if synchronizing and fused is not False and self._fused_can_be_used():
            self._tfpar_fused_alone = True  # if its input's rank and axis allow (_fused_alone)
    return __init__


def _fused_alone(layer, x) -> bool:
    """Whether ``layer`` would run the fused kernel on ``x`` on one device,
    without the synchronization tfpar asked of it (Keras' ``build``)."""
    allowed = {4: ([1], [3]), 5: ([1], [4])}.get(x.shape.rank, ())
    return getattr(layer, "_tfpar_fused_alone", False) and list(layer.axis) in allowed


def _over_replicas(original):
    def _sync_calculate_mean_and_var(self, x, reduction_axes, keep_dims, mask=None):
        self._tfpar_unbiasing = None  # what the moving variance's update multiplies
        graph = ops.get_default_graph()
        if not _in_step(graph):
            mean, variance = original(self, x, reduction_axes, keep_dims, mask=mask)
            if mask is None and _fused_alone(self, x) and not distribute_lib.has_strategy():
                self._tfpar_unbiasing = _bessel(math_ops.cast(
                    array_ops.size(x) // array_ops.size(mean), x.dtype))
            return mean, variance
        if mask is not None:
            _unsynchronized(self, graph)
            return original(self, x, reduction_axes, keep_dims, mask=mask)
        with ops.name_scope("moments"):
            mean, variance, count = _moments(x, reduction_axes, keep_dims)
        if _fused_alone(self, x):
            self._tfpar_unbiasing = _bessel(count)
        return mean, variance
    return _sync_calculate_mean_and_var


def _in_step(graph) -> bool:
    """Whether ops built now are in a graph tfpar captures (not eager)."""
    return not context.executing_eagerly() and cap_lib.existing_capture(graph) is not None


def _unsynchronized(layer, graph) -> None:
    fallback.fall_back(
        f"BatchNormalization '{layer.name}' is synchronized and called with a mask",
        "its statistics are each replica's own", "Call it without a mask to synchronize it",
        graph)


def _over_replicas_3(original, sync_all):
    def moments(self, inputs, mask):
        graph = ops.get_default_graph()
        if not (self.synchronized or sync_all()) or not _in_step(graph):
            return original(self, inputs, mask)
        if mask is not None:
            _unsynchronized(self, graph)
            return original(self, inputs, mask)
        with ops.name_scope("moments"):
            mean, variance, _ = _moments(inputs, self._reduction_axes, False)
        return mean, variance
    return moments


def _bessel(count):
    """The fused kernel's correction of the variance it keeps, for ``count``
    values per channel: n / (n - 1), or 1 for one value."""
    return count / math_ops.maximum(count - 1, 1)


def _with_fused_variance(original):
    def _assign_moving_average(self, variable, value, momentum, inputs_size):
        unbiasing = getattr(self, "_tfpar_unbiasing", None)
        if unbiasing is not None and variable is self.moving_variance:
            value = value * math_ops.cast(unbiasing, value.dtype)
        return original(self, variable, value, momentum, inputs_size)
    return _assign_moving_average


def _moments(x, axes, keep_dims):
    """Mean and variance of ``x`` over ``axes`` from the replicas' summed
    sums, squared sums and row counts, and the count of values summed."""
    total = math_ops.reduce_sum(x, axes, keepdims=True)
    squares = math_ops.reduce_sum(math_ops.square(x), axes, keepdims=True)
    count = math_ops.cast(array_ops.size(x) // array_ops.size(total), x.dtype)
    summed = replica_sum(array_ops.concat(
        [array_ops.reshape(total, [-1]), array_ops.reshape(squares, [-1]), count[None]], 0))
    width = array_ops.size(total)
    mean = array_ops.reshape(summed[:width] / summed[-1], array_ops.shape(total))
    variance = array_ops.reshape(summed[width:2 * width] / summed[-1],
                                 array_ops.shape(total)) - math_ops.square(mean)
    if not keep_dims:
        mean, variance = (array_ops.squeeze(t, axes) for t in (mean, variance))
    return mean, variance, summed[-1]


@custom_gradient.custom_gradient
def replica_sum(x):
    """``x``, marked to be summed over the replicas of its micro-batch by the
    rewrite; its gradient likewise (the gradient of a sum over replicas is
    the sum of the replicas' gradients)."""
    def grad(dy):
        return replica_sum(dy)
    return _marked(x), grad


def _marked(x):
    y = array_ops.identity(x, name="tfpar_replica_sum")
    cap_lib.capture_for(y.graph).replica_sums.add(y.op.name)
    return y
