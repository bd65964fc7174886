"""Layers in a split scope keep what they are on one device (issue 20):
regularizers, constraints, ``layer.kernel``, and shards placed by their slice,
not by their names. Equivalence against single-device TensorFlow."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.ops.variables import PartitionedVariable

from equivalence import assert_equivalent, dense, make_data, plan_of, train

import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=8, classes=10)
CONFIG = {"cluster.num_devices": 2}


def split(tfpar):
    return wh.split(2) if tfpar else contextlib.nullcontext()


def frobenius(w):
    """A regularizer that is not a sum over elements: its value on a weight is
    not the sum of its values on the weight's slices."""
    return 0.1 * tf.sqrt(tf.reduce_sum(tf.square(w)))


def clip(w):
    return tf.clip_by_value(w, -0.05, 0.05)


def keras_sgd_step(loss):
    """A keras legacy optimizer: it applies each variable's constraint after its
    update (TensorFlow's v1 optimizers ignore constraints)."""
    variables = v1.trainable_variables()
    grads = tf.gradients(loss, variables)
    optimizer = tf.keras.optimizers.legacy.SGD(0.5)
    # tfpar's apply_gradients hook (hooks/tf_patches.py) makes the step counter
    # before keras' name scope ("iter", not "SGD/iter"): make it first in both runs.
    optimizer.iterations  # pylint: disable=pointless-statement
    return optimizer.apply_gradients(zip(grads, variables))


def head(tfpar, kind, record=None, **options):
    """A tanh feature layer, then a 10-class dense head (with ``options``:
    regularizers, constraints) in ``wh.split(2)``; loss = cross-entropy + the
    head's regularization losses (from the collection for
    ``tf.compat.v1.layers``, from ``layer.losses`` for keras), trained with the
    keras legacy SGD. Kernel initial values have negative entries."""
    def build(x, y):
        h = dense(x, 8, "features", seed=1, activation=tf.nn.tanh)
        rng = np.random.RandomState(2)
        init = {"kernel_initializer": v1.constant_initializer(rng.randn(8, 10) / np.sqrt(8)),
                "bias_initializer": v1.constant_initializer(0.1 * rng.randn(10))}
        make = v1.layers.Dense if kind == "legacy" else tf.keras.layers.Dense
        with split(tfpar):
            logits_layer = make(10, name="logits", **init, **options)
            logits = logits_layer(h)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
            penalties = (v1.losses.get_regularization_losses() if kind == "legacy"
                         else logits_layer.losses)
            if penalties:
                loss = loss + tf.add_n(penalties)
        if record is not None:
            record.update(layer=logits_layer, penalties=len(penalties),
                          collection=len(v1.losses.get_regularization_losses()))
        return loss, keras_sgd_step(loss)
    return build


LAYER_OPTIONS = {
    "kernel_regularizer": tf.keras.regularizers.L2(0.1),
    "bias_regularizer": tf.keras.regularizers.L1(0.05),
    "activity_regularizer": tf.keras.regularizers.L2(0.01),
    "kernel_constraint": tf.keras.constraints.NonNeg(),
    "bias_constraint": clip,
}


@pytest.mark.parametrize("pattern", ["column", "row"])
@pytest.mark.parametrize("kind", ["legacy", "keras"])
def test_regularizers_and_constraints_of_a_split_dense_layer(kind, pattern):
    plain, split_ = {}, {}
    reference = train(head(False, kind, plain, **LAYER_OPTIONS), DATA)
    config = {**CONFIG, "split.patterns": {"logits": pattern}}
    result = train(head(True, kind, split_, **LAYER_OPTIONS), DATA, config)
    assert_equivalent(reference, result)
    # NonNeg bit: negative initial entries were clipped to zero.
    assert (reference[1]["logits/kernel"] == 0).any()
    # The losses are where they are on one device, one per regularizer.
    assert (split_["penalties"], split_["collection"]) == (plain["penalties"],
                                                           plain["collection"]) != (0, 0)
    kernel = split_["layer"].kernel
    assert isinstance(kernel, PartitionedVariable)
    assert [part.constraint for part in kernel] == [LAYER_OPTIONS["kernel_constraint"]] * 2
    bias = split_["layer"].bias
    assert all(part.constraint is clip for part in (bias if pattern == "column" else [bias]))


def reused_layer(tfpar, record):
    """A tf.compat.v1.layers.dense applied twice (``reuse=True``): its weights,
    and their regularization losses, are made once."""
    def build(x, y):
        rng = np.random.RandomState(2)
        options = {"kernel_initializer": v1.constant_initializer(rng.randn(6, 10) / 3),
                   "kernel_regularizer": tf.keras.regularizers.L2(0.1),
                   "bias_regularizer": frobenius}
        with split(tfpar):
            first = v1.layers.dense(x, 10, name="logits", **options)
            second = v1.layers.dense(2 * x, 10, name="logits", reuse=True, **options)
            loss = (v1.losses.sparse_softmax_cross_entropy(y, first + second)
                    + v1.losses.get_regularization_loss())
        record["collection"] = len(v1.losses.get_regularization_losses())
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def assert_collects_like_one_device(model, losses):
    """``model(tfpar, record)`` trains as on one device, and both runs put
    ``losses`` entries in the regularization collection."""
    plain, split_ = {}, {}
    assert_equivalent(train(model(False, plain), DATA), train(model(True, split_), DATA, CONFIG))
    assert split_ == plain == {"collection": losses}


