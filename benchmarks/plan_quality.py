"""tfpar plan quality: the planner's estimates ranked against the seed papers' measurements.

No TensorFlow and no training. Each case's model is written out op by op as the
planner's ``model_view.ModelView`` (op names and types as TensorFlow's layers name
them, so the sharding search groups them into layers as it would a real graph;
FLOPs, output bytes and weight bytes per op from the architecture), on the
paper's devices, GPU count and batch. Per row the planner searches every mesh
(``auto.search_all`` + ``choice.choose``: the "chosen plan", as data d x tensor
t x pipeline p), and its cost model (``sharding_costs.Problem``) estimates the step
time of the plan the paper ran ("paper plan") and of the baseline the paper
compares it with; "est. ratio" is baseline / paper plan (an estimated
speed-up), next to the paper's measured ratio. Rows:

  * Whale (ATC'22) §5.1.2, Figure 13: ResNet-50 with a 100K-class FC layer
    (written out: 90 MB backbone, 782 MB FC, as the paper states) on 8, 16 and
    32 V100s, hybrid (data-parallel backbone; FC and softmax split by columns
    over all the GPUs, colocated with the replicas) vs pure data parallelism:
    1.13x, 1.66x, 2.43x.
  * Whale §5.1.4, Figure 15: the FC split by SP1 (``column``) vs SP2 (``row``,
    partial sums all-reduced; the cheapest loss candidate after it): 1.6x on 8
    GPUs, 3.75x on 32.
  * Whale §5.1.3, Figure 16: the bridge's share of the hybrid step, 6% on 8
    GPUs, 10% on 32 (estimated: the hybrid's communication other than
    gradients, i.e. bridge and split softmax, over its step); on 32 GPUs the
    hybrid's overhead is 6x less than data parallelism's gradient
    synchronisation (estimated: DP's gradient all-reduce time over that).
  * Whale §5.1.2, Figure 14: 1M classes: data parallelism runs out of memory
    (estimated: its memory need over the 32 GB), and the hybrid goes from 8 to
    32 GPUs at 95% scaling efficiency (3.8x the throughput; estimated: 4 x
    step(8) / step(32)).
  * Rhino §7.3: GPT-Medium (Table 1: 24 layers, hidden 1024, 16 heads; vocab
    50257, untied ``lm_head``) SPMD only on 2 V100s of platform M8, global
    batch 4: "for 2 GPUs, the strategy is as normally as DP". Estimated: the
    planner's best tensor-parallel candidate vs data parallelism (the paper
    states no ratio).

Not expressible, so not rows: Whale Figure 11 (1F1B vs GPipe: one pipeline
length in a schedule replay; the paper's gain is memory), Figure 12 (no
ratios stated); Rhino §7.3 on 4-8 GPUs (ZeRO-like sharding of variables) and
§7.5 (O2 vs O3 on strided sharding; ``benchmarks/planner.py`` checks ours);
TAP §IV-F, Figure 3 (attention split by heads: costed since
``auto.split_heads``, not yet a row); Ada-Grouper §6 (kFkB vs 1F1B under network
preemption, which the cost model has no term for).

Setting: ``V100-32GB`` of the catalog, fp32 (Rhino §7.1: "full FP32"; Whale
does not say), 8 GPUs per node (Whale §5: 2/4/8; Rhino M8: 8); between nodes
Whale's 50 Gb/s Ethernet (§5), an eighth of it per device (collectives across
nodes are hierarchical, so a node's link carries 2 (N-1)/N of an all-reduced
tensor), Rhino's 100 Gb/s RoCE (the catalog's). Whale states no batch
size: ``--batch-per-gpu`` 32 images per GPU (256 on 8), scaled with the GPU
count; Rhino states no sequence length: ``--seq`` 1024.

Targets per row (``--check`` prints PASS/FAIL per target and exits 1 when one
is missed; a missed row stays in the table, "met" no):
  * plan (once per setting): the chosen plan has the paper plan's strategy
    (the layers split and their patterns, pipeline or not; degrees may
    differ), or an estimate within 10% of it: max(chosen / paper plan,
    paper plan / chosen) <= 1.10 (1 when the strategies agree);
  * rank: where the paper's ratio is > 1 (or the baseline ran out of memory),
    the estimate too: 1 / est. ratio <= 1;
  * growth: where the paper's ratio grows with the GPU count, the estimate
    too: previous / this est. ratio <= 1.

    python benchmarks/plan_quality.py [--quick] [--check] [--json]

(2 cores: about 6 s, 0.1 GB; ``--quick``, 8 and 16 GPUs and sequence 128: 4 s.)
"""
import dataclasses
import itertools
import math
import os
import sys
from typing import Dict, List

