"""Split weights of a TF2 step (a ``tf.function`` traced from eager code).

TF2 keeps a step's variables outside the function, and so does tfpar: a layer
split inside a step gets one eager variable per shard, made once (the first
time the layer is split) on its shard's device and read by every trace of the
step through captured handles. A shard's initial value is its slice of the
whole weight's: the weight's current value when the layer was built whole
before (``input_shape``, an earlier call), else its initializer drawn for the
full shape, as one device draws it; so the numbers are the single-device ones.
Keras optimizers make each shard's slots on its device (they colocate slots
with their variable).

A ``SplitWeight`` saves as one value under the weight's single-device
checkpoint key and full shape (its shards are slices of it, TensorFlow's
``SaveSliceInfo``), so a ``tf.train.Checkpoint`` of a split model restores
into a plain one and back.
"""
from typing import List, Sequence

import numpy as np
from tfpar.compat.tf import (array_ops, ops, saveable_object_util, tensor_conversion_registry,
                             trackable, variables_lib)
from tfpar.patterns.sharded import slice_offsets
from tfpar.patterns.sharded_variable import check_shardable

__all__ = ["SplitWeight", "split_weight", "split_weight_of"]


class SplitWeight(trackable.Trackable):
    """A weight of full ``shape`` split along ``axis``: ``list(weight)`` are
    its shard variables, shard i on device i of its split TaskGraph."""

    def __init__(self, name: str, shards: Sequence[variables_lib.Variable], axis: int,
                 shape: Sequence[int]):
        self.name, self.axis, self.shape = name, axis, list(shape)
        self._shards = list(shards)
        self.dtype = self._shards[0].dtype

    def __iter__(self):
        return iter(self._shards)

    def __repr__(self) -> str:
        return f"<SplitWeight '{self.name}' shape={self.shape} in {len(self)} shards>"

    def __len__(self) -> int:
        return len(self._shards)

    def value(self):
        """The whole weight: its shards concatenated (where the caller is)."""
        return array_ops.concat([s.value() for s in self._shards], self.axis)

    def numpy(self) -> np.ndarray:
        return np.concatenate([s.numpy() for s in self._shards], self.axis)

    def _gather_saveables_for_checkpoint(self):
        def slices(name=self.name) -> List:
            saved, offset = [], 0
            for shard in self._shards:
                start = [0] * len(self.shape)
                start[self.axis] = offset
                info = variables_lib.Variable.SaveSliceInfo(
                    full_name=self.name, full_shape=self.shape, var_offset=start,
                    var_shape=shard.shape.as_list())
                saved.append(saveable_object_util.ResourceVariableSaveable(shard, info.spec, name))
                offset += int(shard.shape[self.axis])
            return saved
        return {trackable.VARIABLE_VALUE_KEY: slices}


tensor_conversion_registry.register_tensor_conversion_function(
    SplitWeight, lambda w, dtype=None, name=None, as_ref=False: w.value())


def split_weight(ctx, name: str, initial: np.ndarray, axis: int, dtype, trainable: bool,
                 constraint=None) -> SplitWeight:
    """``initial`` (the whole weight's value) split along ``axis`` into eager
    variables named ``name``, shard i on ``ctx.devices[i]`` (recorded there);
    each keeps ``constraint``."""
    size = initial.shape[axis]
    check_shardable(name, initial.shape, axis, ctx.size)
    bounds = slice_offsets(size, ctx.size, ctx.shares) + [size]
    shards = []
    with ops.init_scope():
        for index, device in enumerate(ctx.devices):
            part = [slice(None)] * initial.ndim
            part[axis] = slice(bounds[index], bounds[index + 1])
            with ops.device(device):
                shard = variables_lib.Variable(initial[tuple(part)], name=f"{name}/part_{index}",
                                               dtype=dtype, trainable=trainable,
                                               constraint=constraint)
            ctx.record_shard(shard, index)
            shards.append(shard)
    weight = SplitWeight(name, shards, axis, initial.shape)
    for shard in shards:
        shard.tfpar_split_weight = weight
    return weight


def split_weight_of(variable):
    """The SplitWeight ``variable`` is a shard of, or None."""
    return getattr(variable, "tfpar_split_weight", None)
