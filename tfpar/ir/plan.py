"""Plan: the parallel program tfpar will run, as data the user can read and pin.

The JSON layout is a contract (DESIGN.md "Plan JSON"): fields may be added,
never removed.
"""
import dataclasses
import json
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tfpar.errors import PlanError
from tfpar.ir.compact import device_ranges, numbered
from tfpar.ir.measured import human_bytes as _human_bytes, table as _measured_table
from tfpar.ir.outcome import Outcome
from tfpar.ir.report import write_report
from tfpar.ir.schedule import build_schedule, interleaved_schedule
from tfpar.ir.simulate import simulate as simulate_schedule
from tfpar.ir.trace import chrome_trace, write_chrome_trace

__all__ = ["Plan", "TaskGraphPlan", "pinned_plan"]


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
        """The plan as the JSON-ready dict of DESIGN.md."""
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
          PlanError: a field of the contract (DESIGN.md "Plan JSON") is
            missing or of the wrong kind, named by its path
            (``plan.task_graphs[1].strategy``).
        """
        read = _Reader(data, "plan")
        pipeline = read.get("pipeline", dict, {})
        tgs = []
        for i, raw in enumerate(read.get("task_graphs", list)):
            tg = _Reader(raw, f"plan.task_graphs[{i}]")
            count = tg.get("device_count", int)
            strategy = tg.get("strategy", str)
            if strategy not in ("replicate", "split"):
                tg.fail("strategy", f"'replicate' or 'split', not {strategy!r}")
            replicas = tg.get("replicas", list, None)
            if replicas is None:
                devs = tg.get("devices", list)
                replicas = [devs[i:i + count] for i in range(0, len(devs), count)]
            tgs.append(TaskGraphPlan(
                name=tg.get("name", str), strategy=strategy, device_count=count,
                replicas=tuple(tuple(r) for r in replicas),
                patterns=dict(tg.get("patterns", dict, {})),
                shard_shares=tuple(tg.get("shard_shares", list, ())),
                num_ops=tg.get("num_ops", int, 0), param_bytes=tg.get("param_bytes", int, 0),
                estimate=dict(tg.get("estimate", dict, {}))))
        if not tgs:
            read.fail("task_graphs", "at least one TaskGraph")
        steps = _Reader(pipeline, "plan.pipeline")
        return cls(task_graphs=tuple(tgs),
                   data_parallel_degree=read.get("data_parallel_degree", int),
                   num_micro_batch=steps.get("num_micro_batch", int, 1),
                   schedule=steps.get("schedule", str, "1f1b"),
                   group_size=steps.get("group_size", (int, str), 1),
                   virtual_stages=steps.get("virtual_stages", int, 1),
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
        """A human-readable table of the plan."""
        lines = [
            f"tfpar plan: data_parallel_degree={self.data_parallel_degree} "
            f"num_micro_batch={self.num_micro_batch} schedule={self.schedule}"
            + (f" virtual_stages={self.virtual_stages} (interleaved)"
               if self.virtual_stages > 1 else ""),
        ]
        estimated = any(tg.estimate for tg in self.task_graphs)
        header = ("TaskGraph", "strategy", "devices", "ops", "params", "placement") + (
            ("est. time", "memory/dev", "comm") if estimated else ())
        rows = [header]
        groups = _alike(self.task_graphs, estimated)
        for name, group in groups:
            columns = _columns(group[0], estimated)
            placement = device_ranges([d for tg in group for d in tg.devices])
            rows.append((name,) + columns[:4] + (placement,) + columns[4:])
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        for i, row in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
            if i == 0:
                lines.append("  ".join("-" * w for w in widths))
        for name, group in groups:
            lines += [f"  {name}: {line}" for line in numbered(
                [f"{unit} -> {pattern}" for tg in group
                 for unit, pattern in sorted(tg.patterns.items())])]
        if self.sharding:
            sequence = ", sequence parallel" if self.sharding.get("sequence_parallel") else ""
            lines.append(f"sharded layers (tensor degree {self.sharding['tensor_degree']}"
                         f"{sequence}): "
                         + ", ".join(numbered([f"{scope} -> {how}" for scope, how
                                               in self.sharding["layers"].items()])))
        for tg in self.task_graphs:
            if tg.shard_shares:
                lines.append(f"{tg.name} shards per device (hardware-aware, Whale §3.3.1): "
                             + _percentages(tg.shard_shares))
        if self.batch_shares:
            lines.append("batch rows per replica (hardware-aware, Whale §3.3.1): "
                         + _percentages(self.batch_shares))
        est = self.estimate
        if est:
            step = est.get("step_time_s")
            mem = est.get("memory_bytes_per_device") or [0]
            lines.append(
                "estimate: step_time=" + ("none" if step is None else f"{step * 1e3:.2f} ms")
                + f"  peak memory/device={_human_bytes(max(mem))}"
                + f"  comm/step={_human_bytes(est.get('comm_bytes', 0))}"
                + ("  needs: " + ", ".join(est["memory_techniques"])
                   if est.get("memory_techniques") else ""))
            if step is None:
                lines.append("  (not costed: tfpar costs the plans it makes for a graph)")
            lines += _stated(est)
        lines += _logical_devices(self)
        lines += [_measured_table(self.measured)] if self.measured else []
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        """``print(plan)`` shows :meth:`summary`."""
        return self.summary()


class _Reader:
    """Fields of one object of a plan's JSON, checked as they are read."""

    _MISSING = object()

    def __init__(self, data: Any, path: str) -> None:
        self.path = path
        if not isinstance(data, dict):
            raise PlanError(f"tfpar: {path} must be a JSON object, not {type(data).__name__} "
                            "(a plan is what wh.current_plan().to_json() writes)")
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

    def fail(self, key: str, what: str) -> None:
        raise PlanError(f"tfpar: the pinned plan's {self.path}.{key} must be {what} "
                        "(DESIGN.md's plan JSON; wh.current_plan().to_json() writes one)")


