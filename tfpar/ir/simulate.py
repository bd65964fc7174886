"""List-scheduling simulation of a pipeline schedule (timing, bubbles, memory); no TensorFlow.

``F(s, m)`` waits for ``F(s-1, m)`` plus a transfer; ``B(s, m)`` waits for ``F(s, m)``
and for ``B(s+1, m)`` plus a transfer; ``W(s, m)`` (zero-bubble) waits for
``B(s, m)``. Each stage runs its tasks in list order, one at a time, each
starting as soon as its stage and its inputs are ready; with interleaved
stages (``device_groups``), each device group runs the tasks of all its
stages one at a time, in their ``slot`` order.
"""
import collections
import dataclasses
import numbers
from typing import Dict, List, Optional, Sequence, Tuple, Union

from tfpar.ir.schedule import Task, validate_schedule

__all__ = ["Replay", "TimedTask", "Transfer", "SimulationResult", "measured", "replay_order",
           "replay_times", "simulate", "task_dependencies"]

Times = Union[float, Sequence[float]]
_Key = Tuple[int, str, int]  # (stage, kind, micro_batch)


@dataclasses.dataclass(frozen=True)
class TimedTask:
    """A task placed on its stage's timeline."""
    stage: int
    task: Task
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Transfer:
    """A cross-stage transfer: activation ("F") to ``s+1`` or gradient ("B") to ``s-1``."""
    src_stage: int
    dst_stage: int
    micro_batch: int
    kind: str
    start: float
    end: float


@dataclasses.dataclass(frozen=True)
class Replay:
    """A schedule's tasks in an order where each comes after its inputs and
    after the task its lane runs before it (``replay_order``): per task its
    stage and ``Task``, and the indices (-1: none) of that previous task, of
    its input on its own stage and of its input from another stage (a task
    has at most one of each: ``task_dependencies``). What a step's timing
    needs, made once for any durations."""
    stages: Tuple[int, ...]
    tasks: Tuple[Task, ...]
    previous: Tuple[int, ...]
    local: Tuple[int, ...]
    remote: Tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class SimulationResult:
    """Timeline of one simulated step.

    Attributes:
      tasks: every task with its times, stage by stage in list order.
      transfers: every cross-stage transfer, by start time.
      length: time when the last task ends.
      bubble_fraction: ``1 - busy time / (num_stages * length)``.
      peak_in_flight: per stage, the most forwards finished whose backward
        (with weight-gradient tasks: its ``W``) has not.
    """
    tasks: List[TimedTask]
    transfers: List[Transfer]
    length: float
    bubble_fraction: float
    peak_in_flight: List[int]

    def __str__(self) -> str:
        return self.describe()

    def describe(self, unit: str = "") -> str:
        """One line: length (then ``unit``, the unit of the times simulated),
        bubble and micro-batches in flight per stage."""
        return (f"length {self.length:g}{unit}, bubble {self.bubble_fraction:.1%}, "
                f"micro-batches in flight per stage {self.peak_in_flight}")


def simulate(schedule: List[List[Task]], forward_time: Times, backward_time: Times,
             transfer_time: float = 0.0, weight_share: float = 0.5,
             device_groups: Optional[int] = None, transfers: bool = True) -> SimulationResult:
    """Simulate one step of ``schedule``.

    Args:
      schedule: ordered task list per stage (see ``build_schedule``).
      forward_time / backward_time: task duration, one number or one per stage;
        a backward split into ``B`` and ``W`` tasks takes ``backward_time`` in all.
      transfer_time: delay of every cross-stage transfer.
      weight_share: the part of a split backward its ``W`` takes (a dense
        layer's weight and input gradients cost one matmul each: 0.5).
      device_groups: interleaved stages (``interleaved_schedule``): stage s
        runs on group ``s % device_groups``; None: a group per stage.
      transfers: list the transfers (False: none, for a caller that needs
        only the timing, as the planner's search, which replays many steps).

    Raises:
      ValueError: malformed schedule or times, or a deadlocked schedule.
    """
    num_micro_batch = sum(t.kind == "F" for t in schedule[0]) if schedule else 0
    validate_schedule(schedule, num_micro_batch)
    num_stages = len(schedule)
    backward = _per_stage("backward_time", backward_time, num_stages)
    durations = {"F": _per_stage("forward_time", forward_time, num_stages), "B": backward}
    if any(t.kind == "W" for t in schedule[0]):
        share = _non_negative("weight_share", weight_share)
        if share > 1:
            raise ValueError(f"weight_share must be at most 1, got {weight_share!r}")
        durations["B"] = [(1 - share) * b for b in backward]
        durations["W"] = [share * b for b in backward]
    delay = _non_negative("transfer_time", transfer_time)

    replay = replay_order(schedule, device_groups)
    starts, ends = replay_times(replay, durations, delay)
    tasks = sorted(map(TimedTask, replay.stages, replay.tasks, starts, ends),
                   key=lambda t: t.stage)  # stable: a stage's tasks in its order
    return _result(tasks, _transfers(tasks, num_stages, delay) if transfers else [], schedule,
                   device_groups or num_stages)


