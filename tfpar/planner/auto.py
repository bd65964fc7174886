"""``auto.auto_parallel``: choose data x tensor x pipeline degrees by cost model
(no TensorFlow).

Meshes: for every pipeline degree p dividing the device count K (or the given
``num_task_graph``), data parallelism d = K / p on top; without a pipeline,
every tensor degree t > 1 dividing K, with d = K / t; and tensor x pipeline
meshes with t, p > 1, t within a node, and d = K / (t p). Only feasible ones:
each of the d replicas gets at least one row of each micro-batch (d x
micro-batches <= the global batch), and p is at most the model's stage units
(its runs of repeated blocks and of ops outside them). A tensor mesh is
planned by the sharding search (``sharding.plan_sharding``: Rhino §4 on the
layer graph, ``auto.opt_level`` O2 or O3); a tensor x pipeline mesh by
cutting stages as below and searching each stage's sharding; a pipeline
mesh as follows:
  * stages come from ``partition.partition_stages`` (Rhino's stage ILP);
  * compute: a stage's forward time is its ops' roofline times per row
    (``roofline``: FLOPs at the device's throughput for the model's compute
    dtype, ``Hardware.flops_per_s``, or memory traffic at its bandwidth,
    whichever is longer) x the rows of a micro-batch, backward twice that;
  * each stage then all-reduces its gradients over its d replicas
    (``comm.allreduce``: 2 (d-1)/d of the bytes, 2 ceil(log2 d) latencies);
  * memory per device: the stage's weights, gradients and optimizer slots,
    plus the activations of the micro-batches in flight.
Every mesh's stages become ``step_model.StageModel``s, and its step (with
one micro-batch the stages run one after the other) and memory are
estimated for each micro-batch count, memory technique and pipeline
schedule - 1F1B, ZB-H1, kFkB (``step_model.best_setting``). The fastest
candidate whose memory fits wins (within ``TOLERANCE`` of it, the one with
fewer stages; among those, within ``TENSOR_TOLERANCE``, the lower tensor
degree: the estimates are rough); ``progress`` reports each one as it is
planned. ``time_limit_s`` bounds the whole search: no mesh is planned once
it has passed (after the first), no ILP runs past it, and each ILP solve
gets a share of it (a stage ILP ``STAGE_ILP_SHARE``, a sharding ILP
``SOLVE_SHARE``). Tensor-only meshes of more than a node are planned in
increasing degree until one plans slower than the one before: across nodes
a doubling halves the compute but not the collectives, which only grow.

Each candidate says how it was found and what its estimate assumes (issue
"Say what you did"): how its stages were cut and whether its sharding is
proved optimal (``ir.outcome.Outcome``), its model FLOPs and those its
recomputation adds, the step it would take with every memory technique
(when the search was not allowed them all), and the search's
``SearchRecord``: the meshes it did not plan, the device, dtype and batch.
"""
import dataclasses
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.errors import PlanError
from tfpar.ir.outcome import Outcome
from tfpar.planner.comm import LATENCY_S, Cost, allreduce
from tfpar.planner.layers import layer_graph, subgraph
from tfpar.planner.memory import RECOMPUTE, Techniques, recomputation
from tfpar.planner.partition import StageCut, partition_stages
from tfpar.planner.sharding import (STATE_BYTES as BYTES_PER_PARAM_STATE, Mesh, Problem,
                                    plan_sharding)
from tfpar.planner.roofline import low_precision_speed_up, timed_flops
from tfpar.planner.solving import left_s
from tfpar.planner.step_model import (KERNELS_PER_OP, LAUNCH_S, SEARCHED_SCHEDULES, Setting, Space,
                                      StageModel, best_setting, micro_batch_counts,
                                      technique_space)

__all__ = ["ALL_TECHNIQUES", "Candidate", "HINT_SPEED_UP", "ModelView", "Part", "SearchRecord",
           "StageCosts", "choose", "faster_with_techniques", "meshes_named", "search",
           "search_all", "stage_costs", "stage_units", "timed"]

# Estimates are rough: within TOLERANCE of the fastest, fewer pipeline stages
# win (bubbles and stage balance are where the model errs most); among those,
# the lower tensor degree within TENSOR_TOLERANCE (a split's cost is computed
# from its collectives: a gain of a few percent is noise, one of 9% - Whale's
# 100K-class head on 8 GPUs - is not).
TOLERANCE = 0.1
TENSOR_TOLERANCE = 0.02
# Each ILP solve's share of the search's time limit (2 s and 10 s of the
# default 60): raising auto.search_time_limit_s gives every solve more.
STAGE_ILP_SHARE = 1 / 30
SOLVE_SHARE = 1 / 6
ALL_TECHNIQUES = ("recompute", "zero", "mixed_precision", "offload")
# A plan this many times faster with memory techniques the search was not
# allowed is worth a hint (``faster_with_techniques``).
HINT_SPEED_UP = 1.5


