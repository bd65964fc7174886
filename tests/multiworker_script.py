"""A training script run by the multi-worker tests as every worker of a cluster.

    python tests/multiworker_script.py OUT.npz [--mode dp|dp-data|pipeline]
        [--save CKPT] [--restore CKPT --first-step K] [--steps N] [--sleep S] [--horovod]
        [--checkpoint-dir DIR] [--nan STEP ROW]

In a TF_CONFIG cluster the chief trains the test MLP on the equivalence data and
writes per-step losses and variables to OUT.npz; other workers only serve
(wh.init does not return there). With --horovod (under horovodrun) every
process trains its share and writes OUT.npz with its rank appended. With
--checkpoint-dir it trains as a script that survives restarts does: a
MonitoredTrainingSession saving a checkpoint in DIR after every step (and
resuming from the last one), each step fed the batch of the global step it
computes, until the global step is N. --nan puts a NaN in row ROW of step
STEP's batch. Every process prints its pid first.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from equivalence import dense, make_data, mlp_classifier, variable_values  # noqa: E402
from proof import TRACER, assert_parallel  # noqa: E402

import tfpar as wh  # noqa: E402

v1 = tf.compat.v1
DATA = make_data(steps=4, batch=8)


def pipeline(x, y):
    with wh.replicate(1):
        h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
    with wh.replicate(1):
        loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", seed=2))
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def split_head(x, y):
    h = dense(x, 8, "hidden", seed=1, activation=tf.nn.tanh)
    with wh.split(2):
        logits = v1.layers.dense(h, 3, name="logits", kernel_initializer=v1.constant_initializer(
            np.random.RandomState(2).randn(8, 3).astype(np.float32)))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


BUILDS = {"pipeline": pipeline, "split": split_head}


def from_start(args, feed, step_fetches):
    """Train ``args.steps`` steps from ``--first-step`` (after ``--restore``),
    then ``--save``: (losses, {variable: value})."""
    saver = v1.train.Saver()
    losses = []
    with v1.Session() as sess:
        sess.run(v1.global_variables_initializer())
        if args.restore:
            saver.restore(sess, args.restore)
        for step in range(args.first_step, args.first_step + args.steps):
            losses.append(sess.run(step_fetches, feed(step))[0])
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
            time.sleep(args.sleep)
        values = variable_values(sess, v1.global_variables())
        if args.save:
            saver.save(sess, args.save)
    return losses, values


def resumed(args, feed, step_fetches):
    """Train from the last checkpoint of ``--checkpoint-dir`` until the global
    step is ``args.steps``, checkpointing every step: (losses, {variable: value})."""
    global_step = v1.train.get_global_step()
    losses = []
    with v1.train.MonitoredTrainingSession(
            checkpoint_dir=args.checkpoint_dir, save_checkpoint_steps=1,
            save_summaries_steps=None, save_summaries_secs=None,
            log_step_count_steps=None) as sess:
        step = sess.run(global_step)
        while step < args.steps:
            losses.append(sess.run(step_fetches, feed(step))[0])
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
            time.sleep(args.sleep)
            step = sess.run(global_step)
        values = variable_values(sess, v1.global_variables())
    return losses, values


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", default="dp", choices=["dp", "dp-data", "dp-shard", "pipeline", "split"])
    parser.add_argument("--save")
    parser.add_argument("--restore", help="checkpoint to resume from")
    parser.add_argument("--first-step", type=int, default=0, help="data step to start at")
    parser.add_argument("--steps", type=int, default=len(DATA[0]))
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--horovod", action="store_true")
    parser.add_argument("--checkpoint-dir", help="resume from and checkpoint every step to DIR")
    parser.add_argument("--nan", type=int, nargs=2, help="STEP ROW: a NaN in that batch row")
    args = parser.parse_args()
    print("pid", os.getpid(), flush=True)
    config = {"communication.timeout_s": 20.0}
    if args.horovod:
        config["communication.backend"] = "horovod"
    if args.mode == "dp-shard":  # each process reads half-size batches of its own
        config["io.shard_dataset"] = True
    if args.mode == "pipeline":
        config["pipeline.num_micro_batch"] = 2
    v1.disable_eager_execution()  # a TF1 script (wh.init leaves the mode alone)
    wh.init(config)
    TRACER.install()  # proves, below, that the plan ran in this process's steps
    build = BUILDS.get(args.mode) or mlp_classifier(global_step=bool(args.checkpoint_dir))
    xs, ys = DATA[0].copy(), DATA[1]
    if args.nan:
        xs[args.nan[0]][args.nan[1], 0] = np.nan
    if args.mode in ("dp-data", "dp-shard"):
        batch = 8 if args.mode == "dp-data" else 4
        ds = tf.data.Dataset.from_tensor_slices((xs.reshape(-1, 6), ys.reshape(-1))).batch(batch)
        x, y = v1.data.make_one_shot_iterator(ds).get_next()
    else:
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
    loss, train_op = build(x, y)
    run = resumed if args.checkpoint_dir else from_start
    losses, values = run(args, lambda step: {} if args.mode.startswith("dp-") else {
        x: xs[step % len(xs)], y: ys[step % len(ys)]}, [loss, train_op])
    try:
        assert_parallel()
    finally:
        TRACER.uninstall()  # a traced run of the exit-time worker release would wait on them
    if args.horovod:
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        args.out = f"{args.out}.rank{hvd.rank()}.npz"
    np.savez(args.out, losses=np.array(losses), plan_ran=np.array(True),
             **{k.replace("/", "|"): v for k, v in values.items()})
    print("plan:", wh.current_plan().summary().splitlines()[0], flush=True)


if __name__ == "__main__":
    main()
