"""What the data-parallel rewrite made (``DataParallelRewrite``), and the
record while it makes it (``RewriteBuilder``).

``data_parallel.replicate``, the driver, starts a builder; every pass reads it
(its fields and the queries of ``RewriteQueries``: ``versions``,
``version_tensor``, ``built_inputs``, ...) and returns what it made, which the
driver alone assigns to it. The rewrite ends with ``RewriteBuilder.freeze``:
one frozen ``DataParallelRewrite``, which the runtime, the fetch translation
and the step trace read, and which nothing changes after the rewrite (a
fetch translator keeps what it builds later, merged fetches and the syncs of
writers built after the rewrite, in caches of its own)."""
import dataclasses
import types
from typing import (AbstractSet, Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple)

from tfpar.analysis.stages import Placement
from tfpar.compat.tf import ops, tensor_lib
from tfpar.errors import PlanError
from tfpar.rewriters.bridge import Bridges
from tfpar.rewriters.layout import Layout
from tfpar.rewriters.select import Selection
from tfpar.rewriters.zero import Sharding

__all__ = ["DataParallelRewrite", "RewriteBuilder", "RewriteQueries"]

Op, Tensor = ops.Operation, tensor_lib.Tensor


class RewriteQueries:
    """Questions about a rewrite's versions, answered from the fields of
    ``DataParallelRewrite`` (or of its builder, while it is made)."""

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

    def versions(self, op: Op) -> List[Op]:
        """Every version of a step op, in batch order."""
        return [m.get(op, op) for m in self.version_maps[self.placement.stage(op)]]

    def replica_versions(self, op: Op) -> List[Op]:
        """Every stage device's copy of an update op or variable (just ``op``
        when the devices share variables, or for a ZeRO slot)."""
        if not self.mirrored or (self.zero is not None and op in self.zero.slots):
            return [op]
        maps = self.device_maps[self.placement.stage(op)]
        return [m.get(op, op) if j else op for j, m in enumerate(maps)]

    def built_inputs(self, op: Op) -> Sequence[Tensor]:
        """``op``'s inputs as the script built them (before the rewrite rerouted
        the originals to their rows and stages)."""
        return self.original_inputs.get(op, op.inputs)

    def built_controls(self, op: Op) -> List[Op]:
        """``op``'s control inputs as the script built them."""
        return list(self.original_controls.get(op, op.control_inputs))

    def version_tensor(self, t: Tensor, version: int) -> Tensor:
        """Step tensor ``t`` as version ``version`` computes it.

        Raises:
          PlanError: the version is a function call that does not return it
            (``task_calls.call_versions`` says which tensors it returns).
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

    def prefix(self, stage: int, device: int) -> str:
        """Name scope of what stage device ``device`` of ``stage`` runs."""
        return (f"replica_{device}" if self.placement.num_stages == 1
                else f"stage_{stage}/replica_{device}")


@dataclasses.dataclass(frozen=True)
class DataParallelRewrite(RewriteQueries):
    """What ``replicate`` made; read by fetch translation, the step trace and
    tests. Read-only: its mappings are views, its lists tuples, its sets
    frozensets.

    Attributes:
      placement: stage devices; stage of every op.
      layout: the rows of every version of every stage.
      selection: the ops/variables/inputs that were copied.
      version_maps: ``version_maps[s][v]``: original op of stage s -> its
        version v (empty for v = 0, the originals): its copy, or the call of
        its task's function.
      device_maps: ``device_maps[s][j]``: original variable / update op of stage
        s -> its copy on stage device j (mirrored variables only; j = 0 empty).
      version_values: ``version_values[s][v]``: tensor of stage s -> its
        value in version v, for versions made by function calls (their
        results); empty for copies.
      functions: versions are function calls (``task_functions``).
      outside_tasks: step ops that run outside the task functions, once per
        stage device (variable reads).
      bridges: the batch pieces, version weights and cross-stage tensors.
      reduced: raw gradient tensor -> reduced gradient per stage device.
      sync_ops: writer op -> op that runs it and copies the result to replicas.
      mirrored: stage devices hold their own copies of the variables.
      merged: step tensor -> its merged tensor (``merge``), made for the ops
        outside the step that read it (a fetch translator starts from these).
      seed_weighted: step ops downstream of scaled gradient seeds: their
        versions' values are already multiplied by the version weight.
      summed_grads: raw gradients of batch-sum losses, whose versions weigh 1
        (when gradients, not seeds, are weighted).
      gradient_terms: raw gradient tensor that is one stage's term of a
        variable's gradient summed across stages -> that gradient's tensor
        (``tied_weights``).
      original_inputs: step op -> its inputs as the script built them (the
        rewrite reroutes the originals' to their rows and stages).
      original_controls: step op -> its control inputs as the script built them
        (less the gates a zero-bubble split dropped, ``pipeline.stage_tasks``).
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
    version_maps: Sequence[Sequence[Mapping[Op, Op]]]
    device_maps: Sequence[Sequence[Mapping[Op, Op]]]
    version_values: Sequence[Sequence[Mapping[Tensor, Tensor]]]
    functions: bool
    outside_tasks: AbstractSet[Op]
    bridges: Optional[Bridges]
    reduced: Mapping[Tensor, Sequence[Tensor]]
    sync_ops: Mapping[Op, Op]
    mirrored: bool
    merged: Mapping[Tensor, Tensor]
    seed_weighted: AbstractSet[Op]
    summed_grads: AbstractSet[Tensor]
    gradient_terms: Mapping[Tensor, Tensor]
    original_inputs: Mapping[Op, Sequence[Tensor]]
    original_controls: Mapping[Op, Sequence[Op]]
    batch_axes: Any
    weight_tasks: bool
    stage_tasks: Mapping[Tuple[int, str], Sequence[Op]]
    task_ops: Mapping[tuple, Sequence[Op]]
    schedule_edges: AbstractSet[Tuple[Op, Op]]
    processes: Any
    zero: Optional[Sharding]
    precision: Optional[str]
    local_copies: Mapping[Tuple[int, int], Mapping[Tensor, Tensor]]
    edits: int


@dataclasses.dataclass
class RewriteBuilder(RewriteQueries):
    """``DataParallelRewrite`` while ``replicate`` makes it: the same fields
    (the record's docstring says what each holds), mutable, empty until the
    pass making each returns. Passes read them; the driver
    (``data_parallel``) alone assigns them (``tests/test_layers.py``), and
    ``freeze`` ends the rewrite."""

    placement: Placement
    layout: Layout
    selection: Selection
    version_maps: List[List[Dict[Op, Op]]]
    device_maps: List[List[Dict[Op, Op]]]
    version_values: List[List[Dict[Tensor, Tensor]]] = dataclasses.field(default_factory=list)
    functions: bool = False
    outside_tasks: Set[Op] = dataclasses.field(default_factory=set)
    bridges: Optional[Bridges] = None
    reduced: Dict[Tensor, List[Tensor]] = dataclasses.field(default_factory=dict)
    sync_ops: Dict[Op, Op] = dataclasses.field(default_factory=dict)
    mirrored: bool = True
    merged: Dict[Tensor, Tensor] = dataclasses.field(default_factory=dict)
    seed_weighted: Set[Op] = dataclasses.field(default_factory=set)
    summed_grads: Set[Tensor] = dataclasses.field(default_factory=set)
    gradient_terms: Dict[Tensor, Tensor] = dataclasses.field(default_factory=dict)
    original_inputs: Dict[Op, List[Tensor]] = dataclasses.field(default_factory=dict)
    original_controls: Dict[Op, List[Op]] = dataclasses.field(default_factory=dict)
    batch_axes: Any = None
    weight_tasks: bool = False
    stage_tasks: Dict[Tuple[int, str], List[Op]] = dataclasses.field(default_factory=dict)
    task_ops: Dict[tuple, List[Op]] = dataclasses.field(default_factory=dict)
    schedule_edges: Set[Tuple[Op, Op]] = dataclasses.field(default_factory=set)
    processes: Any = None
    zero: Optional[Sharding] = None
    precision: Optional[str] = None
    local_copies: Dict[Tuple[int, int], Dict[Tensor, Tensor]] = dataclasses.field(
        default_factory=dict)
    edits: int = 0
    # (stage, device) -> ``variable_copies``, computed once the mirrors exist.
    _copies: Dict[Tuple[int, int], Dict[Tensor, Tensor]] = dataclasses.field(
        default_factory=dict)

    def variable_copies(self, stage: int, device: int) -> Dict[Tensor, Tensor]:
        """Original variable handle -> the copy stage device ``device`` of
        ``stage`` reads (asked only once ``device_maps`` holds the mirrors)."""
        key = (stage, device)
        if key not in self._copies:
            self._copies[key] = _variable_copies(self, stage, device)
        return self._copies[key]

    def freeze(self) -> DataParallelRewrite:
        """The rewrite as made: every field, read-only."""
        return DataParallelRewrite(**{field.name: _read_only(getattr(self, field.name))
                                      for field in dataclasses.fields(DataParallelRewrite)})


def _variable_copies(rw: RewriteBuilder, stage: int, device: int) -> Dict[Tensor, Tensor]:
    """Original variable handle -> the copy stage device ``device`` reads."""
    result = {}
    for var in rw.selection.variables:
        owner = rw.placement.stage(var)
        peer = rw.layout.peer(device, stage, owner)
        if peer and var in rw.device_maps[owner][peer]:  # not a ZeRO slot
            result[var.outputs[0]] = rw.device_maps[owner][peer][var].outputs[0]
    return result


_CONTAINERS = (dict, list, set)


def _read_only(value: Any) -> Any:
    """A read-only copy of ``value``: dicts (their values too) as views,
    lists as tuples, sets as frozensets; anything else as it is."""
    if isinstance(value, dict):
        return types.MappingProxyType({k: _read_only(v) if isinstance(v, _CONTAINERS) else v
                                       for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_read_only(v) if isinstance(v, _CONTAINERS) else v for v in value)
    if isinstance(value, set):
        return frozenset(value)
    return value
