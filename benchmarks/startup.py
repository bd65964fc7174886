"""tfpar start-up benchmark: what the rewrite costs before and after training starts.

One model, a pre-LN transformer encoder (``--layers`` layers, ``--hidden``
wide, 4 heads, ``--seq`` positions; float inputs, MSE loss, AdamOptimizer; TF1
graph API, seeded initial values, the same fed global batch ``--batch`` every
step), is trained in each configuration:

  * ``plain``: plain TF (tfpar not initialised), 1 CPU;
  * ``dp4``: tfpar data parallelism, no scopes, ``cluster.num_devices`` 4;
  * ``pipe4_m4``, ``pipe4_m8``, ``pipe4_m32``: 4 ``wh.replicate(1)`` stages (the
    attention and feed-forward blocks split evenly, 3 layers each by default;
    the loss in the last; the optimizer outside every scope) on 4 devices,
    default schedule (1F1B), ``pipeline.num_micro_batch`` 4, 8, 32;
  * ``pipe4v2_m8``: the same 4 stages on 2 devices, each holding two
    non-adjacent stages (``pipeline.virtual_stages`` 2: interleaved 1F1B), 8
    micro-batches;
  * ``ga_m32``: gradient accumulation, no scopes, 1 device, 32 micro-batches;
  * ``gpt_plain``, ``gpt4_m8``, ``gpt4_m32``: a GPT with tied embeddings (issue 48
    item 6): token ids in, ``--vocab`` x ``--hidden`` token and position
    embeddings, the same blocks with a causal mask, the output projection
    ``matmul(h, wte, transpose_b=True)`` and a next-token cross-entropy; plain TF,
    then 4 ``wh.replicate(1)`` stages (the embeddings in the first, the tied
    projection and the loss in the last) with 8 and 32 micro-batches;
  * ``gpt5_m8``: the GPT in 5 scopes on 4 devices, the embeddings in a scope of
    their own (the first two scopes share a device), 8 micro-batches;
  * ``keras_plain``, ``keras_split2``, ``keras_split2_sp``: the encoder's
    blocks as Keras layers (``MultiHeadAttention``, ``LayerNormalization``,
    ``Dense``), plain TF, then in one ``wh.split(2)`` on 2 devices (Megatron's
    split), then with ``split.sequence_parallel`` (norms and residual adds on
    each device's half of the sequence).

Every configuration runs in its own fresh process (no TF caches shared), given
``--timeout`` seconds; one that times out or fails reports n/a and misses its
targets. Each process measures, with 4 logical CPU devices where it uses 4:

  * start-up s: from the end of graph building (after ``minimize`` and
    ``global_variables_initializer``, before the Session exists) to the end of the
    first training step: Session creation, the initializer run (where tfpar
    rewrites the graph) and the first step; "init s" is its part up to the end
    of the initializer run;
  * step ms: the median of ``--steps`` steps after 2 warm-up steps;
  * ops and GraphDef MB: ``len(graph.get_operations())`` and
    ``graph.as_graph_def().ByteSize()`` (function library included) after the
    first step, i.e. after the rewrite;
  * the losses of steps 0 and 1, which must match plain TF's (rtol 1e-4).

The ratios come from one run (every configuration once, in the order above),
each against the plain TF run of its model. Targets (``TARGETS``, at most):
pipe4_m8 start-up / plain 3; pipe4v2_m8 start-up / plain 3; pipe4_m32 /
pipe4_m8 start-up 1.5; pipe4_m8 step /
plain 1.3; pipe4_m32 / pipe4_m8 ops 1.10; gpt4_m8 start-up / gpt_plain 3;
gpt4_m32 / gpt4_m8 ops 1.10; gpt5_m8 start-up / gpt_plain 3; keras_split2_sp
start-up / keras_split2 1.3. ``--check`` prints PASS/FAIL per target and exits
1 when one is missed or a configuration's losses differ from its plain run's.
Progress goes to stderr.

    python benchmarks/startup.py [--quick] [--check] [--json]

(2 cores, 2026-11-23: the full run about 2 minutes, ``--quick`` less.)
"""
import contextlib
import json
import math
import os
import statistics
import sys
import time

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.models.blocks import layer_norm  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, ratio, report, run_configuration, worker_option  # noqa: E402  (same directory)
from overhead import _dense  # noqa: E402

