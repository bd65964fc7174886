"""Keras attention in a split scope (issue 48 item 4): the transformer block of
Keras' text-classification example in ``wh.split(2)``, the rest replicated,
trained with ``fit`` in graph mode and in TF2 like one device, with
``MultiHeadAttention`` split the Megatron way (query, key and value kernels by
heads, the attention on each device's heads, the output projection by heads as
rows) and the feed-forward ``Dense`` layers column then row."""
import contextlib
import json
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, plan_of, train, variable_values
from keras_transformer import block, fit, text_classifier

import tfpar as wh
import warm_python

v1 = tf.compat.v1
PATTERNS = {"query": "column", "key": "column", "value": "column",
            "multi_head_attention": "heads", "attention_output": "row",
            "dense": "column", "dense_1": "row"}


def whole_slots(values, variables):
    """``values`` with the optimizer slots of each split weight's slices
    (``<optimizer>/<weight>/part_i/m``) put together as the whole weight's."""
    whole = dict(values)
    for part in variables:
        info = getattr(part, "_save_slice_info", None)
        for name in list(whole) if info is not None else ():
            if f"/{part.op.name}/" not in f"/{name}" or name == part.op.name:
                continue
            slot = whole.setdefault(name.replace(part.op.name, info.full_name),
                                    np.zeros(info.full_shape, np.float32))
            slot[tuple(slice(o, o + n) for o, n in zip(info.var_offset, info.var_shape))] = \
                whole.pop(name)
    return whole


def graph_mode_fit(tfpar, heads):
    """Losses, every variable (slots whole), the split TaskGraph's patterns
    and the devices of the attention kernels' shards."""
    graph = tf.Graph()
    with graph.as_default():
        if tfpar:
            wh.init({"cluster.num_devices": 2})
        tf.keras.utils.set_random_seed(1)
        model = text_classifier(heads, *((lambda: wh.split(2), lambda: wh.replicate(2))
                                         if tfpar else ()))
        losses = fit(model)
        variables = v1.global_variables()
        values = whole_slots(variable_values(v1.keras.backend.get_session(), variables),
                             variables)
        attention = block(model).attention
        devices = [sorted(part.device for part in layer.kernel) for layer in (
            attention._query_dense, attention._key_dense, attention._value_dense,
            attention._output_dense)] if tfpar else []
        plan = wh.current_plan().task_graphs if tfpar else ()
    if tfpar:
        wh.reset()
    return (np.array(losses), values), [(tg.strategy, len(tg.devices), tg.patterns)
                                        for tg in plan], devices


def test_keras_transformer_block_in_a_split_scope_fits_like_one_device_in_graph_mode():
    """3 heads on 2 devices: 2 and 1. Before: TypeError int(None) (the query
    projection ``abc,cde->abde`` was taken for a mixture-of-experts dispatch
    with the batch as its expert axis)."""
    reference, _, _ = graph_mode_fit(False, heads=3)
    result, task_graphs, devices = graph_mode_fit(True, heads=3)
    assert_equivalent(reference, result, rtol=1e-5)
    assert task_graphs == [("replicate", 2, {}), ("split", 2, PATTERNS), ("replicate", 2, {})]
    assert devices == [[f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]] * 4


class HeadProjection(tf.keras.layers.Layer):
    """A projection to 2 heads written by hand: ``tf.einsum`` of a weight."""

    def build(self, input_shape):
        self.kernel = self.add_weight("kernel", [input_shape[-1], 2, 3])

    def call(self, x):
        return tf.einsum("abc,cde->abde", x, self.kernel)