def replay_order(schedule: List[List[Task]], device_groups: Optional[int] = None) -> Replay:
    """``schedule``'s ``Replay`` (``device_groups`` as ``simulate``'s).

    Raises:
      ValueError: a deadlocked schedule (a task whose input never comes)."""
    lanes = _lanes(schedule, device_groups)
    num_stages = len(schedule)
    index: Dict[_Key, int] = {}
    order: List[Tuple[int, Task, int, int, int]] = []
    done = [0] * len(lanes)
    lane_of = [s % device_groups if device_groups else s for s in range(num_stages)]
    waiting = collections.deque(range(len(lanes)))  # lanes that may place a task
    while waiting:
        lane = waiting.popleft()
        for stage in _place_ready_tasks(lanes[lane], done, lane, num_stages, index, order):
            for near in (stage - 1, stage + 1):  # whose tasks may wait on it
                if 0 <= near < num_stages and lane_of[near] not in waiting:
                    waiting.append(lane_of[near])
    if any(done[lane] < len(tasks) for lane, tasks in enumerate(lanes)):
        raise ValueError(_deadlock_message(lanes, num_stages, done, index))
    return Replay(*zip(*order)) if order else Replay((), (), (), (), ())


def replay_times(replay: Replay, durations: Dict[str, Sequence[float]],
                 delay: float) -> Tuple[List[float], List[float]]:
    """When each task of ``replay`` starts and ends: it starts once its
    lane's previous task and its inputs have ended (those from another
    stage ``delay`` later), and lasts ``durations[kind][stage]``."""
    starts: List[float] = []
    ends: List[float] = []
    for stage, task, previous, local, remote in zip(replay.stages, replay.tasks,
                                                    replay.previous, replay.local, replay.remote):
        ready = ends[previous] if previous >= 0 else 0.0
        if local >= 0 and ends[local] > ready:
            ready = ends[local]
        if remote >= 0 and ends[remote] + delay > ready:
            ready = ends[remote] + delay
        starts.append(ready)
        ends.append(ready + durations[task.kind][stage])
    return starts, ends


def _lanes(schedule: List[List[Task]], device_groups: Optional[int]):
    """(stage, task) in the order each device group runs them."""
    if device_groups is None:
        return [[(s, task) for task in tasks] for s, tasks in enumerate(schedule)]
    if len(schedule) % device_groups:
        raise ValueError(f"{len(schedule)} stages do not deal evenly to {device_groups} "
                         "device groups")
    return [sorted(((s, task) for s in range(g, len(schedule), device_groups)
                    for task in schedule[s]), key=lambda pair: pair[1].slot)
            for g in range(device_groups)]


def measured(tasks: Sequence[TimedTask], num_stages: int) -> SimulationResult:
    """The same summary for tasks timed in a real run: times are shifted to
    start at 0, each stage's order is its tasks' start order; transfers are not
    measured (empty)."""
    origin = min(t.start for t in tasks)
    shifted = sorted((dataclasses.replace(t, start=t.start - origin, end=t.end - origin)
                      for t in tasks), key=lambda t: (t.stage, t.start))
    order = [[t.task for t in shifted if t.stage == s] for s in range(num_stages)]
    return _result(shifted, [], order)


