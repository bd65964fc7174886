"""Memory techniques applied to graphs (issue 15): activation recomputation
(``memory.recompute``) computes the same numbers, and a traced step shows the
recomputed forward running in the backward."""
import pytest
import tensorflow as tf

from equivalence import (assert_equivalent, deep_mlp, dense, fed_graph, make_data,
                         traced_first_step, train)
import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=16)
RECOMPUTED = ["block1", "block2", "block3"]


def blocks(count):
    """build(x, y): ``count`` name scopes block0.. of two tanh layers of width 8
    (the second's input and both activations live inside the block), a
    3-class head, plain SGD."""
    def build(x, y):
        h = x
        for i in range(count):
            with v1.variable_scope(f"block{i}"):
                h = dense(h, 8, "inner", seed=2 * i, activation=tf.nn.tanh)
                h = dense(h, 8, "outer", seed=2 * i + 1, activation=tf.nn.tanh)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", seed=99))
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def step_nodes(config, build):
    """{node name: (start, end) microseconds} of one traced step of ``build``."""
    with fed_graph(config) as (graph, x, y):
        _, train_op = build(x, y)
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
    return {node.node_name: (node.all_start_micros, node.all_start_micros
                             + node.all_end_rel_micros)
            for device in metadata.step_stats.dev_stats for node in device.node_stats}


@pytest.mark.parametrize("devices", [1, 2])
def test_recomputed_scopes_give_the_same_numbers_and_run_in_the_backward(devices):
    """Three of five blocks recomputed, on one device and on two data-
    parallel replicas: the same losses and variables as plain TF; in a traced
    step each recomputed block's first MatMul runs after the forward's last
    MatMul (the logits) has ended, and the backward reads its copies."""
    build = blocks(5)
    config = {"cluster.num_devices": devices, "memory.recompute": RECOMPUTED}
    assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-6,
                      parallel=devices > 1)
    nodes = step_nodes(config, build)
    forward_end = max(end for name, (_, end) in nodes.items()
                      if name.split("/")[-1] == "MatMul" and "logits" in name
                      and "grad" not in name)
    recomputed = {name: times for name, times in nodes.items() if "_recompute/" in name
                  and name.endswith("inner/MatMul")}
    assert {name.split("_recompute/")[0].split("/")[-1] for name in recomputed} == set(RECOMPUTED)
    assert all(start >= forward_end for start, _ in recomputed.values())


def test_a_random_op_in_a_recomputed_scope_is_refused():
    """Dropout would draw a new mask when recomputed: a silent change of meaning."""
    def build(x, y):
        with v1.variable_scope("noisy"):
            h = tf.nn.dropout(v1.layers.dense(x, 8), rate=0.5)
        loss = v1.losses.sparse_softmax_cross_entropy(y, v1.layers.dense(h, 3))
        return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)
    with pytest.raises(wh.PlanError, match=r"cannot recompute 'noisy/dropout/.*"
                                           r"\(RandomUniform\) in scope 'noisy'"):
        train(build, DATA, {"memory.recompute": ["noisy"]})


def test_a_recomputed_scope_that_does_not_exist_is_named():
    with pytest.raises(wh.PlanError, match="memory.recompute names 'layer9'"):
        train(deep_mlp(2), DATA, {"memory.recompute": ["layer9"]})


def test_recomputation_with_a_pipeline_is_refused_not_ignored():
    with pytest.raises(wh.PlanError, match="memory.recompute is applied to data-parallel plans"):
        train(blocks(2), DATA, {"cluster.num_devices": 2, "memory.recompute": ["block0"],
                                "auto.num_task_graph": 2, "pipeline.num_micro_batch": 2})
