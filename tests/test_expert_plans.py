"""Expert strategies rediscovered by the calibrated cost model (issue 14), on
real graphs whose inputs declare the batch, on catalog GPUs:

* a small MLP on 8 V100s at a batch of 256: plain data parallelism (it used
  to get a 2-stage pipeline of one micro-batch: 14 ring latencies of an
  8-way all-reduce against 6 + 2);
* a conv backbone with a 100K-class head at 256 on 8 V100s (Whale's Figure 3
  setting): the backbone data parallel, the head and the loss split (it used
  to get 4-way tensor x 2-stage pipeline, the backbone 'whole');
* a Megatron MLP block on [8, 512, 8192] and 4 devices of 4 GB: fc1 by
  columns, fc2 by rows (it used to find no plan: "the smallest needs 13.9
  GB", 32 rows assumed and tensordot's reshapes counted as activations);

* GPTs shaped as in Megatron-LM's weak-scaling table (Narayanan et al., SC'21,
  Table 1; vocabulary 51200, sequences of 2048, batch 512) on DGX-like A100
  nodes (8 GPUs each, 80 GB, memory techniques allowed): 1.7B on 32 GPUs
  data parallel, 3.6B on 64 GPUs tensor 2 x data 32 (the MLPs column then
  row), as Megatron ran them, with the micro-batches and memory techniques
  that make them fit;

and no estimate ever beats the hardware's peak.
"""
import contextlib
import dataclasses
import io
import math

import pytest
import tensorflow as tf

from equivalence import plan_of
from test_cost_model import ACTIVATION_KEPT, graph_view, hand_memory, mlp_block, mlp_block_ops

from tfpar.cluster.hardware import CATALOG, DTYPES
from tfpar.planner.auto import search_all
from tfpar.planner.choice import TENSOR_TOLERANCE, choose
from tfpar.planner.memory import Techniques

v1 = tf.compat.v1
GPUS = {"cluster.hardware": ["V100-32GB"], "cluster.devices_per_node": 8,
        "auto.auto_parallel": True}

# The step times pinned below are TensorFlow 2.15's graphs' estimates. 2.16+
# builds the same models with other ops (gelu from erfc, other gradient ops),
# which the cost model estimates 4-5% slower: there they are held to 6%.
PINNED_GRAPHS = tf.__version__.startswith("2.15.")


def as_pinned(seconds: float):
    """``seconds``, to 0.1% on the graphs it was pinned on, else to 6%."""
    return pytest.approx(seconds, rel=1e-3 if PINNED_GRAPHS else 0.06)


def mlp(width, layers=3):
    """build(x, y): ``layers`` dense ReLU layers of ``width``, 10 classes."""
    def build(x, y):
        h = x
        for i in range(layers):
            h = v1.layers.dense(h, width, tf.nn.relu, name=f"l{i}")
        logits = v1.layers.dense(h, 10, name="logits")
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)
    return build


def planned(build, config, shape):
    with contextlib.redirect_stderr(io.StringIO()):
        return plan_of(build, config, shape=shape)


@pytest.mark.parametrize("width", [16, 64, 256, 1024])
def test_small_mlp_on_8_v100s_is_data_parallel(width):
    """32 features, 3 layers of ``width``, 256 rows declared: a pipeline of
    one micro-batch runs its stages one after the other and cannot win on
    compute; with all-reduces at logarithmic latency it no longer wins on
    latency either. At width 1024 (8.6 MB of gradients) halving each
    stage's all-reduce makes up for doubling the compute: 2 stages tie with
    data parallelism (0.212 ms), and the tie goes to fewer stages."""
    plan = planned(mlp(width), {**GPUS, "cluster.num_devices": 8}, (256, 32))
    assert plan.data_parallel_degree == 8 and len(plan.task_graphs) == 1
    assert not plan.sharding


def conv_classifier(classes):
    """build(x, y): two convolutions, global average pooling, a 2048-wide
    dense layer (a small ResNet-like backbone) and a ``classes``-way head."""
    def build(x, y):
        h = v1.layers.conv2d(x, 64, 3, activation=tf.nn.relu, name="c0")
        h = v1.layers.conv2d(h, 128, 3, strides=2, activation=tf.nn.relu, name="c1")
        h = tf.reduce_mean(h, axis=[1, 2], name="pool")
        h = v1.layers.dense(h, 2048, tf.nn.relu, name="fc")
        logits = v1.layers.dense(h, classes, name="head")
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)
    return build