from tfpar.cluster.hardware import CATALOG
from tfpar.errors import PlanError
from tfpar.planner.auto import search_all
from tfpar.planner.choice import choose
from tfpar.planner.model_view import ModelView
from tfpar.planner.layers import layer_graph
from tfpar.planner.pruning import block_labels
from tfpar.planner.sharding_costs import Mesh, Problem

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, meets, parse_sizes, ratio, report  # noqa: E402  (same directory)

FLOAT = 4  # bytes, fp32
LOSS = "sparse_softmax_cross_entropy_loss"
OOM = "OOM"  # a paper's ratio where the baseline ran out of memory
TOLERANCE = 1.10  # plan target: the chosen plan's estimate within 10% of the paper plan's
WHALE_GPUS = {False: (8, 16, 32), True: (8, 16)}  # full / --quick
WHALE_ETHERNET_GBPS = 50.0  # Whale §5: "Nodes are connected by 50Gb/s ethernet"
HYBRID = {"predictions": "column", LOSS: "xent"}  # Whale Figure 3 / Example 2, SP1
SP2 = {"predictions": "row", LOSS: ("dp", "whole", "xent")}  # the cheapest loss after it
SIZES = {"batch_per_gpu": (32, 32, "images per GPU of the Whale cases"),
         "seq": (1024, 128, "sequence length of the Rhino GPT case"),
         "time_limit": (60, 20, "seconds each planner search may take")}
COLUMNS = [("case", "case", ""), ("source", "source", ""), ("GPUs", "gpus", "d"),
           ("chosen plan", "chosen", ""),
           ("paper plan", "paper_plan", ""), ("est. ratio", "est_ratio", ".3g"),
           ("paper ratio", "paper_cell", ""), ("met", "met", "")]
# The papers' numbers (speed-ups unless said), where they are stated:
WHALE_HYBRID = {8: 1.13, 16: 1.66, 32: 2.43}  # Whale §5.1.2, Figure 13
WHALE_SP1_SP2 = {8: 1.6, 32: 3.75}  # Whale §5.1.4, Figure 15
WHALE_BRIDGE_SHARE = {8: 0.06, 32: 0.10}  # Whale §5.1.3, Figure 16
WHALE_DP_SYNC_OVER_BRIDGE = 6.0  # Whale §5.1.3, Figure 16, 32 GPUs
WHALE_1M_SCALING = 4 * 0.95  # Whale §5.1.2, Figure 14: 95% scaling efficiency 8 -> 32 GPUs


def progress(line):
    print(line, file=sys.stderr, flush=True)


