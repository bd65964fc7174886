"""tfpar plan scale: GPTs of 1.7B-1T parameters on 32-3072 A100s vs Megatron-LM's
runs, and Llama 3 405B on 8192 and 16384 H100s vs Meta's.

Two sets of published runs, reported apart: **fit**, the runs the cost
model's one fitted constant, ``hardware.EFFICIENCY`` (0.7), was chosen on
(in sample); and **judged**, runs that choice never saw (out of sample).

Fit: ten rows of Narayanan et al. (SC'21), Table 1 (weak scaling: parameters,
layers, hidden size, heads, tensor x pipeline degrees, GPUs, global batch and
measured model TFLOP/s per GPU): a GPT (sequence 2048, vocabulary 51200, the
static global batch; ``tfpar.models.gpt``: TF1 layers, Adam
``minimize``) on DGX A100 nodes of 8 80-GB A100s (the catalog's
``A100-80GB``: NVLink 300 GB/s within a node, 25 GB/s per GPU between
nodes). Judged: Megatron-Turing NLG 530B as Smith et al. 2022 (section 2.4)
measured it: 1920 sequences a step on 2240, 2800 and 3360 80-GB A100s, 8-way
tensor and 35-way pipeline parallelism, 60.1, 50.2 and 44.4 s a step (one
graph planned for the three clusters), and two rows of Dubey et al. 2024
("The Llama 3 Herd of Models"), Table 4:
Llama 3 405B (``tfpar.models.llama``: 126 layers, hidden 16384, MLP 53248,
128 heads sharing 8 key/value heads, sequence 8192, vocabulary 128256) with
2048 sequences a step on 8192 and 16384 H100s (``H100-80GB``: 450 GB/s
within a node, 50 GB/s between), which used FlashAttention (TF 2.15 has
none). Each is built in a fresh graph and planned
for its cluster, described and not present, the graph's float32 as TF32, all
of the planner's techniques allowed (micro-batch counts, pipeline schedules,
activation recomputation, ZeRO, mixed precision, head-split attention). Per
row:

  * build s: TensorFlow building the graph;
  * plan s: reading it (``model_view``) and the whole search
    (``auto.search_all`` over every data x tensor x pipeline mesh, then
    ``choose``), Python's garbage collector paused as tfpar's planning pass
    pauses it, and plan / build;
  * chosen: the plan and its estimated TFLOP/s per GPU, the FLOPs it runs /
    (step x GPUs): a GPT's 72 B s l h^2 (1 + s / 6h + V / 12lh) a step
    (forward and backward) plus what its recomputation runs again - with
    full recomputation every layer's forward, 24 B s l h^2 (1 + s / 6h),
    which makes Narayanan et al.'s Eq. 3, 96 B s l h^2 (1 + s / 6h +
    V / 16lh); with selective, Q K^T's 2 B s^2 h a layer - and a Llama's as
    MFU counts them, recomputation never counted (``step_flops``);
  * published: the run's tensor x pipeline (data = GPUs / both), its
    measured TFLOP/s per GPU and seconds a step (as published, else its
    FLOPs by ``step_flops`` over that rate);
  * pinned: tfpar's estimate of the published configuration: its mesh, 1F1B,
    the memory techniques it ran (Megatron: full recomputation and mixed
    precision; Llama 3: BF16 with FSDP and no recomputation, sequence
    parallelism, the fastest number of interleaved stages,
    and its attention as FlashAttention runs it, ``flash_view``: the
    share of the estimate with TensorFlow's attention it saves is printed,
    with what TensorFlow can run of the mesh), and its GiB per GPU by
    tfpar's memory model (TensorFlow's). No run here publishes its
    micro-batch size: where runs of one model, batch and mesh on several
    numbers of GPUs tell it (MT-NLG's three, Llama 3's two), it is inferred
    from how their steps scale (``inferred_micro_batch``: the bubble does
    not shrink with the data-parallel degree) and the row also prints the
    estimate with the fastest count; elsewhere the fastest count is taken.

Targets per row (``--check``: PASS/FAIL per target, exit 1 when one is missed):
pinned / published seconds a step within 15% in the fit and judged sets; the
chosen plan at most 10% slower than the published mesh as the search costs
every mesh (``choice.TOLERANCE``: the chooser keeps the plan of fewer stages
within that of a faster one; the fastest micro-batch count and, with
FlashAttention, what TensorFlow can run of the mesh); the
chosen plan fits 80 GB;
plan s / build s <= 0.25.

    python benchmarks/plan_scale.py [--check] [--json] [--rows 1.7B,145.6B]

(2 cores: about 14 minutes for all fifteen rows, most of it TensorFlow
building the graphs - 10 s for the 1.7B, 90 s for the 1T, 66 s for the
MT-NLG graph the three rows share, 62 s for Llama 3 405B's; ``--quick``:
the 1.7B and 3.6B rows, about 45 s.)
"""
import argparse
import dataclasses
import functools
import gc
import os
import sys
import time
from typing import Tuple

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from tfpar.cluster.hardware import CATALOG  # noqa: E402
from tfpar.hooks.capture import capture_for  # noqa: E402
from tfpar.planner.auto import search_all  # noqa: E402
from tfpar.planner.choice import TOLERANCE, choose  # noqa: E402
from tfpar.ir.contractions import CONTRACTIONS  # noqa: E402
from tfpar.planner.memory import RECOMPUTE, Techniques  # noqa: E402
from tfpar.runtime.gc_paused import gc_paused  # noqa: E402
from tfpar.analysis.model_view import model_view  # noqa: E402
from tfpar.analysis.graph_index import GraphIndex  # noqa: E402
from tfpar.models.gpt import gpt_train_op  # noqa: E402
from tfpar.models.llama import llama_train_op  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_args import cell, parse_sizes, report  # noqa: E402  (same directory)

