"""Equivalence: split TaskGraphs (tensor parallelism, Whale §3.2.2) vs single-device TF."""
import contextlib

import numpy as np
import pytest
import tensorflow as tf

from proof import TRACER, executed_nodes, ran_on
from equivalence import (assert_equivalent, checkpoint_session, dense, layer, make_data,
                         plan_of, train, variable_values)

import tfpar as wh

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=8, classes=10)


def scope(tfpar, kind, devices):
    return getattr(wh, kind)(devices) if tfpar else contextlib.nullcontext()


def classifier(tfpar, classes=10, backbone="replicate", devices=4, dense_labels=False,
               optimizer=lambda: v1.train.GradientDescentOptimizer(0.5)):
    """Whale Example 2: a replicated feature extractor and a split classifier head
    (fc + softmax cross-entropy) on the same devices."""
    def build(x, y):
        with scope(tfpar, backbone, devices) if backbone else contextlib.nullcontext():
            features = dense(x, 8, "features", seed=1, activation=tf.nn.tanh)
        with scope(tfpar, "split", devices):
            logits = layer(features, classes, "logits", seed=2)
            if dense_labels:
                loss = v1.losses.softmax_cross_entropy(tf.one_hot(y, classes), logits)
            else:
                loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, optimizer().minimize(loss)
    return build


def test_whale_example_2_with_1000_classes():
    data = make_data(steps=3, batch=8, classes=1000)
    config = {"cluster.num_devices": 4}
    assert_equivalent(train(classifier(False, 1000), data),
                      train(classifier(True, 1000), data, config))


@pytest.mark.parametrize("dense_labels", [False, True], ids=["sparse", "dense"])
@pytest.mark.parametrize("devices", [2, 4])
def test_split_head_alone(devices, dense_labels):
    """Uneven shards too: 10 classes on 4 devices are 3, 3, 2, 2."""
    config = {"cluster.num_devices": devices}
    assert_equivalent(train(classifier(False, dense_labels=dense_labels), DATA),
                      train(classifier(True, backbone=None, devices=devices,
                                       dense_labels=dense_labels), DATA, config))


def test_split_with_adam():
    build = classifier(False, optimizer=lambda: v1.train.AdamOptimizer(0.01))
    staged = classifier(True, optimizer=lambda: v1.train.AdamOptimizer(0.01))
    assert_equivalent(train(build, DATA), train(staged, DATA, {"cluster.num_devices": 4}),
                      rtol=1e-4)


def megatron_mlp(tfpar, devices=2):
    """A split MLP: fc -> fc -> classifier, all in one split scope."""
    def build(x, y):
        with scope(tfpar, "split", devices):
            h = layer(x, 16, "fc1", seed=1, activation=tf.nn.tanh)
            h = layer(h, 8, "fc2", seed=2, activation=tf.nn.tanh)
            logits = layer(h, 10, "logits", seed=3)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return build


def test_matcher_picks_the_cheaper_pattern():
    """fc1 sees a whole input: column (SP1) moves 2*6 floats a row, row (SP2) 16+6.
    fc2 sees fc1's column-split output: row needs no gather (Megatron's column
    then row). The cross-entropy stays distributed (3 floats vs 10 classes)."""
    plan = plan_of(megatron_mlp(True), {"cluster.num_devices": 2})
    assert plan.task_graphs[0].patterns == {
        "fc1": "column", "fc2": "row", "logits": "column", "sparse_softmax_xent": "distributed"}
    assert "fc2 -> row" in plan.summary()


def test_megatron_mlp_and_forced_patterns():
    reference = train(megatron_mlp(False), DATA)
    assert_equivalent(reference, train(megatron_mlp(True), DATA, {"cluster.num_devices": 2}))
    forced = {"cluster.num_devices": 2, "split.patterns": {
        "fc1": "row", "fc2": "column", "logits": "column", "sparse_softmax_xent": "gather"}}
    assert plan_of(megatron_mlp(True), forced).task_graphs[0].patterns == forced["split.patterns"]
    assert_equivalent(reference, train(megatron_mlp(True), DATA, forced))


def test_forcing_a_pattern_that_does_not_match_is_named():
    config = {"cluster.num_devices": 2, "split.patterns": {"sparse_softmax_xent": "nope"}}
    with pytest.raises(wh.ConfigError, match="forces 'nope' on ShardingUnit "
                                            "'sparse_softmax_xent'.*distributed, gather"):
        plan_of(megatron_mlp(True), config)


