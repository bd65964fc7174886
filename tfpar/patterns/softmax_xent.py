"""Sharding patterns for softmax cross-entropy over class-split logits.

* ``distributed``: the full logits never exist on one device. Each device
  computes its shard's max and sum of exponentials; the global max and sum give
  log Z; sparse labels are masked by each shard's class range so the label's
  logit comes from the one shard that holds it (dense labels are sliced).
  Moves three floats per row.
* ``gather``: gather the logits (the split bridge) and run TensorFlow's op.
"""
from tfpar.compat.tf import array_ops, array_ops_stack, dtypes, math_ops, ops
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.matcher import Gather

__all__ = ["XENT_PATTERNS", "softmax_xent"]


class _Distributed:
    name = "distributed"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        logits = unit.inputs[0]
        return logits.axis == len(logits.dims) - 1

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        return 4.0 * 3  # max, sum of exponentials, label logit


DISTRIBUTED, GATHER = _Distributed(), Gather("classes")
XENT_PATTERNS = (DISTRIBUTED, GATHER)


def softmax_xent(ctx, sharded, labels, sparse: bool):
    """Per-row cross-entropy of class-split logits ``sharded`` (a ShardedTensor)."""
    shards, devices = sharded.shards, ctx.devices
    widths = [int(s.shape[-1]) for s in shards]
    offsets = [sum(widths[:i]) for i in range(len(widths))]
    local_max = []
    for shard, device in zip(shards, devices):
        with ops.device(device):
            local_max.append(math_ops.reduce_max(array_ops.stop_gradient(shard), axis=-1))
    with ops.device(devices[0]):
        top = math_ops.reduce_max(array_ops_stack.stack(local_max), axis=0)
    sums, picked, label_mass = [], [], []
    for shard, device, offset, width in zip(shards, devices, offsets, widths):
        with ops.device(device):
            sums.append(math_ops.reduce_sum(math_ops.exp(shard - top[:, None]), axis=-1))
            if sparse:
                local = math_ops.cast(labels, dtypes.int64) - offset
                inside = math_ops.logical_and(local >= 0, local < width)
                index = array_ops.where(inside, local, array_ops.zeros_like(local))
                value = array_ops.gather(shard, index, batch_dims=1)
                picked.append(array_ops.where(inside, value, array_ops.zeros_like(value)))
            else:
                part = math_ops.cast(labels[:, offset:offset + width], shard.dtype)
                picked.append(math_ops.reduce_sum(part * shard, axis=-1))
                label_mass.append(math_ops.reduce_sum(part, axis=-1))
    with ops.device(devices[0]):
        log_z = top + math_ops.log(math_ops.add_n(sums))
        if sparse:
            return log_z - math_ops.add_n(picked)
        return math_ops.add_n(label_mass) * log_z - math_ops.add_n(picked)
