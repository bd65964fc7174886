"""Hooks that turn API calls inside a ``wh.split`` scope into ShardingUnits
(Whale §3.2.2): each wrapper asks the matcher for a pattern and builds its
distributed implementation; outside split scopes, or for inputs the patterns
do not cover, the original TensorFlow function runs.

* keras ``Dense`` (``tf.keras.layers.Dense``, ``tf.compat.v1.layers.dense``)
  and ``EinsumDense``: ``build`` makes no full weight, ``call`` builds the
  chosen dense / einsum-dense pattern; the layer keeps its regularizers
  (``layer.losses``, and the collection for ``tf.compat.v1.layers``), its
  constraints (on every shard) and its ``kernel`` / ``bias`` attributes
  (partitioned variables when split), named as keras names them;
* keras ``MultiHeadAttention._compute_attention`` on query, key and value
  split by heads: keras' attention on each device's heads;
* ``gen_nn_ops`` softmax cross-entropy (sparse and dense; every ``tf.nn`` and
  ``tf.compat.v1.losses`` variant ends there) on class-split logits;
* ``gen_math_ops.arg_max`` (``tf.argmax``) over the split dimension;
* ``VariableScope.get_variable``: a variable made inside a split scope without a
  partitioner is split along its first dimension (a ``ShardedVariable``),
  keeping its regularizer and constraint;
* ``_VariableStore._get_single_variable``: while a sharded variable is made,
  TensorFlow builds each slice here; the slice goes to its shard's device and is
  recorded in the SplitContext's side table (shard identity comes from the
  slice's offset, never from its name);
* ``variable_scope._iter_slices``: the slices of a sharded variable are its
  SplitContext's widths (in proportion to its devices' speeds when they are
  mixed), not TensorFlow's even cut;
* ``gen_array_ops.gather_v2`` (``tf.gather``, ``tf.nn.embedding_lookup``) on a
  row-split table: vocabulary-sharded lookup;
* ``gen_math_ops.mat_mul`` (``tf.matmul``) and ``gen_linalg_ops.einsum``
  (``tf.einsum``) on split operands: contraction patterns;
* elementwise activations (relu, tanh, sigmoid) of a split tensor act on its
  shards, so it stays split.
"""
import contextlib
import functools
import inspect

from keras.src import backend as keras_backend
from keras.src import initializers as keras_initializers
from keras.src.layers.attention import multi_head_attention as keras_attention
from keras.src.layers.core import dense as keras_dense
from keras.src.layers.core import einsum_dense as keras_einsum_dense
from keras.src.legacy_tf_layers import base as legacy_layers
from tensorflow.python.framework import dtypes, ops, tensor_util
from tensorflow.python.ops import gen_array_ops, gen_linalg_ops, gen_math_ops, gen_nn_ops
from tensorflow.python.ops import init_ops, math_ops, special_math_ops, variable_scope

from tfpar.hooks import capture as cap_lib
from tfpar.errors import ShardingError
from tfpar.fallback import fall_back
from tfpar.hooks.checkpoint_bindings import rebind
from tfpar.hooks.optimizer_slots import optimizer_built_with
from tfpar.hooks.patching import PatchSet
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.argmax import sharded_argmax
from tfpar.patterns.contraction import (CONTRACTION_PATTERNS, GATHER as GATHER_OPERANDS,
                                        contraction_unit, sharded_contraction)
from tfpar.patterns import moe
from tfpar.patterns.embedding import vocab_lookup
from tfpar.patterns.attention import ATTENTION_PATTERNS, HEADS, attention_unit, heads_attention
from tfpar.patterns.dense import choose_dense
from tfpar.patterns.einsum_dense import choose_einsum_dense
from tfpar.patterns.matcher import choose
from tfpar.patterns.sharded import creation_slices, shard_being_created
from tfpar.patterns.sharded_variable import ShardedVariable, sharded_variable
from tfpar.patterns.split_weights import split_weight
from tfpar.hooks.step_graphs import is_step_function
from tfpar.patterns.weights import regularization_loss
from tfpar.patterns.softmax_xent import GATHER, XENT_PATTERNS, softmax_xent