@dataclasses.dataclass(frozen=True)
class ModelView:
    """The forward ops of a model in topological order.

    Attributes:
      flops: FLOPs per batch row of each op.
      activation_bytes: bytes per row each op's output allocates (none for
        one that is its input's buffer: a reshape): whether it runs a kernel.
      param_bytes: bytes of the weights each op reads (counted once).
      edges: (i, j, bytes per row) between ops.
      labels: each op's repeated block (``pruning.block_labels``) or None.
      names, types: op names and types (the sharding search groups ops into
        layers by name scope; without them only pipelines are searched).
      input_bytes: bytes per row each op reads from the model's inputs.
      batch: the global batch the model's inputs declare (None: unknown).
      compute_dtype: the dtype of most of its FLOPs (``hardware.DTYPES``;
        "tf32": float32 that TensorFlow may run as TF32).
      traffic_bytes: bytes per row each op reads and writes in device
        memory (None: unknown, FLOPs alone time the ops).
      kept_bytes: bytes per row of each op's outputs the backward pass reads
        (kept from the forward pass until then; None: unknown, and ``kept``
        is every output, about twice as much on a GPT:
        ``benchmarks/memory.py``).
    """

    flops: Sequence[float]
    activation_bytes: Sequence[float]
    param_bytes: Sequence[float]
    edges: Sequence[Tuple[int, int, float]]
    labels: Optional[Sequence[Optional[str]]] = None
    names: Optional[Sequence[str]] = None
    types: Optional[Sequence[str]] = None
    input_bytes: Optional[Sequence[float]] = None
    batch: Optional[int] = None
    compute_dtype: str = "fp32"
    traffic_bytes: Optional[Sequence[float]] = None
    kept_bytes: Optional[Sequence[float]] = None

    @property
    def kept(self) -> Sequence[float]:
        """Bytes per row each op keeps for the backward pass: ``kept_bytes``,
        else (unknown) every output."""
        return self.activation_bytes if self.kept_bytes is None else self.kept_bytes


@dataclasses.dataclass(frozen=True)
class Part:
    """The estimates of one piece of a candidate - a pipeline stage, or a layer
    of a sharded plan (with its ops): busy seconds per step, bytes per device,
    bytes sent per step."""

    seconds: float
    memory_bytes: float
    comm_bytes: float
    ops: Tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class SearchRecord:
    """How a search went and what its estimates assume: the feasible
    ``meshes`` (tensor, pipeline) in search order, those it did not plan -
    ``unsearched`` (its ``time_limit_s`` ran out first) and ``pruned``
    (tensor degrees across nodes, once one planned slower than the one
    before) - and the ``seconds`` it took; the device type it costed
    (``hardware``, the slowest of the cluster) and how many, the model's
    compute dtype, and the global batch (``batch_known``: the graph or
    config states it); the memory techniques it was allowed (names)."""

    meshes: Tuple[Tuple[int, int], ...]
    unsearched: Tuple[Tuple[int, int], ...]
    pruned: Tuple[Tuple[int, int], ...]
    time_limit_s: float
    seconds: float
    hardware: Hardware
    num_devices: int
    dtype: str
    global_batch: int
    batch_known: bool
    techniques: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One (data, tensor, pipeline) mesh with its estimates, the stage of every
    op, the sharded layers: (name scope, sharding candidate) for every layer
    that runs in a split TaskGraph (with tensor and pipeline both > 1: every
    layer, and ``split_stages`` its pipeline stage), the estimates of its
    parts (stages, or layers of a sharded plan); its micro-batches per step
    and memory techniques, and the bytes of weights, gradients and optimizer
    slots on its fullest device (``state_bytes``).

    How it was found: ``stage_search`` (with a pipeline) and
    ``sharding_search`` (with a tensor degree), ``search`` (the search's
    record). ``flops``: FLOPs per step, the model's (3 x forward) and those
    its recomputation adds; ``faster_with``: its best setting with every
    memory technique (``ALL_TECHNIQUES``) that fits, when the search was not
    allowed them all and it is faster."""

    data: int
    pipeline: int
    stages: Tuple[int, ...]
    step_time_s: float
    memory_bytes: float
    comm_bytes: float
    tensor: int = 1
    split_scopes: Tuple[Tuple[str, str], ...] = ()
    parts: Tuple[Part, ...] = ()
    split_stages: Tuple[int, ...] = ()
    micro_batches: int = 1
    techniques: Techniques = Techniques()
    state_bytes: float = 0.0
    schedule: str = "1f1b"
    group_size: int = 1
    stage_search: Optional[Outcome] = None
    sharding_search: Optional[Outcome] = None
    flops: Tuple[float, float] = (0.0, 0.0)
    faster_with: Optional[Setting] = None
    search: Optional[SearchRecord] = None

    def describe(self) -> str:
        """'data 4 x tensor 2 x pipeline 2, 8 micro-batches, zero_bubble,
        recompute full' (the schedule when not 1F1B)."""
        micro = f", {self.micro_batches} micro-batches" if self.micro_batches > 1 else ""
        schedule = {"1f1b": "", "kfkb": f", kfkb k={self.group_size}"}.get(
            self.schedule, f", {self.schedule}")
        used = self.techniques.describe()
        return (f"data {self.data} x tensor {self.tensor} x pipeline {self.pipeline}{micro}"
                + schedule + (f", {used}" if used != "none" else ""))


