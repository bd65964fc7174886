"""Training steps as their users write them (issue 60), in graph mode: a GAN
whose step updates the discriminator, then trains the generator through the
updated discriminator; metric accumulators fed a step's mean; losses
normalised by a data-dependent count (a mask's sum). Each trained plainly and
with tfpar, every loss and variable compared, the plan proven."""
import contextlib
import functools

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, dense, make_data, train
from proof import assert_parallel

import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=10)


def gan(x, y, scope=contextlib.nullcontext):
    """Discriminator step, then a generator step reading the updated
    discriminator (``tf.control_dependencies``), as one train op; the
    latent vectors are a function of the rows (random draws differ per
    replica). Each call of the generator or the discriminator is made in
    ``scope()``. Returns both losses and the train op."""
    del y
    noise = tf.tanh(x[:, :4])

    def generator(z):
        with scope(), v1.variable_scope("generator", reuse=v1.AUTO_REUSE):
            return dense(dense(z, 8, "hidden", 1, tf.nn.relu), 6, "out", 2)

    def discriminator(rows):
        with scope(), v1.variable_scope("discriminator", reuse=v1.AUTO_REUSE):
            return dense(dense(rows, 8, "hidden", 3, tf.nn.relu), 1, "out", 4)

    def xent(labels, logits):
        return tf.reduce_mean(tf.nn.sigmoid_cross_entropy_with_logits(labels=labels,
                                                                      logits=logits))

    fake = generator(noise)
    rows = tf.shape(x)[0]
    labels = tf.concat([tf.ones([rows, 1]), tf.zeros([rows, 1])], 0)
    d_loss = xent(labels, discriminator(tf.concat([fake, x], 0)))
    d_vars = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "discriminator")
    g_vars = v1.get_collection(v1.GraphKeys.TRAINABLE_VARIABLES, "generator")
    d_train = v1.train.AdamOptimizer(0.01).minimize(d_loss, var_list=d_vars)
    with tf.control_dependencies([d_train]):
        g_loss = xent(tf.zeros([rows, 1]), discriminator(generator(noise)))
    g_train = v1.train.AdamOptimizer(0.01).minimize(g_loss, var_list=g_vars)
    return tf.stack([d_loss, g_loss]), g_train


@pytest.mark.parametrize("config", [
    {"cluster.num_devices": 4},
    {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
    {"cluster.num_devices": 2, "communication.backend": "collective"},
    {"cluster.num_devices": 2, "pipeline.task_functions": False}],
    ids=["dp4", "accumulate", "mirrored", "copies"])
def test_a_gan_step_updates_then_reads_the_updated_discriminator(config):
    """Before: ``InvalidArgumentError: ... nodes in a cycle`` (task functions
    held both losses' forward ops, which the first update waited on)."""
    reference = train(gan, DATA)
    assert not np.isclose(reference[0][0][0], reference[0][1][0]), "nothing trained"
    assert_equivalent(reference, train(gan, DATA, config), rtol=1e-5)


def test_a_gan_in_pipeline_stages_keeps_its_rounds():
    """Each call of the generator and the discriminator a pipeline stage (4
    stages on 4 devices), 2 micro-batches: both rounds run every micro-batch
    through the stages, the discriminator's update between them."""
    stages = functools.partial(gan, scope=lambda: wh.replicate(1))
    assert_equivalent(train(gan, DATA), train(stages, DATA, {
        "cluster.num_devices": 4, "pipeline.num_micro_batch": 2}), rtol=1e-5)


def tracked(x, y):
    """A tracker's total and count fed the step's mean loss, as Keras'
    ``Mean.update_state(loss)`` adds them (resource variables in the graph)."""
    logits = dense(dense(x, 8, "hidden", 1, tf.nn.tanh), 3, "logits", 2)
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    total, count = (v1.get_variable(name, [], initializer=v1.zeros_initializer(),
                                    use_resource=True, trainable=False)
                    for name in ("total", "count"))
    track = [total.assign_add(loss), count.assign_add(1.0)]
    return loss, tf.group(v1.train.AdamOptimizer(0.1).minimize(loss), *track)


def masked(weighted):
    """build(x, y): token losses of a 4-token sequence per row; the tokens of
    label 0 are padding. ``weighted``: the mask as ``tf.compat.v1.losses``'
    weights; else ``reduce_sum(loss * mask) / reduce_sum(mask)``."""
    def build(x, y):
        tokens = tf.reshape(tf.tile(y[:, None], [1, 4]) - tf.range(4, dtype=tf.int64), [-1])
        labels = tf.maximum(tokens, 0)
        logits = tf.reshape(dense(dense(x, 8, "hidden", 1, tf.nn.tanh), 12, "logits", 2),
                            [-1, 3])
        mask = tf.cast(tf.not_equal(labels, 0), tf.float32)
        if weighted:
            loss = v1.losses.sparse_softmax_cross_entropy(labels, logits, weights=mask)
        else:
            losses = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                    logits=logits)
            loss = tf.reduce_sum(losses * mask) / tf.reduce_sum(mask)
        return loss, v1.train.AdamOptimizer(0.1).minimize(loss)
    return build


