"""Mirrored variables (the collective reducer, several devices per
stage): stage device j > 0 holds its own copy of its stage's variables and
runs its own copy of the update ops on the reduced gradients (device 0: the
originals)."""
import collections
import functools
from typing import Dict, List, Tuple

from tfpar.compat.tf import control_flow_ops, ops
from tfpar.rewriters import graph_edit
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["clone_variables", "copy_updates", "owner_inputs", "wait_for_earlier_rounds"]

Copies = Dict[ops.Operation, ops.Operation]  # original op -> its copy on one device


def clone_variables(graph: ops.Graph, rw: RewriteBuilder) -> List[List[Copies]]:
    """Mirrored: a copy of each stage's variables on its stage devices 1..;
    the device maps (``rw.device_maps``): ``[s][j]``, stage s's variables'
    copies on its device j (j = 0, the originals: empty)."""
    placement = rw.placement
    device_maps: List[List[Copies]] = []
    for stage, devices in enumerate(placement.stage_devices):
        variables = [v for v in rw.selection.variables if placement.stage(v) == stage
                     and len(rw.replica_versions(v)) > 1]  # not a ZeRO slot
        device_maps.append([{}] + [graph_edit.clone_ops(
            graph, variables, rw.prefix(stage, j) + "/variables",
            functools.partial(placement.device, index=j), {}) for j in range(1, len(devices))])
    return device_maps


def copy_updates(graph: ops.Graph, rw: RewriteBuilder) -> Dict[Tuple[int, int], Copies]:
    """Stage device j > 0 runs its own copy of the update ops of its stage on the
    reduced gradients and its copies of the variables (all but ZeRO's owned
    updates); returns (stage, j) -> those copies."""
    owned = rw.zero.owned_ops if rw.zero is not None else set()
    copies: Dict[Tuple[int, int], Copies] = {}
    for stage, devices in enumerate(rw.placement.stage_devices):
        update_ops = [op for op in rw.selection.update_ops
                      if rw.placement.stage(op) == stage and op not in owned]
        for j in range(1, len(devices)) if update_ops else ():
            copies[(stage, j)] = graph_edit.clone_ops(
                graph, update_ops, rw.prefix(stage, j) + "/update",
                functools.partial(rw.placement.device, index=j),
                _device_inputs(rw, stage, j))
    return copies


def _device_inputs(rw: RewriteBuilder, stage: int, j: int) -> Dict:
    """Tensor an update op of ``stage`` reads from outside the update ops ->
    the one stage device j's copy reads: its variables, its peers' reduced
    gradients and step tensors."""
    placement, layout = rw.placement, rw.layout
    step = rw.selection.step_ops_set
    imap = dict(rw.variable_copies(stage, j))
    # The originals read device 0's reduced gradients: copies read their peer's.
    for grad, red in rw.reduced.items():
        imap[red[0]] = red[layout.peer(j, stage, placement.stage(grad.op))]
    for op in rw.selection.update_ops:
        for t in op.inputs if placement.stage(op) == stage else ():
            if t.op in step and t not in imap:
                owner = placement.stage(t.op)
                v = layout.version(owner, layout.peer(j, stage, owner), 0)
                imap[t] = rw.version_tensor(t, v)
    return imap


def owner_inputs(rw: RewriteBuilder, stage: int, j: int):
    """Tensor an original update op of ``stage`` reads -> the one stage device
    j's copies read (``zero.shard_updates``)."""
    imap, copies = _device_inputs(rw, stage, j), rw.device_maps[stage][j]
    return lambda t: (copies[t.op].outputs[t.value_index] if t.op in copies
                      else imap.get(t, t))


def wait_for_earlier_rounds(rw: RewriteBuilder) -> None:
    """In a step of several rounds (``analysis.rounds``: it updates variables,
    then reads them), every version of an op where a round starts waits on
    every stage device's copy of the round before's updates, not only on the
    originals the script made it wait on: each device reads its own copy of
    the variables, which its own copy of the updates writes."""
    rounds = rw.selection.rounds
    updates = collections.defaultdict(list)
    for op in rw.selection.update_ops:
        updates[rounds.of.get(op, 0)] += rw.replica_versions(op)[1:]
    barriers = {}
    for gate in sorted(rounds.gates, key=lambda op: op.name):
        earlier = rounds.of[gate] - 1
        if earlier not in barriers:
            with ops.name_scope(None), ops.control_dependencies(updates[earlier]):
                barriers[earlier] = control_flow_ops.no_op(name=f"tfpar/round_{earlier}_updated")
        for version in dict.fromkeys(rw.versions(gate)):
            graph_edit.add_control_input(version, barriers[earlier])
