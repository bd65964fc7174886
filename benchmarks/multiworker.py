"""tfpar multi-worker benchmark: one host, so this measures overhead, not speed-up.

Step time of the same data-parallel MLP (same global batch, plain SGD) run as
  A. 2 TF_CONFIG workers x 1 logical CPU each (``tfpar launch``: gRPC between
     processes, collectives across them),
  B. 1 process with 2 logical CPU devices (one-process backend),
  C. 2 Horovod processes x 1 device (``horovodrun --gloo``, backend "horovod"),
reported as ratios to B. Each setup runs in its own processes; the setups run
in the order A B C C B A and each one's median step time is the median over
its two runs (this machine is noisy). ``--check`` also verifies that all
three reach the same final loss. Without Horovod (``make horovod`` builds it)
setup C is skipped with a message.

And a TF2 Keras ``fit`` step of the same MLP (Adam-free SGD, same global batch)
on one cluster of 2 worker processes x 2 logical CPUs (``tfpar launch``), run as
  D. tfpar (``wh.init()``: 4 replicas, the chief's eager context reaching the
     other worker's devices),
  E. ``MultiWorkerMirroredStrategy`` (TensorFlow's own; one CPU replica per
     worker, collectives between them),
in the order D E E D; ``--check`` holds D to at most 1.0x E (no slower) and
checks that D reaches the final loss of the same ``fit`` on one device, without
tfpar (setup F, once; E's logged loss is its own: the chief's log of 2
replicas, twice F's here).

    python benchmarks/multiworker.py [--quick] [--check] [--json]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_args import parse_sizes, verdict  # same directory

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SIZES = {"steps": (30, 8, "timed steps per run"), "width": (512, 64, "MLP width"),
         "batch": (128, 32, "global batch")}
HOROVODRUN = os.path.join(os.path.dirname(sys.executable), "horovodrun")

# The timed script every setup runs (the chief / every Horovod rank writes JSON).
WORKLOAD = r'''
import json, os, statistics, sys, time
import numpy as np
import tensorflow as tf
import tfpar as wh
v1 = tf.compat.v1
v1.disable_eager_execution()
out, steps, width, batch, backend = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
wh.init({"communication.backend": backend})
rng = np.random.RandomState(0)
x_np = rng.randn(batch, width).astype(np.float32)
y_np = rng.randint(0, 10, batch).astype(np.int64)
x = v1.placeholder(tf.float32, [None, width]); y = v1.placeholder(tf.int64, [None])
h = x
for i in range(3):
    h = v1.layers.dense(h, width, tf.nn.relu, kernel_initializer=v1.glorot_uniform_initializer(seed=i))
logits = v1.layers.dense(h, 10, kernel_initializer=v1.glorot_uniform_initializer(seed=9))
loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
train = v1.train.GradientDescentOptimizer(0.05).minimize(loss)
with v1.Session() as sess:
    sess.run(v1.global_variables_initializer())
    for _ in range(3):
        sess.run(train, {x: x_np, y: y_np})
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        value, _ = sess.run([loss, train], {x: x_np, y: y_np})
        times.append(time.perf_counter() - start)
rank = os.environ.get("HOROVOD_RANK", "0")
if rank == "0":
    with open(out, "w") as f:
        json.dump({"step_s": statistics.median(times), "final_loss": float(value)}, f)
'''


# The TF2 timed script: D under tfpar, E under MultiWorkerMirroredStrategy.
WORKLOAD_TF2 = r'''
import json, os, sys, time
import numpy as np
import tensorflow as tf
out, steps, width, batch, engine = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if engine == "tfpar":
    import tfpar as wh
    wh.init({"measure.after_steps": 0})
    scope = None
else:
    scope = tf.distribute.MultiWorkerMirroredStrategy().scope()
rng = np.random.RandomState(0)
x_np = rng.randn(batch * (steps + 3), width).astype(np.float32)
y_np = rng.randint(0, 10, batch * (steps + 3)).astype(np.int64)
def build():
    layers = [tf.keras.layers.Dense(width, "relu", kernel_initializer=tf.keras.initializers.GlorotUniform(seed=i)) for i in range(3)]
    model = tf.keras.Sequential([tf.keras.Input((width,))] + layers + [tf.keras.layers.Dense(10, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=9))])
    model.compile(tf.keras.optimizers.SGD(0.05), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
if scope is None:
    model = build()
else:
    with scope:
        model = build()
class Timer(tf.keras.callbacks.Callback):
    times = []
    def on_train_batch_begin(self, batch, logs=None):
        self.start = time.perf_counter()
    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.start)
        self.loss = float(logs["loss"])
timer = Timer()
data = tf.data.Dataset.from_tensor_slices((x_np, y_np)).batch(batch)
if scope is not None:
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = data.with_options(options)
model.fit(data, epochs=1, verbose=0, callbacks=[timer], shuffle=False)
if json.loads(os.environ.get("TF_CONFIG", '{"task": {"index": 0}}'))["task"]["index"] == 0:
    with open(out, "w") as f:
        json.dump({"step_s": float(np.median(timer.times[3:])), "final_loss": timer.loss}, f)
'''


def run_tf2_setup(name, script, out, args):
    """Setup D or E on 2 workers x 2 logical CPUs (``tfpar launch``), or F."""
    sizes = [str(args.steps), str(args.width), str(args.batch)]
    engine = {"D": "tfpar", "E": "mirrored", "F": "plain"}[name]
    command = [sys.executable, "-m", "tfpar.cli", "launch", "--workers", "2",
               "--devices-per-worker", "2"] if name != "F" else []
    command += [script, out, *sizes, engine] if name != "F" else [sys.executable, script, out,
                                                                     *sizes, engine]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"setup {name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    with open(out) as f:
        return json.load(f)


def run_setup(name, script, out, args):
    sizes = [str(args.steps), str(args.width), str(args.batch)]
    python = sys.executable
    if name == "A":
        command = [python, "-m", "tfpar.cli", "launch", "--workers", "2",
                   "--devices-per-worker", "1", script, out, *sizes, "auto"]
        env = dict(os.environ)
    elif name == "B":
        command = [python, script, out, *sizes, "auto"]
        env = dict(os.environ, TFPAR_CLUSTER_NUM_DEVICES="2")
    else:
        command = [HOROVODRUN, "-np", "2", "-H",
                   "localhost:2", "--gloo", python, script, out, *sizes, "horovod"]
        env = dict(os.environ, TFPAR_CLUSTER_NUM_DEVICES="1")
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"setup {name} failed:\n{(done.stdout + done.stderr)[-3000:]}")
    with open(out) as f:
        return json.load(f)


LABELS = {"A": "2 TF_CONFIG workers x 1 CPU", "B": "1 process x 2 logical CPUs",
          "C": "2 Horovod processes x 1 CPU"}
TF2_LABELS = {"D": "TF2 fit, tfpar, 2 workers x 2 CPUs",
              "E": "TF2 fit, MultiWorkerMirroredStrategy", "F": "TF2 fit, one device, plain"}


def run_order():
    """ABCCBA, or ABBA with a message when Horovod is not built."""
    if os.path.exists(HOROVODRUN):
        return "ABCCBA"
    print(f"horovodrun not found next to {sys.executable} (run `make horovod`): "
          f"skipping setup C ({LABELS['C']})", file=sys.stderr)
    return "ABBA"


def timed(order, labels, run, args, tmp):
    """{setup: its results} of running each setup of ``order`` (a run per
    letter) with ``run(name, out, args)``."""
    runs = {name: [] for name in labels if name in order}
    for i, name in enumerate(order):
        runs[name].append(run(name, os.path.join(tmp, f"{name}{i}.json"), args))
    return runs


def table_rows(runs, labels, base):
    """Rows of ``runs``: median step, ratio to setup ``base``, final loss; and
    whether every setup reached ``base``'s final loss."""
    step = {name: statistics.median(r["step_s"] for r in results) for name, results in runs.items()}
    losses = {name: results[-1]["final_loss"] for name, results in runs.items()}
    rows = [{"setup": labels[n], "step_ms": 1e3 * step[n], f"ratio_to_{base}": step[n] / step[base],
             "final_loss": losses[n]} for n in runs]
    return rows, all(abs(losses[n] - losses[base]) <= 1e-4 * abs(losses[base]) for n in runs)


