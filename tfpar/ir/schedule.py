"""Per-stage task orders of a pipeline step (GPipe, 1F1B, kFkB, zero-bubble);
no TensorFlow.

A pipeline of ``p`` stages runs ``M`` micro-batches per step. Stage ``s`` runs,
for every micro-batch ``m``, a forward task ``F m`` and a backward task ``B m``,
one task at a time in the order of its task list. The zero-bubble schedule
splits each backward in two: ``B m`` computes the gradients of the stage's
inputs (what the stage before it waits for), ``W m`` those of its weights.
"""
import collections
import dataclasses
from typing import List, Sequence

__all__ = ["Task", "SCHEDULES", "build_schedule", "in_rounds", "interleaved_schedule",
           "round_kind", "task_round", "validate_schedule"]

SCHEDULES = ("gpipe", "1f1b", "kfkb", "zero_bubble")


@dataclasses.dataclass(frozen=True)
class Task:
    """One task of a micro-batch on a stage: forward ("F"), backward ("B"; with
    the zero-bubble schedule only its input gradients) or weight gradients
    ("W", zero-bubble only); ``slot``: its place among the tasks of every
    stage its device group runs (interleaved stages; -1: its stage's list
    order is the device's)."""
    kind: str
    micro_batch: int
    slot: int = dataclasses.field(default=-1, compare=False)

    def __str__(self):
        return f"{self.kind}{self.micro_batch}"


def round_kind(kind: str, step_round: int) -> str:
    """The kind of a task of round ``step_round`` of a step that updates
    variables, then reads them (``analysis.rounds``): ``kind`` in round 0,
    ``"F" + "r1"`` in round 1."""
    return f"{kind}r{step_round}" if step_round else kind


def task_round(kind: str) -> tuple:
    """(``"F"``, ``"B"`` or ``"W"``, round) of a task kind (``round_kind``)."""
    base, _, step_round = kind.partition("r")
    return base, int(step_round or 0)


def in_rounds(schedule: Sequence[Sequence[Task]], rounds: int) -> List[List[Task]]:
    """``schedule`` run once per round of the step, round after round: each
    round's tasks wait on the update of the round before, which waits on every
    backward task of that round."""
    if rounds == 1:
        return [list(stage) for stage in schedule]
    span = 1 + max((task.slot for stage in schedule for task in stage), default=-1)
    return [[Task(round_kind(task.kind, r), task.micro_batch,
                  task.slot + r * span if task.slot >= 0 else -1)
             for r in range(rounds) for task in stage] for stage in schedule]


def build_schedule(kind: str, num_stages: int, num_micro_batch: int,
                   group_size: int = 1) -> List[List[Task]]:
    """Ordered task list per stage (index = stage).

    Args:
      kind: "gpipe" (all forwards, then all backwards), "1f1b" (PipeDream-flush:
        ``min(p - s - 1, M)`` warm-up forwards, then one forward / one backward)
        "kfkb" (1F1B over groups of ``group_size`` consecutive micro-batches)
        or "zero_bubble" (ZB-H1, ``_zero_bubble``).
      num_stages: number of pipeline stages ``p``.
      num_micro_batch: micro-batches per step ``M``.
      group_size: micro-batches per group ``k`` (only for "kfkb").

    Raises:
      ValueError: unknown kind, or an argument that is not an int >= 1.
    """
    if kind not in SCHEDULES:
        raise ValueError(f"unknown schedule kind {kind!r}; valid kinds: {', '.join(SCHEDULES)}")
    _check_positive_int("num_stages", num_stages)
    _check_positive_int("num_micro_batch", num_micro_batch)
    if kind == "gpipe":
        return [_gpipe(num_micro_batch) for _ in range(num_stages)]
    if kind == "zero_bubble":
        return [_zero_bubble(_grouped_one_f_one_b(_groups(num_micro_batch, 1),
                                                  num_stages - stage - 1), num_stages)
                for stage in range(num_stages)]
    if kind == "kfkb":
        _check_positive_int("group_size", group_size)
    else:
        group_size = 1
    groups = _groups(num_micro_batch, group_size)
    return [_grouped_one_f_one_b(groups, num_stages - stage - 1) for stage in range(num_stages)]


