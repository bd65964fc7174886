"""The cost model against numbers it did not compute itself (issue 20).

* Communication, layer FLOPs and plan estimates against formulas written out by
  hand below with the literal sizes (never the planner's helpers).
* Memory estimates against TensorFlow's own accounting of a real, traced
  training step (``RunOptions.FULL_TRACE``) of the plan the estimate is for.

How the memory of a real step is measured. Logical CPU devices share one
process-wide allocator, so its ``allocator_bytes_in_use`` is not per device (it
also holds the constants grappler folds the optimizer slots' zero initial values
into, which the step never touches). Per device, TF records every allocation
and deallocation each node makes during the step (``node_stats[].memory[]
.allocation_records``, with timestamps): replayed in time order, their running
sum peaks at the step's *transient* peak (activations kept for the backward
pass, gradients, buckets, temporaries). The *persistent* bytes are the
variables the device holds (weights and the optimizer's slots; allocated by the
initializer, before any step): the sizes of the ``VarHandleOp`` nodes that
TF's trace shows executing on that device. Measured = persistent + transient
peak. The step measured is the second: the first one allocates every
variable once more (TF copies the initial buffers before the first in-place
update), which no later step does.

What the estimate is (``planner/auto.py``, ``planner/sharding.py``): per device,
4 x the weights it holds (weights, gradients, two optimizer slots: Adam's m and
v) plus the bytes of every forward op's output per row x the rows it computes
(x the micro-batches in flight in a pipeline). Against TF:
  * the weights and slots are exact (TF also keeps Adam's two beta powers);
  * gradients are counted whole for the step; TF applies each as it is made
    and frees it, but the collective reducer's fused buckets hold the
    flattened gradients and their reduced copy at once (2 x weights);
  * activations are over-counted: the view counts a dense layer's MatMul,
    BiasAdd and Relu outputs, TF keeps one (grappler fuses them; the backward
    pass reads only the Relu output) -- the estimate is an upper bound there.
Observed (measured / estimated): 0.90 (one device), 1.24 (two replicas with
mirrored variables, collective buckets), 0.84 (a tensor-split plan), 0.54 (a
model whose activations dominate). Hence the bounds asserted: [0.75, 1.5]
where weights and optimizer state dominate, [1/3, 0.75] where activations do.
"""
import contextlib
import dataclasses
import io

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import tensor_shape

from equivalence import plan_of

import tfpar as wh
from tfpar.cluster.hardware import CATALOG, DTYPES, HOST_CPU, Hardware, device_hardware, slowest
from tfpar.config import Config
from tfpar.hooks.capture import existing_capture
from tfpar.runtime.graph_state import existing_state
from tfpar.planner.auto import search
from tfpar.planner.model_view import ModelView, timed
from tfpar.planner.stage_costs import stage_costs
from tfpar.planner.comm import allgather, allreduce
from tfpar.planner.layers import Layer, LayerGraph
from tfpar.planner.roofline import low_precision_speed_up
from tfpar.planner.sharding_costs import Mesh, Problem
from tfpar.analysis.model_view import model_view
from tfpar.analysis.graph_index import GraphIndex

v1 = tf.compat.v1
FLOAT = 4
ALPHA = 10e-6  # comm.py's latency per message
LAUNCHES = 3 * 5e-6  # step_model: per op that computes or allocates, 3 kernels of 5 us each
LOSS = "sparse_softmax_cross_entropy_loss"
# What a backward op reads is kept from the forward pass until it runs
# (``ModelView.kept_bytes``), per row: an activation's output (its gradient
# reads it, as does the next MatMul's weight gradient), a layer's output that
# a MatMul reads without an activation between them, and the softmax
# cross-entropy's backprop, computed in the forward op: one float per class.
# A MatMul's or bias add's output read only by the next op keeps nothing;
# the loss's per-example products and shapes keep nothing either.
CLASSES = 3
XENT_ROW_BYTES = CLASSES * 4


# ---------------------------------------------------------------------------
# Hand tables of the shared test models (used by test_auto.py and
# test_auto_sharding.py too): (layer scope, an op of it, weight bytes,
# bytes per row kept for the backward pass), in model order.

def deep_mlp_layers(layers):
    """``equivalence.deep_mlp(layers)``: 6 features, ``layers`` x (dense to 8:
    MatMul with the kernel, add with the bias, both keeping nothing; tanh
    outside the scope, keeping its 8 floats), dense to 3 classes (keeping
    nothing), the loss (the cross-entropy's backprop)."""
    table, width = [], 6
    for i in range(layers):
        tanh = "Tanh" if i == 0 else f"Tanh_{i}"
        table.append((f"layer{i}", f"layer{i}/MatMul", width * 8 * FLOAT, 0))
        table.append((f"layer{i}", f"layer{i}/add", 8 * FLOAT, 0))
        table.append((tanh, tanh, 0, 8 * FLOAT))
        width = 8
    table.append(("logits", "logits/MatMul", (8 * CLASSES + CLASSES) * FLOAT, 0))
    table.append((LOSS, f"{LOSS}/xentropy/xentropy", 0, XENT_ROW_BYTES))
    return table


TRANSFORMER_MLP_LAYERS = [  # test_auto_sharding.transformer_mlp
    ("embed", "embed/MatMul", (6 * 16 + 16) * FLOAT, 16 * FLOAT),  # fc1's weight gradient reads it
    ("fc1", "fc1/MatMul", (16 * 64 + 64) * FLOAT, 64 * FLOAT),    # the Relu's output
    ("fc2", "fc2/MatMul", (64 * 16 + 16) * FLOAT, 0),             # read by the residual add only
    ("add", "add", 0, 16 * FLOAT),                                 # logits' weight gradient
    ("logits", "logits/MatMul", (16 * CLASSES + CLASSES) * FLOAT, 0),
    (LOSS, f"{LOSS}/xentropy/xentropy", 0, XENT_ROW_BYTES),
]
SPLIT_WEIGHTS = ("column", "row", "vocab")


