"""Every version of every pipeline task as a call of the task's function
(``task_functions``), in an order where each task is defined after the
tasks it reads from.

One more cost grows with calls: when a session builds its step, XLA's
EncapsulateSubgraphsPass (in every TensorFlow build, JIT on or off) asks of
each call node whether its body touches a reference variable, instantiating
and discarding the body for every call, twice (about 40% of the first step at
32 micro-batches). The pass takes any node that a reference-typed node
precedes as touching one without looking inside, so each call waits on a
never-read reference variable of shape [0] on its device
(``tfpar_call_marker``, outside every variable collection): the scan stops at
the calls. Its only effect is that XLA's auto-clustering leaves the calls
alone.
"""
from typing import Dict, List, NamedTuple, Optional, Sequence, Set, Tuple

import networkx as nx
from tfpar import fallback
from tfpar.analysis.op_kinds import is_resource_variable
from tfpar.compat.tf import dtypes, gen_resource_variable_ops, gen_state_ops, ops, tensor_lib
from tfpar.ir.schedule import task_round
from tfpar.rewriters.averaged_variables import local_copy
from tfpar.rewriters.gradients import scale_seed
from tfpar.rewriters.task_functions import call_task, define_task, is_constant
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["Outside", "Versions", "call_markers", "call_versions", "outside_tasks", "task_order"]

Key = Tuple[int, str]  # (stage, "F", "B" or "W")
Slot = Tuple[int, int]  # (stage, version)


class Versions(NamedTuple):
    """What versions run and compute for original ops, as one pass made them.

    Attributes:
      maps: (stage, version) -> original op -> what the version runs for it
        (the call of its task's function; a read or constant outside them).
      values: (stage, version) -> tensor -> its value in the version.
      edits: in-place edits of original ops (their seeds scaled).
    """

    maps: Dict[Slot, Dict[ops.Operation, ops.Operation]]
    values: Dict[Slot, Dict[tensor_lib.Tensor, tensor_lib.Tensor]]
    edits: int = 0


class Outside(NamedTuple):
    """The step ops that run outside the task functions (``outside_tasks``).

    Attributes:
      members: the plain variable reads and the constants.
      versions: what each version reads for them.
    """

    members: Set[ops.Operation]
    versions: Versions


def task_order(graph: ops.Graph, rw: RewriteBuilder, tasks: Dict[Key, List[ops.Operation]],
               marks: List[ops.Operation]) -> Optional[List[Key]]:
    """The order to define the task functions in, each after every task it
    reads from; where tasks cannot be functions (``_order_or_why``; also with
    ``marks``, sums over the replicas: ``replica_sums``), None, said
    (``fallback``) when copies grow with micro-batches (with one micro-batch
    a copy per replica costs what a call per replica does)."""
    order, why = _order_or_why(rw, tasks)
    if marks:
        order, why = None, (f"'{marks[0].name}' sums batch statistics over the replicas "
                            "(synchronized batch norm), between the calls of one task")
    if order is None and rw.num_micro_batch > 1:
        fallback.fall_back(
            "pipeline.task_functions: each replica and micro-batch of a TaskGraph as a call of "
            "its task functions",
            f"they are copies of its ops (graph size and start-up grow with them), because {why}",
            "To ask for copies (and silence this), set pipeline.task_functions to false", graph)
    return order


def _order_or_why(rw: RewriteBuilder, tasks: Dict[Key, List[ops.Operation]]
                  ) -> Tuple[Optional[List[Key]], str]:
    """(the tasks in an order where each comes after every task it reads from
    (data or control), "") or, when they cannot be functions, (None, why,
    naming the culprit): a split stage (its ops span a device group), a
    reference variable (a call cannot take one), tasks reading from each
    other both ways (a task is called whole)."""
    placement = rw.placement
    if placement.split_groups:
        stage = min(placement.split_groups)
        return None, (f"TaskGraph '{placement.task_graph_names[stage]}' is split: its ops span "
                      "a group of devices, which one call cannot (split TaskGraphs have no "
                      "task functions yet)")
    reference = next((v for v in rw.selection.variables if not is_resource_variable(v)), None)
    if reference is not None:
        return None, (f"variable '{reference.name}' is a reference variable, which a call cannot "
                      "take (make variables resource variables: "
                      "tf.compat.v1.enable_resource_variables() before building, or "
                      "get_variable(..., use_resource=True))")
    owner = {op: key for key, members in tasks.items() for op in members}
    dag = nx.DiGraph()
    dag.add_nodes_from(tasks)
    for key, members in tasks.items():
        for op in members:
            for src in [t.op for t in rw.built_inputs(op)] + rw.built_controls(op):
                if owner.get(src, key) != key:
                    dag.add_edge(owner[src], key, reads=(op, src))
    try:
        cycle = nx.find_cycle(dag)
    except nx.NetworkXNoCycle:
        return list(nx.lexicographical_topological_sort(dag)), ""
    (source, target), through = cycle[0][:2], [edge[1] for edge in cycle[1:-1]]
    reader, read = dag.edges[source, target]["reads"]
    return None, (f"'{reader.name}' in {_task_name(rw, target)} reads '{read.name}' from "
                  f"{_task_name(rw, source)}, which needs {_task_name(rw, target)} first"
                  + (f" (through {', '.join(_task_name(rw, key) for key in through)})"
                     if through else "") + " (build each stage's ops under its own scope, so that "
                  "tensors flow one way between stages: forward to later stages, gradients back)")


