"""tf.estimator with tfpar: the same model_fn trains data-parallel, as a 2-stage
pipeline, or with a split classifier head, and matches a plain Estimator.

    python examples/estimator_classifier.py [--mode dp|pipeline|split] [--devices 2]
        [--steps 8] [--model-dir DIR]

Trains a plain Estimator and a tfpar one (``wh.init`` before the Estimator is
built; scopes inside ``model_fn``) on the same data, then evaluates both and
predicts with both: loss, accuracy and logits agree to float32 rounding. The
parallel checkpoint is then evaluated by a plain Estimator (checkpoints keep
single-device names).
"""
import contextlib
import os
import tempfile
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore")  # tf.estimator and tf.compat.v1.layers deprecations

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.get_logger().setLevel("ERROR")  # one deprecation notice per Estimator class (tfpar logs as "tfpar")

import tfpar as wh  # noqa: E402
from loss_report import TracedStepHook, example_parser, print_devices  # noqa: E402  (examples/loss_report.py)

v1 = tf.compat.v1
CLASSES = 10


def model_fn(features, labels, mode, params):
    """An MLP classifier; ``params["mode"]`` says where the tfpar scopes go."""
    where = params["mode"]
    init = v1.glorot_uniform_initializer
    first = wh.replicate(1) if where == "pipeline" else contextlib.nullcontext()
    second = (wh.replicate(1) if where == "pipeline" else
              wh.split(params["devices"]) if where == "split" else contextlib.nullcontext())
    with first:
        h = v1.layers.dense(features["x"], 64, tf.nn.relu, kernel_initializer=init(seed=1))
    with second:
        kernel = np.random.RandomState(2).randn(64, CLASSES).astype(np.float32) / 8
        logits = v1.layers.dense(h, CLASSES, name="logits",
                                 kernel_initializer=v1.constant_initializer(kernel))
        if mode == tf.estimator.ModeKeys.PREDICT:
            return tf.estimator.EstimatorSpec(mode, predictions={"logits": logits})
        loss = v1.losses.sparse_softmax_cross_entropy(labels, logits)
    train_op = v1.train.AdamOptimizer(1e-3).minimize(loss, global_step=v1.train.get_global_step())
    accuracy = v1.metrics.accuracy(labels, tf.argmax(logits, 1))
    return tf.estimator.EstimatorSpec(mode, loss=loss, train_op=train_op,
                                      eval_metric_ops={"accuracy": accuracy})


def make_input_fn(x, y, batch):
    return lambda: tf.data.Dataset.from_tensor_slices(({"x": x}, y)).batch(batch)


def run(model_dir, mode, args, input_fn):
    """Train, evaluate and predict; with ``mode`` under tfpar."""
    if mode is not None:
        wh.init({"cluster.num_devices": args.devices,
                 "pipeline.num_micro_batch": 2 if mode == "pipeline" else 1})
    estimator = tf.estimator.Estimator(
        model_fn, config=tf.estimator.RunConfig(model_dir=model_dir, log_step_count_steps=4),
        params={"mode": mode, "devices": args.devices})
    traced = TracedStepHook()
    estimator.train(input_fn, hooks=[traced])
    metrics = estimator.evaluate(input_fn)
    logits = np.stack([p["logits"] for p in estimator.predict(input_fn)])
    if mode is not None:
        wh.reset()
    return metrics, logits, traced.devices


def main():
    parser = example_parser(__doc__, devices=2, batch=32, steps=8)
    parser.add_argument("--mode", default="dp", choices=["dp", "pipeline", "split"])
    parser.add_argument("--model-dir", help="where both Estimators write (default: a temp dir)")
    args = parser.parse_args()
    v1.disable_eager_execution()
    rng = np.random.RandomState(0)
    x = rng.randn(args.steps * args.batch, 32).astype(np.float32)
    y = np.argmax(x @ rng.randn(32, CLASSES), 1).astype(np.int64)
    input_fn = make_input_fn(x, y, args.batch)
    root = args.model_dir or tempfile.mkdtemp(prefix="tfpar_estimator_")
    plain = run(os.path.join(root, "plain"), None, args, input_fn)
    parallel = run(os.path.join(root, args.mode), args.mode, args, input_fn)
    cross = tf.estimator.Estimator(model_fn, model_dir=os.path.join(root, args.mode),
                                   params={"mode": None, "devices": 1}).evaluate(input_fn)
    print(f"{'':28}{'plain':>12}{'tfpar ' + args.mode:>16}{'plain on its ckpt':>20}")
    for key in ("loss", "accuracy", "global_step"):
        print(f"{key:28}{plain[0][key]:>12.6g}{parallel[0][key]:>16.6g}{cross[key]:>20.6g}")
    worst = float(np.max(np.abs(plain[1] - parallel[1])))
    print(f"largest logit difference in predict: {worst:.2e}")
    print_devices(parallel[2])
    same = abs(plain[0]["loss"] - parallel[0]["loss"]) <= 1e-4 * abs(plain[0]["loss"])
    print("equivalent" if same and worst < 1e-3 else "NOT equivalent")
    return 0 if same and worst < 1e-3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
