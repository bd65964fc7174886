"""Ada-Grouper's online tuning between runs (``runtime.retune``): a profiled
step may move kFkB's k; a Session callable's fixed fetches turn tuning off."""
import dataclasses
import logging
from typing import Optional

from tfpar import fallback
from tfpar.compat.tf import config_pb2, ops
from tfpar.errors import PlanError
from tfpar.ir.schedule import build_schedule
from tfpar.runtime.graph_state import existing_state
from tfpar.runtime.step_trace import step_timeline

__all__ = ["after_run", "keep_group_size", "made_callable"]

log = logging.getLogger("tfpar")


def made_callable(graph: ops.Graph) -> None:
    """A callable (Keras in graph mode) fixes its fetches: online tuning
    cannot move the k of the steps it runs, and is turned off, saying so."""
    state = existing_state(graph)
    if state is not None and state.retuner is not None and state.rewrite.stepped:
        keep_group_size(state.retuner.group_size, "the training step runs through a Session "
                        "callable (Keras), whose fetches are fixed; online tuning follows "
                        "Session.run steps", graph)
        state.retuner = None


def keep_group_size(group_size: int, why: str, graph: ops.Graph) -> None:
    """Say that online tuning (``pipeline.retune_steps``) cannot move k."""
    fallback.fall_back("pipeline.retune_steps (online tuning of kFkB's k)",
                       f"k stays {group_size} as planned: {why}", "Set pipeline.retune_steps to 0 "
                       "to silence this", graph)


def after_run(graph: ops.Graph, run_metadata: Optional[config_pb2.RunMetadata]) -> None:
    """A run of ``graph`` ended: a step profiled for Ada-Grouper's online
    tuning may move k (``runtime.retune``), building that k's pipeline once."""
    state = existing_state(graph)
    retuner = state.retuner if state is not None else None
    if retuner is None or not retuner.pending or run_metadata is None:
        return
    retuner.pending = False
    try:
        tasks = step_timeline(run_metadata, graph=graph).tasks
    except PlanError:  # the trace holds none of the tasks (the run fetched no step)
        return
    if len(tasks) < 2 * retuner.num_stages * retuner.num_micro_batch:
        return  # not a whole training step (a forward-only fetch): no profile this time
    group_size = retuner.profiled(tasks)
    if group_size is None:
        return
    schedule = build_schedule("kfkb", retuner.num_stages, retuner.num_micro_batch, group_size)
    built = state.rewrite.use_group_size(group_size, schedule)
    log.info("tfpar: Ada-Grouper moved k %d -> %d after step %d (%s)",
             state.plan.group_size, group_size, retuner.steps,
             "its pipeline built now, once" if built else "its pipeline was built before")
    state.plan = dataclasses.replace(state.plan, group_size=group_size)