__all__ = ["add_split_patches"]


def add_split_patches(patches: PatchSet) -> None:
    for layer, choose_pattern in ((keras_dense.Dense, choose_dense),
                                  (keras_einsum_dense.EinsumDense, choose_einsum_dense)):
        patches.add(layer, "build", _wrap_layer_build)
        patches.add(layer, "call", functools.partial(_wrap_layer_call, choose=choose_pattern))
    patches.add(keras_attention.MultiHeadAttention, "_compute_attention",
                _wrap_compute_attention)
    patches.add(gen_nn_ops, "sparse_softmax_cross_entropy_with_logits",
                lambda original: _wrap_xent(original, sparse=True))
    patches.add(gen_nn_ops, "softmax_cross_entropy_with_logits",
                lambda original: _wrap_xent(original, sparse=False))
    patches.add(gen_math_ops, "arg_max", _wrap_arg_max)
    patches.add(variable_scope.VariableScope, "get_variable", _wrap_get_variable)
    store = variable_scope._VariableStore  # pylint: disable=protected-access
    patches.add(store, "_get_single_variable", _wrap_get_single_variable)
    patches.add(variable_scope, "_iter_slices", _wrap_iter_slices)
    patches.add(gen_array_ops, "gather_v2", _wrap_gather)
    patches.add(gen_math_ops, "mat_mul", _wrap_mat_mul)
    patches.add(gen_linalg_ops, "einsum", _wrap_einsum)
    for module, name in ((gen_nn_ops, "relu"), (gen_math_ops, "tanh"),
                         (gen_math_ops, "sigmoid")):
        patches.add(module, name, _wrap_elementwise)


def _split_context():
    graph = ops.get_default_graph()
    if graph.building_function and not is_step_function(graph):
        return None
    capture = cap_lib.existing_capture(graph)
    ctx = capture.current_split(graph.get_name_scope()) if capture is not None else None
    return None if ctx is None or ctx.busy else ctx


def _wrap_layer_build(original):
    def build(self, input_shape):
        if _split_context() is None and not hasattr(self, "_tfpar_split"):
            return original(self, input_shape)
        return None  # the pattern makes sharded weights when called
    return build


def _wrap_layer_call(original, choose):
    """A layer built in a split scope stays split: calling it again (a keras
    model applied to a new input; a TF2 step traced again, in its own split
    scope) reuses its pattern and sharded weights. ``choose(ctx, layer,
    inputs)`` picks the pattern."""
    def call(self, inputs):
        ctx = _split_context()
        if not hasattr(self, "_tfpar_split"):
            if ctx is None:
                return original(self, inputs)
            pattern = choose(ctx, self, inputs)
            self._tfpar_split = (ctx, pattern, {}, next(reversed(ctx.decisions)))
        first, pattern, made, unit = self._tfpar_split
        if ctx is not None and ctx is not first and ctx.devices == first.devices:
            ctx.decisions.setdefault(unit, pattern.name)
        else:
            ctx = first
        with ctx.building():
            return pattern.build(ctx, self, inputs, _layer_getter(ctx, self, made))
    return call


