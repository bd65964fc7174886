"""Memory techniques applied to graphs (issue 15): activation recomputation
(``memory.recompute``) computes the same numbers, and a traced step shows the
recomputed forward running in the backward (in pipelines on its stage's
devices, in split TaskGraphs on its shards'); an offloaded optimizer
(``memory.offload_optimizer``) updates on the host."""
import collections
import contextlib
import re

import numpy as np
import pytest
import tensorflow as tf

from equivalence import (assert_equivalent, deep_mlp, dense, fed_graph, layer, make_data,
                         plan_of, traced_first_step, train)
import tfpar as wh
from test_expert_plans import gpt_loss
from tfpar.planner.memory import HOST_LINK_BYTES_S, HOST_MEMORY_BYTES_S
from tfpar.runtime.step_trace import executed_ops

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=16)
RECOMPUTED = ["block1", "block2", "block3"]


def blocks(count, optimizer=lambda: v1.train.GradientDescentOptimizer(0.5),
           loss=v1.losses.sparse_softmax_cross_entropy):
    """build(x, y): ``count`` name scopes block0.. of two tanh layers of width 8
    (the second's input and both activations live inside the block), a
    3-class head, plain SGD unless ``optimizer`` makes another."""
    def build(x, y):
        h = x
        for i in range(count):
            with v1.variable_scope(f"block{i}"):
                h = dense(h, 8, "inner", seed=2 * i, activation=tf.nn.tanh)
                h = dense(h, 8, "outer", seed=2 * i + 1, activation=tf.nn.tanh)
        mean = loss(y, dense(h, 3, "logits", seed=99))
        return mean, optimizer().minimize(mean)
    return build


def is_matmul(node_name, layers, activation="$^"):
    """Whether a traced node is the MatMul of a dense layer named by the regex
    ``layers``: on CPUs where oneDNN is on (AVX-512), grappler fuses the MatMul
    with its bias add, and with its activation (named by the regex
    ``activation``) where nothing else reads the sum, into a node named after
    the last op fused."""
    return re.search(rf"(^|/)(({layers})/(MatMul|add)|{activation})$", node_name) is not None


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
                      if is_matmul(name, "logits") and "grad" not in name)
    recomputed = {name: times for name, times in nodes.items() if "_recompute/" in name
                  and is_matmul(name, "inner", activation=r"block\d/Tanh")}
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
        train(build, DATA, {"cluster.num_devices": 1, "memory.recompute": ["noisy"]})


def test_a_recomputed_scope_that_does_not_exist_is_named():
    with pytest.raises(wh.PlanError, match="memory.recompute names 'layer9'"):
        train(deep_mlp(2), DATA, {"cluster.num_devices": 1, "memory.recompute": ["layer9"]})


PIPELINES = {
    "1f1b, stage functions": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
    "1f1b, stage copies": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2,
                           "pipeline.task_functions": False},
    "zero bubble, 2 replicas": {"cluster.num_devices": 4, "pipeline.num_micro_batch": 4,
                                "pipeline.schedule": "zero_bubble"},
}


@pytest.mark.parametrize("pipeline", PIPELINES.values(), ids=PIPELINES)
def test_recomputed_scopes_in_a_pipeline_run_in_their_stage(pipeline):
    """Two stages of four blocks (block1 spans the cut): the same numbers as
    plain TF; in a traced step each copy ran once per micro-batch and replica
    (in a stage function or as a copy of the stage), on the devices of the op
    it copies, after the first forward reached the logits."""
    config = {**pipeline, "auto.num_task_graph": 2, "memory.recompute": RECOMPUTED[:2]}
    build = blocks(4)
    assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-6)
    with fed_graph(config) as (graph, x, y):
        _, train_op = build(x, y)
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
    ran_on = executed_ops(metadata)
    copies = {name: devices for name, devices in ran_on.items() if "_recompute/" in name}
    runs = collections.Counter(re.sub(r"^tfpar/stage_\d+/replica_\d+/micro_\d+/", "",
                                      node.node_name)
                               for device in metadata.step_stats.dev_stats
                               for node in device.node_stats if "_recompute/" in node.node_name)
    copies_per_op = pipeline["pipeline.num_micro_batch"] * pipeline["cluster.num_devices"] // 2
    assert runs and set(runs.values()) == {copies_per_op}, runs
    for name, devices in copies.items():
        original = re.sub(r"block\d_recompute/", "", name)
        assert devices == ran_on.get(original, devices), (name, devices, ran_on[original])
    assert any(re.sub(r"block\d_recompute/", "", name) in ran_on for name in copies)
    nodes = [(node.node_name, node.all_start_micros, node.all_start_micros
              + node.all_end_rel_micros)
             for device in metadata.step_stats.dev_stats for node in device.node_stats]
    first_logits = min(end for name, _, end in nodes
                       if is_matmul(name, "logits") and "grad" not in name)
    assert all(start >= first_logits for name, start, _ in nodes if "_recompute/" in name
               and is_matmul(name, "inner|outer"))


