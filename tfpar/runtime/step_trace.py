"""What a traced training step really ran: ops per device, and when each
pipeline task ran."""
import collections
import re
from typing import Dict, List, Optional, Set, Tuple

from tfpar.cluster.devices import short_name
from tfpar.compat.tf import config_pb2, ops
from tfpar.errors import PlanError
from tfpar.runtime.graph_state import existing_state
from tfpar.ir.host_trace import Event, step_ops
from tfpar.ir.schedule import Task
from tfpar.ir.simulate import SimulationResult, TimedTask, measured
from tfpar.ir.trace import chrome_trace, write_chrome_trace

__all__ = ["function_spans", "step_allocations", "step_devices", "step_spans", "step_timeline"]


# Grappler renames the nodes it rewrites ``scope/ArithmeticOptimizer/AddOpsRewrite_name``,
# and names a chain of unary ops it fuses (a GELU's gradient) after its last op,
# ``name/unary_ops_composition``.
_GRAPPLER_RENAME = re.compile(r"(^|/)[A-Za-z]+Optimizer/[A-Za-z]+_|/unary_ops_composition$")


def _op_name(node: str) -> str:
    """The graph op a traced node runs (the one grappler rewrote or fused into it)."""
    return _GRAPPLER_RENAME.sub(lambda m: m.group(1) or "", node)


def executed_ops(run_metadata: config_pb2.RunMetadata) -> Dict[str, Set[str]]:
    """Graph op name -> the devices (full names) it ran on in a traced step;
    nodes grappler rewrote count for the op they replace."""
    nodes: Dict[str, Set[str]] = {}
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            name = _op_name(node.node_name)
            nodes.setdefault(name, set()).add(device.device.split("/stream:")[0])
    return nodes


def step_devices(run_metadata: config_pb2.RunMetadata,
                 graph: Optional[ops.Graph] = None) -> Dict[str, Dict[str, int]]:
    """Ops a step traced with ``RunOptions(trace_level=FULL_TRACE)`` ran, per
    TaskGraph and device (short names): where the plan really ran, e.g.
    ``{"replicate_all": {"CPU:0": 40, "CPU:1": 40}, "tfpar": {...}}``. Ops tfpar
    added (batch split, sums, merges) count under ``"tfpar"``, ops outside the
    training step under ``"other"``; a graph tfpar did not rewrite has one
    entry, ``"not rewritten"``. ``graph``: the default graph if not given."""
    graph = graph if graph is not None else ops.get_default_graph()
    translator = getattr(existing_state(graph), "rewrite", None)
    owner: Dict[str, str] = {}
    if translator is not None:
        owner = _task_graph_of_ops(translator)
    counts: Dict[str, Dict[str, int]] = collections.defaultdict(collections.Counter)
    for name, devices in executed_ops(run_metadata).items():
        if translator is None:
            key = "not rewritten"
        else:
            key = owner.get(name) or ("tfpar" if name.startswith("tfpar") else "other")
        for device in devices:
            counts[key][short_name(device)] += 1
    return {key: dict(sorted(per.items())) for key, per in sorted(counts.items())}


def step_spans(run_metadata: config_pb2.RunMetadata, graph: ops.Graph
               ) -> Dict[Tuple[str, str], List[Tuple[int, int]]]:
    """(TaskGraph, device short name) -> (start, end) microseconds of each op
    of that TaskGraph that ran there in a traced step of ``graph``, which tfpar
    rewrote (ops tfpar added under ``"tfpar"``, others under ``"other"``)."""
    owner = _task_graph_of_ops(existing_state(graph).rewrite)
    spans: Dict[Tuple[str, str], List[Tuple[int, int]]] = collections.defaultdict(list)
    for device in run_metadata.step_stats.dev_stats:
        where = short_name(device.device.split("/stream:")[0])
        for node in device.node_stats:
            spans[_owner(node.node_name, owner), where].append(
                (node.all_start_micros, node.all_start_micros + node.all_end_rel_micros))
    return dict(spans)


