"""What synchronized batch norm costs: keras.applications' MobileNetV2 (alpha
0.35, 32x32 images, 4 classes, SGD with momentum) trained by TF2 ``fit`` on
``--devices`` logical CPUs under tfpar, its 52 BatchNorm layers averaged
(``averaged``: each replica's statistics, MirroredStrategy's rule) or
synchronized (``synchronized``: ``batch_norm.sync``, the whole batch's
statistics), each configuration in a fresh process, ``--rounds`` rounds in
alternating order. Measured: start-up (from ``fit``'s start to the end of
the first step: tracing, tfpar's rewrite, TensorFlow's function
instantiation) and the median step after ``WARMUP`` steps, as Keras'
``on_train_batch_begin`` / ``_end`` see it.

Targets (``--check``): none judged; the ratios synchronized / averaged are
informational (what the opt-in costs).

    python benchmarks/batch_norm.py [--quick] [--check] [--json]
"""
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, parse_sizes, ratio, report, run_configuration, worker_option  # noqa: E402  (same directory)

CONFIGS = ("averaged", "synchronized")
WARMUP = 3
SIZES = {"devices": (2, 2, "logical CPU devices"), "batch": (64, 32, "global batch"),
         "steps": (20, 8, "timed steps"), "rounds": (2, 1, "rounds (alternating order)"),
         "timeout": (900, 600, "seconds a configuration may take")}


def run_worker(name, args):
    """Train configuration ``name`` in this process; its measurements."""
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpar as wh  # pylint: disable=import-outside-toplevel
    wh.init({"cluster.num_devices": args.devices, "batch_norm.sync": name == "synchronized"})
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.applications.MobileNetV2((32, 32, 3), alpha=0.35, weights=None, classes=4)
    model.compile(tf.keras.optimizers.SGD(0.05, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy())
    rng = np.random.RandomState(0)
    rows = args.batch * (1 + WARMUP + args.steps)
    x, y = rng.randn(rows, 32, 32, 3).astype(np.float32), rng.randint(0, 4, rows)
    begins, ends, losses = [], [], []
    timer = tf.keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: begins.append(time.perf_counter()),
        on_train_batch_end=lambda batch, logs: (ends.append(time.perf_counter()),
                                                losses.append(float(logs["loss"]))))
    start = time.perf_counter()
    model.fit(x, y, batch_size=args.batch, epochs=1, shuffle=False, verbose=0,
              callbacks=[timer])
    steps = [end - begin for begin, end in zip(begins, ends)][1 + WARMUP:]
    return {"startup_s": ends[0] - start, "step_s": statistics.median(steps),
            "losses": losses[:2]}


def measure_rounds(args):
    """Medians over ``--rounds`` rounds of each configuration's start-up and step."""
    runs = {name: [] for name in CONFIGS}
    for i in range(args.rounds):
        for name in CONFIGS[::-1 if i % 2 else 1]:
            runs[name].append(run_configuration(__file__, "batch_norm", name, args, SIZES,
                                                ("startup_s", "step_s", "losses")))
    return {name: {"startup_s": statistics.median(r["startup_s"] for r in done),
                   "step_s": statistics.median(r["step_s"] for r in done)}
            if all(r.get("step_s") is not None for r in done) else done[0]
            for name, done in runs.items()}


def print_table(rows, found, args):
    print(f"MobileNetV2 (alpha 0.35, 32x32) fit, batch {args.batch}, {args.devices} logical "
          f"CPUs, median of {args.steps} steps after {1 + WARMUP}; medians of {args.rounds} "
          "round(s)")
    print(f"{'batch norm':>14}  {'start-up s':>10}  {'step ms':>8}")
    for r in rows:
        print(f"{r['config']:>14}  {cell(r['startup_s'], '.2f'):>10}  "
              f"{cell(r['step_s'] and 1e3 * r['step_s'], '.1f'):>8}")
    for name, value, _ in found:
        print(f"{name}: {cell(value, '.2f')}")


def main(argv=None):
    _, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv,
                          "exit 1 when a configuration fails (no target is judged)",
                          parents=[worker_option(CONFIGS)])
    if args.worker:
        print(json.dumps(run_worker(args.worker, args)))
        return 0
    results = measure_rounds(args)
    rows = [{"config": name, **r} for name, r in results.items()]
    found = [(f"synchronized / averaged {what}",
              ratio(results["synchronized"].get(key), results["averaged"].get(key)), None)
             for what, key in (("start-up", "startup_s"), ("step", "step_s"))]
    return report(rows, found, args, SIZES, print_table,
                  checks_ok=all(r.get("step_s") is not None for r in rows))


if __name__ == "__main__":
    sys.exit(main())
