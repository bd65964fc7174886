"""auto.auto_parallel's sharding search, end to end: plans found on a model
built plainly, pinned, built split, and trained like one device."""
import numpy as np
import pytest
import tensorflow as tf

from equivalence import (assert_equivalent, deep_mlp, dense, fed_graph, initialized, layer,
                         make_data, plan_of, train)
from proof import TRACER
from test_cost_model import TRANSFORMER_MLP_LAYERS, deep_mlp_layers, hand_memory, planned_stages

import tfpar as wh
from tfpar.runtime.automatic import Automatic
from tfpar.runtime.sharded import sharded_plan

v1 = tf.compat.v1


def classifier(classes):
    """build(x, y): a small backbone and a wide classification head, no scopes."""
    def build(x, y):
        features = dense(x, 256, "features", seed=1, activation=tf.nn.tanh)
        logits = layer(features, classes, "logits", seed=2)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


@pytest.mark.parametrize("classes,devices", [(100000, 8), (8000, 4)])
def test_wide_head_is_split_and_backbone_replicated(classes, devices):
    """Whale's Example 2 found, not written: the head's weights cost more to
    all-reduce than its logits cost to keep split. (The weightless Tanh
    before it may join the split group whole: its gather then the column
    layer's backward all-reduce (Megatron's f) cost about what gathering
    into the column layer and reduce-scattering its gradient do.)"""
    config = {"auto.auto_parallel": True, "cluster.num_devices": devices}
    plan = plan_of(classifier(classes), config)
    assert plan.sharding["layers"]["logits"] == "column"
    assert "features" not in plan.sharding["layers"]
    assert set(plan.sharding["layers"]) <= {"Tanh", "logits", "sparse_softmax_cross_entropy_loss"}
    assert [tg.strategy for tg in plan.task_graphs] == ["replicate", "split"]
    assert f"tensor degree {devices}): " in plan.summary()
    assert "logits -> column" in plan.summary()


def test_the_split_head_plan_trains_like_one_device():
    build, config = classifier(8000), {"auto.auto_parallel": True, "cluster.num_devices": 4}
    plan = plan_of(build, config)
    data = make_data(steps=3, batch=8, classes=8000)
    pinned = {**config, "plan": plan.to_dict()}
    assert_equivalent(train(build, data), train(build, data, pinned))
    built = plan_of(build, pinned)
    assert built.task_graphs[1].patterns["logits"] == "column"
    assert built.sharding == plan.sharding


@pytest.mark.filterwarnings("ignore:.*built before the plan existed:tfpar.FallbackWarning")
def test_current_plan_after_the_first_run_is_what_runs_and_to_pin_the_one_to_pin():
    """In a test or notebook (no planning pass) the graph runs the best unsharded
    plan. Issue 64 item 3: after its first run current_plan() returned the
    sharded plan it does not run; now it returns what runs, and
    current_plan(to_pin=True) the sharded plan the warning says to pin
    (pinned, it builds the head split). Before the first run, current_plan()
    is the search's plan, with a note saying what the graph will run."""
    build, config = classifier(8000), {"auto.auto_parallel": True, "cluster.num_devices": 4}
    with fed_graph(config) as (_, x, y):
        build(x, y)
        before = wh.current_plan()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            runs, to_pin = wh.current_plan(), wh.current_plan(to_pin=True)
    assert before.sharding["layers"]["logits"] == "column"
    assert any(note.startswith("tfpar: this is the search's plan, to pin: it shards layers this "
                               "graph was built without, so the graph, as built, will run the "
                               "best plan without sharding ('replicate_all': replicate on 4 "
                               "devices; data_parallel_degree 4)") for note in before.notes)
    assert not runs.sharding and runs.data_parallel_degree == 4
    assert [(tg.strategy, len(tg.devices)) for tg in runs.task_graphs] == [("replicate", 4)]
    assert any("it runs the best plan without sharding" in note for note in runs.notes)
    assert to_pin.sharding["layers"]["logits"] == "column"
    built = plan_of(build, {**config, "plan": to_pin.to_dict()})
    assert built.task_graphs[1].patterns["logits"] == "column"


