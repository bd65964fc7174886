"""A text-classification transformer as Keras' example "Text classification
with Transformer" builds it: token and position embeddings (two ``Embedding``
layers, positions looked up with ``tf.range`` of the sequence length), one
transformer block (``MultiHeadAttention``, residual, ``LayerNormalization``, a
feed-forward ``Sequential`` of two ``Dense`` layers, residual,
``LayerNormalization``; dropout after the attention and the feed-forward),
then average pooling and a small classifier. Tiny sizes; dropout rate 0 so
every run computes the same numbers. Used by graph-mode tests and by the TF2
script ``tf2_attention_script.py``.
"""
import contextlib

import numpy as np
import tensorflow as tf

SEQUENCE, VOCABULARY, WIDTH, FEED_FORWARD = 6, 20, 8, 16
SAMPLES, BATCH = 24, 8


class TransformerBlock(tf.keras.layers.Layer):
    def __init__(self, width, heads, feed_forward, dropout=0.0):
        super().__init__()
        self.attention = tf.keras.layers.MultiHeadAttention(num_heads=heads, key_dim=width)
        self.feed_forward = tf.keras.Sequential([
            tf.keras.layers.Dense(feed_forward, activation="relu"),
            tf.keras.layers.Dense(width)])
        self.norm_attended = tf.keras.layers.LayerNormalization(epsilon=1e-6)
        self.norm_output = tf.keras.layers.LayerNormalization(epsilon=1e-6)
        self.drop_attended = tf.keras.layers.Dropout(dropout)
        self.drop_output = tf.keras.layers.Dropout(dropout)

    def call(self, inputs, training=None):
        attended = self.drop_attended(self.attention(inputs, inputs), training=training)
        attended = self.norm_attended(inputs + attended)
        transformed = self.drop_output(self.feed_forward(attended), training=training)
        return self.norm_output(attended + transformed)


class TokenAndPositionEmbedding(tf.keras.layers.Layer):
    def __init__(self, sequence, vocabulary, width):
        super().__init__()
        self.tokens = tf.keras.layers.Embedding(input_dim=vocabulary, output_dim=width)
        self.positions = tf.keras.layers.Embedding(input_dim=sequence, output_dim=width)

    def call(self, ids):
        positions = tf.range(start=0, limit=tf.shape(ids)[-1], delta=1)
        return self.tokens(ids) + self.positions(positions)


def text_classifier(heads, block_scope=contextlib.nullcontext, other_scope=contextlib.nullcontext,
                    head_scope=None):
    """The compiled model; its transformer block is made and called in
    ``block_scope()``, the layers before and after it in ``other_scope()``s
    (after it: in ``head_scope()`` if given)."""
    ids = tf.keras.layers.Input(shape=(SEQUENCE,))
    with other_scope():
        x = TokenAndPositionEmbedding(SEQUENCE, VOCABULARY, WIDTH)(ids)
    with block_scope():
        x = TransformerBlock(WIDTH, heads, FEED_FORWARD)(x)
    with (head_scope or other_scope)():
        x = tf.keras.layers.GlobalAveragePooling1D()(x)
        x = tf.keras.layers.Dropout(0.0)(x)
        x = tf.keras.layers.Dense(20, activation="relu")(x)
        x = tf.keras.layers.Dropout(0.0)(x)
        probabilities = tf.keras.layers.Dense(2, activation="softmax")(x)
    model = tf.keras.Model(inputs=ids, outputs=probabilities)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    return model


def reviews():
    """Token ids and binary labels."""
    rng = np.random.RandomState(0)
    return rng.randint(0, VOCABULARY, (SAMPLES, SEQUENCE)), rng.randint(0, 2, SAMPLES)


def fit(model):
    """One epoch of ``model.fit`` in batches of BATCH, unshuffled: the loss
    keras reports after each step."""
    ids, labels = reviews()
    losses = []
    record = tf.keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda step, logs: losses.append(float(logs["loss"])))
    model.fit(ids, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0,
              callbacks=[record])
    return losses


def block(model):
    return next(layer for layer in model.layers if isinstance(layer, TransformerBlock))