def hand_memory(table, global_batch, devices, stages=None, num_stages=1, micro=1, tensor=1,
                candidates=None, state=4):
    """Bytes per device of each stage, by the planner's stated model: ``state``
    x the weights a device holds (weights, gradients and the optimizer's
    slots: 4 with Adam, 2 with SGD; a split layer holds 1 / ``tensor`` of them) + kept bytes
    per row x the rows a device keeps x micro-batches in flight (1F1B: stage s
    of p holds min(p - s, M)). ``stages``: the stage of each layer, by scope or
    by the op named in the table. Rows: the micro-batch's rows / the data
    degree, split over the tensor group (data parallel layers: B / devices;
    column, shards, xent: their share of the features) except whole rows of
    the group for row and vocab (their partial sums) and whole."""
    data = devices // (num_stages * tensor)
    rows_group = global_batch / micro / data
    memory = [0.0] * num_stages
    for scope, op, weights, per_row in table:
        candidate = (candidates or {}).get(scope, "dp")
        rows = rows_group if candidate in ("row", "whole", "vocab") else rows_group / tensor
        s = 0 if stages is None else stages[scope] if scope in stages else stages[op]
        held = weights / tensor if candidate in SPLIT_WEIGHTS else weights
        memory[s] += state * held + per_row * rows * min(num_stages - s, micro)
    return memory


def planned_stages(build, config, shape=(None, 6)):
    """(plan, op name -> stage) of ``build`` under ``config``: the stages the
    search chose for each forward op (built like ``plan_of``, not run)."""
    graph = tf.Graph()
    with graph.as_default(), contextlib.redirect_stderr(io.StringIO()):
        wh.init(config)
        build(v1.placeholder(tf.float32, list(shape)), v1.placeholder(tf.int64, [None]))
        plan = wh.current_plan()
        tags = existing_state(graph).automatic[1].tags
    wh.reset()
    return plan, tags


# ---------------------------------------------------------------------------
# Communication: the alpha-beta model of comm.py, a ring over n devices.

def test_allreduce_by_hand():
    """All-reduce of S bytes on n devices: the ring's bytes, 2 (n-1)/n S per
    device, at 2 ceil(log2 n) latencies alpha (10 us; Rabenseifner's
    algorithm, NCCL's trees): T = 2 ceil(log2 n) alpha + 2 (n-1)/n S / bandwidth."""
    n, size, bandwidth = 4, 100e6, 10e9
    cost = allreduce(n, size, bandwidth)
    # 2 * 3 / 4 * 100 MB = 150 MB sent per device; 2 log2 4 = 4 latencies.
    assert cost.bytes == pytest.approx(150e6)
    assert cost.seconds == pytest.approx(4 * 10e-6 + 150e6 / 10e9)  # 0.01504 s
    assert allreduce(n, size, bandwidth, latency=False).seconds == pytest.approx(0.015)
    assert allreduce(1, size, bandwidth) == (0.0, 0.0)  # nothing to reduce
    # 8 devices: 6 latencies, not a ring's 14; 6 devices round up to 8's
    assert allreduce(8, 0.0, bandwidth).seconds == pytest.approx(6 * 10e-6)
    assert allreduce(6, 0.0, bandwidth).seconds == pytest.approx(6 * 10e-6)


def test_ring_allgather_by_hand():
    """Ring all-gather of an S-byte tensor held in n pieces: n-1 steps of S/n:
    T = (n-1) alpha + (n-1)/n S / bandwidth."""
    cost = allgather(8, 64e6, 16e9)
    assert cost.bytes == pytest.approx(56e6)  # 7 / 8 * 64 MB
    assert cost.seconds == pytest.approx(7 * 10e-6 + 56e6 / 16e9)  # 0.00357 s


def test_split_layers_communication_by_hand():
    """A weighted layer split over t = 4 devices (one group: data degree 1), no
    compute (flops 0) so only communication is left:
      * row (Megatron SP2): the [rows, out] partial sums all-reduced over the
        group: 2 log2(t) alpha + 2 (t-1)/t x rows x out_bytes / bandwidth;
      * column reading the model's input (fed split by rows): all-gathered
        forward, its gradient gathered back in the backward pass:
        2 x [(t-1) alpha + (t-1)/t x rows x in_bytes / bandwidth]."""
    rows, out_bytes, in_bytes = 64, 4096.0, 1024.0  # over 10 GB/s
    layer = Layer("fc", "matmul", flops=0.0, out_bytes=out_bytes, activation_bytes=0.0,
                  param_bytes=1e6, input_bytes=in_bytes, ops=(0,), signature=())
    hardware = Hardware("test", 1.0, 16.0, intra_node_gbps=10)
    problem = Problem(LayerGraph((layer,), ()), Mesh(4, 4, rows, hardware))
    input_gather = 2 * (3 * ALPHA + 3 / 4 * 64 * 1024 / 10e9)
    row = problem.node(0, "row")
    assert row.bytes == pytest.approx(2 * 3 / 4 * 64 * 4096 + 2 * 3 / 4 * 64 * 1024)
    assert row.seconds == pytest.approx(4 * ALPHA + 2 * 3 / 4 * 64 * 4096 / 10e9 + input_gather)
    column = problem.node(0, "column")
    assert column.seconds == pytest.approx(input_gather)  # weights never all-reduced (d = 1)


def weightless_chain(layers, edges):
    """A Problem on 4 devices of one tensor group, 64 rows, of ``layers``
    ((name, kind, bytes per row out)) with neither FLOPs nor weights."""
    made = tuple(Layer(name, kind, 0.0, out, 0.0, 0.0, 0.0, (i,), (name,))
                 for i, (name, kind, out) in enumerate(layers))
    hardware = Hardware("test", 1.0, 16.0, intra_node_gbps=10)
    return Problem(LayerGraph(made, edges), Mesh(4, 4, 64, hardware))