TECHNIQUES = ("recompute", "zero", "mixed_precision")
SEARCH_LIMIT_S = 600


@dataclasses.dataclass(frozen=True)
class Run:
    """A published run: its model (``family`` "gpt" or "llama", with a
    Llama's MLP width and key/value heads), cluster (catalog device, 8 a
    node), mesh, global batch in sequences, measured model TFLOP/s per GPU,
    the memory techniques it ran (those the pinned estimate may use), its
    ``role`` ("fit": the runs
    ``hardware.EFFICIENCY`` was chosen on; "judged": runs that choice never
    saw) and its published seconds a step (0: derived from ``measured``);
    ``interleaved``: the pinned estimate takes the fastest number of virtual
    stages; ``sequence_parallel``: the run used it, so the pinned estimate
    and the search may;
    ``flash_attention``: the run used FlashAttention, which TF 2.15 lacks:
    the pinned estimate costs its attention as FlashAttention runs it
    (``flash_view``), and the row says how much of the same configuration's
    estimate with TensorFlow's attention it saves (``flash_share``);
    ``micro_batch``: its sequences a micro-batch as published (0: not
    published; ``micro_batch_of`` then infers or searches it)."""

    @property
    def published_step_s(self):
        """Seconds a step: as published, else the FLOPs its TFLOP/s count
        (``step_flops``) over that rate on every GPU."""
        return self.step_s or step_flops(self) / (self.measured * 1e12 * self.gpus)

    family: str
    layers: int
    hidden: int
    heads: int
    tensor: int
    pipeline: int
    gpus: int
    batch: int
    measured: float
    device: str = "A100-80GB"
    seq: int = 2048
    vocab: int = 51200
    ffn: int = 0
    kv_heads: int = 0
    techniques: Tuple[Techniques, ...] = (Techniques("full", 0, True),)
    role: str = "fit"
    step_s: float = 0.0
    interleaved: bool = False
    sequence_parallel: bool = False
    flash_attention: bool = False
    micro_batch: int = 0

    @property
    def rows_per_replica(self):
        return self.batch * self.tensor * self.pipeline // self.gpus

    @property
    def hardware(self):
        return dataclasses.replace(CATALOG[self.device], devices_per_node=8)


# The fit set: Narayanan et al. SC'21, Table 1 (GPT: layers, hidden, heads,
# tensor, pipeline, GPUs, global batch, measured model TFLOP/s per GPU), full
# recomputation and mixed precision; hardware.EFFICIENCY (0.7) was chosen so
# these rows land within 15%.
TABLE = {"1.7B": Run("gpt", 24, 2304, 24, 1, 1, 32, 512, 137),
         "3.6B": Run("gpt", 30, 3072, 32, 2, 1, 64, 512, 138),
         "7.5B": Run("gpt", 36, 4096, 32, 4, 1, 128, 512, 142),
         "18.4B": Run("gpt", 40, 6144, 48, 8, 1, 256, 1024, 135),
         "39.1B": Run("gpt", 48, 8192, 64, 8, 2, 512, 1536, 138),
         "76.1B": Run("gpt", 60, 10240, 80, 8, 4, 1024, 1792, 140),
         "145.6B": Run("gpt", 80, 12288, 96, 8, 8, 1536, 2304, 148),
         "310.1B": Run("gpt", 96, 16384, 128, 8, 16, 1920, 2160, 155),
         "529.6B": Run("gpt", 105, 20480, 128, 8, 35, 2520, 2520, 163),
         "1T": Run("gpt", 128, 25600, 160, 8, 64, 3072, 3072, 163)}