def test_variables_are_sharded_across_devices():
    """Each device holds 1/n of the split weights; no full weight exists."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 4})
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        classifier(True, classes=1000)(x, y)
        kernels = [op for op in graph.get_operations()
                   if op.type == "VarHandleOp" and op.name.startswith("logits/kernel")]
        names = sorted(v.op.name for v in v1.global_variables())
    wh.reset()
    assert sorted(k.get_attr("shape").dim[1].size for k in kernels) == [250] * 4
    assert sorted(k.device.rsplit(":", 1)[-1] for k in kernels) == ["0", "1", "2", "3"]
    assert "logits/kernel/part_0" in names and "logits/kernel" not in names


def test_argmax_accuracy_over_split_logits():
    def run(tfpar):
        graph = tf.Graph()
        with graph.as_default():
            if tfpar:
                wh.init({"cluster.num_devices": 4})
            x = v1.placeholder(tf.float32, [None, 6])
            with scope(tfpar, "split", 4):
                logits = layer(x, 10, "logits", seed=2)
                predictions = tf.argmax(logits, 1)
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
                out = sess.run(predictions, {x: DATA[0][0]})
        if tfpar:
            wh.reset()
        return out, ran_on(graph)
    split, devices = run(True)
    np.testing.assert_array_equal(split, run(False)[0])
    assert len(devices) == 4  # one shard of the logits per device


@pytest.mark.parametrize("backend", ["auto", "collective"])
def test_nested_data_parallelism_around_a_split(backend):
    """split(2) on 4 devices: two copies of the split head, each on 2 devices."""
    config = {"cluster.num_devices": 4, "communication.backend": backend}
    build = classifier(False)
    staged = classifier(True, backbone=None, devices=2)
    assert plan_of(staged, config).data_parallel_degree == 2
    assert_equivalent(train(build, DATA), train(staged, DATA, config))


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
def test_pipeline_into_a_split_stage():
    """replicate(1) stage then split(2) stage on 3 devices, 2 micro-batches."""
    config = {"cluster.num_devices": 3, "pipeline.num_micro_batch": 2}
    assert_equivalent(train(classifier(False), DATA),
                      train(_pipelined_classifier(), DATA, config))


def _pipelined_classifier():
    def build(x, y):
        with wh.replicate(1):
            features = dense(x, 8, "features", seed=1, activation=tf.nn.tanh)
        with wh.split(2):
            logits = layer(features, 10, "logits", seed=2)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def two_split_stages(tfpar, second="split", devices=(2, 2), micro=2):
    """Bridges out of a split stage: split -> split on the same devices reads the
    shards (gather and partition along the class dimension fused away);
    split -> replicate gathers them along the split dimension."""
    def build(x, y):
        with scope(tfpar, "split", devices[0]):
            h = layer(x, 12, "fc1", seed=1, activation=tf.nn.tanh)
        with scope(tfpar, second, devices[1]):
            logits = layer(h, 10, "logits", seed=2)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
@pytest.mark.parametrize("second,devices,num_devices", [
    ("split", (2, 2), 2), ("replicate", (2, 1), 3), ("split", (2, 3), 5)])
def test_bridges_out_of_split_stages(second, devices, num_devices):
    config = {"cluster.num_devices": num_devices, "pipeline.num_micro_batch": 2,
              "cluster.colocate_split_and_replicate": second == "split" and num_devices == 2}
    assert_equivalent(train(two_split_stages(False, second, devices), DATA),
                      train(two_split_stages(True, second, devices), DATA, config))


def test_split_to_split_on_the_same_devices_needs_no_gather():
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2, "cluster.colocate_split_and_replicate": True})
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        two_split_stages(True)(x, y)
        plan = wh.current_plan()
        fc1_out = [op for op in graph.get_operations() if op.name.startswith("fc1/")
                   and op.type == "ConcatV2"]
    wh.reset()
    assert plan.task_graphs[1].patterns["logits"] == "row"  # reads fc1's column shards
    assert [c.name for op in fc1_out for c in op.outputs[0].consumers()
            if c.type == "MatMul"] == []


def embedding_model(tfpar, devices=2):
    """A vocabulary-sharded table (tf.nn.embedding_lookup and tf.gather) and a
    row-split projection (tf.matmul on a variable made in the split scope)."""
    def build(ids, y):
        with scope(tfpar, "split", devices):
            rng = np.random.RandomState(5)
            table = v1.get_variable("table", initializer=rng.randn(20, 6).astype(np.float32))
            emb = tf.nn.embedding_lookup(table, ids[:, 0]) + tf.gather(table, ids[:, 1])
            proj = v1.get_variable("proj", initializer=rng.randn(6, 8).astype(np.float32))
            h = tf.tanh(tf.matmul(emb, proj))
        logits = dense(h, 3, "head", seed=4)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdagradOptimizer(0.3).minimize(loss)
    return build


@pytest.mark.parametrize("devices", [2, 3])
def test_vocabulary_sharded_embedding_and_row_split_matmul(devices):
    rng = np.random.RandomState(3)
    data = (rng.randint(0, 20, size=(3, 8, 2)).astype(np.int64),
            rng.randint(0, 3, size=(3, 8)).astype(np.int64))
    config = {"cluster.num_devices": devices}
    assert_equivalent(train(embedding_model(False), data),
                      train(embedding_model(True, devices), data, config))
    plan = plan_of(embedding_model(True, devices), config, tf.int64, (None, 2))
    assert plan.task_graphs[0].patterns == {"embedding": "vocab", "embedding_1": "vocab",
                                            "matmul": "sharded"}


EXPERTS, MODEL, HIDDEN = 4, 6, 5


def expert_weights():
    """[experts, model, hidden] and [experts, hidden, model] expert weights."""
    rng = np.random.RandomState(6)
    return (v1.get_variable("experts/w1", initializer=(0.5 * rng.randn(
                EXPERTS, MODEL, HIDDEN)).astype(np.float32)),
            v1.get_variable("experts/w2", initializer=(0.5 * rng.randn(
                EXPERTS, HIDDEN, MODEL)).astype(np.float32)))


def moe_model(tfpar, devices=4):
    """Whale Example 5: data-parallel gating by default, experts in a split scope.
    Expert weights [experts, ...] are split by expert; each device runs its
    experts on the tokens, and the gate-weighted combination sums over devices."""
    def gating_dispatch(x):
        h = dense(x, MODEL, "embed", seed=1, activation=tf.nn.tanh)
        return tf.nn.softmax(dense(h, EXPERTS, "gate", seed=2)), h

    def moe(combined_weights, dispatch_inputs):
        w1, w2 = expert_weights()
        hidden = tf.nn.relu(tf.einsum("bd,edh->beh", dispatch_inputs, w1))
        outputs = tf.einsum("beh,ehd->bed", hidden, w2)
        return tf.einsum("be,bed->bd", combined_weights, outputs)

    def build(x, y):
        if tfpar:
            wh.set_default_strategy(wh.replicate(devices))
        combined_weights, dispatch_inputs = gating_dispatch(x)
        with scope(tfpar, "split", devices):
            outputs = moe(combined_weights, dispatch_inputs)
        logits = dense(outputs, 3, "head", seed=3)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def test_whale_example_5_mixture_of_experts():
    data = make_data(steps=3, batch=8, classes=3)
    config = {"cluster.num_devices": 4}
    assert_equivalent(train(moe_model(False), data), train(moe_model(True), data, config))
    plan = plan_of(moe_model(True), config)
    assert [tg.strategy for tg in plan.task_graphs] == ["replicate", "split", "replicate"]
    assert plan.task_graphs[1].patterns == {"einsum": "sharded", "einsum_1": "sharded",
                                            "einsum_2": "sharded"}


def dispatched_moe(tfpar, devices=4, combined_outside=False):
    """Whale Example 5 as the paper writes it: gating *and dispatch* under the
    default replicate strategy, so the split experts read ``[E, B, D]`` expert
    inputs whose batch is on axis 1; the combination inside the split scope,
    or (``combined_outside``) under the default strategy too, reading the
    experts' ``[E, B, D]`` outputs."""
    def build(x, y):
        if tfpar:
            wh.set_default_strategy(wh.replicate(devices))
        h = dense(x, MODEL, "embed", seed=1, activation=tf.nn.tanh)
        gates = tf.nn.softmax(dense(h, EXPERTS, "gate", seed=2))
        dispatch_inputs = tf.einsum("be,bd->ebd", gates, h)
        with scope(tfpar, "split", devices):
            w1, w2 = expert_weights()
            hidden = tf.nn.relu(tf.einsum("ebd,edh->ebh", dispatch_inputs, w1))
            expert_outputs = tf.einsum("ebh,ehd->ebd", hidden, w2)
            if not combined_outside:
                outputs = tf.einsum("be,ebd->bd", gates, expert_outputs)
        if combined_outside:
            outputs = tf.einsum("ebd,be->bd", expert_outputs, gates)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(outputs, 3, "head", seed=3))
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