def test_a_megatron_mlp_costs_an_all_reduce_each_way():
    """Shoeybi et al. 2019, §3: layer norm (whole rows) -> fc1 by columns ->
    GeLU on shards -> fc2 by rows -> residual add. Forward, fc2's partial
    sums are all-reduced (g); backward, fc1's partial input gradients are
    (f): 2 x 2 (t-1)/t x 64 rows x 1024 bytes = 196608 bytes. Before, f
    was left out (98304)."""
    problem = weightless_chain(
        (("ln", "other", 1024), ("fc1", "matmul", 4096), ("gelu", "elementwise", 4096),
         ("fc2", "matmul", 1024), ("add", "elementwise", 1024)),
        ((0, 1, 1024.0), (1, 2, 4096.0), (2, 3, 4096.0), (3, 4, 1024.0)))
    chosen = ("whole", "column", "shards", "row", "whole")
    assert problem.objective(chosen).bytes == 2 * allreduce(4, 64 * 1024, 1e10).bytes == 196608


def test_q_k_and_v_reading_one_layer_norm_share_its_all_reduce():
    """Q, K and V by columns each hold a partial gradient of the layer norm's
    output; they are summed on each device first, then all-reduced once:
    each of the three edges carries a third of it. Read split by batch
    rows, the norm's output is gathered once for the three (each edge a
    third of the all-gather) and the sum reduce-scattered back once."""
    problem = weightless_chain((("ln", "other", 1024), ("q", "matmul", 1024),
                                ("k", "matmul", 1024), ("v", "matmul", 1024)),
                               ((0, 1, 1024.0), (0, 2, 1024.0), (0, 3, 1024.0)))
    once = allreduce(4, 64 * 1024, 1e10)
    assert problem.objective(("whole", "column", "column", "column")).bytes == pytest.approx(
        once.bytes)
    assert problem.objective(("dp", "column", "column", "column")).bytes == pytest.approx(
        2 * allgather(4, 64 * 1024, 1e10).bytes)


# ---------------------------------------------------------------------------
# Layer FLOPs from real TF graphs (the model view of rewriters/model_view.py).

def graph_view(make_loss):
    """(forward ops, model view) of ``make_loss()``'s graph, trained with
    Adam (the published runs' optimizer, whose two slots per weight the
    memory model counts)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        v1.train.AdamOptimizer(1e-4).minimize(make_loss())
        order, view = model_view(GraphIndex(graph), existing_capture(graph))
    wh.reset()
    return order, view


def view_of(make_loss):
    """{op name: (FLOPs per row, output bytes per row, weight bytes)} of the
    forward ops of ``make_loss()``'s graph."""
    order, view = graph_view(make_loss)
    return {op.name: (view.flops[i], view.activation_bytes[i], view.param_bytes[i])
            for i, op in enumerate(order)}


def test_dense_layer_flops_by_hand():
    """[B, D] x [D, H] costs 2 B D H FLOPs (a multiply and an add per term):
    per row 2 D H = 2 x 6 x 7 = 84; bias and ReLU one per output element."""
    ops = view_of(lambda: tf.reduce_sum(v1.layers.dense(
        v1.placeholder(tf.float32, [None, 6]), 7, tf.nn.relu, name="d")))
    assert ops["d/MatMul"][:2] == (2 * 6 * 7, 7 * FLOAT)
    assert ops["d/BiasAdd"][:2] == ops["d/Relu"][:2] == (7, 7 * FLOAT)
    # the kernel's and bias's bytes, counted at the op that first reads each
    assert ops["d/MatMul/ReadVariableOp"][2] + ops["d/BiasAdd/ReadVariableOp"][2] == (6 * 7 + 7) * 4


def test_dense_layer_flops_with_a_static_batch():
    """A static batch of B = 4: still per row, so the whole batch is
    B x 84 = 336 = 2 B D H."""
    ops = view_of(lambda: tf.reduce_sum(v1.layers.dense(
        v1.placeholder(tf.float32, [4, 6]), 7, name="d")))
    assert 4 * ops["d/MatMul"][0] == 2 * 4 * 6 * 7


def test_dense_layer_on_a_sequence_flops_by_hand():
    """[B, T, D] through dense(H): tensordot reshapes to [B T, D] (static shape
    [None, None]); the view carries T D elements per row through the reshape:
    2 T D H = 2 x 5 x 6 x 7 = 420 FLOPs and T H = 35 floats out per row."""
    ops = view_of(lambda: tf.reduce_sum(v1.layers.dense(
        v1.placeholder(tf.float32, [None, 5, 6]), 7, name="d")))
    assert ops["d/Tensordot/MatMul"][:2] == (2 * 5 * 6 * 7, 5 * 7 * FLOAT)


def test_reshapes_of_a_sequence_layer_allocate_nothing():
    """Tensordot's identity transpose and its two reshapes hand on their
    input's buffer (TensorFlow forwards it): no activation bytes (they were
    counted as T D, T D and T H floats per row, 5.5x the MatMul and BiasAdd
    outputs of a Megatron fc2). The edges still carry the data."""
    order, view = graph_view(lambda: tf.reduce_sum(v1.layers.dense(
        v1.placeholder(tf.float32, [None, 5, 6]), 7, name="d")))
    ops = {op.name: i for i, op in enumerate(order)}
    assert [view.activation_bytes[ops[name]] for name in
            ("d/Tensordot/transpose", "d/Tensordot/Reshape", "d/Tensordot")] == [0.0] * 3
    assert view.activation_bytes[ops["d/BiasAdd"]] == 5 * 7 * FLOAT
    into_matmul = [size for i, j, size in view.edges if j == ops["d/Tensordot/MatMul"]]
    assert max(into_matmul) == 5 * 6 * FLOAT