def _layer_getter(ctx, layer, made):
    """The getter of the dense patterns (``patterns/dense.py``): the layer's
    weight ``name`` split along ``axis`` (None: whole), made once under the
    layer's variable names (legacy layers already run inside their variable
    scope; keras layers name weights after their name scope) with the layer's
    constraint; its regularizer's value on the whole weight is added as the
    layer's loss, as ``add_weight`` does; the weight becomes the layer's
    attribute (``layer.kernel``), is tracked as its weight and by keras'
    session (which initializes it in ``model.fit``)."""
    def getter(name, shape, dtype, initializer, axis, regularizer=None, constraint=None):
        if name in made:
            return made[name]
        initializer = _add_weight_default(initializer, dtype)
        if ops.get_default_graph().building_function:  # a TF2 step: eager weights
            made[name] = _eager_weight(ctx, layer, name, shape, dtype, initializer, axis,
                                       regularizer, constraint)
            return made[name]
        legacy = isinstance(layer, legacy_layers.Layer)
        scope = contextlib.nullcontext() if legacy else _keras_weight_scope()
        known = ops.get_default_graph().get_collection_ref(ops.GraphKeys.GLOBAL_VARIABLES)
        count = len(known)
        with scope:
            if axis is None:
                variable = variable_scope.get_variable(
                    name, shape=shape, dtype=dtype, initializer=initializer,
                    constraint=constraint, trainable=layer.trainable)
            else:
                variable = sharded_variable(
                    ctx, name, shape, axis, dtype, initializer, constraint=constraint,
                    owner=f"layer '{layer.name}': {name}_constraint", trainable=layer.trainable)
        made[name] = variable
        parts = list(variable) if axis is not None else [variable]
        # pylint: disable=protected-access
        weights = layer._trainable_weights if layer.trainable else layer._non_trainable_weights
        # pylint: enable=protected-access
        weights.extend(parts)
        for part in parts:
            keras_backend.track_variable(part)
        setattr(layer, name, variable)  # as Dense.build sets layer.kernel / layer.bias
        if regularizer is not None and len(known) > count:  # reused weights: once, by their maker
            # Named as keras names it: legacy layers evaluate it now, in their name scope.
            layer.add_loss(functools.partial(_layer_regularization, ctx, regularizer, variable,
                                             axis, name if legacy else f"{layer.name}/{name}"))
        return variable
    return getter


def _keras_weight_scope():
    """Keras names a layer's weights after the name scope it builds them in,
    the one its ``call`` runs in (``block/attention/query/kernel``): a
    variable scope of that name."""
    name = ops.get_default_graph().get_name_scope()
    return variable_scope.variable_scope(variable_scope.VariableScope(None, name=name),
                                         auxiliary_name_scope=False)


def _add_weight_default(initializer, dtype):
    """The initializer keras' ``add_weight`` uses where a layer gives None (a
    ``tf.compat.v1.layers`` kernel by default): the variable scope's, else
    keras' glorot uniform for floats, zeros for the rest."""
    if initializer is None:
        initializer = variable_scope.get_variable_scope().initializer
    if initializer is None:
        floating = dtypes.as_dtype(dtype).is_floating
        initializer = (keras_initializers.get("glorot_uniform") if floating
                       else init_ops.zeros_initializer())
    return initializer


def _eager_weight(ctx, layer, name, shape, dtype, initializer, axis, regularizer, constraint):
    """A layer's weight in a TF2 step (``patterns.split_weights``): whole (axis
    None) as keras makes it, else split from the whole weight's value (the
    layer's own, when it was built whole before), replacing it."""
    existing = getattr(layer, name, None)
    if axis is None:
        if existing is None:
            with ops.init_scope():
                existing = layer.add_weight(name, shape, dtype, initializer, regularizer,
                                            trainable=layer.trainable, constraint=constraint)
        return existing
    built = optimizer_built_with(existing) if existing is not None else None
    if built is not None:
        raise ShardingError(
            f"tfpar: optimizer '{built.name}' made its slots for '{existing.name}' whole before "
            f"layer '{layer.name}' was split in a TF2 step (its weights are split when the step "
            "is first traced): let the first step build the optimizer; to resume from a "
            "checkpoint, restore it before the first step (the restore waits for the slots)")
    with ops.init_scope():
        initial = (existing if existing is not None else initializer(shape, dtype=dtype)).numpy()
    weight = split_weight(ctx, name, initial, axis, dtype, layer.trainable, constraint)
    attribute = "_trainable_weights" if layer.trainable else "_non_trainable_weights"
    weights = getattr(layer, attribute)
    position = next((i for i, w in enumerate(weights) if w is existing), len(weights))
    setattr(layer, name, weight)  # drops the whole one, if any, from the layer's weights
    if existing is not None:
        rebind(existing, weight)
    weights = getattr(layer, attribute)
    weights[position:position] = list(weight)  # where it was: keras' order of weights
    if regularizer is not None:
        layer.add_loss(functools.partial(_layer_regularization, ctx, regularizer, weight, axis,
                                         f"{layer.name}/{name}"))
    return weight