def test_a_reused_layer_is_regularized_once():
    assert_collects_like_one_device(reused_layer, 2)


def test_a_regularizer_that_is_not_additive_sees_the_whole_kernel():
    options = {"kernel_regularizer": frobenius, "bias_regularizer": frobenius}
    assert_equivalent(train(head(False, "legacy", **options), DATA),
                      train(head(True, "legacy", **options), DATA, CONFIG))


def test_a_norm_constraint_along_an_unsplit_axis_is_applied_per_shard():
    """MaxNorm(axis=0) normalises each output column: the column pattern keeps
    columns whole."""
    options = {"kernel_constraint": tf.keras.constraints.MaxNorm(0.5, axis=0)}
    assert plan_of(head(True, "keras", **options), CONFIG).task_graphs[-1].patterns[
        "logits"] == "column"
    assert_equivalent(train(head(False, "keras", **options), DATA),
                      train(head(True, "keras", **options), DATA, CONFIG))


def test_a_constraint_steers_the_matcher_to_the_pattern_it_allows():
    """UnitNorm(axis=1) normalises rows of the kernel: column (cheaper here)
    would split them, so the row pattern is chosen."""
    options = {"kernel_constraint": tf.keras.constraints.UnitNorm(axis=1)}
    assert plan_of(head(True, "legacy", **options), CONFIG).task_graphs[-1].patterns[
        "logits"] == "row"
    assert_equivalent(train(head(False, "legacy", **options), DATA),
                      train(head(True, "legacy", **options), DATA, CONFIG))


@pytest.mark.parametrize("options,config,message", [
    ({"kernel_constraint": tf.keras.constraints.MaxNorm(1.0, axis=[0, 1])}, CONFIG,
     r"layer 'logits'.*kernel_constraint MaxNorm\(max_value=1.0, axis=\[0, 1\]\)"),
    ({"kernel_constraint": lambda w: w / tf.reduce_max(w)}, CONFIG,
     r"layer 'logits'.*kernel_constraint <lambda>"),
    ({"bias_constraint": tf.keras.constraints.UnitNorm(axis=0)},
     {**CONFIG, "split.patterns": {"logits": "column"}},
     r"layer 'logits'.*bias_constraint UnitNorm\(axis=0\).*column splits bias axis 0"),
], ids=["norm-over-both-axes", "not-elementwise", "forced-pattern"])
def test_a_constraint_that_cannot_act_on_shards_is_refused(options, config, message):
    with pytest.raises(wh.ShardingError, match=message):
        plan_of(head(True, "keras", **options), config)


def test_a_get_variable_constraint_across_its_split_axis_is_refused():
    def build(x, y):
        with wh.split(2):
            v1.get_variable("w", shape=[6, 10],
                            constraint=tf.keras.constraints.MaxNorm(1.0, axis=0))
    with pytest.raises(wh.ShardingError, match=r"variable 'w': constraint MaxNorm"):
        plan_of(build, CONFIG)


def matmul_model(tfpar, record):
    """A dense layer and a weight made by get_variable (split by rows) in a split
    scope, under a variable scope with a non-additive default regularizer; the
    weight has an elementwise constraint. Loss = cross-entropy + the
    regularization collection (the scope's regularizer on fc/kernel, fc/bias, w)."""
    def build(x, y):
        rng = np.random.RandomState(3)
        with split(tfpar), v1.variable_scope("head", regularizer=frobenius):
            h = v1.layers.dense(x, 6, tf.nn.tanh, name="fc",
                                kernel_initializer=v1.constant_initializer(rng.randn(6, 6) / 3))
            w = v1.get_variable("w", initializer=(rng.randn(6, 10) / 3).astype(np.float32),
                                constraint=clip)
            loss = v1.losses.sparse_softmax_cross_entropy(y, tf.matmul(h, w))
            loss = loss + v1.losses.get_regularization_loss()
        record["collection"] = len(v1.losses.get_regularization_losses())
        return loss, keras_sgd_step(loss)
    return build


def test_get_variable_keeps_its_scope_regularizer_and_constraint():
    assert_collects_like_one_device(matmul_model, 3)


def scoped_head(tfpar, devices=None):
    """A dense layer and a get_variable weight under variable scopes named like
    partitioned-variable slices (``net/part_1``); ``devices`` collects the
    device of every sharded variable."""
    def build(x, y):
        rng = np.random.RandomState(2)
        with split(tfpar), v1.variable_scope("net"), v1.variable_scope("part_1"):
            logits = v1.layers.dense(
                x, 10, name="logits",
                kernel_initializer=v1.constant_initializer(rng.randn(6, 10) / 3))
            w = v1.get_variable("w", initializer=(rng.randn(10, 10) / 3).astype(np.float32))
            logits = tf.matmul(tf.tanh(logits), w)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        if devices is not None:
            for v in v1.trainable_variables():
                whole = v._save_slice_info.full_name  # pylint: disable=protected-access
                devices.setdefault(whole, []).append(v.op.device.rsplit(":", 1)[-1])
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def test_shards_are_placed_by_their_slice_not_their_name():
    devices = {}
    assert_equivalent(train(scoped_head(False), DATA),
                      train(scoped_head(True, devices), DATA, CONFIG))
    assert devices == {"net/part_1/logits/kernel": ["0", "1"],
                       "net/part_1/logits/bias": ["0", "1"],
                       "net/part_1/w": ["0", "1"]}
