"""TF2 transformers whose attention is written in raw ops (issue 64), for
``real_steps_script.py``: Keras ``Dense`` projections, the core as
google-research BERT and GPT-2 write it (reshape and transpose to heads,
``tf.matmul`` of q and k, a scale, a mask, softmax, ``tf.matmul`` with v,
back to ``[B, T, hidden]``), the attention block built and called in
``wh.split(n)`` under tfpar. Each scenario trains once and returns (every
logged value, every variable in a fixed order: the model's weights whole, as
``get_weights`` gives them, SGD's iterations (its momentum slots stay zero),
the metrics' totals)."""
import contextlib
import math

import numpy as np
import tensorflow as tf

import tfpar as wh
from tfpar.runtime.context import active
from real_steps_models import _padded_tokens, _values

keras = tf.keras
SEQ, WIDTH, HEADS, VOCAB = 6, 16, 4, 12


class RawAttention(keras.layers.Layer):
    """Self-attention from raw ops: separate q, k, v projections and a BERT
    padding mask (``fused`` False), or one ``qkv`` projection cut by
    ``tf.split`` and GPT-2's causal mask."""

    def __init__(self, fused: bool):
        super().__init__()
        self.fused = fused
        self.projections = [keras.layers.Dense(WIDTH * (3 if fused else 1))
                            for _ in range(1 if fused else 3)]
        self.output_dense = keras.layers.Dense(WIDTH)

    def call(self, x, padding):
        dh = WIDTH // HEADS

        def heads_first(t):
            return tf.transpose(tf.reshape(t, [-1, SEQ, HEADS, dh]), [0, 2, 1, 3])
        if self.fused:
            q, k, v = map(heads_first, tf.split(self.projections[0](x), 3, axis=-1))
        else:
            q, k, v = (heads_first(p(x)) for p in self.projections)
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)
        if self.fused:
            causal = tf.linalg.band_part(tf.ones([SEQ, SEQ]), -1, 0)
            scores = scores * causal - 1e10 * (1.0 - causal)
        else:
            scores += (1.0 - padding[:, None, None, :]) * -10000.0
        context = tf.matmul(tf.nn.softmax(scores), v)
        return self.output_dense(tf.reshape(tf.transpose(context, [0, 2, 1, 3]),
                                            [-1, SEQ, WIDTH]))


def _classifier(fused: bool, split: int) -> keras.Model:
    """Embedding, two residual raw-op attention blocks (made and called in
    one ``wh.split(split)`` when ``split``; the rest replicated), mean
    pooling, a 3-class head."""
    scope = (lambda: wh.split(split)) if split else contextlib.nullcontext
    ids = keras.Input((SEQ,), dtype="int64")
    padding = tf.cast(tf.not_equal(ids, 0), tf.float32)
    h = keras.layers.Embedding(VOCAB, WIDTH)(ids)
    with scope():
        for _ in range(2):
            h = h + RawAttention(fused)(h, padding)
    return keras.Model(ids, keras.layers.Dense(3)(keras.layers.GlobalAveragePooling1D()(h)))


def _data():
    tokens = _padded_tokens(16, SEQ, VOCAB, 8)
    return tokens, np.random.RandomState(9).randint(0, 3, 16)


def bert_fit(split: int):
    """``fit`` of the BERT-style classifier (SGD: Adam would blow up the
    rounding noise of the key bias's gradient, zero in exact arithmetic)."""
    model = _classifier(False, split if active() is not None else 0)
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(True),
                  metrics=["accuracy"])
    tokens, labels = _data()
    history = model.fit(tokens, labels, batch_size=8, epochs=2, shuffle=False, verbose=0).history
    return (history["loss"] + history["accuracy"],
            model.get_weights() + [model.optimizer.iterations.numpy()] + _values(*model.metrics))


def gpt2_loop(split: int):
    """A ``tf.function`` GradientTape loop of the GPT-2-style classifier."""
    model = _classifier(True, split if active() is not None else 0)
    optimizer = keras.optimizers.SGD(0.1)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                y, model(x), from_logits=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    tokens, labels = _data()
    logged = [step(tokens[i:i + 8], labels[i:i + 8]) for i in (0, 8, 0)]
    return np.asarray(logged), model.get_weights() + [optimizer.iterations.numpy()]


SCENARIOS = {"raw_attention_bert_fit_split2": (lambda: bert_fit(2), {}),
             "raw_attention_gpt2_loop_split4": (lambda: gpt2_loop(4), {})}
