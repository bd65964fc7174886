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
into a plain one and back. It reads and assigns like the whole variable
(``name``, ``shape``, ``dtype``, ``numpy()``, ``assign()``): Keras shows it, in
its shards' place, where a script reads or sets a model's weights
(``hooks/keras_weights.py``, with ``whole_weights`` and ``shard_variables``).
"""
from typing import List, Sequence

import numpy as np
from tfpar.compat.tf import (array_ops, ops, saveable_object_util, tensor_conversion_registry,
                             tensor_shape, trackable, variables_lib)
from tfpar.patterns.sharded import slice_offsets
from tfpar.patterns.sharded_variable import check_shardable

__all__ = ["SplitWeight", "shard_variables", "split_weight", "split_weight_of",
           "whole_weights"]


class SplitWeight(trackable.Trackable):
    """A weight of full ``shape`` split along ``axis``: ``list(weight)`` are
    its shard variables, shard i on device i of its split TaskGraph; ``name``
    is the whole variable's (``dense/kernel:0``)."""

    def __init__(self, name: str, shards: Sequence[variables_lib.Variable], axis: int,
                 shape: Sequence[int]):
        self.name, self.axis, self.shape = name, axis, tensor_shape.TensorShape(shape)
        self._shards = list(shards)
        self.dtype = self._shards[0].dtype
        self.trainable = self._shards[0].trainable

    def __iter__(self):
        return iter(self._shards)

    def __repr__(self) -> str:
        return f"<SplitWeight '{self.name}' shape={self.shape} in {len(self)} shards>"

    def __len__(self) -> int:
        return len(self._shards)

    def value(self):
        """The whole weight: its shards concatenated (where the caller is)."""
        return array_ops.concat([s.value() for s in self._shards], self.axis)

    def read_value(self):
        return self.value()

    def numpy(self) -> np.ndarray:
        return np.concatenate([s.numpy() for s in self._shards], self.axis)

    def assign(self, value, use_locking=None, name=None, read_value=True):
        """Each shard takes its slice of ``value``, a whole value."""
        value = ops.convert_to_tensor(value, dtype=self.dtype)
        if not self.shape.is_compatible_with(value.shape):
            raise ValueError(f"Cannot assign a value of shape {value.shape} to split weight "
                             f"'{self.name}' of shape {self.shape}")
        for shard, start in self._starts():
            stop = start + int(shard.shape[self.axis])
            shard.assign(value[_part(self.shape.rank, self.axis, start, stop)],
                         use_locking=use_locking)
        return self if read_value else None

    def _starts(self):
        """(shard, its first index along the split axis) for each shard."""
        start = 0
        for shard in self._shards:
            yield shard, start
            start += int(shard.shape[self.axis])

    def _gather_saveables_for_checkpoint(self):
        def slices(name=self.name) -> List:
            saved = []
            for shard, start in self._starts():
                offset = [0] * self.shape.rank
                offset[self.axis] = start
                info = variables_lib.Variable.SaveSliceInfo(
                    full_name=self.name, full_shape=self.shape.as_list(), var_offset=offset,
                    var_shape=shard.shape.as_list())
                saved.append(saveable_object_util.ResourceVariableSaveable(shard, info.spec, name))
            return saved
        return {trackable.VARIABLE_VALUE_KEY: slices}


def _part(rank: int, axis: int, start: int, stop: int) -> tuple:
    """The index of a shard's slice (``start:stop`` along ``axis``) of a whole value."""
    part = [slice(None)] * rank
    part[axis] = slice(start, stop)
    return tuple(part)


tensor_conversion_registry.register_tensor_conversion_function(
    SplitWeight, lambda w, dtype=None, name=None, as_ref=False: w.value())


def split_weight(ctx, name: str, initial: np.ndarray, axis: int, dtype, trainable: bool,
                 constraint=None, whole_name=None) -> SplitWeight:
    """``initial`` (the whole weight's value) split along ``axis`` into eager
    variables named ``name`` (``<scope>/kernel/part_<i>``), shard i on
    ``ctx.devices[i]`` (recorded there); each keeps ``constraint``. The
    weight's name is ``whole_name`` (that of the whole variable it replaces),
    else its shards' without ``/part_0``."""
    size = initial.shape[axis]
    check_shardable(name, initial.shape, axis, ctx.size)
    bounds = slice_offsets(size, ctx.size, ctx.shares) + [size]
    shards = []
    with ops.init_scope():
        for index, device in enumerate(ctx.devices):
            part = _part(initial.ndim, axis, bounds[index], bounds[index + 1])
            with ops.device(device):
                shard = variables_lib.Variable(initial[part], name=f"{name}/part_{index}",
                                               dtype=dtype, trainable=trainable,
                                               constraint=constraint)
            ctx.record_shard(shard, index)
            shards.append(shard)
    weight = SplitWeight(whole_name or unsplit_name(shards[0]), shards, axis, initial.shape)
    for shard in shards:
        shard.tfpar_split_weight = weight
    return weight


def split_weight_of(variable):
    """The SplitWeight ``variable`` is a shard of, or None."""
    return getattr(variable, "tfpar_split_weight", None)


def unsplit_name(first_shard) -> str:
    """The whole variable's name of a first shard's (``a/kernel/part_0:0`` ->
    ``a/kernel:0``)."""
    head, found, tail = first_shard.name.rpartition("/part_0")
    return head + tail if found else first_shard.name


def whole_weights(variables: Sequence) -> list:
    """``variables`` with each split weight's shards shown as the weight, once,
    at the place of the first of them (Keras keeps a weight's shards together,
    where the whole weight was)."""
    shown, seen = [], set()
    for variable in variables:
        weight = split_weight_of(variable)
        if weight is None:
            shown.append(variable)
        elif id(weight) not in seen:
            seen.add(id(weight))
            shown.append(weight)
    return shown


def shard_variables(weights: Sequence) -> list:
    """``weights`` with each split weight as its shards (undoes ``whole_weights``)."""
    return [part for weight in weights
            for part in (list(weight) if isinstance(weight, SplitWeight) else [weight])]
