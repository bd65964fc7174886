"""Hooks that turn API calls inside a ``wh.split`` scope into ShardingUnits
(Whale §3.2.2): each wrapper asks the matcher for a pattern and builds its
distributed implementation; outside split scopes, or for inputs the patterns
do not cover, the original TensorFlow function runs.

* keras ``Dense`` (``tf.keras.layers.Dense``, ``tf.compat.v1.layers.dense``):
  ``build`` makes no full weight, ``call`` builds the chosen dense pattern;
* ``gen_nn_ops`` softmax cross-entropy (sparse and dense; every ``tf.nn`` and
  ``tf.compat.v1.losses`` variant ends there) on class-split logits;
* ``gen_math_ops.arg_max`` (``tf.argmax``) over the split dimension;
* ``VariableScope.get_variable``: a variable made inside a split scope without a
  partitioner is split along its first dimension (a ``ShardedVariable``);
* ``gen_array_ops.gather_v2`` (``tf.gather``, ``tf.nn.embedding_lookup``) on a
  row-split table: vocabulary-sharded lookup;
* ``gen_math_ops.mat_mul`` (``tf.matmul``) and ``gen_linalg_ops.einsum``
  (``tf.einsum``) on split operands: contraction patterns;
* elementwise activations (relu, tanh, sigmoid) of a split tensor act on its
  shards, so it stays split.
"""
import contextlib

from keras.src import backend as keras_backend
from keras.src.layers.core import dense as keras_dense
from keras.src.legacy_tf_layers import base as legacy_layers
from tensorflow.python.framework import ops, tensor_util
from tensorflow.python.ops import gen_array_ops, gen_linalg_ops, gen_math_ops, gen_nn_ops
from tensorflow.python.ops import math_ops, special_math_ops, variable_scope

from tfpar.hooks import capture as cap_lib
from tfpar.hooks.patching import PatchSet
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.argmax import sharded_argmax
from tfpar.patterns.contraction import (CONTRACTION_PATTERNS, GATHER as GATHER_OPERANDS,
                                        contraction_unit, sharded_contraction)
from tfpar.patterns import moe
from tfpar.patterns.embedding import vocab_lookup
from tfpar.patterns.dense import DENSE_PATTERNS, dense_unit
from tfpar.patterns.matcher import choose
from tfpar.patterns.sharded import ShardedVariable, slicing_initializer
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
    patches.add(variable_scope.VariableScope, "get_variable", _wrap_get_variable)
    patches.add(gen_array_ops, "gather_v2", _wrap_gather)
    patches.add(gen_math_ops, "mat_mul", _wrap_mat_mul)
    patches.add(gen_linalg_ops, "einsum", _wrap_einsum)
    for module, name in ((gen_nn_ops, "relu"), (gen_math_ops, "tanh"),
                         (gen_math_ops, "sigmoid")):
        patches.add(module, name, _wrap_elementwise)


def _split_context():
    graph = ops.get_default_graph()
    if graph.building_function:
        return None
    capture = cap_lib.existing_capture(graph)
    ctx = capture.current_split(graph.get_name_scope()) if capture is not None else None
    return None if ctx is None or ctx.busy else ctx


def _wrap_dense_build(original):
    def build(self, input_shape):
        if _split_context() is None and not hasattr(self, "_tfpar_split"):
            return original(self, input_shape)
        return None  # the pattern makes sharded weights when called
    return build


def _wrap_dense_call(original):
    """A layer built in a split scope stays split: calling it again (a keras
    model applied to a new input) reuses its pattern and sharded weights."""
    def call(self, inputs):
        ctx = _split_context()
        if not hasattr(self, "_tfpar_split"):
            if ctx is None:
                return original(self, inputs)
            pattern = choose(ctx, dense_unit(ctx, self, inputs), DENSE_PATTERNS)
            self._tfpar_split = (ctx, pattern, {})
        ctx, pattern, made = self._tfpar_split
        with ctx.building():
            return pattern.build(ctx, self, inputs, _layer_getter(self, made))
    return call


def _layer_getter(layer, made):
    """get_variable under the layer's variable names (legacy layers already run
    inside their variable scope; keras layers name weights ``layer/...``), made
    once per name and tracked as the layer's weights and by keras' session
    (which initializes them in ``model.fit``)."""
    def getter(name, **kwargs):
        if name not in made:
            scope = (contextlib.nullcontext() if isinstance(layer, legacy_layers.Layer)
                     else variable_scope.variable_scope(layer.name))
            with scope:
                made[name] = variable_scope.get_variable(name, **kwargs)
            parts = list(made[name]) if hasattr(made[name], "_get_variable_list") else [made[name]]
            layer._trainable_weights.extend(parts)  # pylint: disable=protected-access
            for part in parts:
                keras_backend.track_variable(part)
        return made[name]
    return getter


