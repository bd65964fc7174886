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

    python benchmarks/multiworker.py [--quick] [--check] [--json]
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile

from bench_args import parse_sizes  # same directory

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


def run_order():
    """ABCCBA, or ABBA with a message when Horovod is not built."""
    if os.path.exists(HOROVODRUN):
        return "ABCCBA"
    print(f"horovodrun not found next to {sys.executable} (run `make horovod`): "
          f"skipping setup C ({LABELS['C']})", file=sys.stderr)
    return "ABBA"


def main(argv=None):
    _, args = parse_sizes(__doc__.split("\n")[0], SIZES, argv,
                          "check that all reach the same loss")
    order = run_order()
    runs = {name: [] for name in LABELS if name in order}
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "workload.py")
        with open(script, "w") as f:
            f.write(WORKLOAD)
        for i, name in enumerate(order):
            runs[name].append(run_setup(name, script, os.path.join(tmp, f"{name}{i}.json"), args))
    step = {name: statistics.median(r["step_s"] for r in results) for name, results in runs.items()}
    losses = {name: results[-1]["final_loss"] for name, results in runs.items()}
    rows = [{"setup": LABELS[n], "step_ms": 1e3 * step[n], "ratio_to_B": step[n] / step["B"],
             "final_loss": losses[n]} for n in runs]
    same = all(abs(losses[n] - losses["B"]) <= 1e-4 * abs(losses["B"]) for n in runs)
    if args.json:
        print(json.dumps({"config": {k: getattr(args, k) for k in SIZES}, "results": rows,
                          "same_loss": same}, indent=2))
    else:
        print(f"tfpar multi-worker overhead (one host; MLP 3x{args.width}, global batch "
              f"{args.batch}; medians of {args.steps} steps, each setup run twice, {order})")
        print(f"{'setup':<32}{'step':>10}{'vs B':>8}{'final loss':>12}")
        for r in rows:
            print(f"{r['setup']:<32}{r['step_ms']:>7.1f} ms{r['ratio_to_B']:>8.2f}"
                  f"{r['final_loss']:>12.6f}")
        if args.check:
            print(f"check: same final loss in every setup: {'ok' if same else 'FAILED'}")
    return 0 if same or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
