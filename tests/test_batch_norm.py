"""Variables a training step writes from their own values (BatchNorm's moving
statistics) under replicas and micro-batches (issue 48, item 1).

Before: every replica and micro-batch applied its own update to the one
variable, so the statistics moved R times too far on R replicas, and on the
fused kernel's path (an assign) the replicas raced: two identical runs gave
different statistics. The rule now is MirroredStrategy's for Keras' ON_READ /
MEAN variables: each version updates a copy of its own; once per step the
variable takes the copies averaged by their batch shares.

References: MirroredStrategy itself (a TF2 subprocess), and, in graph mode,
the same model in plain TensorFlow with ghost batch norm (each ghost batch
normalized alone, the statistics updated with the ghosts' mean), fed the rows
so that each ghost batch holds one replica's rows.
"""
import os
import sys
import warnings
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.training import moving_averages

import tfpar as wh
from batch_norm_script import mobilenet_v2, trained
from equivalence import assert_equivalent, variable_values
from proof import assert_parallel
import warm_python

v1 = tf.compat.v1
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "batch_norm_script.py")
BENCHMARK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "benchmark_step_script.py")
ROWS, STEPS, GHOSTS = 16, 3, 4


def test_mobilenet_v2_statistics_follow_mirrored_strategy_in_tf2_and_graph_mode():
    """keras.applications' MobileNetV2 (52 fused BatchNorm layers in training
    mode) trained by ``fit`` on 2 devices: in TF2 and in graph mode, losses,
    accuracy, every variable (moving statistics included) and every momentum
    slot are MirroredStrategy's on 2 devices."""
    runs = started({"mirrored": ("mirrored", "2", "mobilenet_v2"),
                    "tfpar": ("tfpar", "2", "mobilenet_v2")})
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        graph_mode = trained(mobilenet_v2(), tf.keras.backend.batch_get_value)
    wh.reset()
    assert_parallel()
    results = finished(runs)
    reference = results["mirrored"]
    assert {f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)} <= set(
        results["tfpar"]["devices"]), "the TF2 step did not run on both devices"
    moving = [name for name in reference["variables"] if "moving_mean" in name]
    assert len(moving) == 52
    for got in (results["tfpar"], graph_mode):
        assert_same_fit(reference, got)


def started(runs, script=SCRIPT):
    """``script``'s (``batch_norm_script.py``) runs, by name, started side by side."""
    return {name: warm_python.start([sys.executable, script, *args])
            for name, args in runs.items()}


def finished(runs):
    """What each run of ``started`` printed, once it ended."""
    results = {}
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-3000:]
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def assert_same_fit(reference, got):
    """Same losses, accuracy, variables and slots."""
    np.testing.assert_allclose(got["losses"], reference["losses"], rtol=1e-5)
    assert got["accuracy"] == reference["accuracy"]
    assert list(got["variables"]) == list(reference["variables"])
    for name, value in reference["variables"].items():
        np.testing.assert_allclose(got["variables"][name], value, rtol=1e-4, atol=1e-6,
                                   err_msg=name)
    for got_slot, slot in zip(got["slots"], reference["slots"]):
        np.testing.assert_allclose(got_slot, slot, rtol=1e-4, atol=1e-6)


# --- graph mode against ghost batch norm -------------------------------------------------