def test_conv2d_flops_by_hand():
    """9x9x3 input, 4 filters 3x3, stride 2, valid: (9-3)/2+1 = 4, so a 4x4x4
    output, each element a 3x3x3 dot product: 2 x 4x4x4 x 27 = 3456 per row."""
    ops = view_of(lambda: tf.reduce_sum(v1.layers.conv2d(
        v1.placeholder(tf.float32, [None, 9, 9, 3]), 4, 3, strides=2, name="c")))
    assert ops["c/Conv2D"][:2] == (2 * 4 * 4 * 4 * 27, 4 * 4 * 4 * FLOAT)
    assert ops["c/Conv2D/ReadVariableOp"][2] == 3 * 3 * 3 * 4 * FLOAT


def test_a_batch_mean_holds_nothing_per_row():
    """A reduction to a scalar reads T H elements per row (its FLOPs) but
    writes one number for the whole batch: no bytes per row (it used to be
    counted as large as its input, here 35 floats per row)."""
    ops = view_of(lambda: tf.reduce_mean(v1.layers.dense(
        v1.placeholder(tf.float32, [None, 5, 6]), 7, name="d")))
    assert ops["Mean"][:2] == (5 * 7, 0.0)


# ---------------------------------------------------------------------------
# Whole-plan estimates by hand: a small Adam MLP (6 -> 16 -> 16 -> 3).

def adam_mlp(x, y):
    h = v1.layers.dense(x, 16, tf.nn.relu, name="l0")
    h = v1.layers.dense(h, 16, tf.nn.relu, name="l1")
    logits = v1.layers.dense(h, 3, name="logits")
    loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
    return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)


def test_data_parallel_estimate_by_hand():
    """4 replicas, global batch 32 (8 rows each), HOST_CPU (0.05 TFLOPS, 10 GB/s):
      memory = 4 x 1740 + 8 x 140 = 8080 bytes per device;
      comm = ring all-reduce of the 1740 gradient bytes: 2 x 3/4 x 1740 = 2610;
      time = 3 x forward FLOPs x 8 rows / 0.05e12 + 4 alpha (2 log2 4) + 2610 / 10e9
      + 3 kernel launches of each of the 10 ops that compute, with forward
      FLOPs per row l0 2x6x16+16+16, l1 2x16x16+16+16, logits 2x16x3+3,
      loss 1, mean 1 = 869."""
    host = {"name": "host-CPU", "tflops": 0.05, "memory_gb": 16, "intra_node_gbps": 10,
            "inter_node_gbps": 1.25, "efficiency": 1.0}  # HOST_CPU, not this host's rate
    plan = plan_of(adam_mlp, {"auto.auto_parallel": True, "cluster.num_devices": 4,
                              "auto.num_task_graph": 1, "cluster.hardware": [host]})
    assert plan.data_parallel_degree == 4 and not plan.sharding
    weights = (6 * 16 + 16 + 16 * 16 + 16 + 16 * 3 + 3) * 4  # kernels and biases
    # kept per row: l0's and l1's Relu (16 floats each; their MatMul and
    # BiasAdd nothing); the cross-entropy's backprop (3 classes)
    per_row = 16 * 4 + 16 * 4 + XENT_ROW_BYTES
    assert (weights, per_row) == (1740, 140)
    assert plan.estimate["memory_bytes_per_device"] == [4 * 1740 + 8 * 140] * 4
    assert plan.estimate["comm_bytes"] == pytest.approx(2 * 3 / 4 * 1740)
    flops = (2 * 6 * 16 + 32) + (2 * 16 * 16 + 32) + (2 * 16 * 3 + 3) + 1 + 1
    assert flops == 869
    assert plan.estimate["step_time_s"] == pytest.approx(
        3 * 869 * 8 / 0.05e12 + 4 * ALPHA + 2610 / 10e9 + 10 * LAUNCHES)


def test_pipeline_estimate_by_hand():
    """2 stages x 2 replicas, 1F1B, 2 micro-batches of 32 / 2 / 2 = 8 rows. The
    search cuts after l0 (the plan's TaskGraphs train 448 and 1292 bytes):
      stage 0: 4 x 448 + 64 x 8 rows x 2 micro-batches in flight = 2816;
      stage 1: 4 x 1292 + (64 + 12) x 8 x 1 = 5776;
      comm: 16 floats cross the cut per row, forward and back, per
      micro-batch: 64 x 8 x 2 x 2 = 2048, plus each stage's gradients
      all-reduced over 2 replicas: 2 x 1/2 x (448 + 1292) = 1740."""
    plan = plan_of(adam_mlp, {"auto.auto_parallel": True, "cluster.num_devices": 4,
                              "auto.num_task_graph": 2, "pipeline.num_micro_batch": 2,
                              "pipeline.schedule": "1f1b"})
    assert [tg.param_bytes for tg in plan.task_graphs] == [448, 1088 + 204]
    assert [tg.estimate["memory_bytes"] for tg in plan.task_graphs] == [
        4 * 448 + 64 * 8 * 2, 4 * 1292 + 76 * 8]
    # Each device its stage's: stage 0 on CPU:0 and CPU:2, stage 1 on CPU:1 and CPU:3.
    assert [tg.devices for tg in plan.task_graphs] == [
        [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in ids] for ids in ((0, 2), (1, 3))]
    assert plan.estimate["memory_bytes_per_device"] == [2816, 5776] * 2
    assert plan.estimate["comm_bytes"] == pytest.approx(64 * 8 * 2 * 2 + 1740)


# ---------------------------------------------------------------------------
# Calibrated terms (issue 14): throughput per compute dtype, the batch from
# the graph, one-micro-batch pipelines, activations of [B, T, H] layers.