@pytest.mark.parametrize("combined_outside", [False, True], ids=["combined-inside",
                                                                 "combined-outside"])
def test_whale_example_5_as_written_with_dispatch_outside_the_split(combined_outside):
    """Before: PlanError "'einsum/Einsum:0' ... is not batch-major". The bridge
    into the split scope regroups the expert inputs along their batch axis 1,
    and the bridge out of it the experts' outputs (before, combined outside:
    PlanError "'einsum_2/gather_shards_1:0' ... cannot tell which of its axes
    holds the batch rows": the batch axis was lost where the split scope
    slices the expert inputs by expert)."""
    data = make_data(steps=3, batch=8, classes=3)
    assert_equivalent(train(dispatched_moe(False, combined_outside=combined_outside), data),
                      train(dispatched_moe(True, combined_outside=combined_outside), data,
                            {"cluster.num_devices": 4}))


@pytest.mark.parametrize("model,config", [
    (classifier, {"cluster.num_devices": 4}),
    (megatron_mlp, {"cluster.num_devices": 2, "cluster.hardware": ["V100-32GB", "P100-16GB"]})],
    ids=["even", "by-speed"])
def test_checkpoints_restore_between_split_and_single_device(tmp_path, model, config):
    """Split weights are saved as slices of their single-device names and
    shapes, of any width (shards by speed on a V100 and a P100: 10 / 6)."""
    first, second = (DATA[0][:1], DATA[1][:1]), (DATA[0][1:], DATA[1][1:])
    single, split = str(tmp_path / "single"), str(tmp_path / "split")
    checkpoint_session(model(False), None, single, None, first)
    checkpoint_session(model(True), None, split, config, first)
    assert sorted(tf.train.list_variables(single)) == sorted(tf.train.list_variables(split))
    reference = checkpoint_session(model(False), single, None, None, second)
    assert_equivalent(reference, checkpoint_session(model(True), single, None, config, second))
    assert_equivalent(reference, checkpoint_session(model(False), split, None, None, second),
                      parallel=False)