v1 = tf.compat.v1

HEADS, STAGES, WARMUP, RTOL = 4, 4, 2, 1e-4
# name: (tfpar config or None for plain TF, logical CPU devices, pipeline stages, model)
CONFIGS = {
    "plain": (None, 1, 0, "transformer"),
    "dp4": ({"cluster.num_devices": 4}, 4, 0, "transformer"),
    **{f"pipe4_m{m}": ({"cluster.num_devices": 4, "pipeline.num_micro_batch": m}, 4, STAGES,
                       "transformer") for m in (4, 8, 32)},
    "pipe4v2_m8": ({"cluster.num_devices": 2, "pipeline.num_micro_batch": 8,
                    "pipeline.virtual_stages": 2}, 2, STAGES, "transformer"),
    "ga_m32": ({"cluster.num_devices": 1, "pipeline.num_micro_batch": 32}, 1, 0, "transformer"),
    "gpt_plain": (None, 1, 0, "gpt"),
    **{f"gpt4_m{m}": ({"cluster.num_devices": 4, "pipeline.num_micro_batch": m}, 4, STAGES,
                      "gpt") for m in (8, 32)},
    "gpt5_m8": ({"cluster.num_devices": 4, "pipeline.num_micro_batch": 8}, 4, STAGES, "gpt5"),
    "keras_plain": (None, 1, 0, "keras"),
    "keras_split2": ({"cluster.num_devices": 2}, 2, 0, "keras"),
    "keras_split2_sp": ({"cluster.num_devices": 2, "split.sequence_parallel": True}, 2, 0,
                        "keras"),
}
PLAIN = {"transformer": "plain", "gpt": "gpt_plain", "gpt5": "gpt_plain", "keras": "keras_plain"}
TARGETS = {"startup_m8_plain": 3.0, "startup_v2_m8_plain": 3.0, "startup_m32_m8": 1.5,
           "step_m8_plain": 1.3,
           "ops_m32_m8": 1.10, "gpt_startup_m8_plain": 3.0, "gpt_ops_m32_m8": 1.10,
           "gpt5_startup_m8_plain": 3.0, "keras_startup_sp_split": 1.3}
SIZES = {"layers": (12, 2, f"transformer layers (>= {STAGES // 2})"),
         "hidden": (256, 32, f"hidden size (a multiple of {HEADS} heads)"),
         "seq": (64, 8, "sequence length"), "batch": (64, 32, "global batch (a multiple of 32)"),
         "vocab": (4096, 64, "the GPT's vocabulary"),
         "steps": (5, 3, "timed steps per configuration"),
         "timeout": (900, 300, "seconds a configuration may take before it is abandoned")}
COLUMNS = [("config", "config", ""), ("start-up s", "startup_s", ".2f"),
           ("init s", "init_s", ".2f"), ("/ plain", "startup_plain", ".2f"),
           ("step ms", "step_ms", ".1f"), ("/ plain", "step_plain", ".2f"),
           ("ops", "ops", "d"), ("GraphDef MB", "graphdef_mb", ".2f"),
           ("same loss", "same_loss", "")]


