"""tfpar memory: peak memory of a training step measured by TensorFlow's
allocator, with and without a memory technique, next to the planner's estimate.

A GPT (``planner.gpt_train_op``: pre-LN blocks ``layer_0``.., Adam) on one
device, float32. Per row, one step after a warm-up step (variables and Adam's
slots already allocated): "measured" is the allocator's peak during the step
minus what it held before (TensorFlow's BFC allocator on the CPU,
``TF_CPU_ALLOCATOR_USE_BFC``, read by ``tf.config.experimental.get_memory_info``),
i.e. the activations kept for the backward pass, the gradients and the
kernels' temporaries. "estimated" is the planner's model of the same
(``planner.memory.recomputation`` on the graph's ``ModelView``): the kept
activations of the global batch, the block being rebuilt (recomputation)
and one gradient per weight. Rows:

  * plain: tfpar on one device, nothing recomputed;
  * recompute: ``memory.recompute`` on every block (the planner's ``full``
    mode: a block keeps its input only).

Targets (``--check``): estimate within 25% of measured per row; recomputation
lowers the measured peak. Logical CPU devices share one allocator, so
per-device peaks of multi-device plans cannot be told apart here; ZeRO, mixed
precision and offload are not yet applied to graphs, so they are not rows.

    python benchmarks/memory.py [--check] [--json] [--quick] [--layers N] [--batch N]

(2 cores: about 20 s; ``--quick``: 2 layers, 5 s.)
"""
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocator statistics on the CPU
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.hooks.capture import capture_for  # noqa: E402
from tfpar.planner.memory import recomputation  # noqa: E402
from tfpar.rewriters.model_view import model_view  # noqa: E402
from tfpar.rewriters.select import GraphIndex  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, report  # noqa: E402
from planner import gpt_train_op  # noqa: E402

v1 = tf.compat.v1
SIZES = {"layers": (4, 2, "GPT blocks"), "batch": (8, 4, "sequences a step")}
HIDDEN, SEQ, VOCAB = 256, 256, 2048
MIB = 2 ** 20
TOLERANCE = 0.25


def measure(layers, batch, recompute):
    """(measured, estimated) peak bytes of one step above what the step starts with."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1,
                 "memory.recompute": [f"layer_{i}" for i in range(layers)] if recompute else []})
        train_op = gpt_train_op(layers, HIDDEN, SEQ, VOCAB, batch=batch)
        _, view = model_view(GraphIndex(graph), capture_for(graph))
        ids = np.random.RandomState(0).randint(0, VOCAB, size=(batch, SEQ)).astype(np.int32)
        feed = {graph.get_tensor_by_name("ids:0"): ids, graph.get_tensor_by_name("labels:0"): ids}
        with v1.Session() as session:
            session.run(v1.global_variables_initializer())
            session.run(train_op, feed)
            tf.config.experimental.reset_memory_stats("CPU:0")
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            session.run(train_op, feed)
            measured = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before
        wh.reset()
    mode = "full" if recompute else "none"
    terms = recomputation(view)
    everything = range(len(view.flops))
    activations = batch * (sum(terms.kept[mode]) + terms.transient_bytes(mode, everything))
    return measured, activations + sum(view.param_bytes)


def print_table(rows, found, args):
    print(f"tfpar memory (GPT {args.layers} blocks, hidden {HIDDEN}, sequence {SEQ}, batch "
          f"{args.batch}, float32, one CPU device): peak of a step above its start")
    print(f"{'technique':<10} {'measured MiB':>12} {'estimated MiB':>13} {'est. / meas.':>12}")
    for r in rows:
        print(f"{r['technique']:<10} {r['measured_mib']:>12.1f} {r['estimated_mib']:>13.1f} "
              f"{r['ratio']:>12.3f}")
    for name, value, limit in found:
        print(f"{name:<40} {cell(value, '.3f'):>7}  <= {limit:<4}  "
              f"{'met' if meets(value, limit) else 'NOT MET'}")


def main(argv):
    _, args = parse_sizes(__doc__.splitlines()[0], SIZES, argv,
                          "exit 1 unless every target is met")
    rows = []
    for name, recompute in (("plain", False), ("recompute", True)):
        measured, estimated = measure(args.layers, args.batch, recompute)
        rows.append({"technique": name, "measured_mib": measured / MIB,
                     "estimated_mib": estimated / MIB, "ratio": estimated / measured})
    found = [(f"{r['technique']}: |estimate / measured - 1|", abs(r["ratio"] - 1), TOLERANCE)
             for r in rows]
    found.append(("recompute / plain measured peak",
                  rows[1]["measured_mib"] / rows[0]["measured_mib"], 1.0))
    return report(rows, found, args, SIZES, print_table, checks_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