def keras_batch_norm(ghosts, fused=False):
    """build(x, y): a dense layer, Keras' BatchNormalization in training mode
    (with ``ghosts`` ghost batches; ``fused``: the fused kernel, on the rows
    as images), a head; its updates run as tf.compat.v1 scripts run them, the
    train op built under ``control_dependencies(UPDATE_OPS)``."""
    def build(x, y):
        h = v1.layers.dense(x, 5, kernel_initializer=v1.constant_initializer(
            np.random.RandomState(1).randn(6, 5)), use_bias=False)
        h = tf.reshape(h, [-1, 1, 1, 5]) if fused else h
        h = v1.layers.batch_normalization(h, training=True, momentum=0.8, fused=fused,
                                          virtual_batch_size=ROWS // ghosts if ghosts > 1 else None)
        h = tf.reshape(h, [-1, 5])
        logits = v1.layers.dense(tf.nn.relu(h), 3, kernel_initializer=v1.constant_initializer(
            np.random.RandomState(2).randn(5, 3)))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        with tf.control_dependencies(v1.get_collection(v1.GraphKeys.UPDATE_OPS)):
            return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return build


def slim_batch_norm(ghosts):
    """build(x, y): batch norm written by hand as tf-slim writes it (its own
    get_variable statistics, declaring no aggregation; tf.nn.moments;
    ``assign_moving_average``) over ``ghosts`` contiguous ghost batches."""
    def build(x, y):
        h = tf.matmul(x, v1.get_variable("w", initializer=np.random.RandomState(1).randn(
            6, 4).astype(np.float32)))
        mean_var = v1.get_variable("moving_mean", [4], initializer=v1.zeros_initializer(),
                                   trainable=False)
        var_var = v1.get_variable("moving_variance", [4], initializer=v1.ones_initializer(),
                                  trainable=False)
        grouped = tf.reshape(h, [ghosts, -1, 4])
        mean, variance = tf.nn.moments(grouped, [1], keepdims=True)
        h = tf.reshape((grouped - mean) * tf.math.rsqrt(variance + 1e-3), [-1, 4])
        updates = [moving_averages.assign_moving_average(mean_var, tf.reduce_mean(mean, [0, 1]),
                                                         0.7, zero_debias=False),
                   moving_averages.assign_moving_average(
                       var_var, tf.reduce_mean(variance, [0, 1]), 0.7, zero_debias=False)]
        loss = v1.losses.sparse_softmax_cross_entropy(y, tf.matmul(h, v1.get_variable(
            "head", initializer=np.random.RandomState(2).randn(4, 3).astype(np.float32))))
        with tf.control_dependencies(updates):
            return loss, v1.train.GradientDescentOptimizer(0.2).minimize(loss)
    return build


def ghost_order(values):
    """Rows reordered so that Keras' ghost batch g (rows g, g + GHOSTS, ...)
    holds the rows of replica g (rows g * ROWS / GHOSTS, ...)."""
    return values.reshape(GHOSTS, ROWS // GHOSTS, *values.shape[1:]).swapaxes(0, 1).reshape(
        values.shape)


def train(build, config, reorder=False):
    """(losses, {variable: value}) of ``STEPS`` steps of ``build`` fed fixed
    batches of ``ROWS`` rows."""
    rng = np.random.RandomState(0)
    xs = rng.randn(STEPS, ROWS, 6).astype(np.float32) * 2 + 1
    ys = rng.randint(0, 3, (STEPS, ROWS)).astype(np.int64)
    with tf.Graph().as_default():
        if config is not None:
            wh.init(config)
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int64, [None])
        loss, train_op = build(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([loss, train_op], {x: ghost_order(a) if reorder else a,
                                                  y: ghost_order(b) if reorder else b})[0]
                      for a, b in zip(xs, ys)]
            # Ghost batch norm's parameters are shaped [1, 1, C].
            values = {name: np.squeeze(value)
                      for name, value in variable_values(sess, v1.global_variables()).items()}
    if config is not None:
        wh.reset()
    return np.array(losses), values


KERAS_PLANS = {
    "replicas": {"cluster.num_devices": GHOSTS},
    "mirrored replicas": {"cluster.num_devices": GHOSTS, "communication.backend": "collective"},
    "micro-batches": {"cluster.num_devices": 1, "pipeline.num_micro_batch": GHOSTS},
    "replicas x micro-batches": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
}


@pytest.mark.parametrize("plan", KERAS_PLANS)
def test_keras_batch_norm_updates_once_with_the_versions_statistics_averaged(plan):
    """tf.compat.v1.layers.batch_normalization (Keras' layer, non-fused),
    UPDATE_OPS under the train op: every variable, moving statistics and
    momentum slots included, is ghost batch norm's on one device."""
    reference = train(keras_batch_norm(GHOSTS), None, reorder=True)
    assert_equivalent(reference, train(keras_batch_norm(1), KERAS_PLANS[plan]))


