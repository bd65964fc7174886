"""tfpar memory: peak memory of a training step measured by TensorFlow's
allocator, with and without a memory technique, next to the planner's estimate.

A GPT (``tfpar.models.gpt.gpt_train_op``: pre-LN blocks ``layer_0``.., 16
heads, Adam) on one
device, float32. Per row, one step after a warm-up step (variables and Adam's
slots already allocated): "measured" is the allocator's peak during the step
minus what it held before (TensorFlow's BFC allocator on the CPU,
``TF_CPU_ALLOCATOR_USE_BFC``, read by ``tf.config.experimental.get_memory_info``),
i.e. the activations kept for the backward pass, the gradients and the
kernels' temporaries. Two estimates (``planner.memory.recomputation`` on the
graph's ``ModelView``), each the activations of the global batch kept for
the backward pass plus the block being rebuilt (recomputation), plus one
gradient per weight (as the search counts them: the weights and Adam's
slots are there before the step):

  * "search": what ``auto_parallel`` counts - what a backward op that
    waits for the gradient reads (``ModelView.kept``; a backward op that
    reads forward tensors only runs during the forward pass);
  * "every output": every forward op's output kept, what the search
    counted before (``activation_bytes``), for comparison.

Rows:

  * plain: tfpar on one device, nothing recomputed;
  * recompute: ``memory.recompute`` on every block (the planner's ``full``
    mode: a block keeps its input only);
  * bf16: ``memory.mixed_precision`` "bf16" (where oneDNN computes bf16):
    the estimates count activations at ``planner.memory.MIXED_ACTIVATIONS``
    of their float32 bytes, as the search does.

Targets (``--check``): the "search" estimate within 25% of measured per
row; recomputation lowers the measured peak. The measured peak varies from
run to run with the executor's order (recompute at the default size: 125 to
173 MiB seen); the estimates leave out the gradients in flight inside a
block's backward pass (attention's s x s ones) and count every weight's
gradient at once (the step applies each as it comes).

A second table: ZeRO (``memory.zero`` 0, 1, 2) on 2 mirrored replicas
(``communication.backend`` "collective"), the same GPT with an unknown
batch dimension. Logical CPU devices share one allocator, so it holds both
replicas: "allocator" is what it holds after initialization and one step,
minus what it held before (the weights and Adam's slots of both replicas,
and what the step leaves behind); "estimate" is the planner's state
summed over the replicas (``planner.memory.state_bytes``: weights,
gradients, 2 slots per weight, ZeRO dividing the slots, and at stage 2 the
gradients, among the replicas); "largest device" is the weights and slots
the rewritten graph places on its fullest device, next to the planner's
weights and slots for one. Target: allocator within 25% of the estimate
per row. Optimizer offload moves state between
devices of the one allocator, so it is not a row.

A third table, simulated (the planner's models, nothing run): Whale's
hardware-aware balance on mixed devices, each as the step of even work over
the step of balanced work (Whale reports 1.3-1.4x): replicas taking batch
rows by speed on a V100 and a P100 (``planner.balance.balance_load``); a
split layer of 16 columns cut by speed there (``patterns.sharded.slice_offsets``
with the devices' shares); 48 layers in 4 stages on 2 V100s and 2 P100s, 32
micro-batches of 1F1B (``balance_stages``); and the zero-bubble schedule's
bubble next to 1F1B's, 4 stages and 8 micro-batches (1F1B's is (p-1)/(m+p-1)
= 27.3%). Target: zero-bubble's bubble at most half of 1F1B's.

    python benchmarks/memory.py [--check] [--json] [--quick] [--layers N] [--batch N]

(2 cores: about 40 s; ``--quick``: 2 layers, 10 s.)
"""
import collections
import dataclasses
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"  # allocator statistics on the CPU
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.cluster.hardware import CATALOG  # noqa: E402
from tfpar.hooks.capture import capture_for  # noqa: E402
from tfpar.patterns.sharded import slice_offsets  # noqa: E402
from tfpar.planner.balance import (  # noqa: E402
    balance_load, balance_stages, integer_shares, step_time)
from tfpar.planner.memory import (  # noqa: E402
    MIXED_ACTIVATIONS, SLOTS, recomputation, state_bytes)
from tfpar.ir.schedule import build_schedule  # noqa: E402
from tfpar.ir.simulate import simulate  # noqa: E402
from tfpar.analysis.model_view import model_view  # noqa: E402
from tfpar.analysis.graph_index import GraphIndex  # noqa: E402
from tfpar.analysis.variables import variable_bytes  # noqa: E402
from tfpar.runtime.precision import onednn_computes_bf16  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, report  # noqa: E402
from tfpar.models.gpt import gpt_train_op  # noqa: E402

