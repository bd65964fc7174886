"""Plan: the parallel program tfpar will run, as data the user can read and pin.

The JSON layout is a contract (``docs/plan-json.md``): fields may be added,
never removed.
"""
import dataclasses
import json
import math
from typing import Any, Dict, List, Optional, Tuple

from tfpar.errors import PlanError
from tfpar.ir.compact import device_ranges
from tfpar.ir.plan_summary import summary
from tfpar.ir.report import write_report
from tfpar.ir.schedule import build_schedule, interleaved_schedule
from tfpar.ir.simulate import simulate as simulate_schedule
from tfpar.ir.trace import chrome_trace, write_chrome_trace

__all__ = ["PLAN_JSON", "Plan", "TaskGraphPlan", "pinned_plan"]

# Where the plan JSON's fields are described: cited by every error about one.
PLAN_JSON = "docs/plan-json.md describes each field; wh.current_plan().to_json() writes a plan"


@dataclasses.dataclass(frozen=True)
class TaskGraphPlan:
    """How one TaskGraph runs.

    Attributes:
      name: TaskGraph name.
      strategy: ``"replicate"`` or ``"split"``.
      device_count: devices one copy of the TaskGraph uses (the scope's request).
      replicas: device names of every replica, replica-major (for replicate,
        one device per replica).
      patterns: ShardingUnit name -> pattern name (split TaskGraphs).
      num_ops: ops captured in the TaskGraph (forward + backward + apply).
      param_bytes: bytes of the variables the TaskGraph trains (one copy).
      estimate: the planner's ``time_s`` (busy per step), ``memory_bytes``
        (per device) and ``comm_bytes`` (sent per step) for this TaskGraph;
        empty for annotated plans.
      shard_shares: a split TaskGraph's per-device integer weight in the
        dimensions it cuts (mixed devices, ``balance.hardware_aware``: Whale
        §3.3.1); empty: even shards. Decided as the model is built.
    """

    name: str
    strategy: str
    device_count: int
    replicas: Tuple[Tuple[str, ...], ...]
    patterns: Dict[str, str] = dataclasses.field(default_factory=dict)
    num_ops: int = 0
    param_bytes: int = 0
    estimate: Dict[str, float] = dataclasses.field(default_factory=dict)
    shard_shares: Tuple[int, ...] = ()

    @property
    def devices(self) -> List[str]:
        """Every device the TaskGraph runs on, all replicas together."""
        return [d for group in self.replicas for d in group]


