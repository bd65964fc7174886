"""Pieces the model builders share: normalisations, rotary embeddings,
multi-head attention and the output projection over the vocabulary."""
import math

import numpy as np
import tensorflow as tf

__all__ = ["ROPE_BASE", "causal_mask", "layer_norm", "lm_logits", "mha", "rms_norm", "rotary"]

v1 = tf.compat.v1
ROPE_BASE = 500000.0  # Llama 3's rotary base


def layer_norm(x, name):
    """Layer norm over the last axis, its ops and variables in scope ``name``."""
    with v1.variable_scope(name):
        d = int(x.shape[-1])
        gamma = v1.get_variable("gamma", [d], initializer=v1.ones_initializer())
        beta = v1.get_variable("beta", [d], initializer=v1.zeros_initializer())
        mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
        return (x - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta


def rms_norm(x, name, eps=1e-5):
    """RMSNorm over the last axis (a scale, no shift), in scope ``name``."""
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


def causal_mask(seq):
    """[seq, seq]: 0 where a position may attend (itself and earlier ones),
    -1e9 elsewhere, added to the attention scores."""
    return (1.0 - tf.linalg.band_part(tf.ones([seq, seq]), -1, 0)) * -1e9


def mha(a, seq, heads, fused_qkv, mask=None):
    """Multi-head self-attention of ``a`` [B, seq, hidden] with v1 dense layers
    (biases) ``q``, ``k``, ``v`` (or one ``qkv`` when ``fused_qkv``) and ``out``;
    ``mask`` [seq, seq] added to the scores (None: none)."""
    hidden = int(a.shape[-1])
    dh = hidden // heads

    def dense(x, units, name):
        return v1.layers.dense(x, units, name=name)

    def heads_first(t):  # [B, S, H] -> [B, heads, S, dh]
        return tf.transpose(tf.reshape(t, [-1, seq, heads, dh]), [0, 2, 1, 3])
    if fused_qkv:
        q, k, v = map(heads_first, tf.split(dense(a, 3 * hidden, "qkv"), 3, axis=-1))
    else:
        q, k, v = (heads_first(dense(a, hidden, name)) for name in "qkv")
    scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)
    att = tf.nn.softmax(scores if mask is None else scores + mask)
    ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, seq, hidden])
    return dense(ctx, hidden, "out")


def lm_logits(h, scope, vocab, tied=None):
    """Logits over the vocabulary of ``h`` [..., hidden] in ``scope``: by a
    ``kernel`` [hidden, vocab] of its own, or by the ``tied`` [vocab, hidden]
    embedding."""
    hidden = int(h.shape[-1])
    with v1.variable_scope(scope):
        flat = tf.reshape(h, [-1, hidden])
        if tied is not None:
            return tf.matmul(flat, tied, transpose_b=True)
        return tf.matmul(flat, v1.get_variable("kernel", [hidden, vocab]))
