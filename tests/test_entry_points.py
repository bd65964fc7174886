"""Equivalence through the ways TF 2.15 users train in graph mode: tf.estimator,
Keras (Session loop and model.fit), MonitoredTrainingSession with hooks; each
with data parallelism, a 2-stage pipeline and a split head."""
import contextlib
import glob
import os

import numpy as np
import pytest
import tensorflow as tf

from proof import assert_parallel
from equivalence import assert_equivalent, assert_same_variables, dense, variable_values

import tfpar as wh

v1 = tf.compat.v1
RNG = np.random.RandomState(0)
X = RNG.randn(32, 6).astype(np.float32)
Y = RNG.randint(0, 10, 32).astype(np.int64)
BATCH = 8

CONFIGS = {
    "dp": {"cluster.num_devices": 2},
    "pipeline": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
    "split": {"cluster.num_devices": 2},
}
MODES = list(CONFIGS)


def head_kernel():
    return (np.random.RandomState(2).randn(8, 10) / 3).astype(np.float32)


def classifier(x, y, mode):
    """features -> 10 logits -> (mean cross-entropy, logits); ``mode`` None is
    plain TF, else where the tfpar scopes go."""
    first = wh.replicate(1) if mode == "pipeline" else contextlib.nullcontext()
    second = {"pipeline": lambda: wh.replicate(1),
              "split": lambda: wh.split(2)}.get(mode, contextlib.nullcontext)()
    with first:
        h = dense(x, 8, "features", seed=1, activation=tf.nn.tanh)
    with second:
        logits = v1.layers.dense(h, 10, name="logits",
                                 kernel_initializer=v1.constant_initializer(head_kernel()))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits) if y is not None else None
    return loss, logits


def variables_of(estimator):
    return {n: estimator.get_variable_value(n) for n in estimator.get_variable_names()
            if "global_step" not in n}


# --- tf.estimator ---------------------------------------------------------------

def model_fn(features, labels, mode, params):
    loss, logits = classifier(features["x"], labels, params["tfpar"])
    if mode == tf.estimator.ModeKeys.PREDICT:
        return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
    train_op = v1.train.GradientDescentOptimizer(0.5).minimize(
        loss, global_step=v1.train.get_global_step())
    accuracy = v1.metrics.accuracy(labels, tf.argmax(logits, 1))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      eval_metric_ops={"accuracy": accuracy})


def input_fn():
    return tf.data.Dataset.from_tensor_slices(({"x": X}, Y)).batch(BATCH)


def estimator(model_dir, tfpar_mode, **run_config):
    config = tf.estimator.RunConfig(model_dir=model_dir, tf_random_seed=0, **run_config)
    return tf.estimator.Estimator(model_fn, config=config, params={"tfpar": tfpar_mode})


@contextlib.contextmanager
def tfpar_on(mode):
    """wh.init for ``mode`` (None: plain TF), undone afterwards."""
    if mode is not None:
        wh.init(CONFIGS[mode])
    try:
        yield
    finally:
        if mode is not None:
            wh.reset()


@pytest.mark.estimator
@pytest.mark.parametrize("mode", MODES)
def test_estimator_train_evaluate_predict(mode, tmp_path):
    runs = {}
    for name, tfpar_mode in (("plain", None), ("tfpar", mode)):
        with tfpar_on(tfpar_mode):
            est = estimator(str(tmp_path / name), tfpar_mode, log_step_count_steps=1,
                            save_checkpoints_steps=2)
            est.train(input_fn)
            metrics = est.evaluate(input_fn)
            logits = np.stack([p["logits"] for p in est.predict(input_fn)])
            runs[name] = (metrics, logits, variables_of(est))
    plain, tfpar = runs["plain"], runs["tfpar"]
    assert tfpar[0]["global_step"] == len(X) // BATCH
    np.testing.assert_allclose(tfpar[0]["loss"], plain[0]["loss"], rtol=1e-5)
    assert tfpar[0]["accuracy"] == plain[0]["accuracy"]
    np.testing.assert_allclose(tfpar[1], plain[1], rtol=1e-5, atol=1e-6)
    assert_same_variables(plain[2], tfpar[2])
    # RunConfig.save_checkpoints_steps=2 was honoured as plainly: steps 0, 2 and 4.
    assert checkpoint_steps(tmp_path / "tfpar") == checkpoint_steps(tmp_path / "plain") == [0, 2, 4]


