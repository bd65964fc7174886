"""A Llama-style training graph in the TF1 API (Touvron et al. 2023; Dubey et
al., "The Llama 3 Herd of Models", 2024, Table 3): pre-norm blocks with
RMSNorm, grouped-query attention (``kv_heads`` key/value heads shared by
groups of query heads) with rotary position embeddings, a SwiGLU MLP, no
biases, an untied output projection; LM cross-entropy, Adam."""
import math

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
ROPE_BASE = 500000.0  # Llama 3's rotary base


def rms_norm(x, name, eps=1e-5):
    with v1.variable_scope(name):
        scale = v1.get_variable("scale", [x.shape[-1]], initializer=v1.ones_initializer())
        return x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), -1, keepdims=True) + eps) * scale


def rotary(x, seq, dim):
    """``x`` [..., seq, dim] rotated by position (pairs of its halves)."""
    inverse = ROPE_BASE ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    angles = np.outer(np.arange(seq), inverse)
    cos, sin = (tf.constant(np.concatenate([f(angles)] * 2, -1), tf.float32)
                for f in (np.cos, np.sin))
    first, second = tf.split(x, 2, axis=-1)
    return x * cos + tf.concat([-second, first], -1) * sin


def llama_train_op(layers, hidden, ffn, heads, kv_heads, seq, vocab, batch=None):
    """The train op of a Llama of ``layers`` blocks on token ids (``batch``:
    the inputs' static batch, None: unknown)."""
    ids = v1.placeholder(tf.int32, [batch, seq], name="ids")
    labels = v1.placeholder(tf.int32, [batch, seq], name="labels")
    dh, group = hidden // heads, heads // kv_heads

    def heads_first(t, per_group):  # [B, S, kv * per_group * dh] -> [B, kv, per_group, S, dh]
        return tf.transpose(tf.reshape(t, [-1, seq, kv_heads, per_group, dh]), [0, 2, 3, 1, 4])

    def dense(x, units, name):
        return v1.layers.dense(x, units, use_bias=False, name=name)
    with v1.variable_scope("embedding"):
        h = tf.gather(v1.get_variable("tokens", [vocab, hidden]), ids)
    for i in range(layers):
        with v1.variable_scope(f"layer_{i}"):
            a = rms_norm(h, "attention_norm")
            with v1.variable_scope("attention"):
                q = rotary(heads_first(dense(a, hidden, "q"), group), seq, dh)
                k = rotary(heads_first(dense(a, kv_heads * dh, "k"), 1), seq, dh)
                v = heads_first(dense(a, kv_heads * dh, "v"), 1)
                scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)  # k, v broadcast
                ctx = tf.matmul(tf.nn.softmax(scores), v)
                ctx = tf.reshape(tf.transpose(ctx, [0, 3, 1, 2, 4]), [-1, seq, hidden])
                h = h + dense(ctx, hidden, "o")
            m = rms_norm(h, "mlp_norm")
            with v1.variable_scope("mlp"):
                h = h + dense(tf.nn.silu(dense(m, ffn, "gate")) * dense(m, ffn, "up"), hidden,
                              "down")
    h = rms_norm(h, "final_norm")
    with v1.variable_scope("output"):
        logits = tf.matmul(tf.reshape(h, [-1, hidden]), v1.get_variable("kernel", [hidden, vocab]))
    loss = v1.losses.sparse_softmax_cross_entropy(tf.reshape(labels, [-1]), logits)
    return v1.train.AdamOptimizer(1e-4).minimize(loss)