@pytest.mark.parametrize("classes,devices", [(100000, 8), (100000, 16), (50000, 8)])
def test_wide_classifier_gets_a_data_parallel_backbone_and_a_split_head(classes, devices):
    """Whale §2.1 / Figure 3: the head's weights (2048 x classes) cost more to
    all-reduce than its logits cost to keep split, the backbone's less. The
    head is split over all the devices, as Whale's hybrid does (§5.1.2; on 16
    devices two data-parallel groups of 8 were estimated more than 2% slower)."""
    plan = planned(conv_classifier(classes), {**GPUS, "cluster.num_devices": devices},
                   (256, 32, 32, 3))
    assert plan.sharding == {"tensor_degree": devices, "layers": {
        "head": "column", "sparse_softmax_cross_entropy_loss": "xent"}}
    assert plan.data_parallel_degree == 1
    assert [tg.strategy for tg in plan.task_graphs] == ["replicate", "split"]


def test_narrow_classifier_stays_data_parallel():
    plan = planned(conv_classifier(1000), {**GPUS, "cluster.num_devices": 8}, (256, 32, 32, 3))
    assert plan.data_parallel_degree == 8 and not plan.sharding


@pytest.mark.parametrize("shape,memory_gb,activation", [
    ((8, 512, 8192), 4, "gelu"), ((8, 512, 8192), 4, "relu"), ((4, 512, 8192), 3, "gelu"),
    ((4096, 8192), 4, "gelu"), ((2048, 4096), 1, "relu")])
def test_megatron_block_under_memory_pressure_is_column_then_row(shape, memory_gb, activation):
    """4 devices of ``memory_gb``: data parallelism and pipelines do not fit,
    fc1 split by columns then fc2 by rows does (no gather between them).
    Memory by hand (``test_cost_model.mlp_block_ops``): fc1 holds a quarter
    of its weights and its quarter of the features of all B rows, fc2 a
    quarter of its weights and the whole rows of its partial sums, the
    residual data parallel (B / 4 rows). [8, 512, 8192] with GELU: 1 GiB of
    each layer's kernel and state, their biases' 4 x (32768 + 8192) bytes,
    what GELU keeps of a quarter of fc1's features (4 x 64 MiB) x 2 rows,
    the residual's 16 MiB x 2: 2.53 GiB."""
    device = {"name": "V100-small", "tflops": 15.7, "tflops_fp16": 125,
              "memory_gb": memory_gb, "intra_node_gbps": 150}
    plan = planned(mlp_block(getattr(tf.nn, activation)), {
        "auto.auto_parallel": True, "cluster.num_devices": 4, "cluster.hardware": [device]}, shape)
    layers = {"fc1": "column", "fc2": "row"}
    assert plan.sharding == {"tensor_degree": 4, "layers": layers}
    table = mlp_block_ops(shape[-1], seq=shape[1] if len(shape) == 3 else None,
                          kept=ACTIVATION_KEPT[activation])
    by_hand, = hand_memory(table, shape[0], 4, tensor=4, candidates=layers)
    assert max(plan.estimate["memory_bytes_per_device"]) == by_hand <= memory_gb * 2 ** 30
    if shape == (8, 512, 8192) and activation == "gelu":
        assert by_hand == 2 * 2 ** 30 + 4 * (32768 + 8192) + (256 * 2 + 16 * 2) * 2 ** 20


@pytest.fixture(scope="module")
def classifier_view():
    """The view of a small conv classifier (its layers named, so tensor
    meshes are searched too)."""
    def make_loss():
        x = v1.placeholder(tf.float32, [None, 16, 16, 3])
        y = v1.placeholder(tf.int64, [None])
        return conv_classifier(1000)(x, y)[0]
    return graph_view(make_loss)[1]


@pytest.mark.parametrize("device", list(CATALOG))
def test_no_estimate_beats_the_peak(classifier_view, device):
    """For every catalog device and compute dtype, every mesh's estimated
    step (8 devices, 256 rows) takes at least the model's FLOPs (3 x the
    forward's, with the backward) / (devices x the dtype's peak)."""
    hardware = CATALOG[device]
    flops = 3 * sum(classifier_view.flops) * 256
    for dtype in DTYPES:
        view = dataclasses.replace(classifier_view, compute_dtype=dtype)
        candidates = search_all(view, 8, hardware, 256, 4)
        assert len(candidates) > 4
        bound = flops / (8 * hardware.peak(dtype) * 1e12)
        assert min(c.step_time_s for c in candidates) >= bound, dtype