class Ops:
    """A ModelView written op by op: ``add`` returns the op's index."""

    def __init__(self):
        self.names, self.types, self.flops, self.kept, self.params = [], [], [], [], []
        self.input_bytes, self.sizes, self.edges = [], [], []

    def add(self, name, kind, flops, size, inputs=(), params=0.0, input_bytes=0.0, view=False):
        """An op: FLOPs and output bytes per row (``view``: its output is its
        input's buffer, it allocates nothing), weight bytes, its producers."""
        index = len(self.names)
        self.names.append(name)
        self.types.append(kind)
        self.flops.append(float(flops))
        self.kept.append(0.0 if view else float(size))
        self.params.append(float(params))
        self.input_bytes.append(float(input_bytes))
        self.sizes.append(float(size))
        self.edges += [(j, index, self.sizes[j]) for j in inputs]
        return index

    def dense(self, scope, x, rows, din, dout):
        """A dense layer (its kernel read by the MatMul, the bias by the BiasAdd)
        on ``rows`` vectors per batch row."""
        out = rows * dout
        x = self.add(f"{scope}/MatMul", "MatMul", 2 * out * din, FLOAT * out, [x],
                     params=FLOAT * din * dout)
        return self.add(f"{scope}/BiasAdd", "BiasAdd", out, FLOAT * out, [x], params=FLOAT * dout)

    def loss(self, x, rows):
        """Sparse softmax cross-entropy on ``rows`` logit vectors per batch row
        (int32 labels read from the inputs)."""
        return self.add(f"{LOSS}/xentropy/xentropy", "SparseSoftmaxCrossEntropyWithLogits", rows,
                        FLOAT * rows, [x], input_bytes=FLOAT * rows)

    def view(self) -> ModelView:
        return ModelView(self.flops, self.kept, self.params, self.edges,
                         block_labels(self.names, self.types), self.names, self.types,
                         self.input_bytes, None, "fp32")


def resnet50(classes, image=224) -> ModelView:
    """Keras's ResNet50 (v1: stride in each stage's first 1x1 convolution;
    convolutions with biases, batch norms with 4 vectors) on ``image`` pixels
    square, global average pooling, a ``classes``-way dense layer "predictions"."""
    ops = Ops()

    def conv(name, x, k, cin, cout, side, relu=True):
        out = side * side * cout
        x = ops.add(f"{name}_conv/Conv2D", "Conv2D", 2 * out * k * k * cin, FLOAT * out,
                    () if x is None else [x], params=FLOAT * (k * k * cin * cout + cout),
                    input_bytes=FLOAT * image * image * 3 if x is None else 0.0)
        x = ops.add(f"{name}_bn/FusedBatchNormV3", "FusedBatchNormV3", out, FLOAT * out, [x],
                    params=FLOAT * 4 * cout)
        return ops.add(f"{name}_relu/Relu", "Relu", out, FLOAT * out, [x]) if relu else x
    side = image // 2
    x = conv("conv1", None, 7, 3, 64, side)
    side, channels = side // 2, 64
    x = ops.add("pool1_pool/MaxPool", "MaxPool", side * side * 64, FLOAT * side * side * 64, [x])
    for stage, (blocks, width, stride) in enumerate(((3, 64, 1), (4, 128, 2), (6, 256, 2),
                                                     (3, 512, 2)), 2):
        for block in range(1, blocks + 1):
            name = f"conv{stage}_block{block}"
            if block == 1:
                side //= stride
                shortcut = conv(f"{name}_0", x, 1, channels, 4 * width, side, relu=False)
            else:
                shortcut = x
            y = conv(f"{name}_1", x, 1, channels, width, side)
            y = conv(f"{name}_2", y, 3, width, width, side)
            y = conv(f"{name}_3", y, 1, width, 4 * width, side, relu=False)
            out = side * side * 4 * width
            y = ops.add(f"{name}_add/AddV2", "AddV2", out, FLOAT * out, [shortcut, y])
            x = ops.add(f"{name}_out/Relu", "Relu", out, FLOAT * out, [y])
            channels = 4 * width
    x = ops.add("avg_pool/Mean", "Mean", channels, FLOAT * channels, [x])
    ops.loss(ops.dense("predictions", x, 1, channels, classes), 1)
    return ops.view()


