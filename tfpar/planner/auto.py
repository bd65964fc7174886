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
schedule - 1F1B, ZB-H1, kFkB (``step_model.best_setting``). A pipeline
mesh whose stages are not split is also costed with V = 2, 4, ... stages per
device group under interleaved 1F1B (``costing.MeshCosting.interleaved``,
``planner.interleaved``: its bubble shrinks V-fold, its transfers grow
V-fold, its first group holds more activations), each a candidate of its
own. The fastest candidate whose memory fits wins (``choice.choose``: within
``TOLERANCE`` of it, the one with fewer stages, interleaved ones counted;
among those, within ``TENSOR_TOLERANCE``, the lower tensor degree, then the
fewer virtual stages: the estimates are rough); ``progress`` reports each
one as it is planned. ``time_limit_s`` bounds the whole search: no mesh is planned once
it has passed (after the first), no ILP runs past it, and each ILP solve
gets a share of it (a stage ILP ``costing.STAGE_ILP_SHARE``, a sharding ILP
``costing.SOLVE_SHARE``). Tensor-only meshes of more than a node are planned in
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
from typing import Callable, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.planner.candidate import Candidate, SearchRecord
from tfpar.planner.choice import choose
from tfpar.planner.costing import MeshCosting
from tfpar.planner.meshes import candidate_meshes, feasible_meshes, meshes_named
from tfpar.planner.model_view import ModelView
from tfpar.planner.solving import left_s
from tfpar.planner.step_model import SEARCHED_SCHEDULES

__all__ = ["search", "search_all"]


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
    lists, e.g. a published run's, with "sequence_parallel" beside them if
    it ran so) and pipeline schedule (of ``schedules``,
    the plainest first; kFkB with ``group_size``, or searched when None).
    ``batch_known``: ``global_batch`` is the real one, not an assumed size,
    so meshes that leave a replica without rows are left out.
    ``split_heads``: tensor groups may split attention cores by heads
    (``sharding``'s ``heads``). ``precision``: True when the graph computes
    in 16 bits whatever the plan (``memory.mixed_precision``): every
    candidate is costed so; None: mixed precision is one of ``techniques``.
    Each candidate carries the search's ``SearchRecord``."""
    meshes = candidate_meshes(model, num_devices, pipeline, hardware)
    meshes = feasible_meshes(meshes, model, num_devices,
                             global_batch if batch_known else None, num_micro_batch or 1,
                             progress)
    start = time.monotonic()
    costing = MeshCosting(model, num_devices, hardware, global_batch, num_micro_batch,
                          opt_level, techniques, any(t > 1 for t, _ in meshes), split_heads,
                          (tuple(schedules), group_size), precision, time_limit_s)
    candidates, unsearched, pruned = _plan_meshes(costing, meshes, progress)
    record = SearchRecord(tuple(meshes), unsearched, pruned, time_limit_s,
                          time.monotonic() - start, hardware, num_devices, model.compute_dtype,
                          global_batch, batch_known, costing.allowed_names(),
                          model.optimizer_slots)
    return [dataclasses.replace(c, search=record) for c in candidates]


def _plan_meshes(costing: MeshCosting, meshes: Sequence[Tuple[int, int]],
                 progress: Callable[[str], None]):
    """A candidate per mesh of ``meshes``, in order, until the deadline
    (the first mesh planned whatever it); and the meshes not planned:
    those the deadline left (or left without a plan while they were
    planned), and tensor degrees across nodes left out once one planned
    slower than the one before."""
    candidates: List[Candidate] = []
    spanning: List[Candidate] = []  # tensor-only candidates of more than a node
    pruned: List[Tuple[int, int]] = []
    unsearched: List[Tuple[int, int]] = []
    node = costing.hardware.devices_per_node or costing.num_devices
    for number, (t, p) in enumerate(meshes, 1):
        where = f"tfpar auto [{number}/{len(meshes)}]"
        if left_s(costing.deadline) <= 0 and candidates:
            unsearched += meshes[number - 1:]
            progress(f"tfpar auto: search time limit reached after {number - 1} of "
                     f"{len(meshes)} meshes (auto.search_time_limit_s "
                     f"{costing.time_limit_s:g} s); not searched: {meshes_named(unsearched)}")
            break
        spans = p == 1 and t > node
        if spans and len(spanning) > 1 and spanning[-1].step_time_s > spanning[-2].step_time_s:
            pruned.append((t, p))
            progress(f"{where} tensor {t} x pipeline 1: left out (tensor "
                     f"{spanning[-1].tensor} across nodes planned slower than "
                     f"{spanning[-2].tensor})")
            continue
        candidate = costing.mesh(t, p)
        took = f"({time.monotonic() - costing.deadline + costing.time_limit_s:.1f} s)"
        if candidate is None and left_s(costing.deadline) <= 0:  # its ILPs had no time
            unsearched.append((t, p))
            progress(f"{where} tensor {t} x pipeline {p}: the time limit ran out while it "
                     f"was planned {took}")
            continue
        if candidate is None:
            progress(f"{where} tensor {t} x pipeline {p}: no sharded plan fits or beats "
                     f"data parallelism {took}")
            continue
        spanning += [candidate] if spans else []
        for planned in [candidate] + costing.interleaved(candidate):
            candidates.append(planned)
            progress(f"{where} {planned.describe()}: step {planned.step_time_s * 1e3:.3f} "
                     f"ms, memory/device {planned.memory_bytes / 2 ** 20:.1f} MiB {took}")
    return candidates, tuple(unsearched), tuple(pruned)
