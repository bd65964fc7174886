"""Keras ``model.fit`` / ``model.evaluate`` with tfpar: a functional model
built with scopes, data-parallel, as a 2-stage pipeline, or with a split head;
in TF2 eager mode (the default) or Keras in graph mode (``--graph``).

    python examples/keras_fit.py [--mode dp|pipeline|split] [--devices 2] [--epochs 3] [--graph]

Fits the same model plainly and under tfpar (``wh.init`` first; scopes around
building its layers, as in Whale's examples) and prints the per-epoch losses
side by side, then both evaluations. In eager mode tfpar runs first, because
``wh.init()`` must come before the script's first TensorFlow op.
"""
import contextlib
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from loss_report import (devices_that_worked, example_parser, print_devices, report,  # noqa: E402
                         traced_functions, traced_step_options)  # (examples/loss_report.py)

CLASSES = 10


def build_model(mode, devices, optimizer, **session_kwargs):
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
    model.compile(optimizer,
                  tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], **session_kwargs)
    return model


def config(args, mode) -> dict:
    return {"cluster.num_devices": args.devices,
            "pipeline.num_micro_batch": 2 if mode == "pipeline" else 1}


def fit(model, x, y, args):
    """The per-epoch losses and the evaluation of ``model`` fitted on x, y."""
    history = model.fit(x, y, batch_size=args.batch, epochs=args.epochs, shuffle=False,
                        verbose=0)
    return history.history["loss"], model.evaluate(x, y, batch_size=args.batch, verbose=0)


def run_graph(x, y, args, mode=None):
    """Keras in graph mode (legacy optimizers); where each TaskGraph ran."""
    graph = tf.Graph()
    with graph.as_default():
        if mode is not None:
            wh.init(config(args, mode))
        options, metadata = traced_step_options()  # every step traced; the last one kept
        model = build_model(mode, args.devices, tf.keras.optimizers.legacy.Adam(1e-3),
                            options=options, run_metadata=metadata)
        losses, evaluation = fit(model, x, y, args)
        devices = wh.step_devices(metadata)
        plan = wh.current_plan() if mode is not None else None
    if mode is not None:
        wh.reset()
    return losses, evaluation, plan, devices


def run_eager(x, y, args, mode=None):
    """TF2: Keras' own tf.function steps; the devices they ran on."""
    if mode is not None:
        wh.init(config(args, mode))
    with traced_functions() if mode is not None else contextlib.nullcontext():
        model = build_model(mode, args.devices, tf.keras.optimizers.Adam(1e-3))
        losses, evaluation = fit(model, x, y, args)
        plan, devices = ((wh.current_plan(), devices_that_worked()) if mode is not None
                         else (None, []))
    if mode is not None:
        wh.reset()
    return losses, evaluation, plan, devices


def main():
    parser = example_parser(__doc__, devices=2, batch=32)
    parser.add_argument("--mode", default="dp", choices=["dp", "pipeline", "split"])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--graph", action="store_true", help="Keras in graph mode")
    args = parser.parse_args()
    rng = np.random.RandomState(0)
    x = rng.randn(256, 32).astype(np.float32)
    y = np.argmax(x @ rng.randn(32, CLASSES), 1).astype(np.int64)
    if args.graph:
        tf.compat.v1.disable_eager_execution()
        warnings.filterwarnings("ignore")  # keras v1 graph-mode deprecations
        plain, plain_eval, _, _ = run_graph(x, y, args)
        parallel, parallel_eval, plan, devices = run_graph(x, y, args, args.mode)
    else:
        parallel, parallel_eval, plan, devices = run_eager(x, y, args, args.mode)
        plain, plain_eval, _, _ = run_eager(x, y, args)
    print(plan.summary())
    if args.graph:
        print_devices(devices)
    else:
        print("the training step ran on:", ", ".join(devices))
    print(f"\nevaluate (loss, accuracy): plain {plain_eval}, tfpar {parallel_eval}")
    return report(plain, parallel, args.mode)


if __name__ == "__main__":
    raise SystemExit(main())
