"""The process-wide tfpar runtime set up by ``wh.init``."""
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from tfpar.config import Config
from tfpar.ir.taskgraph import Strategy

__all__ = ["Runtime", "activate", "active", "deactivate"]


@dataclasses.dataclass
class Runtime:
    """Active configuration and the devices tfpar may use.

    Attributes:
      config: the validated Config.
      devices: full device names tfpar places work on, in order.
      device_type: ``"GPU"`` or ``"CPU"``.
      default_strategy: (strategy, device_count) for ops outside any scope,
        set by ``wh.set_default_strategy``; None means "whole model replicate
        when no scope exists".
      cluster: the multi-worker cluster (``runtime.cluster.Cluster``) or None.
      devices_per_worker: devices of one worker (all of them without a cluster).
      warned_one_device: functions said to train on one device (None: eager
        code), each with what was said.
      function_plan: the plan of the last tf.function step tfpar traced: the
        one it runs, rewritten or on one device (eager scripts: what
        ``wh.current_plan()`` returns).
      function_pick: that step's plan to pin when the search's pick shards
        layers it was built without (``wh.current_plan(to_pin=True)``), else None.
      measured_steps: tf.function name -> the plan whose ``measured`` its calls
        filled (``runtime.measured_calls``; a trace of it for another batch
        takes it over, not measured again).
      searches: forward op names -> (best, runnable, candidates) of the ``auto_parallel``
        search of that model (a TF2 step is traced more than once, an
        Estimator builds a graph per call; the search runs once).
      search_said: the planning pass (``runtime.planning_pass``) said the
        progress lines of this process's first search (it searched the same
        model): that search runs without them.
    """

    config: Config
    devices: List[str]
    device_type: str
    default_strategy: Optional[Tuple[Strategy, Optional[int]]] = None
    cluster: Any = None
    devices_per_worker: int = 0
    warned_one_device: Dict[Optional[str], str] = dataclasses.field(default_factory=dict)
    function_plan: Any = None
    function_pick: Any = None
    measured_steps: Dict[str, Any] = dataclasses.field(default_factory=dict)
    searches: Dict[Any, Any] = dataclasses.field(default_factory=dict)
    search_said: bool = False


_active: Optional[Runtime] = None


def activate(runtime: Runtime) -> None:
    global _active
    _active = runtime


def deactivate() -> None:
    global _active
    _active = None


def active() -> Optional[Runtime]:
    return _active
