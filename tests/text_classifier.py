"""Keras' "Text classification with Transformer" example, as its users write
it (token and position embeddings, a transformer block of
``MultiHeadAttention``, ``LayerNormalization`` and a dense feed-forward,
pooling and a dense head), small; dropout rate 0 so that runs compare
exactly. ``scopes`` puts the embedding and the rest in two pipeline stages."""
import contextlib

import numpy as np
import tensorflow as tf
from tensorflow.keras import layers

import tfpar as wh

VOCAB, MAXLEN, DIM, HEADS, FF, CLASSES = 40, 12, 8, 2, 16, 2


class TokenAndPositionEmbedding(layers.Layer):
    def __init__(self, maxlen, vocab_size, embed_dim):
        super().__init__()
        self.token_emb = layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
        self.pos_emb = layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

    def call(self, x):
        maxlen = tf.shape(x)[-1]
        positions = tf.range(start=0, limit=maxlen, delta=1)
        return self.token_emb(x) + self.pos_emb(positions)


class TransformerBlock(layers.Layer):
    def __init__(self, embed_dim, num_heads, ff_dim, rate=0.0):
        super().__init__()
        self.att = layers.MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim)
        self.ffn = tf.keras.Sequential([layers.Dense(ff_dim, activation="relu"),
                                        layers.Dense(embed_dim)])
        self.layernorm1 = layers.LayerNormalization(epsilon=1e-6)
        self.layernorm2 = layers.LayerNormalization(epsilon=1e-6)
        self.dropout1 = layers.Dropout(rate)
        self.dropout2 = layers.Dropout(rate)

    def call(self, inputs, training=None):
        attn_output = self.att(inputs, inputs)
        attn_output = self.dropout1(attn_output, training=training)
        out1 = self.layernorm1(inputs + attn_output)
        ffn_output = self.ffn(out1)
        ffn_output = self.dropout2(ffn_output, training=training)
        return self.layernorm2(out1 + ffn_output)


def text_classifier(stages: bool = False):
    """The example's model; ``stages``: its embedding in one ``wh.replicate(1)``
    scope and the rest in another (two pipeline stages)."""
    def stage():
        return wh.replicate(1) if stages else contextlib.nullcontext()
    tf.keras.utils.set_random_seed(7)
    inputs = layers.Input(shape=(MAXLEN,))
    with stage():
        x = TokenAndPositionEmbedding(MAXLEN, VOCAB, DIM)(inputs)
    with stage():
        x = TransformerBlock(DIM, HEADS, FF)(x)
        x = layers.GlobalAveragePooling1D()(x)
        x = layers.Dense(FF, activation="relu")(x)
        outputs = layers.Dense(CLASSES, activation="softmax")(x)
    return tf.keras.Model(inputs=inputs, outputs=outputs)


def reviews(rows: int = 32):
    """Token ids and labels."""
    rng = np.random.RandomState(0)
    return rng.randint(0, VOCAB, (rows, MAXLEN)), rng.randint(0, CLASSES, rows)