def gpt(layers, hidden, heads, seq, vocab) -> ModelView:
    """A pre-LN GPT as ``benchmarks/planner.py`` builds it (v1 dense layers on
    [batch, seq, hidden]: q, k, v, out, fc1 with GELU, fc2; an untied
    ``lm_head``), per batch row of ``seq`` tokens."""
    ops = Ops()
    tokens = seq * hidden

    def layer_norm(scope, x):
        mean = ops.add(f"{scope}/moments/mean", "Mean", tokens, FLOAT * seq, [x])
        square = ops.add(f"{scope}/moments/SquaredDifference", "SquaredDifference", tokens,
                         FLOAT * tokens, [x, mean])
        variance = ops.add(f"{scope}/moments/variance", "Mean", tokens, FLOAT * seq, [square])
        centred = ops.add(f"{scope}/sub", "Sub", tokens, FLOAT * tokens, [x, mean])
        scale = ops.add(f"{scope}/Rsqrt", "Rsqrt", seq, FLOAT * seq, [variance])
        y = ops.add(f"{scope}/mul", "Mul", tokens, FLOAT * tokens, [centred, scale])
        y = ops.add(f"{scope}/mul_1", "Mul", tokens, FLOAT * tokens, [y], params=FLOAT * hidden)
        return ops.add(f"{scope}/add", "AddV2", tokens, FLOAT * tokens, [y],
                       params=FLOAT * hidden)

    def heads_first(scope, x, n):
        x = ops.add(f"{scope}/Reshape{n}", "Reshape", 0, FLOAT * tokens, [x], view=True)
        return ops.add(f"{scope}/transpose{n}", "Transpose", tokens, FLOAT * tokens, [x])
    h = ops.add("embedding/GatherV2", "GatherV2", tokens, FLOAT * tokens,
                params=FLOAT * vocab * hidden, input_bytes=FLOAT * seq)
    h = ops.add("embedding/add", "AddV2", tokens, FLOAT * tokens, [h], params=FLOAT * tokens)
    scores = heads * seq * seq
    for i in range(layers):
        scope = f"layer_{i}"
        a = layer_norm(f"{scope}/ln1", h)
        att = f"{scope}/attention"
        q, k, v = (heads_first(att, ops.dense(f"{att}/{n}", a, seq, hidden, hidden), f"_{j}")
                   for j, n in enumerate("qkv"))
        s = ops.add(f"{att}/MatMul", "BatchMatMulV2", 2 * seq * tokens, FLOAT * scores, [q, k])
        s = ops.add(f"{att}/truediv", "RealDiv", scores, FLOAT * scores, [s])
        s = ops.add(f"{att}/Softmax", "Softmax", scores, FLOAT * scores, [s])
        c = ops.add(f"{att}/MatMul_1", "BatchMatMulV2", 2 * seq * tokens, FLOAT * tokens, [s, v])
        c = ops.add(f"{att}/transpose_3", "Transpose", tokens, FLOAT * tokens, [c])
        c = ops.add(f"{att}/Reshape_3", "Reshape", 0, FLOAT * tokens, [c], view=True)
        out = ops.dense(f"{att}/out", c, seq, hidden, hidden)
        h = ops.add(f"{scope}/add", "AddV2", tokens, FLOAT * tokens, [h, out])
        f = ops.dense(f"{scope}/fc1", layer_norm(f"{scope}/ln2", h), seq, hidden, 4 * hidden)
        f = ops.add(f"{scope}/fc1/Gelu", "Gelu", 4 * tokens, 4 * FLOAT * tokens, [f])
        h = ops.add(f"{scope}/add_1", "AddV2", tokens, FLOAT * tokens,
                    [h, ops.dense(f"{scope}/fc2", f, seq, 4 * hidden, hidden)])
    h = layer_norm("ln_final", h)
    ops.loss(ops.dense("lm_head", h, seq, hidden, vocab), seq)
    return ops.view()


def v100(inter_node_gbps=None):
    """The catalog's V100-32GB, 8 per node; ``inter_node_gbps`` (Gb/s) a
    node's network to the others, shared by its 8 devices (None: the
    catalog's per device)."""
    hardware = dataclasses.replace(CATALOG["V100-32GB"], devices_per_node=8)
    if inter_node_gbps is not None:
        hardware = dataclasses.replace(hardware, inter_node_gbps=inter_node_gbps / 8 / 8)  # GB/s
    return hardware


