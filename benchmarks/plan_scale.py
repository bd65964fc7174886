"""tfpar plan scale: GPTs of 1.7B-1T parameters on 32-3072 A100s vs Megatron-LM's runs.

Each row is a row of Narayanan et al. (SC'21), Table 1 (weak scaling: its
parameters, layers, hidden size, heads, tensor x pipeline degrees, GPUs,
global batch and measured model TFLOP/s per GPU). Its GPT (sequence 2048,
vocabulary 51200, the static global batch; ``planner.gpt_train_op``: TF1
layers, Adam ``minimize``) is built in a fresh graph and planned for the
paper's cluster, described and not present: DGX A100 nodes of 8 80-GB A100s
(the catalog's ``A100-80GB``: NVLink 300 GB/s within a node, 25 GB/s per GPU
between nodes), the graph's float32 as TF32, all of the planner's techniques
allowed (micro-batch counts, pipeline schedules, activation recomputation,
ZeRO, mixed precision, head-split attention). Per row:

  * build s: TensorFlow building the graph;
  * plan s: reading it (``model_view``) and the whole search
    (``auto.search_all`` over every data x tensor x pipeline mesh, then
    ``choose``), and plan / build;
  * chosen: the plan and its estimated model TFLOP/s per GPU, by the paper's
    Eq. 3: 96 B s l h^2 (1 + s / 6h + V / 16lh) FLOPs per step (it counts
    the forward pass that full recomputation runs again) / (step x GPUs);
  * published: the paper's tensor x pipeline (data = GPUs / both) and its
    measured TFLOP/s per GPU;
  * pinned: tfpar's estimate of the published configuration: its mesh, 1F1B,
    full recomputation and mixed precision as the paper ran (micro-batch
    count searched).

Targets per row (``--check``: PASS/FAIL per target, exit 1 when one is missed):
pinned / published TFLOP/s within 15% (calibration); the chosen plan at least
as fast as the pinned one (chosen step / pinned step <= 1); the chosen plan
fits 80 GB; plan s / build s <= 0.25.

    python benchmarks/plan_scale.py [--check] [--json] [--rows 1.7B,145.6B]

(2 cores: about 16 minutes for all ten rows, most of it TensorFlow building
the graphs - 24 s for the 1.7B, 161 s for the 1T; ``--quick``: the 1.7B and
3.6B rows, about 1.5 minutes.)
"""
import argparse
import dataclasses
import gc
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.cluster.hardware import CATALOG  # noqa: E402
from tfpar.hooks.capture import capture_for  # noqa: E402
from tfpar.planner.auto import choose, search_all  # noqa: E402
from tfpar.planner.memory import Techniques  # noqa: E402
from tfpar.rewriters.model_view import model_view  # noqa: E402
from tfpar.rewriters.select import GraphIndex  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, parse_sizes, report  # noqa: E402  (same directory)
from planner import gpt_train_op  # noqa: E402

SEQ, VOCAB = 2048, 51200
HARDWARE = dataclasses.replace(CATALOG["A100-80GB"], devices_per_node=8)
TECHNIQUES = ("recompute", "zero", "mixed_precision")
PUBLISHED_TECHNIQUES = Techniques("full", 0, True)
SEARCH_LIMIT_S = 600
# Narayanan et al. SC'21 Table 1: name -> (layers, hidden, heads, tensor,
# pipeline, GPUs, global batch, measured model TFLOP/s per GPU).
TABLE = {"1.7B": (24, 2304, 24, 1, 1, 32, 512, 137),
         "3.6B": (30, 3072, 32, 2, 1, 64, 512, 138),
         "7.5B": (36, 4096, 32, 4, 1, 128, 512, 142),
         "18.4B": (40, 6144, 48, 8, 1, 256, 1024, 135),
         "39.1B": (48, 8192, 64, 8, 2, 512, 1536, 138),
         "76.1B": (60, 10240, 80, 8, 4, 1024, 1792, 140),
         "145.6B": (80, 12288, 96, 8, 8, 1536, 2304, 148),
         "310.1B": (96, 16384, 128, 8, 16, 1920, 2160, 155),
         "529.6B": (105, 20480, 128, 8, 35, 2520, 2520, 163),
         "1T": (128, 25600, 160, 8, 64, 3072, 3072, 163)}
QUICK = ("1.7B", "3.6B")
# Targets (at most): |pinned / published - 1|, chosen / pinned step, plan / build.
TARGETS = {"calibration": 0.15, "chosen_pinned": 1.0, "plan_build": 0.25}
COLUMNS = [("model", "model", ""), ("GPUs", "gpus", "d"), ("build s", "build_s", ".1f"),
           ("plan s", "plan_s", ".1f"), ("plan/build", "plan_build", ".2f"),
           ("chosen", "chosen", ""), ("TFLOP/s", "chosen_tflops", ".0f"),
           ("GiB", "chosen_gib", ".1f"), ("published", "published", ""),
           ("measured", "published_tflops", ".0f"), ("pinned", "pinned", ""),
           ("pinned TFLOP/s", "pinned_tflops", ".0f"), ("pinned/meas.", "calibration", ".2f")]


def model_flops(layers, hidden, batch):
    """FLOPs of one training step by Narayanan et al.'s Eq. 3."""
    return 96 * batch * SEQ * layers * hidden ** 2 * (
        1 + SEQ / (6 * hidden) + VOCAB / (16 * layers * hidden))