def search(model: ModelView, num_devices: int, hardware: Hardware, global_batch: int,
           num_micro_batch: Optional[int], **options) -> Candidate:
    """The fastest candidate that fits ``hardware``'s memory (``search_all``,
    with its ``options``, then ``choose``)."""
    return choose(search_all(model, num_devices, hardware, global_batch, num_micro_batch,
                             **options), hardware)


def search_all(model: ModelView, num_devices: int, hardware: Hardware, global_batch: int,
               num_micro_batch: Optional[int], pipeline: Optional[int] = None,
               time_limit_s: float = 10.0, progress: Callable[[str], None] = lambda line: None,
               opt_level: str = "O2", batch_known: bool = True,
               techniques: Sequence = (), split_heads: bool = False,
               schedules: Sequence[str] = SEARCHED_SCHEDULES,
               group_size: Optional[int] = None,
               precision: Optional[bool] = None) -> List[Candidate]:
    """A candidate per mesh, planned within ``time_limit_s`` in all, each
    with its best micro-batch count (``num_micro_batch``, or searched when
    None), memory techniques (of ``techniques``: "recompute", "zero",
    "mixed_precision"; or exactly the ``memory.Techniques`` settings it
    lists, e.g. a published run's) and pipeline schedule (of ``schedules``,
    the plainest first; kFkB with ``group_size``, or searched when None).
    ``batch_known``: ``global_batch`` is the real one, not an assumed size,
    so meshes that leave a replica without rows are left out.
    ``split_heads``: tensor groups may split attention cores by heads
    (``sharding``'s ``heads``). ``precision``: True when the graph computes
    in 16 bits whatever the plan (``memory.mixed_precision``): every
    candidate is costed so; None: mixed precision is one of ``techniques``.
    Each candidate carries the search's ``SearchRecord``."""
    meshes = _meshes(model, num_devices, pipeline, hardware)
    meshes = _feasible(meshes, model, num_devices, global_batch if batch_known else None,
                       num_micro_batch or 1, progress)
    start = time.monotonic()
    search = _Search(model, num_devices, hardware, global_batch, num_micro_batch, opt_level,
                     techniques, any(t > 1 for t, _ in meshes), split_heads,
                     (tuple(schedules), group_size), precision, time_limit_s)
    candidates, unsearched, pruned = search.run(meshes, progress)
    record = SearchRecord(tuple(meshes), unsearched, pruned, time_limit_s,
                          time.monotonic() - start, hardware, num_devices, model.compute_dtype,
                          global_batch, batch_known, search.allowed_names())
    return [dataclasses.replace(c, search=record) for c in candidates]


def meshes_named(meshes: Sequence[Tuple[int, int]]) -> str:
    """'tensor x pipeline 2x1, 4x1, 1x2' (at most 12, then how many more)."""
    named = [f"{t}x{p}" for t, p in meshes[:12]]
    more = f" and {len(meshes) - 12} more" if len(meshes) > 12 else ""
    return "tensor x pipeline " + ", ".join(named) + more


def _meshes(model: ModelView, num_devices: int, pipeline: Optional[int],
            hardware: Hardware) -> List[Tuple[int, int]]:
    """(tensor, pipeline) degrees dividing the devices, tensor degrees only for
    a model whose ops are named; with a pipeline, tensor groups within a node
    (``devices_per_node``: Narayanan et al., SC'21, §3.2, takeaway 1). A
    tensor group is a divisor of a node or whole nodes, never straddling two
    (7 of a node of 8 would)."""
    pipelines = [pipeline] if pipeline else [p for p in range(1, num_devices + 1)
                                             if num_devices % p == 0]
    meshes = [(1, p) for p in pipelines if num_devices % p == 0]
    if model.names is None:
        return meshes
    node = hardware.devices_per_node or num_devices
    tensors = [t for t in range(2, num_devices + 1)
               if num_devices % t == 0 and (node % t == 0 or t % node == 0)]
    meshes += [(t, 1) for t in tensors if (pipeline or 1) == 1]
    meshes += [(t, p) for p in pipelines if p > 1 for t in tensors
               if t <= node and num_devices % (t * p) == 0]
    return meshes


def stage_units(model: ModelView) -> int:
    """How many stages the model can be cut into: its runs of ops of one
    repeated block (a transformer layer) and of ops outside blocks, each op
    its own unit when there are no blocks."""
    if not model.labels or all(label is None for label in model.labels):
        return len(model.flops)
    runs = [label for i, label in enumerate(model.labels)
            if i == 0 or label != model.labels[i - 1]]
    return len(runs)


