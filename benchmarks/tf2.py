"""tfpar on TF2 eager scripts: step time vs MirroredStrategy and vs plain TF2.

One model, an MLP (``--features`` inputs, 4 ReLU Dense layers ``--width`` wide,
10 classes, sparse softmax cross-entropy from logits, ``tf.keras.optimizers.Adam``;
weights seeded with ``tf.keras.utils.set_random_seed``), trained on the same
global batch ``--batch`` every step (numpy arrays converted once), in each
configuration:

  * ``plain_loop``: plain TF2, 1 CPU, a custom loop: a ``@tf.function`` step
    (``tf.GradientTape``, ``apply_gradients``) that returns the loss;
  * ``tfpar1_loop``: the same after ``wh.init({"cluster.num_devices": 1})``;
  * ``tfpar4_loop``: the same after ``wh.init({"cluster.num_devices": 4})``
    (tfpar makes 4 logical CPUs and splits the global batch over them);
  * ``mirrored4_loop``: ``tf.distribute.MirroredStrategy`` over 4 logical CPUs
    (its default cross-device ops), model and optimizer made under its scope, a
    ``@tf.function`` step calling ``strategy.run`` on the batch already split
    into per-replica values (``experimental_distribute_values_from_function``,
    once), each replica's loss ``tf.nn.compute_average_loss`` over the global
    batch, summed with ``strategy.reduce``: the loss plain TF2 computes;
  * ``plain_fit``, ``tfpar4_fit``, ``mirrored4_fit``: ``model.compile(Adam, loss)``
    and one ``model.fit(dataset, epochs=1, steps_per_epoch=S, verbose=0)``
    (Keras' own train_function; model and compile under the strategy's scope for
    mirrored4_fit), the dataset the global batch (``from_tensor_slices``,
    ``batch`` with Keras' default ``drop_remainder=False``, ``cache``) repeated.

Every configuration runs in its own fresh process (TensorFlow makes logical CPU
devices only before its first op, so each worker configures its devices first),
given ``--timeout`` seconds; one that fails or times out reports n/a and misses
its targets. Each measures:

  * start-up s: from the model, optimizer and data being made to the end of the
    first step (tracing, tfpar's rewrite, TensorFlow's function instantiation);
  * step ms: the median of ``--steps`` steps after the first step and 3 warm-up
    steps; a loop step is one call of the step function including its loss
    fetch, a fit step the time from Keras' ``on_train_batch_begin`` to
    ``on_train_batch_end`` (its logs already fetched);
  * devices: how many devices ran work in the placed graphs of the functions
    the first step instantiated (TensorFlow's partition graphs, collected during
    the first step only: part of its start-up time, every configuration alike);
  * the losses of steps 0 and 1 (fit: as logged, the running mean), which must
    match plain TF2's of the same kind (loop or fit) to rtol 1e-4. Marked ``*``:
    MirroredStrategy adds its replicas' gradients in its own order, so it may
    differ by float rounding; it is held to the same rtol.

The ratios come from one run of ``--rounds`` rounds, each running every
configuration once (in the order above, every other round in reverse, so the two
sides of a ratio alternate: the machine's load changes over a run); a
configuration's start-up and step time are the medians of its rounds' (its
losses and devices those of its first round; one failed round fails it).
Targets (``TARGETS``, step time at most): tfpar4_loop / mirrored4_loop 1.0,
tfpar4_fit / mirrored4_fit 1.0, tfpar1_loop / plain_loop 1.05; mirrored4 / plain
is shown for information. ``--check`` prints PASS/FAIL per target and exits 1
when one is missed or a configuration's losses differ. Progress goes to stderr.

    python benchmarks/tf2.py [--quick] [--check] [--json]

(2 cores, today: ``--quick`` about 35 s; the full run about 3 minutes, 5 while
other work runs.)
"""
import contextlib
import json
import math
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, ratio, report, run_configuration, worker_option  # noqa: E402  (same directory)
from overhead import CLASSES, make_data  # noqa: E402

