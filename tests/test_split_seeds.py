"""Seeds in graph mode give a split model the initial weights they give one
device (docs/user-guide.md: seeds set before or after ``wh.init()`` give the initial
weights they give without tfpar). Whale Example 2 (a replicated backbone, a
split classifier head on the same 4 devices), every initializer left to its
default, seeded by ``tf.keras.utils.set_random_seed`` or
``tf.compat.v1.set_random_seed``."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, make_data, train

import tfpar as wh

v1 = tf.compat.v1
CLASSES = 50
DATA = make_data(steps=3, batch=8, classes=CLASSES)


def v1_layers(features):
    return v1.layers.dense(features, CLASSES)


def keras_layers(features):
    return tf.keras.layers.Dense(CLASSES)(features)


def get_variable(features):
    return tf.matmul(features, v1.get_variable("classifier", [16, CLASSES]))


def whale_example_2(tfpar, seed, head):
    def build(x, y):
        seed(7)
        with wh.replicate(4) if tfpar else contextlib.nullcontext():
            features = tf.nn.relu(tf.matmul(x, v1.get_variable("backbone", [6, 16])))
        with wh.split(4) if tfpar else contextlib.nullcontext():
            logits = head(features)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdamOptimizer(0.01).minimize(loss)
    return build


@pytest.mark.parametrize("seed,head", [
    (tf.keras.utils.set_random_seed, v1_layers), (tf.keras.utils.set_random_seed, keras_layers),
    (v1.set_random_seed, get_variable)], ids=["keras-seed-v1-layers", "keras-seed-keras-layers",
                                              "v1-seed-get-variable"])
def test_a_seeded_split_head_starts_from_the_single_device_weights(seed, head):
    """Before: each shard drew its own slice (keras initializers from the
    shard's shape, a v1 layer's default kernel from TensorFlow's initializer
    instead of keras'; each TensorFlow draw took the next graph-seeded op
    seed), so the split head and every seeded op after it started elsewhere."""
    reference = train(whale_example_2(False, seed, head), DATA)
    np.testing.assert_allclose(reference[0], train(whale_example_2(False, seed, head), DATA)[0])
    assert_equivalent(reference, train(whale_example_2(True, seed, head), DATA,
                                       {"cluster.num_devices": 4}), rtol=1e-5)
