"""Saying what ran instead of what was asked (issue 44): every fallback is a
``tfpar.FallbackWarning`` and a note of the plan, and a ``PlanError`` under
``strict: true``; what cannot run correctly is refused."""
import contextlib
import os
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfpar as wh
from equivalence import assert_equivalent, dense, fed_graph, make_data, plan_of, train
import warm_python

v1 = tf.compat.v1


def fetch_after_a_step(config, fetch):
    """``fetch(x)`` of an MLP's step fetched with its train op; returns (the
    value, the plan's notes)."""
    fetched = []

    def build(x, y):
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(x, 3, "logits", 2))
        fetched.append(fetch(x))
        return [loss, fetched[0]], v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    values, notes = _build_and_run(build, config)
    return values[0][1], notes


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


# --- every fallback, under strict: true ---------------------------------------------------

def _build_and_run(build, config, rows=8):
    """Build ``build(x, y)`` (returning what to fetch and the train op) under
    ``config`` and run its initializer (the rewrite) and one step; returns
    (what the step fetched, the plan's notes)."""
    with fed_graph(config) as (_, x, y):
        fetches, train_op = build(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            values = sess.run([fetches, train_op], {x: np.ones((rows, 6)), y: np.zeros(rows)})
        return values, wh.current_plan().notes


def _mlp(stages=1, scope=None, name="h"):
    """build(x, y): ``stages`` dense layers, each in ``scope()`` if given."""
    def build(x, y):
        h = x
        for s in range(stages):
            with scope() if scope else contextlib.nullcontext():
                h = dense(h, 4, f"{name}{s}", s, tf.nn.tanh)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, f"{name}_logits", 9))
        return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    return build


def _unreadable_loss(x, y):
    """A loss tfpar cannot tell a mean or a sum over the batch: the first
    row's logits, by a slice."""
    loss = tf.reduce_mean(dense(x, 3, "logits", 2)[0])
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def _recomputed_scope_without_gradient(x, y):
    """memory.recompute names a scope whose output the loss does not read."""
    with v1.variable_scope("unused"):
        tf.identity(dense(x, 4, "side", 1))
    return _mlp()(x, y)


def _masked_synchronized_batch_norm(x, y):
    bn = tf.keras.layers.BatchNormalization(synchronized=True)
    h = bn(dense(x, 4, "h", 1), training=True, mask=tf.ones_like(x[:, 0], tf.bool))
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", 2))
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def _whole_einsum_dense(x, y):
    with wh.split(2):
        h = tf.keras.layers.EinsumDense("ab,b->ab", [6])(x)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", 2))
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def _one_head_attention(x, y):
    rows = tf.reshape(x, [-1, 2, 3])
    with wh.split(2):
        h = tf.keras.layers.MultiHeadAttention(num_heads=1, key_dim=4)(rows, rows)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(tf.reshape(h, [-1, 6]), 3, "l", 2))
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def _split_layer_norm(x, y):
    """A split scope holding nothing tfpar shards: a LayerNormalization alone."""
    with wh.split(2):
        h = tf.keras.layers.LayerNormalization(name="norm")(x)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", 2))
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


FALLBACKS = {
    "split with nothing to shard": (_split_layer_norm, {"cluster.num_devices": 2},
                                    "nothing in it is a layer or op tfpar shards"),
    "loss kind": (_unreadable_loss, {"cluster.num_devices": 2},
                  "cannot tell whether it is a mean or a sum"),
    "recompute": (_recomputed_scope_without_gradient,
                  {"cluster.num_devices": 1, "memory.recompute": ["unused"]},
                  "memory.recompute asked to recompute scope 'unused'"),
    "synchronized with a mask": (_masked_synchronized_batch_norm, {"cluster.num_devices": 2},
                                 "is synchronized and called with a mask"),
    "whole EinsumDense": (_whole_einsum_dense, {"cluster.num_devices": 2},
                          "it runs whole on"),
    "attention on gathered heads": (_one_head_attention, {"cluster.num_devices": 2},
                                    "by heads: it runs once on"),
    "shared devices": (_mlp(3, lambda: wh.replicate(1)),
                       {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
                       "they share devices"),
    "idle device": (_mlp(2, lambda: wh.replicate(1)),
                    {"cluster.num_devices": 3, "pipeline.num_micro_batch": 2}, "left idle"),
    "even rows in several processes": (
        _mlp(), {"cluster.num_devices": 2, "communication.backend": "horovod",
                 "cluster.hardware": ["V100-32GB", "P100-16GB"]},
        "the replicas take even rows: in a job of several processes"),
    "online tuning in Horovod": (
        _mlp(2, lambda: wh.replicate(1)),
        {"cluster.num_devices": 2, "communication.backend": "horovod",
         "pipeline.num_micro_batch": 2, "pipeline.schedule": "kfkb",
         "pipeline.group_size": "auto"}, "k stays 1 as planned: each Horovod process"),
}


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.horovod)
                                  if "horovod" in str(FALLBACKS[case][1]) else case
                                  for case in FALLBACKS])
def test_each_fallback_is_warned_noted_and_refused_under_strict(case):
    build, config, said = FALLBACKS[case]
    with pytest.warns(wh.FallbackWarning, match=f".*{said}"):
        notes = _build_and_run(build, config)[1]
    assert any(said in note for note in notes), notes
    with pytest.raises(wh.PlanError, match=f".*{said}.*strict: true makes this an error"):
        _build_and_run(build, {**config, "strict": True})
    wh.reset()