def default_classifier(tfpar, initial=None):
    """build(x, y): a 10-class dense head and its cross-entropy, split over 2
    devices under tfpar, made with TensorFlow's default initializers (seeded:
    the same draw every run) or, given ``initial`` values, from those."""
    def build(x, y):
        if initial is None:
            tf.keras.utils.set_random_seed(4)  # keras initializers ignore the graph seed
        given = {} if initial is None else {
            f"{name}_initializer": v1.constant_initializer(initial[f"logits/{name}"])
            for name in ("kernel", "bias")}
        with scope(tfpar, "split", 2):
            logits = v1.layers.dense(x, 10, name="logits", **given)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def test_default_initializers_in_a_split_scope():
    """Layers without explicit initializers get TensorFlow's (glorot / zeros)
    of the whole variable, sliced per shard through partition_info: the
    kernel within glorot's limit for 6 x 10 (a shard's own 6 x 5 draw would
    reach 0.74), the bias zeros; and from those values the split head trains
    as one device does from the same."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2})
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss, train_op = default_classifier(True)(x, y)
        variables = v1.global_variables()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            initial = variable_values(sess, variables)
            losses = [sess.run([loss, train_op], {x: a, y: b})[0] for a, b in zip(*DATA)]
            trained = variable_values(sess, variables)
    wh.reset()
    assert_equivalent(train(default_classifier(False, initial), DATA),
                      (np.array(losses), trained))
    assert sum("logits/bias" in v.op.name for v in variables) == 2, "the bias is not split"
    kernel, limit = initial["logits/kernel"], np.sqrt(6 / (6 + 10))
    assert kernel.shape == (6, 10) and np.abs(kernel).max() <= limit, (
        f"kernel values up to {np.abs(kernel).max():.3f}: not glorot's draw for the whole "
        f"6 x 10 kernel (at most {limit:.3f})")
    np.testing.assert_array_equal(initial["logits/bias"], np.zeros(10, np.float32))


def seeded_classifier(tfpar):
    def build(x, y):
        with scope(tfpar, "split", 2):
            logits = v1.layers.dense(x, 10, name="logits",
                                     kernel_initializer=v1.glorot_uniform_initializer(seed=3))
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def test_seeded_random_initializers_give_the_single_device_values():
    """A seeded initializer draws the whole variable once per shard and keeps
    its slice: shards hold exactly the single-device values."""
    assert_equivalent(train(seeded_classifier(False), DATA),
                      train(seeded_classifier(True), DATA, {"cluster.num_devices": 2}))


NN_LOSSES = {
    "nn_sparse": lambda y, z: tf.reduce_mean(
        tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=z)),
    "nn_dense": lambda y, z: tf.reduce_mean(
        tf.nn.softmax_cross_entropy_with_logits(labels=tf.one_hot(y, 10), logits=z)),
    "v1_nn_sparse": lambda y, z: tf.reduce_mean(
        v1.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=z)),
}


@pytest.mark.parametrize("name", NN_LOSSES)
def test_tf_nn_cross_entropies_are_distributed(name):
    def build_for(tfpar):
        def build(x, y):
            with scope(tfpar, "split", 2):
                loss = NN_LOSSES[name](y, layer(x, 10, "logits", seed=2))
            return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        return build
    config = {"cluster.num_devices": 2}
    assert_equivalent(train(build_for(False), DATA), train(build_for(True), DATA, config))
    assert "distributed" in plan_of(build_for(True), config).task_graphs[0].patterns.values()


CAPACITY = 4


def gshard_moe(tfpar, devices=4):
    """Top-1 routed experts (GShard-style einsums): the dispatch einsum sends each
    device's token rows to their experts' devices and the combine einsum sends
    them back (all-to-all), expert weights split by expert in between."""
    def route(gates):
        expert = tf.argmax(gates, 1)
        chosen = tf.one_hot(expert, EXPERTS)                              # [b, e]
        position = tf.cast(tf.reduce_sum(tf.cumsum(chosen, 0, exclusive=True) * chosen, 1),
                           tf.int64)
        kept = tf.cast(position < CAPACITY, tf.float32)[:, None, None]
        dispatch = chosen[:, :, None] * tf.one_hot(position, CAPACITY)[:, None, :] * kept
        return dispatch, dispatch * gates[:, :, None]                     # [b, e, c]

    def build(x, y):
        if tfpar:
            wh.set_default_strategy(wh.replicate(devices))
        tokens = dense(x, MODEL, "embed", seed=1, activation=tf.nn.tanh)
        gates = tf.nn.softmax(dense(tokens, EXPERTS, "gate", seed=2))
        with scope(tfpar, "split", devices):
            dispatch, combine = route(gates)
            rng = np.random.RandomState(6)
            w1 = v1.get_variable("experts/w1", initializer=(0.5 * rng.randn(
                EXPERTS, MODEL, HIDDEN)).astype(np.float32))
            w2 = v1.get_variable("experts/w2", initializer=(0.5 * rng.randn(
                EXPERTS, HIDDEN, MODEL)).astype(np.float32))
            expert_inputs = tf.einsum("bec,bd->ecd", dispatch, tokens)
            hidden = tf.nn.relu(tf.einsum("ecd,edh->ech", expert_inputs, w1))
            expert_outputs = tf.einsum("ech,ehd->ecd", hidden, w2)
            outputs = tf.einsum("bec,ecd->bd", combine, expert_outputs)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(outputs, 3, "head", seed=3))
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


@pytest.mark.parametrize("devices", [2, 4])
def test_mixture_of_experts_all_to_all_dispatch_and_combine(devices):
    data = make_data(steps=3, batch=8, classes=3)
    config = {"cluster.num_devices": devices}
    assert_equivalent(train(gshard_moe(False), data),
                      train(gshard_moe(True, devices), data, config))
    patterns = plan_of(gshard_moe(True, devices), config).task_graphs[1].patterns
    assert patterns == {"einsum": "tokens", "einsum_1": "sharded", "einsum_2": "sharded",
                        "einsum_3": "tokens"}
    forced = {**config, "split.patterns": {"einsum": "replicated", "einsum_3": "sharded"}}
    assert_equivalent(train(gshard_moe(False), data), train(gshard_moe(True, devices), data,
                                                             forced))


def test_megatron_mlp_on_token_sequences():
    """Column then row dense layers on [batch, tokens, features] inputs."""
    rng = np.random.RandomState(0)
    data = (rng.randn(3, 8, 5, 6).astype(np.float32), rng.randint(0, 3, (3, 8)).astype(np.int64))

    def build_for(tfpar):
        def build(x, y):
            with scope(tfpar, "split", 2):
                h = layer(x, 16, "fc1", seed=1, activation=tf.nn.relu)
                h = layer(h, 6, "fc2", seed=2)
            logits = layer(tf.reduce_mean(h, 1), 3, "head", seed=3)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
            return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
        return build
    config = {"cluster.num_devices": 2}
    assert_equivalent(train(build_for(False), data), train(build_for(True), data, config))
    patterns = plan_of(build_for(True), config, shape=(None, 5, 6)).task_graphs[0].patterns
    assert patterns == {"fc1": "column", "fc2": "row"}


def auto_named_head(config):
    """A v1 dense head named automatically (its variables: dense_1/...)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        h = v1.layers.dense(x, 8, tf.nn.tanh)
        with wh.split(2):
            loss = v1.losses.sparse_softmax_cross_entropy(y, v1.layers.dense(h, 10))
        train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        patterns = wh.current_plan().task_graphs[-1].patterns
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, {x: DATA[0][0], y: DATA[1][0]})
    wh.reset()
    return patterns