def test_a_pipeline_stage_updates_its_statistics_once_per_step():
    """Batch norm in the second of two stages, 4 micro-batches (1F1B): its
    statistics move once per step, by the micro-batches' average."""
    def staged(ghosts):
        build = keras_batch_norm(ghosts)

        def in_stages(x, y):
            with wh.replicate(1):
                x = tf.identity(x)
            with wh.replicate(1):
                return build(x, y)
        return in_stages
    reference = train(keras_batch_norm(GHOSTS), None, reorder=True)
    assert_equivalent(reference, train(staged(1), {"cluster.num_devices": 2,
                                                   "pipeline.num_micro_batch": GHOSTS}))


def test_hand_written_batch_norm_without_a_declared_aggregation_is_averaged():
    """tf-slim-style statistics (get_variable, ``assign_moving_average``):
    their updates read their own value, so they are moving averages."""
    assert_equivalent(train(slim_batch_norm(GHOSTS), None),
                      train(slim_batch_norm(1), {"cluster.num_devices": GHOSTS}))


def test_fused_statistics_are_deterministic():
    """The fused kernel assigns its running mean: the replicas raced (two
    identical runs gave 2.0x and 2.65x the single-device movement). Two runs
    now agree bit for bit, and with ghost batch norm on one device: every
    variable but the moving variance, which the fused kernel moves by each
    replica's unbiased variance (n / (n - 1) = 4 / 3 its 4 rows' variance),
    so from 1 at momentum 0.8 it is 0.8^3 + 4 / 3 (ghost's - 0.8^3) after 3
    steps."""
    config = {"cluster.num_devices": GHOSTS}
    first, second = (train(keras_batch_norm(1, fused=True), config) for _ in range(2))
    for name, value in first[1].items():
        np.testing.assert_array_equal(second[1][name], value, err_msg=name)
    losses, ghost = train(keras_batch_norm(GHOSTS), None, reorder=True)
    rows, kept = ROWS // GHOSTS, 0.8 ** STEPS
    variance = "batch_normalization/moving_variance"
    expected = {**ghost, variance: kept + rows / (rows - 1) * (ghost[variance] - kept)}
    assert_equivalent((losses, expected), first)


def cond_written(x, y):
    """A variable declaring no aggregation, updated inside a tf.cond."""
    total = v1.get_variable("running", [], initializer=v1.zeros_initializer(), trainable=False)
    logits = v1.layers.dense(x, 3)
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    update = tf.cond(loss > 0, lambda: total.assign(0.5 * total + 0.5 * loss),
                     lambda: tf.identity(total))
    with tf.control_dependencies([update]):
        return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_a_variable_written_inside_a_cond_without_a_declared_aggregation_is_said():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with tf.Graph().as_default():
            wh.init({"cluster.num_devices": 2})
            x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int64, [None])
            loss, train_op = cond_written(x, y)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                sess.run(train_op, {x: np.ones((4, 6)), y: np.zeros(4)})
            notes = wh.current_plan().notes
        wh.reset()
    said = [str(w.message) for w in caught if issubclass(w.category, wh.FallbackWarning)]
    assert len(said) == 1 and "'running' is written inside If" in said[0], said
    assert "averaged" in said[0] and "tf.VariableAggregation.SUM" in said[0]
    assert said[0] in notes
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2, "strict": True})
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int64, [None])
        cond_written(x, y)
        with pytest.raises(wh.PlanError, match="'running' is written inside If"):
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
    wh.reset()


# --- synchronized batch norm ---------------------------------------------------------------

@pytest.mark.parametrize("config", [
    {"cluster.num_devices": GHOSTS, "batch_norm.sync": True},
    {"cluster.num_devices": GHOSTS, "batch_norm.sync": True, "communication.backend": "collective"},
    {"cluster.num_devices": 2, "batch_norm.sync": True, "pipeline.num_micro_batch": 1}],
    ids=["replicas", "mirrored replicas", "two replicas"])