def test_running_unsharded_what_the_planner_shards_is_a_fallback():
    """That graph runs the best plan without sharding: before, a log line
    said so; now a FallbackWarning and a note of the plan to pin, and strict
    mode refuses to run it."""
    build, config = classifier(8000), {"auto.auto_parallel": True, "cluster.num_devices": 4}
    with pytest.warns(wh.FallbackWarning, match="but this graph was built before the plan "
                                                "existed: it runs the best plan without "
                                                "sharding \\(data 4 x tensor 1 x pipeline 1, "):
        with initialized(build, config):
            notes = wh.current_plan().notes
    assert len(notes) == 1 and notes[0].startswith("tfpar: the planner shards logits, ")
    assert notes[0].endswith("To shard, run the script itself (its planning pass pins the "
                             "plan) or pin wh.current_plan(to_pin=True).to_json() as the config's "
                             "'plan'")
    with pytest.raises(wh.PlanError, match="was built before the plan existed"):
        with initialized(build, {**config, "strict": True}):
            pass


def transformer_mlp(x, y):
    """A residual MLP block (keras Dense layers) between an embedding and a head."""
    h = dense(x, 16, "embed", seed=1)
    glorot = tf.keras.initializers.GlorotUniform
    inner = tf.keras.layers.Dense(64, activation="relu", name="fc1",
                                  kernel_initializer=glorot(seed=2))(h)
    out = tf.keras.layers.Dense(16, name="fc2", kernel_initializer=glorot(seed=3))(inner)
    logits = dense(h + out, 3, "logits", seed=4)
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def memory_bound_config():
    """2 devices, no pipeline, each too small for the data-parallel copy and
    for fc1 split alone (70% of the copy: splitting fc1 by columns saves its
    half of fc1's weights and kept ReLU outputs, 25%)."""
    device = {"name": "small", "tflops": 0.01, "memory_gb": 16}
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2, "auto.num_task_graph": 1,
              "cluster.hardware": [device]}
    data_parallel = plan_of(transformer_mlp, config)
    assert not data_parallel.sharding and data_parallel.data_parallel_degree == 2
    need = max(data_parallel.estimate["memory_bytes_per_device"])
    return {**config, "cluster.hardware": [{**device, "memory_gb": 0.7 * need / 2 ** 30}]}, need


def test_memory_forces_megatron_column_then_row():
    """Without a pipeline (num_task_graph 1), devices too small for the data
    parallel copy: the MLP's first layer is split by columns, the second by
    rows (no gather between them), the rest stays replicated. Memory by hand
    (``test_cost_model.hand_memory``), 32 rows on 2 devices."""
    config, need = memory_bound_config()
    # data parallel: 2 x 9164 bytes of weights and gradients (SGD: no slots)
    # + 16 rows x 396 kept bytes per row
    assert need == hand_memory(TRANSFORMER_MLP_LAYERS, 32, 2, state=2)[0] == 2 * 9164 + 16 * 396
    plan = plan_of(transformer_mlp, config)
    assert plan.sharding == {"tensor_degree": 2, "layers": {"fc1": "column", "fc2": "row"}}
    assert [tg.strategy for tg in plan.task_graphs] == ["replicate", "split", "replicate"]
    # fc1 and fc2 hold half their weights; fc1 keeps 16 rows of its half of
    # the features, fc2 the 32 whole rows of its partial sums
    by_hand = hand_memory(TRANSFORMER_MLP_LAYERS, 32, 2, tensor=2,
                          candidates=plan.sharding["layers"], state=2)
    assert by_hand[0] <= 0.7 * need  # the split plan fits the device
    assert max(plan.estimate["memory_bytes_per_device"]) == by_hand[0]
    pinned = {**config, "plan": plan.to_dict()}
    data = make_data(steps=3, batch=8)
    assert_equivalent(train(transformer_mlp, data), train(transformer_mlp, data, pinned))
    built = plan_of(transformer_mlp, pinned)
    assert built.task_graphs[1].patterns == {"fc1": "column", "fc2": "row"}


