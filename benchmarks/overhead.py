"""tfpar overhead benchmark: three tfpar/baseline ratios, measured in the same run.

1. Graph-build time of an N-layer transformer (forward + AdamOptimizer.minimize,
   no session) with tfpar's hooks installed (``wh.init`` in the graph) vs plain TF.
2. Step time of ``wh.replicate(1)`` (``cluster.num_devices=1``) vs plain TF, MLP.
3. Step time of tfpar data parallelism on 4 logical CPU devices vs
   ``tf.distribute.MirroredStrategy`` on the same 4 devices (TF1 graph mode),
   same MLP and global batch.

The machine may be noisy, so the two sides of each ratio run alternately
(ABBA order, ``--reps`` rounds of ``--steps`` timed steps, or one build per side
per round) and medians are compared. tfpar's hooks are on only while its own
side runs, so the plain-TF and MirroredStrategy sides run unhooked.

    cd /work/main && .venv/bin/python benchmarks/overhead.py [--quick] [--check] [--json]
"""
import argparse
import contextlib
import gc
import json
import math
import statistics
import sys
import time

import numpy as np
import tensorflow as tf

NUM_CPUS = 4  # logical CPU devices for measurement 3
CLASSES = 10


def _dense(x, units, name, seed=None, activation=None):
    """x @ W + b over the last axis (any rank), variables via get_variable."""
    d = int(x.shape[-1])
    with tf.compat.v1.variable_scope(name):
        w = tf.compat.v1.get_variable(
            "kernel", [d, units], initializer=tf.compat.v1.glorot_uniform_initializer(seed=seed))
        b = tf.compat.v1.get_variable("bias", [units], initializer=tf.compat.v1.zeros_initializer())
    y = tf.matmul(tf.reshape(x, [-1, d]), w) + b
    if x.shape.rank > 2:
        y = tf.reshape(y, tf.concat([tf.shape(x)[:-1], [units]], 0))
    return activation(y) if activation is not None else y


def _layer_norm(x, name):
    with tf.compat.v1.variable_scope(name):
        d = int(x.shape[-1])
        gamma = tf.compat.v1.get_variable("gamma", [d], initializer=tf.compat.v1.ones_initializer())
        beta = tf.compat.v1.get_variable("beta", [d], initializer=tf.compat.v1.zeros_initializer())
    mean, var = tf.nn.moments(x, axes=[-1], keepdims=True)
    return (x - mean) * tf.math.rsqrt(var + 1e-6) * gamma + beta


def transformer_train_op(layers, hidden, heads, seq):
    """Pre-LN transformer encoder on float inputs, MSE loss, Adam; returns the train op."""
    x = tf.compat.v1.placeholder(tf.float32, [None, seq, hidden], name="x")
    target = tf.compat.v1.placeholder(tf.float32, [None, seq, hidden], name="target")
    dh = hidden // heads

    def heads_first(t):  # [B, S, H] -> [B, heads, S, dh]
        return tf.transpose(tf.reshape(t, [-1, seq, heads, dh]), [0, 2, 1, 3])

    h = x
    for i in range(layers):
        with tf.compat.v1.variable_scope(f"layer_{i}"):
            a = _layer_norm(h, "ln_attn")
            q, k, v = (heads_first(_dense(a, hidden, n)) for n in ("q", "k", "v"))
            att = tf.nn.softmax(tf.matmul(q, k, transpose_b=True) / math.sqrt(dh))
            ctx = tf.reshape(tf.transpose(tf.matmul(att, v), [0, 2, 1, 3]), [-1, seq, hidden])
            h = h + _dense(ctx, hidden, "out")
            f = _dense(_layer_norm(h, "ln_ffn"), 4 * hidden, "ffn_in", activation=tf.nn.gelu)
            h = h + _dense(f, hidden, "ffn_out")
    loss = tf.reduce_mean(tf.square(_layer_norm(h, "ln_final") - target))
    return tf.compat.v1.train.AdamOptimizer(1e-4).minimize(loss)


def mlp_builder(width, layers, lr=0.1, grad_scale=1.0):
    """build(x, y) -> (loss, train_op): ReLU MLP + softmax cross-entropy, plain SGD on
    grad_scale * loss. Initial values are op-seeded: every setup starts from the same weights."""
    def build(x, y):
        h = x
        for i in range(layers):
            h = _dense(h, width, f"fc{i}", seed=i, activation=tf.nn.relu)
        logits = _dense(h, CLASSES, "logits", seed=layers)
        loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(y, logits)
        scaled = loss * grad_scale if grad_scale != 1.0 else loss
        return loss, tf.compat.v1.train.GradientDescentOptimizer(lr).minimize(scaled)
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


