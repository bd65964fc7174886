"""The automatic plan of an unannotated model (``auto.auto_parallel``,
``num_task_graph``): the search over the model view, and the plan it gives a
graph built before it (the best unsharded one; ``runtime.sharded`` makes the
one that shards, to pin; ``runtime.techniques`` checks its memory techniques)."""
import dataclasses
from typing import Any, Dict, Optional, Sequence, Tuple

from tfpar import fallback
from tfpar.cluster.hardware import HOST_CPU, Hardware, default_node, device_hardware, slowest
from tfpar.cluster.host_speed import host_cpu
from tfpar.compat.tf import ops
from tfpar.errors import ConfigError, PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.ir.outcome import Outcome
from tfpar.ir.plan import Plan, pinned_plan
from tfpar.planner.auto import search_all
from tfpar.planner.balance import balance_stages
from tfpar.planner.choice import choose
from tfpar.planner.costing import STAGE_ILP_SHARE
from tfpar.planner.memory import state_per_weight
from tfpar.planner.partition import StageCut, partition_stages
from tfpar.planner.step_model import in_flight
from tfpar.analysis.analysed import Analysed
from tfpar.runtime.context import Runtime
from tfpar.runtime.gc_paused import gc_paused
from tfpar.runtime.graph_state import state_of
from tfpar.runtime.precision import applied
from tfpar.runtime.progress import progress
from tfpar.runtime.stated import say_how_it_was_found, say_stage_cut

__all__ = ["DEFAULT_BATCH", "Automatic", "automatic_plan", "chosen_pipeline", "cluster_hardware",
           "part_estimate", "pinned_sharding", "planned_config", "planning_batch",
           "with_stage_search"]

DEFAULT_BATCH = 32  # neither auto.global_batch nor the model's inputs say


def pinned_sharding(rt: Optional[Runtime]) -> Dict[str, Any]:
    """The pinned plan's ``sharding`` (empty: none, or no plan pinned)."""
    plan = pinned_plan(rt.config) if rt is not None else None
    return plan.sharding if plan is not None else {}


@dataclasses.dataclass(frozen=True)
class Automatic:
    """Stages tfpar chose itself for the forward ops ``order``: ``stages`` and
    ``count`` of the plan this graph runs; the search's pick ``best`` (may
    shard layers: then it needs a build with the plan pinned) and the best
    plan without sharding, ``runnable`` (None without ``auto.auto_parallel``);
    how ``num_task_graph``'s stages were cut without it (``stage_search``);
    every candidate the search costed (``candidates``)."""

    order: Tuple[ops.Operation, ...]
    param_bytes: Tuple[float, ...]
    stages: Tuple[int, ...]
    count: int
    best: Any = None
    runnable: Any = None
    stage_search: Optional[Outcome] = None
    candidates: Tuple[Any, ...] = ()

    @property
    def tags(self) -> Dict[str, int]:
        return {op.name: s for op, s in zip(self.order, self.stages)}

    @property
    def shards_unbuilt(self) -> bool:
        """The search's pick shards layers, which this graph was built without."""
        return self.best is not self.runnable


def automatic_plan(analysed: Analysed, capture: GraphCapture, rt: Runtime
                   ) -> Optional[Automatic]:
    """The automatic plan of an unannotated model (cached until the model
    trains something new: ops added later cannot change what the losses
    depend on):
    ``auto.auto_parallel`` searches data x tensor x pipeline meshes by cost
    model; ``num_task_graph`` alone cuts that many stages (Whale Examples 3
    and 4), and so does a pinned plan of the search (as many stages as it
    has: the partition is deterministic). None when the model is annotated,
    or built with a pinned plan's sharding."""
    cfg = rt.config
    auto, count = cfg.get("auto.auto_parallel"), cfg.get("auto.num_task_graph")
    if pinned_sharding(rt):
        return None
    if auto and pinned_plan(cfg) is not None:
        auto, count = False, len(pinned_plan(cfg).task_graphs)
    if not auto and (capture.task_graphs or rt.default_strategy is not None
                     or not count or count < 2):
        return None
    if auto and (capture.task_graphs or rt.default_strategy is not None):
        raise PlanError("tfpar: auto.auto_parallel plans the whole model; remove the "
                        "wh.replicate / wh.split scopes and set_default_strategy, or the key")
    key = (len(capture.gradient_calls), len(capture.apply_calls))
    state = state_of(analysed.graph)
    if state.automatic is not None and state.automatic[0] == key:
        return state.automatic[1]
    with gc_paused():
        result = _plan(analysed, rt, auto, count)
    state.automatic = (key, result)
    return result


