"""Keras layers built inside a ``wh.split`` scope become ShardingUnits
(Whale §3.2.2); outside split scopes the layer builds as in TensorFlow.

* keras ``Dense`` (``tf.keras.layers.Dense``, ``tf.compat.v1.layers.dense``)
  and ``EinsumDense``: ``build`` makes no full weight, ``call`` builds the
  chosen dense / einsum-dense pattern; the layer keeps its regularizers
  (``layer.losses``, and the collection for ``tf.compat.v1.layers``), its
  constraints (on every shard) and its ``kernel`` / ``bias`` attributes
  (partitioned variables when split), named as keras names them;
* keras ``MultiHeadAttention._compute_attention`` on query, key and value
  split by heads: keras' attention on each device's heads.
"""
import contextlib
import functools

from tfpar.compat.keras import (backend as keras_backend, keras_attention, keras_dense,
                                keras_einsum_dense, keras_initializers, legacy_layers)
from tfpar.compat import keras as keras_internals
from tfpar.compat.tf import dtypes, init_ops, ops, variable_scope
from tfpar.errors import ShardingError
from tfpar.fallback import fall_back
from tfpar.hooks.checkpoint_bindings import rebind
from tfpar.hooks.optimizer_slots import optimizer_built_with
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.split_scope import open_split_context
from tfpar.patterns.attention import ATTENTION_PATTERNS, HEADS, attention_unit, heads_attention
from tfpar.patterns.dense import choose_dense
from tfpar.patterns.einsum_dense import choose_einsum_dense
from tfpar.patterns.matcher import choose
from tfpar.patterns.sharded_variable import sharded_variable
from tfpar.patterns.split_weights import split_weight
from tfpar.patterns.weights import regularization_loss

__all__ = ["add_split_layer_patches"]


def add_split_layer_patches(patches: PatchSet) -> None:
    for layer, choose_pattern in ((keras_dense.Dense, choose_dense),
                                  (keras_einsum_dense.EinsumDense, choose_einsum_dense)):
        patches.add(layer, "build", _wrap_layer_build)
        patches.add(layer, "call", functools.partial(_wrap_layer_call, choose=choose_pattern))
    patches.add(keras_attention.MultiHeadAttention, "_compute_attention",
                _wrap_compute_attention)


def _wrap_layer_build(original):
    def build(self, input_shape):
        if open_split_context() is None and not hasattr(self, "_tfpar_split"):
            return original(self, input_shape)
        return None  # the pattern makes sharded weights when called
    return build


def _wrap_layer_call(original, choose):
    """A layer built in a split scope stays split: calling it again (a keras
    model applied to a new input; a TF2 step traced again, in its own split
    scope) reuses its pattern and sharded weights. ``choose(ctx, layer,
    inputs)`` picks the pattern."""
    def call(self, inputs):
        ctx = open_split_context()
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
        keras_internals.layer_weight_list(layer).extend(parts)
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
    weight = split_weight(ctx, name, initial, axis, dtype, layer.trainable, constraint,
                          whole_name=getattr(existing, "name", None))
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
        ctx = open_split_context()
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
                query, key, value, keras_internals.attention_equation(self))
    return compute_attention


def _layer_regularization(ctx, regularizer, variable, axis, name):
    with ops.name_scope(f"{name}/Regularizer"):
        return regularization_loss(ctx, regularizer, variable, axis)