# The judged set: Smith et al. 2022 ("Using DeepSpeed and Megatron to Train
# Megatron-Turing NLG 530B"), section 2.4: MT-NLG 530B (105 layers, hidden
# 20480, 128 heads, sequence 2048) with 1920 sequences a step on 280, 350 and
# 420 DGX A100 nodes (80-GB A100s), 8-way tensor slicing within a node and
# 35-way pipelines across nodes, measured 60.1, 50.2 and 44.4 s a step (126,
# 121 and 113 TFLOP/s per GPU). Full recomputation: those TFLOP/s are Eq. 3's
# count, which includes it, at those times. Vocabulary: GPT-2's, padded as
# Megatron pads it for 8-way tensors (51200; the logits are 0.15% of the
# step's FLOPs, V / 16lh). Micro-batch size not published: inferred from how
# the three steps scale (``micro_batch_of``).
MT_NLG = dict(role="judged")
TABLE.update({f"MT-NLG-{gpus}": Run("gpt", 105, 20480, 128, 8, 35, gpus, 1920, tflops,
                                    step_s=step_s, **MT_NLG)
              for gpus, tflops, step_s in ((2240, 126, 60.1), (2800, 121, 50.2),
                                           (3360, 113, 44.4))})
# Judged: Dubey et al. 2024 ("The Llama 3 Herd of Models"), Table 4: Llama 3
# 405B at sequence 8192, 16M tokens a step, in BF16 with FSDP, on 8192 and
# 16384 H100s, with sequence parallelism and interleaved stages (both
# modelled: the pinned estimate may use them), without activation
# checkpointing at 8K sequences (their section 3.3.2) and with FlashAttention
# (which TF 2.15 does not have: costed as it runs, ``flash_view``).
LLAMA_405B = dict(device="H100-80GB", seq=8192, vocab=128256, ffn=53248, kv_heads=8,
                  techniques=tuple(Techniques("none", zero, True) for zero in (0, 1, 2)),
                  role="judged", interleaved=True, sequence_parallel=True,
                  flash_attention=True)
TABLE.update({"Llama-405B-8K": Run("llama", 126, 16384, 128, 8, 16, 8192, 2048, 430,
                                   **LLAMA_405B),
              "Llama-405B-16K": Run("llama", 126, 16384, 128, 8, 16, 16384, 2048, 400,
                                    **LLAMA_405B)})
QUICK = ("1.7B", "3.6B")
# Targets (at most): |pinned / published step - 1| (fit and judged rows),
# chosen / pinned step (the chooser keeps the plan of fewer stages within
# choice.TOLERANCE of a faster one: a pinned interleaved plan may be that
# much faster), plan / build.
TARGETS = {"estimate": 0.15, "chosen_pinned": 1 + TOLERANCE, "plan_build": 0.25}
COLUMNS = [("model", "model", ""), ("GPUs", "gpus", "d"), ("build s", "build_s", ".1f"),
           ("plan s", "plan_s", ".1f"), ("plan/build", "plan_build", ".2f"),
           ("chosen", "chosen", ""), ("TFLOP/s", "chosen_tflops", ".0f"),
           ("GiB", "chosen_gib", ".1f"), ("published", "published", ""),
           ("measured", "published_tflops", ".0f"), ("meas. s", "published_step_s", ".2f"),
           ("pinned", "pinned", ""), ("pinned TFLOP/s", "pinned_tflops", ".0f"),
           ("pinned s", "pinned_step_s", ".2f"), ("pinned/meas. s", "estimate", ".2f")]