@dataclasses.dataclass(frozen=True)
class Plan:
    """Whole-model plan: TaskGraphs, degrees, schedule and cost estimates.

    Attributes:
      task_graphs: one entry per TaskGraph, in creation order.
      data_parallel_degree: replicas of the whole model (nested DP degree
        times the replicate degree of a single replicate TaskGraph).
      num_micro_batch, schedule, group_size: pipeline settings.
      estimate: ``step_time_s`` (None unless the ``auto.auto_parallel`` search
        costed the plan), ``memory_bytes_per_device`` and ``comm_bytes`` per step;
        for a costed plan what it assumes (``assumptions``: device, compute
        dtype, the peak used and which dtype's it is, efficiency, global
        batch), the FLOPs it counts (``flops_per_step``: the model's, 3 x
        forward; ``recomputed_flops_per_step``; ``model_tflops_per_device``
        and ``hardware_tflops_per_device``, recomputation included), and how
        it was found (``search``: meshes planned, not searched, left out;
        ``stage_search`` and ``sharding_search``: ``ir.outcome.Outcome``s;
        ``auto.num_task_graph``'s plans too say ``stage_search``).
      sharding: what the sharding search chose (``auto.auto_parallel``):
        ``tensor_degree`` and ``layers``, name scope -> sharding candidate
        (``planner.sharding``), and ``sequence_parallel`` when the search
        chose it; pinned, those layers are built split (sequence parallel).
      batch_shares: per replica of the model, its integer weight in the global
        batch (rows in proportion, ``balance.hardware_aware`` on mixed
        devices: Whale §3.3.1); empty: even rows.
      notes: what tfpar runs other than what the script or config asked
        (``tfpar.fallback``), each as it was warned.
      measured: predicted against measured after a traced training step
        (``measure.after_steps``; ``ir.measured``): per TaskGraph, compute time
        and peak memory of its busiest device; empty until then.
    """

    task_graphs: Tuple[TaskGraphPlan, ...]
    data_parallel_degree: int
    num_micro_batch: int = 1
    schedule: str = "1f1b"
    group_size: Any = 1
    estimate: Dict[str, Any] = dataclasses.field(default_factory=dict)
    sharding: Dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_shares: Tuple[int, ...] = ()
    notes: Tuple[str, ...] = ()
    virtual_stages: int = 1
    measured: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        """The plan as the JSON-ready dict ``docs/plan-json.md`` describes."""
        return {
            "data_parallel_degree": self.data_parallel_degree,
            "pipeline": {
                "num_micro_batch": self.num_micro_batch,
                "schedule": self.schedule,
                "group_size": self.group_size,
                "num_stages": len(self.task_graphs),
                **({"virtual_stages": self.virtual_stages} if self.virtual_stages > 1 else {}),
            },
            "task_graphs": [
                {
                    "name": tg.name,
                    "strategy": tg.strategy,
                    "device_count": tg.device_count,
                    "devices": tg.devices,
                    "replicas": [list(r) for r in tg.replicas],
                    "patterns": dict(tg.patterns),
                    "shard_shares": list(tg.shard_shares),
                    "num_ops": tg.num_ops,
                    "param_bytes": tg.param_bytes,
                    "estimate": dict(tg.estimate),
                }
                for tg in self.task_graphs
            ],
            "estimate": dict(self.estimate),
            "sharding": dict(self.sharding),
            "batch_shares": list(self.batch_shares),
            "notes": list(self.notes),
            "measured": dict(self.measured),
        }

    def to_json(self, indent: Optional[int] = 2) -> str:
        """The plan as JSON text; ``wh.init({"plan": text})`` pins it."""
        return json.dumps(self.to_dict(), indent=indent, sort_keys=False)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Plan":
        """Inverse of :meth:`to_dict` (unknown extra fields are ignored).

        Raises:
          PlanError: a field of the contract (``docs/plan-json.md``) is
            missing, of the wrong kind or out of range, named by its path
            (``plan.task_graphs[1].strategy``).
        """
        read = _Reader(data, "plan")
        pipeline = read.get("pipeline", dict, {})
        tgs = [_task_graph(raw, f"plan.task_graphs[{i}]")
               for i, raw in enumerate(read.get("task_graphs", list))]
        if not tgs:
            read.fail("task_graphs", "at least one TaskGraph")
        steps = _Reader(pipeline, "plan.pipeline")
        group_size = steps.get("group_size", (int, str), 1)
        if group_size != "auto" and (not isinstance(group_size, int) or group_size < 1):
            steps.fail("group_size", f"an int >= 1 or 'auto', not {group_size!r}")
        return cls(task_graphs=tuple(tgs),
                   data_parallel_degree=read.positive("data_parallel_degree"),
                   num_micro_batch=steps.positive("num_micro_batch", 1),
                   schedule=steps.get("schedule", str, "1f1b"), group_size=group_size,
                   virtual_stages=steps.positive("virtual_stages", 1),
                   estimate=dict(read.get("estimate", dict, {})),
                   sharding=dict(read.get("sharding", dict, {})),
                   batch_shares=tuple(read.get("batch_shares", list, ())),
                   notes=tuple(read.get("notes", list, ())),
                   measured=dict(read.get("measured", dict, {})))

    def simulate(self, forward_time=None, backward_time=None, transfer_time: float = 0.0):
        """Simulate one step of the plan's pipeline schedule (one replica).

        Times are per stage; by default each TaskGraph's op count (forward a
        third, backward two thirds): relative units until the cost model
        estimates seconds. Returns an ``ir.simulate.SimulationResult``."""
        ops_per_stage = [max(tg.num_ops, 1) for tg in self.task_graphs]
        schedule, groups = self.task_schedule()
        if forward_time is None:
            forward_time = [n / 3 for n in ops_per_stage]
        if backward_time is None:
            backward_time = [2 * n / 3 for n in ops_per_stage]
        return simulate_schedule(schedule, forward_time, backward_time, transfer_time,
                                 device_groups=groups)

    def task_schedule(self):
        """(per stage, its ordered tasks; the device groups that run them:
        with interleaved ``virtual_stages``, ``ir.schedule.interleaved_schedule``'s
        G, else None, a group per stage)."""
        if self.virtual_stages > 1:
            groups = len(self.task_graphs) // self.virtual_stages
            return interleaved_schedule(groups, self.virtual_stages, self.num_micro_batch), groups
        return build_schedule(self.schedule, len(self.task_graphs), self.num_micro_batch,
                              self.group_size if isinstance(self.group_size, int) else 1), None

    def timeline(self, path: str, **times) -> Any:
        """Write the planned schedule as a Chrome trace (one row per device of
        the first replica, a block per forward / backward task and transfer) to
        ``path``; ``times`` go to :meth:`simulate`. Returns the simulation."""
        result = self.simulate(**times)
        names = [f"{tg.name} ({device_ranges(tg.replicas[0])})" for tg in self.task_graphs]
        write_chrome_trace(chrome_trace(result, names), path)
        return result

    def to_html(self, path: str, traced=None) -> str:
        """Write the plan report (one self-contained HTML file: devices, layers,
        schedule, memory, searched candidates, notes) to ``path``; ``traced``:
        ``tfpar.step_timeline`` of a traced step, drawn beside the simulated
        one. Returns ``path``."""
        return write_report(self, path, traced)

    def summary(self) -> str:
        """A human-readable table of the plan (``ir.plan_summary``)."""
        return summary(self)

    def __str__(self) -> str:
        """``print(plan)`` shows :meth:`summary`."""
        return self.summary()