@contextlib.contextmanager
def tfpar_hooks(runtime):
    """tfpar's hooks on, for one timed block of a graph tfpar already rewrote.

    wh.reset() would also forget the graph's rewrite, so this re-installs the
    patches and runtime directly (tfpar internals) and removes them afterwards.
    """
    from tfpar.hooks import tf_patches  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import context, engine  # pylint: disable=import-outside-toplevel
    context.activate(runtime)
    tf_patches.install(engine.session_config, engine.before_run)
    try:
        yield
    finally:
        tf_patches.uninstall()
        context.deactivate()


class Trainer:
    """One graph + session training ``build`` on a fixed batch; ``step()`` is one step.

    With ``tfpar_config`` the graph is built under ``wh.init`` (and ``scope``),
    warmed up (tfpar rewrites it on the first run), then tfpar's hooks are
    switched off; ``hooks()`` switches them on for a timed block. A later
    ``wh.init`` forgets this graph's capture, so time a tfpar Trainer before
    building the next one.
    """

    def __init__(self, name, build, data, tfpar_config=None, scope=None, config=None,
                 warmup=3):
        import tfpar as wh  # pylint: disable=import-outside-toplevel
        from tfpar.runtime import context  # pylint: disable=import-outside-toplevel
        self.name, self.losses, self.runtime = name, [], None
        graph = tf.Graph()
        with graph.as_default():
            if tfpar_config is not None:
                wh.init(tfpar_config)
            x = tf.compat.v1.placeholder(tf.float32, [None, data[0].shape[1]], name="x")
            y = tf.compat.v1.placeholder(tf.int64, [None], name="y")
            with scope() if scope is not None else contextlib.nullcontext():
                self.fetches = build(x, y)
            init = tf.compat.v1.global_variables_initializer()
        self.sess = tf.compat.v1.Session(graph=graph, config=config)
        self.sess.run(init)
        self.feed = {x: data[0], y: data[1]}
        for _ in range(warmup):
            self.step()
        if tfpar_config is not None:  # hooks off, but keep the graph's capture + rewrite
            from tfpar.hooks import tf_patches  # pylint: disable=import-outside-toplevel
            self.runtime = context.active()
            tf_patches.uninstall()
            context.deactivate()

    def step(self):
        self.losses.append(float(self.sess.run(self.fetches, self.feed)[0]))

    def hooks(self):
        return tfpar_hooks(self.runtime) if self.runtime else contextlib.nullcontext()


def alternate(a, b, reps, samples):
    """Median seconds of a_fn() and b_fn() timed alternately.

    ``a``/``b`` are (fn, context factory). Each of ``reps`` rounds runs, in ABBA
    order, ``samples`` timed calls of each side inside that side's context.
    """
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


def row(measurement, tfpar_s, baseline_s, target):
    ratio = tfpar_s / baseline_s
    return {"measurement": measurement, "tfpar_ms": 1e3 * tfpar_s,
            "baseline_ms": 1e3 * baseline_s, "ratio": ratio, "target": target,
            "met": ratio <= target}


def measure_build(args):
    """1. Transformer graph-build time, tfpar hooks installed vs plain TF."""
    import tfpar as wh  # pylint: disable=import-outside-toplevel

    def build(with_tfpar):
        with tf.Graph().as_default():
            if with_tfpar:
                wh.init({"cluster.num_devices": NUM_CPUS})
            try:
                transformer_train_op(args.layers, args.hidden, args.heads, args.seq)
            finally:
                if with_tfpar:
                    wh.reset()

    none = contextlib.nullcontext
    build(True), build(False)  # warm-up: one-time imports and caches
    t, b = alternate((lambda: build(True), none), (lambda: build(False), none), args.reps, 1)
    return row(f"graph build, {args.layers}-layer transformer (wh.init vs plain)", t, b, 1.15)


def measure_replicate1(args, data, trainers):
    """2. Step time of wh.replicate(1) vs plain TF (same MLP, batch, initial weights)."""
    import tfpar as wh  # pylint: disable=import-outside-toplevel
    build = mlp_builder(args.width, args.mlp_layers)
    plain = Trainer("plain TF", build, data)
    rep1 = Trainer("tfpar replicate(1)", build, data, {"cluster.num_devices": 1},
                   scope=lambda: wh.replicate(1))
    trainers += [plain, rep1]
    t, b = alternate((rep1.step, rep1.hooks), (plain.step, plain.hooks), args.reps, args.steps)
    return row("step time, replicate(1) vs plain TF (MLP)", t, b, 1.05)


