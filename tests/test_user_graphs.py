"""Graphs as users write them (issue 12): control flow in the loss path, Keras
optimizers' variable names, queue-based input."""

import numpy as np
import pytest
import tensorflow as tf

from equivalence import (assert_equivalent, dense, fed_graph, make_data, train,
                         variable_values)

import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=8)


def control_flow(x, y):
    """tf.cond on a `training` placeholder and a tf.while_loop in the loss path
    (their gradients are If / While ops whose functions call tf.gradients)."""
    training = v1.placeholder_with_default(True, [])
    h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
    h = tf.cond(training, lambda: h * 2.0, lambda: h)
    _, h = tf.while_loop(lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(a) * 1.1), [0, h])
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", seed=2))
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def dynamic_rnn(x, y):
    """An LSTM over 3 steps of 2 features (tf.compat.v1.nn.dynamic_rnn: a while loop)."""
    cell = v1.nn.rnn_cell.LSTMCell(5, initializer=v1.constant_initializer(0.1))
    outputs, _ = v1.nn.dynamic_rnn(cell, tf.reshape(x, [-1, 3, 2]), dtype=tf.float32)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(outputs[:, -1], 3, "logits", seed=2))
    return loss, v1.train.AdamOptimizer(0.05).minimize(loss)


def frozen_batch_norm(x, y):
    """Batch norm driven by a `training` placeholder (inference statistics)."""
    training = v1.placeholder_with_default(False, [])
    h = v1.layers.batch_normalization(dense(x, 8, "hidden", seed=1), training=training)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(tf.nn.relu(h), 3, "logits", seed=2))
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


@pytest.mark.parametrize("build", [control_flow, dynamic_rnn, frozen_batch_norm],
                         ids=["cond-while", "dynamic-rnn", "batch-norm"])
def test_control_flow_in_the_loss_path(build):
    """Before: `TypeError: Tensor is unhashable` (the If / While gradients' own
    seeds overwrote the outer tf.gradients call's)."""
    assert_equivalent(train(build, DATA), train(build, DATA, {"cluster.num_devices": 4}),
                      rtol=1e-4, atol=1e-6)


def keras_variable_names(config):
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init(config)
        model = tf.keras.Sequential([tf.keras.layers.Dense(3, input_shape=(6,))])
        model.compile(tf.keras.optimizers.legacy.Ftrl(0.1), "mse")
        model.fit(DATA[0][0], np.ones((8, 3), np.float32), batch_size=8, verbose=0)
        names = sorted(v.op.name for v in v1.global_variables())
    if config:
        wh.reset()
    return names


def test_keras_optimizer_variables_keep_their_names():
    """Before: the step counter became `training/iter` instead of
    `training/Ftrl/iter` (tfpar read it before keras opened its name scope),
    so checkpoints were not interchangeable."""
    plain = keras_variable_names(None)
    assert any(name.endswith("Ftrl/iter") for name in plain)
    assert keras_variable_names({"cluster.num_devices": 2}) == plain


def test_queue_based_input_is_named_with_the_alternative():
    """tf.train.batch fixes the batch size in the graph: refused by name,
    pointing at tf.data (before: "found no batch input")."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2})
        x1, y1 = v1.train.slice_input_producer(
            [DATA[0].reshape(-1, 6), DATA[1].reshape(-1)], shuffle=False)
        x, y = v1.train.batch([x1, y1], batch_size=8)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(x, 3, "logits", seed=2))
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        with pytest.raises(wh.PlanError, match=r"'batch:0' \(QueueDequeueManyV2\) has the "
                                               r"static batch size 8.*read the data with tf.data"):
            with v1.train.MonitoredTrainingSession() as sess:
                sess.run(train_op)
    wh.reset()


def test_init_after_the_model_is_built_says_so(fallbacks):
    """Before: the graph ran unchanged on one device while current_plan() showed
    a 4-way replicate, without a word."""
    graph = tf.Graph()
    with graph.as_default():
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(x, 3, "logits", seed=2))
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        wh.init({"cluster.num_devices": 4})
        with pytest.raises(wh.PlanError, match="built before wh.init"):
            wh.current_plan()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {x: DATA[0][0], y: DATA[1][0]})
    wh.reset()
    assert "it was built before wh.init(), so tfpar did not see it" in fallbacks.getvalue()
    assert "GradientDescent" in fallbacks.getvalue()


def test_init_twice_names_what_changed(tfpar_log):
    wh.init({"cluster.num_devices": 2})
    wh.init({"cluster.num_devices": 4})
    assert "wh.init() called again" in tfpar_log.getvalue()
    assert "cluster.num_devices: 2 -> 4" in tfpar_log.getvalue()


def keras_weights_set_early(config, before_compile=False):
    """get_weights / set_weights run Keras' session before fit builds its step
    (``before_compile``: before the model is compiled, as a weights= file or
    load_weights before compile do)."""
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init(config)
        model = tf.keras.Sequential([tf.keras.layers.Dense(8, "tanh", input_shape=(6,)),
                                     tf.keras.layers.Dense(3)])

        def set_weights():
            model.set_weights([np.full(w.shape, 0.1, np.float32) for w in model.get_weights()])
        if before_compile:
            set_weights()
        model.compile(tf.keras.optimizers.legacy.SGD(0.5),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        if not before_compile:
            set_weights()
        history = model.fit(DATA[0].reshape(-1, 6), DATA[1].reshape(-1), batch_size=8,
                            shuffle=False, verbose=0)
        values = dict(zip((w.name for w in model.weights), model.get_weights()))
    if config:
        wh.reset()
    return np.array(history.history["loss"]), values


def test_keras_session_run_before_fit_still_trains_in_parallel():
    """Before: Keras ran its session (get_weights, set_weights, a dataset
    iterator's initializer) before fit built the training step, TensorFlow
    ignored the rewrite of the nodes it had ("This mutation will have no
    effect") and the step failed with a shape error inside TF. tfpar now builds
    a compiled model's training function before Keras first runs its session."""
    assert_equivalent(keras_weights_set_early(None),
                      keras_weights_set_early({"cluster.num_devices": 4}))


def trained_after_an_early_run(config):
    """Plain TF: the session initializes and evaluates the model, then the
    optimizer is built and trained in the same session."""
    with fed_graph(config) as (_, x, y):
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(x, 3, "logits", seed=2))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run(loss, {x: DATA[0][0], y: DATA[1][0]})]
            train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss)
            losses += [sess.run([loss, train_op], {x: a, y: b})[0] for a, b in zip(*DATA)]
            values = variable_values(sess, v1.global_variables())
    return np.array(losses), values