def _task_graph(raw: Any, path: str) -> TaskGraphPlan:
    """One TaskGraph of a plan's JSON. Without ``replicas``, its ``devices``
    make them: groups of ``device_count`` for split, one device each for
    replicate (as ``to_dict`` writes them)."""
    tg = _Reader(raw, path)
    count = tg.positive("device_count")
    strategy = tg.get("strategy", str)
    if strategy not in ("replicate", "split"):
        tg.fail("strategy", f"'replicate' or 'split', not {strategy!r}")
    replicas = tg.get("replicas", list, None)
    devices = tg.get("devices", list, None) if replicas is not None else tg.get("devices", list)
    if not (replicas or devices):
        tg.fail("devices", "at least one device")
    if replicas is None:
        width = count if strategy == "split" else 1
        replicas = [devices[i:i + width] for i in range(0, len(devices), width)]
    elif not all(isinstance(r, list) for r in replicas):
        tg.fail("replicas", f"a list of lists of devices, not {replicas!r}")
    elif devices is not None and devices != [d for r in replicas for d in r]:
        tg.fail("devices", f"the devices of its replicas in order ({replicas}), not {devices}")
    return TaskGraphPlan(
        name=tg.get("name", str), strategy=strategy, device_count=count,
        replicas=tuple(tuple(r) for r in replicas),
        patterns=dict(tg.get("patterns", dict, {})),
        shard_shares=tuple(tg.get("shard_shares", list, ())),
        num_ops=tg.get("num_ops", int, 0), param_bytes=tg.get("param_bytes", int, 0),
        estimate=dict(tg.get("estimate", dict, {})))


class _Reader:
    """Fields of one object of a plan's JSON, checked as they are read."""

    _MISSING = object()

    def __init__(self, data: Any, path: str) -> None:
        self.path = path
        if not isinstance(data, dict):
            raise PlanError(f"tfpar: the pinned plan's {path} must be a JSON object, not "
                            f"{type(data).__name__} ({PLAN_JSON})")
        self.data = data

    def get(self, key: str, kind, default: Any = _MISSING) -> Any:
        """``data[key]``, of ``kind``; ``default`` when absent (else an error)."""
        if key not in self.data:
            if default is self._MISSING:
                self.fail(key, "present")
            return default
        value = self.data[key]
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            names = "/".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            self.fail(key, f"of type {names}, not {value!r}")
        return value

    def positive(self, key: str, default: Any = _MISSING) -> int:
        """``data[key]``, an int >= 1; ``default`` when absent (else an error)."""
        value = self.get(key, int, default)
        if value < 1:
            self.fail(key, f"an int >= 1, not {value!r}")
        return value

    def fail(self, key: str, what: str) -> None:
        raise PlanError(f"tfpar: the pinned plan's {self.path}.{key} must be {what} "
                        f"({PLAN_JSON})")


def pinned_plan(config) -> Optional[Plan]:
    """The plan ``config`` pins (key ``plan``), or None: the one reader of a
    pinned plan's JSON (``Plan.from_dict`` checks each field, ``_consistent``
    that they agree; ``wh.init`` reads it first, so a broken one is refused
    there)."""
    return None if config.plan is None else _consistent(Plan.from_dict(config.plan))


def _consistent(plan: Plan) -> Plan:
    """``plan``, whose device counts agree with its devices, as the planner
    makes them: a split TaskGraph's replicas have ``device_count`` devices
    each, a replicate TaskGraph's one each, in VirtualDevices of
    ``device_count``; ``data_parallel_degree`` is the copies of the model
    they make (the greatest common divisor of their replica counts).

    Raises:
      PlanError: a field contradicts the devices, named by its path.
    """
    for i, tg in enumerate(plan.task_graphs):
        path = f"plan.task_graphs[{i}]"
        widths = sorted({len(r) for r in tg.replicas})
        if tg.strategy == "split" and widths != [tg.device_count]:
            _contradicts(path, "device_count", f"the devices of each of its replicas (they have "
                         f"{' or '.join(map(str, widths))})", tg.device_count)
        if tg.strategy == "replicate" and widths != [1]:
            _contradicts(path, "replicas", "one device each (a replicate TaskGraph's)",
                         [list(r) for r in tg.replicas])
        if tg.strategy == "replicate" and len(tg.devices) % tg.device_count:
            _contradicts(path, "device_count", f"a divisor of its {len(tg.devices)} devices "
                         "(the size of each VirtualDevice they form)", tg.device_count)
    copies = math.gcd(*(len(tg.replicas) for tg in plan.task_graphs))
    if plan.data_parallel_degree != copies:
        _contradicts("plan", "data_parallel_degree", f"{copies}, the copies of the model its "
                     "TaskGraphs' replicas make (replicas per TaskGraph: "
                     f"{', '.join(str(len(tg.replicas)) for tg in plan.task_graphs)})",
                     plan.data_parallel_degree)
    return plan


def _contradicts(path: str, key: str, what: str, value: Any) -> None:
    raise PlanError(f"tfpar: the pinned plan's {path}.{key} must be {what}, not {value!r} "
                    f"({PLAN_JSON})")
