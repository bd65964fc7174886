"""Where each op of the training step runs: its pipeline stage and device.

A stage is a TaskGraph (Whale §3.1.2: TaskGraphs in creation order form the
pipeline). Ops the user built under a scope carry its TaskGraph; the hooks give
backward ops the TaskGraph of the forward op they differentiate. The rest is
inferred here, in graph order:

* an op colocated with a staged op (optimizer slots) joins that stage;
* an op reading a staged variable (optimizer updates) joins the variable's;
* a backward op joins the stage of the forward op it differentiates;
* anything else joins the latest stage among its inputs (stage 0 if none), so
  an unscoped loss after the last stage runs in the last stage.
"""
import dataclasses
from typing import Dict, List, Sequence

from tensorflow.python.framework import ops

from tfpar.errors import PlanError
from tfpar.hooks.capture import GraphCapture
from tfpar.ir.taskgraph import Phase
from tfpar.rewriters.select import VARIABLE_TYPES, GraphIndex

__all__ = ["Placement", "assign_stages", "backward_dependent"]


@dataclasses.dataclass
class Placement:
    """Devices of every (replica, stage) and the stage of every original op.

    Attributes:
      stage_devices: ``stage_devices[r][s]``: device of stage s in replica r.
      stage_of: original op -> stage (ops not listed run in stage 0).
      task_graph_names: name of each stage's TaskGraph (for messages).
    """

    stage_devices: List[List[str]]
    stage_of: Dict[ops.Operation, int]
    task_graph_names: Sequence[str] = ()

    @property
    def num_replicas(self) -> int:
        return len(self.stage_devices)

    @property
    def num_stages(self) -> int:
        return len(self.stage_devices[0])

    def stage(self, op: ops.Operation) -> int:
        return self.stage_of.get(op, 0)

    def device(self, op: ops.Operation, replica: int = 0) -> str:
        """Device of replica ``replica``'s copy of original op ``op``."""
        return self.stage_devices[replica][self.stage(op)]

    def stage_group(self, stage: int) -> List[str]:
        """The devices of ``stage`` in every replica (its all-reduce group)."""
        return [row[stage] for row in self.stage_devices]


def assign_stages(index: GraphIndex, capture: GraphCapture, num_stages: int,
                  names: Sequence[str] = ()) -> Dict[ops.Operation, int]:
    """Stage of every op in ``index`` (see module docstring).

    Raises:
      PlanError: a forward op reads a tensor from a later stage (the stages are
        not in pipeline order).
    """
    if num_stages == 1:
        return {}
    tagged = capture.op_task_graph
    stage_of: Dict[ops.Operation, int] = {}
    by_name = {}
    for op in index.ops:
        by_name[op.name] = op
        stage = tagged.get(op.name)
        if stage is None:
            stage = _inferred_stage(op, stage_of, by_name)
        stage_of[op] = stage
    _check_order(index, capture, stage_of, names)
    return stage_of


def _inferred_stage(op: ops.Operation, stage_of, by_name) -> int:
    for loc in _colocation(op):
        target = by_name.get(loc)
        if target is not None and target is not op and target in stage_of:
            return stage_of[target]
    inputs = [t.op for t in op.inputs]
    variables = [x for x in inputs if x.type in VARIABLE_TYPES and x in stage_of]
    if variables:
        return stage_of[variables[0]]
    differentiated = getattr(op, "_original_op", None)
    if differentiated is not None and differentiated in stage_of:
        return stage_of[differentiated]
    return max((stage_of[x] for x in inputs if x in stage_of), default=0)


def _colocation(op: ops.Operation) -> List[str]:
    try:
        return [c.decode()[len("loc:@"):] for c in op.get_attr("_class")]
    except ValueError:
        return []


def backward_dependent(step_ops: Sequence[ops.Operation], capture: GraphCapture,
                       index: GraphIndex) -> set:
    """Step ops that run in a micro-batch's backward task: backward ops and every
    step op depending on one (a forward-phase op reading a gradient)."""
    step = set(step_ops)
    backward = {op for op in step_ops if capture.op_phase.get(op.name) == Phase.BACKWARD}
    return backward | (index.descendants(backward) & step)


def _check_order(index: GraphIndex, capture: GraphCapture, stage_of, names) -> None:
    for op in index.ops:
        if capture.op_phase.get(op.name, Phase.FORWARD) != Phase.FORWARD:
            continue
        for t in op.inputs:
            src = t.op
            if (capture.op_phase.get(src.name, Phase.FORWARD) == Phase.FORWARD
                    and stage_of[src] > stage_of[op] and src.type not in VARIABLE_TYPES):
                raise PlanError(
                    f"tfpar: op '{op.name}' in TaskGraph {_name(names, stage_of[op])} reads "
                    f"'{t.name}' from the later TaskGraph {_name(names, stage_of[src])}; "
                    "pipeline stages must be built in the order data flows through them")


def _name(names: Sequence[str], stage: int) -> str:
    return f"'{names[stage]}'" if stage < len(names) else str(stage)
