"""tfpar planner benchmark: the planner on GPT-style training graphs (no session).

For each depth in ``--layers`` a GPT is built in a fresh graph under
``wh.init({"cluster.num_devices": 8})``: token + position embedding, pre-LN
transformer layers (``ln1``, ``attention`` with v1 dense q/k/v/out and 16
heads, ``ln2``, gelu MLP ``fc1``/``fc2``), ``ln_final``, an ``lm_head``
projection, sparse softmax cross-entropy and ``AdamOptimizer(1e-4).minimize``.
Measured per model:

  * build s: wall time of building that graph (minimize included); graph ops;
  * view s: reading the graph for the planner (``rewriters.model_view``);
  * layer nodes, critical, blocks: the layer graph (``layers.layer_graph``), its
    critical layers (Rhino §4.3.1) and TAP's similar blocks at the outermost
    level (``pruning.shared_blocks``: the repeated transformer layers);
  * plan O2 s: ``layer_graph`` + ``plan_sharding`` O2 on a data 1 x tensor 8 mesh
    of V100-32GB (32 GiB per device), global batch ``--batch``;
  * O3 s, O3 optimal, O2/O3 cost: the whole-graph CP-SAT ILP (``--o3-limit`` s)
    and the ratio of the O2 and O3 plans' estimated step times;
  * auto s: the whole ``auto.auto_parallel`` planning as tfpar runs it at the
    first ``Session.run`` (``runtime.automatic.automatic_plan``: reading the
    graph, then ``auto.search_all`` over every data x tensor x pipeline mesh
    of 8 V100-32GB, then ``choose``; Python's garbage collector paused, as
    tfpar pauses it);
  * auto mask s: the same for the GPT with one causal mask that every block
    reads (built once, as most scripts build it);

Targets (``TARGETS``; ``--check`` prints PASS/FAIL per target and exits 1 when
one is missed): plan O2 and auto each <= 25% of build time for the largest
model; auto with a shared causal mask / without <= 2 for the largest
model; plan O2 and auto of the largest model / of 24 layers <= 2 (TAP's
sub-linear planning; only when 24 and a larger depth are measured); O2 within
5% of O3 wherever O3 proved its plan optimal. The view-time ratio of the
same two models (read again after auto, with the garbage collector running),
and O2/O3 where O3 stopped at its limit, are printed for information.

    python benchmarks/planner.py [--check] [--json]

(2 cores: about 1.5 minutes plus each model's O3 time, up to ``--o3-limit``; 1.1 GB
peak memory. ``--quick``: 7 s.)
"""
import argparse
import gc
import json
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.cluster.hardware import CATALOG  # noqa: E402
from tfpar.hooks.capture import capture_for  # noqa: E402
from tfpar.planner.layers import layer_graph  # noqa: E402
from tfpar.planner.pruning import shared_blocks  # noqa: E402
from tfpar.planner.sharding import critical_layers, plan_sharding  # noqa: E402
from tfpar.planner.sharding_costs import Mesh  # noqa: E402
from tfpar.analysis.graph_index import GraphIndex  # noqa: E402
from tfpar.analysis.model_view import model_view  # noqa: E402
from tfpar.models.gpt import gpt_train_op  # noqa: E402
from tfpar.runtime.automatic import automatic_plan  # noqa: E402
from tfpar.runtime.context import active  # noqa: E402
from tfpar.runtime.planning import analysed_now  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, verdict  # noqa: E402  (same directory)


DEVICES, HEADS, LIMIT_S = 8, 16, 60  # LIMIT_S: time limit of O2 and of auto.search
HARDWARE = CATALOG["V100-32GB"]
LAYERS = {False: "12,24,48,96", True: "2,4"}  # --layers default, full / --quick
# Targets (at most): plan O2 / build of the largest model, plan O2 of the largest
# model / of 24 layers, O2 / O3 step time where O3 is optimal.
TARGETS = {"plan_build": 0.25, "plan_growth": 2.0, "o2_o3": 1.05, "auto_build": 0.25,
           "auto_growth": 2.0, "mask_auto": 2.0}
