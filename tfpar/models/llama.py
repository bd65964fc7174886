"""A Llama-style training graph (Touvron et al. 2023; Dubey et al., "The
Llama 3 Herd of Models", 2024, Table 3): pre-norm blocks with RMSNorm,
grouped-query attention (``kv_heads`` key/value heads shared by groups of
query heads) with rotary position embeddings, a SwiGLU MLP, no biases, an
untied output projection (unless asked); LM cross-entropy, Adam."""
import math

import tensorflow as tf

from tfpar.models.blocks import lm_logits, rms_norm, rotary

__all__ = ["default_ffn", "llama_train_op"]

v1 = tf.compat.v1


def default_ffn(hidden):
    """Llama's MLP width for ``hidden``: 2/3 of 4 x hidden, rounded up to a
    multiple of 256 (11008 for 4096)."""
    return -(-8 * hidden // 3 // 256) * 256


def llama_train_op(layers, hidden, ffn, heads, kv_heads, seq, vocab, batch=None, *,
                   fused_qkv=False, tied_embeddings=False):
    """The train op of a Llama of ``layers`` blocks on token ids (``batch``:
    the inputs' static batch, None: unknown; ``fused_qkv``: one q/k/v
    projection; ``tied_embeddings``: the output projection is the token
    embedding)."""
    ids = v1.placeholder(tf.int32, [batch, seq], name="ids")
    labels = v1.placeholder(tf.int32, [batch, seq], name="labels")
    with v1.variable_scope("embedding"):
        tokens = v1.get_variable("tokens", [vocab, hidden])
        h = tf.gather(tokens, ids)
    for i in range(layers):
        with v1.variable_scope(f"layer_{i}"):
            a = rms_norm(h, "attention_norm")
            with v1.variable_scope("attention"):
                h = h + _attention(a, seq, heads, kv_heads, fused_qkv)
            m = rms_norm(h, "mlp_norm")
            with v1.variable_scope("mlp"):
                h = h + _dense(tf.nn.silu(_dense(m, ffn, "gate")) * _dense(m, ffn, "up"),
                               hidden, "down")
    logits = lm_logits(rms_norm(h, "final_norm"), "output", vocab,
                       tokens if tied_embeddings else None)
    loss = v1.losses.sparse_softmax_cross_entropy(tf.reshape(labels, [-1]), logits)
    return v1.train.AdamOptimizer(1e-4).minimize(loss)


def _dense(x, units, name):
    return v1.layers.dense(x, units, use_bias=False, name=name)


def _attention(a, seq, heads, kv_heads, fused_qkv):
    """Grouped-query attention of ``a`` [B, seq, hidden], projections ``q``,
    ``k``, ``v`` (or one ``qkv``) and ``o``; k and v broadcast over groups."""
    hidden = int(a.shape[-1])
    dh, group = hidden // heads, heads // kv_heads

    def heads_first(t, per_group):  # [B, S, kv * per_group * dh] -> [B, kv, per_group, S, dh]
        return tf.transpose(tf.reshape(t, [-1, seq, kv_heads, per_group, dh]), [0, 2, 3, 1, 4])
    if fused_qkv:
        q, k, v = tf.split(_dense(a, hidden + 2 * kv_heads * dh, "qkv"),
                           [hidden, kv_heads * dh, kv_heads * dh], axis=-1)
        q, k = (rotary(heads_first(t, n), seq, dh) for t, n in ((q, group), (k, 1)))
        v = heads_first(v, 1)
    else:
        q = rotary(heads_first(_dense(a, hidden, "q"), group), seq, dh)
        k = rotary(heads_first(_dense(a, kv_heads * dh, "k"), 1), seq, dh)
        v = heads_first(_dense(a, kv_heads * dh, "v"), 1)
    scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)
    ctx = tf.matmul(tf.nn.softmax(scores), v)
    ctx = tf.reshape(tf.transpose(ctx, [0, 3, 1, 2, 4]), [-1, seq, hidden])
    return _dense(ctx, hidden, "o")
