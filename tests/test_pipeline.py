"""Equivalence: pipelines of TaskGraphs (Whale §3.1.2, §4) vs single-device TF."""
import contextlib
import json

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from equivalence import (assert_equivalent, deep_mlp, dense, fed_graph, initialized, make_data,
                         plan_of, traced_first_step, train)

import tfpar as wh
from tfpar.runtime.graph_state import existing_state
from tfpar.ir.schedule import build_schedule

DATA = make_data(steps=3, batch=8)
v1 = tf.compat.v1


def stage(tfpar: bool, devices: int = 1):
    """The scope of one pipeline stage: replicate(devices) under tfpar, nothing plainly."""
    return wh.replicate(devices) if tfpar else contextlib.nullcontext()


def mlp_stages(num_stages, tfpar, optimizer=lambda: v1.train.GradientDescentOptimizer(0.5),
               widths=None, units=8):
    """build(x, y): a tanh MLP with one hidden layer of ``units`` per stage
    (stage s a replicate(widths[s]) scope); the logits and the loss are built
    in the last stage, the optimizer outside every scope."""
    widths = widths or [1] * num_stages

    def build(x, y):
        h = x
        for s in range(num_stages):
            with stage(tfpar, widths[s]):
                h = dense(h, units, f"stage{s}", seed=s, activation=tf.nn.tanh)
                if s == num_stages - 1:
                    logits = dense(h, 3, "logits", seed=99)
                    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, optimizer().minimize(loss)
    return build


@pytest.fixture(scope="module")
def two_stage_reference():
    return train(mlp_stages(2, False), DATA)


def test_whale_example_1(two_stage_reference):
    """Example 1 as written: two replicate(1) stages, num_micro_batch 4."""
    config = {"num_micro_batch": 4, "cluster.num_devices": 2}
    assert_equivalent(two_stage_reference, train(mlp_stages(2, True), DATA, config))


# What each of 2 stage devices runs, 4 micro-batches, by hand: GPipe all
# forwards, then all backwards; 1F1B warms stage s up with p - s - 1 = 1, 0
# forwards, then alternates; kFkB is 1F1B over groups of k ({0, 1}, {2, 3}
# for k = 2; one group, GPipe, for k = 4); zero-bubble (ZB-H1) keeps 1F1B's
# F and B and puts each W m just before F m+2 (p = 2 in flight), a W after
# each B once the forwards are done; stage 0 sends no gradient, so its
# backward is W alone.
SCHEDULES_RUN = {
    ("gpipe", 1): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"],
    ("1f1b", 1): ["F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3"],
    ("kfkb", 2): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 B0 B1 F2 F3 B2 B3"],
    ("kfkb", 4): ["F0 F1 F2 F3 B0 B1 B2 B3", "F0 F1 F2 F3 B0 B1 B2 B3"],
    ("zero_bubble", 1): ["F0 F1 W0 F2 W1 F3 W2 W3", "F0 B0 F1 B1 W0 F2 B2 W1 F3 B3 W2 W3"],
}


@pytest.mark.parametrize("schedule,group_size", list(SCHEDULES_RUN))
def test_every_schedule(schedule, group_size, two_stage_reference):
    """Each schedule computes the single-device numbers, and in every step
    each stage device ran its tasks in the schedule's order (kFkB with a
    fixed k too), one after another."""
    config = {"pipeline.num_micro_batch": 4, "cluster.num_devices": 2,
              "pipeline.schedule": schedule, "pipeline.group_size": group_size}
    timelines = []
    assert_equivalent(two_stage_reference,
                      train(mlp_stages(2, True), DATA, config, timelines=timelines))
    assert len(timelines) == len(DATA[0]), "a step has no timeline"
    for result in timelines:
        assert_follows(result, [stage.split() for stage in SCHEDULES_RUN[schedule, group_size]])


