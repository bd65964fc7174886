"""What the runtime decided for one graph (its plan, its rewrite, online
tuning), kept beside the hooks' capture of it and forgotten with it."""
import dataclasses
import weakref
from typing import Any, Optional

from tfpar.ir.plan import Plan

__all__ = ["GraphState", "existing_state", "reset_states", "state_of"]


@dataclasses.dataclass(eq=False, repr=False)
class GraphState:
    """The runtime's decisions for one graph.

    Attributes:
      plan: the plan the graph runs (set by the rewrite, then by online tuning).
      rewrite: the rewrite's ``FetchTranslator`` (set once, by the rewrite).
      rewritten_calls: how many of the capture's ``gradient_calls`` the
        rewrite parallelised (those built later, a second model's, run as built).
      retuner: Ada-Grouper's online tuner of k (``runtime.retune``), if it applies.
      sharded_plan: the search's sharded plan of a graph built unsharded (it
        runs the best unsharded plan): what current_plan() shows, to be pinned.
      calls_optimized: whether task function calls optimize their bodies when
        instantiated, tfpar's sessions of the graph then running grappler off
        (``runtime.sessions``; None until a session or the rewrite decides).
      automatic: (training calls seen, automatic plan) cached by the planner.
      reported: the config's ``report`` was written (``runtime.report_step``).
      predicted: the cost model of its TaskGraphs (``runtime.prediction``) while
        its steps are measured, else None.
      training_steps: training steps run since the rewrite.
      samples: per traced step measured, per TaskGraph (seconds, bytes).
      variables_held: bytes of variables per device (short name), read at the
        first step measured.
      broadcast: a TF2 step of a Horovod job had its variables set to rank
        0's before its first call (``tf2_functions.before_call``).
    """

    plan: Optional[Plan] = None
    rewrite: Any = None
    rewritten_calls: int = 0
    retuner: Any = None
    sharded_plan: Optional[Plan] = None
    calls_optimized: Optional[bool] = None
    automatic: Any = None
    reported: bool = False
    predicted: Any = None
    training_steps: int = 0
    samples: list = dataclasses.field(default_factory=list)
    variables_held: Optional[dict] = None
    broadcast: bool = False


_states: "weakref.WeakKeyDictionary[Any, GraphState]" = weakref.WeakKeyDictionary()


def state_of(graph: Any) -> GraphState:
    """The state of ``graph``, created on first use."""
    state = _states.get(graph)
    if state is None:
        state = _states[graph] = GraphState()
    return state


def existing_state(graph: Any) -> Optional[GraphState]:
    return _states.get(graph)


def reset_states(graph: Any = None) -> None:
    """Forget the state of ``graph`` (every graph when None), with its capture
    (``hooks.capture.reset_captures``)."""
    if graph is None:
        _states.clear()
    else:
        _states.pop(graph, None)