def attention(h, i, args, causal=False):
    """A pre-LN self-attention block ``attn_{i}`` with a residual; ``causal``
    masks later positions."""
    hidden, seq, dh = args.hidden, args.seq, args.hidden // HEADS

    def heads_first(t):  # [B, S, H] -> [B, heads, S, dh]
        return tf.transpose(tf.reshape(t, [-1, seq, HEADS, dh]), [0, 2, 1, 3])

    with v1.variable_scope(f"attn_{i}"):
        a = layer_norm(h, "ln")
        q, k, v = (heads_first(_dense(a, hidden, n, seed=10 * i + j))
                   for j, n in enumerate(("q", "k", "v")))
        scores = tf.matmul(q, k, transpose_b=True) / math.sqrt(dh)
        if causal:
            mask = tf.linalg.band_part(tf.ones([seq, seq]), -1, 0)
            scores = scores * mask - 1e9 * (1 - mask)
        ctx = tf.reshape(tf.transpose(tf.matmul(tf.nn.softmax(scores), v), [0, 2, 1, 3]),
                         [-1, seq, hidden])
        return h + _dense(ctx, hidden, "out", seed=10 * i + 3)


def feed_forward(h, i, args):
    """A pre-LN feed-forward block ``ffn_{i}`` (4x wide, gelu) with a residual."""
    with v1.variable_scope(f"ffn_{i}"):
        f = _dense(layer_norm(h, "ln"), 4 * args.hidden, "in", seed=10 * i + 4,
                   activation=tf.nn.gelu)
        return h + _dense(f, args.hidden, "out", seed=10 * i + 5)


