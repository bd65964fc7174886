"""Saying what ran instead of what was asked (issue 44): every fallback is a
``tfpar.FallbackWarning`` and a note of the plan, and a ``PlanError`` under
``strict: true``; what cannot run correctly is refused."""
import numpy as np
import pytest
import tensorflow as tf

import tfpar as wh
from equivalence import dense

v1 = tf.compat.v1


def fetch_after_a_step(config, fetch):
    """``fetch(x)`` of an MLP's step fetched with its train op; returns (the
    value, the plan's notes)."""
    with tf.Graph().as_default():
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(x, 3, "logits", 2))
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        fetched = fetch(x)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            value = sess.run([fetched, train_op], {x: np.ones((8, 6)), y: np.zeros(8)})[0]
        notes = wh.current_plan().notes
    wh.reset()
    return value, notes


def sampled(x):
    """A forward value drawn by a stateful op from the batch's mean: it cannot
    be recomputed on the merged batch."""
    return tf.random.poisson([2], tf.reduce_mean(tf.abs(x)), seed=1)


def test_a_fetch_that_cannot_be_recomputed_is_averaged_and_said():
    """Before: a warning in the tfpar log only."""
    with pytest.warns(wh.FallbackWarning, match="is its replicas' and micro-batches' values "
                      "averaged by their batch shares .*'random_poisson.*is stateful"):
        value, notes = fetch_after_a_step({"cluster.num_devices": 2}, sampled)
    assert value.shape == (2,) and any("fetching 'random_poisson" in note for note in notes)
    with pytest.raises(wh.PlanError, match="averaged by their batch shares"):
        fetch_after_a_step({"cluster.num_devices": 2, "strict": True}, sampled)
    wh.reset()


def test_an_integer_fetch_that_cannot_be_recomputed_is_refused():
    """Before: replica 0's count, under a warning that said it was merged by
    batch shares."""
    with pytest.raises(wh.PlanError, match="cannot give its single-device value"):
        fetch_after_a_step({"cluster.num_devices": 2}, lambda x: tf.random.categorical(
            tf.reduce_mean(x, 0, keepdims=True), 3, seed=1))
    wh.reset()


def test_devices_on_a_host_without_gpus_are_said():
    """Before: one device, or N logical CPUs sharing the cores, silently."""
    with tf.Graph().as_default(), pytest.warns(
            wh.FallbackWarning, match="cluster.num_devices unset, which means every GPU: no GPU "
            "is visible, so the script runs on one CPU device"):
        wh.init()
    with pytest.raises(wh.PlanError, match="runs on one CPU device"):
        wh.init({"strict": True})
    wh.reset()


def test_logical_cpu_devices_are_said_by_the_plan():
    """Before: N logical CPUs sharing the host's cores, silently."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 3})
        x = v1.placeholder(tf.float32, [None, 6])
        v1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(dense(x, 2, "d", 1)))
        summary = wh.current_plan().summary()
    wh.reset()
    assert "devices: logical CPU devices of one host, sharing its cores (no GPU is visible)" \
        in summary


def shard_in_one_process(config):
    """A step reading a tf.data iterator under ``config`` + io.shard_dataset."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2, "io.shard_dataset": True, **config})
        ds = tf.data.Dataset.from_tensor_slices((np.ones((16, 6), np.float32),
                                                 np.zeros(16, np.int64))).batch(8)
        x, y = v1.data.make_one_shot_iterator(ds).get_next()
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(x, 3, "logits", 2))
        v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        notes = wh.current_plan().notes
    wh.reset()
    return notes


def test_io_shard_dataset_in_one_process_is_said():
    """Before: ignored without a word."""
    with pytest.warns(wh.FallbackWarning, match="io.shard_dataset: this process runs alone"):
        notes = shard_in_one_process({})
    assert any("io.shard_dataset: this process runs alone" in note for note in notes)
    with pytest.raises(wh.PlanError, match="io.shard_dataset: this process runs alone"):
        shard_in_one_process({"strict": True})
    wh.reset()