def _plan(analysed: Analysed, rt: Runtime, auto: bool, count: Optional[int]) -> Automatic:
    """The model's view and the search's pick (``auto``), or ``count`` stages;
    what deserves it said of the graph (``runtime.stated``)."""
    cfg = rt.config
    order, view = analysed.view
    graph = analysed.graph
    time_limit = cfg.get("auto.search_time_limit_s")
    if not auto:
        cut = _stages_on_mixed_devices(rt, view, count, graph) or partition_stages(
            view.flops, view.edges, count, time_limit * STAGE_ILP_SHARE, view.labels)
        say_stage_cut(graph, cut.outcome, f"auto.num_task_graph {count}", time_limit)
        return Automatic(tuple(order), tuple(view.param_bytes), tuple(cut.stages), count,
                         stage_search=cut.outcome)
    # A TF2 step's traces (static batch, relaxed, each new batch shape) are
    # one model: the first one's search plans them all.
    same_model = tuple(op.name for op in order)
    if same_model not in rt.searches:
        rt.searches[same_model] = _search(rt, view, count, time_limit)
    best, runnable, candidates = rt.searches[same_model]
    say_how_it_was_found(graph, rt, best, runnable, candidates)
    stages, count = ((runnable.stages, runnable.pipeline * runnable.virtual_stages)
                     if runnable else ((0,) * len(order), 1))
    return Automatic(tuple(order), tuple(view.param_bytes), tuple(stages), count, best,
                     runnable, candidates=tuple(candidates))


def _search(rt: Runtime, view, count: Optional[int], time_limit: float):
    """The search's pick, the best plan sharding nothing (None: none fits), all candidates."""
    cfg = rt.config
    hardware = cluster_hardware(rt)
    known = bool(cfg.get("auto.global_batch") or view.batch)
    micro = cfg.get("pipeline.num_micro_batch")
    candidates = search_all(view, len(rt.devices), hardware, planning_batch(rt, view),
                            None if micro == 1 and known else micro, count, time_limit,
                            (lambda line: None) if rt.search_said and not rt.searches
                            else progress, cfg.get("auto.opt_level"), batch_known=known,
                            techniques=cfg.get("auto.memory_techniques"),
                            split_heads=cfg.get("auto.split_heads"),
                            precision=True if applied(cfg, rt.device_type) else None,
                            **_searched_schedules(cfg))
    pick = choose(candidates, hardware)
    return pick, pick if pick.tensor == 1 else _unsharded(candidates, hardware), candidates


def _stages_on_mixed_devices(rt: Runtime, view, count: int, graph) -> Optional[StageCut]:
    """``count`` stages cut for the mixed devices of ``cluster.hardware`` by
    Whale's inter-TaskGraph balance (``planner.balance.balance_stages``): stage
    s runs on the devices ranked s-th by memory, as the plan places it
    (§3.3.2), at their slowest rate and within their smallest memory, keeping
    its schedule's micro-batches in flight. None on like devices, with
    ``balance.hardware_aware`` off, or when devices do not divide into stages."""
    cfg = rt.config
    hardware = device_hardware(cfg.get("cluster.hardware"), len(rt.devices))
    if (hardware is None or len(set(hardware)) == 1 or not cfg.get("balance.hardware_aware")
            or len(hardware) % count):
        return None
    replicas = len(hardware) // count
    ranked = sorted(hardware, key=lambda hw: -hw.memory_gb)
    groups = [ranked[s * replicas:(s + 1) * replicas] for s in range(count)]
    dtype = view.compute_dtype
    micro = cfg.get("pipeline.num_micro_batch")
    schedule = "1f1b" if cfg.get("pipeline.schedule") == "auto" else cfg.get("pipeline.schedule")
    group = cfg.get("pipeline.group_size")
    rows = planning_batch(rt, view) / replicas / micro
    stages, fits = balance_stages(
        view.flops, [state_per_weight(view.optimizer_slots) * b for b in view.param_bytes],
        [b * rows for b in view.kept],
        [in_flight(schedule, 1 if group == "auto" else group, count, s, micro)
         for s in range(count)],
        [min(hw.flops_per_s(dtype) for hw in g) for g in groups],
        [min(hw.memory_gb for hw in g) * 2 ** 30 for g in groups])
    if not fits:
        fallback.advise(f"tfpar: the {count} stages of auto.num_task_graph do not all fit the "
                        "memory of cluster.hardware's devices (Whale's Algorithm 1 found no cut "
                        "that does): the step may run out of memory", graph)
    return StageCut(stages, Outcome("hardware-aware cut", "Whale's Algorithm 1"))