def test_catalog_peaks_per_dtype():
    """The datasheets' dense peaks (TFLOPS; hardware.py's table): a dtype a
    device has no units for (TF32, bf16 before Ampere) runs at its fp32
    rate. The planner assumes peak x 0.7 (``hardware.EFFICIENCY``), for
    memory bandwidth too (A100: 2039 GB/s); HOST_CPU's 0.05 TFLOPS is
    already a sustained rate, and its memory is not on the roofline."""
    expected = {"P100-16GB": (4.7, 9.3, 9.3, 18.7, 9.3), "V100-32GB": (7.8, 15.7, 15.7, 125, 15.7),
                "T4": (0.25, 8.1, 8.1, 65, 8.1), "A100-80GB": (19.5, 19.5, 156, 312, 312),
                "H100-80GB": (67, 67, 494.5, 989, 989)}
    assert DTYPES == ("fp64", "fp32", "tf32", "fp16", "bf16")
    for name, peaks in expected.items():
        assert tuple(CATALOG[name].peak(dtype) for dtype in DTYPES) == peaks, name
    assert CATALOG["V100-32GB"].flops_per_s("fp16") == pytest.approx(87.5e12)
    assert CATALOG["V100-32GB"].flops_per_s("tf32") == pytest.approx(10.99e12)
    assert CATALOG["A100-80GB"].flops_per_s("tf32") == pytest.approx(109.2e12)
    assert {name: hw.memory_gbps for name, hw in CATALOG.items()} == {
        "P100-16GB": 732, "V100-32GB": 900, "T4": 320, "A100-80GB": 2039, "H100-80GB": 3350}
    assert CATALOG["A100-80GB"].memory_bytes_per_s() == pytest.approx(1427.3e9)
    assert HOST_CPU.flops_per_s("fp16") == pytest.approx(0.05e12)
    assert HOST_CPU.memory_bytes_per_s() == float("inf")


def test_explicit_specs_peaks_and_efficiency():
    """``tflops`` is the peak of every dtype; a ``tflops_<dtype>`` key sets
    one (TF32 without its own runs at ``tflops_fp32``); ``efficiency``
    defaults to 0.7 and is validated <= 1; ``memory_gbps`` is optional
    (without it, ops are timed by FLOPs alone)."""
    plain = {"name": "a", "tflops": 100, "memory_gb": 8}
    custom = {**plain, "tflops_fp32": 10, "tflops_fp16": 400, "efficiency": 0.8,
              "memory_gbps": 1000}
    Config({"cluster.hardware": [plain, custom]})  # valid keys
    a, b = device_hardware([plain, custom], 2)
    assert [a.peak(dtype) for dtype in DTYPES] == [100] * 5 and a.efficiency == 0.7
    assert a.memory_gbps is None and b.memory_bytes_per_s() == pytest.approx(800e9)
    assert [b.peak(dtype) for dtype in DTYPES] == [100, 10, 10, 400, 100]
    assert b.flops_per_s("fp16") == pytest.approx(400 * 0.8 * 1e12)
    cluster = slowest([CATALOG["V100-32GB"], CATALOG["A100-80GB"]])
    assert [cluster.peak(dtype) for dtype in DTYPES] == [7.8, 15.7, 15.7, 125, 15.7]
    assert (cluster.name, cluster.memory_gb, cluster.memory_gbps) == ("cluster", 32, 900)
    assert slowest([a, b]).memory_gbps is None


def mixed_precision_dense():
    """fp16 matmuls between float32 casts (keras' mixed_float16 pattern)."""
    x = tf.cast(v1.placeholder(tf.float32, [None, 6]), tf.float16)
    return tf.reduce_sum(tf.cast(v1.layers.dense(x, 7, name="d"), tf.float32))


@pytest.mark.parametrize("dtype,tf32,expected", [
    (tf.float32, True, "tf32"), (tf.float32, False, "fp32"), (tf.float16, True, "fp16"),
    (tf.bfloat16, True, "bf16"), (tf.float64, True, "fp64"), (None, True, "fp16")])
def test_compute_dtype_from_the_graph(dtype, tf32, expected):
    """The dtype of most FLOPs; float32 is "tf32" while TensorFlow runs it so
    (``enable_tensor_float_32_execution``, on by default)."""
    make = mixed_precision_dense if dtype is None else lambda: tf.reduce_sum(
        v1.layers.dense(v1.placeholder(dtype, [None, 6]), 7, name="d"))
    tf.config.experimental.enable_tensor_float_32_execution(tf32)
    try:
        _, view = graph_view(make)
    finally:
        tf.config.experimental.enable_tensor_float_32_execution(True)
    assert view.compute_dtype == expected


def test_compute_time_is_flops_over_peak_times_efficiency():
    """1e9 FLOPs per row, 8 rows: fp16 on a V100 at 125 x 0.7 TFLOPS, forward
    8e9 / 87.5e12 = 91 us; tf32 on a V100 (no TF32 units) at 15.7 x 0.7:
    728 us; on an A100 at 156 x 0.7: 73 us. The sharding search's layer
    costs 3 x forward (with backward) on its share of the rows."""
    view = ModelView(flops=[4e8, 6e8], activation_bytes=[0.0, 0.0], param_bytes=[0.0, 0.0],
                     edges=[(0, 1, 0.0)], compute_dtype="fp16")
    v100, a100 = CATALOG["V100-32GB"], CATALOG["A100-80GB"]
    assert stage_costs(view, [0, 0], 1, 8, v100).forward_s == pytest.approx((8e9 / 87.5e12,))
    tf32 = dataclasses.replace(view, compute_dtype="tf32")
    assert stage_costs(tf32, [0, 0], 1, 8, v100).forward_s == pytest.approx((8e9 / 10.99e12,))
    assert stage_costs(tf32, [0, 0], 1, 8, a100).forward_s == pytest.approx((8e9 / 109.2e12,))
    layer = Layer("fc", "matmul", flops=1e9, out_bytes=0.0, activation_bytes=0.0,
                  param_bytes=0.0, input_bytes=0.0, ops=(0,), signature=())
    problem = Problem(LayerGraph((layer,), ()), Mesh(4, 4, 32, v100, "fp16"))
    assert problem.node(0, "column").seconds == pytest.approx(3 * 1e9 * 32 / 4 / 87.5e12)


