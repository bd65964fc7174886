"""Recomputation before the rewrite: the scopes ``memory.recompute`` names,
or what the planner chose (Korthikanti et al., ``planner.memory``)."""
from typing import Dict, List

from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture, recording_paused
from tfpar.planner.memory import recomputation
from tfpar.rewriters import graph_edit
from tfpar.analysis.analysed import Analysed
from tfpar.rewriters.recompute import recompute_ops, recompute_scopes
from tfpar.runtime.context import Runtime

__all__ = ["recompute_configured", "recompute_planned"]


def recompute_configured(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> None:
    """``memory.recompute``'s scopes are recomputed in the backward pass."""
    scopes = rt.config.get("memory.recompute")
    if not scopes:
        return
    _check_recompute(rt)
    with graph_edit.unfinalized(graph), recording_paused():
        copies = recompute_scopes(graph, capture.recorded(), scopes)
    capture.record_copies(copies)


def _check_recompute(rt: Runtime) -> None:
    """``memory.recompute`` is not for plans the planner makes: its estimates
    would not count it (the planner chooses recomputation itself, from
    ``auto.memory_techniques``, and applies what it chose)."""
    if rt.config.get("auto.auto_parallel"):
        raise PlanError("tfpar: memory.recompute is applied to graphs the planner did not "
                        "plan: with auto.auto_parallel, list 'recompute' in "
                        "auto.memory_techniques instead (the planner then recomputes what "
                        "memory needs, and counts it), or remove the key")


def recompute_planned(capture: GraphCapture, analysed: Analysed, mode: str) -> None:
    """The plan's recomputation (Korthikanti et al., ``planner.memory``):
    ``full`` recomputes every repeated block (``ModelView.labels``, name
    scopes), as ``memory.recompute`` would; ``selective`` every attention
    core, outputs included."""
    graph, recorded = analysed.graph, analysed.recorded
    order, view = analysed.view
    with graph_edit.unfinalized(graph), recording_paused():
        if mode == "full":
            copies = recompute_scopes(graph, recorded,
                                      sorted({label for label in view.labels if label}))
        else:
            groups: Dict[str, List[ops.Operation]] = {}
            for op, unit in zip(order, recomputation(view).unit["selective"]):
                if unit >= 0:
                    groups.setdefault(f"attention_core_{unit}", []).append(op)
            copies = recompute_ops(graph, recorded, groups)
    capture.record_copies(copies)
