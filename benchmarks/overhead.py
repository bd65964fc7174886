"""tfpar overhead benchmark: three tfpar/baseline ratios, measured in the same run.

1. Graph-build time of an N-layer transformer (forward + AdamOptimizer.minimize,
   no session) with tfpar's hooks installed vs plain TF (the tfpar side's time
   includes its ``wh.init`` and ``wh.reset`` calls).
2. Step time of ``wh.replicate(1)`` (``cluster.num_devices=1``) vs plain TF, MLP.
3. Step time of tfpar data parallelism on 4 logical CPU devices vs
   ``tf.distribute.MirroredStrategy`` on the same 4 devices (TF1 graph mode, its
   default cross-device ops), same MLP, global batch and update rule; with the
   default backend ("auto": one-process CPU replicas share variables and sum on
   one device) and, for information, with ``communication.backend: collective``
   (mirrored variables, CollectiveReduceV2 ring: what multi-process runs use).
4. What ``check.finite_gradients`` costs: step time of tfpar data parallelism
   on 4 logical CPUs with the check vs without, with one micro-batch and with
   8 (every micro-batch's gradients are checked), same MLP and batch.

The machine may be noisy, so the two sides of each ratio run alternately (ABBA
order, ``--reps`` rounds of ``--steps`` timed steps or of one build per side) and
their medians are compared. tfpar's hooks are on only while its own side runs.

Targets (``TARGETS``, tfpar / baseline at most): graph build 1.15, replicate(1)
step 1.05, DP (auto backend) step 1.0, the check 1.10 (one micro-batch) and
1.30 (8: every micro-batch's gradients are read once more); the collective row
is informational.
``--check`` prints PASS/FAIL per target and exits 1 when one is missed or when a
setup does not train (loss falls, from the same step-0 loss everywhere).

    python benchmarks/overhead.py [--quick] [--check] [--json]
"""
import contextlib
import functools
import gc
import json
import math
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

import tfpar as wh
from tfpar.hooks import tf_patches
from tfpar.models.blocks import layer_norm
from tfpar.runtime import context as tfpar_context, engine as tfpar_engine

from bench_args import meets, parse_sizes, verdict  # same directory

v1 = tf.compat.v1

NUM_CPUS = 4  # logical CPU devices for measurement 3
CHECK_HELP = ("exit 1 when a ratio target is missed or a setup does not train (loss falls, "
              "step-0 losses agree)")
# Targets of the tfpar / baseline ratios (at most), by measurement.
TARGETS = {"build": 1.15, "replicate1": 1.05, "dp_auto": 1.0, "checked": 1.10,
           "checked_micro": 1.30}
CLASSES = 10
SIZES = {"steps": (20, 5, "timed steps per side per round"), "reps": (5, 3, "ABBA rounds"),
         "layers": (24, 2, "transformer layers"), "hidden": (256, 64, "transformer hidden size"),
         "width": (1024, 128, "MLP width"), "batch": (256, 64, "global batch")}


def _dense(x, units, name, seed=None, activation=None):
    """x @ W + b over the last axis (any rank), variables via get_variable."""
    d = int(x.shape[-1])
    with v1.variable_scope(name):
        w = v1.get_variable("kernel", [d, units], initializer=v1.glorot_uniform_initializer(seed))
        b = v1.get_variable("bias", [units], initializer=v1.zeros_initializer())
    y = tf.matmul(tf.reshape(x, [-1, d]), w) + b
    if x.shape.rank > 2:
        y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [units]], 0))
    return activation(y) if activation is not None else y


def transformer_train_op(layers, hidden, heads, seq):
    """Pre-LN transformer encoder on float inputs, MSE loss, Adam; returns the train op."""
    x = v1.placeholder(tf.float32, [None, seq, hidden], name="x")
    target = v1.placeholder(tf.float32, [None, seq, hidden], name="target")
    dh = hidden // heads

    def heads_first(t):  # [B, S, H] -> [B, heads, S, dh]
        return tf.transpose(tf.reshape(t, [-1, seq, heads, dh]), [0, 2, 1, 3])
    h = x
    for i in range(layers):
        with v1.variable_scope(f"layer_{i}"):
            a = layer_norm(h, "ln_attn")
            q, k, v = (heads_first(_dense(a, hidden, n)) for n in ("q", "k", "v"))
            att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / math.sqrt(dh))
            ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, seq, hidden])
            h = h + _dense(ctx, hidden, "out")
            f = _dense(layer_norm(h, "ln_ffn"), 4 * hidden, "ffn_in", activation=tf.nn.gelu)
            h = h + _dense(f, hidden, "ffn_out")
    loss = tf.reduce_mean(tf.square(layer_norm(h, "ln_final") - target))
    return v1.train.AdamOptimizer(1e-4).minimize(loss)


