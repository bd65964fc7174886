"""tfpar split benchmark: tensor parallelism of a large classifier head, measured in one run.

1. Bytes that cross devices in one training step of a ``--classes``-class dense
   head + sparse softmax cross-entropy in ``wh.split(8)`` on 8 logical CPU
   devices, with ``split.patterns`` forcing the head to ``column`` (Whale SP1)
   vs ``row`` (Whale SP2); Whale §5.1.4 reports SP1 ahead of SP2. Next to it:
   the matcher's own estimate, the sum over the split scope's ShardingUnits of
   the chosen pattern's ``cost(unit)`` (bytes per batch row; SP1 is the column
   dense layer plus the distributed cross-entropy, SP2 the row dense layer,
   whose whole output goes to TensorFlow's cross-entropy).
2. Step time of Whale Example 2 (``wh.replicate(4)`` backbone of ``--layers``
   dense layers + ``wh.split(4)`` head, one group of 4 logical CPUs) vs pure
   tfpar data parallelism (the whole model replicated on the same 4 CPUs),
   same model, initial weights, global batch and plain SGD; Whale Fig. 13
   reports the hybrid ahead of DP for big heads. For information, also the
   bytes each moves per step (measured as in 1).
3. A GPT-2-style stack of ``--blocks`` attention blocks written in raw ops
   (fused ``qkv`` cut by ``tf.split``, reshapes and transposes to
   ``--heads`` heads, ``tf.matmul`` scores, a causal mask, softmax, the
   output projection) in ``wh.split(4)`` (Megatron's attention: each device
   its heads) vs the same stack on one device: step time (informational:
   the logical CPUs share this machine's cores, so the split cannot run
   faster here), and the bytes that cross devices per step as traced (as in
   1) against what Megatron's split of a block must move: the column-split
   projection's input to the other devices and its input gradient back, the
   row-split projection's partial outputs and their gradient, each an
   activation ``[B, T, hidden]`` to or from each of the other ``n - 1``
   devices: ``4 (n - 1)`` activations a block (target: at most 1.25 times
   that; gathering q, k and v for a whole core would move more).
   ``--check`` also checks that both train from the same step-0 loss and that
   the cores were built by heads.

How cross-device bytes are measured: one step runs with
``RunOptions(trace_level=FULL_TRACE, output_partition_graphs=True)``. In TF 2.15
graph mode a DirectSession splits the graph per device and joins the pieces
with ``_Send``/``_Recv`` pairs (intra-process rendezvous on CPU; no
``_HostSend``, and the step stats record no Send/Recv nodes). Every ``_Send``
in ``run_metadata.partition_graphs`` is one tensor moved from its
``send_device`` to its ``recv_device``; its size is the runtime shape x dtype
of the tensor it sends, read from ``run_metadata.step_stats``: the sending
device's NodeExecStats of the ``_Send``'s input node, ``output[slot]
.tensor_description``. Control edges cross as empty dummy tensors (0 bytes);
fed tensors distributed from CPU:0 count like any other transfer.

The machine may be noisy, so the two sides of a step-time ratio run alternately
(ABBA order, ``--reps`` rounds of ``--steps`` timed steps per side) and their
medians are compared; tfpar's hooks are on only while a side runs.

Targets (``TARGETS``, A / B at most): bytes per step SP1 / SP2 1.0 (SP1 ahead, as
Whale §5.1.4), step time hybrid / DP 1.0 (hybrid ahead, as Whale Fig. 13), raw-op
attention bytes traced / Megatron's 1.25; the hybrid / DP bytes row and the
raw-op attention step time are informational. ``--check`` prints PASS/FAIL per target
and exits 1 when one is missed or when a setup does not train (loss falls, each
pair from the same step-0 loss).

    python benchmarks/split.py [--quick] [--check] [--json]
"""
import contextlib
import math
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TF loads: no per-trace profiler logs
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.hooks import split_patches  # noqa: E402
from tfpar.patterns import dense as dense_patterns, matcher  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import meets, parse_sizes  # noqa: E402  (same directory)
from overhead import CHECK_HELP, Trainer, alternate, finish, print_checks  # noqa: E402

v1 = tf.compat.v1

SPLIT_CPUS = 8  # logical CPU devices of measurement 1 (the process has this many)
HYBRID_CPUS = 4  # logical CPU devices of measurement 2
LR = 0.1
# Targets of the A / B ratios (at most), by measurement.
TARGETS = {"sp1_sp2_bytes": 1.0, "hybrid_dp_step": 1.0, "raw_attention_bytes": 1.25}
SIZES = {"steps": (10, 2, "timed steps per side per round"), "reps": (5, 3, "ABBA rounds"),
         "classes": (100000, 10000, "classes of the split head"),
         "hidden": (256, 64, "backbone width = head input size"),
         "layers": (3, 2, "backbone dense layers (measurement 2)"),
         "batch": (64, 32, "global batch, step time (measurement 2)"),
         "comm_batch": (16, 16, "batch of the traced step (measurement 1)"),
         "blocks": (2, 1, "attention blocks (measurement 3)"),
         "heads": (8, 4, "attention heads (measurement 3)"),
         "seq": (64, 16, "sequence length (measurement 3)")}


