"""A TF2 training script run by ``test_multiworker_tf2.py`` as every process
of a ``tfpar launch`` cluster (TF_CONFIG) or a ``horovodrun`` job, and plainly
for the reference.

    python tests/multiworker_tf2_script.py OUT --mode loop|fit|pipeline
        [--plain] [--horovod] [--checkpoint-dir DIR] [--steps N] [--sleep S]

``loop``: a ``tf.function`` step (``tf.GradientTape``, a Keras model, Adam)
over 8-row batches, returning its loss and a ``keras.metrics.Mean`` tracker's
value; ``fit``: ``compile`` + ``fit`` with validation data, a metric and a
``ModelCheckpoint`` callback, then ``evaluate``; ``pipeline``: ``loop`` with
its two layers in two ``wh.replicate(1)`` stages and 2 micro-batches;
``split``: ``loop`` with its head in ``wh.split()`` (4 classes);
``shards``: a loop over a ``tf.data`` dataset with ``io.shard_dataset``.
``--plain``: no tfpar (one device). ``--seed-per-rank``: each Horovod rank
initializes the model differently (rank 0 as the plain run). ``--checkpoint-dir``: a loop that resumes
from DIR's latest ``tf.train.Checkpoint`` and saves one after every step
(global step N in all), as a script that survives restarts does.

The chief (or, under Horovod, every rank) writes OUT (``OUT.rankR.npz`` under
Horovod): every logged value and every variable (model, optimizer, tracker), the
devices that ran work in the step's placed graphs and the plan's devices.
Every process prints its pid first.
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402
from tf2_script import planned_devices, working_devices  # noqa: E402

ROWS = np.random.RandomState(0).randn(32, 4).astype(np.float32)
LABELS = (np.random.RandomState(1).rand(32) * 3).astype(np.int64)
BATCH = 8


_TFPAR = []  # [True] once wh.init() ran: scopes are no-ops in the plain run


def stage(on: bool):
    return wh.replicate(1) if on and _TFPAR else _Null()


def split(on: bool):
    return wh.split() if on and _TFPAR else _Null()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def model(stages: bool = False, split_head: bool = False) -> tf.keras.Model:
    """Two Dense layers: in two pipeline stages (``stages``), or the head in
    ``wh.split()`` (``split_head``: 4 classes, a shard per device)."""
    inputs = tf.keras.Input((4,))
    with stage(stages):
        hidden = tf.keras.layers.Dense(8, "relu")(inputs)
    with stage(stages), split(split_head):
        return tf.keras.Model(inputs, tf.keras.layers.Dense(4 if split_head else 3)(hidden))


def train_step(net, optimizer, tracker=None):
    """A ``tf.function`` step of ``net`` (cross-entropy, ``optimizer``):
    returns the loss, and ``tracker``'s mean of the losses if given."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, net(x))
        grads = tape.gradient(loss, net.trainable_variables)
        optimizer.apply_gradients(zip(grads, net.trainable_variables))
        if tracker is None:
            return loss
        tracker.update_state(loss)
        return loss, tracker.result()
    return step


def loop(args, stages: bool = False, split_head: bool = False):
    net, optimizer = model(stages, split_head), tf.keras.optimizers.Adam(0.01)
    tracker = tf.keras.metrics.Mean()
    step = train_step(net, optimizer, tracker)

    checkpoint = tf.train.Checkpoint(model=net, optimizer=optimizer, tracker=tracker,
                                     step=tf.Variable(0, dtype=tf.int64))
    manager = None
    if args.checkpoint_dir:
        manager = tf.train.CheckpointManager(checkpoint, args.checkpoint_dir, max_to_keep=2)
        checkpoint.restore(manager.latest_checkpoint)
    logged = []
    while int(checkpoint.step) < args.steps:
        i = int(checkpoint.step) % (len(ROWS) // BATCH)
        loss, mean = step(ROWS[i * BATCH:(i + 1) * BATCH], LABELS[i * BATCH:(i + 1) * BATCH])
        checkpoint.step.assign_add(1)
        logged.append([float(loss), float(mean)])
        print(f"step {int(checkpoint.step)} loss {float(loss):.6f}", flush=True)
        if manager is not None:
            manager.save()
        time.sleep(args.sleep)
    if split_head:  # its weights whole (its variables and slots are shards)
        return logged, net.weights + tracker.variables
    return logged, net.variables + optimizer.variables() + tracker.variables


def shards(args):
    """``loop`` over a tf.data dataset of 4-row batches iterated in Python; with
    ``io.shard_dataset`` each Horovod process reads alternate batches, the two
    together one 8-row batch; plainly, 8-row batches."""
    net, optimizer = model(), tf.keras.optimizers.Adam(0.01)
    step = train_step(net, optimizer)
    batch = BATCH if args.plain else BATCH // 2
    dataset = tf.data.Dataset.from_tensor_slices((ROWS, LABELS)).batch(batch)
    return [float(step(x, y)) for x, y in dataset], net.variables + optimizer.variables()


def fit(args):
    net = model()
    net.compile(tf.keras.optimizers.Adam(0.01),
                tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
    callbacks = [tf.keras.callbacks.ModelCheckpoint(os.path.join(args.out + ".d", "ckpt"),
                                                    save_weights_only=True)]
    if args.horovod and _rank():
        callbacks = []  # Horovod's convention: rank 0 writes the checkpoints
    history = net.fit(ROWS, LABELS, batch_size=BATCH, epochs=2, verbose=0, shuffle=False,
                      validation_data=(ROWS[:12], LABELS[:12]), callbacks=callbacks).history
    logged = [history[k] for k in ("loss", "accuracy", "val_loss", "val_accuracy")]
    logged.append(net.evaluate(ROWS, LABELS, batch_size=BATCH, verbose=0))
    return logged, net.variables + net.optimizer.variables()


def _rank() -> int:
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    return hvd.rank()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--mode", default="loop",
                        choices=["loop", "fit", "pipeline", "split", "shards"])
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--horovod", action="store_true")
    parser.add_argument("--checkpoint-dir")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--seed-per-rank", action="store_true",
                        help="each Horovod rank seeds its initializers differently")
    args = parser.parse_args()
    print("pid", os.getpid(), flush=True)
    if not args.plain:
        config = {"communication.timeout_s": 30.0}
        if args.horovod:
            config.update({"communication.backend": "horovod", "cluster.num_devices": 2})
        if args.mode == "pipeline":
            config["pipeline.num_micro_batch"] = 2
        if args.mode == "shards":
            config["io.shard_dataset"] = True
        wh.init(config)
        _TFPAR.append(True)
    tf.keras.utils.set_random_seed(3 + (_rank() if args.seed_per_rank else 0))
    context.context().enable_run_metadata()
    logged, variables = (fit(args) if args.mode == "fit" else shards(args) if args.mode == "shards"
                         else loop(args, args.mode == "pipeline", args.mode == "split"))
    devices = working_devices(context.context().export_run_metadata())
    if args.horovod:
        args.out = f"{args.out}.rank{_rank()}.npz"
    np.savez(args.out, logged=np.array([x for v in logged for x in np.ravel(v)]),
             devices=np.array(devices, dtype=object),
             planned=np.array([] if args.plain else planned_devices(), dtype=object),
             **{f"v{i}": v.numpy() for i, v in enumerate(variables)})
    print("done", flush=True)


if __name__ == "__main__":
    main()
