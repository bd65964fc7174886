"""Sequence parallelism in the planner (issue 45): its memory term worked out
by hand (Korthikanti et al. 2022, Table 2), and the search choosing it where
memory forces it, and only there."""
import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, dense, plan_of, train
from proof import TRACER
from test_expert_plans import DGX_A100
from test_cost_model import graph_view
from test_head_split import gpt_view

from tfpar.ir.plan import Plan
from tfpar.planner.auto import search_all
from tfpar.planner.layers import Layer, LayerGraph, layer_graph
from tfpar.planner.memory import Techniques
from tfpar.planner.sharding_costs import Mesh, Problem

v1 = tf.compat.v1

# A transformer layer as Korthikanti et al. count its activations (16-bit
# bytes per sequence, in units of s h): layer norm 1 keeps its input and
# output, the Q K V input (2 + 2); the Q K V projection its Q, K, V (6); the
# attention core its a s^2 tensors (5 a s / h) and the output projection's
# input (2); the output projection its dropout mask (1); layer norm 2 (2 + 2);
# the first MLP layer its 4h output (8); GeLU its output (8); the second
# its dropout mask (1). Together 34 + 5 a s / h. The layer reads the previous
# layer's second MLP layer (a row output whose activations are that layer's).
S, H, A = 8, 16, 4  # sequence, hidden, heads: s h = 128, 5 a s / h = 10
LAYER = (("fc2_before", "matmul", "row", 0),
         ("ln1", "other", "whole", 4), ("qkv", "matmul", "column", 6),
         ("core", "attention", "heads", 2 + 5 * A * S / H), ("proj", "matmul", "row", 1),
         ("ln2", "other", "whole", 4), ("fc1", "matmul", "column", 8),
         ("gelu", "elementwise", "shards", 8), ("fc2", "matmul", "row", 1))


def layer_memory(t, sequence_parallel, first=0):
    """Activation bytes per device of one sequence (batch 1) through
    ``LAYER[first:]`` (a chain) on a tensor group of ``t``, weightless."""
    chain = LAYER[first:]
    layers = tuple(Layer(name, kind, 0.0, 0.0, units * S * H, 0.0, 0.0, (i,), (name,))
                   for i, (name, kind, _, units) in enumerate(chain))
    edges = tuple((i, i + 1, float(S * H)) for i in range(len(chain) - 1))
    problem = Problem(LayerGraph(layers, edges), Mesh(t, t, 1.0, DGX_A100),
                      sequence_parallel=sequence_parallel)
    return problem.memory([candidate for _, _, candidate, _ in chain])


def test_activation_memory_per_layer_is_korthikantis():
    """s b h (34 + 5 a s / h) = 128 x 44 = 5632 on one device; tensor 4:
    s b h (10 + 24 / t + 5 a s / (h t)) = 128 x (10 + 6 + 2.5) = 2368 (the
    layer norms' 4 + 4 and the two dropout masks' 1 + 1 whole on every
    device); with sequence parallelism s b h / t (34 + 5 a s / h) = 128 x 11
    = 1408."""
    assert layer_memory(1, False) == 5632
    assert layer_memory(4, False) == 2368
    assert layer_memory(4, True) == 1408
    assert layer_memory(1, True) == 5632  # nothing to split over one device


def test_sequence_parallelism_keeps_whole_what_no_row_output_feeds():
    """The rewrite slices only downstream of a row-parallel output: a layer
    norm that reads the model's input (no row layer before it) keeps its 4 s
    h whole on each of the 4 devices, 3/4 x 4 x 128 = 384 bytes more than in
    Korthikanti's layer."""
    assert layer_memory(4, True, first=1) == 1408 + 384


def tensor_2(memory_gb, techniques, dropout=False):
    """The tensor 2 x pipeline 2 candidate for a GPT of 2 layers (hidden
    1024, 16 heads, 8 sequences of 512 tokens, 16 bits) on 4 devices;
    ``dropout``: as if it drew random numbers (its masks' ``Range`` ops
    typed as ``RandomUniform``, costed as before)."""
    view = dataclasses.replace(gpt_view(layers=2, hidden=1024, heads=16, seq=512),
                               compute_dtype="fp16")
    if dropout:
        view = dataclasses.replace(view, types=tuple(
            "RandomUniform" if t == "Range" else t for t in view.types))
        assert view.draws_random_numbers
    small = dataclasses.replace(DGX_A100, memory_gb=memory_gb)
    candidates = search_all(view, 4, small, 8, 1, pipeline=2, split_heads=True,
                            techniques=techniques)
    return next(c for c in candidates if c.tensor == 2)