def test_synchronized_batch_norm_gives_one_devices_numbers(config):
    """``batch_norm.sync``: statistics over every replica's rows, their
    gradients summed over the replicas too; losses, weights, statistics and
    slots are one device's. A layer asked to be fused computes unfused, as
    Keras' synchronized layers do, and keeps the fused kernel's moving
    variance (n / (n - 1) times the batch's, n over all replicas' rows; it
    kept the batch's, 16/15 times less than one device's movement)."""
    reference = train(keras_batch_norm(1, fused=True), None)
    assert_equivalent(reference, train(keras_batch_norm(1, fused=True), config))


def test_a_keras_synchronized_layer_in_tf2_gives_one_devices_numbers():
    """Keras' own ``BatchNormalization(synchronized=True)``, trained by ``fit``
    in TF2 on 2 devices: its statistics are over both replicas' rows, as
    under MirroredStrategy, which on one device's batch is one device's."""
    results = finished(started({"plain": ("plain", "1", "synchronized"),
                                "tfpar": ("tfpar", "2", "synchronized")}))
    assert {f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)} <= set(
        results["tfpar"]["devices"]), "the TF2 step did not run on both devices"
    assert_same_fit(results["plain"], results["tfpar"])


def test_synchronized_batch_norm_with_micro_batches_is_refused():
    """By the config, and by the rewrite for Keras' own synchronized layers."""
    with pytest.raises(wh.ConfigError, match="'batch_norm.sync' .* needs pipeline.num_micro"):
        wh.Config({"batch_norm.sync": True, "pipeline.num_micro_batch": 2})

    def synchronized(x, y):
        h = tf.keras.layers.BatchNormalization(synchronized=True)(v1.layers.dense(x, 4),
                                                                  training=True)
        loss = v1.losses.sparse_softmax_cross_entropy(y, v1.layers.dense(h, 3))
        return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(wh.PlanError, match="need pipeline.num_micro_batch 1, not 2"):
        train(synchronized, {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2})
    wh.reset()


def assert_benchmark_step_is_one_devices(model: str, rtol: float, atol: float) -> None:
    """``benchmark_step_script.py``'s ``model`` on 4 devices with
    ``batch_norm.sync``: every variable (weights, moving statistics, the
    optimizer's slots and iterations) is one device's; the step ran on all 4."""
    results = finished(started({"plain": ("0", model), "tfpar": ("4", model)}, BENCHMARK))
    plain, got = results["plain"], results["tfpar"]
    assert {f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)} <= set(
        got["devices"]), f"the step ran on {got['devices']}"
    assert list(got["variables"]) == list(plain["variables"])
    for name, value in plain["variables"].items():
        np.testing.assert_allclose(got["variables"][name], value, rtol=rtol, atol=atol,
                                   err_msg=name)


def test_horovods_benchmark_step_with_synchronized_batch_norm_gives_one_devices_numbers():
    """Horovod's synthetic benchmark (a step reading a batch made eagerly,
    returning nothing) on a convolution to a 1x1 map, BatchNormalization
    (fused on one device, 8 values per channel), ReLU6. Before: the moving
    statistics never moved (the step's control outputs ran each replica's
    update of its local copy, not their average into the variable), and the
    moving variance, once they did, moved 8/7 times less than one device's
    (the fused kernel keeps the variance with Bessel's correction)."""
    assert_benchmark_step_is_one_devices("conv", rtol=1e-5, atol=1e-7)


@pytest.mark.slow
def test_mobilenet_v2_in_horovods_benchmark_step_with_synchronized_batch_norm():
    """Issue 60 item 7: keras.applications' MobileNetV2 (52 BatchNorm layers;
    width multiplier 0.35) at 32x32 in the same step, in float64: every
    variable is one device's.
    (In float32 one device's numbers are out of reach for any other order of
    sums: a ReLU6 input within rounding of 0 takes or drops its gradient, and
    one such flip, in plain TensorFlow with an input 1 ulp away, moved most
    weights by about 1% in one step.)"""
    assert_benchmark_step_is_one_devices("mobilenet_v2", rtol=1e-6, atol=1e-9)