v1 = tf.compat.v1
SIZES = {"layers": (4, 2, "GPT blocks"), "batch": (8, 4, "sequences a step")}
HIDDEN, SEQ, VOCAB, HEADS = 256, 256, 2048, 16
MIB = 2 ** 20
TOLERANCE = 0.25
ROWS = (("plain", False, None), ("recompute", True, None), ("bf16", False, "bf16"))


def measure(layers, batch, recompute, precision=None):
    """Peak bytes of one step above what the step starts with: measured, and
    the "search" and "every output" estimates (activations at
    ``MIXED_ACTIVATIONS`` of their bytes with mixed ``precision``, as the
    search counts them)."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 1, "memory.mixed_precision": precision,
                 "memory.recompute": [f"layer_{i}" for i in range(layers)] if recompute else []})
        train_op = gpt_train_op(layers, HIDDEN, SEQ, VOCAB, HEADS, batch=batch)
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
    every_output = dataclasses.replace(view, kept_bytes=None)
    gradients = sum(view.param_bytes)
    rows = batch * (MIXED_ACTIVATIONS if precision else 1.0)
    return (measured, rows * _activations(view, mode) + gradients,
            rows * _activations(every_output, mode) + gradients)


def measure_zero(layers, batch, zero):
    """(allocator bytes held after init and a step, {device: weight and slot
    bytes placed there}, weight bytes) for 2 mirrored replicas at ZeRO
    stage ``zero``."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2, "communication.backend": "collective",
                 "memory.zero": zero})
        train_op = gpt_train_op(layers, HIDDEN, SEQ, VOCAB, HEADS)
        weights = sum(variable_bytes(v.op.outputs[0]) for v in v1.trainable_variables())
        ids = np.random.RandomState(0).randint(0, VOCAB, size=(batch, SEQ)).astype(np.int32)
        feed = {graph.get_tensor_by_name("ids:0"): ids, graph.get_tensor_by_name("labels:0"): ids}
        with v1.Session() as session:
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            session.run(v1.global_variables_initializer())
            session.run(train_op, feed)
            held = tf.config.experimental.get_memory_info("CPU:0")["current"] - before
        placed = collections.Counter()
        for op in graph.get_operations():
            if op.type == "VarHandleOp":
                placed[op.device] += variable_bytes(op.outputs[0])
        wh.reset()
    return held, placed, weights


def _activations(view, mode):
    """Bytes per row kept for the backward pass, and rebuilt at once, in ``mode``."""
    terms = recomputation(view)
    return sum(terms.kept[mode]) + terms.transient_bytes(mode, range(len(view.flops)))


def simulated_rows():
    """Rows of the simulated table (see the module docstring): baseline and
    tfpar step times (or bubbles) and baseline / tfpar."""
    v100, p100 = CATALOG["V100-32GB"], CATALOG["P100-16GB"]
    pair = [v100.flops_per_s("fp32"), p100.flops_per_s("fp32")]
    rows_by_speed = balance_load(pair, [32 * 2 ** 30, 16 * 2 ** 30], batch_bytes=2 ** 30).ratios
    columns = slice_offsets(16, 2, integer_shares(pair)) + [16]
    four = [v100.flops_per_s("fp32")] * 2 + [p100.flops_per_s("fp32")] * 2
    stages, _ = balance_stages([1.0] * 48, [0.0] * 48, [0.0] * 48, [4, 3, 2, 1], four,
                               [32.0, 32.0, 16.0, 16.0])

    def pipeline(sizes):
        forward = [1e12 * n / speed for n, speed in zip(sizes, four)]
        return simulate(build_schedule("1f1b", 4, 32), forward,
                        [2 * f for f in forward]).length

    bubble = {name: simulate(build_schedule(name, 4, 8), [1.0] * 4, [2.0] * 4).bubble_fraction
              for name in ("1f1b", "zero_bubble")}
    pairs = [
        ("replicas by speed, V100 + P100", step_time([0.5, 0.5], pair, 1e12),
         step_time(rows_by_speed, pair, 1e12)),
        ("split shards by speed, V100 + P100", step_time([0.5, 0.5], pair, 1e12),
         step_time([(b - a) / 16 for a, b in zip(columns, columns[1:])], pair, 1e12)),
        ("stages by speed, 2 V100 + 2 P100", pipeline([12] * 4),
         pipeline([stages.count(i) for i in range(4)])),
        ("bubble, 1f1b vs zero_bubble", bubble["1f1b"], bubble["zero_bubble"])]
    return [{"simulated": name, "baseline": base, "tfpar": ours, "ratio": base / ours}
            for name, base, ours in pairs]