def test_roofline_times_an_op_by_its_flops_or_its_memory_traffic():
    """A100, tf32 (156 x 0.7 = 109.2 TFLOP/s, 2039 x 0.7 = 1427.3 GB/s): a
    matmul of 1e9 FLOPs and 1e6 bytes per row is bound by FLOPs (9.16 us per
    row), a softmax of 1e6 FLOPs and 4e8 bytes by memory (280 us per row);
    8 rows forward: 8 x 289.4 us. Mixed precision: the matmul at 312 x 0.7,
    the softmax's 2e8 bytes: 4.58 + 140.1 us, 1.98x faster. Without traffic
    (a view read elsewhere, or a device without ``memory_gbps``) FLOPs alone."""
    view = ModelView(flops=[1e9, 1e6], activation_bytes=[0.0, 0.0], param_bytes=[0.0, 0.0],
                     edges=[(0, 1, 0.0)], compute_dtype="tf32", traffic_bytes=[1e6, 4e8])
    a100 = CATALOG["A100-80GB"]
    row = 1e9 / 109.2e12 + 4e8 / 1427.3e9
    assert stage_costs(view, [0, 0], 1, 8, a100).forward_s == pytest.approx((8 * row,), 1e-4)
    assert timed(view, a100).flops == pytest.approx([1e9, 4e8 * 109.2e12 / 1427.3e9], 1e-4)
    low = 1e9 / 218.4e12 + 2e8 / 1427.3e9
    assert low_precision_speed_up(view.flops, view.traffic_bytes, a100, "tf32") == \
        pytest.approx(row / low, 1e-4)
    assert low_precision_speed_up(view.flops, None, a100, "tf32") == 2
    assert low_precision_speed_up(view.flops, view.traffic_bytes, a100, "bf16") == 1
    blind = dataclasses.replace(a100, memory_gbps=None)
    assert stage_costs(view, [0, 0], 1, 8, blind).forward_s == \
        pytest.approx((8 * 1.001e9 / 109.2e12,))


def test_memory_traffic_from_the_graph():
    """Bytes per row read and written (float32): a dense layer [6] -> [7]
    reads 24 and writes 28; its BiasAdd, Relu and Square run as one fused
    kernel reading the MatMul's 28 and writing the Square's 28 (the
    intermediates are never written); the Reshape is a view (nothing), the
    Shape reads no elements."""
    def loss():
        h = tf.nn.relu(v1.layers.dense(v1.placeholder(tf.float32, [None, 6]), 7, name="d"))
        h = tf.reshape(tf.square(h), [-1, 7])
        return tf.reduce_sum(h) + tf.cast(tf.shape(h)[0], tf.float32)
    order, view = graph_view(loss)
    traffic = {op.name: view.traffic_bytes[i] for i, op in enumerate(order)}
    assert traffic["d/MatMul"] == 24 + 28
    assert (traffic["d/BiasAdd"], traffic["Relu"], traffic["Square"]) == (28, 0, 28)
    assert traffic["Reshape"] == 0 and traffic["Shape"] == 0


def test_silu_s_custom_gradient_identity_moves_and_keeps_nothing():
    """``tf.nn.silu`` ends in the ``IdentityN`` its custom gradient makes: it
    forwards its inputs' buffers, so it reads, writes and keeps no bytes."""
    order, view = graph_view(lambda: tf.reduce_sum(tf.nn.silu(
        v1.layers.dense(v1.placeholder(tf.float32, [None, 6]), 7, name="d"))))
    identity = [op.name for op in order].index("IdentityN")
    assert view.traffic_bytes[identity] == 0 and view.activation_bytes[identity] == 0


def adam_mlp_on_a_dataset(batch):
    """``adam_mlp`` reading ``batch(batch, drop_remainder=True)`` batches."""
    def build(_x, _y):
        data = tf.data.Dataset.from_tensor_slices((np.zeros((2 * batch, 6), np.float32),
                                                   np.zeros(2 * batch, np.int64)))
        x, y = v1.data.make_one_shot_iterator(data.batch(batch, drop_remainder=True)).get_next()
        return adam_mlp(x, y)
    return build


def test_the_batch_comes_from_the_graph():
    """adam_mlp data parallel on 4 devices (1740 weight bytes, 412 bytes per
    row, see above): inputs declaring 256 rows (placeholders, or a dataset
    batched with drop_remainder) cost 256 / 4 = 64 rows a device; the config
    key overrides (64: 16 rows); inputs that declare nothing: 32 (8 rows)."""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 4, "auto.num_task_graph": 1}

    def memory(build, extra=None, shape=(None, 6)):
        return max(plan_of(build, {**config, **(extra or {})},
                           shape=shape).estimate["memory_bytes_per_device"])
    assert memory(adam_mlp, shape=(256, 6)) == 4 * 1740 + 64 * 140
    assert memory(adam_mlp_on_a_dataset(256)) == 4 * 1740 + 64 * 140
    assert memory(adam_mlp, {"auto.global_batch": 64}, shape=(256, 6)) == 4 * 1740 + 16 * 140
    assert memory(adam_mlp) == 4 * 1740 + 8 * 140


def test_group_size_costs_the_graphs_batch():
    """Ada-Grouper's k (``pipeline.group_size: auto``) is costed on the
    graph's batch too: 32768 declared rows do not fit a device of 100 KiB
    that 32 rows (nothing declared) fit."""
    config = {"cluster.num_devices": 2, "auto.num_task_graph": 2, "pipeline.num_micro_batch": 4,
              "pipeline.schedule": "kfkb", "pipeline.group_size": "auto",
              "cluster.hardware": [{"name": "small", "tflops": 1, "memory_gb": 2 ** -20 * 100}]}
    assert plan_of(adam_mlp, config).group_size >= 1
    with pytest.raises(wh.PlanError, match="no group size fits"):
        plan_of(adam_mlp, config, shape=(32768, 6))