def fixed(layers, mesh, choice, gradients=True):
    """The cost model's plan with the candidates of ``choice`` (layer scope ->
    candidate, or a tuple of them: the cheapest), every other layer data
    parallel: (ShardingPlan, Problem)."""
    problem = Problem(layers, mesh, gradients=gradients)
    options = []
    for layer, allowed in zip(layers.layers, problem.allowed()):
        wanted = choice.get(layer.scope, "dp")
        wanted = (wanted,) if isinstance(wanted, str) else wanted
        if not set(wanted) <= set(allowed):
            raise ValueError(f"{layer.scope}: {wanted} not among its candidates {allowed}")
        options.append(wanted)
    plans = [problem.plan(chosen, False) for chosen in itertools.product(*options)]
    return min(plans, key=lambda plan: plan.step_time_s), problem


def short(scope):
    return "loss" if scope == LOSS else scope


def describe(split: Dict[str, str], data, tensor, pipeline):
    """A plan in one cell: what is split and how, the degrees."""
    if pipeline > 1:
        return f"pipeline p{pipeline} t{tensor} d{data}"
    if not split:
        return f"data parallel d{data}"
    layers = (" ".join(f"{short(s)}:{c}" for s, c in split.items()) if len(split) <= 3
              else f"{len(split)} layers")
    return f"split {layers} t{tensor} d{data}"


def strategy(split: Dict[str, str], pipeline):
    """What the plan target compares: the layers split and their patterns, pipeline or not."""
    return frozenset(split.items()), pipeline > 1


def search(view, gpus, hardware, batch, args, pipeline=None):
    """The planner's choice (None when nothing fits) and every candidate."""
    progress(f"plan_quality: searching {gpus} GPUs, global batch {batch} ...")
    candidates = search_all(view, gpus, hardware, batch, 1, pipeline,
                            time_limit_s=args.time_limit, progress=progress)
    try:
        return choose(candidates, hardware), candidates
    except PlanError as error:
        progress(str(error))
        return None, candidates


def chosen_fields(chosen, paper_strategy, paper_s):
    """The chosen plan's cell, estimate and plan target value (1 when its
    strategy is the paper plan's, else how far the estimates are apart, a
    ratio >= 1; infinite, a miss, when nothing fits)."""
    if chosen is None:
        return {"chosen": "none fits", "chosen_ms": None, "plan": math.inf}
    split = dict(chosen.split_scopes)
    same = strategy(split, chosen.pipeline) == paper_strategy
    apart = max(chosen.step_time_s / paper_s, paper_s / chosen.step_time_s)
    return {"chosen": describe(split, chosen.data, chosen.tensor, chosen.pipeline),
            "chosen_ms": 1e3 * chosen.step_time_s, "plan": 1.0 if same else apart}


def whale_setting(view, layers, gpus, args, hardware, choice):
    """One Whale classifier setting: the chosen plan and the cost model's
    estimates of the hybrid (``choice`` over all ``gpus``), of SP2 and of
    data parallelism."""
    batch = args.batch_per_gpu * gpus
    chosen, _ = search(view, gpus, hardware, batch, args)
    split_mesh = Mesh(gpus, gpus, batch, hardware, view.compute_dtype)
    dp_mesh = Mesh(gpus, 1, batch, hardware, view.compute_dtype)
    hybrid, _ = fixed(layers, split_mesh, choice)
    bare_hybrid, problem = fixed(layers, split_mesh, choice, gradients=False)
    dp, _ = fixed(layers, dp_mesh, {})
    bare_dp, _ = fixed(layers, dp_mesh, {}, gradients=False)
    return {"gpus": gpus, **chosen_fields(chosen, strategy(choice, 1), hybrid.step_time_s),
            "paper_plan": describe(choice, 1, gpus, 1), "hybrid": hybrid,
            "sp2": fixed(layers, split_mesh, SP2)[0], "dp": dp,
            "capacity": hardware.memory_gb * 2 ** 30,
            "bridge_s": bare_hybrid.step_time_s - problem.compute_seconds(bare_hybrid.candidates),
            "dp_sync_s": dp.step_time_s - bare_dp.step_time_s}


