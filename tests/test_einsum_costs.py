"""An einsum costs what the equivalent matrix product costs (issue 45: the
model view counted an einsum as its output elements, so Keras' EinsumDense
and MultiHeadAttention were costed about 1000x too cheap)."""
import pytest
import tensorflow as tf

from test_cost_model import graph_view

from tfpar.cluster.hardware import CATALOG
from tfpar.ir.contractions import einsum_depth
from tfpar.planner.auto import search

v1 = tf.compat.v1
SEQ, HIDDEN, UNITS, HEADS, HEAD = 8, 32, 48, 4, 8  # HIDDEN = HEADS x HEAD


@pytest.mark.parametrize("equation, shapes, depth", [
    ("bsh,hk->bsk", [[None, 8, 32], [32, 48]], 32),
    ("abc,cde->abde", [[None, 8, 32], [32, 4, 16]], 32),           # EinsumDense's projection
    ("aecd,abcd->acbe", [[None, 8, 4, 16], [None, 8, 4, 16]], 16),  # attention scores
    ("acbe,aecd->abcd", [[None, 4, 8, 8], [None, 8, 4, 16]], 8),    # scores x values
    ("...h,hk->...k", [[None, 3, 8, 32], [32, 48]], 32),
    ("ij,jk->ik", [[None, None], [None, 5]], None),                 # j unknown everywhere
    ("ij,jk->ik", [[None, None], [7, 5]], 7),                       # j known in one operand
])
def test_einsum_depth_is_the_product_of_its_summed_letters(equation, shapes, depth):
    assert einsum_depth(equation, shapes) == depth


def _flops(make_loss, op_types):
    order, view = graph_view(make_loss)
    return sum(view.flops[i] for i, op in enumerate(order) if op.type in op_types)


def _rows():
    """A batch of sequences, scaled by a trained scalar (a step to train)."""
    scale = v1.get_variable("scale", [], initializer=v1.ones_initializer())
    return v1.placeholder(tf.float32, [None, SEQ, HIDDEN]) * scale


def test_an_einsum_projection_costs_the_matmul_it_equals():
    """[B, S, H] x [H, K]: 2 S H K per row as an einsum and as a matmul."""
    def einsum():
        w = v1.get_variable("w", [HIDDEN, UNITS])
        return tf.reduce_sum(tf.einsum("bsh,hk->bsk", _rows(), w))

    def matmul():
        w = v1.get_variable("w", [HIDDEN, UNITS])
        return tf.reduce_sum(tf.matmul(tf.reshape(_rows(), [-1, HIDDEN]), w))
    expected = 2 * SEQ * HIDDEN * UNITS
    assert _flops(einsum, {"Einsum"}) == expected
    assert _flops(matmul, {"MatMul"}) == expected


def test_attention_scores_cost_the_batch_matmul_they_equal():
    """q.k over heads: 2 heads S S d per row, as an einsum and a BatchMatMulV2."""
    def heads(x):
        return tf.reshape(x, [-1, SEQ, HEADS, HEAD])

    def einsum():
        x = _rows()
        return tf.reduce_sum(tf.einsum("aecd,abcd->acbe", heads(x), heads(2 * x)))

    def batch_matmul():
        x = _rows()
        q, k = (tf.transpose(heads(t), [0, 2, 1, 3]) for t in (x, 2 * x))
        return tf.reduce_sum(tf.matmul(q, k, transpose_b=True))
    expected = 2 * HEADS * SEQ * SEQ * HEAD
    assert _flops(einsum, {"Einsum"}) == expected
    assert _flops(batch_matmul, {"BatchMatMulV2"}) == expected


def test_keras_einsum_dense_and_attention_cost_their_products():
    """Keras' own layers: an EinsumDense and a MultiHeadAttention block cost
    their matrix products (projections 4 x 2 S H (heads d), scores and
    values 2 x 2 heads S S d per row)."""
    def einsum_dense():
        layer = tf.keras.layers.EinsumDense("abc,cd->abd", output_shape=[SEQ, UNITS])
        return tf.reduce_sum(layer(_rows()))
    assert _flops(einsum_dense, {"Einsum"}) == 2 * SEQ * HIDDEN * UNITS

    def attention():
        x = _rows()
        return tf.reduce_sum(tf.keras.layers.MultiHeadAttention(HEADS, HEAD)(x, x))
    projections = 4 * 2 * SEQ * HIDDEN * HEADS * HEAD
    cores = 2 * 2 * HEADS * SEQ * SEQ * HEAD
    assert _flops(attention, {"Einsum"}) == projections + cores


def _mlp(layers, einsum):
    """A GPT MLP on [B, S, H] (``layers`` 2: H -> 4H, GeLU, 4H -> H; 1: the
    first dense layer alone) as v1 dense layers (tensordot: a MatMul between
    reshapes and the shape arithmetic that sizes them) or as the einsums
    they equal, with the same weights."""
    def loss():
        h = _rows()
        for i, (depth, units) in enumerate([(HIDDEN, 4 * HIDDEN), (4 * HIDDEN, HIDDEN)][:layers]):
            activation = tf.nn.gelu if i == 0 else None
            if not einsum:
                h = v1.layers.dense(h, units, activation, name=f"fc{i}")
                continue
            kernel = v1.get_variable(f"fc{i}/kernel", [depth, units])
            h = tf.einsum("bsh,hk->bsk", h, kernel) + v1.get_variable(f"fc{i}/bias", [units])
            h = activation(h) if activation else h
        return tf.reduce_mean(h)
    return loss


@pytest.mark.parametrize("layers", [1, 2], ids=["dense", "mlp"])
def test_an_einsum_mlp_is_estimated_as_its_dense_layers(layers):
    """The search's step estimate (V100 roofline, kernel launches) of a
    dense layer and of a GPT MLP written with einsums is within 5% of the
    same layers written with v1 dense layers (issue 64: 0.93x; tensordot's
    reshapes and shape arithmetic were each costed as three kernel launches
    and their elements as FLOPs, though they launch no device kernel)."""
    steps = []
    for einsum in (False, True):
        _, view = graph_view(_mlp(layers, einsum))
        steps.append(search(view, 1, CATALOG["V100-32GB"], global_batch=8,
                            num_micro_batch=1).step_time_s)
    matmul, einsum = steps
    assert einsum / matmul == pytest.approx(1, rel=0.05)
