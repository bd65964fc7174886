"""ZeRO stages 1 and 2 over a stage's mirrored replicas (``memory.zero``;
Rajbhandari et al. 2020, §5.1 P_os and §5.2 P_g).

Stage 1 (optimizer states): each trainable variable has an owner among its
stage's devices, chosen greedily by slot bytes (largest first, to the device
holding least). Its slots (the optimizer state only its update reads) live on
the owner only, and only the owner runs its update: the update ops that read
a slot, every op downstream of them, and the ops that only feed them (the
variable's own gradient clipping, say), on the owner's reduced gradient and
copy of the variable. Then every other device copies the new value from the
owner. Those copies are the all-gather of ZeRO: each device sends (R - 1) / R
of the weights, as a ring all-gather does.

Stage 2 (gradients): a dense gradient is summed on its variable's owner (R - 1
copies of it, each device sending (R - 1) / R of the gradients, as a ring
reduce-scatter does) instead of all-reduced, so other devices never hold it
reduced. A sparse gradient (IndexedSlices) of a sharded variable is
concatenated on the owner at either stage: only its update reads it.

Shared optimizer state (Adam's beta powers, Keras' iteration count) stays
mirrored: every device updates its copy.
"""
import collections
import dataclasses
from typing import Dict, List, Set

from tfpar import fallback
from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.rewriters import graph_edit
from tfpar.rewriters.replica_sync import assign_value, read_value
from tfpar.analysis.graph_index import data_ancestors
from tfpar.analysis.op_kinds import is_variable
from tfpar.analysis.variables import variable_bytes, variable_writers
from tfpar.rewriters.select import Selection
from tfpar.analysis.stages import Placement

__all__ = ["Sharding", "plan_sharding", "refuse_unshardable", "shard_updates"]


@dataclasses.dataclass(frozen=True)
class Sharding:
    """Which device owns each trainable variable's optimizer state.

    Attributes:
      stage: 1 or 2.
      owner: trainable variable op -> index of its owner among its stage's
        devices.
      slots: slot variable op -> its trainable variable op.
      updates: trainable variable op -> the update ops only its owner runs.
      copies: trainable variable op -> the ops copying the owner's new value
        to the other devices (made by ``shard_updates``; empty before).
    """

    stage: int
    owner: Dict[ops.Operation, int]
    slots: Dict[ops.Operation, ops.Operation]
    updates: Dict[ops.Operation, List[ops.Operation]]
    copies: Dict[ops.Operation, List[ops.Operation]] = dataclasses.field(default_factory=dict)

    @property
    def owned_ops(self) -> Set[ops.Operation]:
        """Every update op an owner alone runs."""
        return {op for group in self.updates.values() for op in group}

    def gradient_owner(self, var: ops.Operation):
        """With stage 2, the device summing ``var``'s gradient; else None."""
        return self.owner.get(var) if self.stage == 2 else None


def refuse_unshardable(stage: int, mirrored: bool, horovod: bool, in_function: bool) -> None:
    """``memory.zero`` needs mirrored variables in one graph.

    Raises:
      PlanError: naming why this plan has nothing to shard or cannot.
    """
    if stage not in (1, 2):
        raise PlanError(f"tfpar: memory.zero is 0, 1 or 2, not {stage!r}")
    if horovod:
        raise PlanError("tfpar: memory.zero shards optimizer state among the devices of one "
                        "graph; a Horovod job runs a graph per process: use "
                        "communication.backend 'collective' (in-graph, across a cluster)")
    if in_function:
        raise PlanError("tfpar: memory.zero cannot place the optimizer state of a "
                        "tf.function step: its variables were made before tfpar rewrote the "
                        "step; build the model in a graph (TF1 style or Keras in graph mode)")
    if not mirrored:
        raise PlanError("tfpar: memory.zero shards the optimizer state of mirrored replicas, "
                        "but this plan's devices share one copy of each variable (replicas "
                        "on the CPUs of one process, or no replicas of any stage): set "
                        "communication.backend 'collective' to mirror them, or drop "
                        "memory.zero")


def plan_sharding(sel: Selection, placement: Placement, stage: int) -> Sharding:
    """Find every trainable variable's slots and update ops, and its owner
    (module docstring). A variable some op outside its own update writes
    (weight decay applied separately, say), or whose slots another update
    reads, keeps its state mirrored."""
    updates_set = set(sel.update_ops)
    trainable = list(dict.fromkeys(var for _, var in sel.raw_grads))
    trainable_set, variables = set(trainable), set(sel.variables)
    candidates = collections.defaultdict(set)
    feeding = {}
    for var in trainable:
        writers = [w for w in variable_writers(var) if w in updates_set]
        feeding[var] = data_ancestors(writers, updates_set.__contains__)
        for op in feeding[var]:
            for t in op.inputs:
                if is_variable(t.op) and t.op not in trainable_set:
                    candidates[t.op].add(var)
    step = sel.step_ops_set
    slots = {s: next(iter(owners)) for s, owners in candidates.items()
             if len(owners) == 1 and s in variables
             and not any(c in step for c in s.outputs[0].consumers())
             and any(w in updates_set for w in variable_writers(s))}
    by_var = collections.defaultdict(list)
    for s, var in slots.items():
        by_var[var].append(s)
    groups = {}
    for var, var_slots in by_var.items():
        group = _owned(var, var_slots, feeding[var], updates_set)
        if group is not None:
            groups[var] = group
    _say_mirrored([var for var in by_var if var not in groups], updates_set, set(slots), stage)
    owner = _owners(groups, by_var, placement)
    return Sharding(stage, owner, {s: v for s, v in slots.items() if v in owner}, groups)