def test_split_patterns_name_units_as_their_variables_and_refuse_unknown_names():
    """Before: {"nosuch": "row"} was accepted, and the unit of a head whose
    variables are dense_1/... could be named after keras' object name instead,
    so forcing it by the name users see did nothing."""
    assert auto_named_head({"cluster.num_devices": 2})["dense_1"] == "column"
    assert auto_named_head({"cluster.num_devices": 2,
                            "split.patterns": {"dense_1": "row"}})["dense_1"] == "row"
    with pytest.raises(wh.ConfigError, match="split.patterns names 'nosuch'.*units.*dense_1"):
        auto_named_head({"cluster.num_devices": 2, "split.patterns": {"nosuch": "row"}})


def swiglu_mlp(tfpar, style):
    """Llama's MLP, down(silu(gate(x)) * up(x)), as tf.compat.v1 code writes
    it (``tf.nn.silu`` between the layers) or keras (``swish`` activation,
    a ``Multiply`` layer); classifier after it."""
    def build(x, y):
        with scope(tfpar, "split", 2):
            if style == "v1":
                gated = tf.nn.silu(layer(x, 16, "gate", seed=1)) * layer(x, 16, "up", seed=2)
            else:
                init = [tf.keras.initializers.GlorotUniform(seed=s) for s in (1, 2)]
                gated = tf.keras.layers.Multiply()([
                    tf.keras.layers.Dense(16, "swish", kernel_initializer=init[0], name="gate")(x),
                    tf.keras.layers.Dense(16, kernel_initializer=init[1], name="up")(x)])
            logits = layer(layer(gated, 8, "down", seed=3), 10, "logits", seed=4)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


