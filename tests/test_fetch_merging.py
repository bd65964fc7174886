"""Fetched values and trained weights equal one device's whatever the script
reduces over the batch: counts, sums, shapes, batch-sum losses (issue 20)."""
import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, dense, fed_graph, make_data, train
from proof import assert_parallel

import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(3, 8)


def fetched(config, micro=1):
    """Fetch reductions of a trained MLP's step; returns {name: value}."""
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init({**config, "pipeline.num_micro_batch": micro})
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        logits = dense(dense(x, 8, "hidden", 1, tf.nn.tanh), 3, "logits", 2)
        per_example = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
        loss = tf.reduce_mean(per_example)
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        fetches = {
            "correct": tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.int32)),
            "rows": tf.shape(x)[0],
            "loss_sum": tf.reduce_sum(per_example),
            "max_logit": tf.reduce_max(logits),
            "loss": loss,
        }
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            out = [sess.run([fetches, train_op], {x: a, y: b})[0] for a, b in zip(*DATA)]
    if config:
        wh.reset()
    return out


@pytest.mark.parametrize("devices,micro", [(4, 1), (2, 2)])
def test_fetched_counts_sums_and_shapes_are_global(devices, micro):
    """Counts and sums summed, shapes of the merged batch: before, an int count
    fetched replica 0's value (1 for 3), tf.shape(x)[0] gave 2 for 8 and a float
    sum was averaged (2.64 for 10.56)."""
    plain = fetched(None)
    parallel = fetched({"cluster.num_devices": devices}, micro)
    assert_parallel()
    for ref, got in zip(plain, parallel):
        assert got["correct"] == ref["correct"] and got["rows"] == ref["rows"] == 8
        for name in ("loss_sum", "max_logit", "loss"):
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, err_msg=name)


def kernel():
    return next(v for v in v1.trainable_variables() if v.op.name == "hidden/kernel")


def batch_sum_model(extra=None):
    """A loss summed over the batch (not averaged), optionally plus ``extra``."""
    def build(x, y):
        logits = dense(dense(x, 8, "hidden", 1, tf.nn.tanh), 3, "logits", 2)
        loss = tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                           logits=logits))
        if extra is not None:
            loss = loss + extra()
        return loss, v1.train.GradientDescentOptimizer(0.05).minimize(loss)
    return build


@pytest.mark.parametrize("config", [{"cluster.num_devices": 4},
                                    {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
                                    {"cluster.num_devices": 2, "communication.backend":
                                     "collective"}])
def test_batch_sum_loss_trains_like_one_device(config):
    """Before: each replica's gradient was weighted by its batch share as for a
    mean, and the fetched loss was averaged (3.07 for 12.28)."""
    build = batch_sum_model()
    assert_equivalent(train(build, DATA), train(build, DATA, config))


def test_batch_sum_loss_with_a_batch_independent_term_is_refused():
    """sum(rows) + penalty: no weighting of replicas reproduces its gradient."""
    build = batch_sum_model(lambda: 0.1 * tf.reduce_sum(tf.square(kernel())))
    with pytest.raises(wh.PlanError, match="cannot be split over replicas.*adds a sum over the"):
        train(build, DATA, {"cluster.num_devices": 2})


def test_mean_loss_plus_regularizer_trains_like_one_device():
    """mean(rows) + penalty is what most scripts write: weights n_u / N."""
    def build(x, y):
        logits = dense(dense(x, 8, "hidden", 1, tf.nn.tanh), 3, "logits", 2)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits) + 0.1 * tf.nn.l2_loss(kernel())
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    assert_equivalent(train(build, DATA), train(build, DATA, {"cluster.num_devices": 4}))


def test_a_fetched_tensor_with_its_batch_on_axis_1_is_joined_there():
    """[experts, batch, features] (an einsum moved the batch): the replicas'
    pieces are concatenated along axis 1, not 0."""
    def run(config):
        with fed_graph(config) as (_, x, y):
            gates = tf.nn.softmax(dense(x, 2, "gate", 1))
            dispatched = tf.einsum("be,bd->ebd", gates, x)
            loss = v1.losses.sparse_softmax_cross_entropy(
                y, dense(tf.reduce_sum(dispatched, 0), 3, "logits", 2))
            train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                return sess.run([dispatched, train_op], {x: DATA[0][0], y: DATA[1][0]})[0]
    plain = run(None)
    assert plain.shape == (2, 8, 6)
    np.testing.assert_allclose(run({"cluster.num_devices": 4}), plain, rtol=1e-5)
    assert_parallel()
