"""TF2 with tfpar: an eager script's tf.function training step runs data parallel with one added line.

    python examples/tf2_custom_loop.py [--devices 4] [--batch 64] [--steps 8] [--fit]

Trains a small Keras classifier twice on the same data in eager mode (TF2's
default), first with tfpar on N logical CPU devices (GPUs when present), then
plainly on one device, and prints the per-step losses side by side: they agree
to float32 rounding. By default the step is a custom loop (``@tf.function``,
``tf.GradientTape``, ``optimizer.apply_gradients``); ``--fit`` uses
``model.compile`` + ``model.fit`` instead (one epoch per step).

tfpar runs first because ``wh.init()`` must come before the script's first
TensorFlow op, where TensorFlow makes the logical CPU devices.
"""
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from loss_report import (devices_that_worked, example_parser, report,  # noqa: E402
                         traced_functions)  # (examples/loss_report.py)


def make_model():
    return tf.keras.Sequential([tf.keras.layers.Dense(64, activation="relu", input_shape=(32,)),
                                tf.keras.layers.Dense(10)])


def custom_loop(batches):
    """One step per batch of a @tf.function loop; the losses."""
    model, optimizer = make_model(), tf.keras.optimizers.Adam(1e-2)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return [float(step(x, y)) for x, y in batches]


def keras_fit(batches):
    """``model.fit`` for one epoch per batch; the losses."""
    model = make_model()
    model.compile(tf.keras.optimizers.Adam(1e-2),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return [model.fit(x, y, batch_size=len(x), verbose=0).history["loss"][0]
            for x, y in batches]


def main():
    parser = example_parser(__doc__, devices=4, batch=64, steps=8)
    parser.add_argument("--fit", action="store_true", help="model.fit instead of a custom loop")
    args = parser.parse_args()
    wh.init({"cluster.num_devices": args.devices})   # <- the line tfpar adds
    rng = np.random.RandomState(0)
    centers = rng.randn(10, 32)
    batches = []
    for _ in range(args.steps):
        labels = rng.randint(0, 10, args.batch)
        batches.append(((centers[labels] + rng.randn(args.batch, 32)).astype(np.float32),
                        labels))
    train = keras_fit if args.fit else custom_loop

    with traced_functions():
        tf.keras.utils.set_random_seed(0)
        parallel = train(batches)
        print("the training step ran on:", ", ".join(devices_that_worked()))
    wh.reset()

    tf.keras.utils.set_random_seed(0)
    plain = train(batches)
    return report(plain, parallel)


if __name__ == "__main__":
    raise SystemExit(main())