@pytest.mark.parametrize("style", ["v1", "keras"])
def test_swiglu_acts_on_shards_between_its_column_and_row_layers(style):
    """gate and up split by columns; silu and the product act on each
    device's 8 of the 16 features, and down (row) reads those shards: the
    [rows, 16] product is never gathered. Trains like one device."""
    config = {"cluster.num_devices": 2}
    TRACER.take()
    result = train(swiglu_mlp(True, style), DATA, config)
    graph, = TRACER.graphs
    assert {k: v for k, v in TRACER.graphs[graph].plan.task_graphs[0].patterns.items()
            if k in ("gate", "up", "down")} == {"gate": "column", "up": "column", "down": "row"}
    executed = executed_nodes(TRACER.graphs[graph].run_metadata)
    down = [op for op in graph.get_operations() if op.type == "MatMul"
            and op.name.startswith("down/") and "gradients" not in op.name]
    assert [op.inputs[0].op.type for op in down] == ["Mul", "Mul"]
    assert [op.inputs[0].shape.as_list() for op in down] == [[None, 8], [None, 8]]
    assert sorted(d for op in down for d in executed[op.inputs[0].op.name]) == [
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)]
    assert_equivalent(train(swiglu_mlp(False, style), DATA), result)


def test_an_optimizer_applied_inside_a_split_scope_keeps_one_slot_per_slice():
    """``minimize`` inside the scope (a model builder that trains itself, as
    ``tfpar/models/llama.py``'s does): Adam makes its slots of each slice of
    a ``get_variable`` weight with ``get_variable`` too, which the scope
    split again. Before: AttributeError ``'ShardedVariable' object has no
    attribute '_set_save_slice_info'``."""
    def build(tfpar):
        def model(x, y):
            with scope(tfpar, "split", 2):
                logits = dense(x, 10, "logits", seed=2)  # a get_variable kernel: split
                loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
                return loss, v1.train.AdamOptimizer(0.01).minimize(loss)
        return model
    assert_equivalent(train(build(False), DATA),
                      train(build(True), DATA, {"cluster.num_devices": 2}))
