"""What one data-parallel replica copies (``Selection``), chosen from the
read-only analyses of ``tfpar.analysis``: the step's forward and backward
ops, the update ops, the mirrored variables and the batch inputs. Nothing
here mutates.
"""
import dataclasses
import functools
from typing import Dict, List, NamedTuple, Set, Tuple

from tfpar.analysis.graph_index import GraphIndex, ancestors
from tfpar.analysis.rounds import Rounds, step_rounds
from tfpar.analysis.op_kinds import (AUX_TYPES, INPUT_TYPES, READ_ONLY_RESOURCE_TYPES,
                                     REF_READ_TYPES, SPARSE_READER_TYPES, TABLE_TYPES,
                                     VARIABLE_TYPES, gradient_tensors, is_input, is_variable)
from tfpar.analysis.variables import (Averaged, all_variables, averaged_variables,
                                      declared_aggregations, variable_writers, writers_of,
                                      written_variables)
from tfpar.compat.tf import ops
from tfpar.ir.recorded import Recorded
from tfpar.ir.taskgraph import Phase

__all__ = ["Selection", "select_replication"]

# Never copied: variables, inputs, summaries / checkpoint I/O, tables.
FROZEN_TYPES = VARIABLE_TYPES | INPUT_TYPES | AUX_TYPES | TABLE_TYPES


@dataclasses.dataclass
class Selection:
    """What data parallelism copies.

    Attributes:
      step_ops: forward + backward ops copied per replica and micro-batch,
        in graph order.
      update_ops: ops between the raw gradients and the variable updates
        (clipping, optimizer), copied once per replica.
      variables: variable ops mirrored per replica.
      batch_inputs: tensors from feeds / iterators entering ``step_ops``;
        split along dimension 0, except the components of ``sparse_inputs``.
      raw_grads: (gradient, variable op) pairs reduced across units.
      sync_writers: ops outside the training step that write a mirrored
        variable (initializers, restores, user assigns).
      batch_dependent: ops downstream of the batch inputs.
      backward: the step ops ``tf.gradients`` made.
      sparse_inputs: (indices, values, dense shape) of every SparseTensor
        batch input, split by rows (of its dense shape's dimension 0).
      averaged: variable ops the step writes from their own values (moving
        averages: BatchNorm's statistics), each with why it is one and the
        step ops writing it (``averaged_variables``): every version of the
        step updates a local copy, averaged into the variable once per step
        (``rewriters.averaged_variables``). Mirrored like trained ones.
      rounds: the round of every step and update op (``analysis.rounds``: a
        step that updates variables, then reads them, as a GAN's does, runs
        in rounds; 0 for every op of a step of one round).
    """

    step_ops: List[ops.Operation]
    update_ops: List[ops.Operation]
    variables: List[ops.Operation]
    batch_inputs: list
    raw_grads: list
    sync_writers: List[ops.Operation]
    batch_dependent: Set[ops.Operation]
    backward: Set[ops.Operation] = dataclasses.field(default_factory=set)
    sparse_inputs: List[tuple] = dataclasses.field(default_factory=list)
    averaged: Dict[ops.Operation, Averaged] = dataclasses.field(default_factory=dict)
    rounds: Rounds = dataclasses.field(default_factory=Rounds)

    @functools.cached_property
    def step_ops_set(self) -> Set[ops.Operation]:
        """``step_ops`` as a set (read-only)."""
        return set(self.step_ops)


def is_frozen(op: ops.Operation) -> bool:
    """An op no replica copies (``FROZEN_TYPES``)."""
    return op.type in FROZEN_TYPES


class BatchSources(NamedTuple):
    """Where the batch enters the ops the losses need.

    Attributes:
      inputs: feeds / iterator reads (and the SparseTensor readers of them).
      sparse_readers: ops making a SparseTensor's components of an iterator's.
      dependent: every op downstream of ``inputs`` (data and control edges).
    """

    inputs: Set[ops.Operation]
    sparse_readers: Set[ops.Operation]
    dependent: Set[ops.Operation]


