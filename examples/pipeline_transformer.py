"""Pipeline parallelism with tfpar (Whale Example 1): two `wh.replicate(1)` stages
and `num_micro_batch` micro-batches turn a transformer into a 2-stage pipeline.

    python examples/pipeline_transformer.py [--devices 4] [--micro-batches 4]
        [--schedule 1f1b|gpipe|kfkb|zero_bubble] [--group-size 2] [--steps 4] [--trace-dir DIR]

Trains a small BERT-like encoder twice on the same data: plainly on one device
and as a pipeline (on 4 devices the pipeline is also replicated twice, nested
data parallelism). Prints the plan, the planned schedule's bubble and
in-flight micro-batches, and the per-step losses side by side. With
--trace-dir it writes the planned schedule and a traced real step as Chrome
traces (open them in chrome://tracing or https://ui.perfetto.dev).
"""
import contextlib
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
warnings.filterwarnings("ignore", message=".*is deprecated.*")  # tf.compat.v1.layers

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.ir.schedule import SCHEDULES  # noqa: E402
from loss_report import example_parser, report  # noqa: E402  (examples/loss_report.py)

v1 = tf.compat.v1
VOCAB, SEQ, HIDDEN, HEADS, LAYERS, CLASSES = 50, 8, 32, 4, 4, 5


def encoder_layer(h, i):
    """Post-norm self-attention + feed-forward block; seeded initializers make
    both runs start from the same weights."""
    init = v1.glorot_uniform_initializer
    with v1.variable_scope(f"layer_{i}"):
        q, k, v = (v1.layers.dense(h, HIDDEN, name=n, kernel_initializer=init(seed=10 * i + j))
                   for j, n in enumerate(("query", "key", "value")))
        scores = tf.matmul(_heads(q), _heads(k), transpose_b=True) / np.sqrt(HIDDEN // HEADS)
        context = tf.matmul(tf.nn.softmax(scores), _heads(v))
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [-1, SEQ, HIDDEN])
        h = _norm(h + context)
        ff = v1.layers.dense(h, 2 * HIDDEN, tf.nn.gelu, name="ff_in",
                             kernel_initializer=init(seed=10 * i + 3))
        ff = v1.layers.dense(ff, HIDDEN, name="ff_out", kernel_initializer=init(seed=10 * i + 4))
        return _norm(h + ff)


def _heads(t):
    """[batch, SEQ, HIDDEN] -> [batch, HEADS, SEQ, HIDDEN / HEADS]."""
    return tf.transpose(tf.reshape(t, [-1, SEQ, HEADS, HIDDEN // HEADS]), [0, 2, 1, 3])


def _norm(x):
    mean, var = tf.nn.moments(x, [-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-6)


def build_model(ids, labels, stage):
    """Embedding + first half of the layers in stage 0, the rest and the loss in stage 1."""
    with stage():
        table = v1.get_variable("embedding", [VOCAB, HIDDEN],
                                initializer=v1.random_normal_initializer(stddev=0.1, seed=0))
        h = tf.nn.embedding_lookup(table, ids)
        for i in range(LAYERS // 2):
            h = encoder_layer(h, i)
    with stage():
        for i in range(LAYERS // 2, LAYERS):
            h = encoder_layer(h, i)
        logits = v1.layers.dense(h[:, 0], CLASSES, name="classifier",
                                 kernel_initializer=v1.glorot_uniform_initializer(seed=99))
        loss = v1.losses.sparse_softmax_cross_entropy(labels, logits)
    return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)


def run(data, config=None, trace_dir=None):
    """Train on ``data``; with ``config`` as a tfpar pipeline. Returns (losses, plan)."""
    graph = tf.Graph()
    with graph.as_default():
        if config is not None:
            wh.init(config)                             # <- the lines tfpar adds:
        stage = (lambda: wh.replicate(1)) if config is not None else contextlib.nullcontext
        ids = v1.placeholder(tf.int64, [None, SEQ])
        labels = v1.placeholder(tf.int64, [None])
        loss, train_op = build_model(ids, labels, stage)  # <- stages are wh.replicate(1)
        plan = wh.current_plan() if config is not None else None
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = []
            for step, (a, b) in enumerate(data):
                traced = trace_dir is not None and step == len(data) - 1
                metadata = v1.RunMetadata() if traced else None
                options = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE) if traced else None
                losses.append(sess.run([loss, train_op], {ids: a, labels: b}, options=options,
                                       run_metadata=metadata)[0])
            if metadata is not None:
                wh.step_timeline(metadata, os.path.join(trace_dir, "step_timeline.json"))
    if config is not None:
        wh.reset()
    return losses, plan


def main():
    parser = example_parser(__doc__, devices=4, batch=32, steps=4)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    parser.add_argument("--group-size", type=int, default=2, help="k of kFkB (--schedule kfkb)")
    parser.add_argument("--trace-dir", help="write plan_timeline.json and step_timeline.json")
    args = parser.parse_args()
    v1.disable_eager_execution()
    rng = np.random.RandomState(0)
    data = [(rng.randint(0, VOCAB, (args.batch, SEQ)), rng.randint(0, CLASSES, args.batch))
            for _ in range(args.steps)]
    config = {"cluster.num_devices": args.devices, "num_micro_batch": args.micro_batches,
              "pipeline.schedule": args.schedule,
              **({"pipeline.group_size": args.group_size} if args.schedule == "kfkb" else {})}
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
    plain, _ = run(data)
    parallel, plan = run(data, config, args.trace_dir)
    print(plan.summary())
    planned = plan.simulate(forward_time=1, backward_time=2)
    print(f"\nplanned {args.schedule} schedule (forward 1, backward 2 per stage): "
          f"bubble {planned.bubble_fraction:.0%}, micro-batches in flight per stage "
          f"{planned.peak_in_flight}")
    if args.trace_dir:
        plan.timeline(os.path.join(args.trace_dir, "plan_timeline.json"))
        print(f"Chrome traces: {args.trace_dir}/plan_timeline.json, step_timeline.json")
    return report(plain, parallel, "pipeline")


if __name__ == "__main__":
    raise SystemExit(main())