def function_spans(events: List[Event], graph: ops.Graph
                   ) -> Dict[Tuple[str, str], List[Tuple[float, float]]]:
    """As ``step_spans``, for a call of the tf.function step ``graph`` that
    tfpar rewrote, from what the host profiler saw (``ir.host_trace``): each
    op on the device the graph placed it on (an op of a function it calls,
    ``call/node``, as its call op; a node partitioning added, as the op it
    serves; nodes of no op the graph placed, left out)."""
    owner = _task_graph_of_ops(existing_state(graph).rewrite)
    placed = {op.name: short_name(op.device) for op in graph.get_operations() if op.device}
    spans: Dict[Tuple[str, str], List[Tuple[float, float]]] = collections.defaultdict(list)
    for node, start, end in step_ops(events):
        name = _op_name(node)
        while name not in placed and "/" in name:
            name = name.rsplit("/", 1)[0]
        if name in placed:
            spans[_owner(name, owner), placed[name]].append((start, end))
    return dict(spans)


def _owner(node: str, owner: Dict[str, str]) -> str:
    """The TaskGraph a traced node belongs to, ``"tfpar"`` or ``"other"``."""
    name = _op_name(node)
    return owner.get(name) or ("tfpar" if name.startswith("tfpar") else "other")


def step_allocations(run_metadata: config_pb2.RunMetadata) -> Dict[str, List[Tuple[int, int]]]:
    """Device -> the allocator's records of a traced step on it: (microsecond,
    bytes), a release negative."""
    records: Dict[str, List[Tuple[int, int]]] = collections.defaultdict(list)
    for device in run_metadata.step_stats.dev_stats:
        where = device.device.split("/stream:")[0]
        records[where] += [(r.alloc_micros, r.alloc_bytes) for node in device.node_stats
                           for memory in node.memory for r in memory.allocation_records]
    return dict(records)


def _task_graph_of_ops(translator) -> Dict[str, str]:
    """Op name -> TaskGraph name, for every op of the step and its copies
    (those of other group sizes' versions too)."""
    rw = translator.rewrite
    placement = rw.placement
    owner = {op.name: placement.task_graph_names[placement.stage(op)]
             for op in rw.selection.step_ops + rw.selection.update_ops}
    for stage, name in enumerate(placement.task_graph_names):
        for copies in list(rw.version_maps[stage]) + list(rw.device_maps[stage]):
            owner.update((op.name, name) for op in copies.values())
    owner.update((copy.name, owner[op.name])
                 for copy, op in translator.copied_ops().items() if op.name in owner)
    return owner


def step_timeline(run_metadata: config_pb2.RunMetadata, path: Optional[str] = None,
                  graph: Optional[ops.Graph] = None) -> SimulationResult:
    """Pipeline tasks of a step traced with ``RunOptions(trace_level=FULL_TRACE)``.

    On the first device of every stage, each forward / backward task spans
    its ops' first start to last end (microseconds from the first task). With
    ``path``, also written as a Chrome trace laid out like ``Plan.timeline``.

    Raises:
      PlanError: ``graph`` (default: the default graph) was not rewritten by
        tfpar, or ``run_metadata`` holds no trace of its tasks.
    """
    graph = graph if graph is not None else ops.get_default_graph()
    translator = getattr(existing_state(graph), "rewrite", None)
    if translator is None:
        raise PlanError("tfpar: step_timeline needs a graph tfpar has rewritten (run a "
                        "training step first)")
    rewrite = translator.rewrite
    times = {}
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            times[node.node_name] = (node.all_start_micros,
                                     node.all_start_micros + node.all_end_rel_micros)
    tasks = []
    for (device, stage, kind, micro_batch), members in sorted(translator.task_ops.items()):
        spans = [times[op.name] for op in members if op.name in times]
        if device == 0 and spans:
            tasks.append(TimedTask(stage, Task(kind, micro_batch), min(a for a, _ in spans),
                                   max(b for _, b in spans)))
    if not tasks:
        raise PlanError("tfpar: the RunMetadata has no trace of the training step; run it "
                        "with options=RunOptions(trace_level=RunOptions.FULL_TRACE)")
    placement = rewrite.placement
    result = measured(tasks, placement.num_stages)
    if path is not None:
        names = [f"{name} ({short_name(device)})" for name, device in
                 zip(placement.task_graph_names, (d[0] for d in placement.stage_devices))]
        write_chrome_trace(chrome_trace(result, names), path)
    return result