def head_kernel(hidden, classes, seed=1234):
    """Fixed numpy initial values of the head (tfpar slices them per shard)."""
    rng = np.random.RandomState(seed)
    return (rng.randn(hidden, classes) / math.sqrt(hidden)).astype(np.float32)


def classifier_builder(layers, classes, backbone_scope=None, head_scope=None, kernel=None):
    """build(x, y) -> (loss, train_op): ``layers`` ReLU dense layers (op-seeded initial
    values) under ``backbone_scope``, then a ``classes``-way dense head named "logits"
    and sparse softmax cross-entropy under ``head_scope``; plain SGD. The head starts
    from ``kernel`` (numpy) when given, else from a seeded Glorot initializer."""
    def scope(factory):
        return factory() if factory is not None else contextlib.nullcontext()

    def build(x, y):
        h = x
        with scope(backbone_scope):
            for i in range(layers):
                h = v1.layers.dense(h, int(x.shape[-1]), tf.nn.relu, name=f"backbone{i}",
                                    kernel_initializer=v1.glorot_uniform_initializer(seed=i))
        init = (v1.constant_initializer(kernel) if kernel is not None
                else v1.glorot_uniform_initializer(seed=layers))
        with scope(head_scope):
            logits = v1.layers.dense(h, classes, name="logits", kernel_initializer=init)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(LR).minimize(loss)
    return build


@contextlib.contextmanager
def matcher_costs(costs):
    """While building, append (unit name, chosen pattern, cost in bytes per row) to
    ``costs`` for every ShardingUnit the matcher decides."""
    modules = (split_patches, dense_patterns)  # every module that calls the matcher
    original = matcher.choose

    def choose(ctx, unit, candidates):
        pattern = original(ctx, unit, candidates)
        costs.append((unit.name, pattern.name, float(pattern.cost(unit))))
        return pattern
    for module in modules:
        module.choose = choose
    try:
        yield costs
    finally:
        for module in modules:
            module.choose = original


def cross_device_bytes(trainer):
    """(bytes, transfers) that cross devices in one traced training step of ``trainer``."""
    md = v1.RunMetadata()
    options = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE, output_partition_graphs=True)
    with trainer.hooks():
        trainer.sess.run(trainer.fetches, trainer.feed, options=options, run_metadata=md)
    outputs = {(dev.device, node.node_name): {o.slot: o.tensor_description for o in node.output}
               for dev in md.step_stats.dev_stats for node in dev.node_stats}
    total = transfers = 0
    for partition in md.partition_graphs:
        for node in partition.node:
            if node.op not in ("_Send", "_HostSend"):
                continue
            source, _, slot = node.input[0].lstrip("^").partition(":")
            desc = outputs.get((node.device, source), {}).get(int(slot or 0))
            if desc is None:
                raise RuntimeError(f"no step stats for {node.input[0]} on {node.device} "
                                   f"(sent by {node.name})")
            total += math.prod(d.size for d in desc.shape.dim) * tf.as_dtype(desc.dtype).size
            transfers += 1
    return total, transfers


def make_data(batch, hidden, classes, seed=0):
    """A fixed batch: random features and labels over all classes."""
    rng = np.random.RandomState(seed)
    return rng.randn(batch, hidden).astype(np.float32), rng.randint(0, classes, batch)


def row(measurement, a, b, unit, labels, target=None, estimate=None):
    """A result row comparing ``a`` with ``b`` (``labels``); ``target`` None is informational."""
    ratio = a / b
    return {"measurement": measurement, "a": labels[0], "b": labels[1], "unit": unit,
            "a_value": a, "b_value": b, "ratio": ratio, "target": target,
            "met": meets(ratio, target), "estimate": estimate}