def test_the_search_runs_sequence_parallel_where_it_pays():
    """With 2 GiB the split stages fit either way, and sequence parallelism
    saves 4% of the step (layer norms and residual adds on half the
    sequence): taken, as the GPT draws no random numbers. One that does
    (dropout) keeps its masks one device's for less than
    ``choice.TOLERANCE``: not taken. With 0.45 GiB (483 MB) the
    fullest stage needs 529 MB without it, recomputation allowed or not
    (the search found no setting that fits); with it 462 MB (the layer
    norms', dropouts' and residual sums' activations after each row-parallel
    output at 1/2; the stage's first layer norm reads the whole rows the
    stage receives), which fits: taken, dropout or not."""
    roomy = tensor_2(2.0, ("recompute", "sequence_parallel"))
    kept_whole = tensor_2(2.0, ("recompute", "sequence_parallel"), dropout=True)
    assert roomy.sequence_parallel and not kept_whole.sequence_parallel
    assert kept_whole.memory_bytes == 528752640
    plain = tensor_2(0.45, ("recompute",))
    chosen = tensor_2(0.45, ("recompute", "sequence_parallel"), dropout=True)
    assert not plain.sequence_parallel and plain.memory_bytes > 0.45 * 2 ** 30
    assert chosen.sequence_parallel and chosen.techniques.recompute == "none"
    assert round(chosen.memory_bytes) == 461611008 <= 0.45 * 2 ** 30
    assert roomy.step_time_s == chosen.step_time_s
    assert kept_whole.step_time_s == plain.step_time_s
    assert 1 / 1.1 < chosen.step_time_s / plain.step_time_s < 0.97
    assert chosen.describe() == "data 1 x tensor 2 x pipeline 2, sequence parallel"


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_the_view_says_whether_the_step_draws_random_numbers(rate):
    """Dropout as TF1 and Keras write it draws its masks in the step the
    planner reads (``RandomUniform``): sequence parallelism then needs 10%."""
    def make_loss():
        h = v1.layers.dense(v1.placeholder(tf.float32, [8, 16]), 32, name="fc1")
        h = tf.keras.layers.Dropout(rate)(tf.nn.dropout(h, rate=rate) if rate else h,
                                          training=True)
        return tf.reduce_mean(v1.layers.dense(h, 4, name="fc2") ** 2)
    assert graph_view(make_loss)[1].draws_random_numbers == bool(rate)


def test_a_published_run_that_ran_sequence_parallel_is_estimated_so():
    """Pinned ``Techniques`` (a published run's, as ``plan_scale`` gives
    them) with "sequence_parallel" beside them: the estimate runs it even
    where the search would not take it (2 GiB, dropout: 4% faster, within
    ``choice.TOLERANCE``), at the same 4% less than without it."""
    pinned = (Techniques("none", 0, False),)
    ran = tensor_2(2.0, pinned + ("sequence_parallel",), dropout=True)
    without = tensor_2(2.0, pinned, dropout=True)
    assert ran.sequence_parallel and not without.sequence_parallel
    assert 1 / 1.1 < ran.step_time_s / without.step_time_s < 0.97
    assert not tensor_2(2.0, ("recompute", "sequence_parallel"), dropout=True).sequence_parallel


def test_a_plan_says_its_split_task_graphs_run_sequence_parallel():
    plan = Plan((), 1, sharding={"tensor_degree": 2, "layers": {"h0/mlp/c_fc": "column"},
                                 "sequence_parallel": True})
    assert "sharded layers (tensor degree 2, sequence parallel): h0/mlp/c_fc -> column" \
        in plan.summary()
    assert plan.to_dict()["sharding"]["sequence_parallel"] is True