NUM_CPUS, LAYERS, WARMUP, RTOL, LEARNING_RATE = 4, 4, 3, 1e-4, 1e-3
# name: (loop or fit, plain / tfpar / mirrored, devices)
CONFIGS = {
    "plain_loop": ("loop", "plain", 1),
    "tfpar1_loop": ("loop", "tfpar", 1),
    f"tfpar{NUM_CPUS}_loop": ("loop", "tfpar", NUM_CPUS),
    f"mirrored{NUM_CPUS}_loop": ("loop", "mirrored", NUM_CPUS),
    "plain_fit": ("fit", "plain", 1),
    f"tfpar{NUM_CPUS}_fit": ("fit", "tfpar", NUM_CPUS),
    f"mirrored{NUM_CPUS}_fit": ("fit", "mirrored", NUM_CPUS),
}
# Each configuration's step time is shown as a ratio to this one's.
BASELINE = {"tfpar1_loop": "plain_loop",
            f"tfpar{NUM_CPUS}_loop": f"mirrored{NUM_CPUS}_loop",
            f"mirrored{NUM_CPUS}_loop": "plain_loop",
            f"tfpar{NUM_CPUS}_fit": f"mirrored{NUM_CPUS}_fit",
            f"mirrored{NUM_CPUS}_fit": "plain_fit"}
# (configuration, baseline): step-time ratio at most.
TARGETS = {(f"tfpar{NUM_CPUS}_loop", f"mirrored{NUM_CPUS}_loop"): 1.0,
           (f"tfpar{NUM_CPUS}_fit", f"mirrored{NUM_CPUS}_fit"): 1.0,
           ("tfpar1_loop", "plain_loop"): 1.05}
SIZES = {"width": (1024, 128, "MLP width"), "features": (1024, 128, "input features"),
         "batch": (256, 64, f"global batch (a multiple of {NUM_CPUS})"),
         "steps": (50, 30, "timed steps per configuration and round"),
         "rounds": (3, 1, "rounds of every configuration (alternating order)"),
         "timeout": (900, 300, "seconds a configuration may take before it is abandoned")}
COLUMNS = [("config", "config", ""), ("start-up s", "startup_s", ".2f"),
           ("step ms", "step_ms", ".1f"), ("vs", "baseline", ""), ("ratio", "ratio", ".3f"),
           ("devices", "devices", "d"), ("same loss", "same_loss_cell", "")]
# Ops of a placed graph that only move data or mark a function's boundary.
PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp",
            "Identity"}


def make_model(args):
    return tf.keras.Sequential(
        [tf.keras.Input((args.features,))]
        + [tf.keras.layers.Dense(args.width, activation="relu") for _ in range(LAYERS)]
        + [tf.keras.layers.Dense(CLASSES)])


def loss_object(reduction="sum_over_batch_size"):
    """The loss (``reduction`` by the name Keras 2 and Keras 3 both take)."""
    return tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=reduction)