def test_ada_grouper_tunes_k(two_stage_reference):
    """pipeline.group_size 'auto': Ada-Grouper picks k by the cost model; slow
    links (low bandwidth) favour larger groups."""
    slow = {"name": "slow-link", "tflops": 1000, "memory_gb": 16}
    config = {"pipeline.num_micro_batch": 4, "cluster.num_devices": 2,
              "pipeline.schedule": "kfkb", "pipeline.group_size": "auto",
              "cluster.hardware": [slow]}
    plan = plan_of(mlp_stages(2, True), config)
    assert isinstance(plan.group_size, int) and plan.group_size > 1
    assert_equivalent(two_stage_reference, train(mlp_stages(2, True), DATA, config))
    result, _ = traced_step(config)  # what runs is kFkB with the tuned k
    assert_follows(result, build_schedule("kfkb", 2, 4, plan.group_size))


def test_four_stages():
    config = {"pipeline.num_micro_batch": 4, "cluster.num_devices": 4}
    assert_equivalent(train(mlp_stages(4, False), DATA),
                      train(mlp_stages(4, True), DATA, config))


@pytest.mark.parametrize("backend", ["auto", "collective"])
def test_nested_data_parallel_pipeline(backend, two_stage_reference):
    """2 stages on 4 devices: the pipeline is replicated twice (Whale §3.2.1)."""
    config = {"pipeline.num_micro_batch": 2, "cluster.num_devices": 4,
              "communication.backend": backend}
    plan = plan_of(mlp_stages(2, True), config)
    assert plan.data_parallel_degree == 2
    assert [len(tg.devices) for tg in plan.task_graphs] == [2, 2]
    assert_equivalent(two_stage_reference, train(mlp_stages(2, True), DATA, config))


def test_pipeline_with_momentum_and_tf_data():
    build = mlp_stages(2, False, lambda: v1.train.MomentumOptimizer(0.1, 0.9))
    staged = mlp_stages(2, True, lambda: v1.train.MomentumOptimizer(0.1, 0.9))
    config = {"pipeline.num_micro_batch": 2, "cluster.num_devices": 2}
    assert_equivalent(train(build, DATA, use_dataset=True),
                      train(staged, DATA, config, use_dataset=True))


def test_ops_run_on_their_stage_device():
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"pipeline.num_micro_batch": 2, "cluster.num_devices": 2})
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss, train_op = mlp_stages(2, True)(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
        devices = {op.name: op.device for op in graph.get_operations()}
    wh.reset()
    assert devices["stage0/kernel"].endswith("CPU:0")
    assert devices["stage1/kernel"].endswith("CPU:1")
    # Backward ops follow the forward op they differentiate; updates follow the variable.
    assert devices["gradients/stage0/MatMul_grad/MatMul_1"].endswith("CPU:0")
    assert devices["gradients/stage1/MatMul_grad/MatMul_1"].endswith("CPU:1")
    assert devices["GradientDescent/update_stage1/kernel/ResourceApplyGradientDescent"
                   ].endswith("CPU:1")


def transformer(num_stages, tfpar, vocab=20, seq=4, hidden=8, heads=2, layers=2):
    """build(ids, y): a BERT-like encoder (embedding; pre-norm self-attention and
    MLP blocks) classifying the first token; its layers split evenly into stages,
    the embedding in the first, the classifier and loss in the last."""
    dh = hidden // heads

    def norm(h, name):
        with v1.variable_scope(name):
            gamma = v1.get_variable("gamma", initializer=np.ones(hidden, np.float32))
        mean, var = tf.nn.moments(h, [-1], keepdims=True)
        return (h - mean) * tf.math.rsqrt(var + 1e-6) * gamma

    def tokens_dense(h, units, name, seed, activation=None):
        out = dense(tf.reshape(h, [-1, int(h.shape[-1])]), units, name, seed, activation)
        return tf.reshape(out, [-1, seq, units])

    def heads_first(t):
        return tf.transpose(tf.reshape(t, [-1, seq, heads, dh]), [0, 2, 1, 3])

    def block(h, i):
        with v1.variable_scope(f"layer{i}"):
            a = norm(h, "ln_attention")
            q, k, v = (heads_first(tokens_dense(a, hidden, n, 10 * i + j))
                       for j, n in enumerate("qkv"))
            att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / np.sqrt(dh))
            ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, seq, hidden])
            h = h + tokens_dense(ctx, hidden, "out", 10 * i + 3)
            m = tokens_dense(norm(h, "ln_mlp"), 2 * hidden, "fc1", 10 * i + 4, tf.nn.tanh)
            return h + tokens_dense(m, hidden, "fc2", 10 * i + 5)

    def build(ids, y):
        per_stage = layers // num_stages
        for s in range(num_stages):
            with stage(tfpar):
                if s == 0:
                    table = v1.get_variable("embedding", initializer=np.random.RandomState(7)
                                            .randn(vocab, hidden).astype(np.float32))
                    h = tf.nn.embedding_lookup(table, ids)
                for i in range(s * per_stage, (s + 1) * per_stage):
                    h = block(h, i)
                if s == num_stages - 1:
                    logits = dense(h[:, 0, :], 3, "classifier", seed=50)
                    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
    return build