def sequence_mlp(x, y):
    """A residual MLP block of Keras layers on [batch, 5, 6] sequences, a
    LayerNormalization after the residual add, then a pooled head."""
    h = dense(x, 16, "embed", seed=1)
    glorot = tf.keras.initializers.GlorotUniform
    inner = tf.keras.layers.Dense(64, activation="relu", name="fc1",
                                  kernel_initializer=glorot(seed=2))(h)
    out = tf.keras.layers.Dense(16, name="fc2", kernel_initializer=glorot(seed=3))(inner)
    normed = tf.keras.layers.LayerNormalization(name="norm")(h + out)
    logits = dense(tf.reduce_mean(normed, 1), 3, "logits", seed=4)
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def test_a_pinned_plan_with_sequence_parallelism_builds_its_split_task_graph_so():
    """The searched plan of a memory-bound MLP block (fc1 by columns, fc2 by
    rows) with ``sequence_parallel`` in its sharding, as a chosen plan carries
    it, and the residual add and the norm in the tensor group (``whole``, as
    the search keeps every layer of a pipeline's split stage; here it kept
    them data parallel): pinned, its split TaskGraph reduce-scatters fc2's
    output and runs the add and the norm on sequence slices, with one
    device's numbers."""
    device = {"name": "small", "tflops": 0.01, "memory_gb": 16}
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2, "auto.num_task_graph": 1,
              "cluster.hardware": [device]}
    need = max(plan_of(sequence_mlp, config, shape=(None, 5, 6)).estimate[
        "memory_bytes_per_device"])
    config["cluster.hardware"] = [{**device, "memory_gb": 0.9 * need / 2 ** 30}]
    plan = plan_of(sequence_mlp, config, shape=(None, 5, 6)).to_dict()
    assert plan["sharding"]["layers"] == {"fc1": "column", "fc2": "row"}
    plan["sharding"]["sequence_parallel"] = True
    plan["sharding"]["layers"].update({"add": "whole", "norm": "whole"})  # as a search keeps them
    pinned = {**config, "plan": plan}
    rng = np.random.RandomState(0)
    data = (rng.randn(3, 8, 5, 6).astype(np.float32), rng.randint(0, 3, (3, 8)).astype(np.int64))
    assert_equivalent(train(sequence_mlp, data), train(sequence_mlp, data, pinned))
    built = plan_of(sequence_mlp, pinned, shape=(None, 5, 6))
    assert built.task_graphs[1].patterns == {"fc1": "column", "fc2": "row",
                                             "add_v2": "sequence", "norm": "sequence"}


def keras_blocks(x, y):
    """Two pre-norm blocks of Keras layers (MultiHeadAttention, a 4 x MLP,
    LayerNormalization, residual adds), hidden 32, then a pooled head."""
    tf.keras.utils.set_random_seed(4)
    for _ in range(2):
        attention = tf.keras.layers.MultiHeadAttention(2, 16)
        norm_1, norm_2 = tf.keras.layers.LayerNormalization(), tf.keras.layers.LayerNormalization()
        up, down = tf.keras.layers.Dense(128, activation="relu"), tf.keras.layers.Dense(32)
        normed = norm_1(x)
        x = x + attention(normed, normed)
        x = x + down(up(norm_2(x)))
    logits = tf.keras.layers.Dense(3, name="head")(tf.reduce_mean(x, 1))
    loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)


KERAS_BLOCKS_SHAPE = (None, 16, 32)


def keras_blocks_config(device_bytes, techniques=()):
    """Automatic plans of ``keras_blocks`` in 2 TaskGraphs of 4 slow devices
    of ``device_bytes`` each, 2 micro-batches of 8 sequences, 1F1B."""
    return {"auto.auto_parallel": True, "auto.num_task_graph": 2, "cluster.num_devices": 4,
            "pipeline.num_micro_batch": 2, "pipeline.schedule": "1f1b", "auto.global_batch": 8,
            "auto.memory_techniques": list(techniques),
            "cluster.hardware": [{"name": "slow", "tflops": 3e-5,
                                  "memory_gb": device_bytes / 2 ** 30, "intra_node_gbps": 100.0}]}


