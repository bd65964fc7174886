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

``recompute_ops`` does the same for a group of ops that is not a name scope
(an attention core, Korthikanti et al.'s selective recomputation), its
outputs included: the forward reads the originals, the backward copies.
"""
import re
from typing import AbstractSet, Dict, List, Sequence, Set

from tfpar import fallback
from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.ir.recorded import Recorded
from tfpar.ir.taskgraph import Phase
from tfpar.rewriters import graph_edit
from tfpar.analysis.graph_index import data_ancestors

__all__ = ["recompute_ops", "recompute_scopes"]


# Stateful ops whose copies return what the originals did within a step.
_REPEATABLE = frozenset({"ReadVariableOp"})
_METADATA = frozenset({"Shape", "ShapeN", "Size", "Rank"})  # ops that read no values
# The name scope tf.gradients (gradients, gradients_1, ...) or a GradientTape
# puts a forward op's gradient ops under, before the op's own name.
_GRADIENT_ROOT = re.compile(r"gradients(_\d+)?|gradient_tape")


def recompute_scopes(graph: ops.Graph, recorded: Recorded,
                     scopes: Sequence[str]) -> Dict[str, str]:
    """Recompute each of ``scopes`` in the backward (the graph is read once
    for all of them: a scope per layer stays linear in the graph's size).
    Returns the copies' op names -> the names of the forward ops they copy
    (backward ops, for the capture to record)."""
    scopes = [scope.rstrip("/") for scope in scopes]
    forward, own = _by_scope(graph, recorded, scopes)
    return _recompute_all(graph, recorded, {scope: (forward[scope], own[scope])
                                            for scope in scopes}, keep_outputs=True)


def recompute_ops(graph: ops.Graph, recorded: Recorded,
                  groups: Dict[str, List[ops.Operation]]) -> Dict[str, str]:
    """Recompute each named group of forward ops (an attention core:
    Korthikanti et al.'s selective recomputation) in the backward, its
    outputs too: the backward reads copies of everything it read of the
    group, so the originals live only as long as the forward reads them.
    Returns the copies as ``recompute_scopes`` does."""
    # tf.gradients builds op X's gradient ops in the name scope "X_grad".
    group_of = {f"{op.name}_grad": name for name, members in groups.items() for op in members}
    own: Dict[str, Set[ops.Operation]] = {name: set() for name in groups}
    for op in graph.get_operations():
        parts = op.name.split("/")
        if recorded.op_phase.get(op.name) == Phase.BACKWARD and _GRADIENT_ROOT.fullmatch(parts[0]):
            for scope in _prefixes(parts[1:], group_of.keys()):
                own[group_of[scope]].add(op)
    return _recompute_all(graph, recorded, {name: (members, own[name])
                                            for name, members in groups.items()},
                          keep_outputs=False)


def _recompute_all(graph: ops.Graph, recorded: Recorded, units,
                   keep_outputs: bool) -> Dict[str, str]:
    """``units``: name -> (forward ops in creation order, their gradient ops).
    Returns each copy's name -> its original's."""
    backward = {op for op in graph.get_operations()
                if recorded.op_phase.get(op.name) == Phase.BACKWARD}
    waiting: Dict[ops.Operation, List[ops.Operation]] = {}  # op -> ops with it as control input
    for op in backward:
        for dep in op.control_inputs:
            waiting.setdefault(dep, []).append(op)
    late = _after_the_seeds(recorded, backward)
    copied_from: Dict[str, str] = {}
    for name, (forward, own) in units.items():
        copied_from.update(_recompute(graph, recorded, name, forward, own, backward, waiting,
                                      keep_outputs, late))
    return copied_from


def _after_the_seeds(recorded: Recorded, backward: Set[ops.Operation]) -> Set[ops.Operation]:
    """The backward ops that depend by data on the seeds backprop starts from
    (so run once the forward has reached the loss); the others (shape
    arithmetic) run during the forward pass, and copies waiting for them
    would too."""
    late: Set[ops.Operation] = set()
    stack = [s.op for call in recorded.gradient_calls for s in call.seeds if hasattr(s, "op")]
    while stack:
        op = stack.pop()
        for user in (u for t in op.outputs for u in t.consumers()):
            if user in backward and user not in late:
                late.add(user)
                stack.append(user)
    return late


def _by_scope(graph: ops.Graph, recorded: Recorded, scopes: Sequence[str]):
    """Per scope: its forward ops with inputs and outputs, in creation
    (topological) order, and its gradient ops (named after it by tf.gradients
    or a GradientTape)."""
    wanted = set(scopes)
    forward: Dict[str, List[ops.Operation]] = {scope: [] for scope in scopes}
    own: Dict[str, Set[ops.Operation]] = {scope: set() for scope in scopes}
    for op in graph.get_operations():
        parts, phase = op.name.split("/"), recorded.op_phase.get(op.name)
        if phase is None and op.inputs and op.outputs:
            for scope in _prefixes(parts, wanted):
                forward[scope].append(op)
        elif phase == Phase.BACKWARD and _GRADIENT_ROOT.fullmatch(parts[0]):
            for scope in _prefixes(parts[1:], wanted):
                own[scope].add(op)
    return forward, own


def _prefixes(parts: List[str], wanted: AbstractSet[str]) -> List[str]:
    """The name scopes of ``wanted`` that a name of ``parts`` lies inside."""
    return [name for name in ("/".join(parts[:k]) for k in range(1, len(parts)))
            if name in wanted]


def _recompute(graph: ops.Graph, recorded: Recorded, scope: str,
               forward: List[ops.Operation], own: Set[ops.Operation],
               backward: Set[ops.Operation],
               waiting: Dict[ops.Operation, List[ops.Operation]], keep_outputs: bool,
               late: Set[ops.Operation]) -> Dict[str, str]:
    if not forward:
        raise PlanError(f"tfpar: memory.recompute names '{scope}', but no forward op with "
                        "inputs is in that name scope; give the scope layers are built in "
                        "(e.g. 'dense_1' or 'encoder/layer_3')")
    members = set(forward)
    # With ``keep_outputs``, the scope's outputs feed the forward beyond it and
    # stay alive (Chen et al.'s checkpoints, the next scope's inputs), and what
    # only it and the backward (copies made so far too) read is rebuilt; else
    # all the backward reads.
    inside = {t for op in forward for t in op.outputs
              if all(user in members or user.name in recorded.op_phase or user in backward
                     for user in t.consumers())
              or not keep_outputs and any(user in backward for user in t.consumers())}
    # A shape read is not a use: it runs as soon as the original exists, and
    # a copy read for its shape would hold back the gradient the copies wait for.
    consumers = {user for t in inside for user in t.consumers()
                 if user in backward and user.type not in _METADATA}
    # Data edges only: an op a member merely waits for need not run again.
    needed = data_ancestors({t.op for c in consumers for t in c.inputs if t in inside},
                            members.__contains__)
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
    triggers = _entering_gradients(consumers, set(copies.values()), late or backward, own,
                                   waiting)
    if not triggers:
        fallback.fall_back(
            f"memory.recompute asked to recompute scope '{scope}' in the backward", "no gradient "
            "enters it, so its forward is recomputed as soon as its inputs are ready (no memory "
            "saved)", "Recompute a scope the loss depends on, or drop it from memory.recompute",
            graph)
    for original, copy in copies.items():
        backward.add(copy)
        if not any(t.op in copies for t in original.inputs):
            for trigger in triggers:
                graph_edit.add_control_input(copy, trigger)
                waiting.setdefault(trigger, []).append(copy)
    return {copy.name: original.name for original, copy in copies.items()}


def _entering_gradients(consumers: Set[ops.Operation], copies: Set[ops.Operation],
                        backward: Set[ops.Operation], own: Set[ops.Operation],
                        waiting: Dict[ops.Operation, List[ops.Operation]]
                        ) -> List[ops.Operation]:
    """The ``backward`` ops (those after the seeds, when known) outside the
    scope's gradient ops (``own``) that feed them or the ``consumers``, and
    that neither the consumers nor the copies precede by data or control
    edges (``waiting``: op -> ops with it as control input): the gradients
    entering the scope, which the copies may wait for without a cycle (the
    gradient of an attention core's output, gated with the gradient that
    reads the core, is not one: the gradient entering that reader is)."""
    after, stack = set(), list(consumers) + list(copies)
    while stack:
        op = stack.pop()
        for user in [u for t in op.outputs for u in t.consumers()] + waiting.get(op, []):
            if user not in after:
                after.add(user)
                stack.append(user)
    return sorted({t.op for op in own | consumers for t in op.inputs
                   if t.op in backward and t.op not in own and t.op not in after
                   and t.op not in copies and t.op.inputs}, key=lambda op: op.name)