def test_bert_like_transformer_in_two_stages():
    rng = np.random.RandomState(11)
    data = (rng.randint(0, 20, size=(3, 8, 4)).astype(np.int64),
            rng.randint(0, 3, size=(3, 8)).astype(np.int64))
    config = {"pipeline.num_micro_batch": 4, "cluster.num_devices": 2}
    assert_equivalent(train(transformer(2, False), data),
                      train(transformer(2, True), data, config))


def traced_step(config, path=None, num_stages=2):
    """wh.step_timeline of one traced step of the ``num_stages``-stage MLP under ``config``."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss, train_op = mlp_stages(num_stages, True)(x, y)
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
        result = wh.step_timeline(metadata, path)
    wh.reset()
    return result, metadata


def assert_follows(result, schedule):
    """Every stage device ran its tasks in ``schedule`` order (tasks or their
    names, ``"F0"``), one after another."""
    for s, tasks in enumerate(schedule):
        ran = [t for t in result.tasks if t.stage == s]
        assert [str(t.task) for t in ran] == [str(t) for t in tasks], (
            f"stage {s} ran {' '.join(str(t.task) for t in ran)}; "
            f"the schedule says {' '.join(map(str, tasks))}")
        for before, after in zip(ran, ran[1:]):
            assert before.end <= after.start, f"stage {s}: {after.task} overlaps {before.task}"


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_traced_step_follows_the_schedule(schedule, tmp_path):
    """In a traced step every stage device runs its tasks in schedule order, each
    task's ops all after the previous task's; wh.step_timeline writes it."""
    result, _ = traced_step({"pipeline.num_micro_batch": 4, "cluster.num_devices": 2,
                             "pipeline.schedule": schedule}, str(tmp_path / "step.json"))
    assert_follows(result, build_schedule(schedule, 2, 4))
    # GPipe keeps every micro-batch's activations on stage 0; 1F1B at most 2.
    assert result.peak_in_flight[0] == (4 if schedule == "gpipe" else 2)
    trace = json.loads((tmp_path / "step.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == 2 * 2 * 4


@pytest.mark.parametrize("functions", [True, False])
@pytest.mark.parametrize("optimizer", [lambda: v1.train.GradientDescentOptimizer(0.5),
                                       lambda: v1.train.AdamOptimizer(0.05)])
def test_zero_bubble_in_four_stages_computes_the_single_device_numbers(optimizer, functions):
    """Issue 15: ZB-H1 on 4 stages, 8 micro-batches, each stage's backward two
    tasks (input gradients B, weight gradients W); as task functions or copies."""
    config = {"pipeline.num_micro_batch": 8, "cluster.num_devices": 4,
              "pipeline.schedule": "zero_bubble", "pipeline.task_functions": functions}
    assert_equivalent(train(mlp_stages(4, False, optimizer), DATA),
                      train(mlp_stages(4, True, optimizer), DATA, config))


def test_zero_bubble_traced_step_runs_weight_gradients_late(tmp_path):
    """A traced step follows ZB-H1: the first stage sends no gradient, so its
    backward is all weight gradients (W only); the last stage runs its W
    tasks after later micro-batches' F and B, as the schedule defers them."""
    config = {"pipeline.num_micro_batch": 8, "cluster.num_devices": 4,
              "pipeline.schedule": "zero_bubble"}
    result, _ = traced_step(config, str(tmp_path / "step.json"), num_stages=4)
    planned = build_schedule("zero_bubble", 4, 8)
    planned[0] = [t for t in planned[0] if t.kind != "B"]
    assert_follows(result, planned)
    trace = json.loads((tmp_path / "step.json").read_text())
    assert sum(e["ph"] == "X" for e in trace["traceEvents"]) == (2 + 3 * 3) * 8