def _searched_schedules(cfg) -> Dict[str, Any]:
    """``search_all``'s schedules: every one for ``pipeline.schedule`` "auto",
    else the one set (kFkB with ``pipeline.group_size``, searched if "auto")."""
    schedule, group = cfg.get("pipeline.schedule"), cfg.get("pipeline.group_size")
    if schedule == "auto":
        return {}
    return {"schedules": (schedule,), "group_size": None if group == "auto" else group}


def planning_batch(rt: Runtime, view) -> int:
    """The global batch the cost model assumes: ``auto.global_batch``, else
    the static batch of the model's inputs (``ModelView.batch``), else
    ``DEFAULT_BATCH``. The graph is planned before its first run, which
    often feeds nothing (the initializer), so fed batches are never seen."""
    return rt.config.get("auto.global_batch") or view.batch or DEFAULT_BATCH


def _unsharded(candidates, hardware: Hardware):
    """The best candidate that shards nothing, or None when none fits."""
    try:
        return choose([c for c in candidates if c.tensor == 1], hardware)
    except PlanError:
        return None


def cluster_hardware(rt: Runtime) -> Hardware:
    """The slowest, smallest device of ``cluster.hardware`` - when unset, on
    CPUs the host's measured matmul throughput (``cluster.host_speed``),
    else a generic host CPU - with ``cluster.devices_per_node``, else the
    devices per worker of a TF_CONFIG cluster, else (``_described_nodes``)
    the size of the nodes such devices come in. The one device the search,
    the plan's estimate and the predicted-vs-measured table cost on.

    Raises:
      ConfigError: a described cluster of more devices than a node of any
        catalog type holds, of devices whose nodes vary, says no node size.
    """
    described = device_hardware(rt.config.get("cluster.hardware"), len(rt.devices))
    per_node = rt.config.get("cluster.devices_per_node") or (
        rt.devices_per_worker if rt.cluster is not None else None)
    if described is not None and per_node is None:
        per_node = _described_nodes(described)
    return slowest(described or [host_cpu() if rt.device_type == "CPU" else HOST_CPU], per_node)


def _described_nodes(devices: Sequence[Hardware]) -> Optional[int]:
    """The node size of a described cluster that does not say it: none for
    one node's worth (8 devices at most); else the datacenter nodes of its
    device type (``hardware.NODE_SIZES``: 8), said as a fallback (before, all
    on one node: 1536 A100s planned as if on one NVLink switch)."""
    node = default_node(devices)
    if len(devices) <= (node or 8):
        return None
    names = ", ".join(sorted({d.name for d in devices}))
    if node is None:
        raise ConfigError(f"tfpar: cluster.hardware describes {len(devices)} devices ({names}) "
                          "but not how many a node holds: set cluster.devices_per_node "
                          "(tfpar assumes DGX / HGX nodes of 8 only for V100-32GB, A100-80GB "
                          "and H100-80GB)")
    fallback.fall_back(f"cluster.hardware describes {len(devices)} {names} devices and no "
                       "cluster.devices_per_node",
                       f"they are planned in nodes of {node} (DGX / HGX), not all on one node",
                       "Set cluster.devices_per_node to the devices a node holds")
    return node


def part_estimate(parts) -> Dict[str, float]:
    """A TaskGraph's estimate: the sum of its parts' (stages' or layers')."""
    return {"time_s": sum(p.seconds for p in parts),
            "memory_bytes": sum(p.memory_bytes for p in parts),
            "comm_bytes": sum(p.comm_bytes for p in parts)}


def with_stage_search(plan: Plan, automatic: Optional[Automatic]) -> Plan:
    """``plan`` with how ``auto.num_task_graph``'s stages were cut in its
    estimate (the search's plans say it in theirs; a pinned plan keeps its)."""
    if automatic is None or automatic.stage_search is None or "stage_search" in plan.estimate:
        return plan
    return dataclasses.replace(plan, estimate={**plan.estimate,
                                               "stage_search": automatic.stage_search.to_dict()})


def planned_config(rt: Runtime, automatic: Optional[Automatic]):
    """The config a plan is built with: the micro-batch count and schedule
    the search chose for the plan that runs."""
    if automatic is None or automatic.runnable is None:
        return rt.config
    return rt.config.replace(chosen_pipeline(automatic.runnable))


def chosen_pipeline(candidate) -> Dict[str, Any]:
    """The pipeline keys of a search candidate."""
    return {"pipeline.num_micro_batch": candidate.micro_batches,
            "pipeline.schedule": candidate.schedule, "pipeline.group_size": candidate.group_size}
