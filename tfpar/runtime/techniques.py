"""The memory techniques of the plan that runs (the search's pick's, or a
pinned plan's), and the plans tfpar cannot train here, refused by name;
what a rewrite pass prepares before it plans (``prepared``)."""
import dataclasses
from typing import List, Optional, Sequence

from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.ir.plan import pinned_plan
from tfpar.planner.memory import Techniques
from tfpar.analysis.analysed import Analysed
from tfpar.runtime.automatic import Automatic, automatic_plan
from tfpar.runtime.context import Runtime
from tfpar.runtime.planning import analysed_now
from tfpar.runtime.precision import applied
from tfpar.runtime.recomputation import recompute_planned

__all__ = ["Prepared", "planned_techniques", "prepared", "refuse_planning_only", "unapplied"]


@dataclasses.dataclass(frozen=True)
class Prepared:
    """What a rewrite pass has before it plans: the analysis of the graph
    (with the search's recomputation made), the search's result
    (``runtime.automatic``; None for an annotated model) and the memory
    techniques of the plan that runs."""

    analysed: Analysed
    automatic: Optional[Automatic]
    techniques: Techniques


def prepared(graph: ops.Graph, capture: GraphCapture, rt: Runtime) -> Prepared:
    """The search's result and the memory techniques the plan that runs
    needs (the search's pick's, or a pinned plan's), refused when tfpar
    cannot apply them, with its recomputation made, so that the graph is
    planned once, after it (and analysed again, the copies with it)."""
    analysed = analysed_now(graph, capture)
    automatic = automatic_plan(analysed, capture, rt)
    refuse_planning_only(automatic, rt)
    techniques = planned_techniques(automatic, rt)
    if techniques.recompute != "none":
        recompute_planned(capture, analysed, techniques.recompute)
        analysed = analysed_now(graph, capture)
    return Prepared(analysed, automatic, techniques)


def unapplied(techniques: Sequence[str], mixed_precision: bool = False) -> List[str]:
    """Of memory ``techniques`` (``auto.memory_techniques`` names), those
    tfpar cannot apply to the graph: none but mixed precision, unless the
    graph computes in 16 bits (``mixed_precision``, ``runtime.precision``:
    grappler's options are set when a session is made, before the search
    runs; a plan pinned before the graph is built sets them)."""
    return sorted(set(techniques) - {"offload", "recompute", "zero"} - (
        {"mixed_precision"} if mixed_precision else set()))


def planned_techniques(automatic: Optional[Automatic], rt: Runtime) -> Techniques:
    """The memory techniques the plan that runs needs: the search's pick's, or
    a pinned plan's (its estimate's: a plan the planning pass or ``tfpar
    plan`` wrote)."""
    if automatic is not None and automatic.runnable is not None:
        return automatic.runnable.techniques
    pinned = pinned_plan(rt.config)
    estimate = pinned.estimate if pinned is not None else {}
    names = estimate.get("memory_techniques", [])
    return Techniques(recompute=estimate.get("recompute", "none"),
                      zero=estimate.get("zero", int("zero" in names)),
                      mixed_precision="mixed_precision" in names, offload="offload" in names)


def refuse_planning_only(automatic: Optional[Automatic], rt: Runtime) -> None:
    """A plan that needs memory techniques (``auto.memory_techniques``) tfpar
    does not apply to the graph (``unapplied``) cannot train here: raise,
    naming them; a pinned plan too."""
    chosen = [c for c in (automatic.best, automatic.runnable) if c is not None] \
        if automatic is not None else []
    low = applied(rt.config, rt.device_type) is not None
    needs = next((c for c in chosen if unapplied(c.techniques.names, low)), None)
    if needs is not None:
        raise PlanError(f"tfpar: the planner's plan ({needs.describe()}) needs "
                        f"{needs.techniques.describe()}, which the graph's sessions were made "
                        "without: set memory.mixed_precision, or let the planning pass "
                        "(auto.planning_pass) pin the plan before the graph is built")
    pinned = unapplied(planned_techniques(automatic, rt).names, low)
    if pinned:
        raise PlanError(f"tfpar: the pinned plan needs {', '.join(pinned)} (its estimate's "
                        "memory_techniques), which tfpar cannot apply here")

