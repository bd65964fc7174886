"""A TF2 (eager) training script, run by ``test_tf2.py`` in a fresh process:
TensorFlow makes logical CPU devices only before it first runs an op, and the
test suite itself runs in graph mode.

    python tf2_script.py SCENARIO DEVICES [--late-init] [--dir DIR] [--restore DIR]
                         [--resume DIR]
    python tf2_script.py --batch DEVICES [--plain FILE] SCENARIO [SCENARIO ...]

DEVICES 0 runs the script plainly; otherwise ``wh.init({"cluster.num_devices":
DEVICES, ...})`` comes first (``--late-init``: after the script ran its first
op). ``--dir``: where checkpoints and logs go (custom loops save a
``tf.train.Checkpoint`` of the model and optimizer there at the end).
``--batch``: each scenario plainly and with tfpar in one process (``batch``;
``--plain``: a JSON file of plain runs by scenario, not run again).
Prints one JSON line: the losses, the final weights, and the devices that ran
work in the training step's placed graphs (TensorFlow's partition graphs of
every function run, collected from the first step on) and the plan's predicted
vs measured table (``measured``).

Scenarios: ``tape_adam`` / ``tape_legacy_adam`` / ``gradients_adam`` (a
``tf.function`` step with tf.GradientTape or tf.gradients and a Keras
optimizer, over a dataset iterated in Python, two steps per batch, the last
batch smaller), ``pipeline`` (``tape_adam`` with its two layers in two
``wh.replicate(1)`` scopes and 4 micro-batches; ``pipeline_interleaved``: the
two stages as virtual stages of one device group), ``fit`` (compile, fit with
validation data and the ModelCheckpoint, EarlyStopping and TensorBoard (where
installed) callbacks, evaluate, predict); ``split`` / ``split_gradients`` (a custom loop
with tf.GradientTape / tf.gradients whose 8-class head and cross-entropy are
called in ``wh.split()``), ``split_fit`` (``fit`` on a subclassed model calling
its head in ``wh.split()``; ``split_mixed_fit`` on a V100 and a P100, shards
by speed), ``pipeline_fit`` (``fit`` on a subclassed model
calling its two layers in two ``wh.replicate(1)`` stages, 4 micro-batches),
``auto`` (``tape_adam`` with ``auto.auto_parallel``), ``next_in_step``
(``tape_adam`` reading each batch with ``next(iterator)`` inside the step).
Models built in eager code inside scopes: ``functional_pipeline_fit`` /
``functional_split_fit`` (``fit`` on a functional model calling its layers in
two ``wh.replicate(1)`` scopes, 4 micro-batches / its head in ``wh.split()``),
``made_in_stages`` (``tape_adam`` on a Sequential model of layers made in two
``wh.replicate(1)`` scopes, 4 micro-batches). ``made_in_first_trace``
(``tape_adam`` whose step makes a step counter in its first trace, as Keras 3's
optimizers make their variables: tfpar's relaxed retrace must keep that trace
alive, or TensorFlow empties its graph and the counter's initializer with it).

``--restore DIR``: after training, the model of DIR's latest checkpoint is
restored and its weights printed too. ``--resume DIR``: a custom loop first
restores the model and optimizer of DIR's latest checkpoint (before its first
step, so the optimizer's slots are restored when it makes them), and checks at
the end that every value of the checkpoint was restored.
"""
import contextlib
import importlib.util
import json
import logging
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402

# Ops that only move data or mark a function's boundary.
_PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp",
             "Identity"}


def model(outputs: int = 3):
    return tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                tf.keras.layers.Dense(outputs)])


CLASSES = 8  # of the split heads: a shard per device has some


_TFPAR = []  # [True] once wh.init() ran
_OPTIMIZERS = []  # the custom loop's
_RESUME = []  # [directory] of --resume


def split_scope():
    """``wh.split()`` under tfpar; nothing in the plain run."""
    return wh.split() if _TFPAR else contextlib.nullcontext()


