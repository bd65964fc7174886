"""The planner's memory techniques and micro-batches (issues 14, 15 and 17):
activation recomputation on a GPT layer by hand (Korthikanti et al. 2022),
ZeRO's state bytes, memory pressure choosing micro-batches, recomputation and ZeRO in that order, and per-device
weights and optimizer state that never grow with the tensor or pipeline degree.
"""
import dataclasses

import pytest
import tensorflow as tf

from test_cost_model import graph_view
from test_expert_plans import gpt_loss


import tfpar as wh
from tfpar.cluster.hardware import Hardware
from tfpar.planner.auto import search, search_all
from tfpar.planner.comm import Cost
from tfpar.planner.memory import MIXED_ACTIVATIONS, Techniques, recomputation, state_bytes
from tfpar.planner.step_model import Space, StageModel, best_setting

v1 = tf.compat.v1
FLOAT = 4
# A GPT of 2 layers, hidden h 64, a 4 heads, sequences s of 32, vocabulary 100.
LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 2, 64, 4, 32, 100
SBH = SEQ * HIDDEN  # floats per row (one sequence) of a [s, h] tensor
AS2 = HEADS * SEQ * SEQ  # of an attention score tensor


@pytest.fixture(scope="module")
def gpt_view():
    _, view = graph_view(lambda: gpt_loss(LAYERS, HIDDEN, HEADS, vocab=VOCAB)(
        v1.placeholder(tf.int32, [8, SEQ])))
    return view


def block_ops(view, block):
    return [i for i, label in enumerate(view.labels) if label == block]