def test_a_session_that_ran_before_the_training_step_trains_in_parallel():
    """Before: refused (TensorFlow keeps the nodes a session was sent, so the
    rewrite could not take effect there). The session is now reopened on the
    rewritten graph with its variables' values, and tfpar says so (the state
    of iterators and lookup tables starts anew)."""
    reference = trained_after_an_early_run(None)
    with pytest.warns(wh.FallbackWarning, match="is reopened on the parallel graph with its 2 "
                      "variables' values; the state of the iterators and lookup tables"):
        assert_equivalent(reference, trained_after_an_early_run({"cluster.num_devices": 4}))
    with pytest.raises(wh.PlanError, match="is reopened on the parallel graph"):
        trained_after_an_early_run({"cluster.num_devices": 4, "strict": True})
    wh.reset()


def test_keras_weights_set_before_compile_are_carried_into_the_parallel_session():
    reference = keras_weights_set_early(None, before_compile=True)
    with pytest.warns(wh.FallbackWarning, match="is reopened on the parallel graph"):
        parallel = keras_weights_set_early({"cluster.num_devices": 4}, before_compile=True)
    assert_equivalent(reference, parallel)


def test_ragged_tensors_from_an_iterator_are_refused_by_name():
    """A ragged element arrives from the iterator as one variant tensor, which
    tfpar cannot cut by rows (SparseTensors it can: ``test_sparse_inputs``)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2})
        rows = tf.ragged.constant([[1.0, 2.0], [3.0], [4.0, 5.0, 6.0], []] * 2)
        ds = tf.data.Dataset.from_tensor_slices((rows, DATA[1][0])).batch(8).repeat()
        ragged, y = v1.data.make_one_shot_iterator(ds).get_next()
        features = tf.stack([tf.reduce_sum(ragged, 1), tf.cast(ragged.row_lengths(), tf.float32)], 1)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(features, 3, "logits", seed=2))
        train_op = v1.train.AdagradOptimizer(0.5).minimize(loss)
        with v1.Session() as sess:
            with pytest.raises(wh.PlanError, match="'IteratorGetNext:0' .* composite tensor"):
                sess.run(v1.global_variables_initializer())
                sess.run(train_op)
    wh.reset()


def keras_fit_with_a_short_last_batch(config):
    """62 rows in batches of 30: the last batch has 2 rows, fewer than 4 replicas."""
    rng = np.random.RandomState(0)
    x, y = rng.randn(62, 6).astype(np.float32), rng.randint(0, 3, 62)
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init(config)
        model = tf.keras.Sequential([
            tf.keras.layers.Dense(8, "tanh", input_shape=(6,),
                                  kernel_initializer=tf.keras.initializers.Constant(0.1)),
            tf.keras.layers.Dense(3, kernel_initializer=tf.keras.initializers.Constant(0.2))])
        model.compile(tf.keras.optimizers.legacy.SGD(0.5),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        history = model.fit(x, y, batch_size=30, epochs=2, shuffle=False, verbose=0).history
        values = dict(zip((w.name for w in model.weights), model.get_weights()))
    if config:
        wh.reset()
    return np.array(history["loss"] + history["accuracy"]), values


def test_a_last_batch_smaller_than_the_replicas_trains_like_one_device():
    """Before: a TF assertion repeated per replica killed the step. Replicas
    that get no rows contribute nothing (weight 0)."""
    assert_equivalent(keras_fit_with_a_short_last_batch(None),
                      keras_fit_with_a_short_last_batch({"cluster.num_devices": 4}))