def custom_loop(tape: bool, optimizer, directory: str, stages: bool = False,
                split: bool = False, in_function: bool = False, build=model,
                first_trace_variable: bool = False):
    rng = np.random.RandomState(0)
    x_all = rng.randn(40, 4).astype(np.float32)
    y_all = ((rng.rand(40) * CLASSES).astype(np.int64) if split
             else rng.randn(40, 3).astype(np.float32))
    net, opt = build(CLASSES if split else 3), optimizer(0.01)
    _OPTIMIZERS.append(opt)

    def forward(x):
        if not stages:
            return net(x)
        with wh.replicate(1):
            h = net.layers[0](x)
        with wh.replicate(1):
            return net.layers[1](h)

    def loss_of(x, y):
        if not split:
            return tf.reduce_mean(tf.square(forward(x) - y))
        h = net.layers[0](x)
        with split_scope():  # class-split logits and cross-entropy
            logits = net.layers[1](h)
            return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))

    counted = []  # a step counter made in the step's first trace, as Keras 3 optimizers do

    def step(x, y):  # its tf.function is called 'step' too
        if first_trace_variable and not counted:
            counted.append(tf.Variable(tf.constant(0, tf.int64), name="steps_taken"))
        for counter in counted:
            counter.assign_add(1)
        if tape:
            with tf.GradientTape() as t:
                loss = loss_of(x, y)
            grads = t.gradient(loss, net.trainable_variables)
        else:
            loss = loss_of(x, y)
            grads = tf.gradients(loss, net.trainable_variables)
        opt.apply_gradients(zip(grads, net.trainable_variables))
        return loss

    step_function = tf.function(step)
    step_reading = tf.function(lambda iterator: step(*next(iterator)))

    ds = tf.data.Dataset.from_tensor_slices((x_all, y_all)).batch(16)
    checkpoint = tf.train.Checkpoint(model=net, optimizer=opt)
    resumed = [checkpoint.restore(tf.train.latest_checkpoint(d)) for d in _RESUME]
    if in_function:
        iterator = iter(ds)
        losses = [float(step_reading(iterator)) for _ in range(3)]
    else:
        losses = [float(step_function(x, y)) for x, y in ds for _ in range(2)]
    losses += [float(counter.numpy()) for counter in counted]
    for status in resumed:
        status.assert_consumed()
    tf.train.CheckpointManager(checkpoint, directory, max_to_keep=1).save()
    return losses, net


def stage_scope():
    """``wh.replicate(1)`` (a pipeline stage) under tfpar; nothing in the plain run."""
    return wh.replicate(1) if _TFPAR else contextlib.nullcontext()


class Scoped(tf.keras.Model):
    """A subclassed model calling its head in a split scope (``split``), or
    its two layers in two pipeline stages."""

    def __init__(self, split: bool):
        super().__init__()
        self.split = split
        self.body = tf.keras.layers.Dense(8, activation="relu")
        self.head = tf.keras.layers.Dense(CLASSES if split else 3)

    def call(self, x):
        with contextlib.nullcontext() if self.split else stage_scope():
            h = self.body(x)
        with split_scope() if self.split else stage_scope():
            return self.head(h)


def made_in_stages(outputs: int):
    """A Sequential model of two layers made in two ``wh.replicate(1)`` scopes
    in eager code."""
    with stage_scope():
        body = tf.keras.layers.Dense(8, activation="relu")
    with stage_scope():
        head = tf.keras.layers.Dense(outputs)
    return tf.keras.Sequential([tf.keras.Input((4,)), body, head])


def functional(split: bool):
    """A functional model built in eager code calling its head in
    ``wh.split()`` (``split``), or its two layers in two pipeline stages."""
    inputs = tf.keras.Input((4,))
    with contextlib.nullcontext() if split else stage_scope():
        hidden = tf.keras.layers.Dense(8, activation="relu")(inputs)
    with split_scope() if split else stage_scope():
        return tf.keras.Model(inputs, tf.keras.layers.Dense(CLASSES if split else 3)(hidden))


def tensorboard(logs: str) -> list:
    """The TensorBoard callback, where TensorBoard is installed (TensorFlow 2.21 no
    longer brings it; the callback is left out there, and stderr says so)."""
    if importlib.util.find_spec("tensorboard") is None:
        print(f"tf2_script: the TensorBoard callback is left out: TensorFlow {tf.__version__} "
              "has no TensorBoard installed (pip install tensorboard)", file=sys.stderr)
        return []
    return [tf.keras.callbacks.TensorBoard(logs)]


