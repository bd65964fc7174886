"""Sequence parallelism (issue 45; Korthikanti et al. 2022, §4.2.2) with
``split.sequence_parallel``: the transformer block of Keras' text-classification
example in ``wh.split(2)`` trains like one device, its row-parallel outputs
reduce-scattered along the sequence, its residual adds, dropouts and
LayerNormalizations run on each device's half of the sequence, and the next
column-parallel layer all-gathers it."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, plan_of, train, variable_values
from keras_transformer import fit, text_classifier
from proof import TRACER, executed_nodes
from test_split_attention import PATTERNS, tf2_fits, whole_slots

import tfpar as wh

v1 = tf.compat.v1
SEQUENCE_UNITS = {"dropout": "sequence", "add_v2": "sequence", "layer_normalization": "sequence",
                  "dropout_1": "sequence", "add_v2_1": "sequence",
                  "layer_normalization_1": "sequence"}


def keras_fit(config):
    """Losses and every variable (slots whole) of ``fit`` in graph mode, the
    block in ``wh.split(2)`` (plain: ``config`` None); with tfpar, also the
    split TaskGraph's patterns and the graph with its traced steps."""
    graph = tf.Graph()
    with graph.as_default():
        if config is not None:
            wh.init({"cluster.num_devices": 2, **config})
        tf.keras.utils.set_random_seed(1)
        model = text_classifier(2, *((lambda: wh.split(2), lambda: wh.replicate(2))
                                     if config is not None else ()))
        losses = fit(model)
        variables = v1.global_variables()
        values = whole_slots(variable_values(v1.keras.backend.get_session(), variables),
                             variables)
        patterns = wh.current_plan().task_graphs[1].patterns if config is not None else {}
    if config is not None:
        wh.reset()
    return (np.array(losses), values), patterns, graph


def forward_ops(graph, op_type):
    """The transformer block's forward ops of ``op_type``."""
    return [op for op in graph.get_operations() if op.type == op_type
            and op.name.startswith("transformer_block/") and "gradients" not in op.name]


def test_keras_transformer_block_runs_its_norms_on_sequence_halves_and_fits_like_one_device():
    reference, _, _ = keras_fit(None)
    result, patterns, graph = keras_fit({"split.sequence_parallel": True})
    executed = executed_nodes(TRACER.graphs[graph].run_metadata)
    assert_equivalent(reference, result, rtol=1e-5)
    assert patterns == {**PATTERNS, **SEQUENCE_UNITS}
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
    for norm in ("layer_normalization", "layer_normalization_1"):
        moments = [op for op in forward_ops(graph, "Mean")
                   if op.name.startswith(f"transformer_block/{norm}/moments")
                   and op.name.endswith("/mean")]
        assert [int(op.inputs[0].shape[1]) for op in moments] == [3, 3]  # sequence 6 / 2
        assert sorted(d for op in moments for d in executed[op.name]) == devices
    # The two row outputs are summed as halves of the sequence, each on its
    # device: no full [batch, 6, 8] sum on device 0 before the norms.
    sums = forward_ops(graph, "AddN")
    assert all(int(op.outputs[0].shape[1]) == 3 for op in sums), sums
    assert sorted(op.device for op in sums) == sorted(devices * 2)


def test_without_the_key_the_row_outputs_are_summed_whole_on_one_device():
    """The check above would fail without sequence parallelism."""
    _, patterns, graph = keras_fit({})
    TRACER.take()
    assert patterns == PATTERNS
    assert {int(op.outputs[0].shape[1]) for op in forward_ops(graph, "AddN")} == {6}


def block(x, dropout=0.0, heads=2):
    """A pre-norm transformer block as users write it (keras MultiHeadAttention,
    Dense MLP, LayerNormalization, residual adds, Dropout), then a pooled
    3-class head outside the split scope."""
    tf.keras.utils.set_random_seed(4)
    width = int(x.shape[-1])
    attention = tf.keras.layers.MultiHeadAttention(heads, 4)
    norm_1, norm_2 = tf.keras.layers.LayerNormalization(), tf.keras.layers.LayerNormalization()
    up, down = tf.keras.layers.Dense(16, activation="relu"), tf.keras.layers.Dense(width)
    drop = tf.keras.layers.Dropout(dropout, seed=5)
    normed = norm_1(x)
    h = x + drop(attention(normed, normed), training=True)
    return h + drop(down(up(norm_2(h))), training=True)


def block_model(tfpar, dropout=0.0, heads=2):
    def build(x, y):
        with wh.split(2) if tfpar else contextlib.nullcontext():
            h = block(block(x, dropout, heads), dropout, heads)
        logits = tf.keras.layers.Dense(3, name="head")(tf.reduce_mean(h, 1))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return build