def _task_name(rw: RewriteBuilder, key: Key) -> str:
    stage, kind = key
    base, step_round = task_round(kind)
    what = {"F": "forward", "B": "backward", "W": "weight gradients"}[base]
    return (f"the {what} of TaskGraph '{rw.placement.task_graph_names[stage]}'"
            + (f" in round {step_round} of the step" if step_round else ""))


def call_markers(graph: ops.Graph, rw: RewriteBuilder, order: List[Key]
                 ) -> Dict[str, List[ops.Operation]]:
    """Stage device -> the reference-variable marker its calls wait on
    (module doc), one per device, made in the order the calls reach them;
    none in a tf.function, whose bodies hold no reference variables."""
    devices = dict.fromkeys(rw.bridges.device(stage, v) for stage, _ in order
                            for v in range(rw.layout.num_versions(stage)))
    if graph.building_function:
        return {device: [] for device in devices}
    markers = {}
    for device in devices:
        with graph.as_default(), ops.device(device), ops.control_dependencies(None):
            with ops.name_scope(None):
                markers[device] = [gen_state_ops.variable_v2(
                    [0], dtypes.float32, name="tfpar_call_marker").op]
    return markers


def call_versions(graph: ops.Graph, rw: RewriteBuilder, key: Key,
                  task: List[ops.Operation], seeds: Sequence[tensor_lib.Tensor],
                  fetchable: Set[tensor_lib.Tensor], markers: Dict[str, List[ops.Operation]],
                  optimize: bool = False) -> Versions:
    """Every version of the task ``key`` (its original ops ``task``, less
    ``rw.outside_tasks``) as a call of its function (module doc), each
    waiting on its device's ``markers`` and optimizing its body when
    instantiated if ``optimize``; the tasks it reads from were called and
    recorded first. The originals are the template: their ``seeds`` are
    scaled by version 0's batch share (a weight each call passes its own
    of), the rest of what they read maps to each version's counterpart;
    they no longer run. Besides what other ops read, a forward task returns
    its tensors that hold batch rows (a later fetch merges any tensor from
    them: concatenated, or recomputed from the rows it reduced), a backward
    one those of ``fetchable`` (what ``tf.gradients`` returned) and of its
    ops that ``tf.gradients`` did not make (a loss reading a gradient)."""
    stage, kind = key
    step = rw.selection.step_ops_set
    members = [op for op in task if op not in rw.outside_tasks]
    inside = set(members)
    edits = 0
    for seed in seeds:
        if seed.op in inside:
            scaled = scale_seed(rw, seed, [0])
            members += scaled.made
            edits += scaled.edits
    fn = define_task(graph, members, f"tfpar_stage_{stage}_{kind}",
                     rw.batch_axes.holds_rows if task_round(kind)[0] == "F" else
                     (lambda t: t in fetchable or t.op not in rw.selection.backward))
    outside = _outside_controls(rw, members, inside)
    made = Versions({}, {}, edits)
    for v in range(rw.layout.num_versions(stage)):
        j, m = rw.layout.slot(stage, v)
        device = rw.bridges.device(stage, v)
        values = call_task(
            graph, fn, [_counterpart(rw, x, stage, v, j) for x in fn.arguments],
            _call_controls(rw, outside, stage, v) + markers[device],
            device, f"{rw.prefix(stage, j)}/micro_{m}/{kind}", optimize, rw.precision)
        call = values.pop(None)
        made.values[(stage, v)] = values
        made.maps[(stage, v)] = {op: call for op in members if op in step}
    return made