def select_replication(graph: ops.Graph, recorded: Recorded, index: GraphIndex,
                       global_step_ops: Set[ops.Operation],
                       unmirrored: Set[ops.Operation]) -> Selection:
    """Choose the ops, variables and inputs one data-parallel replica copies.

    Args:
      global_step_ops: variable ops updated once per step (the global step).
      unmirrored: variable ops shared by every replica (metric accumulators).
    """
    roots, raw_grads = training_roots(recorded, global_step_ops)
    needed = ancestors(roots, is_frozen)
    sources = batch_sources(needed, index)
    raw_grad_ops = {t.op for g, _ in raw_grads for t in gradient_tensors(g)}
    step = step_ops(recorded, index, needed, sources, raw_grad_ops)
    trained = {var for _, var in raw_grads}
    averaged = averaged_variables(step, global_step_ops | trained,
                                  declared_aggregations(graph, recorded))
    accumulators = {v for op in step for v in written_variables(op)} - global_step_ops - set(
        averaged)
    step -= late_accumulator_ops(index, step, needed, accumulators)
    averaged = once_written_left_out(averaged, step)
    update = update_ops(graph, recorded, index, step | raw_grad_ops, global_step_ops)
    copied = step | update
    used_vars = {t.op for op in copied for t in op.inputs if is_variable(t.op)}
    variables = [op for op in index.ops if op in used_vars and op not in global_step_ops
                 and op not in unmirrored and op not in accumulators]
    sync_writers = {w for v in variables for w in variable_writers(v) if w not in copied}
    batch_inputs = step_batch_inputs(index, step, copied, sources)
    fed = set(batch_inputs)
    order = {op: i for i, op in enumerate(index.ops)}
    sparse_inputs = [tuple(op.outputs) for op in sorted(sources.sparse_readers, key=order.get)]
    sparse_inputs += [group for group in recorded.sparse_feeds
                      if any(t in fed for t in group)]
    return Selection(
        step_ops=sorted(step, key=order.get), update_ops=sorted(update, key=order.get),
        variables=variables, batch_inputs=batch_inputs, raw_grads=raw_grads,
        sync_writers=sorted(sync_writers, key=order.get), batch_dependent=sources.dependent,
        backward={op for op in step if recorded.op_phase.get(op.name) == Phase.BACKWARD},
        sparse_inputs=sparse_inputs, averaged=averaged,
        rounds=step_rounds(index.ops, step, update))


def training_roots(recorded: Recorded, global_step_ops: Set[ops.Operation]
                   ) -> Tuple[List[ops.Operation], list]:
    """(the ops the losses and gradients of every ``tf.gradients`` call end
    in, the (gradient, variable op) pairs reduced across replicas: every
    variable's gradient but the global step's)."""
    roots: List[ops.Operation] = []
    raw_grads = []
    for call in recorded.gradient_calls:
        roots.extend(y.op for y in call.ys if hasattr(y, "op"))
        for x, g in zip(call.xs, call.grads):
            if g is None:
                continue
            roots.extend(t.op for t in gradient_tensors(g))
            var_op = getattr(x, "op", None)
            if var_op is not None and is_variable(var_op) and var_op not in global_step_ops:
                raw_grads.append((g, var_op))
    return roots, raw_grads


def batch_sources(needed: Set[ops.Operation], index: GraphIndex) -> BatchSources:
    """The feeds / iterators the ``needed`` ops read (not, say, a Saver's
    filename placeholder) and what descends from them: what depends on the
    batch. Control edges count: tf.gradients' tuple() NoOps wait on a
    replica's gradients."""
    inputs = {t.op for op in needed for t in op.inputs if is_input(t.op)}
    sparse_readers = {op for op in needed if op.type in SPARSE_READER_TYPES
                      and op.inputs[0].op in inputs}
    inputs |= sparse_readers
    return BatchSources(inputs, sparse_readers, index.descendants(inputs, control=True))