def test_zero_bubble_weight_tasks_hold_the_weight_gradients():
    """B computes what the stage before waits for, W the weight gradients; a B
    call never waits on a W call (tf.gradients' gates are dropped: they order
    but compute nothing), so the stage before gets its gradient first."""
    config = {"pipeline.num_micro_batch": 4, "cluster.num_devices": 2,
              "pipeline.schedule": "zero_bubble"}
    with initialized(mlp_stages(2, True), config) as graph:
        bodies = {f.signature.name.split("tfpar_stage_")[1]: {node.name for node in f.node_def}
                  for f in graph.as_graph_def().library.function}
        assert set(bodies) == {"0_F", "0_W", "1_F", "1_B", "1_W"}  # stage 0 sends no gradient
        x_grad = "gradients/stage1/MatMul_grad/MatMul"
        w_grad = x_grad + "_1"
        assert x_grad in bodies["1_B"] and w_grad not in bodies["1_B"]
        assert w_grad in bodies["1_W"] and "gradients/stage1/add_grad/Sum" in bodies["1_W"]
        calls = {op.name: op for op in graph.get_operations()
                 if op.type == "StatefulPartitionedCall"}
        for name, call in calls.items():
            if name.endswith("/B"):
                assert not any(p.name.endswith("/W") for p in call.control_inputs), name


def test_plan_timeline_writes_the_planned_schedule(tmp_path):
    plan = plan_of(mlp_stages(2, True), {"pipeline.num_micro_batch": 4, "cluster.num_devices": 2})
    result = plan.timeline(str(tmp_path / "plan.json"), forward_time=1, backward_time=2)
    assert result.length == (4 + 2 - 1) * 3
    assert result.bubble_fraction == pytest.approx((2 - 1) / (4 + 2 - 1))
    trace = json.loads((tmp_path / "plan.json").read_text())
    rows = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"replicate_0 (CPU:0)", "replicate_1 (CPU:1)"} <= rows
    assert sum(e["cat"] in ("forward", "backward") for e in trace["traceEvents"]
               if e["ph"] == "X") == 2 * 2 * 4
    assert plan.simulate().length > 0  # default: op-count units


BRIDGED = [([2, 1], 3), ([1, 2], 3), ([2, 1], 6), ([2, 4], 6), ([4, 2], 6), ([2, 3], 5)]


@pytest.mark.parametrize("widths,devices", BRIDGED, ids=[f"{w}-on-{d}" for w, d in BRIDGED])
@pytest.mark.parametrize("backend", ["auto", "collective"])
def test_bridges_between_stages_of_different_widths(widths, devices, backend):
    """replicate(a) then replicate(b): stage rows are regrouped by bridge layers
    (Whale §3.2.3); with 6 devices [2, 1] is also nested twice."""
    data = make_data(steps=3, batch=12)
    config = {"pipeline.num_micro_batch": 2, "cluster.num_devices": devices,
              "communication.backend": backend}
    assert_equivalent(train(mlp_stages(2, False), data),
                      train(mlp_stages(2, True, widths=widths), data, config))


@pytest.mark.parametrize("widths,reads", [([2, 4], "SplitV"), ([4, 2], "ConcatV2"),
                                          ([2, 2], "producer")])