def checkpoint_steps(model_dir):
    return sorted(int(p.rsplit("-", 1)[1].split(".")[0])
                  for p in glob.glob(str(model_dir / "model.ckpt-*.index")))


@pytest.mark.estimator
@pytest.mark.parametrize("mode", ["dp", "split"])
def test_estimator_checkpoints_interchange(mode, tmp_path):
    """A checkpoint written in parallel evaluates in a plain Estimator, and a plain
    one keeps training in parallel, exactly as it would plainly."""
    with tfpar_on(mode):
        estimator(str(tmp_path / "parallel"), mode).train(input_fn, steps=2)
    with tfpar_on(None):
        estimator(str(tmp_path / "plain"), None).train(input_fn, steps=2)
        plain_eval = estimator(str(tmp_path / "plain"), None).evaluate(input_fn)
        cross_eval = estimator(str(tmp_path / "parallel"), None).evaluate(input_fn)
    assert cross_eval["loss"] == pytest.approx(plain_eval["loss"], rel=1e-5)
    with tfpar_on(None):
        reference = estimator(str(tmp_path / "plain"), None)
        reference.train(input_fn, steps=2)
        expected = variables_of(reference)
    with tfpar_on(mode):
        continued = estimator(str(tmp_path / "parallel"), mode)
        continued.train(input_fn, steps=2)
        got = variables_of(continued)
    assert_same_variables(expected, got)


@pytest.mark.estimator
def test_train_and_evaluate(tmp_path):
    results = {}
    for name, mode in (("plain", None), ("tfpar", "dp")):
        with tfpar_on(mode):
            est = estimator(str(tmp_path / name), mode)
            metrics, _ = tf.estimator.train_and_evaluate(
                est, tf.estimator.TrainSpec(input_fn, max_steps=4),
                tf.estimator.EvalSpec(input_fn, steps=None, throttle_secs=0))
            results[name] = metrics
    assert results["tfpar"]["loss"] == pytest.approx(results["plain"]["loss"], rel=1e-5)
    assert_parallel()


# --- Keras --------------------------------------------------------------------------

def keras_model(mode):
    """A functional model: tfpar scopes around its layers like any TF code."""
    first = wh.replicate(1) if mode == "pipeline" else contextlib.nullcontext()
    second = {"pipeline": lambda: wh.replicate(1),
              "split": lambda: wh.split(2)}.get(mode, contextlib.nullcontext)()
    inputs = tf.keras.Input((6,))
    with first:
        h = tf.keras.layers.Dense(8, "tanh", name="features", kernel_initializer=tf.keras.
                                  initializers.Constant(np.random.RandomState(1).randn(6, 8)
                                                        .astype(np.float32) / 2))(inputs)
    with second:
        logits = tf.keras.layers.Dense(10, name="logits", kernel_initializer=v1.
                                       constant_initializer(head_kernel()))(h)
    return tf.keras.Model(inputs, logits)


