"""Whale Example 5 with only the experts in the split scope: the dispatch
(``be,bd->ebd``) and the combine (``ebd,be->bd``) under the default replicate
strategy, so the experts' outputs ``[E, B, D]`` leave the split TaskGraph with
the batch on axis 1 and the bridge regroups their rows along it."""
import contextlib

import tensorflow as tf

from equivalence import assert_equivalent, dense, make_data, train
from test_split import EXPERTS, MODEL, expert_weights

import tfpar as wh

v1 = tf.compat.v1


def experts_alone(tfpar, devices=4):
    def build(x, y):
        if tfpar:
            wh.set_default_strategy(wh.replicate(devices))
        h = dense(x, MODEL, "embed", seed=1, activation=tf.nn.tanh)
        gates = tf.nn.softmax(dense(h, EXPERTS, "gate", seed=2))
        dispatched = tf.einsum("be,bd->ebd", gates, h)
        with wh.split(devices) if tfpar else contextlib.nullcontext():
            w1, w2 = expert_weights()
            hidden = tf.nn.relu(tf.einsum("ebd,edh->ebh", dispatched, w1))
            expert_outputs = tf.einsum("ebh,ehd->ebd", hidden, w2)
        outputs = tf.einsum("ebd,be->bd", expert_outputs, gates)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(outputs, 3, "head", seed=3))
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def test_experts_combined_outside_the_split_scope_train_like_one_device():
    """Before: PlanError "'einsum_2/gather_shards_1:0' ... cannot tell which of
    its axes holds the batch rows" (the experts' inputs are sliced by expert
    in the split scope, and the batch axis was lost at the slice)."""
    data = make_data(steps=3, batch=8, classes=3)
    assert_equivalent(train(experts_alone(False), data),
                      train(experts_alone(True), data, {"cluster.num_devices": 4}))