def measure_patterns(args, trainers):
    """1. Cross-device bytes per step of the split head: SP1 (column) vs SP2 (row)."""
    data = make_data(args.comm_batch, args.hidden, args.classes)
    build = classifier_builder(1, args.classes, head_scope=lambda: wh.split(SPLIT_CPUS),
                               kernel=head_kernel(args.hidden, args.classes))
    measured, estimates, patterns = {}, {}, {}
    for pattern in ("column", "row"):
        costs = []
        with matcher_costs(costs):
            t = Trainer(f"split x{SPLIT_CPUS} {pattern}", build, data,
                        {"cluster.num_devices": SPLIT_CPUS,
                         "split.patterns": {"logits": pattern}}, warmup=2)
        trainers.append(t)
        measured[pattern], _ = cross_device_bytes(t)
        estimates[pattern] = sum(cost for _, _, cost in costs)
        patterns[pattern] = {name: chosen for name, chosen, _ in costs}
    estimate = {"sp1_bytes_per_row": estimates["column"], "sp2_bytes_per_row": estimates["row"],
                "ratio": estimates["column"] / estimates["row"],
                "sp1_patterns": patterns["column"], "sp2_patterns": patterns["row"]}
    return row(f"bytes/step, SP1 vs SP2 ({args.classes}-class head, {SPLIT_CPUS} CPUs, "
               f"batch {args.comm_batch})", measured["column"], measured["row"], "B",
               ("SP1 column", "SP2 row"), TARGETS["sp1_sp2_bytes"], estimate)


def measure_hybrid(args, trainers):
    """2. Step time (and bytes) of replicate+split (Whale Example 2) vs pure DP."""
    data = make_data(args.batch, args.hidden, args.classes, seed=1)
    kernel = head_kernel(args.hidden, args.classes)
    hybrid = Trainer(f"hybrid x{HYBRID_CPUS}",
                     classifier_builder(args.layers, args.classes,
                                        lambda: wh.replicate(HYBRID_CPUS),
                                        lambda: wh.split(HYBRID_CPUS), kernel),
                     data, {"cluster.num_devices": HYBRID_CPUS})
    dp = Trainer(f"DP x{HYBRID_CPUS}", classifier_builder(args.layers, args.classes, kernel=kernel),
                 data, {"cluster.num_devices": HYBRID_CPUS})
    trainers += [hybrid, dp]
    t, b = alternate((hybrid.step, hybrid.hooks), (dp.step, dp.hooks), args.reps, args.steps)
    labels = ("hybrid", "DP")
    desc = f"{args.layers}x{args.hidden} backbone + {args.classes}-class head, {HYBRID_CPUS} CPUs"
    return [row(f"step time, hybrid vs DP ({desc}, batch {args.batch})", 1e3 * t, 1e3 * b, "ms",
                labels, TARGETS["hybrid_dp_step"]),
            row(f"bytes/step, hybrid vs DP ({desc}, batch {args.batch})",
                cross_device_bytes(hybrid)[0], cross_device_bytes(dp)[0], "B", labels)]


def attention_builder(blocks, heads, seq, hidden, scope=None):
    """build(x, y): x [B, seq * hidden] as ``blocks`` residual GPT-2-style
    attention blocks of raw ops (inside ``scope()`` when given), mean-pooled
    into a 3-class head; plain SGD; seeded initial values."""
    depth = hidden // heads

    def heads_first(t):
        return tf.transpose(tf.reshape(t, [-1, seq, heads, depth]), [0, 2, 1, 3])

    def build(x, y):
        h = tf.reshape(x, [-1, seq, hidden])
        causal = tf.linalg.band_part(tf.ones([seq, seq]), -1, 0)
        with scope() if scope is not None else contextlib.nullcontext():
            for i in range(blocks):
                with v1.variable_scope(f"h{i}"):
                    qkv = v1.layers.dense(h, 3 * hidden, name="c_attn",
                                          kernel_initializer=v1.glorot_uniform_initializer(seed=i))
                    q, k, v = map(heads_first, tf.split(qkv, 3, axis=-1))
                    w = tf.matmul(q, k, transpose_b=True) / math.sqrt(depth)
                    w = tf.nn.softmax(w * causal - 1e10 * (1.0 - causal))
                    o = tf.reshape(tf.transpose(tf.matmul(w, v), [0, 2, 1, 3]), [-1, seq, hidden])
                    h = h + v1.layers.dense(o, hidden, name="c_proj", kernel_initializer=(
                        v1.glorot_uniform_initializer(seed=100 + i)))
        logits = v1.layers.dense(tf.reduce_mean(h, 1), 3, name="logits",
                                 kernel_initializer=v1.glorot_uniform_initializer(seed=7))
        loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(LR).minimize(loss)
    return build