def step_ops(recorded: Recorded, index: GraphIndex, needed: Set[ops.Operation],
             sources: BatchSources, raw_grad_ops: Set[ops.Operation]) -> Set[ops.Operation]:
    """The forward + backward ops a replica copies: what the losses and
    gradients need, and the side outputs of the batch (accuracy,
    predictions); but what consumes the raw gradients (clipping acts on the
    reduced ones), apply-phase ops and frozen ones."""
    phase = recorded.op_phase
    side = sources.dependent - index.descendants(raw_grad_ops, control=True)
    return {op for op in needed | side if phase.get(op.name, Phase.FORWARD) != Phase.APPLY
            and not is_frozen(op) and op not in sources.sparse_readers}


def once_written_left_out(averaged: Dict[ops.Operation, Averaged], step: Set[ops.Operation]
                          ) -> Dict[ops.Operation, Averaged]:
    """``averaged`` without the variables whose writers all run once per
    step, after every replica (``late_accumulator_ops``: Keras'
    ``_train_counter``, declared ONLY_FIRST_REPLICA, incremented after the
    metrics): no version writes a copy of them, so there is nothing to average,
    and averaging the unwritten copies would overwrite the one write."""
    kept = {}
    for var, found in averaged.items():
        writers = tuple(w for w in found.writers if w in step)
        if writers:
            kept[var] = Averaged(found.why, writers)
    return kept


def late_accumulator_ops(index: GraphIndex, step: Set[ops.Operation],
                         needed: Set[ops.Operation], accumulators: Set[ops.Operation]
                         ) -> Set[ops.Operation]:
    """Step ops that run once, after every replica, not per replica: what
    the losses do not need of the accumulators (streaming metrics: keras'
    total / count, variables the step writes by adding what does not depend
    on them), their reads (the metric's value) and their writes (a tracker's
    ``update_state``: it adds what one device adds, the merged value of what
    it read, recomputed on the whole batch's rows), and what depends on them.
    A write that something the losses need waits for stays per replica."""
    late = {op for op in step - needed
            if (op.type in READ_ONLY_RESOURCE_TYPES | REF_READ_TYPES
                and any(t.op in accumulators for t in op.inputs))
            or any(v in accumulators for v in written_variables(op))}
    late = {op for op in late if not index.descendants([op], control=True) & needed}
    return late | index.descendants(late, control=True)


def update_ops(graph: ops.Graph, recorded: Recorded, index: GraphIndex,
               cut: Set[ops.Operation], global_step_ops: Set[ops.Operation]
               ) -> Set[ops.Operation]:
    """The ops updating the variables once per replica: the apply-phase ops
    writing a variable (not an initializer, not only the global step) and
    their ancestors, cut at frozen ops and ``cut`` (step ops, raw gradients)."""
    initializers = {v.initializer for v in all_variables(graph)}
    writers = []
    for op in index.ops:
        if recorded.op_phase.get(op.name) != Phase.APPLY or op in initializers:
            continue
        written = [t.op for t in op.inputs if is_variable(t.op)]
        if any(v not in global_step_ops for v in written) and op in writers_of(written):
            writers.append(op)
    return ancestors(writers, lambda op: is_frozen(op) or op in cut)


def step_batch_inputs(index: GraphIndex, step: Set[ops.Operation], copied: Set[ops.Operation],
                      sources: BatchSources) -> list:
    """The tensors from outside ``step`` that carry the batch into it (not
    scalars), in graph order of their readers."""
    batch_inputs: Dict = {}
    outside_batch = sources.dependent | sources.inputs
    for op in index.ops:
        if op not in step:
            continue
        for t in op.inputs:
            if (t.op not in copied and t.op in outside_batch and t not in batch_inputs
                    and t.shape.rank != 0):
                batch_inputs[t] = None
    return list(batch_inputs)