def outside_tasks(graph: ops.Graph, rw: RewriteBuilder) -> Outside:
    """The step's plain variable reads and constants, which run outside the
    task functions (``_read_variables``, ``_constants``), and what each
    version reads for them."""
    made = Versions({}, {})
    reads = _read_variables(graph, rw, made)
    return Outside(reads | _constants(rw, made), made)


def _read_variables(graph: ops.Graph, rw: RewriteBuilder, made: Versions) -> Set[ops.Operation]:
    """The step's plain variable reads run outside the task functions, once per
    stage device (each version on it reads the value there, kept in
    ``made``), so that calls pass values, not variable handles: TensorFlow's
    placer inspects the body of every call that takes a resource, once per
    call. Returns the reads moved."""
    reads = {op for op in rw.selection.step_ops if op.type == "ReadVariableOp"
             and op.inputs[0].op in rw.selection.variables and not op.control_inputs
             and op.inputs[0].op not in rw.selection.averaged}  # read per version
    for read in sorted(reads, key=lambda op: op.name):
        stage = rw.placement.stage(read)
        handle = read.inputs[0]
        on_device = {}
        for v in range(rw.layout.num_versions(stage)):
            j = rw.layout.slot(stage, v)[0]
            if j not in on_device:
                copy = rw.variable_copies(stage, j).get(handle, handle) if rw.mirrored else handle
                if copy is handle:
                    on_device[j] = read
                else:
                    with graph.as_default(), ops.device(rw.placement.device(read, j)):
                        on_device[j] = gen_resource_variable_ops.read_variable_op(
                            copy, read.get_attr("dtype"), name=f"{rw.prefix(stage, j)}/read").op
            made.maps.setdefault((stage, v), {})[read] = on_device[j]
            made.values.setdefault((stage, v), {})[read.outputs[0]] = on_device[j].outputs[0]
    return reads


def _constants(rw: RewriteBuilder, made: Versions) -> Set[ops.Operation]:
    """The step's constants leave the tasks: every version reads the one
    constant (kept in ``made``), and a body that reads it holds a copy
    (``define_task``)."""
    constants = {op for op in rw.selection.step_ops if is_constant(op)}
    for op in constants:
        stage = rw.placement.stage(op)
        for v in range(rw.layout.num_versions(stage)):
            made.maps.setdefault((stage, v), {})[op] = op
            made.values.setdefault((stage, v), {})[op.outputs[0]] = op.outputs[0]
    return constants


def _counterpart(rw: RewriteBuilder, x: tensor_lib.Tensor, stage: int, version: int,
                 device: int) -> tensor_lib.Tensor:
    """What version ``version`` (on stage device ``device``) of a task of
    ``stage`` reads where version 0 reads ``x``."""
    made = rw.bridges.counterpart(x, stage, version)
    if made is None:
        made = local_copy(rw, x, stage, version)
    if made is not None:
        return made
    if x.op in rw.selection.step_ops_set:
        if rw.placement.stage(x.op) == stage:
            return rw.version_tensor(x, version)
        return rw.bridges.tensor(x, stage, version)
    return rw.variable_copies(stage, device).get(x, x) if rw.mirrored else x


def _outside_controls(rw: RewriteBuilder, members, inside) -> List[ops.Operation]:
    """The control inputs of ``members`` from outside the task, as the script
    built them."""
    found: Dict[ops.Operation, None] = {}
    for op in members:
        for p in rw.built_controls(op):
            if p not in inside:
                found.setdefault(p)
    return list(found)


def _call_controls(rw: RewriteBuilder, outside: Sequence[ops.Operation], stage: int,
                   version: int) -> List[ops.Operation]:
    """What version ``version`` of a task of ``stage`` waits on: its
    ``outside`` control inputs, in that version."""
    step = rw.selection.step_ops_set
    deps: Dict[ops.Operation, None] = {}
    for p in outside:
        if p not in step:
            deps.setdefault(p)
        elif rw.placement.stage(p) == stage:
            deps.setdefault(rw.versions(p)[version])
        else:
            unit = rw.layout.unit(stage, version)
            for source in rw.layout.unit_versions(rw.placement.stage(p), unit):
                deps.setdefault(rw.versions(p)[source])
    return list(deps)