def test_one_micro_batch_pipeline_runs_its_stages_one_after_the_other():
    """2 stages, 1 micro-batch, 8 rows on 2 devices (no replicas: no
    all-reduce), 1 TFLOPS at efficiency 1, 10 GB/s: F0, send, F1, B1, send
    back, B0 in sequence, forward + backward = 3 x forward:
      3 x (1e9 + 3e9) x 8 / 1e12 + 2 x (10 us + 4096 x 8 / 10e9) = 96.027 ms
    (and each op's 3 kernel launches), the sum of the stages, never less than
    data parallelism's 3 x 4e9 x 4 rows / 1e12 = 48 ms on the same devices
    (the weights all-reduced too)."""
    view = ModelView(flops=[1e9, 3e9], activation_bytes=[4096.0, 4.0], param_bytes=[4e3, 4e3],
                     edges=[(0, 1, 4096.0)])
    hardware = Hardware("h", 1.0, 16.0, intra_node_gbps=10, efficiency=1.0)
    pipeline = search(view, 2, hardware, global_batch=8, num_micro_batch=1, pipeline=2)
    assert (pipeline.pipeline, pipeline.stages) == (2, (0, 1))
    assert pipeline.step_time_s == pytest.approx(
        3 * 4e9 * 8 / 1e12 + 2 * (10e-6 + 4096 * 8 / 10e9) + 2 * LAUNCHES)
    data_parallel = search(view, 2, hardware, global_batch=8, num_micro_batch=1, pipeline=1)
    assert data_parallel.step_time_s == pytest.approx(
        3 * 4e9 * 4 / 1e12 + 2 * ALPHA + 8e3 / 10e9 + 2 * LAUNCHES)
    assert search(view, 2, hardware, global_batch=8, num_micro_batch=1).pipeline == 1


def mlp_block(activation=tf.nn.relu):
    """build(x, y): a Megatron MLP block on [B, D] or [B, T, D] (dense 4D
    with ``activation``, dense D, residual; the loss its mean square)."""
    def build(x, y):
        del y
        depth = x.shape[-1]
        h = v1.layers.dense(x, 4 * depth, activation, name="fc1")
        out = v1.layers.dense(h, depth, name="fc2")
        loss = tf.reduce_mean(tf.square(out + x))
        return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)
    return build


def mlp_block_ops(depth, seq=None, kept=1):
    """Hand table of ``mlp_block`` on [B, depth] or [B, seq, depth], by op (a
    pipeline may cut a layer after its MatMul): per row fc1 keeps ``kept`` x
    T x 4D floats (``ACTIVATION_KEPT``); the residual add keeps T x D (the
    square's gradient reads it); the MatMuls, fc2's BiasAdd, the square and
    tensordot's shape arithmetic keep nothing (T = 1 and no tensordot on
    [B, D]). Kernels go with the MatMul, biases with the BiasAdd."""
    wide, tokens = 4 * depth, seq or 1
    matmul = "fc{}/Tensordot/MatMul" if seq else "fc{}/MatMul"
    return [("fc1", matmul.format(1), depth * wide * FLOAT, 0),
            ("fc1", "fc1/BiasAdd", wide * FLOAT, kept * tokens * wide * FLOAT),
            ("fc2", matmul.format(2), wide * depth * FLOAT, 0),
            ("fc2", "fc2/BiasAdd", depth * FLOAT, 0),
            ("add", "add", 0, tokens * depth * FLOAT),
            ("Square", "Square", 0, 0)]


# Outputs of width 4D an activation keeps: ReLU its output (its gradient
# reads it, as does fc2's weight gradient); erf GELU, 0.5 x (1 + erf(x /
# sqrt 2)), keeps 0.5 x (read by the last product's gradient), x / sqrt 2
# (read by erf's gradient), 1 + erf(...) (the last product's other factor)
# and the product (fc2's weight gradient): 4.
ACTIVATION_KEPT = {"relu": 1, "gelu": 4}


def test_sequence_layers_pipeline_memory_by_hand():
    """[16, 32, 64] inputs, 2 stages x 2 replicas, 1F1B, 2 micro-batches: 4 rows
    per micro-batch and replica. The stage ILP cuts after fc1's MatMul: the
    fewest bytes crossing (fc1's 32 x 256 floats per row after its MatMul
    or after its BiasAdd, the ILP's tie) within its balance tolerance
    (2 x 64 x 256 x 32 FLOPs per row against 2 x 256 x 64 x 32 + 3 x 64 x
    32 + 2 x 256 x 32 for the rest, 0.8% more than the most balanced cut,
    after the BiasAdd). Stage 0 holds fc1's kernel and keeps nothing (a
    MatMul's output is not read back): 4 x 65536; stage 1 the rest and one
    micro-batch of the ReLU's and of the residual's outputs:
    4 x (1024 + 65536 + 256) + 4 rows x (32768 + 8192). (Before
    tensordot's shape arithmetic held nothing per row, its shape vector
    crossing that cut cost 4 bytes per row and broke the tie.)"""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 4, "auto.num_task_graph": 2,
              "pipeline.num_micro_batch": 2, "pipeline.schedule": "1f1b"}
    plan, stages = planned_stages(mlp_block(), config, shape=(16, 32, 64))
    table = mlp_block_ops(64, seq=32)
    assert [stages[op] for _, op, _, _ in table] == [0, 1, 1, 1, 1, 1]
    by_hand = hand_memory(table, 16, 4, stages, 2, micro=2)
    assert by_hand == [4 * 65536, 4 * (1024 + 65536 + 256) + 4 * (32768 + 8192)]
    assert [tg.estimate["memory_bytes"] for tg in plan.task_graphs] == by_hand


# ---------------------------------------------------------------------------
# Measured: TF's accounting of a real traced step against the estimate.

def wide_mlp(width, layers=3, classes=10):
    def build(x, y):
        h = x
        for i in range(layers):
            h = v1.layers.dense(h, width, tf.nn.relu, name=f"l{i}")
        logits = v1.layers.dense(h, classes, name="logits")
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)
    return build


