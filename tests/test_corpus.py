"""A third-party model corpus (issue 12): models nobody on this project wrote,
adopted the way a user adopts tfpar (``wh.init(...)`` added before the model,
nothing else), train like one device: same data, same initial weights (checked
before the first step), then every loss and every variable (optimizer slots
included) compared with a plain single-device run.

* tf-slim 1.1.0: ``resnet_v1`` (TF1 variable_scope / arg_scope code, weight
  decay, ``slim.learning.create_train_op``) in a Session loop over a
  ``tf.data`` iterator; data parallel on 4 devices and automatic 2-stage
  pipeline (Whale Example 4). Batch norm is absent: every batch-norm path of
  tf-slim 1.1.0 fails on TF 2.15 by itself (the core-layer path imports
  ``tf_keras.legacy_tf_layers``, which no TF-2.15-compatible tf-keras has; the
  fused and legacy paths call ``tensorflow.python.framework.ops.Tensor``, gone
  from TF 2.15).
* ``tf.keras.applications.MobileNet`` in graph mode, ``model.fit``, batch norm
  frozen the usual transfer-learning way (the application called with
  ``training=False``).
* canned ``tf.estimator`` classifiers (``DNNClassifier``,
  ``DNNLinearCombinedClassifier``) on feature columns from a dict of numpy
  arrays, or parsed from ``tf.Example`` records with a variable-length tag
  list (a ``VarLenFeature``: a SparseTensor input), with their default
  optimizers (Adagrad, Ftrl).

Inputs are batched with ``drop_remainder`` True (2 full batches) and False
(16, 16 and an uneven 12 rows): each model with both, the orthogonal choices
(the parallel config, the categorical column) paired so that every value
meets every other once rather than in every combination.
"""
import numpy as np
import pytest
import tensorflow as tf
import tf_slim as slim
from tf_slim.nets import resnet_utils, resnet_v1

from equivalence import assert_equivalent, variable_values
from proof import TRACER

import tfpar as wh

v1 = tf.compat.v1
RNG = np.random.RandomState(0)
ROWS, BATCH = 44, 16
IMAGES = RNG.rand(ROWS, 32, 32, 3).astype(np.float32)
IMAGE_LABELS = RNG.randint(0, 10, ROWS).astype(np.int64)

DP = {"cluster.num_devices": 4}
PIPELINE = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2, "auto.num_task_graph": 2}
DROP = pytest.mark.parametrize("drop_remainder", [True, False], ids=["drop", "keep"])


def images(drop_remainder):
    return tf.data.Dataset.from_tensor_slices((IMAGES, IMAGE_LABELS)).batch(
        BATCH, drop_remainder=drop_remainder)


