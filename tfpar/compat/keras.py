"""Keras internals tfpar uses (``keras.src``), and the private members it
reaches, each behind a function named for what it does."""
# pylint: disable=protected-access,unused-import

# IMPORTS (every keras.src name tfpar uses)
from keras.src.layers.core import einsum_dense
from keras.src.optimizers import optimizer
# END IMPORTS


def analyze_einsum_string(equation, bias_axes, input_shape, output_shape):
    """(kernel shape, bias shape or None, full output shape) of an
    ``EinsumDense``, as its ``build`` computes them."""
    return einsum_dense._analyze_einsum_string(equation, bias_axes, input_shape, output_shape)


def base_optimizer_class():
    """The class Keras' (non-legacy) optimizers derive from."""
    return optimizer._BaseOptimizer


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


def attention_equation(layer) -> str:
    """The einsum equation a ``MultiHeadAttention`` layer takes q.k with."""
    return layer._dot_product_equation
