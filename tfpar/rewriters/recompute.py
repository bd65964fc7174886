"""Activation recomputation (``memory.recompute``): the backward recomputes a
name scope's forward from the scope's inputs instead of keeping its
activations alive from the forward (Chen et al. 2016, "Training deep nets
with sublinear memory cost"; Whale §2, Example 5: recomputation).

The forward ops of the scope whose outputs only the scope and the backward
read are copied, with the scope's forward ops they depend on (the scope's
outputs stay alive for the forward beyond it); the backward reads the copies;
the copies wait (control inputs) for the gradients that enter the scope from
outside it, so they run when the backward reaches the scope and the
originals' outputs are freed once the forward has used them. The copies
compute the same numbers: stateful ops (random draws) are refused.
"""
import logging
import re
from typing import Dict, List, Sequence, Set

from tensorflow.python.framework import ops

from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.ir.taskgraph import Phase
from tfpar.rewriters import graph_edit

__all__ = ["recompute_scopes"]

log = logging.getLogger("tfpar")

# Stateful ops whose copies return what the originals did within a step.
_REPEATABLE = frozenset({"ReadVariableOp"})


def recompute_scopes(graph: ops.Graph, capture: GraphCapture,
                     scopes: Sequence[str]) -> Dict[str, int]:
    """Recompute each of ``scopes`` in the backward; returns scope -> ops copied."""
    copied = {}
    for scope in scopes:
        copied[scope] = _recompute(graph, capture, scope.rstrip("/"))
    return copied


def _recompute(graph: ops.Graph, capture: GraphCapture, scope: str) -> int:
    forward = [op for op in graph.get_operations()
               if op.name.startswith(scope + "/") and op.name not in capture.op_phase
               and op.inputs and op.outputs]
    if not forward:
        raise PlanError(f"tfpar: memory.recompute names '{scope}', but no forward op with "
                        "inputs is in that name scope; give the scope layers are built in "
                        "(e.g. 'dense_1' or 'encoder/layer_3')")
    members = set(forward)
    # The scope's outputs feed the forward beyond it and stay alive (Chen et
    # al.'s checkpoints, the next scope's inputs); what only it and the
    # backward read is rebuilt.
    inside = {t for op in forward for t in op.outputs
              if all(user in members or user.name in capture.op_phase for user in t.consumers())}
    consumers = [op for op in graph.get_operations()
                 if capture.op_phase.get(op.name) == Phase.BACKWARD
                 and any(t in inside for t in op.inputs)]
    needed = _closure({t.op for c in consumers for t in c.inputs if t in inside}, members)
    for op in needed:
        if op.op_def.is_stateful and op.type not in _REPEATABLE:
            raise PlanError(f"tfpar: memory.recompute cannot recompute '{op.name}' ({op.type}) "
                            f"in scope '{scope}': it is stateful, so a second run would not "
                            "give the same values (a random op draws again); leave the scope "
                            "out or move the op out of it")
    order = [op for op in forward if op in needed]  # creation order is topological
    copies = graph_edit.clone_ops(graph, order, f"{scope}_recompute", None, {})
    for op in consumers:
        for k, t in enumerate(op.inputs):
            if t in inside:
                graph_edit.update_input(op, k, copies[t.op].outputs[t.value_index])
    backward = {op for op in graph.get_operations()
                if capture.op_phase.get(op.name) == Phase.BACKWARD}
    own = re.compile(r"(gradients(_\d+)?|gradient_tape)/" + re.escape(scope) + "/")
    triggers = _entering_gradients(consumers, set(copies.values()), backward,
                                   {op for op in backward if own.match(op.name)})
    if not triggers:
        log.warning("tfpar: memory.recompute found no gradient entering scope '%s'; its "
                    "forward is recomputed as soon as its inputs are ready", scope)
    for original, copy in copies.items():
        capture.op_phase[copy.name] = Phase.BACKWARD
        if not any(t.op in copies for t in original.inputs):
            for trigger in triggers:
                graph_edit.add_control_input(copy, trigger)
    return len(copies)


def _closure(seeds: Set[ops.Operation], members: Set[ops.Operation]) -> Set[ops.Operation]:
    """``seeds`` and the ``members`` they depend on through members."""
    found, stack = set(), list(seeds)
    while stack:
        op = stack.pop()
        if op in found:
            continue
        found.add(op)
        stack.extend(t.op for t in op.inputs if t.op in members)
    return found


def _entering_gradients(consumers: List[ops.Operation], copies: Set[ops.Operation],
                        backward: Set[ops.Operation],
                        own: Set[ops.Operation]) -> List[ops.Operation]:
    """The backward ops outside the scope's gradient ops (``own``: named after
    the scope by tf.gradients or a GradientTape) that feed them, and that
    neither the ``consumers`` nor the copies precede by data or control
    edges: the gradients entering the scope, which the copies may wait for
    without a cycle."""
    waiting: Dict[ops.Operation, List[ops.Operation]] = {}  # op -> ops with it as control input
    for op in backward:
        for dep in op.control_inputs:
            waiting.setdefault(dep, []).append(op)
    after, stack = set(), list(consumers) + list(copies)
    while stack:
        op = stack.pop()
        for user in [u for t in op.outputs for u in t.consumers()] + waiting.get(op, []):
            if user not in after:
                after.add(user)
                stack.append(user)
    return sorted({t.op for op in own for t in op.inputs
                   if t.op in backward and t.op not in own and t.op not in after
                   and t.op not in copies and t.op.inputs}, key=lambda op: op.name)