def test_recomputation_of_a_gpt_layer_by_hand(gpt_view):
    """Korthikanti et al. count a layer's activations as s b h (34 + 5 a s / h)
    bytes (16 bits, dropout, fused kernels): 34 s b h + 5 a s^2 b. This graph
    (float32, no dropout, TensorFlow's unfused ops) keeps, per sequence, what
    its backward pass reads (``test_kept_bytes_of_a_gpt_layer_by_hand``):
      * ``none``: 28 s h + a s^2 + 4 s floats;
      * ``selective`` drops the attention core's a s^2 (the softmax, the one
        tensor of the core read back; the paper's five bytes per score are
        five tensors of which TensorFlow keeps one) and recomputes the
        core's FLOPs (QK^T, scaling, mask, softmax);
      * ``full`` keeps the layer's input alone: s h floats (the paper's 2 s b h
        bytes in 16 bits), and holds the whole layer's kept bytes again while
        it recomputes it, running its forward FLOPs twice."""
    terms = recomputation(gpt_view)
    ops = block_ops(gpt_view, "h1")
    kept = {mode: sum(terms.kept[mode][i] for i in ops) for mode in terms.kept}
    assert kept["none"] == (28 * SBH + AS2 + 4 * SEQ) * FLOAT
    assert kept["selective"] == (28 * SBH + 4 * SEQ) * FLOAT
    assert kept["full"] == SBH * FLOAT
    assert terms.transient_bytes("full", ops) == kept["none"]
    assert terms.transient_bytes("selective", ops) == AS2 * FLOAT
    layer_flops = sum(gpt_view.flops[i] for i in ops)
    assert sum(terms.flops["full"][i] for i in ops) == layer_flops
    core = [i for i in ops if terms.flops["selective"][i]]
    assert sorted(gpt_view.types[i] for i in core) == ["BatchMatMulV2", "Mul", "Mul", "Softmax",
                                                      "Sub"]
    qk = 2 * HEADS * SEQ * SEQ * (HIDDEN // HEADS)  # Q K^T per sequence
    assert sum(terms.flops["selective"][i] for i in ops) == pytest.approx(qk + 4 * AS2, rel=0.01)
    outside = [i for i, label in enumerate(gpt_view.labels) if label is None]
    for mode in ("selective", "full"):  # embedding, logits and loss keep theirs
        assert [terms.kept[mode][i] for i in outside] == [gpt_view.kept[i] for i in outside]


def test_kept_bytes_of_a_gpt_layer_by_hand(gpt_view):
    """What the backward pass reads after the gradient comes back
    (``ModelView.kept_bytes``), per sequence of layer h1: 28 s h floats -
    layer norms 2 x 3 (the sub, mul and output), the 3 head transposes of Q,
    K, V, the context's transpose, residuals 2, GELU 4 x 4 (x / sqrt 2, erf +
    1, x / 2, output) - plus a s^2 (the softmax), 2 s (the norms' rsqrt) and
    2 s (their means: the variance's gradient computes the centred input
    again once the gradient arrives, its ``SquaredDifference`` gradient
    waiting for it by a control edge, and reads the norm's input, kept
    anyway, and mean). The
    scores, their scaling and mask are not read back, nor are the dense
    layers' MatMul and BiasAdd outputs (their gradients need the inputs), nor
    the tensordots' shapes (read early). ``activation_bytes`` counts every
    output, what the planner once kept: 56 s h + 5 a s^2 + 2 x 5 s (the
    tensordots' shape vectors, a few integers for the whole batch, were
    counted as 4 x 5 floats per sequence until issue 64)."""
    ops = block_ops(gpt_view, "h1")
    kept = sum(gpt_view.kept_bytes[i] for i in ops)
    assert kept == (28 * SBH + AS2 + 4 * SEQ) * FLOAT
    assert sum(gpt_view.activation_bytes[i] for i in ops) == (
        56 * SBH + 5 * AS2 + 2 * 5 * SEQ) * FLOAT
    by_type = {}
    for i in ops:
        if gpt_view.kept_bytes[i]:
            by_type[gpt_view.types[i]] = by_type.get(gpt_view.types[i], 0) + 1
    assert "MatMul" not in by_type and "BiasAdd" not in by_type and "Shape" not in by_type
    assert by_type["Softmax"] == 1 and "BatchMatMulV2" not in by_type


def test_state_bytes_by_zero_stage():
    """16 bytes per float32 parameter (weights 4, gradients 4, Adam's two slots
    8): 4 x the weights' bytes; ZeRO-1 (Rajbhandari et al. §5.1) shards the
    slots over d replicas, ZeRO-2 the gradients too."""
    weights, d = 4e9, 8  # 1B parameters
    assert state_bytes(weights, d, 0) == 16e9
    assert state_bytes(weights, d, 1) == 4e9 + 4e9 + 8e9 / 8
    assert state_bytes(weights, d, 2) == 4e9 + 4e9 / 8 + 8e9 / 8
    assert state_bytes(weights, 1, 2) == 16e9
    assert state_bytes(weights, 1, 0, offload=True) == 4e9 + 4e9  # slots on the host


def stage(compute, params=0.0):
    """A stage of ``compute`` seconds per row, keeping 1 byte per row (1/2
    with selective recomputation, 1/8 with full, which holds 1/8 more while
    it recomputes), recomputing 10% (selective) or all of its forward."""
    return StageModel(compute, 0.0, 0.0, 0.0, params, Cost(), (1.0, 0.5, 0.125),
                      (0.0, 0.0, 0.125), (0.0, 0.1, 1.0))


def test_memory_pressure_chooses_micro_batches_then_recomputation_then_zero():
    """One stage, 4 rows per replica on 4 replicas, 1 GB of weights (4 GB with
    gradients and slots): the fastest setting that fits. A row: 1 s of
    compute, 1 byte kept; micro-batches cost a 10 ms launch latency each."""
    model = [dataclasses.replace(stage(1.0, params=1e9), latency_s=0.01)]
    ladder = [Techniques(mode) for mode in ("none", "selective", "full")]

    def pick(capacity, counts=(1,), space=tuple(ladder)):
        return best_setting(model, 4, 4.0, Space(tuple(counts), tuple(space)), 0.0, 1e9,
                            1.0, capacity)
    assert pick(4e9 + 4).techniques == Techniques()  # 4 rows fit: nothing needed
    fits = pick(4e9 + 1, counts=(1, 2, 4))  # a row at a time: 4 x 10 ms more
    assert (fits.micro_batches, fits.techniques) == (4, Techniques())
    assert fits.step_time_s == pytest.approx(4 * (0.01 + 1))
    selective = pick(4e9 + 2)  # 4 x 1/2 byte
    assert selective.techniques == Techniques("selective")
    assert selective.step_time_s == pytest.approx(0.01 + 4 * (1 + 0.1 / 3))
    full = pick(4e9 + 1)  # 4 x 1/8 kept + 4 x 1/8 held
    assert full.techniques == Techniques("full")
    assert full.step_time_s == pytest.approx(0.01 + 4 * (1 + 1 / 3))
    with_zero = [Techniques(t.recompute, zero) for t in ladder for zero in (0, 1)]
    assert pick(3e9, space=with_zero).techniques == Techniques("none", 1)  # 1 + 1 + 2 / 4 GB
    least = pick(1e9, space=with_zero)  # nothing fits: the least memory, for the error
    assert least.techniques == Techniques("full", 1) and least.peak_memory > 1e9


def test_weights_and_optimizer_state_never_grow_with_tensor_or_pipeline(gpt_view):
    """Per device, at a fixed micro-batch count: more tensor or pipeline ways
    never hold more weights, gradients or optimizer slots."""
    hardware = Hardware("gpu", 100.0, 80.0, 300, 25, devices_per_node=8)
    candidates = search_all(gpt_view, 16, hardware, 64, 4)
    state = {(c.tensor, c.pipeline): c.state_bytes for c in candidates}
    assert len(state) >= 8  # pipelines of up to 4 stages: 2 blocks, embedding and head
    for (t, p), held in state.items():
        for (t2, p2), other in state.items():
            if t2 >= t and p2 >= p:
                assert other <= held * (1 + 1e-9), ((t, p), (t2, p2))


def test_search_chooses_recomputation_only_under_memory_pressure(gpt_view):
    """The GPT on 2 devices, data parallel, one micro-batch: with room, no
    technique; with a device too small for its activations, full
    recomputation, estimated slower by a second forward of its layers."""
    view = dataclasses.replace(gpt_view, names=None)  # no tensor meshes
    roomy = Hardware("roomy", 1.0, 16.0)
    plain = search(view, 2, roomy, 8, 1, pipeline=1, techniques=("recompute",))
    assert plain.techniques == Techniques()
    kept = sum(view.kept) * 4  # 4 rows a replica
    # Selective recomputation saves 3% of that, full 43% (test above).
    small = dataclasses.replace(roomy, memory_gb=(plain.memory_bytes - 0.3 * kept) / 2 ** 30)
    with pytest.raises(wh.PlanError, match="no plan that fits"):
        search(view, 2, small, 8, 1, pipeline=1)
    full = search(view, 2, small, 8, 1, pipeline=1, techniques=("recompute",))
    assert full.techniques.recompute == "full"
    blocks = sum(f for f, label in zip(gpt_view.flops, gpt_view.labels) if label)
    assert full.step_time_s - plain.step_time_s == pytest.approx(
        4 * blocks / roomy.flops_per_s("fp32"), rel=1e-6)


def test_mixed_precision_runs_at_the_low_precision_peak(gpt_view):
    """Allowed, mixed precision is chosen for its speed: compute at the fp16
    peak (8x the fp32 one here), activations in MIXED_ACTIVATIONS of the bytes."""
    device = Hardware("gpu", 10.0, 16.0, peaks=(("fp16", 80.0),), efficiency=1.0)
    fp32 = search(gpt_view, 1, device, 8, 1, techniques=())
    mixed = search(gpt_view, 1, device, 8, 1, techniques=("mixed_precision",))
    assert mixed.techniques == Techniques(mixed_precision=True)
    compute = 3 * sum(gpt_view.flops) * 8 / 10e12
    assert fp32.step_time_s - mixed.step_time_s == pytest.approx(compute * 7 / 8, rel=1e-6)
    weights = 4 * sum(gpt_view.param_bytes)
    assert mixed.memory_bytes - weights == pytest.approx(
        (fp32.memory_bytes - weights) * MIXED_ACTIVATIONS)
