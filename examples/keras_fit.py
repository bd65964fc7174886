"""Keras in graph mode with tfpar: ``model.fit`` / ``model.evaluate`` of a
functional model, data-parallel, as a 2-stage pipeline, or with a split head.

    python examples/keras_fit.py [--mode dp|pipeline|split] [--devices 2] [--epochs 3]

Fits the same model plainly and under tfpar (``wh.init`` before the model is
built; scopes around its layers) and prints the per-epoch losses side by side,
then both evaluations.
"""
import contextlib
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore")  # keras v1 graph-mode deprecations

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from loss_report import example_parser, print_devices, report, traced_step_options  # noqa: E402  (examples/loss_report.py)

CLASSES = 10


def build_model(mode, devices, **session_kwargs):
    first = wh.replicate(1) if mode == "pipeline" else contextlib.nullcontext()
    second = (wh.replicate(1) if mode == "pipeline" else
              wh.split(devices) if mode == "split" else contextlib.nullcontext())
    inputs = tf.keras.Input((32,))
    with first:
        h = tf.keras.layers.Dense(64, "relu", kernel_initializer=tf.keras.initializers.
                                  GlorotUniform(seed=1))(inputs)
    with second:
        kernel = np.random.RandomState(2).randn(64, CLASSES).astype(np.float32) / 8
        logits = tf.keras.layers.Dense(CLASSES, name="logits", kernel_initializer=tf.compat.v1.
                                       constant_initializer(kernel))(h)
    model = tf.keras.Model(inputs, logits)
    model.compile(tf.keras.optimizers.legacy.Adam(1e-3),
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **session_kwargs)
    return model


def run(x, y, args, mode=None):
    graph = tf.Graph()
    with graph.as_default():
        if mode is not None:
            wh.init({"cluster.num_devices": args.devices,
                     "pipeline.num_micro_batch": 2 if mode == "pipeline" else 1})
        options, metadata = traced_step_options()  # every step traced; the last one kept
        model = build_model(mode, args.devices, options=options, run_metadata=metadata)
        history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                            verbose=0)
        devices = wh.step_devices(metadata)
        evaluation = model.evaluate(x, y, batch_size=args.batch, verbose=0)
        plan = wh.current_plan() if mode is not None else None
    if mode is not None:
        wh.reset()
    return history.history["loss"], evaluation, plan, devices


def main():
    parser = example_parser(__doc__, devices=2, batch=32)
    parser.add_argument("--mode", default="dp", choices=["dp", "pipeline", "split"])
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    rng = np.random.RandomState(0)
    x = rng.randn(256, 32).astype(np.float32)
    y = np.argmax(x @ rng.randn(32, CLASSES), 1).astype(np.int64)
    plain, plain_eval, _, _ = run(x, y, args)
    parallel, parallel_eval, plan, devices = run(x, y, args, args.mode)
    print(plan.summary())
    print_devices(devices)
    print(f"\nevaluate (loss, accuracy): plain {plain_eval}, tfpar {parallel_eval}")
    return report(plain, parallel, args.mode)


if __name__ == "__main__":
    raise SystemExit(main())