def gpt_loss(layers, hidden, heads, vocab=51200):
    """loss(tokens): a GPT as GPT-2's TF1 code writes it (pre-LN blocks
    ``h{i}``: ``ln_1``, ``attn`` with ``c_attn`` and ``c_proj``, ``ln_2``,
    ``mlp`` with ``c_fc`` and ``c_proj``; the causal mask made in each block;
    the output layer tied to the token embedding), on [batch, seq] int32
    tokens; the loss predicts the tokens themselves (the same costs as the
    next ones). Dense layers are ``v1.layers.dense`` (a MatMul reading its
    kernel: the sharding search's column / row candidates)."""
    def norm(x, name):
        with v1.variable_scope(name):
            gain = v1.get_variable("g", [x.shape[-1]], initializer=v1.ones_initializer())
            bias = v1.get_variable("b", [x.shape[-1]], initializer=v1.zeros_initializer())
            mean, var = tf.nn.moments(x, [-1], keepdims=True)
            return (x - mean) * tf.math.rsqrt(var + 1e-5) * gain + bias

    def loss(tokens):
        seq, depth = tokens.shape[1], hidden // heads
        wte = v1.get_variable("wte", [vocab, hidden])
        h = tf.gather(wte, tokens) + v1.get_variable("wpe", [seq, hidden])

        def heads_first(t):
            return tf.transpose(tf.reshape(t, [-1, seq, heads, depth]), [0, 2, 1, 3])
        for i in range(layers):
            with v1.variable_scope(f"h{i}"):
                with v1.variable_scope("attn"):
                    qkv = v1.layers.dense(norm(h, "ln_1"), 3 * hidden, name="c_attn")
                    q, k, v = (heads_first(t) for t in tf.split(qkv, 3, axis=-1))
                    w = tf.matmul(q, k, transpose_b=True) * (1 / math.sqrt(depth))
                    mask = tf.cast(tf.range(seq)[:, None] >= tf.range(seq), w.dtype)
                    w = tf.nn.softmax(w * mask - 1e10 * (1 - mask))
                    o = tf.reshape(tf.transpose(tf.matmul(w, v), [0, 2, 1, 3]), [-1, seq, hidden])
                    h = h + v1.layers.dense(o, hidden, name="c_proj")
                with v1.variable_scope("mlp"):
                    f = v1.layers.dense(norm(h, "ln_2"), 4 * hidden, tf.nn.gelu, name="c_fc")
                    h = h + v1.layers.dense(f, hidden, name="c_proj")
        logits = tf.tensordot(norm(h, "ln_f"), wte, [[2], [1]])
        return v1.losses.sparse_softmax_cross_entropy(tokens, logits)
    return loss


# Megatron-LM's cluster (Narayanan et al. §5: Selene, DGX A100 nodes of 8
# 80-GB A100s, NVLink within a node, 8 x 200 Gb/s InfiniBand per node: the
# catalog's 300 and 25 GB/s per GPU), with what Megatron may do to fit:
# micro-batches (searched), activation recomputation, ZeRO and mixed precision
# (the graph keeps fp32 weights: 16 bytes of state per parameter either way).
DGX_A100 = dataclasses.replace(CATALOG["A100-80GB"], devices_per_node=8)
MEMORY_TECHNIQUES = ("recompute", "zero", "mixed_precision")


def megatron_choice(layers, hidden, heads, devices, hardware=DGX_A100, split_heads=False):
    """The planner's pick for a Megatron GPT at batch 512 x 2048 on
    ``devices`` (it fits), and every candidate it chose from."""
    _, view = graph_view(lambda: gpt_loss(layers, hidden, heads)(
        v1.placeholder(tf.int32, [512, 2048])))
    candidates = search_all(view, devices, hardware, 512, None, time_limit_s=600,
                            techniques=MEMORY_TECHNIQUES, split_heads=split_heads)
    best = choose(candidates, hardware)
    assert best.memory_bytes <= hardware.memory_gb * 2 ** 30
    return best, candidates


def gpt_parameters(layers, hidden, vocab=51200, seq=2048):
    """Megatron-LM's Eq. 2, 12 l h^2 (1 + 13 / 12h + (V + s) / 12lh), plus
    the final layer norm's 2h, which Eq. 2 leaves out."""
    return 12 * layers * hidden ** 2 + 13 * layers * hidden + (vocab + seq) * hidden + 2 * hidden


