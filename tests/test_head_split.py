"""Head-parallel attention in the sharding search (``auto.split_heads``):
attention cores found from the graph's structure, split by heads between a
column-split Q K V projection and a row-split output projection (Megatron's
attention), offered only where tfpar's split builds them (whole heads per
device); training such plans: ``test_raw_attention_split.py``."""
import dataclasses

import pytest
import tensorflow as tf

from test_cost_model import graph_view, mlp_block
from test_expert_plans import DGX_A100, gpt_loss
from test_raw_attention_split import fused_qkv


import tfpar as wh
from tfpar.hooks.capture import existing_capture
from tfpar.planner.auto import search_all
from tfpar.planner.layers import layer_graph
from tfpar.analysis.model_view import model_view
from tfpar.analysis.graph_index import GraphIndex
from tfpar.models.gpt import gpt_train_op
from tfpar.models.llama import llama_train_op

v1 = tf.compat.v1

# Per GPT block: the split into Q, K and V, their reshapes and transposes to
# heads, Q K^T, the softmax, the attention over V and the merge of heads (the
# scale, mask and their arithmetic are element-wise layers, split as shards).
CORE = {"split", "Reshape", "transpose", "Reshape_1", "transpose_1", "Reshape_2", "transpose_2",
        "MatMul", "Softmax", "MatMul_1", "transpose_3", "Reshape_3"}


def gpt_view(layers=2, hidden=256, heads=8, batch=8, seq=128, vocab=512):
    return graph_view(lambda: gpt_loss(layers, hidden, heads, vocab)(
        v1.placeholder(tf.int32, [batch, seq])))[1]


def test_attention_cores_are_found_from_the_graph():
    """Every block's core, and nothing else: not the layer norms, residual
    adds or the mask's ops (which carry no rows), nor an MLP's layers."""
    graph = layer_graph(gpt_view(layers=3))
    found = {layer.scope for layer in graph.layers if layer.kind == "attention"}
    assert found == {f"h{i}/attn/{name}" for i in range(3) for name in CORE}
    mlp = layer_graph(graph_view(lambda: mlp_block()(v1.placeholder(tf.float32, [8, 16, 32]),
                                                     None)[0])[1])
    assert not any(layer.kind == "attention" for layer in mlp.layers)


def test_a_weightless_contraction_of_the_inputs_is_no_attention_core():
    """x x^T of the model's inputs (not fed by a weighted projection) must
    keep whole rows."""
    def loss():
        x = v1.placeholder(tf.float32, [8, 16, 32])
        scores = tf.nn.softmax(tf.matmul(x, x, transpose_b=True))
        return tf.reduce_mean(v1.layers.dense(tf.matmul(scores, x), 4, name="out"))
    graph = layer_graph(graph_view(loss)[1])
    assert not any(layer.kind == "attention" for layer in graph.layers)


def tensor_8(view, split_heads, memory_gb=0.15):
    """The tensor-8 candidate on devices too small for the model's ~0.4 GB
    of weights and optimizer state, or for its attention's with only the MLPs
    split (with 0.3 GB, replicas of the attention would beat splitting it:
    the layer norms before a column split run whole on every device)."""
    small = dataclasses.replace(DGX_A100, memory_gb=memory_gb)
    candidates = search_all(view, 8, small, 8, 1, pipeline=1, split_heads=split_heads)
    return next(c for c in candidates if c.tensor == 8)


def test_heads_split_as_megatron_splits_them():
    """Tensor 8 on a GPT of 16 heads: with ``split_heads`` every core layer
    runs on its group's heads after c_attn by columns, so it computes an
    eighth of the core and gathers no Q K V; without it the core runs whole
    (or by rows) behind an all-gather of Q K V. The merged heads go on to
    c_proj by rows (Megatron's) or, as the cost model finds here, gathered
    to the batch's rows for a replicated c_proj: its weights' all-reduce
    costs less than the row split's all-reduce and the gather of its
    gradient back (the residual stream stays split by batch rows)."""
    view = dataclasses.replace(gpt_view(layers=2, hidden=1024, heads=16, seq=512),
                               compute_dtype="fp16")
    split, whole = tensor_8(view, True), tensor_8(view, False)
    layers = dict(split.split_scopes)
    for i in range(2):
        assert {layers[f"h{i}/attn/{name}"] for name in CORE - {"Reshape_3"}} == {"heads"}
        assert layers[f"h{i}/attn/c_attn"] == "column"
        assert (layers.get(f"h{i}/attn/Reshape_3", "dp"), layers.get(f"h{i}/attn/c_proj", "dp")
                ) in (("heads", "row"), ("dp", "dp"))
        assert dict(whole.split_scopes).get(f"h{i}/attn/MatMul", "dp") in ("whole", "dp")
    assert split.step_time_s < whole.step_time_s
    assert split.comm_bytes < whole.comm_bytes