def test_pinned_sharding_candidates_are_built_as_written():
    """Anything the plan shows can be pinned: editing the layers' candidates
    in the plan JSON changes the patterns built (and not the numbers)."""
    config, _ = memory_bound_config()
    plan = plan_of(transformer_mlp, config).to_dict()
    plan["sharding"]["layers"] = {"fc1": "row", "fc2": "column"}
    pinned = {**config, "plan": plan}
    assert plan_of(transformer_mlp, pinned).task_graphs[1].patterns == {"fc1": "row",
                                                                        "fc2": "column"}
    data = make_data(steps=2, batch=8)
    assert_equivalent(train(transformer_mlp, data), train(transformer_mlp, data, pinned))


VOCAB = 20000


def embedding_model(ids, y):
    """A large embedding table looked up by ids, a small head."""
    rng = np.random.RandomState(5)
    with v1.variable_scope("embedding"):
        table = v1.get_variable("table", initializer=rng.randn(VOCAB, 32).astype(np.float32))
        features = tf.reduce_sum(tf.nn.embedding_lookup(table, ids), axis=1)
    logits = dense(features, 3, "head", seed=4)
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def test_large_embedding_is_vocabulary_sharded():
    """Without a pipeline (which would keep the table on one device), all-reducing
    the table's gradient costs more than summing looked-up rows over shards."""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 4, "auto.num_task_graph": 1}
    plan = plan_of(embedding_model, config, tf.int64, (None, 2))
    assert plan.sharding["layers"]["embedding"] == "vocab"
    rng = np.random.RandomState(3)
    data = (rng.randint(0, VOCAB, size=(3, 8, 2)).astype(np.int64),
            rng.randint(0, 3, size=(3, 8)).astype(np.int64))
    pinned = {**config, "plan": plan.to_dict()}
    assert_equivalent(train(embedding_model, data), train(embedding_model, data, pinned))
    built = plan_of(embedding_model, pinned, tf.int64, (None, 2))
    assert "vocab" in built.task_graphs[1].patterns.values()


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
@pytest.mark.parametrize("devices", [4, 8])
def test_memory_forces_tensor_and_pipeline_together(devices):
    """3-D meshes: with 2 stages asked for and devices too small for a data
    parallel pipeline, each stage is split over its own devices (tensor x
    pipeline, and data parallel copies of both on 8 devices), micro-batches
    flow through them (1F1B: the hand count's), and training matches one
    device."""
    model = deep_mlp(6)
    device = {"name": "small", "tflops": 0.01, "memory_gb": 16}
    config = {"auto.auto_parallel": True, "cluster.num_devices": devices,
              "auto.num_task_graph": 2, "pipeline.num_micro_batch": 2,
              "pipeline.schedule": "1f1b", "cluster.hardware": [device]}
    pipeline, stages = planned_stages(model, config)
    assert not pipeline.sharding and pipeline.data_parallel_degree == devices // 2
    need = max(hand_memory(deep_mlp_layers(6), 32, devices, stages, 2, micro=2,
                           state=2))  # by hand (SGD: weights and gradients)
    assert max(pipeline.estimate["memory_bytes_per_device"]) == need
    config["cluster.hardware"] = [{**device, "memory_gb": 0.85 * need / 2 ** 30}]
    plan = plan_of(model, config)
    tensor = plan.sharding["tensor_degree"]
    assert tensor > 1 and set(plan.sharding["stages"].values()) == {0, 1}
    by_hand = hand_memory(deep_mlp_layers(6), 32, devices, plan.sharding["stages"], 2, micro=2,
                          tensor=tensor, candidates=plan.sharding["layers"], state=2)
    assert max(by_hand) <= 0.85 * need  # the split stages fit the device
    assert max(plan.estimate["memory_bytes_per_device"]) == max(by_hand)
    assert plan.data_parallel_degree * tensor * 2 == devices
    assert [tg.strategy for tg in plan.task_graphs] == ["split", "split"]
    assert not set(plan.task_graphs[0].devices) & set(plan.task_graphs[1].devices)
    pinned = {**config, "plan": plan.to_dict()}
    data = make_data(steps=3, batch=8)
    # deep_mlp's layers are tf.matmul on get_variable: a column split cuts
    # the kernel along its last axis, as planned (before: along its first,
    # which tfpar said as a FallbackWarning).
    assert_equivalent(train(model, data), train(model, data, pinned))
    built = plan_of(model, pinned)
    assert [tg.devices for tg in built.task_graphs] == [tg.devices for tg in plan.task_graphs]