def measure_raw_attention(args, trainers):
    """3. Raw-op attention split by heads over 4 devices vs one device."""
    data = make_data(args.comm_batch, args.seq * args.hidden, 3, seed=2)
    split = Trainer(f"raw attention split x{HYBRID_CPUS}",
                    attention_builder(args.blocks, args.heads, args.seq, args.hidden,
                                      lambda: wh.split(HYBRID_CPUS)),
                    data, {"cluster.num_devices": HYBRID_CPUS})
    with split.sess.graph.as_default(), split.hooks():
        split.heads_built = [unit for tg in wh.current_plan().task_graphs
                             for unit, pattern in tg.patterns.items() if pattern == "heads"]
    one = Trainer("raw attention, 1 device",
                  attention_builder(args.blocks, args.heads, args.seq, args.hidden), data)
    trainers += [split, one]
    t, b = alternate((split.step, split.hooks), (one.step, one.hooks), args.reps, args.steps)
    desc = (f"{args.blocks} GPT-2 raw-op attention blocks, {args.heads} heads, seq {args.seq}, "
            f"hidden {args.hidden}, batch {args.comm_batch}")
    activation = 4 * args.comm_batch * args.seq * args.hidden  # float32 [B, T, hidden]
    megatron = args.blocks * 4 * (HYBRID_CPUS - 1) * activation
    return [row(f"step time, split x{HYBRID_CPUS} vs 1 device ({desc})", 1e3 * t, 1e3 * b, "ms",
                ("split", "1 device")),
            row(f"bytes/step, traced vs Megatron's ({desc})", cross_device_bytes(split)[0],
                megatron, "B", ("traced", "Megatron"), TARGETS["raw_attention_bytes"])]


def loss_checks(trainers):
    """Loss must fall for every setup (traced steps excluded); the two setups of each
    measurement must start from the same step-0 loss."""
    checks = []
    for pair in (trainers[0:2], trainers[2:4], trainers[4:6]):
        first = pair[0].losses[0]
        for t in pair:
            checks.append({"setup": t.name, "first_loss": t.losses[0], "last_loss": t.losses[-1],
                           "steps": len(t.losses), "ok": t.losses[-1] < t.losses[0]
                           and math.isclose(t.losses[0], first, rel_tol=1e-4)})
    heads = trainers[4].heads_built
    checks.append({"setup": f"{trainers[4].name}: cores built by heads",
                   "detail": f"{len(heads)} batched matmuls built by heads", "ok": bool(heads)})
    return checks


def _fmt(value, unit):
    if unit == "B":
        for scale, name in ((2 ** 20, "MiB"), (2 ** 10, "KiB")):
            if value >= scale:
                return f"{value / scale:.2f} {name}"
        return f"{value:.0f} B"
    return f"{value:.1f} {unit}"


def print_table(rows, checks, args):
    print(f"tfpar split (classes {args.classes}, hidden {args.hidden}; step times are medians of"
          f" {args.reps} rounds x {args.steps} steps)")
    width = max(len(r["measurement"]) for r in rows)
    print(f"{'measurement':<{width}}  {'A':>22}  {'B':>16}  {'A/B':>7}  target  met")
    for r in rows:
        print(f"{r['measurement']:<{width}}  {r['a']:>10} {_fmt(r['a_value'], r['unit']):>11}  "
              f"{r['b']:>4} {_fmt(r['b_value'], r['unit']):>11}  {r['ratio']:>7.4f}  "
              + (f"<= {r['target']:<4}  {'met' if r['met'] else 'not met'}"
                 if r["target"] is not None else "(info)"))
        e = r["estimate"]
        if e is not None:
            measured = (r["a_value"] / args.comm_batch, r["b_value"] / args.comm_batch)
            chosen = [", ".join(f"{u}={p}" for u, p in e[k].items())
                      for k in ("sp1_patterns", "sp2_patterns")]
            print(f"  matcher estimate: SP1 {e['sp1_bytes_per_row']:.0f} vs SP2 "
                  f"{e['sp2_bytes_per_row']:.0f} B/row, ratio {e['ratio']:.4f} (measured "
                  f"{measured[0]:.0f} vs {measured[1]:.0f} B/row); units: {chosen[0]} vs "
                  f"{chosen[1]}")
    print_checks(checks)


def parse_args(argv):
    p, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv, CHECK_HELP,
                          "small sizes (smoke test, < 60 s)")
    if args.batch % HYBRID_CPUS or min(args.steps, args.reps, args.layers, args.comm_batch) < 1:
        p.error(f"--batch must be a multiple of {HYBRID_CPUS}; "
                "--steps/--reps/--layers/--comm-batch >= 1")
    if args.classes < SPLIT_CPUS or args.hidden < SPLIT_CPUS:
        p.error(f"--classes and --hidden must be >= {SPLIT_CPUS}")
    return args


def main(argv=None):
    args = parse_args(argv)
    # Before anything initialises TF's context: SPLIT_CPUS logical CPUs.
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()]
                                               * SPLIT_CPUS)
    v1.disable_eager_execution()
    trainers = []
    rows = [measure_patterns(args, trainers), *measure_hybrid(args, trainers),
            *measure_raw_attention(args, trainers)]
    return finish(rows, trainers, args, print_table, loss_checks)


if __name__ == "__main__":
    sys.exit(main())