def split_block(split):
    """build(x, y): a name scope ``block`` of two tanh layers (keras-style
    v1 dense, so a split scope shards them: Megatron's column then row) and
    a 10-class head, all in ``wh.split(2)`` when ``split``; Momentum."""
    def build(x, y):
        with wh.split(2) if split else contextlib.nullcontext():
            with v1.variable_scope("block"):
                h = layer(x, 16, "fc1", seed=1, activation=tf.nn.tanh)
                h = layer(h, 8, "fc2", seed=2, activation=tf.nn.tanh)
            loss = v1.losses.sparse_softmax_cross_entropy(y, layer(h, 10, "logits", seed=3))
        return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return build


def test_a_recomputed_scope_in_a_split_task_graph_runs_on_its_shards():
    """The split block recomputed: the same numbers as plain TF; in a traced
    step the copies of fc1's shards (their MatMuls and the tanh fc2's
    weight gradient reads) ran on both devices, each where its original ran."""
    data = make_data(steps=3, batch=16, classes=10)
    config = {"cluster.num_devices": 2, "memory.recompute": ["block"]}
    assert_equivalent(train(split_block(False), data), train(split_block(True), data, config))
    with fed_graph(config) as (graph, x, y):
        _, train_op = split_block(True)(x, y)
        ran_on = executed_ops(traced_first_step(train_op, {x: data[0][0], y: data[1][0]}))
    copies = {name: devices for name, devices in ran_on.items()
              if name.startswith("block_recompute/")}
    assert any(name.endswith("Tanh") for name in copies), sorted(copies)
    assert set().union(*copies.values()) == {HOST, HOST[:-1] + "1"}
    for name, devices in copies.items():
        assert devices == ran_on[name[len("block_recompute/"):]], name


def mean_xent(labels, logits):
    """A loss without v1.losses' nested scopes (the deepest scopes then are
    the blocks' layers, so TAP's walk finds the blocks)."""
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=labels,
                                                                         logits=logits))


# Four blocks on one device of 60000 bytes: the search recomputes them all
# (test_the_planner_recomputes_every_block_when_memory_forces_it).
FULL_RECOMPUTE = {
    "auto.auto_parallel": True, "cluster.num_devices": 1, "auto.global_batch": 512,
    "pipeline.num_micro_batch": 2, "auto.memory_techniques": ["recompute"],
    "cluster.hardware": [{"name": "small", "tflops": 1, "memory_gb": 60000 / 2 ** 30}]}


def test_the_planner_recomputes_every_block_when_memory_forces_it():
    """Four blocks planned for one device of 60000 bytes, 2 micro-batches of
    256 rows (auto.global_batch 512). Without recomputation: 2 x 2348 bytes
    of weights and gradients (SGD keeps no slots) + 256 x (8 tanh outputs x
    32 + 12 of the cross-entropy's backprop) = 73304. Full recomputation:
    each block keeps its input (32 bytes a row; block0's is the fed batch,
    which the feed holds) and holds one block's 64 while rebuilding it:
    4696 + 256 x (3 x 32 + 12 + 64) = 48728, and the search chooses it. The plan trains, searched and
    pinned: the numbers of plain TF, and every block's copies ran."""
    build = blocks(4, loss=mean_xent)
    config = FULL_RECOMPUTE
    plan = plan_of(build, config)
    assert (plan.estimate["memory_techniques"], plan.estimate["recompute"]) == (["recompute"],
                                                                              "full")
    assert plan.estimate["memory_bytes_per_device"] == [4696 + 256 * (3 * 32 + 12 + 64)]
    assert max(plan_of(build, {**config, "auto.memory_techniques": [], "cluster.hardware": [
        {"name": "roomy", "tflops": 1, "memory_gb": 1}]}).estimate[
            "memory_bytes_per_device"]) == 4696 + 256 * (8 * 32 + 12)
    for run in (config, {**config, "plan": plan.to_dict()}):
        assert_equivalent(train(build, DATA), train(build, DATA, run), rtol=1e-6)
        copies = {re.search(r"(block\d)_recompute/", name).group(1)
                  for name in step_nodes(run, build) if "_recompute/" in name}
        assert copies == {f"block{i}" for i in range(4)}