def swiglu_block(style):
    """Llama's MLP, down(silu(gate(h)) * up(h)), in a residual block between
    an embedding and a head, as keras writes it (a ``swish`` activation, a
    ``Multiply`` layer) or tf.compat.v1 code (``tf.nn.silu`` between the
    layers)."""
    def build(x, y):
        h = dense(x, 16, "embed", seed=1)
        if style == "keras":
            init = [tf.keras.initializers.GlorotUniform(seed=s) for s in (2, 3, 4)]
            gated = tf.keras.layers.Multiply()([
                tf.keras.layers.Dense(64, "swish", kernel_initializer=init[0], name="gate")(h),
                tf.keras.layers.Dense(64, kernel_initializer=init[1], name="up")(h)])
            out = tf.keras.layers.Dense(16, kernel_initializer=init[2], name="down")(gated)
        else:
            gated = tf.nn.silu(layer(h, 64, "gate", seed=2)) * layer(h, 64, "up", seed=3)
            out = layer(gated, 16, "down", seed=4)
        logits = dense(h + out, 3, "logits", seed=5)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


SWIGLU_LAYERS = {"keras": {"multiply": "shards"},
                 "v1": {"mul_2": "shards", **{silu: "shards" for silu in (
                     "beta", "mul", "Sigmoid", "mul_1", "IdentityN")}}}


@pytest.mark.parametrize("style", ["keras", "v1"])
def test_a_swiglu_mlp_is_planned_and_built_column_shards_row(style):
    """On 2 devices holding 80% of the data-parallel copy, gate and up split
    by columns, silu (its custom gradient's IdentityN too) and the product
    act on shards, down splits by rows: Megatron's MLP for SwiGLU. Before
    tfpar read IdentityN as element-wise, silu ran whole and no plan fit.
    Pinned, it trains like one device, down reading each device's shard of
    the product."""
    build = swiglu_block(style)
    device = {"name": "small", "tflops": 0.01, "memory_gb": 16}
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2, "auto.num_task_graph": 1,
              "cluster.hardware": [device]}
    need = max(plan_of(build, config).estimate["memory_bytes_per_device"])
    config["cluster.hardware"] = [{**device, "memory_gb": 0.8 * need / 2 ** 30}]
    plan = plan_of(build, config)
    assert plan.sharding["layers"] == {"gate": "column", "up": "column", "down": "row",
                                       **SWIGLU_LAYERS[style]}
    data = make_data(steps=3, batch=8)
    TRACER.take()
    result = train(build, data, {**config, "plan": plan.to_dict()})
    graph, = TRACER.graphs
    down = [op for op in graph.get_operations() if op.type == "MatMul"
            and op.name.startswith("down/") and "gradients" not in op.name]
    assert [(op.inputs[0].op.type, op.inputs[0].shape.as_list()) for op in down] == [
        ("Mul", [None, 32])] * 2
    assert sorted(op.inputs[0].op.device[-1] for op in down) == ["0", "1"]
    assert_equivalent(train(build, data), result)


def test_a_plan_to_pin_is_made_only_when_the_pick_shards_a_graph_built_without():
    """The one place that decides: the rewrite and current_plan() both ask
    sharded_plan, which returns None unless the search's pick is not what runs."""
    pick = object()
    runs_the_pick = Automatic(order=(), param_bytes=(), stages=(), count=1, best=pick,
                              runnable=pick)
    runs_another = Automatic(order=(), param_bytes=(), stages=(), count=1, best=pick,
                             runnable=object())
    assert not runs_the_pick.shards_unbuilt and runs_another.shards_unbuilt
    assert sharded_plan(None, None, None, None) is None
    assert sharded_plan(runs_the_pick, None, None, None) is None