def _wrap_xent(original, sparse: bool):
    kind = "sparse_softmax_xent" if sparse else "softmax_xent"

    def xent(features, labels, name=None):
        ctx = _split_context()
        sharded = ctx.lookup(features) if ctx is not None else None
        if sharded is None:
            return original(features, labels, name=name)
        unit = ShardingUnit(ctx.unit_name(kind), kind, (ctx.info(features), ctx.info(labels)),
                            {"classes": sum(int(x.shape[-1]) for x in sharded.shards)})
        if choose(ctx, unit, XENT_PATTERNS) is GATHER:
            return original(features, labels, name=name)
        with ctx.building():
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
        with ctx.building():
            return sharded_argmax(ctx, sharded, output_type)
    return arg_max


def _wrap_get_variable(original):
    def get_variable(self, var_store, name, shape=None, dtype=None, initializer=None,
                     *args, partitioner=None, **kwargs):
        ctx = _split_context()
        rank = len(shape) if shape is not None else getattr(initializer, "ndim", 0)
        if ctx is None or partitioner is not None or not rank:
            return original(self, var_store, name, shape, dtype, initializer, *args,
                            partitioner=partitioner, **kwargs)
        parts = [ctx.size] + [1] * (rank - 1)
        if shape is None:
            shape = initializer.shape
        with ctx.building(), ctx.on_shard_devices():
            partitioned = original(self, var_store, name, shape, dtype,
                                   slicing_initializer(initializer), *args,
                                   partitioner=lambda shape, dtype: parts, **kwargs)
        return ShardedVariable(partitioned, ctx)
    return get_variable


def _wrap_gather(original):
    def gather_v2(params, indices, axis, batch_dims=0, name=None):
        ctx = _split_context()
        if ctx is not None:
            params = _read(params)
        sharded = ctx.lookup(params) if ctx is not None else None
        if sharded is None or sharded.axis != 0 or batch_dims or _constant(axis) != 0:
            return original(params, indices, axis, batch_dims=batch_dims, name=name)
        ctx.decisions[ctx.unit_name("embedding")] = "vocab"
        with ctx.building():
            return vocab_lookup(ctx, sharded, indices)
    return gather_v2


def _constant(x):
    return x if isinstance(x, int) else tensor_util.constant_value(x)


def _wrap_mat_mul(original):
    def mat_mul(a, b, transpose_a=False, transpose_b=False, name=None):
        equation = ("ki" if transpose_a else "ik") + "," + ("jk" if transpose_b else "kj") + "->ij"
        return _contraction(
            "matmul", equation, [a, b],
            lambda x, y: math_ops.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b),
            lambda: original(a, b, transpose_a=transpose_a, transpose_b=transpose_b, name=name))
    return mat_mul


def _wrap_einsum(original):
    def einsum(inputs, equation, name=None):
        return _contraction(
            "einsum", equation.replace(" ", ""), list(inputs),
            lambda *xs: special_math_ops.einsum(equation, *xs),
            lambda: original(inputs, equation, name=name))
    return einsum


def _read(x):
    """tf.gather and tf.einsum hand variables to the gen op unconverted."""
    return x.value() if isinstance(x, ShardedVariable) else x


def _contraction(kind, equation, operands, compute, fallback):
    ctx = _split_context()
    if ctx is None:
        return fallback()
    operands = [_read(x) for x in operands]
    if not any(ctx.lookup(x) is not None for x in operands):
        return _dispatch(ctx, kind, equation, operands, fallback)
    unit = contraction_unit(ctx, kind, equation, operands)
    pattern = choose(ctx, unit, CONTRACTION_PATTERNS)
    if pattern is GATHER_OPERANDS:
        return fallback()
    with ctx.building():
        if pattern is moe.TOKENS:
            index = unit.sizes["split_operand"]
            return moe.tokens_combine(ctx, equation, operands, index,
                                      ctx.lookup(operands[index]), unit.sizes["token"])
        return sharded_contraction(ctx, equation, operands, compute)


def _dispatch(ctx, kind, equation, operands, fallback):
    """An einsum of whole operands in a split scope: a mixture-of-experts
    dispatch may send token rows to their experts' devices (all-to-all)."""
    indices = moe.dispatch_indices(equation) if kind == "einsum" else None
    if indices is None:
        return fallback()
    unit = moe.dispatch_unit(ctx, equation, operands, indices[0])
    if choose(ctx, unit, moe.DISPATCH_PATTERNS) is not moe.TOKENS:
        return fallback()
    with ctx.building():
        return moe.tokens_dispatch(ctx, equation, operands[0], operands[1], *indices)


def _wrap_elementwise(original):
    def elementwise(x, name=None):
        ctx = _split_context()
        sharded = ctx.lookup(x) if ctx is not None else None
        if sharded is None:
            return original(x, name=name)
        with ctx.building():
            shards = []
            for shard, device in zip(sharded.shards, ctx.devices):
                with ops.device(device):
                    shards.append(original(shard))
            return ctx.sharded(shards, sharded.axis)
    return elementwise
