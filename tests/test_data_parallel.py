"""Equivalence: data parallelism and gradient accumulation vs single-device TF."""
import numpy as np
import pytest
import tensorflow as tf

from proof import assert_parallel
from equivalence import (assert_equivalent, dense, fed_graph, make_data, mlp_classifier,
                         rewritten_op_types, train)

import tfpar as wh

DATA = make_data(steps=4, batch=8)
SGD = mlp_classifier()


@pytest.fixture(scope="module")
def sgd_reference():
    return train(SGD, DATA)


# "auto" sums on one device (CPU devices of one process); "collective" runs the
# CollectiveReduceV2 ring that multi-process and GPU runs use.
BACKENDS = ["auto", "collective"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("devices", [1, 2, 4])
@pytest.mark.parametrize("use_dataset", [False, True], ids=["feed_dict", "tf.data"])
def test_dp_matches_single_device(devices, use_dataset, backend, sgd_reference):
    reference = sgd_reference if not use_dataset else train(SGD, DATA, use_dataset=True)
    config = {"cluster.num_devices": devices, "communication.backend": backend}
    assert_equivalent(reference, train(SGD, DATA, config, use_dataset=use_dataset))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("devices,micro", [(1, 2), (1, 4), (2, 2)])
def test_gradient_accumulation_matches_full_batch(devices, micro, backend, sgd_reference):
    config = {"cluster.num_devices": devices, "pipeline.num_micro_batch": micro,
              "communication.backend": backend}
    assert_equivalent(sgd_reference, train(SGD, DATA, config))


def test_backend_choice():
    """auto: one-device sum for CPUs of one process, collectives across processes
    or on GPUs; "collective" forces collectives."""
    from tfpar.rewriters.allreduce import (CollectiveKeys, CollectiveReducer, LocalReducer,
                                           make_reducer)

    def kind(backend, devices, device_type="CPU"):
        return type(make_reducer(backend, devices, device_type, CollectiveKeys(),
                                 fusion_bytes=1.0, timeout_s=1.0))
    local = ["/device:CPU:0", "/device:CPU:1"]
    workers = ["/job:worker/task:0/device:CPU:0", "/job:worker/task:1/device:CPU:0"]
    assert kind("auto", local) is LocalReducer
    assert kind("collective", local) is CollectiveReducer
    assert kind("auto", workers) is CollectiveReducer
    assert kind("auto", ["/device:GPU:0", "/device:GPU:1"], "GPU") is CollectiveReducer
    assert make_reducer("auto", local, "GPU", CollectiveKeys(), 1.0, 1.0).hint == "nccl"


@pytest.mark.parametrize("backend,copies", [("auto", 1), ("collective", 4)])
def test_variables_shared_or_mirrored(backend, copies):
    """CPU devices of one process share one copy of each variable, updated once;
    collectives keep a mirrored copy per replica."""
    kinds = rewritten_op_types(SGD, {"cluster.num_devices": 4, "communication.backend": backend})
    assert kinds.count("VarHandleOp") == 4 * copies
    assert kinds.count("ResourceApplyGradientDescent") == 4 * copies


@pytest.mark.parametrize("devices", [2, 4])
def test_higher_order_gradients_weigh_gradients_not_seeds(devices):
    """An input-gradient penalty makes a forward op depend on a gradient seed, so
    unit weights cannot ride on the seeds; gradients are weighted instead."""
    def build(x, y):
        h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
        logits = dense(h, 3, "logits", seed=2)
        (grad_x,) = tf.gradients(tf.reduce_sum(logits), [x])  # per-example rows
        penalty = tf.reduce_mean(tf.reduce_sum(tf.square(grad_x), 1))
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits) + 0.1 * penalty
        return loss, tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    assert_equivalent(train(build, DATA), train(build, DATA, {"cluster.num_devices": devices}))


def test_fetched_backward_tensors_are_global():
    """Fetching a gradient w.r.t. the input (batch-major) or an intermediate
    gradient gives the single-device values."""
    def run(config):
        graph = tf.Graph()
        with graph.as_default():
            if config:
                wh.init(config)
            x = tf.compat.v1.placeholder(tf.float32, [None, 6])
            y = tf.compat.v1.placeholder(tf.int64, [None])
            h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
            logits = dense(h, 3, "logits", seed=2)
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
            grad_x, grad_h = tf.gradients(loss, [x, h])
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                out = sess.run([grad_x, tf.reduce_sum(grad_h, 0), loss],
                               {x: DATA[0][0], y: DATA[1][0]})
        wh.reset()
        return out

    for ref, got in zip(run(None), run({"cluster.num_devices": 4})):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-7)
    assert_parallel()


def test_a_backward_intermediate_task_functions_do_not_return_is_refused_by_name():
    """A version made by a task function returns what other ops read, its
    forward tensors holding rows and what tf.gradients returned. Fetching a
    backward intermediate after the rewrite is refused naming it and the way
    out (pipeline.task_functions false), which fetches the single-device value."""
    def run(config):
        with fed_graph(config) as (_, x, y):
            h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", 2))
            train_op = tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)
            inner = tf.compat.v1.get_default_graph().get_tensor_by_name(
                "gradients/Tanh_grad/TanhGrad:0")
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                return sess.run([inner, train_op], {x: DATA[0][0], y: DATA[1][0]})[0]
    with pytest.raises(wh.PlanError, match="'gradients/Tanh_grad/TanhGrad:0' .* "
                                           "pipeline.task_functions to false"):
        run({"cluster.num_devices": 4})
    np.testing.assert_allclose(
        run({"cluster.num_devices": 4, "pipeline.task_functions": False}), run(None),
        rtol=1e-5, atol=1e-7)
    assert_parallel()