SIZES = {"hidden": (1024, 64, "hidden size"), "seq": (128, 16, "sequence length"),
         "vocab": (32000, 1000, "vocabulary size"), "batch": (8, 8, "global batch of the plans"),
         "o3_limit": (60, 10, "O3 (CP-SAT) time limit in seconds")}
COLUMNS = [("layers", "layers", "d"), ("graph ops", "graph_ops", "d"),
           ("layer nodes", "layer_nodes", "d"), ("critical", "critical", "d"),
           ("blocks", "blocks", "d"), ("build s", "build_s", ".2f"), ("view s", "view_s", ".2f"),
           ("plan O2 s", "plan_s", ".3f"), ("plan/build", "plan_build", ".3f"),
           ("O3 s", "o3_s", ".2f"), ("O3 optimal", "o3_optimal", ""),
           ("O2/O3 cost", "o2_o3_cost", ".4f"), ("auto s", "auto_s", ".2f"),
           ("auto mask s", "auto_mask_s", ".2f")]


def timed(fn, *args, **kwargs):
    """(fn's result, seconds it took)."""
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - start


def measure(layers, args):
    """One result row: build the GPT, read it, plan it (O2, O3) and run auto_parallel's planning."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            wh.init(auto_config(args))
            _, build_s = timed(gpt_train_op, layers, args.hidden, args.seq, args.vocab, HEADS)
            # Planned first, as at the first Session.run: nothing of the graph read before.
            automatic, auto_s = timed(automatic_plan, analysed(graph), capture_for(graph),
                                      active())
            (_, view), view_s = timed(model_view, GraphIndex(graph), capture_for(graph))
        best = automatic.best
        mesh, memory = Mesh(DEVICES, DEVICES, args.batch, HARDWARE), HARDWARE.memory_gb * 2 ** 30
        start = time.perf_counter()
        graph_of_layers = layer_graph(view)
        o2 = plan_sharding(graph_of_layers, mesh, memory, "O2", LIMIT_S)
        plan_s = time.perf_counter() - start
        o3, o3_s = timed(plan_sharding, graph_of_layers, mesh, memory, "O3", args.o3_limit)
        levels = shared_blocks(view.names, view.types)
        return {"layers": layers, "graph_ops": len(graph.get_operations()),
                "layer_nodes": len(graph_of_layers.layers),
                "critical": len(critical_layers(graph_of_layers)),
                "blocks": len(levels[-1]) if levels else 0, "build_s": build_s, "view_s": view_s,
                "plan_s": plan_s, "plan_build": plan_s / build_s, "o3_s": o3_s,
                "o3_optimal": o3 is not None and o3.optimal,
                "o2_step_s": o2 and o2.step_time_s, "o3_step_s": o3 and o3.step_time_s,
                "o2_o3_cost": o2.step_time_s / o3.step_time_s if o2 and o3 else None,
                "auto_s": auto_s, "auto_build": auto_s / build_s,
                "auto_mask_s": masked_auto_s(layers, args),
                "search_mesh": f"data {best.data} x tensor {best.tensor} "
                                                     f"x pipeline {best.pipeline}"}
    finally:
        wh.reset()
        del graph
        gc.collect()


def analysed(graph):
    """``graph`` as tfpar analyses it at its first ``Session.run``."""
    return analysed_now(graph, capture_for(graph))


def auto_config(args):
    """``auto.auto_parallel`` on the benchmark's mesh, planned in this process."""
    return {"cluster.num_devices": DEVICES, "cluster.hardware": [HARDWARE.name],
            "auto.auto_parallel": True, "auto.planning_pass": False,
            "auto.global_batch": args.batch, "auto.search_time_limit_s": LIMIT_S}