def einsum_layers(tfpar):
    """EinsumDense layers alone in ``wh.split(2)``: ``...b,bc->...c`` (column:
    its output split along the last axis), ``abc,cd->abd`` reading those
    shards (row), a per-feature scale ``abc,c->abc`` (nothing to split:
    whole), a one-head MultiHeadAttention (one head cannot be split over two
    devices: the projections split along the head's width, the attention on
    the gathered query, key and value); hand-written projections to heads
    (``tf.einsum`` of a weight) of a whole input (computed whole: no
    mixture-of-experts dispatch, whose expert axis would be the batch) and of
    a split one (partial products: no mixture-of-experts combine, whose
    token rows would be the weight's heads)."""
    def build(x, y):
        tf.keras.utils.set_random_seed(2)
        with wh.split(2) if tfpar else contextlib.nullcontext():
            h = tf.keras.layers.EinsumDense("...b,bc->...c", 12, bias_axes="c",
                                            activation="relu")(x)
            h = tf.keras.layers.EinsumDense("abc,cd->abd", [5, 6], bias_axes="d")(h)
            h = tf.keras.layers.EinsumDense("abc,c->abc", [5, 6])(h)
            h = tf.reshape(HeadProjection()(h), [-1, 5, 6])
            h = tf.keras.layers.MultiHeadAttention(num_heads=1, key_dim=4)(h, h)
            h = HeadProjection()(h)
        logits = tf.keras.layers.Dense(3)(tf.reduce_mean(h, [1, 2]))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return build


def test_einsum_dense_layers_split_where_their_equations_allow_and_say_what_runs_whole():
    rng = np.random.RandomState(0)
    data = (rng.randn(3, 8, 5, 6).astype(np.float32), rng.randint(0, 3, (3, 8)).astype(np.int64))
    config = {"cluster.num_devices": 2}
    with pytest.warns(wh.FallbackWarning) as said:
        result = train(einsum_layers(True), data, config)
    assert_equivalent(train(einsum_layers(False), data), result)
    with pytest.warns(wh.FallbackWarning):
        plan = plan_of(einsum_layers(True), config, shape=(None, 5, 6))
    assert plan.task_graphs[0].patterns == {
        "einsum_dense": "column", "einsum_dense_1": "row", "einsum_dense_2": "whole",
        "query": "column", "key": "column", "value": "column",
        "multi_head_attention": "gather", "attention_output": "column", "einsum": "sharded"}
    texts = [str(w.message) for w in said if w.category is wh.FallbackWarning]
    assert len(texts) == 2, texts
    assert ("EinsumDense layer 'einsum_dense_2' ('abc,c->abc', kernel [6]): it runs whole"
            in texts[0])
    assert "attention of layer 'multi_head_attention' by heads: it runs once" in texts[1]


SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf2_attention_script.py")


def tf2_fits(tmp_path, devices, heads, modes=None):
    """``tf2_attention_script.py`` for each device count (0: plain) and mode
    (default: split), in fresh processes run side by side: their results."""
    modes = modes or ["split"] * len(devices)
    runs = [warm_python.start([sys.executable, SCRIPT, str(n), str(heads),
                               str(tmp_path / f"{n}{mode}"), mode])
            for n, mode in zip(devices, modes)]
    results = []
    for run in runs:
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-4000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def test_keras_transformer_block_in_a_split_scope_fits_like_one_device_in_tf2(tmp_path):
    """``fit`` on the functional model built in eager code, its block made in
    ``wh.split()``, the rest in ``wh.replicate()``: the losses and every value
    a checkpoint of the model and its optimizer holds (split weights and their
    slots whole under their single-device keys) are the plain run's; the
    attention kernels are one shard per device, and both devices ran the step.
    Before: TypeError int(None), as in graph mode; with the split fixed,
    PlanError "'gradient_tape/model/global_average_pooling1d/Shape:0' ... flows
    between TaskGraphs 'split_1' (1 replicas) and 'replicate_2' (2)": a tape's
    backward ops joined the TaskGraph of the gradient they read first, the
    next one's, instead of their forward op's."""
    plain, split = tf2_fits(tmp_path, (0, 2), heads=2)
    np.testing.assert_allclose(split["losses"], plain["losses"], rtol=1e-5)
    assert sorted(split["saved"]) == sorted(plain["saved"])
    assert any("optimizer" in key for key in plain["saved"])
    for key, value in plain["saved"].items():
        np.testing.assert_allclose(split["saved"][key], value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert split["patterns"] == [PATTERNS]
    assert split["strategies"] == [["replicate", 2], ["split", 2], ["replicate", 2]]
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
    assert split["shards"] == [devices] * 4
    assert split["devices"] == split["planned"] == devices
