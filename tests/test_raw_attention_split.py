"""Attention built from raw ops in ``wh.split`` (issue 64): the Megatron split
(q, k, v projections by columns, the core by heads, the output projection by
rows) of BERT-style (separate q, k, v; a ``[B, 1, T, T]`` padding mask added
to the scores, google-research BERT's way) and GPT-2-style (one fused ``qkv``
cut by ``tf.split``, by index, ``unstack`` or heads-interleaved, rotary
embeddings; a causal ``[T, T]`` mask) and Llama-style (grouped-query heads,
``tf.split`` by sizes) blocks, trained to one
device's numbers, with a traced step proving each device computed the
scores of its heads only."""
import contextlib
import math

import pytest
import tensorflow as tf

from equivalence import assert_equivalent, layer, make_data, plan_of, train
from proof import executed_nodes

import tfpar as wh
from tfpar.models.blocks import rotary

v1 = tf.compat.v1
SEQ, HIDDEN, HEADS = 6, 16, 4


def attention(h, mask, style, seed):
    """One raw-op attention of ``h`` [B, SEQ, hidden] as ``style`` writes it:
    "bert" (separate q, k, v; ``mask`` [B, 1, T, T] of 0/1 turned into an
    additive -10000 bias) or "gpt2..." (fused qkv cut as ``fused_qkv`` does:
    "gpt2" by split, "gpt2_index", "gpt2_unstack", "gpt2_megatron";
    ``mask`` [T, T] causal; "gpt2_rotary": rotary embeddings on q and k, as
    Llama's: their halves split, negated and joined) or "llama"
    (``grouped_attention``)."""
    hidden = int(h.shape[-1])
    dh = hidden // HEADS

    def heads_first(t):  # [B, T, H*D] -> [B, H, T, D]
        return tf.transpose(tf.reshape(t, [-1, SEQ, HEADS, dh]), [0, 2, 1, 3])
    if style == "llama":
        return grouped_attention(h, seed)
    if style == "bert":
        q, k, v = (heads_first(layer(h, hidden, name, seed + i))
                   for i, name in enumerate(("query", "key", "value")))
        scores = tf.multiply(tf.matmul(q, k, transpose_b=True), 1.0 / math.sqrt(dh))
        scores += (1.0 - mask) * -10000.0
    else:
        cut = style[len("gpt2_"):] if style in ("gpt2_index", "gpt2_unstack",
                                                 "gpt2_megatron") else "split"
        q, k, v = fused_qkv(layer(h, 3 * hidden, "c_attn", seed), cut)
        if style == "gpt2_rotary":
            q, k = (rotary(t, SEQ, dh) for t in (q, k))
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)
        scores = scores * mask - 1e10 * (1.0 - mask)
    probs = tf.nn.softmax(scores)
    context = tf.reshape(tf.transpose(tf.matmul(probs, v), [0, 2, 1, 3]), [-1, SEQ, hidden])
    return layer(context, hidden, "output", seed + 7)


def grouped_attention(h, seed, kv_heads=2):
    """Llama's grouped-query attention with rotary embeddings and a causal
    mask: one fused projection cut by ``tf.split`` into q (``HEADS`` heads)
    and k, v (``kv_heads`` heads, each shared by a group of query heads),
    heads as ``[B, kv_heads, group, T, D]`` (split along the key/value
    heads)."""
    hidden = int(h.shape[-1])
    dh, group = hidden // HEADS, HEADS // kv_heads

    def heads_first(t, per_group):  # [B, T, kv * per_group * D] -> [B, kv, per_group, T, D]
        return tf.transpose(tf.reshape(t, [-1, SEQ, kv_heads, per_group, dh]), [0, 2, 3, 1, 4])
    q, k, v = tf.split(layer(h, hidden + 2 * kv_heads * dh, "qkv", seed),
                       [hidden, kv_heads * dh, kv_heads * dh], axis=-1)
    q, k = rotary(heads_first(q, group), SEQ, dh), rotary(heads_first(k, 1), SEQ, dh)
    causal = tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
    scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)
    probs = tf.nn.softmax(scores * causal - 1e10 * (1.0 - causal))
    context = tf.transpose(tf.matmul(probs, heads_first(v, 1)), [0, 3, 1, 2, 4])
    return layer(tf.reshape(context, [-1, SEQ, hidden]), hidden, "output", seed + 7)


def fused_qkv(qkv, cut, seq=SEQ, heads=HEADS):
    """q, k, v ``[B, heads, seq, D]`` of a fused projection ``[B, seq, 3 x
    heads x D]`` cut as scripts write it: by ``tf.split`` ("split"), by index
    after a reshape (GPT-2 ports' ``qkv[:, :, i]``, "index"), by ``unstack``,
    or heads-interleaved (Megatron's ``[B, T, H, 3 x D]`` split, "megatron")."""
    dh = int(qkv.shape[-1]) // (3 * heads)

    def to_heads(t):  # [B, T, H, D] -> [B, H, T, D]
        return tf.transpose(t, [0, 2, 1, 3])
    if cut == "index":
        t = tf.reshape(qkv, [-1, seq, 3, heads, dh])
        return [to_heads(t[:, :, i]) for i in range(3)]
    if cut == "unstack":
        return tf.unstack(tf.transpose(tf.reshape(qkv, [-1, seq, 3, heads, dh]),
                                       [2, 0, 3, 1, 4]))
    if cut == "megatron":
        return [to_heads(t) for t in tf.split(tf.reshape(qkv, [-1, seq, heads, 3 * dh]), 3,
                                               axis=-1)]
    return [to_heads(tf.reshape(t, [-1, seq, heads, dh])) for t in tf.split(qkv, 3, axis=-1)]


