"""A BERT-style pre-training graph (Devlin et al. 2019): token, position and
segment embeddings with a layer norm, post-LN encoder blocks (attention,
``ln1``, gelu MLP ``fc1`` / ``fc2``, ``ln2``), the masked-LM head (a gelu
``transform`` with a layer norm, then the vocabulary projection with a bias,
at ``predictions`` masked positions a sequence) and the next-sentence head
(``pooler`` on the first token, two classes); the sum of both losses, Adam."""
import tensorflow as tf

from tfpar.models.blocks import layer_norm, lm_logits, mha

__all__ = ["bert_train_op", "default_predictions"]

v1 = tf.compat.v1
SEGMENTS = 2


def default_predictions(seq):
    """Masked positions a sequence: BERT's 15% of its tokens (at least one)."""
    return max(1, round(0.15 * seq))


def bert_train_op(layers, hidden, seq, vocab, heads, batch=None, *, ffn=None, fused_qkv=False,
                  tied_embeddings=False, predictions=None):
    """The train op of a BERT of ``layers`` blocks (``batch``: the inputs'
    static batch, None: unknown; ``ffn``: the MLP's width, None: 4 x
    ``hidden``; ``fused_qkv``: one q/k/v projection; ``tied_embeddings``: the
    masked-LM projection is the token embedding, as in BERT; ``predictions``:
    masked positions a sequence, None: ``default_predictions``)."""
    predictions = predictions or default_predictions(seq)
    ids = v1.placeholder(tf.int32, [batch, seq], name="ids")
    segments = v1.placeholder(tf.int32, [batch, seq], name="segments")
    masked = v1.placeholder(tf.int32, [batch, predictions], name="masked_positions")
    labels = v1.placeholder(tf.int32, [batch, predictions], name="labels")
    next_sentence = v1.placeholder(tf.int32, [batch], name="next_sentence")
    with v1.variable_scope("embedding"):
        tokens = v1.get_variable("tokens", [vocab, hidden])
        h = (tf.gather(tokens, ids) + v1.get_variable("positions", [seq, hidden])
             + tf.gather(v1.get_variable("segments", [SEGMENTS, hidden]), segments))
        h = layer_norm(h, "ln")
    for i in range(layers):
        with v1.variable_scope(f"layer_{i}"):
            with v1.variable_scope("attention"):
                h = layer_norm(h + mha(h, seq, heads, fused_qkv), "ln1")
            f = v1.layers.dense(h, ffn or 4 * hidden, tf.nn.gelu, name="fc1")
            h = layer_norm(h + v1.layers.dense(f, hidden, name="fc2"), "ln2")
    with v1.variable_scope("masked_lm"):
        picked = tf.gather(h, masked, batch_dims=1)  # [B, predictions, hidden]
        picked = layer_norm(v1.layers.dense(picked, hidden, tf.nn.gelu, name="transform"), "ln")
        logits = lm_logits(picked, "decoder", vocab, tokens if tied_embeddings else None)
        logits += v1.get_variable("bias", [vocab], initializer=v1.zeros_initializer())
    pooled = v1.layers.dense(h[:, 0], hidden, tf.nn.tanh, name="pooler")
    loss = (v1.losses.sparse_softmax_cross_entropy(tf.reshape(labels, [-1]), logits)
            + v1.losses.sparse_softmax_cross_entropy(
                next_sentence, v1.layers.dense(pooled, 2, name="next_sentence")))
    return v1.train.AdamOptimizer(1e-4).minimize(loss)