def mlp_builder(width, layers, lr=0.1, grad_scale=1.0):
    """build(x, y) -> (loss, train_op): ReLU MLP + softmax cross-entropy, plain SGD on
    grad_scale * loss. Initial values are op-seeded: every setup starts from the same weights."""
    def build(x, y):
        h = x
        for i in range(layers):
            h = _dense(h, width, f"fc{i}", seed=i, activation=tf.nn.relu)
        logits = _dense(h, CLASSES, "logits", seed=layers)
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(lr).minimize(loss * grad_scale)
    return build


def mirrored_builder(build):
    """build wrapped for MirroredStrategy: each replica gets 1/NUM_CPUS of the fed batch."""
    def wrapped(x, y):
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(NUM_CPUS)])
        with strategy.scope():
            def replica_slice(ctx):
                n = tf.shape(x)[0] // ctx.num_replicas_in_sync
                lo = ctx.replica_id_in_sync_group * n
                return x[lo:lo + n], y[lo:lo + n]
            xs, ys = strategy.experimental_distribute_values_from_function(replica_slice)
            loss, train = strategy.run(build, args=(xs, ys))
            return strategy.reduce("MEAN", loss, axis=None), strategy.group(train)
    return wrapped


def tfpar_hooks_off():
    """Switch tfpar's hooks off and return a context manager factory that switches them
    back on. Unlike wh.reset() this keeps the graphs' captures and rewrites (it uses
    tfpar internals), so an already rewritten graph can be timed with hooks on again."""
    runtime = tfpar_context.active()
    tf_patches.uninstall()
    tfpar_context.deactivate()

    @contextlib.contextmanager
    def on():
        tfpar_context.activate(runtime)
        tf_patches.install(tfpar_engine)
        try:
            yield
        finally:
            tf_patches.uninstall()
            tfpar_context.deactivate()
    return on


class Trainer:
    """One graph + session training ``build`` on a fixed batch; ``step()`` is one step.

    With ``tfpar_config``: built under wh.init (and ``scope``), warmed up (tfpar rewrites
    the graph at the first run), then hooks off; ``with self.hooks():`` turns them on.
    A later wh.init forgets this graph's capture: time each tfpar Trainer before the next."""

    def __init__(self, name, build, data, tfpar_config=None, scope=None, config=None, warmup=3,
                 dataset=False):
        self.name, self.losses, self.hooks = name, [], contextlib.nullcontext
        graph = tf.Graph()
        with graph.as_default():
            if tfpar_config is not None:
                wh.init(tfpar_config)
            if dataset:  # the usual input_fn: a static batch (drop_remainder=True)
                ds = tf.data.Dataset.from_tensor_slices(data).batch(
                    len(data[0]), drop_remainder=True).repeat()
                x, y = v1.data.make_one_shot_iterator(ds).get_next()
            else:
                x = v1.placeholder(tf.float32, [None, data[0].shape[1]], name="x")
                y = v1.placeholder(tf.int64, [None], name="y")
            with scope() if scope is not None else contextlib.nullcontext():
                self.fetches = build(x, y)
            init = v1.global_variables_initializer()
        self.sess = v1.Session(graph=graph, config=config)
        self.sess.run(init)
        self.feed = None if dataset else {x: data[0], y: data[1]}
        for _ in range(warmup):
            self.step()
        if tfpar_config is not None:
            self.hooks = tfpar_hooks_off()

    def step(self):
        self.losses.append(float(self.sess.run(self.fetches, self.feed)[0]))


