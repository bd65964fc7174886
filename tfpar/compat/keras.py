"""Keras internals tfpar uses (Keras 2's ``keras.src`` on TensorFlow 2.15, the same
layout as ``tf_keras.src`` on 2.16+), and the private members it reaches, each behind
a function named for what it does; and what tells Keras 3 (2.16+'s default
``tf.keras``) apart."""
# pylint: disable=protected-access,unused-import
import collections
import functools
import importlib
import importlib.metadata
import os
from typing import Optional

import tensorflow as _tf

from tfpar.compat.tf import VERSION


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


# Keras 2: the keras package up to TensorFlow 2.15; from 2.16, where keras is Keras 3,
# the tf_keras package (tf.keras is tf_keras there only with TF_USE_LEGACY_KERAS=1;
# tfpar hooks Keras 2 either way).
KERAS_2_PACKAGE = "keras" if _installed_version("keras").startswith("2.") else "tf_keras"
# Whether tf.keras is Keras 3 (TensorFlow's lazy loader decides so, by the same rule).
TF_KERAS_IS_KERAS_3 = (KERAS_2_PACKAGE == "tf_keras"
                       and os.environ.get("TF_USE_LEGACY_KERAS") not in ("true", "True", "1"))


def _keras_2(module: str):
    try:
        return importlib.import_module(f"{KERAS_2_PACKAGE}.src.{module}")
    except ImportError as error:
        if KERAS_2_PACKAGE == "tf_keras" and (error.name or "").split(".")[0] == "tf_keras":
            version = ".".join(str(part) for part in VERSION)
            raise ImportError(
                f"tfpar on TensorFlow {_tf.__version__} needs Keras 2, the tf_keras package: "
                f"pip install tf-keras=={version}.*") from error
        raise


# IMPORTS (every keras.src / tf_keras.src name tfpar uses)
backend, constraints, keras_initializers, regularizers = (
    _keras_2(m) for m in ("backend", "constraints", "initializers", "regularizers"))
base_layer, functional, training, training_v1 = (
    _keras_2(f"engine.{m}") for m in ("base_layer", "functional", "training", "training_v1"))
keras_attention = _keras_2("layers.attention.multi_head_attention")
keras_dense = _keras_2("layers.core.dense")
keras_einsum_dense = _keras_2("layers.core.einsum_dense")
batch_normalization = _keras_2("layers.normalization.batch_normalization")
layer_normalization = _keras_2("layers.normalization.layer_normalization")
keras_dropout = _keras_2("layers.regularization.dropout")
legacy_layers = _keras_2("legacy_tf_layers.base")
keras_optimizer = _keras_2("optimizers.optimizer")
keras_optimizer_v2 = _keras_2("optimizers.legacy.optimizer_v2")
hdf5_format = _keras_2("saving.legacy.hdf5_format")
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


# Keras 3 (TensorFlow 2.16+'s default tf.keras), imported only where keras is Keras 3.
Keras3 = collections.namedtuple("Keras3", "version layer optimizer trainer batch_normalization")


@functools.lru_cache(maxsize=None)
def keras_3() -> Optional[Keras3]:
    """Keras 3's version and the classes tfpar hooks (every layer's base, every
    optimizer's, the TensorFlow trainer behind ``Model.fit``, BatchNormalization);
    None where the keras package is Keras 2 (TensorFlow 2.15)."""
    if KERAS_2_PACKAGE == "keras":
        return None
    keras = importlib.import_module("keras")
    return Keras3(version=keras.__version__,
                  layer=importlib.import_module("keras.src.layers.layer").Layer,
                  optimizer=importlib.import_module(
                      "keras.src.optimizers.base_optimizer").BaseOptimizer,
                  trainer=importlib.import_module(
                      "keras.src.backend.tensorflow.trainer").TensorFlowTrainer,
                  batch_normalization=importlib.import_module(
                      "keras.src.layers.normalization.batch_normalization").BatchNormalization)


def keras_3_step_by_step(model, step_function):
    """A Keras 3 model's train or test function (``function(iterator)``, what
    ``TensorFlowTrainer._make_function`` returns) that calls ``step_function``
    as a tf.function of one batch from eager code, ``steps_per_execution``
    times, where Keras calls it inside a while loop of another tf.function;
    StopIteration when the iterator has no batch left, as Keras' does."""
    step = _tf.function(step_function, reduce_retracing=True)

    def function(iterator):
        batches, outputs = iter(iterator), None
        for _ in range(model.steps_per_execution):
            data = next(batches, None)
            if data is None:
                break
            outputs = step(data)
        if outputs is None:
            raise StopIteration
        return outputs
    return function