def _feasible(meshes: List[Tuple[int, int]], model: ModelView, num_devices: int,
              global_batch: Optional[int], num_micro_batch: int,
              progress: Callable[[str], None]) -> List[Tuple[int, int]]:
    """The (tensor, pipeline) meshes whose every replica gets a row of each
    micro-batch (d x micro-batches <= the global batch, when known) and whose
    stages do not outnumber the model's ``stage_units``.

    Raises:
      PlanError: no mesh is feasible, saying why.
    """
    units = stage_units(model)
    short = {(t, p) for t, p in meshes if global_batch is not None
             and num_devices // (t * p) * (num_micro_batch if p > 1 else 1) > global_batch}
    deep = {(t, p) for t, p in meshes if p > units}
    reasons = ([f"{len(short)} would leave a replica x micro-batch without a row of the "
                f"batch of {global_batch}"] if short else []) + (
        [f"{len(deep)} would have more stages than the model's {units} layers"] if deep else [])
    kept = [mesh for mesh in meshes if mesh not in short and mesh not in deep]
    if reasons:
        progress(f"tfpar auto: {len(meshes) - len(kept)} of {len(meshes)} meshes left out: "
                 + "; ".join(reasons))
    if not kept:
        raise PlanError(f"tfpar: auto.auto_parallel has no feasible mesh of {num_devices} "
                        f"devices: {'; '.join(reasons)}. Use fewer devices "
                        "(cluster.num_devices), a larger batch, or fewer micro-batches "
                        "(pipeline.num_micro_batch)")
    return kept


def choose(candidates: Sequence[Candidate], hardware: Hardware) -> Candidate:
    """The fastest of ``candidates`` whose memory fits.

    Raises:
      PlanError: none fits, naming the smallest memory need.
    """
    capacity = hardware.memory_gb * 2 ** 30
    fitting = [c for c in candidates if c.memory_bytes <= capacity]
    if not fitting:
        fits = "" if not any(c.faster_with for c in candidates) else (
            "; with more memory techniques one would: " + faster_with_techniques(
                candidates, None)[1])
        if not candidates:
            raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits "
                            f"{hardware.name}'s {hardware.memory_gb:g} GB per device")
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits {hardware.name}'s "
                        f"{hardware.memory_gb:g} GB per device; the smallest needs "
                        f"{least.memory_bytes / 2 ** 30:.3g} GB ({least.describe()}){fits}")
    fastest = min(c.step_time_s for c in fitting)
    near = [c for c in fitting if c.step_time_s <= fastest * (1 + TOLERANCE)]
    stages = min(c.pipeline for c in near)
    near = [c for c in near if c.pipeline == stages]
    fastest = min(c.step_time_s for c in near)
    return min((c for c in near if c.step_time_s <= fastest * (1 + TENSOR_TOLERANCE)),
               key=lambda c: (c.tensor, c.step_time_s))


def faster_with_techniques(candidates: Sequence[Candidate], chosen: Optional[Candidate]
                           ) -> Optional[Tuple[float, str, Tuple[str, ...]]]:
    """When the fastest of ``candidates``' settings with every memory
    technique (``Candidate.faster_with``) is at least ``HINT_SPEED_UP``
    times faster than ``chosen`` (None: than nothing): (its speed-up, what
    it is, the technique names it uses that the search was not allowed);
    else None."""
    options = [c for c in candidates if c.faster_with]
    if not options:
        return None
    candidate = min(options, key=lambda c: c.faster_with.step_time_s)
    best = candidate.faster_with
    speed_up = (chosen.step_time_s / best.step_time_s if chosen is not None
                else float("inf"))
    if speed_up < HINT_SPEED_UP:
        return None
    what = dataclasses.replace(candidate, micro_batches=best.micro_batches,
                               techniques=best.techniques, schedule=best.schedule,
                               group_size=best.group_size).describe()
    allowed = candidate.search.techniques if candidate.search else ()
    return (speed_up, f"{what}, estimated {best.step_time_s * 1e3:.4g} ms/step",
            tuple(name for name in best.techniques.names if name not in allowed))


