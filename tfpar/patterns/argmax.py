"""Sharding pattern for ``argmax`` over the split (class) dimension: each device
finds its shard's best value and index; the best of those wins (ties go to the
lower class, as in TensorFlow)."""
from tfpar.compat.tf import array_ops, array_ops_stack, math_ops, ops

__all__ = ["sharded_argmax"]


def sharded_argmax(ctx, sharded, output_type):
    values, indices = [], []
    offset = 0
    for shard, device in zip(sharded.shards, ctx.devices):
        with ops.device(device):
            values.append(math_ops.reduce_max(shard, axis=-1))
            indices.append(math_ops.argmax(shard, axis=-1, output_type=output_type) + offset)
        offset += int(shard.shape[-1])
    with ops.device(ctx.devices[0]):
        best = math_ops.argmax(array_ops_stack.stack(values, axis=-1), axis=-1,
                               output_type=output_type)
        return array_ops.gather(array_ops_stack.stack(indices, axis=-1), best, batch_dims=1)
