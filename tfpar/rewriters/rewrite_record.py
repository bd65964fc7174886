"""What the data-parallel rewrite made (``DataParallelRewrite``): the
versions of every step op, the stage devices' copies of variables and update
ops, the bridges and reduced gradients; read by the rewrite's own passes, by
fetch translation and by tests."""
import dataclasses
from typing import Any, Dict, List, Optional, Set

from tfpar.analysis.stages import Placement
from tfpar.compat.tf import ops, tensor_lib
from tfpar.errors import PlanError
from tfpar.rewriters.bridge import Bridges
from tfpar.rewriters.layout import Layout
from tfpar.rewriters.merge import merge_step_tensor
from tfpar.rewriters.select import Selection
from tfpar.rewriters.zero import Sharding

__all__ = ["DataParallelRewrite"]


@dataclasses.dataclass
class DataParallelRewrite:
    """What ``replicate`` did; read by fetch translation and tests.

    Attributes:
      placement: stage devices; stage of every op.
      layout: the rows of every version of every stage.
      selection: the ops/variables/inputs that were copied.
      version_maps: ``version_maps[s][v]``: original op of stage s -> its
        version v (empty for v = 0, the originals): its copy, or the call of
        its task's function.
      version_values: ``version_values[s][v]``: tensor of stage s -> its
        value in version v, for versions made by function calls (their
        results); empty for copies.
      functions: versions are function calls (``task_functions``).
      outside_tasks: step ops that run outside the task functions, once per
        stage device (variable reads).
      device_maps: ``device_maps[s][j]``: original variable / update op of stage
        s -> its copy on stage device j (mirrored variables only; j = 0 empty).
      bridges: the batch pieces, version weights and cross-stage tensors.
      reduced: raw gradient tensor -> reduced gradient per stage device.
      sync_ops: writer op -> op that runs it and copies the result to replicas.
      mirrored: stage devices hold their own copies of the variables.
      merged: step tensor -> merged tensor, filled on demand.
      seed_weighted: step ops downstream of scaled gradient seeds: their
        versions' values are already multiplied by the version weight.
      summed_grads: raw gradients of batch-sum losses, whose versions weigh 1
        (when gradients, not seeds, are weighted).
      gradient_terms: raw gradient tensor that is one stage's term of a
        variable's gradient summed across stages -> that gradient's tensor
        (``tied_weights``).
      original_inputs: step op -> its inputs as the script built them (the
        rewrite reroutes the originals' to their rows and stages).
      original_controls: step op -> its control inputs as the script built them.
      batch_axes: which axis of each step tensor holds the batch rows
        (``analysis.batch_axes.BatchAxes``).
      weight_tasks: each stage's backward is two tasks, input gradients ("B")
        and weight gradients ("W"): the schedule runs W tasks (zero-bubble).
      stage_tasks: (stage, kind) -> the original ops of that task
        (``pipeline.stage_tasks``).
      task_ops: (stage device j, stage, "F"/"B"/"W", micro-batch) -> the ops of
        that pipeline task (``pipeline.task_ops``).
      schedule_edges: the control edges (op, op it waits for) that order the
        tasks as the schedule says (``pipeline.order_tasks``).
      processes: the Horovod job this process is part of
        (``horovod_backend.HorovodProcesses``), or None.
      zero: which device owns each variable's optimizer state
        (``zero.Sharding``, ``memory.zero``), or None.
      precision: the grappler option computing in 16 bits, which task
        function calls turn on (``runtime.precision``), or None.
      local_copies: (stage, version) -> averaged variable's handle -> the
        handle of the version's local copy (``averaged_variables``).
      edits: number of in-place edits of original ops.
    """

    placement: Placement
    layout: Layout
    selection: Selection
    version_maps: List[List[Dict[ops.Operation, ops.Operation]]]
    device_maps: List[List[Dict[ops.Operation, ops.Operation]]]
    version_values: List[List[Dict[tensor_lib.Tensor, tensor_lib.Tensor]]] = dataclasses.field(
        default_factory=list)
    functions: bool = False
    outside_tasks: Set[ops.Operation] = dataclasses.field(default_factory=set)
    bridges: Optional[Bridges] = None
    reduced: Dict[tensor_lib.Tensor, List[tensor_lib.Tensor]] = dataclasses.field(default_factory=dict)
    sync_ops: Dict[ops.Operation, ops.Operation] = dataclasses.field(default_factory=dict)
    mirrored: bool = True
    merged: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dataclasses.field(default_factory=dict)
    seed_weighted: Set[ops.Operation] = dataclasses.field(default_factory=set)
    summed_grads: Set[tensor_lib.Tensor] = dataclasses.field(default_factory=set)
    gradient_terms: Dict[tensor_lib.Tensor, tensor_lib.Tensor] = dataclasses.field(
        default_factory=dict)
    original_inputs: Dict[ops.Operation, List[tensor_lib.Tensor]] = dataclasses.field(
        default_factory=dict)
    original_controls: Dict[ops.Operation, List[ops.Operation]] = dataclasses.field(
        default_factory=dict)
    batch_axes: Any = None
    weight_tasks: bool = False
    stage_tasks: Dict[tuple, List[ops.Operation]] = dataclasses.field(default_factory=dict)
    task_ops: Dict[tuple, List[ops.Operation]] = dataclasses.field(default_factory=dict)
    schedule_edges: Set[tuple] = dataclasses.field(default_factory=set)
    processes: Any = None
    zero: Optional[Sharding] = None
    precision: Optional[str] = None
    local_copies: Dict[tuple, Dict[tensor_lib.Tensor, tensor_lib.Tensor]] = dataclasses.field(
        default_factory=dict)
    edits: int = 0
    _copies: Dict[tuple, Dict] = dataclasses.field(default_factory=dict)

    @property
    def num_micro_batch(self) -> int:
        return self.layout.num_micro_batch

    @property
    def trivial(self) -> bool:
        """One version of everything in one process: the graph runs as built."""
        return self.layout.num_pieces == 1 and self.processes is None

    @property
    def synced(self) -> bool:
        """Writes of variables outside training must be copied (to mirrored
        copies, or to other processes)."""
        return self.mirrored or self.processes is not None

    def versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every version of a step op, in batch order."""
        return [m.get(op, op) for m in self.version_maps[self.placement.stage(op)]]

    def replica_versions(self, op: ops.Operation) -> List[ops.Operation]:
        """Every stage device's copy of an update op or variable (just ``op``
        when the devices share variables, or for a ZeRO slot)."""
        if not self.mirrored or (self.zero is not None and op in self.zero.slots):
            return [op]
        maps = self.device_maps[self.placement.stage(op)]
        return [m.get(op, op) if j else op for j, m in enumerate(maps)]

    def built_inputs(self, op: ops.Operation) -> List[tensor_lib.Tensor]:
        """``op``'s inputs as the script built them (before the rewrite rerouted
        the originals to their rows and stages)."""
        return self.original_inputs.get(op, op.inputs)

    def built_controls(self, op: ops.Operation) -> List[ops.Operation]:
        """``op``'s control inputs as the script built them."""
        return self.original_controls.get(op, op.control_inputs)

    def version_tensor(self, t: tensor_lib.Tensor, version: int) -> tensor_lib.Tensor:
        """Step tensor ``t`` as version ``version`` computes it.

        Raises:
          PlanError: the version is a function call that does not return it
            (``task_calls.call_tasks`` says which tensors it returns).
        """
        if t.op not in self.selection.step_ops_set or not (version or self.functions):
            return t
        stage = self.placement.stage(t.op)
        if not self.functions:
            return self.version_maps[stage][version][t.op].outputs[t.value_index]
        value = self.version_values[stage][version].get(t)
        if value is None:
            raise PlanError(
                f"tfpar: '{t.name}' ({t.op.type}) is computed inside a task function of "
                f"TaskGraph '{self.placement.task_graph_names[stage]}' and is not one of its "
                "results (tensors other ops read when tfpar rewrote the graph, forward tensors "
                "holding batch rows, what tf.gradients returned), so its per-micro-batch values "
                "cannot be fetched; to fetch it, set pipeline.task_functions to false")
        return value

    def variable_copies(self, stage: int, device: int) -> Dict:
        """Original variable handle -> the copy stage device ``device`` of
        ``stage`` reads."""
        key = (stage, device)
        if key not in self._copies:
            self._copies[key] = _variable_copies(self, stage, device)
        return self._copies[key]

    def prefix(self, stage: int, device: int) -> str:
        """Name scope of what stage device ``device`` of ``stage`` runs."""
        return (f"replica_{device}" if self.placement.num_stages == 1
                else f"stage_{stage}/replica_{device}")

    def merged_tensor(self, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
        """``t`` (a step tensor) merged over versions (``merge``). Builds ops on
        first use."""
        if t not in self.merged:
            self.merged[t] = merge_step_tensor(self, t)
        return self.merged[t]


def _variable_copies(rw: DataParallelRewrite, stage: int, device: int) -> Dict:
    """Original variable handle -> the copy stage device ``device`` reads."""
    result = {}
    for var in rw.selection.variables:
        owner = rw.placement.stage(var)
        peer = rw.layout.peer(device, stage, owner)
        if peer and var in rw.device_maps[owner][peer]:  # not a ZeRO slot
            result[var.outputs[0]] = rw.device_maps[owner][peer][var].outputs[0]
    return result