def masked_auto_s(layers, args):
    """Seconds of auto's planning of the same GPT with one causal mask that
    every block reads, built once as most scripts build it."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            wh.init(auto_config(args))
            gpt_train_op(layers, args.hidden, args.seq, args.vocab, HEADS, mask="shared")
            return timed(automatic_plan, analysed(graph), capture_for(graph), active())[1]
    finally:
        wh.reset()
        del graph
        gc.collect()


def target(name, value, limit):
    """A target row; ``limit`` None marks an informational one (always met)."""
    return {"target": name, "value": value, "limit": limit,
            "met": meets(value, limit)}


def targets(rows):
    by_layers = {r["layers"]: r for r in rows}
    largest = by_layers[max(by_layers)]
    found = [target(f"plan O2 / build, {largest['layers']} layers", largest["plan_build"],
                    TARGETS["plan_build"]),
             target(f"auto / build, {largest['layers']} layers", largest["auto_build"],
                    TARGETS["auto_build"]),
             target(f"auto shared mask / none, {largest['layers']} layers",
                    largest["auto_mask_s"] / largest["auto_s"], TARGETS["mask_auto"])]
    if 24 in by_layers and largest["layers"] > 24:
        ratio = f"{largest['layers']} / 24 layers"
        found += [target(f"plan O2 {ratio}", largest["plan_s"] / by_layers[24]["plan_s"],
                         TARGETS["plan_growth"]),
                  target(f"auto {ratio}", largest["auto_s"] / by_layers[24]["auto_s"],
                         TARGETS["auto_growth"]),
                  target(f"view {ratio}", largest["view_s"] / by_layers[24]["view_s"], None)]
    found += [target(f"O2 / O3 step time, {r['layers']} layers"
                     + ("" if r["o3_optimal"] else " (O3 not optimal)"), r["o2_o3_cost"],
                     TARGETS["o2_o3"] if r["o3_optimal"] else None) for r in rows]
    return found


def print_table(rows, found, args):
    print(f"tfpar planner (GPT hidden {args.hidden}, {HEADS} heads, seq {args.seq}, vocab "
          f"{args.vocab}; mesh data 1 x tensor {DEVICES} {HARDWARE.name}, global batch "
          f"{args.batch}; O3 limit {args.o3_limit} s)")
    widths = [max(len(title), 7) for title, _, _ in COLUMNS]
    print("  ".join(f"{title:>{w}}" for (title, _, _), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(f"{cell(r[key], fmt):>{w}}" for (_, key, fmt), w in zip(COLUMNS, widths)))
    for r in rows:
        print(f"auto, {r['layers']} layers: {r['search_mesh']}")
    for t in found:
        value = cell(t["value"], ".3f")
        print(f"{t['target']:<46} {value:>7}  " + (f"<= {t['limit']:<4}  "
              f"{'met' if t['met'] else 'NOT MET'}" if t["limit"] is not None else "(info)"))


def parse_args(argv):
    layers = argparse.ArgumentParser(add_help=False)
    layers.add_argument("--layers", type=lambda text: sorted({int(n) for n in text.split(",")}))
    known, rest = layers.parse_known_args(argv)
    p, args = parse_sizes(f"{__doc__.split(chr(10), 1)[0]} Also --layers N,N,... (default "
                          f"{LAYERS[False]}, --quick {LAYERS[True]}).", SIZES, rest,
                          "exit 1 when a target is missed", "tiny models (smoke test)")
    args.layers = known.layers or sorted(int(n) for n in LAYERS[args.quick].split(","))
    if min(args.layers + [args.seq, args.vocab, args.batch, args.o3_limit]) < 1:
        p.error("--layers, --seq, --vocab, --batch and --o3-limit must be >= 1")
    if args.hidden < HEADS or args.hidden % HEADS or args.batch % DEVICES:
        p.error(f"--hidden must be a multiple of {HEADS} heads, --batch of {DEVICES} devices")
    return args


def main(argv=None):
    args = parse_args(argv)
    return finish([measure(layers, args) for layers in args.layers], args)


def finish(rows, args) -> int:
    """Print the rows and targets (table or JSON); the exit code: 1 under --check
    when a target is missed."""
    found = targets(rows)
    if args.json:
        print(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "json"},
                          "results": rows, "targets": found}, indent=2))
    else:
        print_table(rows, found, args)
    return verdict([(t["target"], t["value"], t["limit"]) for t in found], args)


if __name__ == "__main__":
    sys.exit(main())
