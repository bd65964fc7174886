"""Issue 48 item 6: a variable read by several pipeline stages (tied input and
output embeddings) trains with the single-device numbers, its stages as task
functions (``tfpar/rewriters/tied_weights.py``)."""
import contextlib
import warnings

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import indexed_slices

from equivalence import assert_equivalent, dense, train, variable_values
from proof import TRACER
from tied_gpt import FOUR, gpt, token_data

import tfpar as wh
from tfpar.runtime.graph_state import existing_state
from tfpar.analysis.op_kinds import gradient_tensors

v1 = tf.compat.v1
DATA = token_data()


@pytest.fixture(scope="module")
def reference():
    return train(gpt(), DATA)


def rewrite_of_last_training():
    """The rewrite of the graph tfpar rewrote and trained last."""
    return list(TRACER.graphs.values())[-1].rewrite


@contextlib.contextmanager
def no_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("error", wh.FallbackWarning)
        yield


def assert_summed_per_stage(rw, variable, stages):
    """``variable``'s gradient is reduced as one term per stage reading it,
    each on its own stage's devices, and the stages are task functions."""
    assert rw.functions
    terms = [g for g, var in rw.selection.raw_grads if var.name == variable]
    term_stages = sorted(rw.placement.stage(gradient_tensors(g)[0].op) for g in terms)
    assert term_stages == stages
    for g in terms:
        stage = rw.placement.stage(gradient_tensors(g)[0].op)
        for t in gradient_tensors(g):
            assert [r.device for r in rw.reduced[t]] == rw.placement.stage_devices[stage]


@pytest.mark.parametrize("built", ["embedding_in_first_scope", "optimizer_in_last_scope"])
def test_a_gpt_with_tied_embeddings_trains_in_four_stages(built, reference):
    """4 replicate(1) stages on 4 devices, 4 micro-batches, Adam: every
    variable (slots too) as on one device, as task functions. Before: the
    embedding made in the first scope turned every micro-batch into a copy of
    its stage (the tied gradient's sum made the stages' backward tasks wait
    on each other), silently; an optimizer built in the last scope, or an
    embedding made before the scopes, put 'wte/Adam' on another device than
    its update, and TensorFlow refused to place the graph."""
    kwargs = ({} if built == "embedding_in_first_scope"
              else {"embedding_outside": True, "optimizer_inside": True})
    with no_fallback():
        result = train(gpt(FOUR, **kwargs), DATA,
                       {"cluster.num_devices": 4, "pipeline.num_micro_batch": 4})
    assert_summed_per_stage(rewrite_of_last_training(), "wte", [0, 3])
    assert_equivalent(reference, result, rtol=1e-4)


def test_tied_embeddings_with_data_parallelism_around_the_pipeline(reference):
    """8 devices: the 4-stage pipeline twice, each replica of a stage with its
    own copies of its variables (the collective backend): the embedding's
    copies end equal, every variable as on one device."""
    graph = tf.Graph()
    with graph.as_default(), no_fallback():
        wh.init({"cluster.num_devices": 8, "pipeline.num_micro_batch": 2,
                 "communication.backend": "collective"})
        ids = v1.placeholder(tf.int64, [None, DATA[0].shape[-1]])
        loss, train_op = gpt(FOUR)(ids, None)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([loss, train_op], {ids: batch})[0] for batch in DATA[0]]
            values = variable_values(sess, v1.global_variables())
            rw = existing_state(graph).rewrite.rewrite
            copies = rw.replica_versions(graph.get_operation_by_name("wte"))
            reads = [v1.raw_ops.ReadVariableOp(resource=c.outputs[0], dtype=tf.float32)
                     for c in copies]
            first, second = sess.run(reads)
    wh.reset()
    assert len(copies) == 2
    np.testing.assert_array_equal(first, second)
    assert_summed_per_stage(rw, "wte", [0, 3])
    assert_equivalent(reference, (np.array(losses), values), rtol=1e-4)


def shared_table_and_skip(tfpar):
    """build(ids, y): 3 stages; the first and second look rows up in one table
    (T5 shares an embedding between encoder and decoder: a sparse gradient
    from two stages), and the last reads the first's output again (a skip
    connection across stages: a dense gradient summed from two stages)."""
    def build(ids, y):
        scope = wh.replicate if tfpar else lambda _: contextlib.nullcontext()
        with scope(1):
            table = v1.get_variable("table", initializer=np.random.RandomState(1).randn(
                10, 4).astype(np.float32))
            h0 = dense(tf.reduce_mean(tf.gather(table, ids), 1), 4, "s0", 0, tf.nn.tanh)
        with scope(1):
            again = tf.reduce_mean(tf.gather(table, ids[:, ::-1]), 1)
            h1 = dense(h0, 4, "s1", 1, tf.nn.tanh) + again
        with scope(1):
            logits = dense(h1 + h0, 3, "s2", 2)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdamOptimizer(0.1).minimize(loss)
    return build


def test_gradients_summed_across_stages_keep_task_functions():
    """A table gathered in two stages is reduced per stage (IndexedSlices
    terms); a skip connection's gradient sum runs in the stage that needs it
    (before: in the last stage, and the stages' backward tasks waited on each
    other: copies, silently)."""
    rng = np.random.RandomState(0)
    data = (rng.randint(0, 10, size=(3, 8, 5)).astype(np.int64),
            rng.randint(0, 3, size=(3, 8)).astype(np.int64))
    with no_fallback():
        result = train(shared_table_and_skip(True), data,
                       {"cluster.num_devices": 3, "pipeline.num_micro_batch": 2})
    rw = rewrite_of_last_training()
    assert_summed_per_stage(rw, "table", [0, 1])
    assert all(isinstance(g, indexed_slices.IndexedSlices)
               for g, var in rw.selection.raw_grads if var.name == "table")
    assert_equivalent(train(shared_table_and_skip(False), data), result)