def alternate(a, b, reps, samples):
    """Median seconds per call of two sides, each (fn, context factory): each of ``reps``
    rounds runs, in ABBA order, ``samples`` timed calls of each side inside its context."""
    times = ([], [])
    for r in range(reps):
        for i in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn, ctx = (a, b)[i]
            gc.collect()
            with ctx():
                for _ in range(samples):
                    start = time.perf_counter()
                    fn()
                    times[i].append(time.perf_counter() - start)
    return statistics.median(times[0]), statistics.median(times[1])


def row(measurement, tfpar_s, baseline_s, target=None):
    """A result row; ``target`` None marks an informational row (always "met")."""
    ratio = tfpar_s / baseline_s
    return {"measurement": measurement, "tfpar_ms": 1e3 * tfpar_s, "baseline_ms": 1e3 * baseline_s,
            "ratio": ratio, "target": target, "met": meets(ratio, target)}


def measure_build(args):
    """1. Transformer graph-build time, tfpar hooks installed vs plain TF."""
    def build(with_tfpar):
        with tf.Graph().as_default():
            if with_tfpar:
                wh.init({"cluster.num_devices": NUM_CPUS})
            transformer_train_op(args.layers, args.hidden, args.heads, args.seq)
        if with_tfpar:
            wh.reset()

    sides = [(functools.partial(build, with_tfpar), contextlib.nullcontext)
             for with_tfpar in (True, False)]
    alternate(*sides, reps=1, samples=1)  # warm-up: one-time imports and caches
    t, b = alternate(*sides, reps=args.reps, samples=1)
    return row(f"graph build, {args.layers}-layer transformer (wh.init vs plain)", t, b,
               TARGETS["build"])


def measure_replicate1(args, data, trainers):
    """2. Step time of wh.replicate(1) vs plain TF (same MLP, batch, initial weights)."""
    build = mlp_builder(args.width, args.mlp_layers)
    plain = Trainer("plain TF", build, data)
    rep1 = Trainer("tfpar replicate(1)", build, data, {"cluster.num_devices": 1},
                   scope=lambda: wh.replicate(1))
    trainers += [plain, rep1]
    t, b = alternate((rep1.step, rep1.hooks), (plain.step, plain.hooks), args.reps, args.steps)
    return row("step time, replicate(1) vs plain TF (MLP)", t, b, TARGETS["replicate1"])


def measure_data_parallel(args, data, trainers):
    """3. Step time of tfpar DP (per backend) vs MirroredStrategy, NUM_CPUS logical CPUs,
    same global batch read from a tf.data input batched with drop_remainder=True (a
    static batch, as an Estimator input_fn makes it): one row per backend."""
    build = mlp_builder(args.width, args.mlp_layers)
    # TF2 MirroredStrategy sums replica gradients without scaling a v1 loss (only
    # Estimator did), so each replica minimises loss / replicas: the global-batch mean.
    per_replica = mlp_builder(args.width, args.mlp_layers, grad_scale=1.0 / NUM_CPUS)
    mirrored = Trainer("MirroredStrategy x4", mirrored_builder(per_replica), data,
                       config=v1.ConfigProto(device_count={"CPU": NUM_CPUS}), dataset=True)
    trainers.append(mirrored)
    rows = []
    for backend, target in (("auto", TARGETS["dp_auto"]), ("collective", None)):
        dp = Trainer(f"tfpar DP x{NUM_CPUS} {backend}", build, data,
                     {"cluster.num_devices": NUM_CPUS, "communication.backend": backend},
                     dataset=True)
        trainers.append(dp)
        t, b = alternate((dp.step, dp.hooks), (mirrored.step, mirrored.hooks), args.reps,
                         args.steps)
        rows.append(row(f"step time, tfpar DP ({backend}) vs MirroredStrategy "
                        f"({NUM_CPUS} CPUs, MLP)", t, b, target))
    return rows