def interleaved_schedule(num_groups: int, virtual_stages: int,
                         num_micro_batch: int) -> List[List[Task]]:
    """Interleaved 1F1B (Narayanan et al. SC'21 §2.2): ``num_groups`` device
    groups each run ``virtual_stages`` stages, group g stages g, g + G, ...
    (G = ``num_groups``). A group's micro-batch units go through its stages
    in rounds of G micro-batches: forward unit k is micro-batch
    ``k // (G V) * G + k % G`` on its stage ``k // G mod V``, backward unit k
    the same micro-batch on stage ``V - 1 - k // G mod V``; group g first runs
    ``2 (G - g - 1) + (V - 1) G`` forward units (all of them when the
    micro-batches are exactly G), then one forward and one backward unit
    alternately, then the backward units left. Returns the tasks per stage
    (stage v G + g), each with its ``slot`` in its group's order.

    Raises:
      ValueError: an argument is not an int >= 1, or the micro-batches are
        not a multiple of the groups (each round has G).
    """
    for name, value in (("num_groups", num_groups), ("virtual_stages", virtual_stages),
                        ("num_micro_batch", num_micro_batch)):
        _check_positive_int(name, value)
    if num_micro_batch % num_groups:
        raise ValueError(f"interleaved stages need micro-batches in rounds of the {num_groups} "
                         f"device groups: {num_micro_batch} is not a multiple of {num_groups}")
    units = num_micro_batch * virtual_stages
    schedule: List[List[Task]] = [[] for _ in range(num_groups * virtual_stages)]
    for g in range(num_groups):
        warmup = units if num_micro_batch == num_groups else min(
            units, 2 * (num_groups - g - 1) + (virtual_stages - 1) * num_groups)
        order = [("F", k) for k in range(warmup)]
        for k in range(units - warmup):
            order += [("F", warmup + k), ("B", k)]
        order += [("B", k) for k in range(units - warmup, units)]
        for slot, (kind, k) in enumerate(order):
            chunk = k // num_groups % virtual_stages
            stage = (chunk if kind == "F" else virtual_stages - 1 - chunk) * num_groups + g
            micro_batch = k // (num_groups * virtual_stages) * num_groups + k % num_groups
            schedule[stage].append(Task(kind, micro_batch, slot))
    return schedule


def validate_schedule(schedule: List[List[Task]], num_micro_batch: int) -> None:
    """Raise ValueError unless every stage runs each ``F m`` and ``B m`` once,
    ``F m`` first, and, if any stage runs weight-gradient tasks, each ``W m``
    once after ``B m``."""
    if not schedule:
        raise ValueError("schedule has no stages")
    kinds = "FBW" if any(t.kind == "W" for tasks in schedule for t in tasks) else "FB"
    expected = sorted((kind, m) for kind in kinds for m in range(num_micro_batch))
    for stage, tasks in enumerate(schedule):
        got = sorted((t.kind, t.micro_batch) for t in tasks)
        if got != expected:
            last = num_micro_batch - 1
            raise ValueError(f"stage {stage} must run "
                             + " and ".join(f"{k}0..{k}{last}" for k in kinds)
                             + f" exactly once each, got [{' '.join(map(str, tasks))}]")
        position = {(t.kind, t.micro_batch): i for i, t in enumerate(tasks)}
        for m in range(num_micro_batch):
            for before, after in zip(kinds, kinds[1:]):
                if position[(after, m)] < position[(before, m)]:
                    raise ValueError(f"stage {stage} runs {after}{m} before {before}{m}")


def _check_positive_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")


def _gpipe(num_micro_batch: int) -> List[Task]:
    return ([Task("F", m) for m in range(num_micro_batch)]
            + [Task("B", m) for m in range(num_micro_batch)])


def _groups(num_micro_batch: int, group_size: int) -> List[range]:
    """Consecutive micro-batch groups of ``group_size`` (the last may be smaller)."""
    return [range(first, min(first + group_size, num_micro_batch))
            for first in range(0, num_micro_batch, group_size)]


def _grouped_one_f_one_b(groups: Sequence[range], stages_after: int) -> List[Task]:
    """1F1B over groups: warm-up group forwards, then group forward / group backward."""
    warmup = min(stages_after, len(groups))
    order = [("F", g) for g in range(warmup)]
    for i in range(len(groups) - warmup):
        order += [("F", warmup + i), ("B", i)]
    order += [("B", g) for g in range(len(groups) - warmup, len(groups))]
    return [Task(kind, m) for kind, g in order for m in groups[g]]


def _zero_bubble(one_f_one_b: Sequence[Task], num_stages: int) -> List[Task]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, §2.1)
    from a stage's 1F1B order: its forwards and backwards (now input gradients
    only) keep 1F1B's order, so gradients reach the stage before sooner, and
    each weight-gradient task ``W m`` is put off as long as 1F1B's memory bound
    allows: it runs just before ``F m+p``, so no stage holds more than ``p``
    micro-batches whose backward is unfinished (the first stage's 1F1B peak).
    Once the forwards are done, a ``W`` follows each ``B`` (filling the waits
    of the cool-down), and the ``W``\ s left run last."""
    pending = collections.deque()
    forwards_left = sum(t.kind == "F" for t in one_f_one_b)
    order: List[Task] = []
    for task in one_f_one_b:
        if task.kind == "F":
            while pending and pending[0] + num_stages <= task.micro_batch:
                order.append(Task("W", pending.popleft()))
            forwards_left -= 1
            order.append(task)
            continue
        order.append(task)
        pending.append(task.micro_batch)
        if not forwards_left:
            order.append(Task("W", pending.popleft()))
    return order + [Task("W", m) for m in pending]