@pytest.mark.slow
def test_gpt_1_7b_on_32_a100s_is_data_parallel():
    """Table 1's first row: 1.7B parameters (24 layers, hidden 2304, 24
    heads; 1,652,230,656 by the paper's Eq. 2 and the final layer norm, as
    many as this graph has) on 32 GPUs, batch 512: data 32 x tensor 1 x
    pipeline 1, each replica's 16 sequences in 4 micro-batches of 4, mixed
    precision, no ZeRO and no recomputation: weights, gradients, fp32
    master weights and Adam's two slots, 16 bytes a parameter, whole on
    every device, and the activations within 80 GB (79.9 GiB). Step
    estimated at 2.78 s, within 25% of Megatron's measurement (137 TFLOP/s
    per GPU: 3.53 s by its Eq. 3, which counts full recomputation's extra
    forward pass, 2.65 s without it); every other mesh is estimated slower
    (the pipelines from 2.94 s; no split within a node beats data
    parallelism). Full size (15 s here, most of it TensorFlow building the
    graph)."""
    best, candidates = megatron_choice(24, 2304, 24, 32)
    mesh = (best.data, best.tensor, best.pipeline, best.micro_batches)
    assert mesh == (32, 1, 1, 4) and not best.split_scopes
    assert best.techniques == Techniques(recompute="none", zero=0, mixed_precision=True)
    state, memory_gib, step_s = best.state_bytes, best.memory_bytes / 2 ** 30, best.step_time_s
    assert gpt_parameters(24, 2304) == 1_652_230_656
    assert state == 16 * gpt_parameters(24, 2304)
    assert memory_gib == pytest.approx(79.93, abs=0.01)
    assert step_s == as_pinned(2.7761)
    assert 2.65 < step_s < 2.65 * 1.25
    others = [c.step_time_s for c in candidates if c is not best]
    assert len(others) == len(candidates) - 1 and min(others) > step_s
    fastest_pipeline = min(c.step_time_s for c in candidates if c.pipeline > 1)
    assert fastest_pipeline == as_pinned(2.9354)


@pytest.mark.slow
def test_gpt_3_6b_on_64_a100s_needs_no_tensor_split_with_zero():
    """Table 1's second row: 3.6B parameters (30 layers, hidden 3072, 32
    heads) on 64 GPUs, batch 512, which Megatron ran at tensor 2 x pipeline 1
    (so data 32), without ZeRO, which it did not have. With ZeRO-1, pure data
    parallelism is estimated as fast (within TENSOR_TOLERANCE; DeepSpeed ran
    such sizes so): a node's gradients cross to the other nodes over all 8 of
    its links (hierarchical all-reduce), and on Megatron's mesh the search
    keeps the blocks whole, splitting only the embedding by vocabulary. The
    plainer plan is chosen: data 64, 4 micro-batches of 2 sequences, mixed
    precision, ZeRO-1 (Adam's slots, 8 of the 16 bytes a parameter, sharded
    over the 64 replicas), no recomputation, 72.7 GiB of 80 (the activations
    the backward pass reads), 2.83 s, within 25% of Megatron's measurement
    (138 TFLOP/s per GPU: 3.70 s by Eq. 3, 2.77 s without recomputation);
    Megatron's mesh, with the same micro-batches and techniques, 2.83 s too.
    Megatron's split of the blocks, where it pays, is tested by the
    memory-pressure and head-split tests. Full size (23 s here)."""
    best, candidates = megatron_choice(30, 3072, 32, 64, split_heads=True)
    megatron, = [c for c in candidates if (c.data, c.tensor, c.pipeline) == (32, 2, 1)]
    zero_1 = Techniques(recompute="none", zero=1, mixed_precision=True)
    mesh = (best.data, best.tensor, best.pipeline, best.micro_batches)
    assert mesh == (64, 1, 1, 4) and megatron.micro_batches == 4
    assert best.techniques == megatron.techniques == zero_1
    assert not best.split_scopes and megatron.split_scopes == (("Gather", "vocab"),)
    state, memory_gib, step_s = best.state_bytes, best.memory_bytes / 2 ** 30, best.step_time_s
    megatron_s = megatron.step_time_s
    assert state == gpt_parameters(30, 3072) * (4 + 4 + 8 / 64)
    assert memory_gib == pytest.approx(72.68, abs=0.01)
    assert step_s == as_pinned(2.8257)
    assert megatron_s == as_pinned(2.8252)
    assert megatron_s <= step_s * (1 + TENSOR_TOLERANCE)
    assert 2.77 < step_s < 2.77 * 1.25 and 2.77 < megatron_s < 2.77 * 1.25