class _Search:
    """What one search shares across meshes: the model's layer graph (when
    some mesh splits tensors), its recomputation terms, its stage cuts per
    pipeline degree (cut once), its deadline (``time_limit_s`` from now)."""

    def __init__(self, model: ModelView, num_devices: int, hardware: Hardware,
                 global_batch: int, num_micro_batch: Optional[int], opt_level: str,
                 techniques: Sequence, tensors: bool, split_heads: bool,
                 schedules: Tuple[Tuple[str, ...], Optional[int]],
                 precision: Optional[bool] = None, time_limit_s: float = 10.0):
        self.time_limit_s, self.deadline = time_limit_s, time.monotonic() + time_limit_s
        self.speed_up = low_precision_speed_up(model.flops, model.traffic_bytes, hardware,
                                               model.compute_dtype)
        raw = model.flops  # per row, as the graph counts them
        self.forward_flops = sum(raw)
        model = timed(model, hardware)
        self.model, self.num_devices, self.hardware = model, num_devices, hardware
        self.global_batch, self.num_micro_batch = global_batch, num_micro_batch
        self.opt_level, self.techniques = opt_level, tuple(techniques)
        self.split_heads, self.precision = split_heads, precision
        self.schedules, self.group_size = schedules
        self.layers = layer_graph(model) if tensors else None
        self.recompute = recomputation(model)
        # Forward FLOPs per row each recomputation mode runs again (the ops
        # it recomputes, counted as the graph counts them).
        self.recomputed = {mode: sum((f for f, again in zip(raw, self.recompute.flops[mode])
                                      if again), 0.0) for mode in RECOMPUTE}
        self.kernels = [int(bool(f or a)) for f, a in zip(model.flops, model.activation_bytes)]
        self.capacity = hardware.memory_gb * 2 ** 30
        self.cuts: Dict[int, StageCut] = {}
        self.solved: Dict = {}  # sharding segments, across stages and meshes
        self.shapes: Dict[Tuple, int] = {}  # layer graphs' shapes, numbered
        self.sharded: Dict = {}  # (graph shape, mesh, split only) -> candidates
        self.plans: Dict = {}  # estimates of sharded graphs, by shape
        self.stage_models: Dict = {}  # their StageModels, by shape and mesh

    def run(self, meshes: Sequence[Tuple[int, int]], progress: Callable[[str], None]):
        """A candidate per mesh of ``meshes``, in order, until the deadline
        (the first mesh planned whatever it); and the meshes not planned:
        those the deadline left (or left without a plan while they were
        planned), and tensor degrees across nodes left out once one planned
        slower than the one before."""
        candidates: List[Candidate] = []
        spanning: List[Candidate] = []  # tensor-only candidates of more than a node
        pruned: List[Tuple[int, int]] = []
        unsearched: List[Tuple[int, int]] = []
        node = self.hardware.devices_per_node or self.num_devices
        for number, (t, p) in enumerate(meshes, 1):
            where = f"tfpar auto [{number}/{len(meshes)}]"
            if left_s(self.deadline) <= 0 and candidates:
                unsearched += meshes[number - 1:]
                progress(f"tfpar auto: search time limit reached after {number - 1} of "
                         f"{len(meshes)} meshes (auto.search_time_limit_s "
                         f"{self.time_limit_s:g} s); not searched: {meshes_named(unsearched)}")
                break
            spans = p == 1 and t > node
            if spans and len(spanning) > 1 and spanning[-1].step_time_s > spanning[-2].step_time_s:
                pruned.append((t, p))
                progress(f"{where} tensor {t} x pipeline 1: left out (tensor "
                         f"{spanning[-1].tensor} across nodes planned slower than "
                         f"{spanning[-2].tensor})")
                continue
            candidate = self.mesh(t, p)
            took = f"({time.monotonic() - self.deadline + self.time_limit_s:.1f} s)"
            if candidate is None and left_s(self.deadline) <= 0:  # its ILPs had no time
                unsearched.append((t, p))
                progress(f"{where} tensor {t} x pipeline {p}: the time limit ran out while it "
                         f"was planned {took}")
                continue
            if candidate is None:
                progress(f"{where} tensor {t} x pipeline {p}: no sharded plan fits or beats "
                         f"data parallelism {took}")
                continue
            spanning += [candidate] if spans else []
            candidates.append(candidate)
            progress(f"{where} {candidate.describe()}: step {candidate.step_time_s * 1e3:.3f} "
                     f"ms, memory/device {candidate.memory_bytes / 2 ** 20:.1f} MiB {took}")
        return candidates, tuple(unsearched), tuple(pruned)

    def allowed_names(self) -> Tuple[str, ...]:
        """The memory techniques the search may use, by name (all of them
        when it is given ``Techniques`` settings to use)."""
        if any(isinstance(t, Techniques) for t in self.techniques):
            return ALL_TECHNIQUES
        return tuple(t for t in ALL_TECHNIQUES if t in self.techniques)

    def stages_of(self, p: int) -> StageCut:
        """The stage cut of ``p`` stages (made once, with its share of the time limit)."""
        if p not in self.cuts:
            model = self.model
            self.cuts[p] = partition_stages(
                model.flops, model.edges, p, self.time_limit_s * STAGE_ILP_SHARE, model.labels,
                self.deadline) if p > 1 else StageCut([0] * len(model.flops),
                                                      Outcome("optimal", "one stage"))
        return self.cuts[p]

    def mesh(self, t: int, p: int) -> Optional[Candidate]:
        """The candidate of data x ``t`` x ``p`` with its best setting (None:
        a tensor mesh whose sharding fits nowhere or shards nothing)."""
        d = self.num_devices // (t * p)
        rows = self.global_batch / d
        counts = micro_batch_counts(max(int(rows), 1), self.num_micro_batch)
        if t == 1:
            return self._unsplit(p, d, rows, counts, self.stages_of(p))
        return self._split(t, p, d, rows, counts)

    def _setting(self, stages: Sequence[StageModel], d: int, rows: float, counts: Sequence[int],
                 cut: float, bandwidth: float) -> Tuple[Setting, Optional[Setting]]:
        """The best setting, and the best with every memory technique when
        the search may not use them all and it fits and is faster."""
        pinned = [t for t in self.techniques if isinstance(t, Techniques)]
        allowed = pinned or technique_space(self.techniques, d, self.speed_up > 1,
                                            self.precision)
        every = technique_space(ALL_TECHNIQUES, d, self.speed_up > 1, self.precision)
        settings = []
        for techniques in [allowed] if pinned or set(every) <= set(allowed) else [allowed, every]:
            space = Space(tuple(counts), tuple(techniques), self.schedules, self.group_size)
            settings.append(best_setting(stages, d, rows, space, cut, bandwidth, self.speed_up,
                                         self.capacity))
        best, faster = settings[0], settings[-1]
        fits = faster.peak_memory <= self.capacity
        better = faster.step_time_s < best.step_time_s or best.peak_memory > self.capacity
        return best, faster if faster is not best and fits and better else None

    def _made(self, best: Setting, faster: Optional[Setting], d: int, t: int, p: int,
              stages: Tuple[int, ...], parts: Tuple[Part, ...], **found) -> Candidate:
        """The candidate of ``best`` (``found``: ``Candidate``'s fields of
        its sharding), with its FLOPs and its stage cut's outcome."""
        batch = self.global_batch
        flops = (3 * self.forward_flops * batch,
                 self.recomputed[best.techniques.recompute] * batch)
        return Candidate(data=d, pipeline=p, stages=stages, step_time_s=best.step_time_s,
                         memory_bytes=best.peak_memory, comm_bytes=best.comm_bytes, tensor=t,
                         parts=parts, micro_batches=best.micro_batches,
                         techniques=best.techniques, state_bytes=max(best.state_bytes),
                         schedule=best.schedule, group_size=best.group_size,
                         stage_search=self.cuts[p].outcome if p > 1 else None, flops=flops,
                         faster_with=faster, **found)

    def _terms(self, ops: Sequence[int], act_scale: float) -> Dict[str, tuple]:
        """``StageModel``'s recomputation fields for ``ops``, activations x ``act_scale``."""
        terms = self.recompute
        flops = _total(self.model.flops, ops) or 1.0
        return {"kept": tuple(act_scale * _total(terms.kept[mode], ops) for mode in RECOMPUTE),
                "transient": tuple(act_scale * terms.transient_bytes(mode, ops)
                                   for mode in RECOMPUTE),
                "recomputed": tuple(_total(terms.flops[mode], ops) / flops
                                    for mode in RECOMPUTE)}

    def _launches(self, ops: Sequence[int]) -> float:
        """Seconds of kernel launches of one micro-batch through ``ops``."""
        return KERNELS_PER_OP * LAUNCH_S * _total(self.kernels, ops)

    def _unsplit(self, p: int, d: int, rows: float, counts: Sequence[int],
                 cut: StageCut) -> Candidate:
        """A pipeline (or, with ``p`` 1, data parallel) candidate of ``cut``."""
        hardware, stages = self.hardware, cut.stages
        per_row = stage_costs(self.model, stages, p, 1.0, hardware)
        members: List[List[int]] = [[] for _ in range(p)]
        for i, stage in enumerate(stages):
            members[stage].append(i)
        models = [StageModel(3 * forward, 0.0, 0.0, self._launches(ops), params,
                             allreduce(d, params, hardware.bandwidth(d, p)),
                             **self._terms(ops, 1.0))
                  for ops, forward, params in zip(members, per_row.forward_s, per_row.param_bytes)]
        best, faster = self._setting(models, d, rows, counts, per_row.cut_bytes,
                                     hardware.link(p))
        parts = tuple(Part(seconds, memory, stage.grads.bytes) for seconds, memory, stage
                      in zip(best.stage_seconds, best.memory_bytes, models))
        return self._made(best, faster, d, 1, p, tuple(stages), parts)

    def _split(self, t: int, p: int, d: int, rows: float,
               counts: Sequence[int]) -> Optional[Candidate]:
        """Data x ``t`` x ``p``: without a pipeline, the sharding search on the
        whole layer graph (layers may stay data parallel); with one, the stages
        of ``partition_stages``, each on its own d x t devices with every layer
        split over groups of t (``split_only``, gradients apart: all-reduced
        over the stage's d replicas once per step). Sharded at the rows of one
        micro-batch (the given count, else the whole batch) of a replica of
        the tensor-only mesh to fit the device (when nothing fits so, with
        its weights, gradients and optimizer slots alone: micro-batches and
        recomputation shrink activations), then evaluated at every setting."""
        layers, hardware, model = self.layers, self.hardware, self.model
        op_stages = self.stages_of(p).stages
        stage_of = [op_stages[layer.ops[0]] for layer in layers.layers]  # non-decreasing
        groups = [[i for i, stage in enumerate(stage_of) if stage == s] for s in range(p)]
        if not all(groups):
            return None
        graphs = [subgraph(layers, members) for members in groups] if p > 1 else [layers]
        shapes = [self._shape(graph) for graph in graphs]
        sharded = self._sharded(shapes, graphs, t, p, d)
        if sharded is None:
            return None
        chosen, outcome = sharded
        models = [self._split_stage(shape, graph, c, t, p, d)
                  for shape, graph, c in zip(shapes, graphs, chosen)]
        cut = sum(size for i, j, size in layers.edges if stage_of[i] != stage_of[j])
        best, faster = self._setting(models, d, rows, counts, cut, _scattered(hardware, t, p))
        final = rows / best.micro_batches
        parts, split, stages = [], [], []
        for s, (shape, graph, candidates) in enumerate(zip(shapes, graphs, chosen)):
            plan = self._plan(shape, graph, candidates, t, p, d, final, p == 1)
            for layer, c, cost, memory in zip(graph.layers, candidates, plan.layer_costs,
                                              plan.layer_memory):
                parts.append(Part(cost.seconds * best.micro_batches, memory,
                                  cost.bytes * best.micro_batches, layer.ops))
                if p > 1 or c != "dp":
                    split += [(scope, c) for scope in layer.scopes]
                    stages += [s] * len(layer.scopes) if p > 1 else []
        op_stage = [0] * len(model.flops)
        for i, layer in enumerate(layers.layers):
            for op in layer.ops:
                op_stage[op] = stage_of[i]
        return self._made(best, faster, d, t, p, tuple(op_stage), tuple(parts),
                          split_scopes=tuple(split), split_stages=tuple(stages),
                          sharding_search=outcome)

    def _sharded(self, shapes, graphs, t: int, p: int, d: int):
        """Each of ``graphs``' (of ``shapes``) sharding candidates and how
        their searches went, as one ``Outcome`` (the first one not proved
        optimal, a timed-out one first); None when one fits nowhere or
        shards nothing. Split stages cost the same per replica whatever d:
        sharded as on one replica of a tensor-only mesh, so that every
        pipeline degree reuses the same solved segments."""
        replicas = 1 if p > 1 else d
        sizing = self.global_batch * t / self.num_devices / (self.num_micro_batch or 1)
        mesh = Mesh(replicas * t, t, sizing * replicas, self.hardware, self.model.compute_dtype)
        chosen, outcomes = [], []
        for shape, graph in zip(shapes, graphs):
            key = (shape, mesh, p > 1)
            if key not in self.sharded:
                self.sharded[key] = self._shard(graph, mesh, p)
            if self.sharded[key] is None or all(c == "dp" for c in self.sharded[key][0]):
                return None
            chosen.append(self.sharded[key][0])
            outcomes.append(self.sharded[key][1])
        return chosen, min(outcomes, key=lambda o: (not o.timed_out, o.path == "optimal"))

    def _shape(self, graph) -> int:
        """A number for what a layer graph's sharding and estimates depend on:
        its layers' identities and its edges (equal for a pipeline's middle
        stages; a number, as the caches' keys hash it often)."""
        shape = (tuple(layer.identity for layer in graph.layers), graph.edges)
        return self.shapes.setdefault(shape, len(self.shapes))

    def _shard(self, graph, mesh: Mesh, p: int) -> Optional[Tuple[Tuple[str, ...], Outcome]]:
        """The sharding search's candidates for ``graph`` on ``mesh`` and how
        it went (None: nothing fits, not even weights, gradients and
        optimizer slots alone); each ILP solve gets ``SOLVE_SHARE`` of the
        time limit, none past the deadline."""
        for activations in (True, False):
            plan = plan_sharding(graph, mesh, self.capacity, self.opt_level,
                                 self.time_limit_s * SOLVE_SHARE, split_only=p > 1,
                                 gradients=p == 1, solved=self.solved, activations=activations,
                                 split_heads=self.split_heads, deadline=self.deadline)
            if plan is not None:
                return plan.candidates, plan.outcome
        return None

    def _problem(self, graph, t: int, p: int, d: int, rows: float,
                 gradients: bool = False) -> Problem:
        return Problem(graph, Mesh(d * t, t, rows * d, self.hardware, self.model.compute_dtype),
                       split_only=p > 1, gradients=gradients)

    def _plan(self, shape, graph, candidates: Sequence[str], t: int, p: int, d: int,
              rows: float, gradients: bool = False):
        """``Problem.plan`` of ``graph`` (of ``shape``) as ``candidates``, made
        once for the stages of one shape (a pipeline's middle stages)."""
        key = (shape, tuple(candidates), t, p, d, rows, gradients)
        if key not in self.plans:
            self.plans[key] = self._problem(graph, t, p, d, rows, gradients).plan(candidates,
                                                                                 False)
        return self.plans[key]

    def _split_stage(self, shape, graph, candidates: Sequence[str], t: int, p: int,
                     d: int) -> StageModel:
        """``graph`` (of ``shape``) sharded as ``candidates``, as a
        ``StageModel`` (affine in the rows: evaluated at one and two rows per
        replica), made once for the stages of one shape."""
        key = (shape, tuple(candidates), t, p, d)
        if key not in self.stage_models:
            self.stage_models[key] = self._stage_model(shape, graph, candidates, t, p, d)
        return self.stage_models[key]

    def _stage_model(self, shape, graph, candidates: Sequence[str], t: int, p: int,
                     d: int) -> StageModel:
        one = self._plan(shape, graph, candidates, t, p, d, 1.0)
        two = self._plan(shape, graph, candidates, t, p, d, 2.0)
        compute = self._problem(graph, t, p, d, 1.0).compute_seconds(candidates)
        per_row = two.step_time_s - one.step_time_s
        params = one.weight_memory / BYTES_PER_PARAM_STATE
        if p == 1:
            with_grads = self._plan(shape, graph, candidates, t, p, d, 1.0, gradients=True)
            grads = Cost(with_grads.step_time_s - one.step_time_s,
                         with_grads.comm_bytes - one.comm_bytes)
        else:
            grads = allreduce(d, params, self.hardware.bandwidth(d, t * p))
        ops = [op for layer in graph.layers for op in layer.ops]
        unsplit = _total(self.recompute.kept["none"], ops) or 1.0
        activations = one.memory_bytes - one.weight_memory
        return StageModel(compute, per_row - compute, two.comm_bytes - one.comm_bytes,
                          one.step_time_s - per_row + self._launches(ops), params, grads,
                          **self._terms(ops, activations / unsplit))