def test_the_estimate_counts_the_flops_recomputation_runs_again():
    """The plan above: full recomputation runs every block's forward again,
    per row 2 x 6 x 8 + 8 + 8 (block0's inner dense: MatMul, bias, tanh) +
    2 x 8 x 8 + 8 + 8 + 3 x 2 x (2 x 8 x 8 + 8 + 8) = 1120 FLOPs, x 512 rows.
    The plan's hardware FLOPs count them, its model FLOPs (3 x forward) do
    not; before, no FLOPs were counted, and benchmarks printed Megatron's
    Eq. 3, which counts them whether a plan recomputes or not."""
    config = FULL_RECOMPUTE
    est = plan_of(blocks(4, loss=mean_xent), config).estimate
    assert (est["recompute"], est["recomputed_flops_per_step"]) == ("full", 1120 * 512)
    assert est["hardware_tflops_per_device"] == pytest.approx(
        (est["flops_per_step"] + 1120 * 512) / est["step_time_s"] / 1e12)
    assert est["hardware_tflops_per_device"] > est["model_tflops_per_device"]


def test_a_rewrite_that_recomputes_plans_once(monkeypatch):
    """The plan above, run: the rewrite makes the search's recomputation
    before planning, then plans once, reading the graph with the copies
    (before, it planned, recomputed and planned again); the plan it runs
    recomputes, and the numbers are plain TF's."""
    from tfpar.runtime import engine  # pylint: disable=import-outside-toplevel
    calls, planned = [], engine.planned

    def counted(*args, **kwargs):
        made = planned(*args, **kwargs)
        calls.append(made.plan)
        return made
    monkeypatch.setattr(engine, "planned", counted)
    build = blocks(4, loss=mean_xent)
    assert_equivalent(train(build, DATA), train(build, DATA, FULL_RECOMPUTE), rtol=1e-6)
    assert len(calls) == 1
    assert calls[0].estimate["recompute"] == "full"
    # Its ops are counted with the copies: more than the graph as built had.
    assert calls[0].task_graphs[0].num_ops > plan_of(build, FULL_RECOMPUTE).task_graphs[0].num_ops


def small_gpt(x, y):
    """test_expert_plans' GPT-2 graph: 2 blocks, hidden 32, 4 heads, 50
    tokens, seeded initial values, SGD (Adam would turn float noise in
    near-zero gradients into visible steps)."""
    del y
    with v1.variable_scope("", initializer=v1.glorot_uniform_initializer(seed=1)):
        loss = gpt_loss(2, 32, 4, vocab=50)(x)
    return loss, v1.train.GradientDescentOptimizer(0.1).minimize(loss)


def test_the_planner_recomputes_attention_cores_when_memory_forces_it():
    """The GPT on one device of 1.28 MB, 8 sequences of 16 tokens: 1299968
    bytes without recomputation (SGD: weights and gradients, no slots);
    selective recomputation drops each layer's softmax (a s^2 = 4 x 16^2
    floats a sequence: 4096 bytes) for 8 sequences and 2 layers and holds
    one while rebuilding it: 1299968 - 65536 + 32768 = 1267200, which fits (full does too, but recomputes
    more). The plan trains, searched and pinned: the numbers of plain TF,
    and both cores' softmax copies ran after the forward reached the loss,
    the backward reading them (the forward's softmax then lives only until the
    attention over V has read it)."""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 1, "auto.global_batch": 8,
              "auto.memory_techniques": ["recompute"],
              "cluster.hardware": [{"name": "small", "tflops": 1, "memory_gb": 1.28e6 / 2 ** 30}]}
    plan = plan_of(small_gpt, config, dtype=tf.int32, shape=(8, 16))
    assert plan.estimate["recompute"] == "selective"
    assert plan.estimate["memory_bytes_per_device"] == [1299968 - 65536 + 32768]
    rng = np.random.RandomState(0)
    data = (rng.randint(0, 50, size=(3, 8, 16)).astype(np.int32), np.zeros((3, 8), np.int64))
    for run in (config, {**config, "plan": plan.to_dict()}):
        assert_equivalent(train(small_gpt, data, static_batch=True),
                          train(small_gpt, data, run, static_batch=True))
        graph = tf.Graph()
        with graph.as_default():
            wh.init(run)
            tokens = v1.placeholder(tf.int32, [8, 16])
            _, train_op = small_gpt(tokens, None)
            metadata = traced_first_step(train_op, {tokens: data[0][0]})
        wh.reset()
        nodes = {node.node_name: (node.all_start_micros, node.all_start_micros
                                  + node.all_end_rel_micros)
                 for device in metadata.step_stats.dev_stats for node in device.node_stats}
        softmax = {name: start for name, (start, _) in nodes.items()
                   if "_recompute/" in name and name.endswith("Softmax")}
        assert set(softmax) == {f"attention_core_{i}_recompute/h{i}/attn/Softmax"
                                for i in range(2)}
        loss_end = nodes["sparse_softmax_cross_entropy_loss/xentropy/xentropy"][1]
        assert min(softmax.values()) >= loss_end


