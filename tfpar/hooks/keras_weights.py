"""A model's weights as one device holds them, where Keras hands them to a
script.

A layer split in a TF2 step trains one variable per shard
(``patterns/split_weights.py``), and the lists a step differentiates and an
optimizer updates hold those shards: ``trainable_variables``,
``trainable_weights``, ``non_trainable_weights``, ``variables``. What Keras
gives and takes as the model's state shows each split weight whole instead,
as its ``SplitWeight``, once, where the whole weight is among one device's
weights:

* ``Layer.weights`` / ``Model.weights``, hence ``get_weights()``,
  ``set_weights()`` and ``model.weights[i].numpy()`` (``Layer.variables``,
  Keras' alias of ``weights``, keeps the shards);
* the lists Keras' h5 files hold per layer (``save_weights`` / ``load_weights``
  of ``.h5``, ``Model.save`` to h5), and the values its v3 files
  (``.weights.h5``, ``.keras``) hold per layer (``Layer.save_own_variables`` /
  ``load_own_variables``, which Keras writes for a layer's own weights).

TF-format files (``save_weights(prefix)``) are checkpoints, which hold a split
weight as one value already.
"""
from tfpar.compat import keras as keras_internals
from tfpar.compat.keras import base_layer, training
from tfpar.patterns.split_weights import SplitWeight, shard_variables, whole_weights

__all__ = ["add_keras_weight_patches"]


def add_keras_weight_patches(patches) -> None:
    for owner in (base_layer.Layer, training.Model):
        patches.add(owner, "weights", _whole)
    patches.add(base_layer.Layer, "variables", lambda original: property(
        lambda self: shard_variables(self.weights), doc=original.__doc__))
    patches.add(*keras_internals.h5_weight_lister(), _listing_whole)
    patches.add(base_layer.Layer, "save_own_variables", _saving_whole)
    patches.add(base_layer.Layer, "load_own_variables", _loading_whole)


def _whole(original):
    return property(lambda self: whole_weights(original.fget(self)), doc=original.__doc__)


def _listing_whole(original):
    def legacy_weights(layer):
        return whole_weights(original(layer))
    return legacy_weights


def _split_own_weights(layer):
    """``layer``'s own weights, each split one whole, if it has a split one; else None."""
    weights = whole_weights(keras_internals.own_weights(layer))
    return weights if any(isinstance(w, SplitWeight) for w in weights) else None


def _saving_whole(original):
    def save_own_variables(self, store):
        weights = _split_own_weights(self)
        if weights is None:
            return original(self, store)
        for index, weight in enumerate(weights):
            store[str(index)] = weight.numpy()
        return None
    return save_own_variables


def _loading_whole(original):
    def load_own_variables(self, store):
        weights = _split_own_weights(self)
        if weights is None:
            return original(self, store)
        if len(store.keys()) != len(weights):
            raise ValueError(f"Layer '{self.name}' expected {len(weights)} variables, but "
                             f"received {len(store.keys())} variables during loading. "
                             f"Expected: {[w.name for w in weights]}")
        for index, weight in enumerate(weights):
            weight.assign(store[str(index)])
        return None
    return load_own_variables