def _columns(tg: TaskGraphPlan, estimated: bool) -> Tuple[str, ...]:
    """A TaskGraph's summary columns but its name and placement."""
    est = tg.estimate
    return (tg.strategy, str(len(tg.devices)), str(tg.num_ops), _human_bytes(tg.param_bytes)) + ((
        f"{est.get('time_s', 0) * 1e3:.3f} ms", _human_bytes(est.get("memory_bytes", 0)),
        _human_bytes(est.get("comm_bytes", 0))) if estimated else ())


def _alike(task_graphs: Sequence[TaskGraphPlan], estimated: bool
           ) -> List[Tuple[str, List[TaskGraphPlan]]]:
    """Runs of consecutive TaskGraphs with equal columns whose names differ
    in one number (a pipeline's middle stages), each as (its name written
    once, ``stage_{2..61}``, its TaskGraphs); any other TaskGraph alone."""
    runs: List[List[TaskGraphPlan]] = []
    for tg in task_graphs:
        if runs and _columns(runs[-1][-1], estimated) == _columns(tg, estimated):
            runs[-1].append(tg)
        else:
            runs.append([tg])
    groups = []
    for run in runs:
        names = numbered([tg.name for tg in run])
        groups += [(names[0], run)] if len(names) == 1 else [(tg.name, [tg]) for tg in run]
    return groups


def _logical_devices(plan: "Plan") -> List[str]:
    """The line saying the plan's devices are logical CPU devices, and for a
    described cluster (``cluster.hardware``) what they stand in for."""
    logical = sorted({d for tg in plan.task_graphs for d in tg.devices
                      if re.search(r"/device:CPU:[1-9]", d)},
                     key=lambda d: (d.rsplit(":", 1)[0], int(d.rsplit(":", 1)[1])))
    if not logical:  # one process has one CPU device; the others are TensorFlow's logical ones
        return []
    described = ((plan.estimate or {}).get("assumptions") or {}).get("device")
    what = (f"standing in for the {described} devices described"
            if described is not None and not described.startswith("host-CPU")
            else "sharing its cores (no GPU is visible)")
    return [f"devices: logical CPU devices of one host, {what}, e.g. {device_ranges(logical)}"]


def _stated(est: Dict[str, Any]) -> List[str]:
    """Summary lines of what an estimate assumes and how its plan was found."""
    lines, said = [], est.get("assumptions")
    if said:
        node = f", {said['devices_per_node']} a node" if said.get("devices_per_node") else ""
        dtype, peak = said["compute_dtype"], said["peak_dtype"]
        why = {"tf32": " (float32 matmuls as TF32, TensorFlow's default on Ampere and later)",
               "fp16": " (mixed precision)"}.get(dtype, "") if dtype == peak else (
            f" ({said['device']} runs {dtype} at its {peak} peak)")
        lines.append(f"assumes: {said['devices']} x {said['device']}{node}; {dtype} at "
                     f"{said['peak_tflops']:g} TFLOP/s peak x efficiency "
                     f"{said['efficiency']:g}{why}; batch {said['global_batch']} "
                     f"({said['batch_from']})")
    if "flops_per_step" in est:
        again = est["recomputed_flops_per_step"]
        lines.append(f"FLOPs: {est['flops_per_step']:.3g} a step (model FLOPs: 3 x forward), "
                     f"{est['model_tflops_per_device']:.3g} TFLOP/s per device" + (
                         f"; {est['hardware_tflops_per_device']:.3g} with the {again:.3g} "
                         "recomputation adds (hardware FLOPs)" if again else ""))
    found = []
    if "search" in est:
        search = est["search"]
        skipped = len(search["not_searched"])
        found.append(f"{search['planned']} of {search['meshes']} meshes planned in "
                     f"{search['seconds']:.1f} s (limit {search['time_limit_s']:g} s"
                     + (f", {skipped} not searched" if skipped else "") + ")")
    for key, what in (("stage_search", "stages"), ("sharding_search", "sharding")):
        if key in est:
            found.append(f"{what} {Outcome.from_dict(est[key]).describe()}")
    return lines + (["search: " + "; ".join(found)] if found else [])


def _percentages(shares: Sequence[int]) -> str:
    return " ".join(f"{share / sum(shares):.1%}" for share in shares)


def pinned_plan(config) -> Optional[Plan]:
    """The plan ``config`` pins (key ``plan``), or None: the one reader of a
    pinned plan's JSON (``Plan.from_dict`` checks it; ``wh.init`` reads it
    first, so a broken one is refused there)."""
    return None if config.plan is None else Plan.from_dict(config.plan)