@pytest.mark.parametrize("heads", [12, 16])
def test_heads_the_tensor_group_does_not_divide_are_not_offered(heads):
    """tfpar splits a core of raw ops into whole heads per device (test_raw_attention_split
    trains such plans): 12 heads over 8 devices cannot be, so the search never
    plans it (before, it planned it and the run refused it); 16 heads are
    split as above."""
    view = dataclasses.replace(gpt_view(layers=2, hidden=960, heads=heads, seq=512),
                               compute_dtype="fp16")
    assert dict(view.core_heads) == {"h0/attn": heads, "h1/attn": heads}
    layers = dict(tensor_8(view, True).split_scopes)
    assert ("heads" in layers.values()) == (heads == 16), layers


def test_a_llama_core_with_grouped_heads_and_rotary_embeddings_splits_by_heads():
    """tfpar/models/llama.py's block (plan_scale's Llama 3 rows): 16 query
    heads sharing 8 key/value heads, rotary embeddings (their half swaps are
    concats inside the core), a SwiGLU MLP. Tensor 8: q, k, v by columns,
    the core by heads, o by rows; gate and up by columns, down by rows
    (with 0.1 GB: with 0.15 GB replicas of the attention cost less than its
    tensor-parallel all-reduces)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        llama_train_op(2, 1024, 2048, 16, 8, 256, 512, batch=8)
        _, view = model_view(GraphIndex(graph), existing_capture(graph))
    wh.reset()
    core = {layer.scope for layer in layer_graph(view).layers if layer.kind == "attention"}
    assert {"layer_0/attention/concat", "layer_0/attention/Softmax",
            "layer_1/attention/MatMul_1"} <= core
    layers = dict(tensor_8(dataclasses.replace(view, compute_dtype="fp16"), True,
                           memory_gb=0.1).split_scopes)
    for i in range(2):
        assert {layers[scope] for scope in core if scope.startswith(f"layer_{i}/")} == {"heads"}
        assert [layers[f"layer_{i}/attention/{name}"] for name in "qkvo"] == ["column"] * 3 + [
            "row"]
        assert [layers[f"layer_{i}/mlp/{name}"] for name in ("gate", "up", "down")] == [
            "column", "column", "row"]


def _fused_attention(style):
    """loss() of two attention blocks whose one ``qkv`` projection (3 x hidden)
    is cut into q, k and v as scripts write it: by ``split`` of its last axis,
    by index after a reshape (GPT-2's ``qkv[:, :, i]``), by ``unstack``, or
    Megatron's heads-interleaved ``[B, S, heads, 3 x dh]`` split."""
    seq, hidden, heads = 16, 64, 4
    dh = hidden // heads

    def loss():
        h = v1.placeholder(tf.float32, [8, seq, hidden])
        for i in range(2):
            with v1.variable_scope(f"block{i}"):
                qkv = v1.layers.dense(h, 3 * hidden, name="qkv")
                q, k, v = fused_qkv(qkv, style, seq, heads)
                att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / dh ** 0.5)
                ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, seq, hidden])
                h = h + v1.layers.dense(ctx, hidden, name="out")
        return tf.reduce_mean(h ** 2)
    return loss


@pytest.mark.parametrize("style", ["split", "index", "unstack", "megatron"])
def test_a_fused_qkv_projection_feeds_an_attention_core_however_it_is_cut(style):
    """Before, q, k and v taken from a fused projection by index or unstack
    (GPT-2's and many ports' way) left the core unfound, so its heads were
    never split and the plan fell back to data and pipeline parallelism."""
    graph = layer_graph(graph_view(_fused_attention(style))[1])
    cores = {layer.scope.split("/")[0] for layer in graph.layers if layer.kind == "attention"}
    assert cores == {"block0", "block1"}
    kinds = {layer.scope: layer.kind for layer in graph.layers}
    assert (kinds["block0/qkv"], kinds["block0/out"]) == ("matmul", "matmul")


def _gpt_model_view(fused_qkv):
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        gpt_train_op(2, 1024, 256, 512, 16, batch=8, fused_qkv=fused_qkv, mask="shared")
        _, view = model_view(GraphIndex(graph), existing_capture(graph))
    wh.reset()
    return dataclasses.replace(view, compute_dtype="fp16")


def test_a_fused_qkv_gpt_is_planned_as_its_separate_qkv_twin():
    """tfpar/models/gpt.py's GPT (2 blocks, hidden 1024, 16 heads, a causal
    mask every block reads) with one fused q/k/v projection, as GPT-2 and
    Megatron-LM write it, and with three: on 8 small A100s the tensor-8
    plans split each projection by columns and the cores by heads, and the
    fused one is estimated no slower (one projection's kernels where three
    ran; the issue's GPT-3 with a fused projection was planned without a
    tensor split, 38% slower than with three)."""
    plans = {fused: tensor_8(_gpt_model_view(fused), True, memory_gb=0.1) for fused in (True, False)}
    for fused, plan in plans.items():
        layers = dict(plan.split_scopes)
        projections = ["qkv"] if fused else ["q", "k", "v"]
        assert [layers[f"layer_0/attention/{name}"] for name in projections + ["out"]] == [
            "column"] * len(projections) + ["row"]
        assert layers["layer_0/attention/Softmax"] == "heads"
    assert plans[True].step_time_s <= plans[False].step_time_s