def test_bridge_fuses_gather_and_partition(widths, reads):
    """Splitting each producer's rows for narrower consumers needs no gather;
    gathering for wider ones needs no split; equal widths read directly."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 6 if widths != [2, 2] else 4})
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        mlp_stages(2, True, widths=widths)(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
        rw = existing_state(graph).rewrite.rewrite
        matmul = graph.get_operation_by_name("stage1/MatMul")
        hidden = rw.built_inputs(matmul)[0]  # what each version of stage 1 reads for it:
        read = [rw.bridges.tensor(hidden, 1, v).op for v in range(len(rw.versions(matmul)))]
        called = set(rw.versions(matmul))
        producers = rw.versions(hidden.op)
    wh.reset()
    assert len(read) == len(called) == widths[1]
    if reads == "producer":
        assert read == producers
    else:
        assert {op.type for op in read} == {reads}


@pytest.mark.parametrize("hardware,devices,first_stage", [
    (["T4", "V100-32GB"], 2, ["CPU:1"]),
    (["T4", "A100-80GB", "V100-32GB", "T4"], 4, ["CPU:1", "CPU:2"]),
    (["T4", "T4", {"name": "big", "tflops": 10, "memory_gb": 48}], 3, ["CPU:2"]),
])
@pytest.mark.filterwarnings("ignore:.*left idle:tfpar.FallbackWarning")  # 2 stages on 3
def test_earlier_stages_get_devices_with_more_memory(hardware, devices, first_stage):
    """Whale §3.3.2: with heterogeneous cluster.hardware, stage 0 (which keeps the
    most micro-batches in flight) goes to the devices with the most memory."""
    plan = plan_of(mlp_stages(2, True), {"cluster.num_devices": devices,
                                          "cluster.hardware": hardware,
                                          "pipeline.num_micro_batch": 2})
    assert [d.rsplit("device:", 1)[-1] for d in plan.task_graphs[0].devices] == first_stage
    used = [d for tg in plan.task_graphs for d in tg.devices]
    assert len(used) == len(set(used))


def test_unknown_or_miscounted_hardware_is_named():
    for hardware, match in ((["K80"], "unknown device 'K80'"),
                            (["T4", "T4", "T4"], "lists 3 devices but there are 2")):
        with tf.Graph().as_default():
            wh.init({"cluster.num_devices": 2, "cluster.hardware": hardware})
            x = v1.placeholder(tf.float32, [None, 6])
            y = v1.placeholder(tf.int64, [None])
            mlp_stages(2, True)(x, y)
            with pytest.raises(wh.ConfigError, match=match):
                wh.current_plan()
        wh.reset()


@pytest.mark.parametrize("devices", [2, 4])
def test_whale_example_4_num_task_graph_without_scopes(devices):
    """Example 4: no scopes, {"num_micro_batch": M, "num_task_graph": p}: the model
    is cut into p balanced stages automatically (nested DP on 4 devices)."""
    build = deep_mlp(4)
    config = {"num_micro_batch": 4, "num_task_graph": 2, "cluster.num_devices": devices}
    assert_equivalent(train(build, DATA), train(build, DATA, config))
    plan = plan_of(build, config)
    assert [tg.name for tg in plan.task_graphs] == ["stage_0", "stage_1"]
    assert plan.data_parallel_degree == devices // 2
    params = [tg.param_bytes for tg in plan.task_graphs]
    assert min(params) > 0 and max(params) <= 2 * min(params)  # balanced, no empty stage


def transposed_between_stages(tfpar):
    """A [features, batch] tensor crosses from a 2-wide stage to a 1-wide one."""
    def build(x, y):
        with scope(tfpar, 2):
            h = dense(x, 4, "first", seed=1)
            per_feature = tf.transpose(h)  # [4, batch]: the batch is on axis 1
        with scope(tfpar, 1):
            logits = dense(tf.transpose(per_feature), 3, "second", seed=2)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


def scope(tfpar, width):
    return wh.replicate(width) if tfpar else contextlib.nullcontext()


def test_a_bridge_regroups_rows_along_the_batch_axis():
    """Before: refused ("not batch-major"). The bridge follows the batch to
    axis 1 through the transpose and gathers along it."""
    assert_equivalent(train(transposed_between_stages(False), DATA),
                      train(transposed_between_stages(True), DATA, {"cluster.num_devices": 3}))


def test_a_bridge_refuses_tensors_reduced_over_the_batch():
    """A per-replica statistic (a mean over its rows) crossing stages of
    different widths has no rows to regroup: a clear error naming it."""
    def build(x, y):
        with wh.replicate(2):
            h = dense(x, 4, "first", seed=1)
            centre = tf.reduce_mean(h, 0)  # [4]: one value per replica's rows
        with wh.replicate(1):
            logits = dense(h - centre, 3, "second", seed=2)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    with pytest.raises(wh.PlanError, match="'Mean:0' .* cannot tell which of its axes"):
        train(build, DATA, {"cluster.num_devices": 3})
    wh.reset()


def deep_stages(layers_per_stage, tfpar=True):
    """build(x, y): 2 stages of ``layers_per_stage`` tanh layers each, Adam."""
    def build(x, y):
        h = x
        for s in range(2):
            with stage(tfpar, 1):
                for i in range(layers_per_stage):
                    h = dense(h, 8, f"stage{s}_{i}", seed=10 * s + i, activation=tf.nn.tanh)
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", seed=99))
        return loss, v1.train.AdamOptimizer(0.1).minimize(loss)
    return build


def rewritten_ops(build, config):
    """Ops in the graph after the rewrite (made at the first run)."""
    with initialized(build, config) as graph:
        return len(graph.get_operations())


@pytest.mark.parametrize("functions", [True, False], ids=["functions", "copies"])
def test_a_pipeline_trains_with_stage_functions_or_copies(functions):
    """Task functions (the default) and copies (``pipeline.task_functions``
    false, also the fallback for split stages) give the single-device numbers."""
    config = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 4,
              "pipeline.task_functions": functions}
    assert_equivalent(train(deep_stages(2, False), DATA), train(deep_stages(2), DATA, config))


def test_op_count_does_not_grow_with_micro_batches_times_ops():
    """Issue 18: each micro-batch adds a call per task (and a few ops of
    bookkeeping), not a copy of its stage: from 4 to 16 micro-batches a model
    3x deeper grows by as many ops; copies grow by the model's size."""
    def growth(layers, functions):
        config = {"cluster.num_devices": 2, "pipeline.task_functions": functions}
        return (rewritten_ops(deep_stages(layers), {**config, "pipeline.num_micro_batch": 16})
                - rewritten_ops(deep_stages(layers), {**config, "pipeline.num_micro_batch": 4}))
    shallow, deep = growth(1, True), growth(3, True)
    assert shallow == deep, (shallow, deep)
    assert shallow <= 12 * 2 * 10  # 12 more micro-batches x 2 stages x a few ops each
    assert growth(3, False) > 3 * deep  # copies: one of every stage op per micro-batch


