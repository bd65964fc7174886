"""What a traced training step really ran: ops per device, and when each
pipeline task ran."""
import collections
from typing import Dict, Optional

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.framework import ops

from tfpar.cluster.devices import short_name
from tfpar.errors import PlanError
from tfpar.hooks.capture import existing_capture
from tfpar.planner.schedule import Task
from tfpar.planner.simulate import SimulationResult, TimedTask, measured
from tfpar.planner.trace import chrome_trace, write_chrome_trace

__all__ = ["step_devices", "step_timeline"]


def step_devices(run_metadata: config_pb2.RunMetadata) -> Dict[str, int]:
    """Ops executed per device (short names, ``CPU:3``) in a step traced with
    ``RunOptions(trace_level=FULL_TRACE)``: where the plan really ran."""
    counts: Dict[str, int] = collections.Counter()
    for device in run_metadata.step_stats.dev_stats:
        counts[short_name(device.device.split("/stream:")[0])] += len(device.node_stats)
    return dict(sorted((d, n) for d, n in counts.items() if n))


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
    capture = existing_capture(graph)
    if capture is None or capture.rewrite is None:
        raise PlanError("tfpar: step_timeline needs a graph tfpar has rewritten (run a "
                        "training step first)")
    rewrite = capture.rewrite.rewrite
    times = {}
    for device in run_metadata.step_stats.dev_stats:
        for node in device.node_stats:
            times[node.node_name] = (node.all_start_micros,
                                     node.all_start_micros + node.all_end_rel_micros)
    tasks = []
    for (device, stage, kind, micro_batch), members in sorted(rewrite.task_ops.items()):
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