def keras_blocks_data(seed):
    """2 steps of 8 sequences of 16 x 32 and their labels of 3 classes."""
    rng = np.random.RandomState(seed)
    return (rng.randn(2, 8, 16, 32).astype(np.float32),
            rng.randint(0, 3, (2, 8)).astype(np.int64))


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
def test_a_pinned_plan_of_two_keras_attention_layers_builds_each_as_planned():
    """keras names the projections of every MultiHeadAttention ``query``,
    ``key``, ``value``: the pinned plan's ``multi_head_attention/query`` and
    ``multi_head_attention_1/query`` are told apart by the scope the layer is
    being built in (before: "name its layers uniquely", which keras does not
    let one do). 299000 bytes a device: a data parallel pipeline needs
    299920, split stages 298208, so the search splits them; pinned, the
    model trains with one device's numbers."""
    shape, config = KERAS_BLOCKS_SHAPE, keras_blocks_config(299000)
    plan = plan_of(keras_blocks, config, shape=shape)
    assert plan.sharding["tensor_degree"] == 2
    assert {"multi_head_attention/query", "multi_head_attention_1/query"} <= set(
        plan.sharding["layers"])
    pinned = {**config, "plan": plan.to_dict()}
    data = keras_blocks_data(0)
    assert_equivalent(train(keras_blocks, data), train(keras_blocks, data, pinned))
    built = plan_of(keras_blocks, pinned, shape=shape)
    assert [tg.patterns["query"] for tg in built.task_graphs] == ["column", "column"]
    # The cores of keras attention are planned by heads and built so.
    assert plan.sharding["layers"]["multi_head_attention_1/einsum"] == "heads"
    assert [tg.patterns.get(f"multi_head_attention{suffix}") for tg, suffix
            in zip(built.task_graphs, ("", "_1"))] == ["heads", "heads"]


def test_keras_attention_splits_by_heads_on_at_most_as_many_devices_as_heads():
    """Without ``auto.split_heads`` a keras MultiHeadAttention's core may split
    by heads, which tfpar builds (its heads read from the query kernel): its
    2 heads on a tensor group of 2, not of 4 (that would force the heads
    pattern on a layer that cannot take it)."""
    view = graph_view(lambda: keras_blocks(v1.placeholder(tf.float32, [8, 16, 32]),
                                           v1.placeholder(tf.int64, [8]))[0])[1]
    assert dict(view.attention_heads) == {"multi_head_attention": 2, "multi_head_attention_1": 2}
    graph = layer_graph(view)
    cores = [i for i, layer in enumerate(graph.layers) if layer.kind == "attention"]
    assert len(cores) >= 6 and {graph.layers[i].heads for i in cores} == {2}
    for t, offered in ((2, True), (4, False)):
        allowed = Problem(graph, Mesh(t, t, 8.0, DGX_A100)).allowed()
        assert {"heads" in allowed[i] for i in cores} == {offered}


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
def test_the_search_runs_keras_blocks_sequence_parallel_and_the_plan_trains_so():
    """280000 bytes a device: the split stages (tensor 2 x pipeline 2) need
    294656 without sequence parallelism. Allowed it, the search splits each
    block Megatron's way (attention output and second MLP layer by rows,
    adds and norms whole), which sequence parallelism runs on sequence
    halves: 253680 bytes. Pinned, the plan trains like one device; every
    row output is summed as sequence halves [batch, 8, 32], on each device
    of each stage; nothing falls back (FallbackWarning is an error here)."""
    config = keras_blocks_config(280000, ["sequence_parallel"])
    plan = plan_of(keras_blocks, config, shape=KERAS_BLOCKS_SHAPE)
    assert plan.sharding["sequence_parallel"] is True
    assert max(plan.estimate["memory_bytes_per_device"]) <= 280000
    assert [plan.sharding["layers"][f"{scope}"] for scope in (
        "multi_head_attention/attention_output", "dense_1", "add", "layer_normalization_1")
            ] == ["row", "row", "whole", "whole"]
    data = keras_blocks_data(1)
    result = train(keras_blocks, data, {**config, "plan": plan.to_dict()})
    graph, = TRACER.graphs
    sums = [op for op in graph.get_operations() if op.type == "AddN" and "gradients" not in
            op.name and op.outputs[0].shape[0] is None and op.outputs[0].shape.rank == 3]
    assert {tuple(op.outputs[0].shape[1:]) for op in sums} == {(8, 32)}
    assert {op.device[-1] for op in sums} == set("0123")
    assert_equivalent(train(keras_blocks, data), result)