def loop_step(model, optimizer, strategy, global_batch):
    """The @tf.function training step of a custom loop: step(x, y) -> loss; under
    ``strategy`` each replica's loss is its share of the global-batch mean."""
    if strategy is None:
        loss_fn = loss_object()

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_fn(y, model(x, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return loss
        return step

    per_example_fn = loss_object("none")

    def replica_step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(per_example_fn(y, model(x, training=True)),
                                              global_batch_size=global_batch)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def step(x, y):
        return strategy.reduce(tf.distribute.ReduceOp.SUM,
                               strategy.run(replica_step, args=(x, y)), axis=None)
    return step


def run_loop(model, optimizer, strategy, x, y, args):
    """(start-up s, step times, losses, devices of the first step) of the custom loop."""
    if strategy is not None:  # the global batch split into per-replica values, once
        def replica_rows(ctx):
            n = args.batch // ctx.num_replicas_in_sync
            lo = ctx.replica_id_in_sync_group * n
            return x[lo:lo + n], y[lo:lo + n]
        x, y = strategy.experimental_distribute_values_from_function(replica_rows)
    step = loop_step(model, optimizer, strategy, args.batch)
    losses, times = [], []
    stop_collecting = collect_devices()
    start = time.perf_counter()
    for i in range(1 + WARMUP + args.steps):
        begin = time.perf_counter()
        losses.append(float(step(x, y)))
        end = time.perf_counter()
        if i == 0:
            startup_s, used = end - start, stop_collecting()
        elif i > WARMUP:
            times.append(end - begin)
    return startup_s, times, losses, used


class StepTimer(tf.keras.callbacks.Callback):
    """Each fit step's end time, duration (batch begin to batch end) and logged loss;
    ``first_end()``'s value at the end of the first step as ``first``."""

    def __init__(self, first_end):
        super().__init__()
        self.begin, self.ends, self.times, self.losses = None, [], [], []
        self.first_end, self.first = first_end, None

    def on_train_batch_begin(self, batch, logs=None):
        self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))  # already fetched by Keras; be sure
        end = time.perf_counter()
        self.ends.append(end)
        self.times.append(end - self.begin)
        if len(self.ends) == 1:
            self.first = self.first_end()


def run_fit(model, optimizer, strategy, x, y, args):
    """(start-up s, step times, losses, devices of the first step) of model.fit."""
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model.compile(optimizer, loss_object())
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).cache().repeat()
    timer = StepTimer(collect_devices())
    start = time.perf_counter()
    model.fit(dataset, epochs=1, steps_per_epoch=1 + WARMUP + args.steps, verbose=0,
              callbacks=[timer])
    return timer.ends[0] - start, timer.times[1 + WARMUP:], timer.losses, timer.first


def collect_devices():
    """Start collecting the placed graphs of the functions TensorFlow instantiates (it
    collects them when it instantiates a function: start before the first step); returns
    stop(), which stops and returns the devices that ran work in them."""
    ctx = context.context()
    ctx.enable_run_metadata()
    ctx.enable_graph_collection()

    def stop():
        metadata = ctx.export_run_metadata()
        ctx.disable_graph_collection()
        ctx.disable_run_metadata()
        return sorted({node.device for function in metadata.function_graphs
                       for graph in function.partition_graphs for node in graph.node
                       if node.op not in PLUMBING and node.device})
    return stop


def run_worker(name, args):
    """Train configuration ``name`` in this process; its measurements as a dict."""
    kind, backend, devices = CONFIGS[name]
    # First of all, before any TensorFlow op: the devices.
    if backend == "tfpar":
        wh.init({"cluster.num_devices": devices})
    elif devices > 1:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * devices)
    tf.keras.utils.set_random_seed(0)
    data = make_data(args.batch, args.features)
    x, y = tf.constant(data[0]), tf.constant(data[1])
    strategy = (tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)])
                if backend == "mirrored" else None)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model, optimizer = make_model(args), tf.keras.optimizers.Adam(LEARNING_RATE)
    startup_s, times, losses, used = (run_loop if kind == "loop" else run_fit)(
        model, optimizer, strategy, x, y, args)
    if backend == "tfpar":
        wh.reset()
    return {"startup_s": startup_s, "step_s": statistics.median(times), "losses": losses[:2],
            "devices": len(used), "device_names": used}


def measure(name, args):
    """Run configuration ``name`` in a fresh process; its measurements (None on failure)."""
    return run_configuration(__file__, "tf2", name, args, SIZES,
                             ("startup_s", "step_s", "losses", "devices", "device_names"))


def measure_rounds(args):
    """Every configuration's measurements over ``--rounds`` rounds (the order reversed in
    every other round): medians of start-up and step time, the first round's losses and
    devices; a configuration that fails in any round fails (its error kept)."""
    runs = {name: [] for name in CONFIGS}
    for i in range(args.rounds):
        if args.rounds > 1:
            print(f"tf2: round {i + 1} of {args.rounds}", file=sys.stderr, flush=True)
        for name in list(CONFIGS)[::-1 if i % 2 else 1]:
            if not runs[name] or "error" not in runs[name][-1]:
                runs[name].append(measure(name, args))
    results = {}
    for name, done in runs.items():
        failed = [r for r in done if "error" in r]
        results[name] = failed[0] if failed else {
            **done[0], "startup_s": statistics.median(r["startup_s"] for r in done),
            "step_s": statistics.median(r["step_s"] for r in done),
            "step_s_rounds": [r["step_s"] for r in done]}
    return results


