"""Where each op of the training step runs: its pipeline stage and device.

A stage is a TaskGraph (Whale §3.1.2: TaskGraphs in creation order form the
pipeline). Ops the user built under a scope carry its TaskGraph; the hooks give
backward ops the TaskGraph of the forward op they differentiate, and other
backward ops that of their first input. A sum ``tf.gradients`` made of a
tensor's gradient contributions (an ``AddN`` outside every gradient function)
joins the earliest stage among its inputs instead: from a later one (a skip
connection across stages), the two stages' backward tasks would wait on each
other. The rest is inferred here, in graph order:

* a recomputed copy of a forward op (``memory.recompute``) joins the stage of
  the op it copies;
* an op colocated with a staged op (optimizer slots) joins that stage;
* an op reading a staged variable (optimizer updates) joins the variable's;
* a ``Switch`` (fp16 loss scaling gates gradients) joins the stage of what
  it passes;
* a backward op joins the stage of the forward op it differentiates;
* anything else joins the latest stage among its inputs, so an unscoped loss
  after the last stage runs in the last stage;
* an op none of these place (a constant, a gradient seed built from
  constants, an input) joins the earliest stage among its consumers, else the
  latest among its inputs, else stage 0.

Then backward ops that a ``tf.GradientTape`` computed from forward values
only (a shape) join the earliest stage reading them; and optimizer state and
updates join their variable's stage, whatever scope built them (an optimizer
built inside the last stage's scope; a variable made outside every scope and
read by several stages): an apply-phase op joins the stage of the op it is
colocated with (a slot: its variable's), else of the first variable it reads
(an update); and so does a variable's gradient that sums contributions of
several stages (tied weights, ``tied_weights``).
"""
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.op_kinds import gradient_tensors, is_variable
from tfpar.analysis.variables import trainable_variables
from tfpar.compat.tf import device_lib, indexed_slices, ops
from tfpar.errors import PlanError
from tfpar.ir.recorded import Recorded
from tfpar.ir.taskgraph import Phase

__all__ = ["Placement", "assign_stages", "backward_dependent", "canonical_device",
           "host_device", "split_op_devices", "stage_sizes", "stage_terms"]


