"""The memory model counts the optimizer the script built (issue 45: every
estimate assumed Adam's two slots per weight, and annotated plans none):
SGD keeps no state, Momentum and Adagrad one slot, Adam and RMSProp two, as
each optimizer made them; searched and annotated plans share one factor."""
import pytest
import tensorflow as tf
from test_tf2 import run_eager

import tfpar as wh
from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.model_view import model_view
from tfpar.hooks.capture import existing_capture
from tfpar.planner.memory import SLOTS, state_bytes, state_per_weight

v1 = tf.compat.v1
WIDTH = 16


def _loss():
    x = v1.placeholder(tf.float32, [None, WIDTH])
    h = v1.layers.dense(x, WIDTH, name="fc1")
    return tf.reduce_mean(v1.layers.dense(h, 1, name="fc2") ** 2)


def _slots_of(minimize):
    """The model view's optimizer slots of a two-layer model trained by ``minimize``."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1})
        minimize(_loss())
        _, view = model_view(GraphIndex(graph), existing_capture(graph))
    wh.reset()
    return view.optimizer_slots


@pytest.mark.parametrize("make, slots", [
    (lambda: v1.train.GradientDescentOptimizer(0.1), 0),
    (lambda: v1.train.MomentumOptimizer(0.1, 0.9), 1),
    (lambda: v1.train.AdagradOptimizer(0.1), 1),
    (lambda: v1.train.AdamOptimizer(0.1), 2),
    (lambda: v1.train.RMSPropOptimizer(0.1), 2),               # rms and momentum
    (lambda: v1.train.RMSPropOptimizer(0.1, centered=True), 3),
    (lambda: tf.keras.optimizers.legacy.SGD(0.1), 0),
    (lambda: tf.keras.optimizers.legacy.SGD(0.1, momentum=0.9), 1),
    (lambda: tf.keras.optimizers.legacy.Adam(0.1), 2),
], ids=["sgd", "momentum", "adagrad", "adam", "rmsprop", "centered-rmsprop", "keras-sgd",
        "keras-momentum", "keras-adam"])
def test_graph_optimizers_state_per_weight(make, slots):
    def minimize(loss):
        variables = v1.trainable_variables()
        return make().apply_gradients(zip(tf.gradients(loss, variables), variables))
    assert _slots_of(minimize) == slots


def test_no_optimizer_seen_is_adams_state():
    assert _slots_of(lambda loss: tf.gradients(loss, v1.trainable_variables())) == SLOTS == 2


TF2_STEP = """
wh.init({"cluster.num_devices": 2})
model = tf.keras.Sequential([tf.keras.layers.Dense(16), tf.keras.layers.Dense(1)])
model.build((None, 16))
optimizer = tf.keras.optimizers.%s

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(model(x) ** 2)
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

step(tf.constant(np.ones((4, 16), np.float32)))
params = sum(v.shape.num_elements() * 4 for v in model.trainable_variables)
state = wh.current_plan().estimate["memory"]
print("RESULT", params, [state["weights"], state["gradients"], state["optimizer"]])
"""


@pytest.mark.parametrize("optimizer, slots", [
    ("SGD(0.1)", 1), ("SGD(0.1, momentum=0.9)", 1), ("Adam(0.1)", 2)])
def test_a_tf2_steps_keras_optimizer_state_per_weight(optimizer, slots):
    """A Keras (non-legacy) optimizer in a tf.function step, counted by its
    ``variables`` but ``iterations`` and its learning rate (scalars). Keras
    2.15's SGD makes a momentum slot per weight even without momentum (its
    ``build``): one slot, as it allocates."""
    out = run_eager(TF2_STEP % optimizer)
    result = next(line for line in out.splitlines() if line.startswith("RESULT "))
    params, memory = result.split(" ", 2)[1:]  # TensorFlow 2.21 logs after it
    params = int(params)
    assert eval(memory) == [params, params, slots * params]  # pylint: disable=eval-used


def test_sgd_and_adam_estimates_by_hand():
    """Weights, gradients and slots per weight byte: 8 bytes per float32
    parameter with SGD, 16 with Adam; ZeRO-1 shards only the slots."""
    weights = 4e9
    assert state_bytes(weights, 8, 0, slots=0) == 8e9 == state_per_weight(0) * weights
    assert state_bytes(weights, 8, 0, slots=2) == 16e9 == state_per_weight(2) * weights
    assert state_bytes(weights, 8, 1, slots=1) == 4e9 + 4e9 + 4e9 / 8
