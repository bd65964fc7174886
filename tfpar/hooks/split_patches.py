"""Hooks that turn API calls inside a ``wh.split`` scope into ShardingUnits
(Whale §3.2.2): each wrapper asks the matcher for a pattern and builds its
distributed implementation; outside split scopes, or for inputs the patterns
do not cover, the original TensorFlow function runs.

* keras ``Dense`` (``tf.keras.layers.Dense``, ``tf.compat.v1.layers.dense``):
  ``build`` makes no full weight, ``call`` builds the chosen dense pattern;
* ``gen_nn_ops`` softmax cross-entropy (sparse and dense; every ``tf.nn`` and
  ``tf.compat.v1.losses`` variant ends there) on class-split logits;
* ``gen_math_ops.arg_max`` (``tf.argmax``) over the split dimension.
"""
from keras.src.layers.core import dense as keras_dense
from keras.src.legacy_tf_layers import base as legacy_layers
from tensorflow.python.framework import ops, tensor_util
from tensorflow.python.ops import gen_math_ops, gen_nn_ops, variable_scope

from tfpar.hooks import capture as cap_lib
from tfpar.hooks.patching import PatchSet
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.argmax import sharded_argmax
from tfpar.patterns.dense import DENSE_PATTERNS, dense_unit
from tfpar.patterns.matcher import choose
from tfpar.patterns.softmax_xent import GATHER, XENT_PATTERNS, softmax_xent

__all__ = ["add_split_patches"]


def add_split_patches(patches: PatchSet) -> None:
    patches.add(keras_dense.Dense, "build", _wrap_dense_build)
    patches.add(keras_dense.Dense, "call", _wrap_dense_call)
    patches.add(gen_nn_ops, "sparse_softmax_cross_entropy_with_logits",
                lambda original: _wrap_xent(original, sparse=True))
    patches.add(gen_nn_ops, "softmax_cross_entropy_with_logits",
                lambda original: _wrap_xent(original, sparse=False))
    patches.add(gen_math_ops, "arg_max", _wrap_arg_max)


def _split_context():
    graph = ops.get_default_graph()
    if graph.building_function:
        return None
    capture = cap_lib.existing_capture(graph)
    return capture.current_split() if capture is not None else None


def _wrap_dense_build(original):
    def build(self, input_shape):
        if _split_context() is None:
            return original(self, input_shape)
        return None  # the pattern makes sharded weights when called
    return build


def _wrap_dense_call(original):
    def call(self, inputs):
        ctx = _split_context()
        if ctx is None:
            return original(self, inputs)
        pattern = choose(ctx, dense_unit(ctx, self, inputs), DENSE_PATTERNS)
        return pattern.build(ctx, self, inputs, _layer_getter(self))
    return call


def _layer_getter(layer):
    """get_variable under the layer's variable names (legacy layers already
    run inside their variable scope; keras layers name weights ``layer/...``)."""
    if isinstance(layer, legacy_layers.Layer):
        return variable_scope.get_variable

    def getter(name, **kwargs):
        with variable_scope.variable_scope(layer.name):
            return variable_scope.get_variable(name, **kwargs)
    return getter


def _wrap_xent(original, sparse: bool):
    kind = "sparse_softmax_xent" if sparse else "softmax_xent"

    def xent(features, labels, name=None):
        ctx = _split_context()
        sharded = ctx.lookup(features) if ctx is not None else None
        if sharded is None:
            return original(features, labels, name=name)
        unit = ShardingUnit(ctx.unit_name(kind), kind, (ctx.info(features), ctx.info(labels)),
                            {"classes": int(features.shape[-1])})
        if choose(ctx, unit, XENT_PATTERNS) is GATHER:
            return original(features, labels, name=name)
        loss = softmax_xent(ctx, sharded, labels, sparse)
        return loss, None  # callers use the loss; gradients flow through its ops
    return xent


def _wrap_arg_max(original):
    def arg_max(input, dimension, output_type=None, name=None):  # pylint: disable=redefined-builtin
        ctx = _split_context()
        sharded = ctx.lookup(input) if ctx is not None else None
        axis = dimension if isinstance(dimension, int) else tensor_util.constant_value(dimension)
        if sharded is None or axis is None or int(axis) % input.shape.rank != sharded.axis:
            return original(input, dimension, output_type=output_type, name=name)
        ctx.decisions[ctx.unit_name("argmax")] = "sharded"
        return sharded_argmax(ctx, sharded, output_type)
    return arg_max
