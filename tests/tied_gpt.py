"""A tiny GPT whose output projection reuses the input embedding (GPT-2,
BERT and T5 tie them), written as users write one in TF1 style:
``tf.compat.v1.layers.dense``, matmuls, a causal mask, ``gather(wte, ids)``
in the first stage and ``matmul(h, wte, transpose_b=True)`` in the last; its
loss predicts each next token. Initial values come from numpy, so every
graph starts alike.

``gpt(scopes)`` builds it in ``scopes``: one list of parts per
``wh.replicate(1)`` scope, a part being "embedding", a block's index or
"head" (None: no scopes, plain TF). ``embedding_outside`` makes the
embeddings before any scope; ``optimizer_inside`` builds ``minimize`` in the
last scope.
"""
import contextlib

import numpy as np
import tensorflow as tf

import tfpar as wh
from equivalence import layer

__all__ = ["FIVE", "FOUR", "VOCAB", "gpt", "token_data"]

v1 = tf.compat.v1
VOCAB, SEQ, HIDDEN, HEADS, BLOCKS = 16, 6, 8, 2, 3
FOUR = [["embedding", 0], [1], [2], ["head"]]
FIVE = [["embedding"], [0], [1], [2], ["head"]]


def token_data(steps=3, batch=8, seed=3):
    """(ids [steps, batch, SEQ], unused labels [steps, batch]) for ``train``."""
    rng = np.random.RandomState(seed)
    return (rng.randint(0, VOCAB, size=(steps, batch, SEQ)).astype(np.int64),
            rng.randint(0, 3, size=(steps, batch)).astype(np.int64))


def _norm(h, name):
    with v1.variable_scope(name):
        gamma = v1.get_variable("gamma", initializer=np.ones(HIDDEN, np.float32))
        beta = v1.get_variable("beta", initializer=np.zeros(HIDDEN, np.float32))
    mean, var = tf.nn.moments(h, [-1], keepdims=True)
    return (h - mean) * tf.math.rsqrt(var + 1e-5) * gamma + beta


def _heads(h, name, seed):
    """A bias-free projection (a key bias only adds rounding noise to the
    scores, which Adam would amplify), split into heads."""
    kernel = np.random.RandomState(seed).randn(HIDDEN, HIDDEN) / np.sqrt(HIDDEN)
    t = v1.layers.dense(h, HIDDEN, use_bias=False, name=name,
                        kernel_initializer=v1.constant_initializer(kernel.astype(np.float32)))
    return tf.transpose(tf.reshape(t, [-1, SEQ, HEADS, HIDDEN // HEADS]), [0, 2, 1, 3])


def _block(h, i):
    with v1.variable_scope(f"h{i}"):
        a = _norm(h, "ln_1")
        q, k, v = (_heads(a, name, 10 * i + j) for j, name in enumerate("qkv"))
        mask = tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
        scores = tf.matmul(q, k, transpose_b=True) / np.sqrt(HIDDEN // HEADS)
        att = tf.nn.softmax(scores * mask - 1e9 * (1 - mask))
        ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, SEQ, HIDDEN])
        h = h + layer(ctx, HIDDEN, "attn_out", 10 * i + 3)
        m = layer(_norm(h, "ln_2"), 2 * HIDDEN, "fc", 10 * i + 4, tf.nn.gelu)
        return h + layer(m, HIDDEN, "proj", 10 * i + 5)


def _embeddings():
    rng = np.random.RandomState(7)
    return (v1.get_variable("wte", initializer=(0.1 * rng.randn(VOCAB, HIDDEN)).astype(np.float32)),
            v1.get_variable("wpe", initializer=(0.1 * rng.randn(SEQ, HIDDEN)).astype(np.float32)))


def gpt(scopes=None, embedding_outside=False, optimizer_inside=False,
        optimizer=lambda: v1.train.AdamOptimizer(0.01)):
    """build(ids, y) for ``equivalence.train`` (module doc); ``y`` is unused."""
    def build(ids, y):
        del y
        embedding = _embeddings() if embedding_outside else None
        train_op = None
        for parts in scopes or [["embedding", *range(BLOCKS), "head"]]:
            with wh.replicate(1) if scopes else contextlib.nullcontext():
                for part in parts:
                    if part == "embedding":
                        wte, wpe = embedding or _embeddings()
                        h = tf.gather(wte, ids) + wpe
                    elif part == "head":
                        flat = tf.reshape(_norm(h, "ln_f"), [-1, HIDDEN])
                        logits = tf.reshape(tf.matmul(flat, wte, transpose_b=True),
                                            [-1, SEQ, VOCAB])
                        loss = v1.losses.sparse_softmax_cross_entropy(ids[:, 1:], logits[:, :-1])
                        if optimizer_inside:
                            train_op = optimizer().minimize(loss)
                    else:
                        h = _block(h, part)
        return loss, train_op or optimizer().minimize(loss)
    return build