def transformer(style, split=None, blocks=2, hidden=HIDDEN):
    """build(x, y): ``blocks`` attention blocks (residual) on x [B, SEQ *
    hidden], each inside ``split()`` (None: no scope), a mean-pooled 3-class
    head; SGD (Adam would blow up the rounding noise of the key bias's
    gradient, zero in exact arithmetic: softmax ignores a shift of every score)."""
    def build(x, y):
        h = tf.reshape(x, [-1, SEQ, hidden])
        if style == "bert":  # the last two positions of every other row are padding
            keep = tf.concat([tf.ones([SEQ - 2]), tf.zeros([2])], 0)
            rows = tf.cast(tf.range(tf.shape(h)[0]) % 2, tf.float32)[:, None]
            pad = rows * keep + (1.0 - rows)  # [B, T]
            mask = pad[:, None, None, :] * tf.ones([1, 1, SEQ, 1])  # [B, 1, T, T]
        else:
            mask = tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
        for i in range(blocks):
            with v1.variable_scope(f"layer_{i}"), (split() if split else contextlib.nullcontext()):
                h = h + attention(h, mask, style, seed=10 * i)
        logits = layer(tf.reduce_mean(h, 1), 3, "logits", seed=99)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


DATA = make_data(steps=3, batch=4, features=SEQ * HIDDEN)


def scores_devices(build, config, data=DATA):
    """{device: [shape of each Q K^T batch matmul it ran]} in one traced
    step of ``build`` under ``config``, fed ``data``'s first batch."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, data[0].shape[-1]])
        y = v1.placeholder(tf.int64, [None])
        _, train_op = build(x, y)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            metadata = v1.RunMetadata()
            sess.run(train_op, {x: data[0][0], y: data[1][0]}, run_metadata=metadata,
                     options=v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE))
        found = {}
        for name, devices in executed_nodes([metadata]).items():
            op = graph.get_operation_by_name(name) if _exists(graph, name) else None
            if op is None or op.type not in ("BatchMatMulV2", "BatchMatMulV3"):
                continue
            if op.outputs[0].shape[-1] == SEQ and op.outputs[0].shape[-2] == SEQ \
                    and "gradients" not in name:
                for device in devices:
                    found.setdefault(device.rsplit("device:", 1)[-1], []).append(
                        op.outputs[0].shape.as_list())
    wh.reset()
    return found


def _exists(graph, name):
    try:
        graph.get_operation_by_name(name)
        return True
    except KeyError:
        return False


@pytest.mark.parametrize("style,devices", [
    ("bert", 2), ("bert", 4), ("gpt2", 2), ("gpt2", 4), ("gpt2_index", 2), ("gpt2_unstack", 4),
    ("gpt2_megatron", 2), ("gpt2_rotary", 2), ("gpt2_sequence_parallel", 2), ("llama", 2)])
def test_raw_op_attention_in_a_split_scope_runs_each_devices_heads(style, devices):
    """``gpt2_sequence_parallel``: with ``split.sequence_parallel`` the output
    projection's partial sums are reduce-scattered along the sequence (the
    residual add runs on each device's half) and the next block's q k v
    projection gathers the halves."""
    config = {"cluster.num_devices": devices,
              "split.sequence_parallel": style.endswith("sequence_parallel")}
    style = style.replace("_sequence_parallel", "")
    reference = train(transformer(style), DATA)
    split = transformer(style, lambda: wh.split(devices))
    assert_equivalent(reference, train(split, DATA, config), rtol=1e-4, atol=1e-5)
    found = scores_devices(split, config)
    assert sorted(found) == [f"CPU:{i}" for i in range(devices)], found
    heads = 2 if style == "llama" else HEADS  # Llama's split is by key/value heads
    for shapes in found.values():  # per block, its heads' scores only
        assert [s[1] for s in shapes] == [heads // devices] * 2, found


@pytest.mark.parametrize("memory_gb,tensor,data", [(0.003, 2, 2), (0.002, 4, 1)])
def test_a_plan_that_splits_heads_trains_like_one_device(memory_gb, tensor, data):
    """``auto.split_heads`` on 4 devices too small for replicas: the search
    splits the attention cores by heads (q k v by columns, the output by
    rows), over 2 devices twice (data parallel) or over all 4, and the run
    builds what was planned (the plan pinned, as the planning pass pins
    it). Before: PlanError "which tfpar cannot build yet"."""
    device = {"name": "gpu", "tflops": 10, "memory_gb": memory_gb}
    config = {"auto.auto_parallel": True, "cluster.num_devices": 4, "cluster.hardware": [device],
              "auto.split_heads": True, "auto.planning_pass": False, "auto.num_task_graph": 1}
    build = transformer("gpt2", hidden=256)
    batches = make_data(steps=2, batch=4, features=SEQ * 256)
    plan = plan_of(build, config, shape=(None, SEQ * 256))
    assert (plan.data_parallel_degree, plan.task_graphs[0].device_count) == (data, tensor)
    layers = plan.sharding["layers"]
    for i in range(2):
        assert [layers[f"layer_{i}/{name}"] for name in ("c_attn", "Softmax", "output")] == [
            "column", "heads", "row"], layers
    run = {**config, "plan": plan.to_dict()}
    assert_equivalent(train(build, batches), train(build, batches, run), rtol=1e-4, atol=1e-5)
    found = scores_devices(build, run, batches)
    assert sorted(found) == [f"CPU:{i}" for i in range(4)], found
    assert {s[1] for shapes in found.values() for s in shapes} == {HEADS // tensor}, found