def measure_data_parallel(args, data, trainers):
    """3. Step time of tfpar DP vs MirroredStrategy, NUM_CPUS logical CPUs, same global batch."""
    build = mlp_builder(args.width, args.mlp_layers)
    # TF2 MirroredStrategy sums replica gradients without scaling a v1 loss (only
    # Estimator did), so each replica minimises loss / replicas: the global-batch mean.
    per_replica = mlp_builder(args.width, args.mlp_layers, grad_scale=1.0 / NUM_CPUS)
    mirrored = Trainer("MirroredStrategy x4", mirrored_builder(per_replica), data,
                       config=tf.compat.v1.ConfigProto(device_count={"CPU": NUM_CPUS}))
    dp = Trainer(f"tfpar DP x{NUM_CPUS}", build, data, {"cluster.num_devices": NUM_CPUS})
    trainers += [mirrored, dp]
    t, b = alternate((dp.step, dp.hooks), (mirrored.step, mirrored.hooks), args.reps, args.steps)
    return row(f"step time, tfpar DP vs MirroredStrategy ({NUM_CPUS} CPUs, MLP)", t, b, 1.0)


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
             "steps": len(t.losses),
             "ok": t.losses[-1] < t.losses[0] and math.isclose(t.losses[0], first, rel_tol=1e-3)}
            for t in trainers]


def print_table(rows, checks, args):
    print(f"tfpar overhead (medians; transformer {args.layers}x{args.hidden}, {args.heads} heads,"
          f" seq {args.seq}; MLP {args.mlp_layers}x{args.width}, global batch {args.batch};"
          f" {args.reps} rounds x {args.steps} steps)")
    head = ("measurement", "tfpar", "baseline", "ratio", "target", "")
    width = max(len(r["measurement"]) for r in rows)
    print(f"{head[0]:<{width}}  {head[1]:>10}  {head[2]:>10}  {head[3]:>6}  {head[4]:>7}")
    for r in rows:
        print(f"{r['measurement']:<{width}}  {r['tfpar_ms']:>7.1f} ms  {r['baseline_ms']:>7.1f} ms"
              f"  {r['ratio']:>6.3f}  <= {r['target']:<4}  {'met' if r['met'] else 'not met'}")
    for c in checks:
        print(f"check {c['setup']:<20} loss {c['first_loss']:.4f} -> {c['last_loss']:.4f} "
              f"over {c['steps']} steps: {'ok' if c['ok'] else 'FAILED'}")


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--check", action="store_true",
                   help="also check that every setup trains (loss falls, step-0 losses agree)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test, < 60 s)")
    p.add_argument("--steps", type=int, help="timed steps per side per round (default 10)")
    p.add_argument("--reps", type=int, help="alternating rounds (default 5)")
    p.add_argument("--layers", type=int, help="transformer layers (default 24)")
    p.add_argument("--hidden", type=int, help="transformer hidden size (default 256)")
    p.add_argument("--width", type=int, help="MLP width (default 1024)")
    p.add_argument("--batch", type=int, help="global batch (default 256)")
    args = p.parse_args(argv)
    sizes = dict(steps=10, reps=5, layers=24, hidden=256, width=1024, batch=256)
    if args.quick:
        sizes = dict(steps=5, reps=3, layers=2, hidden=64, width=128, batch=64)
    for key, value in sizes.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.heads, args.seq, args.mlp_layers = 4, (16 if args.quick else 64), 4
    if args.batch % NUM_CPUS or min(args.steps, args.reps, args.layers) < 1:
        p.error(f"--batch must be a multiple of {NUM_CPUS}; --steps/--reps/--layers >= 1")
    return args


def main(argv=None):
    import tfpar as wh  # pylint: disable=import-outside-toplevel
    args = parse_args(argv)
    # Before anything initialises TF's context: both tfpar sessions and MirroredStrategy
    # then see NUM_CPUS logical CPU devices.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_CPUS)
    tf.compat.v1.disable_eager_execution()
    data, trainers = make_data(args.batch, args.width), []
    rows = [measure_build(args), measure_replicate1(args, data, trainers),
            measure_data_parallel(args, data, trainers)]
    checks = loss_checks(trainers) if args.check else []
    for t in trainers:
        t.sess.close()
    wh.reset()
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                          "results": rows, "checks": checks}, indent=2))
    else:
        print_table(rows, checks, args)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
