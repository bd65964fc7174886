"""The plan report the config's ``report`` key asks for: the first training
step of a graph tfpar rewrote is traced, and after it the report (with that
step's timeline beside the simulated one) is written and its path said."""
from typing import Optional

from tfpar.compat.tf import config_pb2, ops
from tfpar.errors import PlanError
from tfpar.runtime.context import active
from tfpar.runtime.graph_state import existing_state
from tfpar.runtime.step_trace import step_timeline

__all__ = ["after_step", "report_due", "rewrite_report"]


def report_due(graph: Optional[ops.Graph]) -> bool:
    """Whether the next run of ``graph`` is the training step the report
    waits for (then it is traced)."""
    rt = active()
    state = existing_state(graph) if graph is not None else None
    return (rt is not None and bool(rt.config.get("report")) and state is not None
            and state.rewrite is not None and state.rewrite.stepped and not state.reported)


def after_step(graph: ops.Graph, run_metadata: Optional[config_pb2.RunMetadata]) -> None:
    """After the traced training step: write the report, once per graph."""
    if run_metadata is None or not report_due(graph):
        return
    existing_state(graph).reported = True
    rewrite_report(graph, run_metadata)


def rewrite_report(graph: ops.Graph, run_metadata: config_pb2.RunMetadata) -> None:
    """Write the report of ``graph``'s plan, with the step ``run_metadata``
    traced, if the config's ``report`` asks for one."""
    path = active().config.get("report")
    if not path:
        return
    try:
        traced = step_timeline(run_metadata, graph=graph)
    except PlanError:  # the trace holds no task of the step
        traced = None
    existing_state(graph).plan.to_html(path, traced)
    print(f"tfpar: plan report written to {path}")