def test_every_call_waits_on_a_reference_marker_on_its_device():
    """Issue 18: XLA's scan for reference variables, run when a session builds
    a step, instantiated every call's body twice (about 40% of the first step
    at 32 micro-batches); a call that a reference-typed op precedes is not
    looked into. Each call waits on its device's marker, which is in no
    variable collection (savers and initializers never see it)."""
    config = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 4}
    with initialized(deep_stages(1), config) as graph:
        calls = [op for op in graph.get_operations() if op.type == "StatefulPartitionedCall"]
        assert len(calls) == 2 * 2 * 4
        markers = set()
        for call in calls:
            marker, = [op for op in call.control_inputs if op.type == "VariableV2"]
            assert marker.device == call.device and marker.outputs[0].dtype._is_ref_dtype
            markers.add(marker)
        assert len(markers) == 2 and {c.device for c in calls} == {m.device for m in markers}
        variables = v1.global_variables() + v1.local_variables()
        assert not markers & {v.op for v in variables}


def _grappler_of(session_config, build, config):
    """(the session's RewriterConfig, the RewriterConfigs of the task function
    calls) of ``build`` under ``config``, in a session made with
    ``session_config`` and initialized once (tfpar rewrites the graph then)."""
    with fed_graph(config) as (graph, x, y):
        build(x, y)
        with v1.Session(config=session_config) as sess:
            sess.run(v1.global_variables_initializer())
            session_rewrites = sess._config.graph_options.rewrite_options  # pylint: disable=protected-access
        calls = []
        for op in graph.get_operations():
            if op.type == "StatefulPartitionedCall":
                proto = config_pb2.ConfigProto.FromString(op.get_attr("config_proto"))
                calls.append(proto.graph_options.rewrite_options)
        return session_rewrites, calls