def plain_of(name):
    return f"plain_{CONFIGS[name][0]}"


def same_loss(r, plain) -> bool:
    """Whether ``r`` has the step-0 and step-1 losses of ``plain`` (rtol ``RTOL``)."""
    return (r["losses"] is not None and plain["losses"] is not None
            and len(r["losses"]) == len(plain["losses"])
            and all(math.isclose(a, b, rel_tol=RTOL) for a, b in zip(r["losses"],
                                                                    plain["losses"])))


def rows_of(results):
    """Table rows: the measurements, the step-time ratio to the baseline, the loss check."""
    rows = []
    for name, r in results.items():
        base = BASELINE.get(name)
        same = same_loss(r, results[plain_of(name)])
        rows.append({"config": name, **r, "step_ms": r["step_s"] and 1e3 * r["step_s"],
                     "baseline": base or "-",
                     "ratio": ratio(r["step_s"], results[base]["step_s"]) if base else None,
                     "same_loss": same,
                     "same_loss_cell": cell(same, "") + ("*" if CONFIGS[name][1] == "mirrored"
                                                          else "")})
    return rows


def targets(results):
    """(name, measured value, limit) per target of ``TARGETS``."""
    return [(f"{a} / {b} step", ratio(results[a]["step_s"], results[b]["step_s"]), limit)
            for (a, b), limit in TARGETS.items()]


def print_table(rows, found, args):
    print(f"tfpar TF2 (MLP {LAYERS}x{args.width}, {args.features} features, {CLASSES} classes,"
          f" Adam; global batch {args.batch}; step: median of {args.steps} steps after"
          f" {1 + WARMUP}; medians of {args.rounds} round{'s' * (args.rounds > 1)})")
    widths = [max(len(title), 8) for title, _, _ in COLUMNS]
    widths[0] = max(len(r["config"]) for r in rows)
    widths[3] = max(len(r["baseline"]) for r in rows)
    print("  ".join(f"{title:>{w}}" for (title, _, _), w in zip(COLUMNS, widths)))
    for r in rows:
        shown = {**r, "ratio": "-" if r["baseline"] == "-" else r["ratio"],
                 "same_loss_cell": "ref" if r["config"] == plain_of(r["config"])
                 else r["same_loss_cell"]}
        print("  ".join(f"{text(shown[key], fmt):>{w}}"
                        for (_, key, fmt), w in zip(COLUMNS, widths)))
    print(f"same loss: steps 0 and 1 vs the plain row of its kind (ref), rtol {RTOL:g}; "
          "* MirroredStrategy (may differ by float summation order)")
    for name, value, limit in found:
        print(f"{name:<34} {cell(value, '.3f'):>7}  <= {limit:<4}  "
              f"{'met' if meets(value, limit) else 'NOT MET'}")


def text(value, fmt) -> str:
    """A table cell: a string as it is, anything else as ``cell`` shows it."""
    return value if isinstance(value, str) else cell(value, fmt)


def parse_args(argv):
    p, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv,
                          "exit 1 when a target is missed or a loss differs from plain TF2's",
                          "tiny model (smoke test, a few minutes)",
                          parents=[worker_option(CONFIGS)])
    if args.batch % NUM_CPUS or min(args.steps, args.rounds, args.width, args.features) < 1:
        p.error(f"--batch must be a multiple of {NUM_CPUS}; --steps, --rounds, --width, "
                "--features >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args)))
        return 0
    results = measure_rounds(args)
    return report(rows_of(results), targets(results), args, SIZES, print_table)


if __name__ == "__main__":
    sys.exit(main())