@dataclasses.dataclass
class Placement:
    """Devices of every stage and the stage of every original op.

    Attributes:
      stage_devices: ``stage_devices[s][j]``: device j of stage s, j = r * width
        + k for pipeline replica r and sub-replica k (``layout.Layout``).
      num_replicas: copies of the whole pipeline (R).
      stage_of: original op -> stage (ops not listed run in stage 0).
      task_graph_names: name of each stage's TaskGraph (for messages).
      split_groups: split stage -> its device group per stage device index j
        (``stage_devices[s][j]`` is the group's first device).
      op_devices: op of a split stage -> its device in group 0
        (``split_op_devices``).
    """

    stage_devices: List[List[str]]
    num_replicas: int
    stage_of: Dict[ops.Operation, int]
    task_graph_names: Sequence[str] = ()
    split_groups: Dict[int, List[Tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    op_devices: Dict[ops.Operation, str] = dataclasses.field(default_factory=dict)

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices)

    @property
    def widths(self) -> List[int]:
        """Sub-replicas of each stage per pipeline replica."""
        return [len(d) // self.num_replicas for d in self.stage_devices]

    def stage(self, op: ops.Operation) -> int:
        return self.stage_of.get(op, 0)

    def device(self, op: ops.Operation, index: int = 0) -> str:
        """Device of original op ``op`` in stage device slot ``index``: the
        stage's device, or for a split stage the op's shard device in group
        ``index``."""
        stage = self.stage(op)
        groups = self.split_groups.get(stage)
        if groups is None:
            return self.stage_devices[stage][index]
        base = self.op_devices.get(op, groups[0][0])
        return groups[index][groups[0].index(base)]


def split_op_devices(index: GraphIndex, stage_of: Dict[ops.Operation, int],
                     split_groups: Dict[int, List[Tuple[str, ...]]]) -> Dict[ops.Operation, str]:
    """The device (in group 0) of every op of a split stage: the one a pattern
    gave it, else that of the forward op it differentiates, a colocated op or
    its first placed input in the same group (gradients and optimizer updates
    of a shard stay on the shard's device), else the group's first device."""
    result: Dict[ops.Operation, str] = {}
    by_name = {op.name: op for op in index.ops}
    for op in index.ops:
        groups = split_groups.get(stage_of.get(op, 0))
        if groups is None:
            continue
        own = canonical_device(op.device) if op.device else None
        if own in groups[0]:
            result[op] = own
            continue
        candidates = [getattr(op, "_original_op", None)]
        candidates += [by_name.get(name) for name in _colocation(op)]
        candidates += [t.op for t in op.inputs]
        result[op] = next((result[c] for c in candidates
                           if c in result and result[c] in groups[0]), groups[0][0])
    return result


def canonical_device(device: str) -> str:
    """``device`` in TensorFlow's full form (``/job:.../device:CPU:0``)."""
    return device_lib.DeviceSpec.from_string(device).to_string()


def host_device(device: str) -> str:
    """The host CPU of ``device``'s worker, in full form."""
    spec = device_lib.DeviceSpec.from_string(device)
    return spec.replace(device_type="CPU", device_index=0).to_string()


def assign_stages(index: GraphIndex, recorded: Recorded, num_stages: int,
                  names: Sequence[str] = (), tags: Optional[Dict[str, int]] = None
                  ) -> Dict[ops.Operation, int]:
    """Stage of every op in ``index`` (see module docstring); ``tags`` (op name
    -> stage) replaces the scopes' TaskGraphs (an automatic partition).

    Raises:
      PlanError: a forward op reads a tensor from a later stage (the stages are
        not in pipeline order).
    """
    if num_stages == 1:
        return {}
    tagged = recorded.op_task_graph if tags is None else tags
    stage_of: Dict[ops.Operation, int] = {}
    by_name = {}
    unplaced = []
    for op in index.ops:
        by_name[op.name] = op
        stage = _gradient_sum_stage(op, recorded, stage_of)
        if stage is None:
            stage = tagged.get(op.name)
        if stage is None:  # a recomputed copy: its original's
            stage = stage_of.get(by_name.get(recorded.copied_from.get(op.name)))
        if stage is None:
            stage = _inferred_stage(op, stage_of, by_name)
        if stage is None:
            unplaced.append(op)
        else:
            stage_of[op] = stage
    resolved: Dict[ops.Operation, int] = {}
    for op in reversed(unplaced):  # consumers come later in graph order
        consumers = [stage_of.get(c, resolved.get(c)) for t in op.outputs for c in t.consumers()]
        consumers = [c for c in consumers if c is not None]
        if consumers:
            resolved[op] = min(consumers)
    for op in unplaced:  # the rest follow their inputs, as placed by now
        stage_of[op] = resolved.get(op, max(
            (stage_of[t.op] for t in op.inputs if t.op in stage_of), default=0))
    _forward_valued_to_readers(index, recorded, stage_of)
    _follow_variables(index, recorded, stage_of, by_name)
    _check_order(index, recorded, stage_of, names)
    return stage_of


def _follow_variables(index: GraphIndex, recorded: Recorded, stage_of, by_name) -> None:
    """Optimizer state, updates and tied gradient sums join their variable's
    stage (module docstring)."""
    for op in index.ops:
        if recorded.op_phase.get(op.name) != Phase.APPLY:
            continue
        owners = [by_name.get(name) for name in _colocation(op)]
        owners += [t.op for t in op.inputs if is_variable(t.op)]
        owner = next((x for x in owners if x in stage_of and x is not op), None)
        if owner is not None:
            stage_of[op] = stage_of[owner]
    for call in recorded.gradient_calls:
        for x, g in zip(call.xs, call.grads):
            var = getattr(x, "op", None)
            found = (stage_terms(g, stage_of.get)
                     if g is not None and var in stage_of and is_variable(var) else None)
            for op in found[1] if found else ():
                stage_of[op] = stage_of[var]


def stage_sizes(index: GraphIndex, stage_of: Dict[ops.Operation, int],
                num_stages: int) -> Dict[str, List[int]]:
    """Per stage: its ops (as placed: backward and updates with their forward
    stage) and trainable bytes."""
    num_ops = [0] * num_stages
    for op in index.ops:
        num_ops[stage_of.get(op, 0)] += 1
    param_bytes = [0] * num_stages
    for op, v in trainable_variables(index.graph):
        if v.shape.is_fully_defined():
            param_bytes[stage_of.get(op, 0)] += v.shape.num_elements() * v.dtype.size
    return {"num_ops": num_ops, "param_bytes": param_bytes}


def stage_terms(g, stage: Callable[[ops.Operation], int]
                ) -> Optional[Tuple[list, List[ops.Operation]]]:
    """(the terms, the ops summing them) of gradient ``g`` when it sums
    contributions of several stages (``stage``: op -> its stage), else None."""
    if isinstance(g, indexed_slices.IndexedSlices):
        values, indices = g.values.op, g.indices.op
        if not (values.type == indices.type == "ConcatV2"
                and len(values.inputs) == len(indices.inputs)):
            return None
        terms = [indexed_slices.IndexedSlices(v, i, g.dense_shape)
                 for v, i in zip(values.inputs[:-1], indices.inputs[:-1])]
        sums = [values, indices]
    elif g.op.type == "AddN":
        terms, sums = list(g.op.inputs), [g.op]
    else:
        return None
    if len({stage(gradient_tensors(term)[0].op) for term in terms}) < 2:
        return None
    return terms, sums


def _forward_valued_to_readers(index: GraphIndex, recorded: Recorded, stage_of) -> None:
    """Backward ops computed from forward values only (not from a seed),
    made outside any gradient function ``tf.gradients`` records (a
    ``tf.GradientTape``'s gradient functions take the shape of a forward
    input: the tape says not which op they differentiate, and their first
    input tags them with the stage before), join the earliest stage among
    their readers."""
    phase = recorded.op_phase
    seeds = {getattr(s, "op", None) for call in recorded.gradient_calls for s in call.seeds}
    forward_valued = set()
    for op in index.ops:
        if (phase.get(op.name) == Phase.BACKWARD and op.name not in recorded.differentiates
                and op not in seeds
                and all(phase.get(t.op.name) != Phase.BACKWARD or t.op in forward_valued
                        for t in op.inputs)):
            forward_valued.add(op)
    for op in reversed(index.ops):
        readers = [stage_of[c] for t in op.outputs for c in t.consumers()
                   if c in stage_of] if op in forward_valued else ()
        if readers:
            stage_of[op] = min(readers)


def _gradient_sum_stage(op: ops.Operation, recorded: Recorded, stage_of) -> Optional[int]:
    """The earliest stage among the inputs of a sum ``tf.gradients`` made of a
    tensor's gradient contributions (an ``AddN`` outside any gradient
    function), else None. Tagged by its first input, it could sit in a later
    stage than another input's, and the backward tasks of the two stages
    would wait on each other (a skip connection across stages)."""
    if (op.type != "AddN" or recorded.op_phase.get(op.name) != Phase.BACKWARD
            or op.name in recorded.differentiates):
        return None
    return min((stage_of[t.op] for t in op.inputs if t.op in stage_of), default=None)


def _inferred_stage(op: ops.Operation, stage_of, by_name) -> Optional[int]:
    for loc in _colocation(op):
        target = by_name.get(loc)
        if target is not None and target is not op and target in stage_of:
            return stage_of[target]
    inputs = [t.op for t in op.inputs]
    if op.type == "Switch" and inputs[0] in stage_of:  # a gradient gated by loss scaling
        return stage_of[inputs[0]]
    variables = [x for x in inputs if is_variable(x) and x in stage_of]
    if variables:
        return stage_of[variables[0]]
    differentiated = getattr(op, "_original_op", None)
    if differentiated is not None and differentiated in stage_of:
        return stage_of[differentiated]
    return max((stage_of[x] for x in inputs if x in stage_of), default=None)


def _colocation(op: ops.Operation) -> List[str]:
    try:
        return [c.decode()[len("loc:@"):] for c in op.get_attr("_class")]
    except ValueError:
        return []


def backward_dependent(step_ops: Sequence[ops.Operation], recorded: Recorded,
                       index: GraphIndex) -> set:
    """Step ops that run in a micro-batch's backward task: backward ops and every
    step op depending on one (a forward-phase op reading a gradient)."""
    step = set(step_ops)
    backward = {op for op in step_ops if recorded.op_phase.get(op.name) == Phase.BACKWARD}
    return backward | (index.descendants(backward) & step)


def _check_order(index: GraphIndex, recorded: Recorded, stage_of, names) -> None:
    for op in index.ops:
        if recorded.op_phase.get(op.name, Phase.FORWARD) != Phase.FORWARD:
            continue
        for t in op.inputs:
            src = t.op
            if (recorded.op_phase.get(src.name, Phase.FORWARD) == Phase.FORWARD
                    and stage_of[src] > stage_of[op] and not is_variable(src)):
                raise PlanError(
                    f"tfpar: op '{op.name}' in TaskGraph {_name(names, stage_of[op])} reads "
                    f"'{t.name}' from the later TaskGraph {_name(names, stage_of[src])}; "
                    "pipeline stages must be built in the order data flows through them")


def _name(names: Sequence[str], stage: int) -> str:
    return f"'{names[stage]}'" if stage < len(names) else str(stage)
