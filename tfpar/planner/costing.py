"""Costing one (data, tensor, pipeline) mesh of the automatic search: its
stages cut, its layers sharded, every setting estimated (no TensorFlow).

Sequence parallelism (``auto.memory_techniques`` "sequence_parallel"): a
split mesh is sharded twice, the second search knowing its regions keep and
compute 1/t (``sharding_costs``), and it is taken when its best setting is
faster (by more than ``TOLERANCE`` where the step draws random numbers, so
that dropout masks stay one device's unless it spares recomputation or
micro-batches) or fits where the setting without it does not; beside
pinned ``Techniques`` (a published run's), always."""
import time
from typing import Dict, List, Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.ir.outcome import Outcome
from tfpar.planner.candidate import ALL_TECHNIQUES, Candidate, Part, shared_out
from tfpar.planner.choice import TOLERANCE
from tfpar.planner.comm import Cost, allreduce
from tfpar.planner.interleaved import virtual_stage_counts
from tfpar.planner.layers import layer_graph, subgraphs
from tfpar.planner.memory import RECOMPUTE, Techniques, recomputation
from tfpar.planner.model_view import ModelView, sent_bytes, stage_units, timed
from tfpar.planner.partition import StageCut, partition_stages
from tfpar.planner.roofline import low_precision_speed_up
from tfpar.planner.sharding import plan_sharding
from tfpar.planner.sharding_costs import Mesh, Problem
from tfpar.planner.stage_costs import stage_costs, stage_members
from tfpar.planner.step_model import (KERNELS_PER_OP, LAUNCH_S, Setting, Space, StageModel,
                                      best_setting, kernel_counts, micro_batch_counts,
                                      technique_space)

__all__ = ["MeshCosting", "SOLVE_SHARE", "STAGE_ILP_SHARE"]

# Each ILP solve's share of the search's time limit (2 s and 10 s of the
# default 60): raising auto.search_time_limit_s gives every solve more.
STAGE_ILP_SHARE = 1 / 30
SOLVE_SHARE = 1 / 6


