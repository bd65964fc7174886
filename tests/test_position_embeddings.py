"""Position embeddings (a Keras ``Embedding`` looked up with
``tf.range(seq_len)``) under replicas and micro-batches (issue 48, item 3).

Before: the lookup's gradient is an IndexedSlices whose row count the graph
fixes (the sequence length), the update ops are built for that count, and
tfpar concatenated the versions' slices: ``Cannot update edge, incompatible
shapes: [24] and [12]``. Now such slices are summed row by row (every version
looks up the same rows, which a run-time check makes sure of).
"""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

import tfpar as wh
from equivalence import assert_equivalent, variable_values
from keras_transformer import fit, text_classifier
from test_split_attention import tf2_fits

v1 = tf.compat.v1


def trained(config, stages=False):
    """(per-step losses, every variable) of Keras' text classifier trained by
    ``fit`` in graph mode; ``stages``: its embeddings in one pipeline stage,
    the rest in another."""
    with tf.Graph().as_default():
        if config is not None:
            wh.init(config)
        tf.keras.utils.set_random_seed(1)
        stage = (lambda: wh.replicate(1)) if stages else contextlib.nullcontext
        model = text_classifier(2, stage, stage, contextlib.nullcontext)
        losses = fit(model)
        values = variable_values(v1.keras.backend.get_session(), v1.global_variables())
    if config is not None:
        wh.reset()
    return np.array(losses), values


@pytest.mark.parametrize("config,stages", [
    ({"cluster.num_devices": 2}, False),
    ({"cluster.num_devices": 2, "pipeline.num_micro_batch": 4}, True)],
    ids=["replicas", "pipeline"])
def test_text_classifier_with_position_embeddings_trains_as_on_one_device(config, stages):
    assert_equivalent(trained(None), trained(config, stages))


@pytest.mark.filterwarnings("ignore:.*cannot tell whether it is a mean:tfpar.FallbackWarning")
def test_fixed_rows_that_differ_between_replicas_are_refused_at_run_time():
    """A lookup of a fixed number of rows that depend on the batch (the first
    row's ids): summing the replicas' slices row by row would be wrong."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        ids = v1.placeholder(tf.int32, [None, 3])
        table = v1.get_variable("table", [10, 2])
        loss = tf.reduce_mean(tf.gather(table, ids[0]))
        train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            with pytest.raises(tf.errors.InvalidArgumentError,
                               match="sparse gradient of .{1,3}table.{1,3} has 3 rows .* look up"):
                sess.run(train_op, {ids: [[1, 2, 3], [4, 5, 6]]})
    wh.reset()


def test_text_classifier_with_position_embeddings_trains_as_on_one_device_in_tf2(tmp_path):
    """The same model built in eager code and trained by ``fit`` in TF2, data
    parallel and as two pipeline stages: losses and every value a checkpoint
    of the model and its optimizer holds are the plain run's."""
    plain, replicas, stages = tf2_fits(tmp_path, (0, 2, 2), heads=2,
                                       modes=["split", "replicas", "stages"])
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
    assert replicas["strategies"] == [["replicate", 2]]
    assert stages["strategies"] == [["replicate", 1], ["replicate", 1]]
    for got in (replicas, stages):
        np.testing.assert_allclose(got["losses"], plain["losses"], rtol=1e-5)
        assert sorted(got["saved"]) == sorted(plain["saved"])
        for key, value in plain["saved"].items():
            np.testing.assert_allclose(got["saved"][key], value, rtol=1e-5, atol=1e-6,
                                       err_msg=key)
        assert got["devices"] == got["planned"] == devices
