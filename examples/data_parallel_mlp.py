"""Data parallelism with tfpar: one added line makes a TF1-style script run on N devices.

    python examples/data_parallel_mlp.py [--devices 4] [--steps 8] [--micro-batches 1]
                                         [--report plan_report.html] [--calibrate FILE]

Trains a small MLP classifier twice on the same data, plainly on one device and
with tfpar on N logical CPU devices (GPUs when present), and prints the plan
and the per-step losses side by side: they agree to float32 rounding. With
--report, tfpar writes the plan report (config key ``report``) after the first
step, and the example ends by naming it. After the last step tfpar prints its
cost model's predicted compute time and memory beside those measured in the
last steps (config key ``measure.after_steps``); with --calibrate, tfpar also fits a
device entry to that step and writes it to FILE, and the example trains once
more with that entry as ``cluster.hardware``, printing the table again.
"""
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore", message=".*is deprecated.*")  # tf.compat.v1.layers

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from loss_report import example_parser, print_devices, report, train_steps  # noqa: E402  (examples/loss_report.py)


def build_model(x, y):
    """A 2-layer MLP; seeded initializers make both runs start identical."""
    init = tf.compat.v1.glorot_uniform_initializer
    h = tf.compat.v1.layers.dense(x, 64, tf.nn.relu, kernel_initializer=init(seed=1))
    logits = tf.compat.v1.layers.dense(h, 10, kernel_initializer=init(seed=2))
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
    train_op = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
    return loss, train_op


def run(data, tfpar_config=None):
    """Train on ``data``; with ``tfpar_config`` the graph goes through tfpar."""
    graph = tf.Graph()
    with graph.as_default():
        if tfpar_config is not None:
            wh.init(tfpar_config)                      # <- the line tfpar adds
        x = tf.compat.v1.placeholder(tf.float32, [None, 32])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        loss, train_op = build_model(x, y)
        plan = wh.current_plan() if tfpar_config is not None else None
        losses, devices = train_steps(loss, train_op, [{x: a, y: b} for a, b in data])
    if tfpar_config is not None:
        wh.reset()
    return losses, plan, devices


def main():
    parser = example_parser(__doc__, devices=4, batch=64, steps=8)
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--report", help="write the plan report (HTML) to this path")
    parser.add_argument("--calibrate", metavar="FILE",
                        help="write the device entry fitted to the measured step to FILE, "
                             "then train again with it")
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    rng = np.random.RandomState(0)
    centers = rng.randn(10, 32)
    data = []
    for _ in range(args.steps):
        labels = rng.randint(0, 10, args.batch)
        data.append(((centers[labels] + rng.randn(args.batch, 32)).astype(np.float32), labels))

    plain, _, _ = run(data)
    config = {"cluster.num_devices": args.devices, "pipeline.num_micro_batch": args.micro_batches,
              "measure.after_steps": args.steps}  # the last steps: the least disturbed
    parallel, plan, devices = run(data, {**config, "report": args.report,
                                         "measure.calibrate": args.calibrate})
    print(plan.summary())
    print_devices(devices)
    failed = report(plain, parallel)
    if args.calibrate:
        print(f"training again, planned with the calibrated entry: cluster.hardware "
              f"{args.calibrate!r}")
        run(data, {**config, "cluster.hardware": args.calibrate})
    if args.report:
        print(f"plan report (open it in a browser): {os.path.abspath(args.report)}")
    return failed


if __name__ == "__main__":
    raise SystemExit(main())