def staged_blocks(args, stages, start, finish, causal=False, start_alone=False):
    """``finish`` of the 2 x ``--layers`` blocks (attention, feed-forward) on
    ``start()``, split evenly over ``stages`` ``wh.replicate(1)`` scopes (none
    when 0): ``start()`` runs in the first scope (``start_alone``: in a scope
    of its own before them), ``finish`` (the loss) in the last."""
    groups, blocks = max(stages, 1), 2 * args.layers
    h = None
    if start_alone:
        with wh.replicate(1):
            h = start()
    for s in range(groups):
        with wh.replicate(1) if stages else contextlib.nullcontext():
            h = start() if h is None else h
            for b in range(s * blocks // groups, (s + 1) * blocks // groups):
                h = (attention(h, b // 2, args, causal) if b % 2 == 0
                     else feed_forward(h, b // 2, args))
            if s == groups - 1:
                result = finish(h)
    return result


def build(args, stages):
    """(feeds of a batch, loss, train_op) in the default graph: the
    transformer, float inputs and targets, MSE loss."""
    x = v1.placeholder(tf.float32, [None, args.seq, args.hidden], name="x")
    target = v1.placeholder(tf.float32, [None, args.seq, args.hidden], name="target")
    loss = staged_blocks(args, stages, lambda: x, lambda h: tf.reduce_mean(
        tf.square(layer_norm(h, "ln_final") - target)))
    rng = np.random.RandomState(0)
    feed = {t: rng.randn(args.batch, args.seq, args.hidden).astype(np.float32)
            for t in (x, target)}
    return feed, loss, v1.train.AdamOptimizer(1e-4).minimize(loss)


def build_gpt(args, stages, embedding_alone=False):
    """(feeds of a batch, loss, train_op): the GPT with tied embeddings (module
    doc), the embeddings in the first scope (``embedding_alone``: in a scope
    of their own), the tied projection in the last."""
    ids = v1.placeholder(tf.int64, [None, args.seq], name="ids")
    embedding = {}

    def embed():
        embedding["wte"] = v1.get_variable("wte", [args.vocab, args.hidden],
                                           initializer=v1.random_normal_initializer(0, 0.02, 1))
        wpe = v1.get_variable("wpe", [args.seq, args.hidden],
                              initializer=v1.random_normal_initializer(0, 0.01, 2))
        return tf.gather(embedding["wte"], ids) + wpe

    def loss_of(h):
        flat = tf.reshape(layer_norm(h, "ln_final"), [-1, args.hidden])
        logits = tf.reshape(tf.matmul(flat, embedding["wte"], transpose_b=True),
                            [-1, args.seq, args.vocab])
        return v1.losses.sparse_softmax_cross_entropy(ids[:, 1:], logits[:, :-1])

    loss = staged_blocks(args, stages, embed, loss_of, True, embedding_alone)
    feed = {ids: np.random.RandomState(0).randint(0, args.vocab, (args.batch, args.seq))}
    return feed, loss, v1.train.AdamOptimizer(1e-4).minimize(loss)


def build_keras(args, split):
    """(feeds of a batch, loss, train_op): the encoder's blocks as Keras
    layers, in ``wh.split(2)`` when ``split``; MSE loss, Adam."""
    x = v1.placeholder(tf.float32, [None, args.seq, args.hidden], name="x")
    target = v1.placeholder(tf.float32, [None, args.seq, args.hidden], name="target")
    tf.keras.utils.set_random_seed(0)
    layers = tf.keras.layers
    h = x
    with wh.split(2) if split else contextlib.nullcontext():
        for _ in range(args.layers):
            a = layers.LayerNormalization()(h)
            h = h + layers.MultiHeadAttention(HEADS, args.hidden // HEADS)(a, a)
            f = layers.Dense(4 * args.hidden, activation="gelu")(layers.LayerNormalization()(h))
            h = h + layers.Dense(args.hidden)(f)
    loss = tf.reduce_mean(tf.square(layers.LayerNormalization()(h) - target))
    rng = np.random.RandomState(0)
    feed = {t: rng.randn(args.batch, args.seq, args.hidden).astype(np.float32)
            for t in (x, target)}
    return feed, loss, v1.train.AdamOptimizer(1e-4).minimize(loss)


def run_worker(name, args):
    """Build and train configuration ``name`` in this process; its measurements as a dict."""
    tfpar_config, devices, stages, model = CONFIGS[name]
    v1.disable_eager_execution()
    graph = tf.Graph()
    with graph.as_default():
        if tfpar_config is not None:
            wh.init(tfpar_config)
        if model == "keras":
            feed, loss, train = build_keras(args, tfpar_config is not None)
        else:
            feed, loss, train = (build(args, stages) if model == "transformer"
                                 else build_gpt(args, stages, model == "gpt5"))
        init = v1.global_variables_initializer()
    start = time.perf_counter()
    sess = v1.Session(graph=graph, config=v1.ConfigProto(device_count={"CPU": devices}))
    sess.run(init)
    init_s = time.perf_counter() - start
    losses = [float(sess.run([loss, train], feed)[0])]
    startup_s = time.perf_counter() - start
    ops, graphdef_bytes = len(graph.get_operations()), graph.as_graph_def().ByteSize()
    times = []
    for i in range(WARMUP + args.steps):
        begin = time.perf_counter()
        losses.append(float(sess.run([loss, train], feed)[0]))
        if i >= WARMUP:
            times.append(time.perf_counter() - begin)
    sess.close()
    return {"startup_s": startup_s, "init_s": init_s, "step_s": statistics.median(times),
            "ops": ops, "graphdef_bytes": graphdef_bytes, "losses": losses[:2]}


def measure(name, args):
    """Run configuration ``name`` in a fresh process; its measurements (None on failure)."""
    return run_configuration(__file__, "startup", name, args, SIZES,
                             ("startup_s", "init_s", "step_s", "ops", "graphdef_bytes", "losses"))


def same_loss(r, plain) -> bool:
    """Whether configuration ``r`` has plain TF's step-0 and step-1 losses (rtol ``RTOL``)."""
    return r["losses"] is not None and plain["losses"] is not None and all(
        math.isclose(a, b, rel_tol=RTOL) for a, b in zip(r["losses"], plain["losses"]))


def plain_of(name):
    """The plain TF configuration of ``name``'s model."""
    return PLAIN[CONFIGS[name][3]]


def rows_of(results):
    """Table rows: the measurements, their ratios to plain TF on the same model
    and the loss check."""
    rows = []
    for name, r in results.items():
        plain = results[plain_of(name)]
        rows.append({"config": name, **r, "startup_plain": ratio(r["startup_s"], plain["startup_s"]),
                     "step_ms": r["step_s"] and 1e3 * r["step_s"],
                     "step_plain": ratio(r["step_s"], plain["step_s"]),
                     "graphdef_mb": r["graphdef_bytes"] and r["graphdef_bytes"] / 2 ** 20,
                     "same_loss": same_loss(r, plain)})
    return rows


def targets(results):
    """(name, measured value, limit) per target of ``TARGETS``."""
    m8, m32, plain = results["pipe4_m8"], results["pipe4_m32"], results["plain"]
    v2 = results["pipe4v2_m8"]
    g8, g32 = results["gpt4_m8"], results["gpt4_m32"]
    return [("pipe4_m8 start-up / plain", ratio(m8["startup_s"], plain["startup_s"]),
             TARGETS["startup_m8_plain"]),
            ("pipe4v2_m8 start-up / plain", ratio(v2["startup_s"], plain["startup_s"]),
             TARGETS["startup_v2_m8_plain"]),
            ("pipe4_m32 / pipe4_m8 start-up", ratio(m32["startup_s"], m8["startup_s"]),
             TARGETS["startup_m32_m8"]),
            ("pipe4_m8 step / plain", ratio(m8["step_s"], plain["step_s"]),
             TARGETS["step_m8_plain"]),
            ("pipe4_m32 / pipe4_m8 ops", ratio(m32["ops"], m8["ops"]), TARGETS["ops_m32_m8"]),
            ("gpt4_m8 start-up / gpt_plain",
             ratio(g8["startup_s"], results["gpt_plain"]["startup_s"]),
             TARGETS["gpt_startup_m8_plain"]),
            ("gpt4_m32 / gpt4_m8 ops", ratio(g32["ops"], g8["ops"]), TARGETS["gpt_ops_m32_m8"]),
            ("gpt5_m8 start-up / gpt_plain",
             ratio(results["gpt5_m8"]["startup_s"], results["gpt_plain"]["startup_s"]),
             TARGETS["gpt5_startup_m8_plain"]),
            ("keras_split2_sp / keras_split2 start-up",
             ratio(results["keras_split2_sp"]["startup_s"], results["keras_split2"]["startup_s"]),
             TARGETS["keras_startup_sp_split"])]


def print_table(rows, found, args):
    print(f"tfpar start-up (transformer {args.layers}x{args.hidden}, {HEADS} heads, seq "
          f"{args.seq}, Adam; gpt: the same with tied {args.vocab}-token embeddings; global "
          f"batch {args.batch}; step: median of {args.steps} steps; / plain: against plain TF "
          "on the same model)")
    widths = [max(len(title), 8) for title, _, _ in COLUMNS]
    print("  ".join(f"{title:>{w}}" for (title, _, _), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(f"{cell(r[key], fmt):>{w}}" for (_, key, fmt), w in zip(COLUMNS, widths)))
    for name, value, limit in found:
        print(f"{name:<32} {cell(value, '.3f'):>7}  <= {limit:<4}  "
              f"{'met' if meets(value, limit) else 'NOT MET'}")


def parse_args(argv):
    p, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv,
                          "exit 1 when a target is missed or a loss differs from plain TF's",
                          "tiny model (smoke test, about 2 minutes)",
                          parents=[worker_option(CONFIGS)])
    if 2 * args.layers < STAGES or args.hidden % HEADS or args.batch % 32 or args.steps < 1:
        p.error(f"--layers must be >= {STAGES // 2}, --hidden a multiple of {HEADS}, --batch "
                "of 32, --steps >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(run_worker(args.worker, args)))
        return 0
    results = {name: measure(name, args) for name in CONFIGS}
    return report(rows_of(results), targets(results), args, SIZES, print_table)


if __name__ == "__main__":
    sys.exit(main())