def step_flops(run, recompute="full"):
    """FLOPs of one training step: a GPT's forward and backward (3 x forward:
    24 B s h^2 + 4 B s^2 h a layer, 2 B s h V the logits) plus the forward
    ``recompute`` runs again (full: every layer's, as Narayanan et al.'s
    Eq. 3 counts it; selective: Q K^T's); a Llama's as its MFU counts them,
    6 per weight of its contractions and 12 s h per layer for attention,
    per token."""
    tokens, l, h, s = run.batch * run.seq, run.layers, run.hidden, run.seq
    if run.family == "gpt":
        layers = 24 * run.batch * s * l * h ** 2 * (1 + s / (6 * h))
        again = {"none": 0, "selective": 2 * run.batch * s ** 2 * l * h, "full": layers}
        return 3 * (layers + 2 * tokens * h * run.vocab) + again[recompute]
    kv = run.kv_heads * h // run.heads
    weights = l * (2 * h * h + 2 * h * kv + 3 * h * run.ffn) + h * run.vocab
    return tokens * (6 * weights + 12 * l * s * h)


def model_of(run):
    """What a run's graph is built from: rows of one model and batch share it."""
    return (run.family, run.layers, run.hidden, run.heads, run.seq, run.vocab, run.batch,
            run.ffn, run.kv_heads)


@functools.lru_cache(maxsize=1)
def build_view(model):
    """(model view of the training graph of ``model_of(run)``, seconds building
    it took, seconds reading it)."""
    family, layers, hidden, heads, seq, vocab, batch, ffn, kv_heads = model
    graph = tf.Graph()
    try:
        with graph.as_default():
            wh.init({"cluster.num_devices": 1})
            start = time.perf_counter()
            if family == "gpt":
                gpt_train_op(layers, hidden, seq, vocab, heads, batch)
            else:
                llama_train_op(layers, hidden, ffn, heads, kv_heads, seq, vocab, batch)
            build_s = time.perf_counter() - start
            start = time.perf_counter()
            with gc_paused():  # as tfpar's planning pass reads it
                _, view = model_view(GraphIndex(graph), capture_for(graph))
            view_s = time.perf_counter() - start
    finally:
        wh.reset()
        del graph
        gc.collect()
    return dataclasses.replace(view, compute_dtype="tf32"), build_s, view_s


def measure(name):
    """One result row: build, plan everything, estimate the published configuration."""
    run = TABLE[name]
    gpus, batch, t, p, hardware = run.gpus, run.batch, run.tensor, run.pipeline, run.hardware
    print(f"plan_scale: {name} on {gpus} GPUs ...", file=sys.stderr, flush=True)
    view, build_s, view_s = build_view(model_of(run))
    start = time.perf_counter()
    offered = TECHNIQUES + (("sequence_parallel",) if run.sequence_parallel else ())
    with gc_paused():  # as tfpar's planning pass searches (runtime.automatic)
        chosen = choose(search_all(view, gpus, hardware, batch, None,
                                   time_limit_s=SEARCH_LIMIT_S, techniques=offered,
                                   split_heads=True), hardware)
    plan_s = view_s + time.perf_counter() - start
    pinned, runnable, flash_share, fastest = pinned_estimates(run, view)
    pinned_tflops = step_flops(run) / (pinned.step_time_s * gpus) / 1e12
    return {"model": name, "set": run.role, "gpus": gpus,
            "batch": batch, "device": run.device, "seq": run.seq,
            "build_s": build_s, "plan_s": plan_s,
            "plan_build": plan_s / build_s, "chosen": chosen.describe(),
            "chosen_tflops": step_flops(run, chosen.techniques.recompute)
            / (chosen.step_time_s * gpus) / 1e12,
            "chosen_step_s": chosen.step_time_s, "chosen_gib": chosen.memory_bytes / 2 ** 30,
            "fits": chosen.memory_bytes <= hardware.memory_gb * 2 ** 30,
            "published": f"data {gpus // (t * p)} x tensor {t} x pipeline {p}",
            "published_tflops": run.measured, "published_step_s": run.published_step_s,
            "pinned": pinned.describe(), "pinned_step_s": pinned.step_time_s,
            "pinned_gib": pinned.memory_bytes / 2 ** 30,
            "pinned_tflops": pinned_tflops, "estimate": pinned.step_time_s / run.published_step_s,
            "runnable": runnable.describe(), "runnable_step_s": runnable.step_time_s,
            "chosen_pinned": chosen.step_time_s / runnable.step_time_s,
            "flash_share": flash_share, "micro_batch": micro_batch_of(run),
            "fastest_estimate": fastest and fastest.step_time_s / run.published_step_s}


