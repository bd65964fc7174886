"""Issue 44 ("Say what you did"): where the replicas and micro-batches of a
TaskGraph cannot be calls of its task functions and become copies of its ops
(start-up and graph size then grow with them), tfpar says why, naming the
culprit, through ``tfpar.fallback`` (a FallbackWarning and a plan note; a
PlanError under ``strict``); asking for copies says nothing."""
import numpy as np
import pytest
import tensorflow as tf

from equivalence import dense, fed_graph
from test_split import _pipelined_classifier

import tfpar as wh

v1 = tf.compat.v1
split_head = _pipelined_classifier()  # a replicate(1) stage, then a split(2) one


def reference_variable(x, y):
    """Two replicate(1) stages, the second's weights a reference variable."""
    with wh.replicate(1):
        h = dense(x, 8, "first", seed=1, activation=tf.nn.tanh)
    with wh.replicate(1):
        kernel = v1.get_variable("second", initializer=np.ones((8, 3), np.float32),
                                 use_resource=False)
        loss = v1.losses.sparse_softmax_cross_entropy(y, tf.matmul(h, kernel))
    return v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def rewrite(build, config):
    """Build ``build`` under ``config`` and run its initializer (the rewrite);
    the plan's notes."""
    with fed_graph(config) as (graph, x, y):
        build(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
        return wh.current_plan().notes


@pytest.mark.parametrize("build,devices,culprit", [
    (split_head, 3, "TaskGraph 'split_1' is split"),
    (reference_variable, 2, "variable 'second' is a reference variable")])
def test_copies_of_stages_are_said_with_their_culprit(build, devices, culprit):
    config = {"cluster.num_devices": devices, "pipeline.num_micro_batch": 2}
    with pytest.warns(wh.FallbackWarning, match=culprit) as said:
        notes = rewrite(build, config)
    text, = [str(w.message) for w in said if issubclass(w.category, wh.FallbackWarning)]
    assert "copies of its ops" in text and "pipeline.task_functions to false" in text
    assert text in notes
    with pytest.raises(wh.PlanError, match=culprit):
        rewrite(build, {**config, "strict": True})


def test_copies_asked_for_are_not_said(recwarn):
    notes = rewrite(split_head, {"cluster.num_devices": 3, "pipeline.num_micro_batch": 2,
                                 "pipeline.task_functions": False})
    assert not [note for note in notes if "copies of its ops" in note]
    assert not [w for w in recwarn if issubclass(w.category, wh.FallbackWarning)]