def block_data(sequence, steps=3):
    rng = np.random.RandomState(0)
    return (rng.randn(steps, 4, sequence, 8).astype(np.float32),
            rng.randint(0, 3, (steps, 4)).astype(np.int64))


CONFIG = {"cluster.num_devices": 2, "split.sequence_parallel": True}


def test_two_pre_norm_blocks_on_an_odd_sequence_train_like_one_device():
    """Sequence 5 on two devices: slices of 3 and 2 (``slice_offsets``); the
    second block's attention projections all-gather the first's output. The
    first norm reads the whole input: it runs whole."""
    data = block_data(5)
    assert_equivalent(train(block_model(False), data), train(block_model(True), data, CONFIG))
    plan = plan_of(block_model(True), CONFIG, shape=(None, 5, 8))
    assert [p for u, p in plan.task_graphs[0].patterns.items()
            if u.startswith("layer_normalization")] == ["sequence"] * 3


def test_dropout_draws_a_mask_on_every_sequence_slice():
    """Rate 0.5: each device's slice gets its own mask (not one device's mask,
    so not the numbers of one device); every slice has dropped entries and
    the loss stays finite."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(CONFIG)
        x = v1.placeholder(tf.float32, [None, 6, 8])
        with wh.split(2):
            out = block(x, dropout=0.5)
        loss = tf.reduce_mean(tf.square(out))
        step = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        dropped = [op.outputs[0] for op in graph.get_operations() if op.type == "SelectV2"
                   and "dropout" in op.name and "gradients" not in op.name
                   and op.outputs[0].shape.rank == 3 and op.outputs[0].shape[1] == 3]
        assert len(dropped) == 4  # two dropouts, two slices each
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            values = sess.run([loss, step] + dropped, {x: block_data(6)[0][0]})
    wh.reset()
    assert np.isfinite(values[0])
    for masked in values[2:]:
        assert 0 < np.mean(masked == 0) < 1


def test_a_split_scope_where_nothing_can_run_on_sequence_slices_says_so():
    """An MLP on [batch, features]: no sequence axis to split."""
    def build(x, y):
        with wh.split(2):
            h = tf.keras.layers.Dense(8, activation="relu")(x)
            logits = tf.keras.layers.Dense(3)(h)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    data = (np.ones((1, 4, 6), np.float32), np.zeros((1, 4), np.int64))
    with pytest.warns(wh.FallbackWarning, match="split.sequence_parallel asked to split"):
        train(build, data, CONFIG)
    with pytest.raises(wh.PlanError, match="sequence_parallel"):
        train(build, data, {**CONFIG, "strict": True})
    TRACER.take()


def test_keras_transformer_block_with_sequence_parallelism_fits_like_one_device_in_tf2(tmp_path):
    plain, split = tf2_fits(tmp_path, (0, 2), heads=2, modes=["split", "sequence"])
    np.testing.assert_allclose(split["losses"], plain["losses"], rtol=1e-5)
    assert sorted(split["saved"]) == sorted(plain["saved"])
    for key, value in plain["saved"].items():
        np.testing.assert_allclose(split["saved"][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert split["patterns"] == [{**PATTERNS, **SEQUENCE_UNITS}]
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
    assert split["norm_devices"] == devices


def pipelined_blocks(tfpar):
    """Two pre-norm blocks, each in its own split(2) stage (tensor x
    pipeline on 4 devices), then the pooled head."""
    def build(x, y):
        h = x
        for _ in range(2):
            with wh.split(2) if tfpar else contextlib.nullcontext():
                h = block(h)
        logits = tf.keras.layers.Dense(3, name="head")(tf.reduce_mean(h, 1))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return build


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
def test_split_stages_of_a_pipeline_run_sequence_parallel_and_train_like_one_device():
    """Each stage reduce-scatters its row outputs over its own 2 devices
    (CPU:0-1, then CPU:2-3); the second stage reads the first's output
    whole across the stage boundary; 2 micro-batches."""
    config = {**CONFIG, "cluster.num_devices": 4, "pipeline.num_micro_batch": 2}
    data = block_data(6)
    result = train(pipelined_blocks(True), data, config)
    graph, = TRACER.graphs
    sums = [op for op in graph.get_operations() if op.type == "AddN"  # of activations
            and "gradients" not in op.name and op.outputs[0].shape[0] is None]
    assert {int(op.outputs[0].shape[1]) for op in sums} == {3}
    assert {op.device[-1] for op in sums} == set("0123")
    assert_equivalent(train(pipelined_blocks(False), data), result)