def row(case, source, setting, est, paper, plan=False, growth=None, compared=()):
    """A result row of ``setting`` (a dict with the chosen plan); ``paper``:
    the paper's ratio, ``OOM`` (the baseline does not fit: a ratio > 1) or
    None (not stated). Judged: the plan target when ``plan``; rank where the
    paper's ratio is > 1; growth after ``growth``, the previous estimate of a
    series whose paper ratio grows (None: not judged). ``compared``: (label,
    seconds) of the estimates the ratio compares (informational)."""
    stated = isinstance(paper, (int, float))
    above_one = paper == OOM or stated and paper > 1
    checks = {"plan": (setting["plan"], TOLERANCE) if plan else None,
              "rank": (ratio(1.0, est), 1.0) if above_one else None,
              "growth": (ratio(growth, est), 1.0) if growth is not None else None}
    checks = {k: v for k, v in checks.items() if v is not None}
    return {"case": case, "source": source, "gpus": setting["gpus"],
            "chosen": setting["chosen"], "chosen_ms": setting["chosen_ms"],
            "paper_plan": setting["paper_plan"], "est_ratio": est,
            "paper_ratio": paper if stated else None,
            "paper_cell": cell(paper, ".3g") if paper != OOM else "OOM (> 1)",
            "compared_ms": {label: 1e3 * seconds for label, seconds in compared},
            "checks": {k: {"value": v, "limit": lim, "met": meets(v, lim)}
                       for k, (v, lim) in checks.items()},
            "met": all(meets(v, lim) for v, lim in checks.values())}


def series(case, source, settings, paper, estimate, compared, plan=False):
    """Rows of one comparison over the GPU counts the paper states and this
    run has, each judged for growth over the previous one where the paper's
    ratio grows; ``estimate`` and ``compared`` map a setting to its estimated
    ratio and to (label, seconds) pairs."""
    rows, previous = [], None
    for gpus in sorted(set(paper) & set(settings)):
        setting = settings[gpus]
        est = estimate(setting)
        grows = rows and paper[gpus] > rows[-1]["paper_ratio"]
        rows.append(row(case, source, setting, est, paper[gpus], plan,
                        previous if grows else None, compared(setting)))
        previous = est
    return rows


def whale_rows(args) -> List[dict]:
    """Whale §5.1.2-5.1.4: ResNet-50 with 100K and 1M classes."""
    hardware = v100(WHALE_ETHERNET_GBPS)
    counts = WHALE_GPUS[args.quick]
    view = resnet50(100000)
    layers = layer_graph(view)
    settings = {g: whale_setting(view, layers, g, args, hardware, HYBRID) for g in counts}
    step = {name: (lambda s, name=name: s[name].step_time_s) for name in ("dp", "hybrid", "sp2")}
    rows = series("100K classes: hybrid vs DP", "Whale §5.1.2 Fig. 13", settings, WHALE_HYBRID,
                  lambda s: step["dp"](s) / step["hybrid"](s),
                  lambda s: (("DP", step["dp"](s)), ("hybrid", step["hybrid"](s))), plan=True)
    rows += series("100K classes: SP1 vs SP2", "Whale §5.1.4 Fig. 15", settings, WHALE_SP1_SP2,
                   lambda s: step["sp2"](s) / step["hybrid"](s),
                   lambda s: (("SP2", step["sp2"](s)), ("SP1", step["hybrid"](s))))
    rows += series("100K classes: bridge share of step", "Whale §5.1.3 Fig. 16", settings,
                   WHALE_BRIDGE_SHARE, lambda s: s["bridge_s"] / step["hybrid"](s),
                   lambda s: (("bridge", s["bridge_s"]), ("hybrid", step["hybrid"](s))))
    rows += series("100K classes: DP grad sync / bridge", "Whale §5.1.3 Fig. 16", settings,
                   {32: WHALE_DP_SYNC_OVER_BRIDGE}, lambda s: s["dp_sync_s"] / s["bridge_s"],
                   lambda s: (("DP sync", s["dp_sync_s"]), ("bridge", s["bridge_s"])))
    view = resnet50(1000000)
    layers = layer_graph(view)
    low, high = counts[0], counts[-1]
    big = {g: whale_setting(view, layers, g, args, hardware, HYBRID) for g in (low, high)}
    rows.append(row("1M classes: DP memory / device", "Whale §5.1.2 Fig. 14", big[low],
                    big[low]["dp"].memory_bytes / big[low]["capacity"], OOM, plan=True))
    rows.append(row(f"1M classes: hybrid {high} vs {low} GPUs", "Whale §5.1.2 Fig. 14", big[high],
                    high / low * step["hybrid"](big[low]) / step["hybrid"](big[high]),
                    WHALE_1M_SCALING if (low, high) == (8, 32) else None, plan=True,
                    compared=((f"{low} GPUs", step["hybrid"](big[low])),
                              (f"{high} GPUs", step["hybrid"](big[high])))))
    return rows