def print_table(title, rows, base):
    print(title)
    print(f"{'setup':<40}{'step':>10}{'vs ' + base:>8}{'final loss':>12}")
    for r in rows:
        print(f"{r['setup']:<40}{r['step_ms']:>7.1f} ms{r[f'ratio_to_{base}']:>8.2f}"
              f"{r['final_loss']:>12.6f}")


def main(argv=None):
    _, args = parse_sizes(__doc__.split("\n")[0], SIZES, argv,
                          "check that all reach the same loss, and TF2 D <= 1.0x E")
    order = run_order()
    with tempfile.TemporaryDirectory() as tmp:
        scripts = {}
        for name, text in (("graph", WORKLOAD), ("tf2", WORKLOAD_TF2)):
            scripts[name] = os.path.join(tmp, f"{name}.py")
            with open(scripts[name], "w") as f:
                f.write(text)
        runs = timed(order, LABELS, lambda n, o, a: run_setup(n, scripts["graph"], o, a),
                     args, tmp)
        tf2_runs = timed("DEEDF", TF2_LABELS,
                         lambda n, o, a: run_tf2_setup(n, scripts["tf2"], o, a), args, tmp)
    rows, same = table_rows(runs, LABELS, "B")
    tf2_rows, _ = table_rows(tf2_runs, TF2_LABELS, "E")
    tf2_same = abs(tf2_rows[0]["final_loss"] - tf2_rows[2]["final_loss"]) <= 1e-4 * abs(
        tf2_rows[2]["final_loss"])
    target = ("TF2 fit on 2 workers x 2 CPUs: tfpar / MultiWorkerMirroredStrategy",
              tf2_rows[0]["ratio_to_E"], 1.0)
    if args.json:
        print(json.dumps({"config": {k: getattr(args, k) for k in SIZES}, "results": rows,
                          "same_loss": same, "tf2_results": tf2_rows, "tf2_same_loss": tf2_same,
                          "targets": [dict(zip(("target", "value", "limit"), target))]},
                         indent=2))
    else:
        print_table(f"tfpar multi-worker overhead (one host; MLP 3x{args.width}, global batch "
                    f"{args.batch}; medians of {args.steps} steps, each setup run twice, {order})",
                    rows, "B")
        print_table("\nTF2 fit on one cluster of 2 workers x 2 logical CPUs (DEED, then F)",
                    tf2_rows, "E")
        if args.check:
            print(f"check: same final loss in every graph-mode setup, and tfpar's TF2 fit as "
                  f"one device's: {'ok' if same and tf2_same else 'FAILED'}")
    return verdict([target], args, same and tf2_same)


if __name__ == "__main__":
    sys.exit(main())