def test_recomputation_with_auto_parallel_is_refused_not_ignored():
    with pytest.raises(wh.PlanError, match="memory.recompute is applied to graphs the planner "
                                           "did not plan"):
        train(blocks(2), DATA, {"cluster.num_devices": 2, "memory.recompute": ["block0"],
                                "auto.auto_parallel": True})


HOST = "/job:localhost/replica:0/task:0/device:CPU:0"


def adam():
    return v1.train.AdamOptimizer(0.05)


OFFLOADED = {
    "pipeline": {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2},
    "2 pipelines, stage copies": {"cluster.num_devices": 4, "pipeline.num_micro_batch": 2,
                                  "pipeline.task_functions": False},
}


@pytest.mark.parametrize("pipeline", OFFLOADED.values(), ids=OFFLOADED)
def test_an_offloaded_optimizer_updates_on_the_host(pipeline):
    """Adam over two stages with ``memory.offload_optimizer``: the same numbers
    as plain TF; in a traced step every Adam update (a kernel and a bias in
    each of 7 layers) ran on the host CPU only (stage 1's would run on its
    device), while stage 1's logits ran on its devices, not on the host."""
    assert_updates_on_the_host({**pipeline, "auto.num_task_graph": 2,
                                "memory.offload_optimizer": True})


def assert_updates_on_the_host(config):
    """Adam blocks trained under ``config`` give plain TF's numbers, and a
    traced step of stage 1 ran its logits off the host and every update on it."""
    build = blocks(3, adam)
    assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-5)
    with fed_graph(config) as (graph, x, y):
        _, train_op = build(x, y)
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
        updates = [op.name for op in graph.get_operations() if op.type == "ResourceApplyAdam"]
    ran_on = executed_ops(metadata)
    assert len(updates) == 14 and all(ran_on[name] == {HOST} for name in updates), {
        name: ran_on.get(name) for name in updates}
    logits = {d for name, devices in ran_on.items() for d in devices
              if is_matmul(name, "logits") and "grad" not in name}
    assert logits and HOST not in logits, logits


def test_offloading_mirrored_variables_is_refused():
    with pytest.raises(wh.PlanError, match="mirrors variables on every device of a stage"):
        train(blocks(1), DATA, {"cluster.num_devices": 2, "memory.offload_optimizer": True,
                                "communication.backend": "collective"})


def test_the_planner_offloads_the_optimizer_when_memory_forces_it():
    """Two stages of the Adam blocks on devices of 4500 bytes: no plan fits without
    offload; with it, each stage sheds its Adam slots (2 x its weights'
    bytes: stage 0 holds block0 and block1/inner, 200 parameters; stage 1
    the rest, 243) and the step takes the host's traffic and update of the
    larger stage more; the plan trains with the updates on the host, also
    pinned."""
    base = {"auto.auto_parallel": True, "cluster.num_devices": 2, "auto.num_task_graph": 2,
            "pipeline.num_micro_batch": 2, "auto.global_batch": 16,
            "auto.memory_techniques": ["offload"]}
    device = {"name": "small", "tflops": 1, "memory_gb": 4500 / 2 ** 30}
    roomy = plan_of(blocks(3, adam), {**base, "cluster.hardware": [{**device, "memory_gb": 1}]})
    assert roomy.estimate["memory_techniques"] == []  # slower, so not without need
    small = {**base, "cluster.hardware": [device]}
    with pytest.raises(wh.PlanError, match="no plan that fits small"):
        plan_of(blocks(3, adam), {**small, "auto.memory_techniques": []})
    offloaded = plan_of(blocks(3, adam), small)
    assert offloaded.estimate["memory_techniques"] == ["offload"]
    shed = [plain.estimate["memory_bytes"] - tg.estimate["memory_bytes"]
            for plain, tg in zip(roomy.task_graphs, offloaded.task_graphs)]
    assert shed == [2 * 4 * 200, 2 * 4 * 243]
    assert offloaded.estimate["step_time_s"] - roomy.estimate["step_time_s"] == pytest.approx(
        2 * 4 * 243 / HOST_LINK_BYTES_S + 7 * 4 * 243 / HOST_MEMORY_BYTES_S, rel=1e-6)
    assert_updates_on_the_host(small)
    assert_updates_on_the_host({**small, "plan": offloaded.to_dict()})  # pinned
