"""Scripts that declare their batch statically (issue 12, cause 1): a placeholder
``[B, D]``, ``batch(B, drop_remainder=True)`` (the usual Estimator input_fn),
and code that reads the batch from static shapes (BERT's ``get_shape_list``)
train like one device. Before, the rewrite died with ``Cannot update edge,
incompatible shapes: [2,6] and [8,6]``."""
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, dense, make_data, mlp_classifier, train
import test_entry_points as entry

import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=8)
CONFIGS = {"dp4": {"cluster.num_devices": 4},
           "accumulate": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
           "collective": {"cluster.num_devices": 2, "communication.backend": "collective"}}


@pytest.mark.parametrize("use_dataset", [False, True], ids=["placeholder", "drop_remainder"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_static_batch_trains_like_one_device(use_dataset, config):
    build = mlp_classifier(lambda: v1.train.AdamOptimizer(0.1))
    reference = train(build, DATA, use_dataset=use_dataset, static_batch=True)
    assert_equivalent(reference, train(build, DATA, CONFIGS[config], use_dataset=use_dataset,
                                       static_batch=True), rtol=1e-4)


def shape_list(x):
    """google-research BERT's get_shape_list: static dimensions where known."""
    static = x.shape.as_list()
    dynamic = tf.shape(x)
    return [d if d is not None else dynamic[i] for i, d in enumerate(static)]


def bert_style(x, y):
    """Reshapes computed from static shapes, as BERT's transformer does."""
    batch, features = shape_list(x)
    tokens = tf.reshape(x, [batch, 3, features // 3])            # [B, T, H]
    flat = tf.reshape(tokens, [batch * 3, features // 3])        # [B*T, H]
    hidden = tf.reshape(dense(flat, 4, "token", seed=1, activation=tf.nn.tanh), [batch, 12])
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(hidden, 3, "logits", seed=2))
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


@pytest.mark.parametrize("config", ["dp4", "accumulate"])
def test_shapes_read_from_static_dimensions(config):
    assert_equivalent(train(bert_style, DATA, static_batch=True),
                      train(bert_style, DATA, CONFIGS[config], static_batch=True))


def test_monitored_training_session_with_static_batch():
    build = mlp_classifier()
    assert_equivalent(train(build, DATA, session="monitored", use_dataset=True, static_batch=True),
                      train(build, DATA, CONFIGS["dp4"], session="monitored", use_dataset=True,
                            static_batch=True))


@pytest.mark.estimator
def test_estimator_with_drop_remainder_input_fn(tmp_path, monkeypatch):
    """The canonical Estimator input_fn batches with drop_remainder=True."""
    monkeypatch.setattr(entry, "input_fn", lambda: tf.data.Dataset.from_tensor_slices(
        ({"x": entry.X}, entry.Y)).batch(entry.BATCH, drop_remainder=True))
    results = {}
    for mode in (None, "dp"):
        with entry.tfpar_on(mode):
            est = entry.estimator(str(tmp_path / str(mode)), mode)
            est.train(entry.input_fn)
            results[mode] = entry.variables_of(est)
    from equivalence import assert_same_variables
    assert_same_variables(results[None], results["dp"])


def test_the_script_still_sees_what_it_declared():
    """The declared sizes are recorded; the graph is built for any batch size."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2})
        x = v1.placeholder(tf.float32, [8, 6], name="x")
        from tfpar.hooks.capture import existing_capture
        assert existing_capture(graph).declared_batch == {"x": 8}
        assert x.shape.as_list() == [None, 6]
    wh.reset()
    with tf.Graph().as_default():  # without tfpar nothing changes
        assert v1.placeholder(tf.float32, [8, 6]).shape.as_list() == [8, 6]
