"""tfpar chooses the parallel plan itself: ``auto.auto_parallel`` on a classifier
with a wide head, no scopes in the model.

    python examples/auto_parallel.py [--devices 4] [--classes 20000] [--steps 4]

``wh.init`` first runs this script once more as a planning pass (a child that
stops at the first training step): the planner searches data x tensor x
pipeline meshes and finds that the head's weights cost more to all-reduce
than its logits cost to keep split, so the head and the loss are built split
over the devices and the backbone stays data parallel (Whale's Example 2,
found rather than written). The script then trains plainly and with tfpar
and prints the plan and both runs' losses.
"""
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore", message=".*is deprecated.*")  # tf.compat.v1.layers

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from loss_report import example_parser, print_devices, report, train_steps  # noqa: E402  (examples/loss_report.py)

FEATURES, HIDDEN = 32, 256


def build_model(x, y, classes):
    """Backbone and a wide head; seeded initializers make both runs start alike."""
    init = tf.compat.v1.glorot_uniform_initializer
    h = tf.compat.v1.layers.dense(x, HIDDEN, tf.nn.relu, kernel_initializer=init(seed=1),
                                  name="backbone")
    logits = tf.compat.v1.layers.dense(h, classes, kernel_initializer=init(seed=2), name="head")
    loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, tf.compat.v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def run(data, classes, tfpar_config=None):
    """Train on ``data``; with ``tfpar_config`` the graph goes through tfpar."""
    graph = tf.Graph()
    with graph.as_default():
        if tfpar_config is not None:
            wh.init(tfpar_config)
        x = tf.compat.v1.placeholder(tf.float32, [None, FEATURES])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        loss, train_op = build_model(x, y, classes)
        plan = wh.current_plan() if tfpar_config is not None else None
        losses, devices = train_steps(loss, train_op, [{x: a, y: b} for a, b in data])
    if tfpar_config is not None:
        wh.reset()
    return losses, plan, devices


def make_data(steps, batch, classes, seed=0):
    """The same random batch every step: random labels carry nothing to learn
    across batches, so only a repeated batch shows the loss going down."""
    rng = np.random.RandomState(seed)
    batch_data = (rng.randn(batch, FEATURES).astype(np.float32), rng.randint(0, classes, batch))
    return [batch_data] * steps


def main():
    parser = example_parser(__doc__, devices=4, batch=32, steps=4)
    parser.add_argument("--classes", type=int, default=20000)
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    data = make_data(args.steps, args.batch, args.classes)
    plain, _, _ = run(data, args.classes)
    parallel, plan, devices = run(data, args.classes, {
        "auto.auto_parallel": True, "cluster.num_devices": args.devices,
        "auto.global_batch": args.batch})
    print(plan.summary())
    print_devices(devices)
    return report(plain, parallel)


if __name__ == "__main__":
    raise SystemExit(main())