def measure_finite_check(args, data, trainers):
    """4. Step time of tfpar DP on NUM_CPUS CPUs with check.finite_gradients vs
    without, with 1 and with 8 micro-batches: one row each."""
    build = mlp_builder(args.width, args.mlp_layers)
    rows = []
    for micro, target in ((1, TARGETS["checked"]), (8, TARGETS["checked_micro"])):
        config = {"cluster.num_devices": NUM_CPUS, "pipeline.num_micro_batch": micro}
        sides = [Trainer(f"DP x{micro}{' checked' if checked else ''}", build, data,
                         {**config, "check.finite_gradients": checked})
                 for checked in (True, False)]
        trainers += sides
        t, b = alternate(*[(side.step, side.hooks) for side in sides], args.reps, args.steps)
        rows.append(row(f"step time, tfpar DP with check.finite_gradients vs without "
                        f"({NUM_CPUS} CPUs, {micro} micro-batch{'es' if micro > 1 else ''}, MLP)",
                        t, b, target))
    return rows


def make_data(batch, width, seed=0):
    """A fixed learnable batch: labels from a random linear teacher."""
    rng = np.random.RandomState(seed)
    x = rng.randn(batch, width).astype(np.float32)
    y = np.argmax(x @ rng.randn(width, CLASSES), axis=1).astype(np.int64)
    return x, y


def loss_checks(trainers):
    """Loss must fall for every setup; step-0 losses must agree (same weights, batch)."""
    first = trainers[0].losses[0]
    return [{"setup": t.name, "first_loss": t.losses[0], "last_loss": t.losses[-1],
             "steps": len(t.losses), "ok": t.losses[-1] < t.losses[0]
             and math.isclose(t.losses[0], first, rel_tol=1e-3)} for t in trainers]


def print_table(rows, checks, args):
    print(f"tfpar overhead (medians; transformer {args.layers}x{args.hidden}, {args.heads} heads,"
          f" seq {args.seq}; MLP {args.mlp_layers}x{args.width}, global batch {args.batch};"
          f" {args.reps} rounds x {args.steps} steps)")
    width = max(len(r["measurement"]) for r in rows)
    print(f"{'measurement':<{width}}  {'tfpar':>10}  {'baseline':>10}  {'ratio':>6}  target  met")
    for r in rows:
        print(f"{r['measurement']:<{width}}  {r['tfpar_ms']:>7.1f} ms  {r['baseline_ms']:>7.1f} ms"
              f"  {r['ratio']:>6.3f}  " + (f"<= {r['target']:<4}  {'met' if r['met'] else 'not met'}"
                                           if r["target"] is not None else "(info)"))
    print_checks(checks)


def print_checks(checks):
    for c in checks:
        what = c.get("detail") or (f"loss {c['first_loss']:.4f} -> {c['last_loss']:.4f} "
                                   f"over {c['steps']} steps")
        print(f"check {c['setup']:<20} {what}: {'ok' if c['ok'] else 'FAILED'}")


def parse_args(argv):
    p, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv, CHECK_HELP,
                          "tiny sizes (smoke test, < 60 s)")
    args.heads, args.seq, args.mlp_layers = 4, (16 if args.quick else 64), 4
    if args.batch % NUM_CPUS or min(args.steps, args.reps, args.layers) < 1:
        p.error(f"--batch must be a multiple of {NUM_CPUS}; --steps/--reps/--layers >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    # Before anything initialises TF's context: tfpar and MirroredStrategy see NUM_CPUS CPUs.
    tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                               [tf.config.LogicalDeviceConfiguration()] * NUM_CPUS)
    v1.disable_eager_execution()
    data, trainers = make_data(args.batch, args.width), []
    rows = [measure_build(args), measure_replicate1(args, data, trainers),
            *measure_data_parallel(args, data, trainers),
            *measure_finite_check(args, data, trainers)]
    return finish(rows, trainers, args, print_table, loss_checks)


def finish(rows, trainers, args, print_table, checker) -> int:
    """Check (with --check), close the sessions, print a table or JSON; the exit code:
    1 under --check when a row misses its ratio target or a check fails."""
    checks = checker(trainers) if args.check else []
    for t in trainers:
        t.sess.close()
    wh.reset()
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                          "results": rows, "checks": checks}, indent=2))
    else:
        print_table(rows, checks, args)
    return verdict([(r["measurement"], r["ratio"], r["target"]) for r in rows], args,
                   all(c["ok"] for c in checks))


if __name__ == "__main__":
    sys.exit(main())