def _total(values: Sequence[float], ops: Sequence[int]) -> float:
    """The sum of ``values`` at ``ops``."""
    return sum(map(values.__getitem__, ops))


def _scattered(hardware: Hardware, t: int, p: int) -> float:
    """Bytes/s between the split stages of a tensor x pipeline mesh: each of
    a stage's ``t`` devices sends its ``1/t`` of the activations to its peer
    in the next stage, which all-gathers them within its group (Narayanan et
    al., SC'21, §4.1: scatter/gather)."""
    between, within = hardware.link(t * p), hardware.link(t)
    return 1 / (1 / (t * between) + (t - 1) / (t * within))


@dataclasses.dataclass(frozen=True)
class StageCosts:
    """Per stage: forward time of one micro-batch (backward is twice it), the
    bytes of its weights, the activations one micro-batch keeps alive; the delay
    of one cross-stage transfer; bytes crossing stages per micro-batch."""

    forward_s: Tuple[float, ...]
    param_bytes: Tuple[float, ...]
    activation_bytes: Tuple[float, ...]
    transfer_s: float
    cut_bytes: float

    @property
    def backward_s(self) -> Tuple[float, ...]:
        return tuple(2 * f for f in self.forward_s)

    @property
    def fixed_bytes(self) -> Tuple[float, ...]:
        return tuple(BYTES_PER_PARAM_STATE * b for b in self.param_bytes)


