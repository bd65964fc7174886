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
"""
from tfpar.compat.keras import batch_normalization
from tfpar import fallback
from tfpar.compat.tf import array_ops, context, custom_gradient, math_ops, ops
from tfpar.hooks import capture as cap_lib

__all__ = ["add_sync_batch_norm_patches", "replica_sum"]


def add_sync_batch_norm_patches(patches, sync_all) -> None:
    """Make every BatchNormalization synchronized while ``sync_all()``, and
    synchronized ones sum over tfpar's replicas."""
    base = batch_normalization.BatchNormalizationBase
    patches.add(base, "__init__", lambda original: _synchronizing(original, sync_all))
    patches.add(base, "_sync_calculate_mean_and_var", _over_replicas)


def _synchronizing(original, sync_all):
    def __init__(self, *args, **kwargs):
        if sync_all():
            kwargs["synchronized"] = True
            if kwargs.get("fused"):  # a kernel choice; the fused kernel cannot sync
                kwargs["fused"] = None
        original(self, *args, **kwargs)
    return __init__


def _over_replicas(original):
    def _sync_calculate_mean_and_var(self, x, reduction_axes, keep_dims, mask=None):
        graph = ops.get_default_graph()
        if context.executing_eagerly() or cap_lib.existing_capture(graph) is None:
            return original(self, x, reduction_axes, keep_dims, mask=mask)
        if mask is not None:
            fallback.fall_back(
                f"BatchNormalization '{self.name}' is synchronized and called with a mask",
                "its statistics are each replica's own", "Call it without a mask to "
                "synchronize it", graph)
            return original(self, x, reduction_axes, keep_dims, mask=mask)
        with ops.name_scope("moments"):
            return _moments(x, reduction_axes, keep_dims)
    return _sync_calculate_mean_and_var


def _moments(x, axes, keep_dims):
    """Mean and variance of ``x`` over ``axes`` from the replicas' summed
    sums, squared sums and row counts."""
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
    return mean, variance


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
