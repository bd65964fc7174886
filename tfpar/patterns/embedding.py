"""Vocabulary-sharded embedding lookup: rows of the table are split across
devices; each device looks up the ids in its row range (others masked to
zero) and the partial results are summed. Moves one embedding row per id;
the table is never gathered."""
from tfpar.compat.tf import array_ops, math_ops, ops

__all__ = ["vocab_lookup"]


def vocab_lookup(ctx, sharded, ids):
    parts = []
    offset = 0
    for shard, device in zip(sharded.shards, ctx.devices):
        rows = int(shard.shape[0])
        with ops.device(device):
            local = ids - math_ops.cast(offset, ids.dtype)
            inside = math_ops.logical_and(local >= 0, local < rows)
            found = array_ops.gather(shard, array_ops.where(inside, local,
                                                            array_ops.zeros_like(local)))
            mask = math_ops.cast(inside, shard.dtype)
            parts.append(found * array_ops.reshape(
                mask, array_ops.concat([array_ops.shape(mask), [1] * (shard.shape.rank - 1)], 0)))
        offset += rows
    with ops.device(ctx.devices[0]):
        return math_ops.add_n(parts)