def test_explicit_replicate_scope(sgd_reference):
    result = train(SGD, DATA, {"cluster.num_devices": 2}, scope=lambda: wh.replicate(2))
    assert_equivalent(sgd_reference, result)


def test_nested_dp_of_replicate_one(sgd_reference):
    """replicate(1) on 4 devices becomes 4-way nested data parallelism (Whale §3.2.1)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 4})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        with wh.replicate(1):
            SGD(x, y)
        assert wh.current_plan().data_parallel_degree == 4
    result = train(SGD, DATA, {"cluster.num_devices": 4}, scope=lambda: wh.replicate(1))
    assert_equivalent(sgd_reference, result)


@pytest.mark.parametrize("name,make,rtol", [
    ("momentum", lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9), 1e-5),
    ("adam", lambda: tf.compat.v1.train.AdamOptimizer(0.01), 1e-4),
])
def test_optimizers_with_slots(name, make, rtol):
    build = mlp_classifier(make)
    reference = train(build, DATA)
    assert_equivalent(reference, train(build, DATA, {"cluster.num_devices": 2}), rtol=rtol)


def test_uneven_batch_split():
    """A batch of 10 on 4 replicas (3/2/3/2 rows) still equals the full batch."""
    data = make_data(steps=3, batch=10)
    assert_equivalent(train(SGD, data), train(SGD, data, {"cluster.num_devices": 4}))


def test_clipping_acts_on_the_global_gradient():
    """clip_by_global_norm between compute and apply sees the reduced gradient."""
    def build(x, y):
        h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
        logits = dense(h, 3, "logits", seed=2)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
        opt = tf.compat.v1.train.GradientDescentOptimizer(0.5)
        grads, variables = zip(*opt.compute_gradients(loss))
        clipped, _ = tf.clip_by_global_norm(grads, 0.05)
        step = tf.compat.v1.train.get_or_create_global_step()
        return loss, opt.apply_gradients(zip(clipped, variables), global_step=step)
    reference = train(build, DATA)
    result = train(build, DATA, {"cluster.num_devices": 4})
    assert_equivalent(reference, result)
    assert result[1]["global_step"] == len(DATA[0])


def test_monitored_training_session(sgd_reference):
    reference = train(SGD, DATA, session="monitored")
    assert_equivalent(reference, train(SGD, DATA, {"cluster.num_devices": 2},
                                       session="monitored"))


def test_embedding_gradients_are_indexed_slices():
    """Sparse (IndexedSlices) gradients are gathered across replicas."""
    rng = np.random.RandomState(3)
    ids = rng.randint(0, 20, size=(3, 8)).astype(np.int64)
    labels = rng.randint(0, 3, size=(3, 8)).astype(np.int64)

    def run(config):
        graph = tf.Graph()
        with graph.as_default():
            if config:
                wh.init(config)
            x = tf.compat.v1.placeholder(tf.int64, [None])
            y = tf.compat.v1.placeholder(tf.int64, [None])
            table = tf.compat.v1.get_variable(
                "table", initializer=rng_table())
            logits = dense(tf.nn.embedding_lookup(table, x), 3, "head", seed=4)
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
            train_op = tf.compat.v1.train.AdagradOptimizer(0.3).minimize(loss)
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                losses = [sess.run([loss, train_op], {x: a, y: b})[0] for a, b in zip(ids, labels)]
                values = sess.run({v.op.name: v for v in tf.compat.v1.global_variables()})
        wh.reset()
        return np.array(losses), values

    def rng_table():
        return np.random.RandomState(5).randn(20, 4).astype(np.float32)

    reference = run(None)
    for backend in BACKENDS:
        assert_equivalent(reference, run({"cluster.num_devices": 2,
                                          "communication.backend": backend}))


@pytest.mark.parametrize("fusion_mb,collectives_per_replica", [(64, 1), (1e-9, 4)])
def test_gradient_fusion_buckets(fusion_mb, collectives_per_replica, sgd_reference):
    """64 MiB fuses the MLP's 4 gradients into one all-reduce; a tiny bucket gives 4."""
    config = {"cluster.num_devices": 2, "communication.fusion_mb": fusion_mb,
              "communication.backend": "collective"}
    reduces = rewritten_op_types(SGD, config).count("CollectiveReduceV2")
    assert reduces == 2 * collectives_per_replica
    assert_equivalent(sgd_reference, train(SGD, DATA, config))


def test_bucketize_respects_size_and_dtype():
    from tfpar.rewriters.allreduce import bucketize
    assert bucketize([4, 4, 4], ["f", "f", "f"], 8) == [[0, 1], [2]]
    assert bucketize([4, 4, 4], ["f", "h", "f"], 100) == [[0, 2], [1]]
    assert bucketize([16, 4], ["f", "f"], 8) == [[0], [1]]