class MeshCosting:
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
        self.pinned = any(isinstance(t, Techniques) for t in self.techniques)
        self.sequence_tolerance = TOLERANCE if model.draws_random_numbers else 0.0
        self.split_heads, self.precision = split_heads, precision
        self.schedules, self.group_size = schedules
        self.layers = layer_graph(model) if tensors else None
        self.recompute = recomputation(model)
        # Forward FLOPs per row each recomputation mode runs again (the ops
        # it recomputes, counted as the graph counts them).
        self.recomputed = {mode: sum((f for f, again in zip(raw, self.recompute.flops[mode])
                                      if again), 0.0) for mode in RECOMPUTE}
        self.kernels = kernel_counts(model.flops, model.activation_bytes)
        self.capacity = hardware.memory_gb * 2 ** 30
        self.cuts: Dict[int, StageCut] = {}
        self.solved: Dict = {}  # sharding segments, across stages and meshes
        self.shapes: Dict[Tuple, int] = {}  # layer graphs' shapes, numbered
        self.sharded: Dict = {}  # (graph shape, mesh, split only) -> candidates
        self.plans: Dict = {}  # estimates of sharded graphs, by shape
        self.stage_models: Dict = {}  # their StageModels, by shape and mesh

    def allowed_names(self) -> Tuple[str, ...]:
        """The memory techniques the search may use, by name (all of them
        when it is given ``Techniques`` settings to use)."""
        if self.pinned:
            return ALL_TECHNIQUES
        return tuple(t for t in ALL_TECHNIQUES if t in self.techniques)

    def sequence_space(self) -> Tuple[bool, ...]:
        """Without and with sequence parallelism, as ``techniques`` allow or pin it."""
        if "sequence_parallel" not in self.techniques:
            return (False,)
        return (True,) if self.pinned else (False, True)

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
            return self._unsplit(p, d, rows, counts)
        return self._split(t, p, d, rows, counts)

    def interleaved(self, base: Candidate) -> List[Candidate]:
        """``base``'s mesh with V = 2, 4, ... stages per device group
        (``interleaved.virtual_stage_counts``) under interleaved 1F1B, when
        1F1B is searched, at the micro-batch counts that are a multiple of
        its groups: a pipeline's stages, or with tensor splits its sharded
        stages (each of the G V on its group's t devices). Tried only when
        ``base`` is more than ``choice.TOLERANCE`` slower than its groups'
        mean busy seconds (``Candidate.busy_s``, as its setting runs them:
        its parts' seconds are a split stage's layers at the compute dtype,
        without mixed precision or recomputation): no schedule of the same
        work on G groups is faster than that, and the chooser keeps the
        fewer stages of a candidate within TOLERANCE of a faster one. V
        doubles while each is faster than the V before it (a V that is not
        shortens the bubble less than its transfers and activations cost;
        more would shorten it less still). The first V is not held to
        ``base``, whose schedule may be another (ZB-H1 fills 1F1B's bubble
        otherwise: V = 2 may lose to it where V = 8 wins)."""
        p, t = base.pipeline, base.tensor
        if (p == 1 or "1f1b" not in self.schedules
                or base.step_time_s <= (1 + TOLERANCE) * base.busy_s):
            return []
        d = self.num_devices // (p * t)
        rows = self.global_batch / d
        counts = [m for m in micro_batch_counts(max(int(rows), 1), self.num_micro_batch)
                  if m % p == 0]
        if not counts:
            return []
        made: List[Candidate] = []
        for v in virtual_stage_counts(p, stage_units(self.model)):
            candidate = (self._unsplit(p, d, rows, counts, v) if t == 1
                         else self._split(t, p, d, rows, counts, v, base))
            if candidate is None:
                continue
            made.append(candidate)
            if len(made) > 1 and candidate.step_time_s >= made[-2].step_time_s:
                break
        return made

    def _setting(self, stages: Sequence[StageModel], d: int, rows: float, counts: Sequence[int],
                 cut: float, bandwidth: float,
                 virtual: int = 1) -> Tuple[Setting, Optional[Setting]]:
        """The best setting (with ``virtual`` stages per device: interleaved
        1F1B), and the best with every memory technique when the search may
        not use them all and it fits and is faster."""
        pinned = [t for t in self.techniques if isinstance(t, Techniques)]
        allowed = pinned or technique_space(self.techniques, d, self.speed_up > 1,
                                            self.precision)
        every = technique_space(ALL_TECHNIQUES, d, self.speed_up > 1, self.precision)
        settings = []
        for techniques in [allowed] if pinned or set(every) <= set(allowed) else [allowed, every]:
            space = Space(tuple(counts), tuple(techniques),
                          self.schedules if virtual == 1 else ("1f1b",), self.group_size, virtual)
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
                         stage_search=self.cuts[p * best.virtual_stages].outcome if p > 1
                         else None, flops=flops, faster_with=faster,
                         stage_memory=best.memory_bytes, virtual_stages=best.virtual_stages,
                         bubble_s=best.bubble_s, transfer_s=best.transfer_s,
                         busy_s=sum(best.stage_seconds) / p, **found)

    def _terms(self, ops: Sequence[int], act_scale: float) -> Dict[str, tuple]:
        """``StageModel``'s recomputation fields for ``ops``, activations x
        ``act_scale``, and the model's optimizer slots."""
        terms = self.recompute
        flops = _total(self.model.flops, ops) or 1.0
        return {"kept": tuple(act_scale * _total(terms.kept[mode], ops) for mode in RECOMPUTE),
                "transient": tuple(act_scale * terms.transient_bytes(mode, ops)
                                   for mode in RECOMPUTE),
                "recomputed": tuple(_total(terms.flops[mode], ops) / flops
                                    for mode in RECOMPUTE),
                "optimizer_slots": self.model.optimizer_slots}

    def _launches(self, ops: Sequence[int]) -> float:
        """Seconds of kernel launches of one micro-batch through ``ops``."""
        return KERNELS_PER_OP * LAUNCH_S * _total(self.kernels, ops)

    def _unsplit(self, p: int, d: int, rows: float, counts: Sequence[int],
                 virtual: int = 1) -> Candidate:
        """A pipeline (or, with ``p`` 1, data parallel) candidate of ``p``
        device groups, each running ``virtual`` stages of the cut of
        ``p virtual`` (interleaved 1F1B when more than one)."""
        hardware, stages = self.hardware, self.stages_of(p * virtual).stages
        per_row = stage_costs(self.model, stages, p * virtual, 1.0, hardware)
        members = stage_members(stages, p * virtual)
        models = [StageModel(3 * forward, 0.0, 0.0, self._launches(ops), params,
                             allreduce(d, params, hardware.bandwidth(d, p)),
                             **self._terms(ops, 1.0))
                  for ops, forward, params in zip(members, per_row.forward_s, per_row.param_bytes)]
        best, faster = self._setting(models, d, rows, counts, per_row.cut_bytes,
                                     hardware.link(p), virtual)
        pieces = [Part(1.0, m.param_bytes + m.kept[0], 1.0) for m in models]  # one a stage
        parts = shared_out(best, p, range(p * virtual), pieces, [m.param_bytes for m in models])
        return self._made(best, faster, d, 1, p, tuple(stages), parts)

    def _split(self, t: int, p: int, d: int, rows: float, counts: Sequence[int],
               virtual: int = 1, kept: Optional[Candidate] = None) -> Optional[Candidate]:
        """Data x ``t`` x ``p``: without a pipeline, the sharding search on the
        whole layer graph (layers may stay data parallel); with one, the stages
        of ``partition_stages``, each on its own d x t devices with every layer
        split over groups of t (``split_only``, gradients apart: all-reduced
        over the stage's d replicas once per step). Sharded at the rows of one
        micro-batch (the given count, else the whole batch) of a replica of
        the tensor-only mesh to fit the device (when nothing fits so, with
        its weights, gradients and optimizer slots alone: micro-batches and
        recomputation shrink activations), then evaluated at every setting.
        With ``virtual`` stages per device group, the cut is of p V stages,
        each layer sharded as in ``kept`` (the mesh without them: its layers'
        shardings do not depend on the cut, and re-solving them for every V
        would cost a search as long as the mesh's own)."""
        layers, hardware, model = self.layers, self.hardware, self.model
        op_stages = self.stages_of(p * virtual).stages
        stage_of = [op_stages[layer.ops[0]] for layer in layers.layers]  # non-decreasing
        groups = stage_members(stage_of, p * virtual)
        if not all(groups):
            return None
        graphs = subgraphs(layers, groups) if p > 1 else [layers]
        shapes = [self._shape(graph) for graph in graphs]
        op_stage = [0] * len(model.flops)
        for i, layer in enumerate(layers.layers):
            for op in layer.ops:
                op_stage[op] = stage_of[i]
        cut = sent_bytes(model.edges, op_stage)
        best, faster, sequence, chosen, outcome = None, None, False, None, None
        tried = (kept.sequence_parallel,) if kept is not None else self.sequence_space()
        for sequence_parallel in tried:
            sharded = (self._sharded(shapes, graphs, t, p, d, sequence_parallel) if kept is None
                       else _as_kept(kept, graphs))
            if sharded is None:
                continue
            models = [self._split_stage(shape, graph, c, t, p, d, sequence_parallel)
                      for shape, graph, c in zip(shapes, graphs, sharded[0])]
            setting = self._setting(models, d, rows, counts, cut, _scattered(hardware, t, p),
                                    virtual)
            if best is None or _relieves(setting[0], best, self.capacity, self.sequence_tolerance):
                (best, faster), sequence, (chosen, outcome) = setting, sequence_parallel, sharded
        if best is None:
            return None
        final = rows / best.micro_batches
        before, state, of_stage, split, stages = [], [], [], [], []
        for s, (shape, graph, candidates) in enumerate(zip(shapes, graphs, chosen)):
            plan = self._plan(shape, graph, candidates, t, p, d, final, p == 1, sequence)
            before += [Part(cost.seconds, memory, cost.bytes, layer.ops) for layer, cost, memory
                       in zip(graph.layers, plan.layer_costs, plan.layer_memory)]
            state += plan.layer_weights
            of_stage += [s] * len(graph.layers)
            for layer, c in zip(graph.layers, candidates):
                if p > 1 or c != "dp":
                    split += [(scope, c) for scope in layer.scopes]
                    stages += [s] * len(layer.scopes) if p > 1 else []
        parts = shared_out(best, p, of_stage, before, state)
        return self._made(best, faster, d, t, p, tuple(op_stage), parts,
                          split_scopes=tuple(split), split_stages=tuple(stages),
                          sharding_search=outcome, sequence_parallel=sequence)

    def _sharded(self, shapes, graphs, t: int, p: int, d: int, sequence: bool = False):
        """Each of ``graphs``' (of ``shapes``) sharding candidates and how
        their searches went, as one ``Outcome`` (the first one not proved
        optimal, a timed-out one first); None when one fits nowhere or
        shards nothing. Split stages cost the same per replica whatever d:
        sharded as on one replica of a tensor-only mesh, so that every
        pipeline degree reuses the same solved segments. ``sequence``: the
        search knows its split layers run sequence parallel."""
        replicas = 1 if p > 1 else d
        sizing = self.global_batch * t / self.num_devices / (self.num_micro_batch or 1)
        mesh = Mesh(replicas * t, t, sizing * replicas, self.hardware, self.model.compute_dtype)
        chosen, outcomes = [], []
        for shape, graph in zip(shapes, graphs):
            key = (shape, mesh, p > 1, sequence)
            if key not in self.sharded:
                self.sharded[key] = self._shard(graph, mesh, p, sequence)
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

    def _shard(self, graph, mesh: Mesh, p: int,
               sequence: bool = False) -> Optional[Tuple[Tuple[str, ...], Outcome]]:
        """The sharding search's candidates for ``graph`` on ``mesh`` and how
        it went (None: nothing fits, not even weights, gradients and
        optimizer slots alone); each ILP solve gets ``SOLVE_SHARE`` of the
        time limit, none past the deadline."""
        for activations in (True, False):
            plan = plan_sharding(graph, mesh, self.capacity, self.opt_level,
                                 self.time_limit_s * SOLVE_SHARE, split_only=p > 1,
                                 gradients=p == 1, solved=self.solved, activations=activations,
                                 split_heads=self.split_heads, deadline=self.deadline,
                                 sequence_parallel=sequence)
            if plan is not None:
                return plan.candidates, plan.outcome
        return None

    def _problem(self, graph, t: int, p: int, d: int, rows: float,
                 gradients: bool = False, sequence: bool = False) -> Problem:
        return Problem(graph, Mesh(d * t, t, rows * d, self.hardware, self.model.compute_dtype),
                       split_only=p > 1, gradients=gradients, sequence_parallel=sequence)

    def _plan(self, shape, graph, candidates: Sequence[str], t: int, p: int, d: int,
              rows: float, gradients: bool = False, sequence: bool = False):
        """``Problem.plan`` of ``graph`` (of ``shape``) as ``candidates`` (with
        sequence parallelism if ``sequence``), made once for the stages of
        one shape (a pipeline's middle stages)."""
        key = (shape, tuple(candidates), t, p, d, rows, gradients, sequence)
        if key not in self.plans:
            self.plans[key] = self._problem(graph, t, p, d, rows, gradients,
                                            sequence).plan(candidates, False)
        return self.plans[key]

    def _split_stage(self, shape, graph, candidates: Sequence[str], t: int, p: int,
                     d: int, sequence: bool = False) -> StageModel:
        """``graph`` (of ``shape``) sharded as ``candidates``, as a
        ``StageModel`` (affine in the rows: evaluated at one and two rows per
        replica), made once for the stages of one shape."""
        key = (shape, tuple(candidates), t, p, d, sequence)
        if key not in self.stage_models:
            self.stage_models[key] = self._stage_model(shape, graph, candidates, t, p, d,
                                                       sequence)
        return self.stage_models[key]

    def _stage_model(self, shape, graph, candidates: Sequence[str], t: int, p: int,
                     d: int, sequence: bool = False) -> StageModel:
        one = self._plan(shape, graph, candidates, t, p, d, 1.0, sequence=sequence)
        two = self._plan(shape, graph, candidates, t, p, d, 2.0, sequence=sequence)
        compute = self._problem(graph, t, p, d, 1.0).compute_seconds(candidates)
        per_row = two.step_time_s - one.step_time_s
        params = one.weight_memory / graph.state_per_weight
        if p == 1:
            with_grads = self._plan(shape, graph, candidates, t, p, d, 1.0, True, sequence)
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


def _relieves(setting: Setting, plain: Setting, capacity: float, tolerance: float) -> bool:
    """Whether ``setting`` (with sequence parallelism) beats ``plain``: a step
    shorter by more than ``tolerance``, or it fits where ``plain`` does not."""
    return (setting.step_time_s * (1 + tolerance) < plain.step_time_s
            or plain.peak_memory > capacity >= setting.peak_memory)


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


def _as_kept(kept: Candidate, graphs) -> Tuple[List[Tuple[str, ...]], Optional[Outcome]]:
    """``_sharded``'s answer for ``graphs`` with each layer sharded as in ``kept``."""
    by_scope = dict(kept.split_scopes)
    return ([tuple(by_scope[layer.scopes[0]] for layer in graph.layers) for graph in graphs],
            kept.sharding_search)