def unshardable(block, tfpar):
    """build(x, y): ``block(x)`` in ``wh.split(4)`` (``tfpar``; else no
    scope), then a dense head."""
    def build(x, y):
        with wh.split(4) if tfpar else contextlib.nullcontext():
            h = block(x)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", 2))
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def conv_and_pooling(x):
    """A Conv2D (numpy initial values) and max pooling on x seen as 4x4x3 images."""
    kernel = np.random.RandomState(1).randn(3, 3, 3, 4).astype(np.float32) * 0.3
    h = tf.keras.layers.Conv2D(4, 3, padding="same", name="conv",
                               kernel_initializer=tf.constant_initializer(kernel))(
                                   tf.reshape(x, [-1, 4, 4, 3]))
    return tf.reshape(tf.keras.layers.MaxPooling2D()(h), [-1, 16])


@pytest.mark.parametrize("block", [lambda: conv_and_pooling,
                                   lambda: tf.keras.layers.LayerNormalization(name="norm")],
                         ids=["conv_pooling", "layer_norm"])
def test_a_split_scope_with_nothing_to_shard_is_replicated_with_one_devices_numbers(
        block, fallbacks):
    """Issue 64 item 1: before, wh.split(4) around a Conv2D and pooling, or a
    LayerNormalization alone, trained at data-parallel degree 1 on 4 devices
    (the whole model on the first), silently, even under strict. Now what it
    holds is replicated over its devices (the plan says so, and strict
    refuses it), with the numbers of one device."""
    def make(tfpar):
        return unshardable(block(), tfpar)
    config = {"cluster.num_devices": 4}
    data = make_data(steps=3, batch=8, features=48)
    assert_equivalent(train(make(False), data), train(make(True), data, config))
    plan = plan_of(make(True), config, shape=(None, 48))
    assert [(tg.strategy, len(tg.replicas)) for tg in plan.task_graphs] == [("replicate", 4)]
    assert plan.data_parallel_degree == 4
    assert any("'split_0', to shard its layers over 4 devices: nothing in it is a layer or op "
               "tfpar shards" in note and "it is replicated instead" in note
               for note in plan.notes), plan.notes
    assert "it is replicated instead" in fallbacks.getvalue()
    with pytest.raises(wh.PlanError, match="nothing in it is a layer or op tfpar shards"):
        plan_of(make(True), {**config, "strict": True}, shape=(None, 48))


def test_a_split_scope_that_only_makes_a_split_variable_stays_split():
    """A get_variable in a split scope is made in shards (read whole outside
    it): something is sharded, so the scope is not replicated, and nothing
    is said (a FallbackWarning would fail this test)."""
    def build(x, y):
        with wh.split(2):
            w = v1.get_variable("w", initializer=np.ones((6, 3), np.float32))
        loss = v1.losses.sparse_softmax_cross_entropy(y, tf.matmul(x, w))
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    plan = plan_of(build, {"cluster.num_devices": 2})
    assert [tg.strategy for tg in plan.task_graphs] == ["split"] and not plan.notes


def test_graphs_built_before_init_and_gradients_built_after_the_rewrite_under_strict():
    """Both run as built, on one device: refused under strict."""
    with tf.Graph().as_default():
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int64, [None])
        _, train_op = _mlp()(x, y)
        wh.init({"cluster.num_devices": 2, "strict": True})
        with v1.Session() as sess, pytest.raises(wh.PlanError, match="built before wh.init"):
            sess.run(v1.global_variables_initializer())
    wh.reset()
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2, "strict": True})
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int64, [None])
        _, first = _mlp(name="first")(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(first, {x: np.ones((4, 6)), y: np.zeros(4)})
            _, second = _mlp(name="second")(x, y)
            with pytest.raises(wh.PlanError, match="built after tfpar rewrote this graph"):
                sess.run(second, {x: np.ones((4, 6)), y: np.zeros(4)})
    wh.reset()


def test_tf2_fallbacks_are_refused_under_strict():
    """Eager gradients (one device, as without tfpar) and a scope around
    eager code (nothing) are PlanErrors under strict."""
    with context.eager_mode():
        wh.init({"cluster.num_devices": 2, "strict": True})
        w = tf.Variable(tf.ones([4, 2]))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w)
        with pytest.raises(wh.PlanError, match="eager code, data parallel over 2 devices: it "
                                               "trains on one device"):
            tape.gradient(loss, w)
        with pytest.raises(wh.PlanError, match=r"split\(2\) around eager code"):
            with wh.split(2):
                tf.constant(1.0) + 1.0
    wh.reset()


def test_a_legacy_optimizers_split_slots_are_refused_under_strict():
    """In a TF2 step (a fresh process: the logical devices), strict refuses
    what a checkpoint would miss."""
    code = ("import tensorflow as tf\nimport tfpar as wh\n"
            "wh.init({'cluster.num_devices': 2, 'strict': True})\n"
            "head, opt = tf.keras.layers.Dense(4), tf.keras.optimizers.legacy.Adam()\n"
            "@tf.function\ndef step(x):\n"
            "    with tf.GradientTape() as tape:\n"
            "        with wh.split(2):\n"
            "            loss = tf.reduce_sum(head(x))\n"
            "    opt.apply_gradients(zip(tape.gradient(loss, head.trainable_variables),"
            " head.trainable_variables))\n"
            "step(tf.ones([8, 4]))\n")
    done = warm_python.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode != 0
    assert "PlanError: tfpar: checkpoints of legacy optimizer 'Adam' to hold its slots" \
        in done.stderr, done.stderr[-3000:]