def keras_fit(directory: str, split: bool = False, stages: bool = False, build=None):
    rng = np.random.RandomState(0)
    x_all = rng.randn(40, 4).astype(np.float32)
    y_all = (rng.rand(40) * (CLASSES if split else 3)).astype(np.int64)
    net = build(split) if build else Scoped(split) if split or stages else model()
    net.compile(tf.keras.optimizers.Adam(0.01),
                tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"])
    callbacks = [tf.keras.callbacks.ModelCheckpoint(os.path.join(directory, "weights.h5"),
                                                    save_weights_only=True),
                 tf.keras.callbacks.EarlyStopping("loss", patience=2)]
    callbacks += tensorboard(os.path.join(directory, "logs"))
    history = net.fit(x_all, y_all, batch_size=16, epochs=3, verbose=0, callbacks=callbacks,
                      validation_data=(x_all[:8], y_all[:8])).history
    evaluated = net.evaluate(x_all, y_all, verbose=0)
    predicted = net.predict(x_all[:5], verbose=0)
    losses = (history["loss"] + history["accuracy"] + history["val_loss"]
              + history["val_accuracy"] + list(evaluated) + predicted.ravel().tolist())
    return losses, net


SCENARIOS = {
    "tape_adam": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d),
    "tape_legacy_adam": lambda d: custom_loop(True, tf.keras.optimizers.legacy.Adam, d),
    "gradients_adam": lambda d: custom_loop(False, tf.keras.optimizers.Adam, d),
    "pipeline": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d, stages=True),
    "pipeline_interleaved": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d,
                                                  stages=True),
    "fit": keras_fit,
    "split": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d, split=True),
    "split_gradients": lambda d: custom_loop(False, tf.keras.optimizers.Adam, d, split=True),
    "split_fit": lambda d: keras_fit(d, split=True),
    "pipeline_fit": lambda d: keras_fit(d, stages=True),
    "functional_pipeline_fit": lambda d: keras_fit(d, build=functional),
    "functional_split_fit": lambda d: keras_fit(d, split=True, build=functional),
    "split_mixed_fit": lambda d: keras_fit(d, split=True),
    "made_in_stages": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d,
                                            build=made_in_stages),
    "auto": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d),
    "next_in_step": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d, in_function=True),
    "made_in_first_trace": lambda d: custom_loop(True, tf.keras.optimizers.Adam, d,
                                                 first_trace_variable=True),
}
# tfpar settings besides the device count.
CONFIGS = {"pipeline": {"pipeline.num_micro_batch": 4},
           "pipeline_interleaved": {"pipeline.num_micro_batch": 4, "pipeline.virtual_stages": 2},
           "pipeline_fit": {"pipeline.num_micro_batch": 4},
           "functional_pipeline_fit": {"pipeline.num_micro_batch": 4},
           "made_in_stages": {"pipeline.num_micro_batch": 4}, "auto": {"auto.auto_parallel": True},
           "split_mixed_fit": {"cluster.hardware": ["V100-32GB", "P100-16GB"]}}


def working_devices(metadata) -> list:
    return sorted({node.device for function in metadata.function_graphs
                   for graph in function.partition_graphs for node in graph.node
                   if node.op not in _PLUMBING})


def main(scenario: str, devices: int, late_init: bool, directory: str,
         restore_from: str = "") -> dict:
    if not logging.getLogger("tfpar").handlers:
        logging.getLogger("tfpar").addHandler(logging.StreamHandler(sys.stderr))
    if late_init:
        tf.constant(0.0) + 1.0  # TensorFlow makes its devices here
    if devices:
        wh.init({"cluster.num_devices": devices, **CONFIGS.get(scenario, {})})
        _TFPAR.append(True)
    tf.keras.utils.set_random_seed(3)
    context.context().enable_run_metadata()
    context.context().enable_graph_collection()
    losses, net = SCENARIOS[scenario](directory)
    restored = restore(net, restore_from) if restore_from else []
    return {"losses": losses, "weights": whole_weights(net), "restored": restored,
            "slot_devices": slot_devices(_OPTIMIZERS[0] if _OPTIMIZERS else net.optimizer),
            "shard_devices": [[shard.device for shard in layer.kernel] for layer in dense(net)
                              if not isinstance(layer.kernel, tf.Variable)],
            "shard_widths": [[int(shard.shape[-1]) for shard in layer.kernel]
                             for layer in dense(net) if not isinstance(layer.kernel, tf.Variable)],
            "devices": working_devices(context.context().export_run_metadata()),
            "planned": planned_devices() if devices else [],
            "strategies": strategies() if devices else [],
            "notes": notes() if devices else [],
            "measured": measured() if devices and not late_init else {}}


