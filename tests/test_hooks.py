"""Hooks record scopes and phases, then get out of the way."""
import tensorflow as tf
from tensorflow.python.client import session as tf_session
from tensorflow.python.framework import ops
from tensorflow.python.ops import gradients_util
from tensorflow.python.training import optimizer as tf_optimizer

from equivalence import dense

import tfpar as wh
from tfpar.hooks.capture import existing_capture
from tfpar.runtime.graph_state import existing_state
from tfpar.ir.taskgraph import Phase


def _build(opt):
    x = tf.compat.v1.placeholder(tf.float32, [None, 6])
    with wh.replicate(1, name="body"):
        h = dense(x, 4, "hidden", seed=1)
    loss = tf.reduce_mean(h * h)
    return loss, opt.minimize(loss)


def test_scopes_and_phases_are_recorded():
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        _build(tf.compat.v1.train.GradientDescentOptimizer(0.1))
        cap = existing_capture(graph)
        assert [tg.name for tg in cap.task_graphs] == ["body"]
        assert "hidden/MatMul" in cap.op_task_graph
        assert "Mean" not in cap.op_task_graph  # created outside the scope
        phases = {op.name: cap.op_phase.get(op.name, Phase.FORWARD) for op in graph.get_operations()}
        assert phases["hidden/MatMul"] == Phase.FORWARD
        assert any(p == Phase.BACKWARD and "hidden/MatMul_grad" in n for n, p in phases.items())
        assert any(p == Phase.APPLY and "ResourceApplyGradientDescent" in graph.get_operation_by_name(n).type
                   for n, p in phases.items())
        assert len(cap.gradient_calls) == 1 and len(cap.apply_calls) == 1


def test_optimizer_subclass_override_is_recorded_once():
    class Wrapped(tf.compat.v1.train.GradientDescentOptimizer):
        def apply_gradients(self, grads_and_vars, global_step=None, name=None):
            return super().apply_gradients(grads_and_vars, global_step, name)

    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        _build(Wrapped(0.1))
        cap = existing_capture(graph)
        assert len(cap.apply_calls) == 1
        assert any(p == Phase.APPLY for p in cap.op_phase.values())


def test_reset_restores_tensorflow():
    originals = (ops.Graph._create_op_helper, ops.Graph.finalize, gradients_util._GradientsHelper,
                 tf_optimizer.Optimizer.apply_gradients, tf_optimizer.Optimizer.__init__,
                 tf_session.BaseSession.__init__, tf_session.BaseSession.run)
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 1})
        assert tf_session.BaseSession.run is not originals[-1]
    wh.reset()
    assert (ops.Graph._create_op_helper, ops.Graph.finalize, gradients_util._GradientsHelper,
            tf_optimizer.Optimizer.apply_gradients, tf_optimizer.Optimizer.__init__,
            tf_session.BaseSession.__init__, tf_session.BaseSession.run) == originals


def test_session_gets_logical_devices():
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 3})
        with tf.compat.v1.Session() as sess:
            cpus = [d.name for d in sess.list_devices() if d.device_type == "CPU"]
    assert len(cpus) == 3


def test_session_keeps_tf_config_settings(monkeypatch):
    """With no ConfigProto, sessions start from tf.config's settings, as in plain TF."""
    import types
    from tensorflow.core.protobuf import config_pb2
    from tfpar.runtime import sessions as engine
    fake = types.SimpleNamespace(config=config_pb2.ConfigProto(intra_op_parallelism_threads=1))
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        monkeypatch.setattr(engine.context, "context", lambda: fake)
        merged = engine.session_config(None)
        monkeypatch.undo()
    assert merged.intra_op_parallelism_threads == 1 and merged.device_count["CPU"] == 2


def test_init_in_another_graph_keeps_earlier_rewrites():
    import numpy as np
    from equivalence import mlp_classifier
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        loss, train_op = mlp_classifier()(x, y)
        sess = tf.compat.v1.Session()
        sess.run(tf.compat.v1.global_variables_initializer())
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
    feed = {x: np.ones((4, 6), np.float32), y: np.zeros(4, np.int64)}
    assert existing_capture(graph) is not None and existing_state(graph).rewrite is not None
    sess.run([loss, train_op], feed)
    sess.close()
