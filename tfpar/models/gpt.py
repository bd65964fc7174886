"""A GPT-style training graph: token and position embeddings, pre-LN
transformer blocks (``ln1``, ``attention``, ``ln2``, gelu MLP ``fc1`` /
``fc2``), ``ln_final``, the ``lm_head`` projection (or the token embedding
again, tied), LM cross-entropy, Adam."""
import tensorflow as tf

from tfpar.models.blocks import causal_mask, layer_norm, lm_logits, mha

__all__ = ["gpt_train_op"]

v1 = tf.compat.v1


def gpt_train_op(layers, hidden, seq, vocab, heads, batch=None, *, ffn=None, fused_qkv=False,
                 tied_embeddings=False, mask=None):
    """The train op of a GPT of ``layers`` blocks on token ids (``batch``: the
    inputs' static batch, None: unknown; ``ffn``: the MLP's width, None: 4 x
    ``hidden``; ``fused_qkv``: one q/k/v projection; ``tied_embeddings``: the
    output projection is the token embedding; ``mask``: a causal mask built
    once and read by every block, "shared", or by each block, "per_layer";
    None: none)."""
    ids = v1.placeholder(tf.int32, [batch, seq], name="ids")
    labels = v1.placeholder(tf.int32, [batch, seq], name="labels")
    with v1.variable_scope("embedding"):
        tokens = v1.get_variable("tokens", [vocab, hidden])
        h = tf.gather(tokens, ids) + v1.get_variable("positions", [seq, hidden])
    shared = causal_mask(seq) if mask == "shared" else None
    for i in range(layers):
        with v1.variable_scope(f"layer_{i}"):
            a = layer_norm(h, "ln1")
            with v1.variable_scope("attention"):
                out = mha(a, seq, heads, fused_qkv,
                          causal_mask(seq) if mask == "per_layer" else shared)
            h = h + out
            f = v1.layers.dense(layer_norm(h, "ln2"), ffn or 4 * hidden, tf.nn.gelu, name="fc1")
            h = h + v1.layers.dense(f, hidden, name="fc2")
    logits = lm_logits(layer_norm(h, "ln_final"), "lm_head", vocab,
                       tokens if tied_embeddings else None)
    loss = v1.losses.sparse_softmax_cross_entropy(tf.reshape(labels, [-1]), logits)
    return v1.train.AdamOptimizer(1e-4).minimize(loss)