def whole_weights(net) -> list:
    """Each dense layer's kernel and bias, whole (a split one's shards joined)."""
    return [np.asarray(getattr(layer, name).numpy()).tolist()
            for layer in dense(net) for name in ("kernel", "bias")]


def dense(net) -> list:
    return [layer for layer in net.layers if hasattr(layer, "kernel")]


def slot_devices(optimizer) -> list:
    """Per shard variable (``.../part_i``) the optimizer has slots of, the
    devices of those slots."""
    by_part = {}
    for v in optimizer.variables():  # a method of legacy optimizers; callable in new ones
        if "/part_" in v.name:
            by_part.setdefault(v.name.rsplit("/part_", 1)[1], set()).add(v.device)
    return [sorted(devices) for _, devices in sorted(by_part.items())]


def restore(net, directory: str) -> list:
    """``net``'s weights after restoring the model of the checkpoint in ``directory``."""
    status = tf.train.Checkpoint(model=net).restore(tf.train.latest_checkpoint(directory))
    status.assert_existing_objects_matched().expect_partial()
    return whole_weights(net)


def strategies() -> list:
    """(strategy, device count) of each TaskGraph of ``wh.current_plan()`` (none
    when no step was traced)."""
    try:
        plan = wh.current_plan()
    except wh.PlanError:
        return []
    return [[tg.strategy, len(tg.devices)] for tg in plan.task_graphs]


def notes() -> list:
    """``wh.current_plan().notes`` (none when no step was traced)."""
    try:
        return list(wh.current_plan().notes)
    except wh.PlanError:
        return []


def measured() -> dict:
    """``wh.current_plan().measured`` (empty when no step was rewritten)."""
    try:
        return wh.current_plan().measured
    except wh.PlanError:
        return {}


def planned_devices() -> list:
    """Devices of ``wh.current_plan()`` (none when no step was traced)."""
    try:
        plan = wh.current_plan()
    except wh.PlanError:
        return []
    return sorted({d for tg in plan.task_graphs for d in tg.devices})


def batch(devices: int, scenarios, plain_runs: dict) -> None:
    """Each of ``scenarios`` trained plainly (no tfpar; unless ``plain_runs``
    has its run already) and with tfpar on ``devices`` logical CPUs, in this
    one process (``wh.reset()`` between): one JSON line per scenario,
    {"scenario", "plain", "tfpar"}. TensorFlow makes its logical devices at
    the first op, so they are made first."""
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    for scenario in scenarios:
        alike = "tape_adam" if scenario in ("pipeline", "pipeline_interleaved", "auto") else scenario
        if alike not in plain_runs:
            plain_runs[alike] = _fresh(lambda: main(alike, 0, False, tempfile.mkdtemp()))
        context.context().export_run_metadata()  # forget the plain runs' graphs
        got = _fresh(lambda: main(scenario, devices, False, tempfile.mkdtemp()))
        wh.reset()
        print(json.dumps({"scenario": scenario, "plain": plain_runs[alike], "tfpar": got}),
              flush=True)


def _fresh(run):
    """``run()`` with the script's own state of a run reset before and after."""
    for state in (_TFPAR, _OPTIMIZERS):
        state.clear()
    tf.keras.backend.clear_session()
    try:
        return run()
    finally:
        for state in (_TFPAR, _OPTIMIZERS):
            state.clear()


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[0] == "--batch":
        known, scenarios = {}, args[2:]
        if scenarios[0] == "--plain":
            with open(scenarios[1], encoding="utf-8") as f:
                known, scenarios = json.load(f), scenarios[2:]
        batch(int(args[1]), scenarios, known)
        sys.exit(0)
    out = args[args.index("--dir") + 1] if "--dir" in args else tempfile.mkdtemp()
    source = args[args.index("--restore") + 1] if "--restore" in args else ""
    _RESUME.extend(args[args.index("--resume") + 1:][:1] if "--resume" in args else [])
    print(json.dumps(main(args[0], int(args[1]), "--late-init" in args, out, source)))