def test_task_function_calls_optimize_their_bodies_and_the_session_does_not():
    """Issue 18: grappler on a step graph of calls cost about 2 s of a 5 s
    pipeline start-up; a session of a graph that trains with task functions
    and micro-batches runs it off, and each call optimizes its body when
    instantiated. A script that sets grappler's options keeps them, its calls
    then optimizing nothing twice; so do data parallelism without
    micro-batches (a call per function and device: grappler optimizes each
    function once with the step graph) and a graph that does not train."""
    config = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 4}
    session, calls = _grappler_of(None, deep_stages(1), config)
    assert session.disable_meta_optimizer
    assert len(calls) == 2 * 2 * 4 and not any(c.disable_meta_optimizer for c in calls)

    mine = v1.ConfigProto()
    mine.graph_options.rewrite_options.constant_folding = rewriter_config_pb2.RewriterConfig.OFF
    session, calls = _grappler_of(mine, deep_stages(1), config)
    assert not session.disable_meta_optimizer
    assert session.constant_folding == rewriter_config_pb2.RewriterConfig.OFF
    assert calls and all(c.disable_meta_optimizer for c in calls)

    session, calls = _grappler_of(None, deep_stages(1, False), {"cluster.num_devices": 2})
    assert not session.disable_meta_optimizer
    assert len(calls) == 2 * 2 and all(c.disable_meta_optimizer for c in calls)

    def forward_only(x, y):
        dense(x, 3, "logits", seed=1)
    session, calls = _grappler_of(None, forward_only, config)
    assert not session.disable_meta_optimizer and not calls


def _kernels_per_step(session_config):
    """Kernels a traced data-parallel step of ``deep_stages`` runs on 2 devices
    without micro-batches, in a session made with ``session_config``."""
    with fed_graph({"cluster.num_devices": 2}) as (graph, x, y):
        loss, train = deep_stages(2, False)(x, y)
        feed = {x: np.ones((8, 6), np.float32), y: np.zeros(8, np.int64)}
        with v1.Session(config=session_config) as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train, feed)
            metadata = config_pb2.RunMetadata()
            sess.run(train, feed, options=config_pb2.RunOptions(trace_level=3),
                     run_metadata=metadata)
            rewrites = sess._config.graph_options.rewrite_options  # pylint: disable=protected-access
    return sum(len(d.node_stats) for d in metadata.step_stats.dev_stats), rewrites


def test_data_parallel_sessions_optimize_the_bodies_of_their_calls():
    """Without micro-batches grappler's function optimizer stays on, as it is
    what optimizes the task functions' bodies there (it was off: a 4-device MLP
    step ran 936 kernels instead of 740 and took 1.1x MirroredStrategy's step,
    benchmarks/overhead.py): a tfpar session runs as many kernels per step as
    one whose script turned the function optimizer on itself."""
    kernels, rewrites = _kernels_per_step(None)
    mine = v1.ConfigProto()
    mine.graph_options.rewrite_options.function_optimization = rewriter_config_pb2.RewriterConfig.ON
    asked, _ = _kernels_per_step(mine)
    assert rewrites.function_optimization != rewriter_config_pb2.RewriterConfig.OFF
    assert kernels == asked, (kernels, asked)


def test_task_functions_hold_the_constants_they_read():
    """A constant a task reads is copied into its body, not returned by the
    forward task and passed to every backward call (a stage of the start-up
    benchmark's transformer passed ~30: gelu's, moments' axes, transposes')."""
    def build(x, y):
        with stage(True):
            h = tf.nn.gelu(dense(x, 8, "first", seed=1))
        with stage(True):
            logits = dense(h, 3, "second", seed=2)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdamOptimizer(0.1).minimize(loss)
    config = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 4}
    with initialized(build, config) as graph:
        functions = graph.as_graph_def().library.function
        assert len(functions) == 4
        for f in functions:
            kinds = {node.name: node.op for node in f.node_def}
            returned = [ref.split(":")[0] for ref in f.ret.values()]
            assert "Const" not in {kinds[name] for name in returned}, f.signature.name