def build_view(layers, hidden, heads, batch):
    """(model view of the GPT's training graph, seconds building it took)."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            wh.init({"cluster.num_devices": 1})
            start = time.perf_counter()
            gpt_train_op(layers, hidden, SEQ, VOCAB, heads, batch)
            build_s = time.perf_counter() - start
            start = time.perf_counter()
            _, view = model_view(GraphIndex(graph), capture_for(graph))
            view_s = time.perf_counter() - start
    finally:
        wh.reset()
        del graph
        gc.collect()
    return dataclasses.replace(view, compute_dtype="tf32"), build_s, view_s


def measure(name):
    """One result row: build, plan everything, estimate the published configuration."""
    layers, hidden, heads, t, p, gpus, batch, measured = TABLE[name]
    print(f"plan_scale: {name} on {gpus} GPUs ...", file=sys.stderr, flush=True)
    view, build_s, view_s = build_view(layers, hidden, heads, batch)
    start = time.perf_counter()
    chosen = choose(search_all(view, gpus, HARDWARE, batch, None, time_limit_s=SEARCH_LIMIT_S,
                               techniques=TECHNIQUES, split_heads=True), HARDWARE)
    plan_s = view_s + time.perf_counter() - start
    pinned = next(c for c in search_all(view, gpus, HARDWARE, batch, None, pipeline=p,
                                        time_limit_s=SEARCH_LIMIT_S,
                                        techniques=[PUBLISHED_TECHNIQUES], split_heads=True,
                                        schedules=("1f1b",))
                  if c.tensor == t)
    flops = model_flops(layers, hidden, batch)
    pinned_tflops = flops / (pinned.step_time_s * gpus) / 1e12
    return {"model": name, "gpus": gpus, "batch": batch, "build_s": build_s, "plan_s": plan_s,
            "plan_build": plan_s / build_s, "chosen": chosen.describe(),
            "chosen_tflops": flops / (chosen.step_time_s * gpus) / 1e12,
            "chosen_step_s": chosen.step_time_s, "chosen_gib": chosen.memory_bytes / 2 ** 30,
            "fits": chosen.memory_bytes <= HARDWARE.memory_gb * 2 ** 30,
            "published": f"data {gpus // (t * p)} x tensor {t} x pipeline {p}",
            "published_tflops": measured, "pinned": pinned.describe(),
            "pinned_step_s": pinned.step_time_s, "pinned_tflops": pinned_tflops,
            "calibration": pinned_tflops / measured,
            "chosen_pinned": chosen.step_time_s / pinned.step_time_s}


def targets(rows):
    """(name, value, limit) of every judged check of every row."""
    found = []
    for r in rows:
        where = f"{r['model']} on {r['gpus']} GPUs"
        found += [(f"{where}: |pinned / published TFLOP/s - 1|", abs(r["calibration"] - 1),
                   TARGETS["calibration"]),
                  (f"{where}: chosen / pinned step", r["chosen_pinned"], TARGETS["chosen_pinned"]),
                  (f"{where}: chosen fits 80 GB (1 = no)", float(not r["fits"]), 0.0),
                  (f"{where}: plan / build", r["plan_build"], TARGETS["plan_build"])]
    return found


def print_table(rows, _found, _args):
    print(f"tfpar plan scale (GPT, sequence {SEQ}, vocabulary {VOCAB}; {HARDWARE.name}, "
          "8 per node; TFLOP/s per GPU by Megatron-LM's Eq. 3)")
    for r in rows:
        print(f"{r['model']} on {r['gpus']} GPUs, batch {r['batch']}: built in "
              f"{r['build_s']:.1f} s, planned in {r['plan_s']:.1f} s "
              f"({r['plan_build']:.2f} of the build)")
        print(f"  chosen     {r['chosen']}: {r['chosen_step_s']:.2f} s/step, "
              f"{r['chosen_tflops']:.0f} TFLOP/s, {r['chosen_gib']:.1f} GiB per GPU")
        print(f"  published  {r['published']}: {r['published_tflops']} TFLOP/s measured")
        print(f"  pinned     {r['pinned']}: {r['pinned_step_s']:.2f} s/step, "
              f"{r['pinned_tflops']:.0f} TFLOP/s = {r['calibration']:.2f} x measured")
    short = [c for c in COLUMNS if c[1] not in ("chosen", "pinned", "published")]
    widths = [max(len(title), *(len(cell(r[key], fmt)) for r in rows)) for title, key, fmt in short]
    print("  ".join(f"{title:>{w}}" for (title, _, _), w in zip(short, widths)))
    for r in rows:
        print("  ".join(f"{cell(r[key], fmt):>{w}}" for (_, key, fmt), w in zip(short, widths)))


def parse_args(argv):
    rows = argparse.ArgumentParser(add_help=False)
    rows.add_argument("--rows", help=f"comma-separated models of {', '.join(TABLE)} "
                                     "(default all; --quick: " + ", ".join(QUICK) + ")")
    p, args = parse_sizes(__doc__.split("\n", 1)[0], {}, argv, "exit 1 when a row misses a "
                          "target", "the " + " and ".join(QUICK) + " rows only", parents=[rows])
    names = args.rows.split(",") if args.rows else list(QUICK if args.quick else TABLE)
    unknown = [n for n in names if n not in TABLE]
    if unknown:
        p.error(f"--rows: unknown {', '.join(unknown)} (known: {', '.join(TABLE)})")
    args.names = names
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = [measure(name) for name in args.names]
    return report(rows, targets(rows), args, {}, print_table, checks_ok=True)


if __name__ == "__main__":
    sys.exit(main())