def _transient_peak(device_stats):
    """The peak of the step's allocations minus deallocations on one device,
    replayed in time order (allocations first within a microsecond)."""
    records = sorted((r.alloc_micros, -r.alloc_bytes) for node in device_stats.node_stats
                     for memory in node.memory for r in memory.allocation_records)
    live = peak = 0
    for _, negated in records:
        live -= negated
        peak = max(peak, live)
    return peak


def measured_step(build, config, batch, features, classes=10):
    """Train ``build`` one step under ``config``, then trace a second one.
    Returns (the plan that ran, {device: (variable bytes, transient peak)})."""
    rng = np.random.RandomState(0)
    values = (rng.randn(batch, features).astype(np.float32),
              rng.randint(0, classes, batch).astype(np.int64))
    graph = tf.Graph()
    with graph.as_default(), contextlib.redirect_stderr(io.StringIO()):
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, features])
        y = v1.placeholder(tf.int64, [None])
        _, train_op = build(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            sess.run(train_op, dict(zip((x, y), values)))
            metadata = v1.RunMetadata()
            sess.run(train_op, dict(zip((x, y), values)), run_metadata=metadata,
                     options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE))
        plan = existing_state(graph).plan
        handles = {op.name: tensor_shape.TensorShape(op.get_attr("shape")).num_elements()
                   * tf.as_dtype(op.get_attr("dtype")).size
                   for op in graph.get_operations() if op.type == "VarHandleOp"}
    wh.reset()
    devices = {}
    for stats in metadata.step_stats.dev_stats:
        held = sum(handles.get(node.node_name, 0) for node in stats.node_stats)
        before = devices.get(stats.device, (0, 0))
        devices[stats.device] = (before[0] + held, before[1] + _transient_peak(stats))
    return plan, devices


def _ratios(plan, devices):
    """measured / estimated for the busiest device (the estimate is the max)."""
    estimated = max(plan.estimate["memory_bytes_per_device"])
    return max(held + peak for held, peak in devices.values()) / estimated


WIDE = 1024  # 3 x (1024 x 1024) weights: 12.05 MiB, Adam state dominates at 32 rows


def test_one_device_estimate_matches_the_allocations():
    """One device, batch 32, Adam: TF holds 36.15 MiB of variables (weights, m,
    v: 3 x 12.05 MiB, + 8 bytes of beta powers) and peaks at about 8 MiB more
    in the step (two 4 MiB kernel gradients alive at once, activations); the
    estimate, 4 x 12.05 + 1.2 MiB of activations = 49.3 MiB: ratio ~0.90."""
    build = wide_mlp(WIDE)
    plan, devices = measured_step(build, {"auto.auto_parallel": True, "cluster.num_devices": 1},
                                  batch=32, features=WIDE)
    trainable = (3 * (WIDE * WIDE + WIDE) + WIDE * 10 + 10) * 4
    (held, peak), = devices.values()
    assert held == 3 * trainable + 2 * 4  # Adam: two slots per weight, and beta1/2 powers
    assert 0 < peak <= trainable + 32 * 3 * 3 * WIDE * 4  # <= gradients + activations counted
    assert 0.75 <= _ratios(plan, devices) <= 1.5


@pytest.mark.filterwarnings("ignore:.*built before the plan existed:tfpar.FallbackWarning")
def test_data_parallel_estimate_matches_the_allocations_per_replica():
    """2 replicas with mirrored variables (the collective reducer: each device
    holds its copy, as the planner assumes), 16 rows each. The fused gradient
    bucket holds the flattened gradients and their all-reduced copy at once
    (24 MiB transient against the 12 MiB the estimate counts): ratio ~1.24."""
    plan, devices = measured_step(
        wide_mlp(WIDE), {"auto.auto_parallel": True, "cluster.num_devices": 2,
                         "auto.num_task_graph": 1, "communication.backend": "collective"},
        batch=32, features=WIDE)
    assert plan.data_parallel_degree == 2 and not plan.sharding
    assert len(devices) == 2 and len({held for held, _ in devices.values()}) == 1
    assert 0.75 <= _ratios(plan, devices) <= 1.5


def test_split_plan_estimate_matches_the_allocations():
    """The search's tensor-split plan of the wide MLP on 2 devices, pinned and
    run: each device holds half of every layer's weights and slots (18.1 MiB),
    the estimate 24.7 MiB: ratio ~0.84."""
    build = wide_mlp(WIDE)
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2, "auto.num_task_graph": 1}
    with contextlib.redirect_stderr(io.StringIO()):
        searched = plan_of(build, config, shape=(None, WIDE))
    assert searched.sharding["tensor_degree"] == 2
    plan, devices = measured_step(build, {**config, "plan": searched.to_dict()},
                                  batch=32, features=WIDE)
    assert plan.sharding == searched.sharding and len(devices) == 2
    trainable = (3 * (WIDE * WIDE + WIDE) + WIDE * 10 + 10) * 4
    assert all(held <= 0.51 * 3 * trainable for held, _ in devices.values())
    assert 0.75 <= _ratios(plan, devices) <= 1.5


def test_activation_heavy_estimate_counts_what_the_backward_keeps():
    """256-wide layers at 1024 rows: activations dominate. The view counts
    what the backward pass reads, each layer's Relu output (1 MiB), not its
    MatMul's and BiasAdd's (which it once counted too: 3 MiB a layer, twice
    the measurement): 4 x 0.76 MiB of weights and state + 3 MiB + the
    cross-entropy's backprop (40 KiB) = 6.09 MiB estimated, 6.5 MiB
    measured: ratio ~1.07."""
    plan, devices = measured_step(wide_mlp(256),
                                  {"auto.auto_parallel": True, "cluster.num_devices": 1,
                                   "auto.global_batch": 1024}, batch=1024, features=256)
    assert 0.75 <= _ratios(plan, devices) <= 1.25