def _result(tasks: List[TimedTask], transfers: List[Transfer],
            order: Sequence[Sequence[Task]], lanes: Optional[int] = None) -> SimulationResult:
    length = max(t.end for t in tasks)
    busy = sum(t.end - t.start for t in tasks)
    bubble = 1.0 - busy / ((lanes or len(order)) * length) if length > 0 else 0.0
    return SimulationResult(tasks=tasks, transfers=transfers, length=length,
                            bubble_fraction=bubble,
                            peak_in_flight=[_peak_in_flight(stage) for stage in order])


def _per_stage(name: str, value: Times, num_stages: int) -> List[float]:
    if isinstance(value, numbers.Real):
        return [_non_negative(name, value)] * num_stages
    values = list(value)
    if len(values) != num_stages:
        raise ValueError(f"{name} has {len(values)} entries for {num_stages} stages")
    return [_non_negative(f"{name}[{s}]", v) for s, v in enumerate(values)]


def _non_negative(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or value < 0:
        raise ValueError(f"{name} must be a number >= 0, got {value!r}")
    return float(value)


def task_dependencies(stage: int, task: Task, num_stages: int) -> List[Tuple[_Key, bool]]:
    """``(key, crosses_stages)`` of each task that must end before ``task`` starts."""
    m = task.micro_batch
    if task.kind == "F":
        return [((stage - 1, "F", m), True)] if stage > 0 else []
    if task.kind == "W":
        return [((stage, "B", m), False)]
    deps = [((stage, "F", m), False)]
    if stage < num_stages - 1:
        deps.append(((stage + 1, "B", m), True))
    return deps


def _place_ready_tasks(lane_tasks, done, lane, num_stages, index, order) -> List[int]:
    """Put a lane's next tasks in ``order`` while their inputs are in it;
    the stages of those put."""
    stages = []
    while done[lane] < len(lane_tasks):
        stage, task = lane_tasks[done[lane]]
        inputs = {False: -1, True: -1}  # crosses stages -> index
        for key, cross in task_dependencies(stage, task, num_stages):
            if key not in index:
                return stages
            inputs[cross] = index[key]
        previous = index[_key(*lane_tasks[done[lane] - 1])] if done[lane] else -1
        index[_key(stage, task)] = len(order)
        order.append((stage, task, previous, inputs[False], inputs[True]))
        done[lane] += 1
        stages.append(stage)
    return stages


def _key(stage: int, task: Task) -> _Key:
    return (stage, task.kind, task.micro_batch)


def _deadlock_message(lanes, num_stages, done, index) -> str:
    stuck = []
    for lane, lane_tasks in enumerate(lanes):
        if done[lane] == len(lane_tasks):
            continue
        stage, task = lane_tasks[done[lane]]
        missing = [f"{kind}{m} on stage {s}"
                   for (s, kind, m), _ in task_dependencies(stage, task, num_stages)
                   if (s, kind, m) not in index]
        stuck.append(f"stage {stage} at {task} (waits for {', '.join(missing)})")
    return "infeasible pipeline schedule (deadlock): " + "; ".join(stuck)


def _transfers(tasks: List[TimedTask], num_stages: int, delay: float) -> List[Transfer]:
    transfers = []
    for t in tasks:
        if t.task.kind == "W":
            continue
        dst = t.stage + 1 if t.task.kind == "F" else t.stage - 1
        if 0 <= dst < num_stages:
            transfers.append(Transfer(t.stage, dst, t.task.micro_batch, t.task.kind,
                                      t.end, t.end + delay))
    return sorted(transfers, key=lambda x: (x.start, x.src_stage, x.dst_stage))


def _peak_in_flight(stage_tasks: Sequence[Task]) -> int:
    """Tasks of a stage end in list order, so the count changes in that order."""
    last = "W" if any(task.kind == "W" for task in stage_tasks) else "B"
    count = peak = 0
    for task in stage_tasks:
        count += (task.kind == "F") - (task.kind == last)
        peak = max(peak, count)
    return peak