def keras_fit(mode):
    graph = tf.Graph()
    with graph.as_default(), tfpar_on(mode):
        model = keras_model(mode)
        model.compile(tf.keras.optimizers.legacy.SGD(0.5),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        history = model.fit(X, Y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        evaluation = model.evaluate(X, Y, batch_size=BATCH, verbose=0)
        weights = variable_values(v1.keras.backend.get_session(), model.weights)
    return history.history, evaluation, weights


@pytest.mark.parametrize("mode", MODES)
def test_keras_fit_and_evaluate(mode):
    plain, tfpar = keras_fit(None), keras_fit(mode)
    np.testing.assert_allclose(tfpar[0]["loss"], plain[0]["loss"], rtol=1e-5)
    np.testing.assert_allclose(tfpar[0]["accuracy"], plain[0]["accuracy"])
    np.testing.assert_allclose(tfpar[1], plain[1], rtol=1e-5)
    assert_same_variables(plain[2], tfpar[2])


def keras_session_loop(mode, optimizer):
    """Keras layers trained by a Session loop with a v1 or keras legacy optimizer."""
    graph = tf.Graph()
    with graph.as_default(), tfpar_on(mode):
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        model = keras_model(mode)
        loss = v1.losses.sparse_softmax_cross_entropy(y, model(x))
        if optimizer == "v1":
            train_op = v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        else:
            opt = tf.keras.optimizers.legacy.Adam(0.01)
            grads = tf.gradients(loss, model.trainable_variables)
            train_op = opt.apply_gradients(zip(grads, model.trainable_variables))
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([loss, train_op], {x: X[i:i + BATCH], y: Y[i:i + BATCH]})[0]
                      for i in range(0, len(X), BATCH)]
            weights = variable_values(sess, model.trainable_variables)
    return np.array(losses), weights


@pytest.mark.parametrize("optimizer,rtol", [("v1", 1e-5), ("keras", 1e-4)])
@pytest.mark.parametrize("mode", MODES)
def test_keras_layers_in_a_session_loop(mode, optimizer, rtol):
    assert_equivalent(keras_session_loop(None, optimizer), keras_session_loop(mode, optimizer),
                      rtol=rtol)


# --- MonitoredTrainingSession with hooks --------------------------------------------

def monitored(mode, model_dir):
    """StopAtStepHook, LoggingTensorHook, CheckpointSaverHook, SummarySaverHook and
    a Scaffold with its own init op and saver."""
    graph = tf.Graph()
    logged = []
    with graph.as_default(), tfpar_on(mode):
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss, _ = classifier(x, y, mode)
        step = v1.train.get_or_create_global_step()
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss, global_step=step)
        v1.summary.scalar("loss", loss)
        scaffold = v1.train.Scaffold(init_op=v1.global_variables_initializer(),
                                     saver=v1.train.Saver(max_to_keep=10))
        hooks = [v1.train.StopAtStepHook(last_step=3),
                 v1.train.LoggingTensorHook({"loss": loss}, every_n_iter=1,
                                            formatter=lambda v: logged.append(v["loss"]) or ""),
                 v1.train.CheckpointSaverHook(model_dir, save_steps=1, scaffold=scaffold),
                 v1.train.SummarySaverHook(save_steps=1, output_dir=model_dir,
                                           summary_op=v1.summary.merge_all())]
        losses = []
        with v1.train.MonitoredTrainingSession(scaffold=scaffold, hooks=hooks,
                                               save_checkpoint_secs=None,
                                               save_summaries_steps=None) as sess:
            i = 0
            while not sess.should_stop():
                feed = {x: X[i:i + BATCH], y: Y[i:i + BATCH]}
                losses.append(sess.run([loss, train_op], feed)[0])
                i += BATCH
    summaries = [v.simple_value for path in glob.glob(os.path.join(model_dir, "events.*"))
                 for event in v1.train.summary_iterator(path) for v in event.summary.value
                 if v.tag == "loss"]
    return np.array(losses), np.array(logged), np.array(summaries)


@pytest.mark.parametrize("mode", MODES)
def test_monitored_training_session_hooks(mode, tmp_path):
    plain = monitored(None, str(tmp_path / "plain"))
    tfpar = monitored(mode, str(tmp_path / "tfpar"))
    assert len(tfpar[0]) == 3  # StopAtStepHook
    for got, expected in zip(tfpar, plain):  # losses, logged values, summaries
        np.testing.assert_allclose(got, expected, rtol=1e-5)
    assert_parallel()
    assert tf.train.latest_checkpoint(str(tmp_path / "tfpar")).endswith("-3")


@pytest.mark.estimator
def test_estimator_session_config_is_honoured(tmp_path, monkeypatch):
    """RunConfig.session_config reaches the session with tfpar's devices added."""
    from tfpar.runtime import engine
    seen = []
    original = engine.session_config

    def spy(config, graph=None):
        merged = original(config, graph)
        seen.append((config, merged))
        return merged
    monkeypatch.setattr(engine, "session_config", spy)
    user = v1.ConfigProto(intra_op_parallelism_threads=1, inter_op_parallelism_threads=2)
    with tfpar_on("dp"):  # the hooks look engine.session_config up at each session
        estimator(str(tmp_path), "dp", session_config=user).train(input_fn, steps=1)
    merged = [m for c, m in seen if c is not None and c.intra_op_parallelism_threads == 1]
    assert merged and merged[0].inter_op_parallelism_threads == 2
    assert merged[0].device_count["CPU"] == 2
    # Data parallelism without micro-batches: grappler optimizes the step graph.
    assert not merged[0].graph_options.rewrite_options.disable_meta_optimizer