def pinned_estimates(run, view):
    """(the pinned estimate of ``run`` as it ran, the one chosen plans are
    held to, FlashAttention's share of the first or None, the first with
    the fastest micro-batch count where its size is known, else None).
    Chosen plans are held to the published mesh as the search costs every
    mesh: the fastest micro-batch count, and, with FlashAttention, which
    TensorFlow lacks, TensorFlow's attention and the recomputation it needs
    to fit. The first costs the attention as FlashAttention runs it
    (``flash_view``); its share is what the same configuration with
    TensorFlow's attention takes longer."""
    size, _ = micro_batch_of(run)
    ran = flash_view(view, run) if run.flash_attention else view
    pinned = pinned_candidate(run, ran, size)
    searched = pinned_candidate(run, ran, 0) if size else pinned
    if not run.flash_attention:
        return pinned, searched, None, searched if size else None
    plain = pinned_candidate(run, view, size)
    fitting = dataclasses.replace(run, techniques=tuple(
        Techniques(mode, zero, True) for mode in RECOMPUTE for zero in (0, 1, 2)))
    return (pinned, pinned_candidate(fitting, view, 0),
            1 - pinned.step_time_s / plain.step_time_s, searched if size else None)


def pinned_candidate(run, view, size):
    """tfpar's estimate of the published configuration: its mesh, 1F1B (the
    fastest number of virtual stages if the run interleaved), its memory
    techniques (and sequence parallelism if it used it), micro-batches of
    ``size`` sequences (0: the fastest count)."""
    techniques = run.techniques + (("sequence_parallel",) if run.sequence_parallel else ())
    found = [c for c in search_all(view, run.gpus, run.hardware, run.batch,
                                   run.rows_per_replica // size if size else None,
                                   pipeline=run.pipeline, time_limit_s=SEARCH_LIMIT_S,
                                   techniques=techniques, split_heads=True, schedules=("1f1b",))
             if c.tensor == run.tensor]
    return min(found, key=lambda c: c.step_time_s) if run.interleaved else found[0]


def micro_batch_of(run):
    """(sequences a micro-batch of ``run``, how known): as "published"; else
    "inferred" from the runs of its model, batch and mesh on other numbers
    of GPUs where they tell it (``inferred_micro_batch``); else (0,
    "searched": the fastest count)."""
    if run.micro_batch:
        return run.micro_batch, "published"
    size = inferred_micro_batch(series_of(run))
    return (size, "inferred") if size else (0, "searched")


def series_of(run):
    """Names of the runs of ``run``'s model, batch and mesh on any number of GPUs."""
    return tuple(name for name, other in TABLE.items()
                 if model_of(other) == model_of(run)
                 and (other.tensor, other.pipeline) == (run.tensor, run.pipeline))


@functools.lru_cache(maxsize=None)
def inferred_micro_batch(series):
    """The micro-batch size (of ``MICRO_BATCH_SIZES`` dividing every run's
    rows a replica) whose pinned estimates of the runs ``series`` are most
    alike as fractions of their measured steps (the least max / min), or 0
    when there is one run or no size is alike by ``DECISIVE`` more than
    every other. As the data-parallel degree d grows, a step's m + p - 1
    micro-batch slots shrink to their bubble's p - 1, so the size shows in
    how the measured steps scale with d, whatever the level of the
    estimates: that level, ``hardware.EFFICIENCY``'s, is what the judged
    target checks."""
    runs = [TABLE[name] for name in series]
    if len(runs) < 2:
        return 0
    view = build_view(model_of(runs[0]))[0]
    view = flash_view(view, runs[0]) if runs[0].flash_attention else view

    def spread(size):
        ratios = [pinned_candidate(run, view, size).step_time_s / run.published_step_s
                  for run in runs]
        return max(ratios) / min(ratios)

    spreads = sorted((spread(size), size) for size in MICRO_BATCH_SIZES
                     if all(run.rows_per_replica % size == 0 for run in runs))
    if len(spreads) < 2:
        return 0
    (best, size), (second, _) = spreads[0], spreads[1]
    return size if second > best * (1 + DECISIVE) else 0


MICRO_BATCH_SIZES = (1, 2, 4, 8)
DECISIVE = 0.01  # published steps of 3 figures: 0.1-0.2%; TFLOP/s of 3: 0.1-0.4%


