"""A TF2 script with Keras 3 (tf.keras on TensorFlow 2.16+ without
TF_USE_LEGACY_KERAS), run by ``test_keras3.py`` in a fresh process.

    python keras3_script.py SCENARIO DEVICES

DEVICES 0 runs it plainly; otherwise ``wh.init({"cluster.num_devices": DEVICES,
...})`` comes first. Prints one JSON line: the losses, the final weights, the
devices that ran work in the step's placed graphs, the plan's TaskGraphs, or
the ``PlanError`` tfpar raised.

Scenarios: ``loop`` (a tf.function step with tf.GradientTape and a Keras 3
Adam on a Sequential model, over batches of 16, the last one of 8);
``keras_loss`` (``loop`` with Keras 3's SparseCategoricalCrossentropy, which
divides the sum by the size of the per-example losses it computes);
``stages`` (that step calling its two layers in two ``wh.replicate(1)``
scopes, 2 micro-batches); ``fit`` (``Model.fit`` with an accuracy metric, 2
epochs, then ``evaluate`` and ``predict``: "losses" are every value logged
and predicted); ``fit_jit`` (``fit`` compiled with ``jit_compile=True``,
under ``strict``); ``fit_bn`` (``fit`` of the model with a Keras 3
BatchNormalization between its layers, under ``batch_norm.sync``); refused with a ``PlanError``: ``eager_scope`` (a layer made
in ``wh.replicate(1)`` in eager code), ``split`` (the head called in
``wh.split()`` in the step).
"""
import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402
from tf2_script import planned_devices, strategies, working_devices  # noqa: E402

CONFIGS = {"stages": {"pipeline.num_micro_batch": 2}, "fit_jit": {"strict": True},
           "fit_bn": {"batch_norm.sync": True}}


def scope(kind: str, devices: int):
    """``wh.replicate(1)`` (kind "stages") / ``wh.split()`` (kind "split") under tfpar;
    nothing in the plain run or for another kind."""
    if not devices or kind not in ("stages", "split"):
        return contextlib.nullcontext()
    return wh.split() if kind == "split" else wh.replicate(1)


def train(scenario: str, devices: int):
    rng = np.random.RandomState(0)
    x_all = rng.randn(40, 4).astype(np.float32)
    y_all = (rng.rand(40) * 4).astype(np.int64)
    with scope("stages" if scenario == "eager_scope" else "", devices):
        body = tf.keras.layers.Dense(8, activation="relu")
    head = tf.keras.layers.Dense(4)
    middle = [tf.keras.layers.BatchNormalization()] if scenario.endswith("_bn") else []
    net = tf.keras.Sequential([tf.keras.Input((4,)), body, *middle, head])
    if scenario.startswith("fit"):  # every logged value: the loss and accuracy of each epoch
        net.compile(tf.keras.optimizers.Adam(0.01),
                    tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=["accuracy"], jit_compile=scenario == "fit_jit")
        logged = net.fit(x_all, y_all, batch_size=16, epochs=2, verbose=0).history
        evaluated = net.evaluate(x_all, y_all, batch_size=16, verbose=0)
        predicted = net.predict(x_all, batch_size=16, verbose=0)
        return (logged["loss"] + logged["accuracy"] + evaluated
                + predicted.ravel().tolist()), net
    opt = tf.keras.optimizers.Adam(0.01)
    keras_loss = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            with scope("stages" if scenario == "stages" else "", devices):
                hidden = body(x)
            with scope(scenario, devices):
                logits = head(hidden)
                loss = (keras_loss(y, logits) if scenario == "keras_loss" else tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits)))
        grads = tape.gradient(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss

    batches = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(16)
    return [float(step(x, y)) for _ in range(2) for x, y in batches], net


def main(scenario: str, devices: int) -> dict:
    if devices:
        wh.init({"cluster.num_devices": devices, **CONFIGS.get(scenario, {})})
    tf.keras.utils.set_random_seed(3)
    context.context().enable_run_metadata()
    try:
        losses, net = train(scenario, devices)
    except wh.PlanError as error:
        return {"refused": str(error)}
    return {"keras": tf.keras.__version__, "losses": losses,
            "weights": [w.numpy().tolist() for w in net.weights],
            "devices": working_devices(context.context().export_run_metadata()),
            "planned": planned_devices() if devices else [],
            "strategies": strategies() if devices else []}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
