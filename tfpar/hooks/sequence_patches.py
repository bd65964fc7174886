"""Hooks that keep a tensor split along its sequence (``split.sequence_parallel``,
``patterns/sequence.py``) through what runs on each device's slice alike:
keras ``LayerNormalization`` over the last axis only, keras ``Dropout``
(each device draws its own mask for its slice), and the broadcasting adds,
subtractions, products and bias adds (residual connections). On anything
else, or on tensors not split along the sequence, TensorFlow's own runs.
"""
from tfpar.compat.keras import keras_dropout, layer_normalization
from tfpar.compat.tf import context, gen_math_ops, gen_nn_ops
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.split_scope import open_split_context
from tfpar.patterns import sequence

__all__ = ["add_sequence_patches"]


def add_sequence_patches(patches: PatchSet) -> None:
    patches.add(layer_normalization.LayerNormalization, "call", _wrap_layer_norm)
    patches.add(keras_dropout.Dropout, "call", _wrap_dropout)
    for name in ("add_v2", "sub", "mul"):
        patches.add(gen_math_ops, name, _wrap_binary)
    patches.add(gen_nn_ops, "bias_add", _wrap_bias_add)


def _on_slices(kind: str, build, whole):
    """``build(ctx)`` (None: not split along the sequence) in the open split
    scope, recorded as ShardingUnit ``kind`` run on sequence slices; else
    ``whole()``."""
    ctx = open_split_context()
    if ctx is None or not ctx.sequence_parallel:
        return whole()
    with ctx.building():
        result = build(ctx)
    if result is None:
        return whole()
    ctx.decisions[ctx.unit_name(kind)] = "sequence"
    return result


def _wrap_layer_norm(original):
    def call(self, inputs):
        rank = getattr(getattr(inputs, "shape", None), "rank", None)
        if rank is None or list(self.axis) != [rank - 1]:
            return original(self, inputs)
        return _on_slices(self.name, lambda ctx: sequence.per_shard(
            ctx, inputs, lambda shard: original(self, shard)), lambda: original(self, inputs))
    return call


def _wrap_dropout(original):
    def call(self, inputs, training=None):
        return _on_slices(self.name, lambda ctx: sequence.per_shard(
            ctx, inputs, lambda shard: original(self, shard, training)),
            lambda: original(self, inputs, training))
    return call


def _wrap_binary(original):
    def binary(x, y, name=None):
        if context.executing_eagerly():  # no split scope: the hot path of eager code
            return original(x, y, name=name)
        return _on_slices(original.__name__, lambda ctx: sequence.binary(ctx, original, x, y),
                          lambda: original(x, y, name=name))
    return binary


def _wrap_bias_add(original):
    def bias_add(value, bias, data_format="NHWC", name=None):
        return _on_slices("bias_add", lambda ctx: sequence.binary(
            ctx, lambda a, b: original(a, b, data_format=data_format), value, bias)
            if data_format in (None, "NHWC", b"NHWC") else None,
            lambda: original(value, bias, data_format=data_format, name=name))
    return bias_add