@pytest.mark.parametrize("devices", [2, 4])
def test_a_tracker_adds_what_one_device_adds(devices):
    """10 rows on 4 devices: before, each replica added its own mean with
    weight 1 (count 4 per step, and the total's mean off by the uneven
    split)."""
    assert_equivalent(train(tracked, DATA),
                      train(tracked, DATA, {"cluster.num_devices": devices}), rtol=1e-5)


@pytest.mark.parametrize("weighted", [False, True], ids=["mask_sum", "v1_weights"])
@pytest.mark.parametrize("config", [
    {"cluster.num_devices": 4},
    {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2}], ids=["dp4", "accumulate"])
def test_a_masked_loss_is_one_devices(weighted, config):
    """Before: each replica divided by its own count of unmasked tokens."""
    build = masked(weighted)
    reference = train(build, DATA)
    assert_equivalent(reference, train(build, DATA, config), rtol=1e-5)


def test_a_count_of_what_the_model_computes_is_refused_by_name():
    """A loss divided by a count that depends on the model's outputs cannot
    be read whole-batch before the replicas run: refused, naming the op."""
    def build(x, y):
        del y
        out = dense(x, 3, "out", 1)
        confident = tf.cast(out > 0.0, tf.float32)
        loss = tf.reduce_sum(tf.square(out) * confident) / tf.reduce_sum(confident)
        return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(wh.PlanError, match="whole batch.*out/add.*a variable.s value"):
        train(build, DATA, {"cluster.num_devices": 2})


def keras_masked_fit(config):
    """Keras in graph mode: an Embedding's padding mask reaches the compiled
    sparse cross-entropy; 10-row batches (uneven on 4 devices)."""
    rng = np.random.RandomState(0)
    tokens = rng.randint(1, 12, size=(20, 5))
    tokens[np.arange(5)[None, :] >= rng.randint(1, 6, size=20)[:, None]] = 0
    targets = np.roll(tokens, -1, axis=1)
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init(config)
        tf.keras.utils.set_random_seed(3)
        model = tf.keras.Sequential([tf.keras.Input((5,), dtype="int64"),
                                     tf.keras.layers.Embedding(12, 8, mask_zero=True),
                                     tf.keras.layers.Dense(8, "relu"), tf.keras.layers.Dense(12)])
        model.compile(tf.keras.optimizers.legacy.Adam(0.01),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(tokens, targets, batch_size=10, epochs=2, shuffle=False,
                            verbose=0).history
        weights = model.get_weights()
    if config:
        wh.reset()
    return history["loss"], weights


def test_a_keras_masked_loss_in_graph_mode_is_one_devices():
    (losses, weights), (got, got_weights) = (keras_masked_fit(None),
                                             keras_masked_fit({"cluster.num_devices": 4}))
    assert_parallel()
    np.testing.assert_allclose(got, losses, rtol=1e-5)
    for a, b in zip(weights, got_weights):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