def _say_mirrored(mirrored: List[ops.Operation], updates_set: Set[ops.Operation],
                  slots: Set[ops.Operation], stage: int) -> None:
    """Say (``fall_back``) that ``mirrored`` variables, which an update op
    reading none of their ``slots`` writes too, keep their optimizer state on
    every replica: ZeRO shards the others'."""
    if not mirrored:
        return
    names = [var.name for var in sorted(mirrored, key=lambda op: op.name)]
    writes = sorted({w.type for var in mirrored for w in variable_writers(var)
                     if w in updates_set and not any(t.op in slots for t in w.inputs)})
    fallback.fall_back(
        f"ZeRO-{stage} (memory.zero, or the plan's), to shard the optimizer state of every "
        "trainable variable over its replicas", f"{len(names)} variable(s) keep their optimizer "
        "state mirrored on every replica ("
        + ", ".join(f"'{name}'" for name in names[:6]) + (", ..." if len(names) > 6 else "")
        + "): an update op besides their optimizer's writes them (writers: "
        + ", ".join(writes) + "; a weight decay applied as an op of its own, say), and "
        "ZeRO's owner alone runs a variable's update", "Fold that write into the optimizer's "
        "update (its slots' readers), or make it outside apply_gradients; memory.zero 0 keeps "
        "every optimizer state mirrored", mirrored[0].graph)


def _owned(var, var_slots, feeding, updates_set):
    """The update ops ``var``'s owner alone runs: the readers of its slots and
    everything downstream of them among update ops, and the ops that only
    feed those; None if something else writes ``var``."""
    readers = {c for s in var_slots for c in s.outputs[0].consumers() if c in updates_set}
    group = set(readers)
    stack = list(readers)
    while stack:
        for t in stack.pop().outputs:
            for c in t.consumers():
                if c in updates_set and c not in group:
                    group.add(c)
                    stack.append(c)
    if not all(w in group for w in variable_writers(var) if w in updates_set):
        return None
    changed = True
    while changed:  # ops whose every update-op reader is owned are owned too
        changed = False
        for op in feeding - group:
            readers = [c for t in op.outputs for c in t.consumers() if c in updates_set]
            if readers and all(c in group for c in readers):
                group.add(op)
                changed = True
    return sorted(group, key=lambda op: op.name)


def _owners(groups, by_var, placement: Placement) -> Dict[ops.Operation, int]:
    """Greedy balance of slot bytes over each stage's devices."""
    load = collections.defaultdict(float)
    owner = {}
    sizes = {var: sum(variable_bytes(s.outputs[0]) for s in by_var[var]) for var in groups}
    for var in sorted(groups, key=lambda v: (-sizes[v], v.name)):
        stage = placement.stage(var)
        width = len(placement.stage_devices[stage])
        owner[var] = min(range(width), key=lambda j: (load[stage, j], j))
        load[stage, owner[var]] += sizes[var]
    return owner


def shard_updates(graph: ops.Graph, rw, input_map) -> Dict[ops.Operation, List[ops.Operation]]:
    """Run each sharded variable's update on its owner only (its original
    ops, moved there and reading the owner's inputs: ``input_map(stage, j)``
    maps a tensor the original update ops read to stage device j's), then
    copy the new value to the other devices. Ops waiting on the update wait
    on the copies too. Returns the copies (``Sharding.copies``)."""
    zero, placement = rw.zero, rw.placement
    owned = zero.owned_ops
    copied: Dict[ops.Operation, List[ops.Operation]] = {}
    remaps = {}  # (stage, owner) -> input_map(stage, owner), one per device
    waiting = [op for op in graph.get_operations() if op not in owned
               and any(dep in owned for dep in op.control_inputs)]
    for var, o in zero.owner.items():
        stage = placement.stage(var)
        device = placement.device(var, o)
        group = zero.updates[var]
        if o:
            if (stage, o) not in remaps:
                remaps[stage, o] = input_map(stage, o)
            remap = remaps[stage, o]
            for op in group:
                for k, t in enumerate(op.inputs):
                    new = remap(t)
                    if new is not t and t.op not in group:
                        graph_edit.update_input(op, k, new)
                _move(op, device)
        for slot in (s for s, v in zero.slots.items() if v is var):
            _move(slot, device)
            for c in slot.outputs[0].consumers():
                _move(c, device)
        copies = rw.replica_versions(var)
        with ops.name_scope("zero"):
            with ops.device(device), ops.control_dependencies(group):
                value = read_value(copies[o])
            copied[var] = []
            for j, copy in enumerate(copies):
                if j != o:
                    with ops.device(placement.device(var, j)):
                        copied[var].append(assign_value(copy, value))
        members = set(group)
        for op in waiting:
            if any(dep in members for dep in op.control_inputs):
                for copy in copied[var]:
                    graph_edit.add_control_input(op, copy)
    return copied


def _move(op: ops.Operation, device: str) -> None:
    """Place ``op`` on ``device``, dropping colocation with ops left behind."""
    graph_edit.set_device(op, device)
    graph_edit.clear_colocation(op)