def flash_view(view, run):
    """``view`` with its attention as FlashAttention (Dao et al. 2022, §3.1)
    runs it: the [heads, s, s] scores and what is computed from them stay on
    chip, so the ops making them move none of them through device memory
    (neither write them nor read them) and keep none of them for the
    backward pass, which recomputes ``Q K^T`` (a third more of its FLOPs:
    forward once more beside the backward's two)."""
    scores = run.heads * run.seq ** 2 * 4  # bytes per sequence, float32 as built
    on_chip = {i for i, size in enumerate(view.activation_bytes) if size >= scores}
    traffic, kept, flops = list(view.traffic_bytes), list(view.kept), list(view.flops)
    for i in on_chip:
        traffic[i] -= view.activation_bytes[i]
        kept[i] = 0.0
        if view.types[i] in CONTRACTIONS:
            flops[i] *= 4 / 3
    for i, j, size in view.edges:
        if i in on_chip:
            traffic[j] -= size
    return dataclasses.replace(view, flops=tuple(flops), kept_bytes=tuple(kept),
                               traffic_bytes=tuple(max(t, 0.0) for t in traffic))


def targets(rows):
    """(name, value, limit) of every check of every row, then each set's
    worst estimate of the published step (informational)."""
    found = []
    for r in rows:
        where = f"{r['model']} on {r['gpus']} GPUs"
        found.append((f"{where} ({r['set']}): |pinned / published step - 1|",
                       abs(r["estimate"] - 1), TARGETS["estimate"]))
        found += [(f"{where}: chosen / pinned step", r["chosen_pinned"], TARGETS["chosen_pinned"]),
                  (f"{where}: chosen fits 80 GB (1 = no)", float(not r["fits"]), 0.0),
                  (f"{where}: plan / build", r["plan_build"], TARGETS["plan_build"])]
    for group in SETS:
        errors = [abs(r["estimate"] - 1) for r in rows if r["set"] == group]
        if errors:
            found.append((f"{group} set: worst |pinned / published step - 1| of {len(errors)}",
                          max(errors), None))
    return found


SETS = {"fit": "fit (hardware.EFFICIENCY = 0.7 chosen on these: in sample)",
        "judged": "judged (runs the fit never saw: out of sample)"}


def print_row(r):
    """A row's build, plans and estimate of the published step, in words."""
    print(f"{r['model']} on {r['gpus']} {r['device']}, batch {r['batch']} x {r['seq']}: "
          f"built in {r['build_s']:.1f} s, planned in {r['plan_s']:.1f} s "
          f"({r['plan_build']:.2f} of the build)")
    print(f"  chosen     {r['chosen']}: {r['chosen_step_s']:.2f} s/step, "
          f"{r['chosen_tflops']:.0f} TFLOP/s, {r['chosen_gib']:.1f} GiB per GPU")
    print(f"  published  {r['published']}: {r['published_step_s']:.2f} s/step, "
          f"{r['published_tflops']} TFLOP/s measured")
    print(f"  pinned     {r['pinned']}: {r['pinned_step_s']:.2f} s/step = "
          f"{r['estimate']:.2f} x measured, {r['pinned_tflops']:.0f} TFLOP/s"
          + f", {r['pinned_gib']:.0f} GiB per GPU"
          + _micro_batch_words(r)
          + (f"\n             attention as FlashAttention runs it: {r['flash_share']:.0%} "
             "less than with TensorFlow's attention; what TensorFlow can run of the mesh: "
             f"{r['runnable']}, {r['runnable_step_s']:.2f} s/step"
             if r.get("flash_share") is not None else ""))


def _micro_batch_words(r):
    """How the pinned estimate's micro-batch size is known, in words."""
    size, how = r.get("micro_batch", (0, "searched"))
    if how == "searched":
        return "; micro-batch count searched (not published)"
    words = f"; micro-batches of {size} sequence{'s' * (size > 1)} ({how}"
    if r.get("fastest_estimate") is None:
        return words + ")"
    return words + f"; with the fastest count {r['fastest_estimate']:.2f} x measured)"


def print_table(rows, _found, _args):
    print("tfpar plan scale (8 GPUs a node; TFLOP/s per GPU: the FLOPs each plan runs, GPTs' "
          "recomputation included - Megatron-LM's Eq. 3 with full recomputation -, Llamas' as "
          "their MFU counts)")
    short = [c for c in COLUMNS if c[1] not in ("chosen", "pinned", "published")]
    for group, title in SETS.items():
        chosen = [r for r in rows if r["set"] == group]
        if not chosen:
            continue
        print(f"\n== {title}")
        for r in chosen:
            print_row(r)
        widths = [max(len(head), *(len(cell(r[key], fmt)) for r in chosen))
                  for head, key, fmt in short]
        print("  ".join(f"{head:>{w}}" for (head, _, _), w in zip(short, widths)))
        for r in chosen:
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
