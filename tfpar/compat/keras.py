"""Keras internals tfpar uses (``keras.src``), and the private members it
reaches, each behind a function named for what it does."""
# pylint: disable=protected-access,unused-import

# IMPORTS (every keras.src name tfpar uses)
from keras.src import backend, constraints, initializers as keras_initializers, regularizers
from keras.src.engine import base_layer, functional, training, training_v1
from keras.src.layers.attention import multi_head_attention as keras_attention
from keras.src.layers.core import dense as keras_dense, einsum_dense as keras_einsum_dense
from keras.src.layers.normalization import batch_normalization, layer_normalization
from keras.src.layers.regularization import dropout as keras_dropout
from keras.src.legacy_tf_layers import base as legacy_layers
from keras.src.optimizers import optimizer as keras_optimizer
from keras.src.optimizers.legacy import optimizer_v2 as keras_optimizer_v2
from keras.src.saving.legacy import hdf5_format
# END IMPORTS


def analyze_einsum_string(equation, bias_axes, input_shape, output_shape):
    """(kernel shape, bias shape or None, full output shape) of an
    ``EinsumDense``, as its ``build`` computes them."""
    return keras_einsum_dense._analyze_einsum_string(equation, bias_axes, input_shape,
                                                     output_shape)


def base_optimizer_class():
    """The class Keras' (non-legacy) optimizers derive from."""
    return keras_optimizer._BaseOptimizer


def slot_index_has(keras_optimizer, variable) -> bool:
    """Whether ``keras_optimizer`` made slots for ``variable``."""
    return (keras_optimizer._var_key(variable)
            in getattr(keras_optimizer, "_index_dict", {}))


def optimizer_name(legacy_optimizer) -> str:
    return legacy_optimizer._name


def make_train_function(model) -> None:
    """Build a compiled graph-mode model's training function now."""
    model._make_train_function()


def layer_weight_list(layer) -> list:
    """The list of ``layer``'s own weights (trainable ones if it trains) that
    a weight made outside ``add_weight`` joins."""
    return layer._trainable_weights if layer.trainable else layer._non_trainable_weights


def own_weights(layer) -> list:
    """``layer``'s own weights (not its sublayers'), trainable ones first, as
    Keras' v3 files (``.weights.h5``, ``.keras``) number them."""
    return layer._trainable_weights + layer._non_trainable_weights


def attention_equation(layer) -> str:
    """The einsum equation a ``MultiHeadAttention`` layer takes q.k with."""
    return layer._dot_product_equation


def h5_weight_lister():
    """(module, name) of the function Keras' h5 files list a layer's weights
    with, saving and loading (its trainable weights, then the others)."""
    return hdf5_format, "_legacy_weights"
