"""The rounds of a training step that updates variables, then reads them.

A GAN's step first updates the discriminator (its gradients, then
``d_optimizer.apply_gradients``), then runs the discriminator again inside
the generator's tape, reading the variables the first update wrote (keras-io's
DCGAN ``train_step``; in graph mode, a second loss built under
``tf.control_dependencies([d_train_op])``). The order the script wrote is part
of its meaning: every replica must compute the second loss after the first
update, which needs every replica's first gradients. So the step's ops fall in
rounds: round 0 is what runs before any update, round r + 1 what waits (by data
or control edges, directly or through ops outside the step) on an update of
round r; a stateless op only later rounds read runs in the first of them. A
step of one round is the usual step. Nothing here mutates.
"""
import dataclasses
from typing import Dict, FrozenSet, Iterable, List, Set

from tfpar.compat import tf as internals
from tfpar.compat.tf import ops

__all__ = ["Rounds", "step_rounds"]


@dataclasses.dataclass(frozen=True)
class Rounds:
    """The rounds of a step.

    Attributes:
      of: step or update op -> its round.
      gates: the step ops that wait on an update of the round before theirs
        (directly, or through ops outside the step): where a round starts.
      count: how many rounds the step runs in (1: the usual step).
    """

    of: Dict[ops.Operation, int] = dataclasses.field(default_factory=dict)
    gates: FrozenSet[ops.Operation] = frozenset()

    @property
    def count(self) -> int:
        return 1 + max(self.of.values(), default=0)


def step_rounds(graph_ops: Iterable[ops.Operation], step: Set[ops.Operation],
                update: Set[ops.Operation]) -> Rounds:
    """The rounds of the step's and update ops (``Rounds``).

    Args:
      graph_ops: every op of the graph in creation order (a topological one).
      step: the forward and backward ops copied per replica.
      update: the ops updating the variables (clipping, optimizer).

    Each op carries ``2 * round + pending``: ``pending`` when an update of that
    round precedes it with no step op between; a step op after a pending
    predecessor starts the next round; update ops and ops outside the step
    pass what they wait on along."""
    value: Dict[ops.Operation, int] = {}
    gates = set()
    for op in graph_ops:
        before = max((value.get(p, 0) for p in [t.op for t in op.inputs] + list(op.control_inputs)),
                     default=0)
        if op in step:
            value[op] = before + (before & 1)
            if before & 1:
                gates.add(op)
        elif op in update:
            value[op] = before | 1
        elif before:
            value[op] = before
    rounds = {op: value.get(op, 0) // 2 for op in step | update}
    if any(rounds.values()):
        _postpone(list(graph_ops), step, rounds)
    return Rounds(rounds, frozenset(gates))


def _postpone(graph_ops: List[ops.Operation], step: Set[ops.Operation],
              rounds: Dict[ops.Operation, int]) -> None:
    """A stateless step op that only later rounds' step or update ops read
    runs in the first of them (the seed ``tf.GradientTape`` makes of a constant for the second
    loss belongs to that loss's backward, not to the first round's)."""
    waiting: Dict[ops.Operation, List[ops.Operation]] = {}
    for op in graph_ops:
        for dep in op.control_inputs:
            waiting.setdefault(dep, []).append(op)
    for op in reversed(graph_ops):
        if op not in step or internals.is_stateful(op):
            continue
        readers = [c for t in op.outputs for c in t.consumers()] + waiting.get(op, [])
        readers = [c for c in readers if c in rounds]  # not the backward's dead ends
        if readers:
            rounds[op] = max(rounds[op], min(rounds[c] for c in readers))