def timed(model: ModelView, hardware: Hardware) -> ModelView:
    """``model`` with each op's FLOPs its roofline time on ``hardware``
    (``roofline.timed_flops``) and the traffic folded in (None)."""
    if model.traffic_bytes is None:
        return model
    return dataclasses.replace(
        model, flops=timed_flops(model.flops, model.traffic_bytes, hardware, model.compute_dtype),
        traffic_bytes=None)


def stage_costs(model: ModelView, stages: Sequence[int], num_stages: int, rows: float,
                hardware: Hardware) -> StageCosts:
    """The cost model of ``stages`` (stage of each op) for micro-batches of ``rows``."""
    model = timed(model, hardware)
    speed = hardware.flops_per_s(model.compute_dtype)
    bandwidth = hardware.link(num_stages)  # neighbouring stages, consecutive devices
    forward = [0.0] * num_stages
    params = [0.0] * num_stages
    activations = [0.0] * num_stages
    for i, stage in enumerate(stages):
        forward[stage] += model.flops[i] * rows / speed
        params[stage] += model.param_bytes[i]
        activations[stage] += model.kept[i] * rows
    cut = sum(size for i, j, size in model.edges if stages[i] != stages[j]) * rows
    transfer = LATENCY_S + cut / max(num_stages - 1, 1) / bandwidth if num_stages > 1 else 0.0
    return StageCosts(tuple(forward), tuple(params), tuple(activations), transfer, cut)