def print_table(rows, found, args):
    zero_rows = [r for r in rows if "zero" in r]
    simulated = [r for r in rows if "simulated" in r]
    rows = [r for r in rows if "zero" not in r and "simulated" not in r]
    print(f"tfpar memory (GPT {args.layers} blocks, hidden {HIDDEN}, sequence {SEQ}, batch "
          f"{args.batch}, float32 weights, one CPU device): peak of a step above its start")
    print(f"{'technique':<10} {'measured MiB':>12} {'search MiB':>10} {'search/meas':>11} "
          f"{'every output MiB':>16} {'every/meas':>10}")
    for r in rows:
        print(f"{r['technique']:<10} {r['measured_mib']:>12.1f} {r['search_mib']:>10.1f} "
              f"{r['search_ratio']:>11.3f} {r['every_mib']:>16.1f} {r['every_ratio']:>10.3f}")
    print(f"\nZeRO over 2 mirrored replicas (same GPT, batch {args.batch} split in 2): "
          "weights and Adam slots")
    print(f"{'stage':<6} {'allocator MiB':>13} {'estimate MiB':>12} {'alloc/est':>9} "
          f"{'largest device MiB':>18} {'weights+slots est':>17}")
    for r in zero_rows:
        print(f"{r['zero']:<6} {r['allocator_mib']:>13.1f} {r['estimate_mib']:>12.1f} "
              f"{r['ratio']:>9.3f} {r['largest_device_mib']:>18.1f} "
              f"{r['estimate_device_mib']:>17.1f}")
    print("\nsimulated (the planner's models): even work (or 1F1B) vs tfpar's")
    print(f"{'':<36} {'baseline':>10} {'tfpar':>10} {'ratio':>6}")
    for r in simulated:
        print(f"{r['simulated']:<36} {r['baseline']:>10.4g} {r['tfpar']:>10.4g} "
              f"{r['ratio']:>6.2f}")
    for name, value, limit in found:
        judged = "" if limit is None else (
            f"<= {limit:<4}  {'met' if meets(value, limit) else 'NOT MET'}")
        print(f"{name:<48} {cell(value, '.3f'):>7}  {judged}".rstrip())


def main(argv):
    _, args = parse_sizes(__doc__.splitlines()[0], SIZES, argv,
                          "exit 1 unless every target is met")
    rows = []
    for name, recompute, precision in ROWS:
        if precision == "bf16" and not onednn_computes_bf16():
            print("bf16: TensorFlow's oneDNN kernels compute no bf16 on this CPU: no row")
            continue
        measured, search, every = measure(args.layers, args.batch, recompute, precision)
        rows.append({"technique": name, "measured_mib": measured / MIB,
                     "search_mib": search / MIB, "search_ratio": search / measured,
                     "every_mib": every / MIB, "every_ratio": every / measured})
    found = [(f"{r['technique']}: |search / measured - 1|", abs(r["search_ratio"] - 1),
              TOLERANCE) for r in rows]
    found.append(("recompute / plain measured peak",
                  rows[1]["measured_mib"] / rows[0]["measured_mib"], 1.0))
    for zero in (0, 1, 2):
        held, placed, weights = measure_zero(args.layers, args.batch, zero)
        estimate = 2 * state_bytes(weights, 2, zero)
        placed_estimate = weights + SLOTS * weights / (2 if zero else 1)
        rows.append({"zero": zero, "allocator_mib": held / MIB, "estimate_mib": estimate / MIB,
                     "ratio": held / estimate, "largest_device_mib": max(placed.values()) / MIB,
                     "estimate_device_mib": placed_estimate / MIB})
        found.append((f"ZeRO-{zero}: |allocator / estimate - 1|", abs(held / estimate - 1),
                      TOLERANCE))
    simulated = simulated_rows()
    rows += simulated
    found += [(f"{r['simulated']}: speed-up", r["ratio"], None) for r in simulated[:3]]
    found.append(("zero_bubble / 1f1b bubble", 1 / simulated[3]["ratio"], 0.5))
    return report(rows, found, args, SIZES, print_table, checks_ok=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