def _wrap_compute_attention(original):
    """Keras' attention on each device's heads (``patterns/attention.py``)
    when the projections split query, key and value by heads; else once, on
    their gathered values, said by ``fall_back`` unless forced."""
    def compute_attention(self, query, key, value, attention_mask=None, training=None):
        ctx = _split_context()
        if ctx is None:
            return original(self, query, key, value, attention_mask, training)
        unit = attention_unit(ctx, self, query, key, value)
        by_heads = choose(ctx, unit, ATTENTION_PATTERNS) is HEADS
        if not by_heads and ctx.forced_pattern(unit.name) is None:
            fall_back(f"wh.split asked to split the attention of layer '{self.name}' by heads",
                      f"it runs once on {ctx.devices[0]}, on its query, key and value gathered "
                      "(they are not all split by heads: fewer heads than devices, or other "
                      "patterns forced on the projections)",
                      f"Give it at least {ctx.size} heads, or force split.patterns "
                      f"{{'{unit.name}': 'gather'}} to silence this", ops.get_default_graph())
        with ctx.building():
            if not by_heads:
                with ops.device(ctx.devices[0]):
                    return original(self, query, key, value, attention_mask, training)
            return heads_attention(
                ctx, lambda q, k, v: original(self, q, k, v, attention_mask, training),
                query, key, value, self._dot_product_equation)  # pylint: disable=protected-access
    return compute_attention


def _layer_regularization(ctx, regularizer, variable, axis, name):
    with ops.name_scope(f"{name}/Regularizer"):
        return regularization_loss(ctx, regularizer, variable, axis)


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
    signature = inspect.signature(original)

    def get_variable(self, var_store, name, shape=None, dtype=None, initializer=None,
                     *args, partitioner=None, **kwargs):
        ctx = _split_context()
        rank = len(shape) if shape is not None else getattr(initializer, "ndim", 0)
        if ctx is None or partitioner is not None or not rank:
            return original(self, var_store, name, shape, dtype, initializer, *args,
                            partitioner=partitioner, **kwargs)
        given = signature.bind(self, var_store, name, shape, dtype, initializer, *args,
                               **kwargs).arguments
        for key in ("self", "var_store", "name", "shape", "dtype", "initializer"):
            given.pop(key)
        full_name = f"{self.name}/{name}" if self.name else name
        if ops.get_default_graph().building_function:
            raise ShardingError(
                f"tfpar: variable '{full_name}' is made with tf.compat.v1.get_variable inside "
                "wh.split in a TF2 tf.function; tfpar splits keras Dense layers there. Use "
                "tf.keras.layers.Dense, or build the model in graph mode")
        with ctx.building():
            partitioned = sharded_variable(
                ctx, name, initializer.shape if shape is None else shape, 0, dtype, initializer,
                getter=functools.partial(original, self, var_store),
                owner=f"variable '{full_name}': constraint", **given)
        return ShardedVariable(partitioned, ctx)
    return get_variable


def _wrap_get_single_variable(original):
    """A slice of a sharded variable being made is built on its shard's device
    and recorded (``SplitContext.shard_index``)."""
    def _get_single_variable(self, *args, partition_info=None, **kwargs):
        slot = shard_being_created(partition_info)
        if slot is None:
            return original(self, *args, partition_info=partition_info, **kwargs)
        creation, index = slot
        with ops.device(creation.ctx.devices[index]):
            variable = original(self, *args, partition_info=partition_info, **kwargs)
        creation.record(variable, index)
        return variable
    return _get_single_variable


def _wrap_iter_slices(original):
    """The slices of a sharded variable being made are its SplitContext's
    (uneven on mixed devices), not TensorFlow's even ones."""
    def iter_slices(full_shape, num_slices, slice_dim):
        slices = creation_slices(full_shape, slice_dim, num_slices)
        return iter(slices) if slices is not None else original(full_shape, num_slices,
                                                                  slice_dim)
    return iter_slices


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
    indices = moe.dispatch_indices(equation, operands) if kind == "einsum" else None
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