def compare(plain, parallel, stages=1):
    """(initial values, losses, final values) of both runs: same start, same
    training; every rewritten graph ran a plan of ``stages`` TaskGraphs."""
    planned = [len(entry.plan.task_graphs) for entry in TRACER.graphs.values()]
    assert planned and set(planned) == {stages}, planned
    assert len(plain[1]) in (ROWS // BATCH, -(-ROWS // BATCH)), plain[1]  # every batch trained
    assert_equivalent((np.zeros(1), plain[0]), (np.zeros(1), parallel[0]), rtol=0, atol=0,
                      parallel=False)
    assert_equivalent(plain[1:], parallel[1:], rtol=1e-4, atol=1e-5)


# --- tf-slim ------------------------------------------------------------------------

def slim_resnet(config, drop_remainder):
    """tf-slim's resnet_v1 (two small bottleneck blocks, 10 classes) trained by
    ``slim.learning.create_train_op`` with momentum, plainly or under ``config``."""
    with tf.Graph().as_default():
        if config is not None:
            wh.init(config)
        v1.set_random_seed(0)
        x, y = v1.data.make_one_shot_iterator(images(drop_remainder)).get_next()
        blocks = [resnet_v1.resnet_v1_block("block1", base_depth=4, num_units=2, stride=2),
                  resnet_v1.resnet_v1_block("block2", base_depth=8, num_units=1, stride=1)]
        with slim.arg_scope(resnet_utils.resnet_arg_scope()), \
                slim.arg_scope([slim.conv2d], normalizer_fn=None):
            logits, _ = resnet_v1.resnet_v1(x, blocks, num_classes=10, is_training=False)
        v1.losses.sparse_softmax_cross_entropy(y, tf.squeeze(logits, [1, 2]))
        total_loss = slim.learning.create_train_op(
            v1.losses.get_total_loss(), v1.train.MomentumOptimizer(0.05, 0.9))
        variables = v1.global_variables()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            initial = variable_values(sess, variables)
            losses = []
            while True:
                try:
                    losses.append(sess.run(total_loss))
                except tf.errors.OutOfRangeError:
                    break
            final = variable_values(sess, variables)
    wh.reset()
    return initial, np.array(losses), final


@pytest.mark.parametrize("config,stages,drop_remainder", [(DP, 1, True), (PIPELINE, 2, False)],
                         ids=["dp4-drop", "pipeline2-keep"])  # orthogonal: each value once
def test_tf_slim_resnet_v1(config, stages, drop_remainder):
    parallel = slim_resnet(config, drop_remainder)
    compare(slim_resnet(None, drop_remainder), parallel, stages)


# --- tf.keras.applications --------------------------------------------------------------

class Recorder(tf.keras.callbacks.Callback):
    """The weights before the first step and the loss of every step."""

    def on_train_begin(self, logs=None):
        self.initial = variable_values(v1.keras.backend.get_session(), self.model.weights)
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def keras_mobilenet(config, data):
    """MobileNet (alpha 0.25, 32x32 inputs, 10 classes) with batch norm frozen,
    fit for one epoch on ``data``: "arrays" (batches of 16 from numpy arrays), or
    a ``tf.data`` dataset batched with ``drop_remainder`` True ("drop") / False ("keep")."""
    with tf.Graph().as_default():
        if config is not None:
            wh.init(config)
        tf.keras.utils.set_random_seed(0)  # keras initializers ignore the graph seed
        base = tf.keras.applications.MobileNet(alpha=0.25, input_shape=(32, 32, 3), weights=None,
                                               classes=10, classifier_activation=None)
        inputs = tf.keras.Input((32, 32, 3))
        model = tf.keras.Model(inputs, base(inputs, training=False))
        model.compile(tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9),
                      tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        recorder = Recorder()
        if data == "arrays":
            model.fit(IMAGES, IMAGE_LABELS, batch_size=BATCH, shuffle=False, verbose=0,
                      callbacks=[recorder])
        else:
            model.fit(images(data == "drop"), verbose=0, callbacks=[recorder])
        final = variable_values(v1.keras.backend.get_session(),
                                model.weights + model.optimizer.weights)
    wh.reset()
    return recorder.initial, np.array(recorder.losses), final


@pytest.mark.parametrize("data", ["arrays", "drop", "keep"])
def test_keras_applications_mobilenet_fit(data):
    parallel = keras_mobilenet(DP, data)
    compare(keras_mobilenet(None, data), parallel)


# --- canned estimators on feature columns -----------------------------------------------

FEATURES = {
    "age": RNG.randn(ROWS).astype(np.float32),
    "hours": RNG.randn(ROWS).astype(np.float32),
    "job": RNG.choice(["tech", "sales", "admin", "farm"], ROWS),
    "city": RNG.choice(["north", "south", "east"], ROWS),
}
FEATURE_LABELS = RNG.randint(0, 2, ROWS).astype(np.int64)
TAGS = ["red", "green", "blue", "gold", "grey"]
ROW_TAGS = [list(RNG.choice(TAGS, RNG.randint(0, 4), replace=False)) for _ in range(ROWS)]


def parsed_examples(drop_remainder):
    """The feature rows, plus a variable-length tag list, as tf.Examples parsed
    in the input pipeline (the tags arrive as a SparseTensor)."""
    def feature(value):
        if isinstance(value, (list, np.ndarray)) and (not len(value) or isinstance(value[0], str)):
            return tf.train.Feature(bytes_list=tf.train.BytesList(value=[v.encode() for v in value]))
        if isinstance(value, str):
            return feature([value])
        return tf.train.Feature(float_list=tf.train.FloatList(value=[value]))
    records = [tf.train.Example(features=tf.train.Features(feature={
        **{name: feature(column[r]) for name, column in FEATURES.items()},
        "tags": feature(ROW_TAGS[r]),
        "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[FEATURE_LABELS[r]]))}))
        .SerializeToString() for r in range(ROWS)]
    spec = {"age": tf.io.FixedLenFeature([], tf.float32),
            "hours": tf.io.FixedLenFeature([], tf.float32),
            "job": tf.io.FixedLenFeature([], tf.string), "city": tf.io.FixedLenFeature([], tf.string),
            "tags": tf.io.VarLenFeature(tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}

    def parse(batch):
        features = tf.io.parse_example(batch, spec)
        return features, features.pop("label")
    return tf.data.Dataset.from_tensor_slices(records).batch(
        BATCH, drop_remainder=drop_remainder).map(parse)


def feature_columns(categorical, tags=False):
    """(deep, wide) columns; ``categorical`` "vocabulary" (lookup tables) or
    "hash"; ``tags``: with the parsed tag list too."""
    fc = tf.feature_column
    if categorical == "vocabulary":
        job = fc.categorical_column_with_vocabulary_list("job", ["tech", "sales", "admin", "farm"])
        city = fc.categorical_column_with_vocabulary_list("city", ["north", "south", "east"])
    else:
        job = fc.categorical_column_with_hash_bucket("job", 8)
        city = fc.categorical_column_with_hash_bucket("city", 5)
    deep = [fc.numeric_column("age"), fc.numeric_column("hours"), fc.embedding_column(job, 3),
            fc.indicator_column(city)]
    wide = [job, city, fc.crossed_column(["job", "city"], hash_bucket_size=16)]
    if tags:
        tag = fc.categorical_column_with_vocabulary_list("tags", TAGS)
        deep.append(fc.embedding_column(tag, 2))
        wide += [tag, fc.crossed_column(["tags", "city"], hash_bucket_size=16)]
    return deep, wide


class InitialValues(v1.train.SessionRunHook):
    """Every variable's value before the first training step."""

    def __init__(self):
        self.variables, self.values = [], None

    def begin(self):
        self.variables = v1.global_variables()

    def after_create_session(self, session, coord):
        self.values = variable_values(session, self.variables)


class StepLosses(v1.train.SessionRunHook):
    """The loss of every training step (``loss`` is the estimator's fetched one)."""

    def __init__(self):
        self.losses = []

    def before_run(self, run_context):
        return v1.train.SessionRunArgs(v1.get_collection(v1.GraphKeys.LOSSES)[-1])

    def after_run(self, run_context, run_values):
        self.losses.append(run_values.results)


def canned(config, estimator, categorical, drop_remainder, model_dir, parsed=False):
    """A canned ``estimator`` ("dnn" or "wide_and_deep", default optimizers)
    trained for one epoch, plainly or under ``config``, on the numpy
    features or (``parsed``) on tf.Examples with tags."""
    if config is not None:
        wh.init(config)
    deep, wide = feature_columns(categorical, tags=parsed)
    run_config = tf.estimator.RunConfig(model_dir=str(model_dir), tf_random_seed=0)
    if estimator == "dnn":
        est = tf.estimator.DNNClassifier([8, 4], deep, config=run_config)
    else:
        est = tf.estimator.DNNLinearCombinedClassifier(
            linear_feature_columns=wide, dnn_feature_columns=deep, dnn_hidden_units=[8, 4],
            config=run_config)
    initial, losses = InitialValues(), StepLosses()
    est.train(lambda: parsed_examples(drop_remainder) if parsed else
              tf.data.Dataset.from_tensor_slices((FEATURES, FEATURE_LABELS)).batch(
                  BATCH, drop_remainder=drop_remainder), hooks=[initial, losses])
    final = {name: est.get_variable_value(name) for name in est.get_variable_names()}
    wh.reset()
    return initial.values, np.array(losses.losses), final


@pytest.mark.estimator
@pytest.mark.parametrize("estimator,categorical,drop_remainder", [
    ("dnn", "vocabulary", True), ("dnn", "hash", False), ("wide_and_deep", "vocabulary", False),
    ("wide_and_deep", "hash", True)])  # every pair of values of two of the three, once
def test_canned_estimator(estimator, categorical, drop_remainder, tmp_path):
    parallel = canned(DP, estimator, categorical, drop_remainder, tmp_path / "tfpar")
    compare(canned(None, estimator, categorical, drop_remainder, tmp_path / "plain"), parallel)


@pytest.mark.estimator
@pytest.mark.parametrize("estimator,drop_remainder", [("dnn", False), ("wide_and_deep", True)])
def test_canned_estimator_on_parsed_examples(estimator, drop_remainder, tmp_path):
    """The tag list is a SparseTensor from the input pipeline (issue 12, cause 3)."""
    parallel = canned(DP, estimator, "hash", drop_remainder, tmp_path / "tfpar", parsed=True)
    compare(canned(None, estimator, "hash", drop_remainder, tmp_path / "plain", parsed=True),
            parallel)


@pytest.mark.estimator
@DROP
def test_wide_and_deep_in_a_two_stage_pipeline(drop_remainder, tmp_path):
    parallel = canned(PIPELINE, "wide_and_deep", "hash", drop_remainder, tmp_path / "tfpar")
    compare(canned(None, "wide_and_deep", "hash", drop_remainder, tmp_path / "plain"), parallel,
            stages=2)