def rhino_rows(args) -> List[dict]:
    """Rhino §7.3: GPT-Medium (Table 1: 24 layers, hidden 1024, 16 heads)
    SPMD only (no pipeline) on 2 GPUs of M8, global batch 4."""
    hardware, gpus, batch = v100(), 2, 4
    chosen, candidates = search(gpt(24, 1024, 16, args.seq, 50257), gpus, hardware, batch, args,
                                pipeline=1)
    dp = next(c for c in candidates if c.tensor == 1)
    split = min((c for c in candidates if c.tensor > 1), key=lambda c: c.step_time_s,
                default=None)
    setting = {"gpus": gpus, "paper_plan": describe({}, gpus, 1, 1),
               **chosen_fields(chosen, strategy({}, 1), dp.step_time_s)}
    return [row("GPT-Medium SPMD: DP vs best split", "Rhino §7.3", setting,
                ratio(split and split.step_time_s, dp.step_time_s), None, plan=True,
                compared=(("best split", split.step_time_s if split else math.nan),
                          ("DP", dp.step_time_s)))]


def targets(rows):
    """(name, value, limit) of every judged check of every row."""
    return [(f"{r['case']}, {r['gpus']} GPUs: {name}", c["value"], c["limit"])
            for r in rows for name, c in r["checks"].items()]


def print_table(rows, _found, args):
    """The table (``--check`` prints each target's verdict after it)."""
    print(f"tfpar plan quality (V100-32GB, 8 per node, {WHALE_ETHERNET_GBPS:g} Gb/s between "
          f"nodes for Whale; {args.batch_per_gpu} images per GPU; GPT sequence {args.seq})")
    widths = [max(len(title), *(len(cell(r[key], fmt)) for r in rows))
              for title, key, fmt in COLUMNS]
    print("  ".join(f"{title:<{w}}" for (title, _, _), w in zip(COLUMNS, widths)))
    for r in rows:
        print("  ".join(f"{cell(r[key], fmt):<{w}}" for (_, key, fmt), w in zip(COLUMNS, widths)))


def parse_args(argv):
    p, args = parse_sizes(__doc__.split("\n", 1)[0], SIZES, argv,
                          "exit 1 when a row misses a target",
                          "8 and 16 GPUs only, sequence 128 (smoke test)")
    if min(args.batch_per_gpu, args.seq, args.time_limit) < 1:
        p.error("--batch-per-gpu, --seq and --time-limit must be >= 1")
    return args


def main(argv=None):
    args = parse_args(argv)
    rows = whale_rows(args) + rhino_rows(args)
    return report(rows, targets(rows), args, SIZES, print_table, checks_ok=True)


if __name__ == "__main__":
    sys.exit(main())
