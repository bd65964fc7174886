"""Pipeline tasks as graph functions: a step graph that does not grow with
micro-batches (issue 18).

A task is the ops a stage runs for one micro-batch in one direction
(``pipeline.stage_tasks``). Its original ops, the template, become one
function of the graph's library: its arguments are the tensors the task reads
from outside it, its results the tensors other ops (or a later fetch) may
read. Every version of the task, version 0 included, is one call of that
function on its stage device, reading its own counterparts of the arguments;
the template no longer runs. The graph grows by one op per call, not by a copy
of the stage, and TensorFlow optimizes each body once: when its calls are
instantiated (tfpar's sessions then skip grappler on the step graph, which
holds little but calls), or else with the session's graph. Bodies hold their
own copies of the constants they read, and the functions are marked
``_noinline`` so that TensorFlow does not inline the calls back into the graph.

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
import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import networkx as nx
from tensorflow.core.framework import attr_value_pb2, function_pb2
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python.eager import context
from tensorflow.python.framework import dtypes, function, ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import gen_resource_variable_ops, gen_state_ops

from tfpar.rewriters.averaged_variables import local_copy
from tfpar.rewriters.gradients import scale_seed
from tfpar.analysis.op_kinds import is_resource_variable

__all__ = ["TaskFunction", "call_task", "call_tasks", "define_task", "task_order"]

Key = Tuple[int, str]  # (stage, "F", "B" or "W")


@dataclasses.dataclass
class TaskFunction:
    """A task's ops as a library function.

    Attributes:
      arguments: the tensors it reads from outside, in argument order.
      results: the tensors it returns, in result order.
      function: the library function (``function._DefinedFunction``).
      shapes: the result shapes of calls by their arguments' dtypes and shapes.
    """

    arguments: List[tensor_lib.Tensor]
    results: List[tensor_lib.Tensor]
    function: object
    shapes: Dict[tuple, list] = dataclasses.field(default_factory=dict)


def define_task(graph: ops.Graph, task: Sequence[ops.Operation], name: str,
                exported: Callable[[tensor_lib.Tensor], bool]) -> TaskFunction:
    """Add the function of ``task`` (ops of ``graph``) to the graph's library.

    Its results are the task's tensors that ops outside it read, that nothing
    reads (a fetch may), and those ``exported`` (what a later fetch, merged
    over the versions, may need).
    """
    inside: Set[ops.Operation] = set(task)
    arguments: Dict[tensor_lib.Tensor, None] = {}
    results: List[tensor_lib.Tensor] = []
    constants = _outside_constants(task, inside)
    body = inside | set(constants)
    for op in task:
        for t in op.inputs:
            if t.op not in body:
                arguments.setdefault(t)
        results.extend(t for t in op.outputs if exported(t) or not t.consumers()
                       or any(c not in inside for c in t.consumers()))
    definition = _function_def(_library_name(graph, name), constants + list(task), body,
                               list(arguments), results)
    library_function = function._from_definition(definition)  # pylint: disable=protected-access
    library_function.add_to_graph(graph)
    if graph.building_function:  # a tf.function's callees run from the eager context's library
        context.context().add_function_def(definition)
    return TaskFunction(list(arguments), results, library_function)


def _library_name(graph: ops.Graph, name: str) -> str:
    """A name for a function of ``graph`` that no other function has: unique
    in the graph; for a tf.function, whose callees join the one library of
    the process (every step, retrace and model), numbered process-wide too."""
    unique = graph.unique_name(name, mark_as_used=True)
    return f"{unique}_{ops.uid()}" if graph.building_function else unique


def _outside_constants(task: Sequence[ops.Operation], inside: Set[ops.Operation]
                       ) -> List[ops.Operation]:
    """The constants ``task`` reads from outside it: each body holds its own
    copy of them instead of an argument (a call per micro-batch would
    otherwise add an edge per constant)."""
    found: Dict[ops.Operation, None] = {}
    for op in task:
        for t in op.inputs:
            if t.op not in inside and _is_constant(t.op):
                found.setdefault(t.op)
    return list(found)


def _is_constant(op: ops.Operation) -> bool:
    return op.type == "Const" and not op.control_inputs


def _function_def(name: str, task: Sequence[ops.Operation], inside: Set[ops.Operation],
                  arguments: List[tensor_lib.Tensor], results: List[tensor_lib.Tensor]
                  ) -> function_pb2.FunctionDef:
    """The FunctionDef whose body is ``task``'s ops (devices and colocations
    dropped: the body runs where its call does), reading ``arguments`` and
    returning ``results``. Ops whose effect is not a result (a metric
    accumulator's update, a no-op others wait on) are control outputs, so
    every call runs them."""
    definition = function_pb2.FunctionDef()
    definition.signature.name = name
    refs: Dict[str, str] = {}
    for i, t in enumerate(arguments):
        arg = definition.signature.input_arg.add(name=f"arg{i}", type=t.dtype.as_datatype_enum)
        refs[t.name] = arg.name
    for op in task:
        refs.update(zip((t.name for t in op.outputs), _output_refs(op)))
    returned = {t.op for t in results}
    for op in task:
        node = definition.node_def.add()
        node.CopyFrom(op.node_def)
        node.device = ""
        if "_class" in node.attr:
            del node.attr["_class"]
        del node.input[:]
        node.input.extend([refs[t.name] for t in op.inputs]
                          + ["^" + dep.name for dep in op.control_inputs if dep in inside])
        if op.op_def.is_stateful:
            definition.signature.is_stateful = True
        if op not in returned and (op.op_def.is_stateful or not op.outputs):
            definition.signature.control_output.append(op.name)
            definition.control_ret[op.name] = op.name
    for i, t in enumerate(results):
        out = definition.signature.output_arg.add(name=f"out{i}", type=t.dtype.as_datatype_enum)
        definition.ret[out.name] = refs[t.name]
    definition.attr["_noinline"].CopyFrom(attr_value_pb2.AttrValue(b=True))
    return definition


@functools.lru_cache(maxsize=None)
def _call_config(optimize: bool, precision: Optional[str]) -> bytes:
    """The ConfigProto of calls: with ``optimize``, TensorFlow's graph
    optimizer runs on the body when a call is instantiated (once per function
    and device: tfpar sessions then skip it on the step graph, see
    ``runtime.engine.session_config``), with the ``precision`` rewrite option
    (``runtime.precision``) on if set; otherwise the ``precision`` rewrite
    only, if set (a tf.function's calls: the step's own optimizer leaves
    their bodies to them), else nothing, the session's graph optimizer
    having optimized the library with the step graph."""
    config = config_pb2.ConfigProto()
    rewriting = config.graph_options.rewrite_options
    rewriting.disable_meta_optimizer = not optimize and precision is None
    if precision is not None:
        setattr(rewriting, precision, rewriter_config_pb2.RewriterConfig.ON)
        if not optimize:
            rewriting.optimizers.append(precision)
    return config.SerializeToString()


def _output_refs(op: ops.Operation) -> List[str]:
    """How a function body refers to each output of ``op`` (``op:arg:i``)."""
    attrs = op.node_def.attr
    refs = []
    for arg in op.op_def.output_arg:
        count = (attrs[arg.number_attr].i if arg.number_attr else
                 len(attrs[arg.type_list_attr].list.type) if arg.type_list_attr else 1)
        refs += [f"{op.name}:{arg.name}:{i}" for i in range(count)]
    return refs


def call_task(graph: ops.Graph, fn: TaskFunction, arguments: Sequence[tensor_lib.Tensor],
              controls: Sequence[ops.Operation], device: str, name: str,
              optimize: bool = False, precision: Optional[str] = None
              ) -> Dict[tensor_lib.Tensor, tensor_lib.Tensor]:
    """One call of ``fn`` on ``device`` reading ``arguments`` (one per
    ``fn.arguments``), after ``controls``, optimizing the body when
    instantiated if ``optimize``, in ``precision`` (``_call_config``); returns result tensor of
    version 0 -> the call's tensor, and the call op under the key None.

    TensorFlow infers a call's result shapes through its body, which takes
    milliseconds per call of a stage of a few layers; a call whose arguments
    have the dtypes and shapes (constants: the values) of an earlier call's
    gets that call's result shapes instead.
    """
    signature = tuple((t.dtype, None if t.shape.rank is None else tuple(t.shape.as_list()),
                       t.name if t.op.type == "Const" else None) for t in arguments)
    known = None if dtypes.resource in (t.dtype for t in arguments) else fn.shapes.get(signature)
    with graph.as_default(), ops.device(device), ops.control_dependencies(controls):
        call = graph.create_op(
            "StatefulPartitionedCall", list(arguments), [t.dtype for t in fn.results],
            name=name, attrs={
                "f": attr_value_pb2.AttrValue(func=attr_value_pb2.NameAttrList(
                    name=fn.function.name)),
                "Tin": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                    type=[t.dtype.as_datatype_enum for t in arguments])),
                "Tout": attr_value_pb2.AttrValue(list=attr_value_pb2.AttrValue.ListValue(
                    type=[t.dtype.as_datatype_enum for t in fn.results])),
                "config": attr_value_pb2.AttrValue(s=b""),
                "config_proto": attr_value_pb2.AttrValue(s=_call_config(optimize, precision)),
                "executor_type": attr_value_pb2.AttrValue(s=b""),
                "_disable_call_shape_inference": attr_value_pb2.AttrValue(b=known is not None)})
    if known is None:
        fn.shapes[signature] = [t.shape for t in call.outputs]
    else:
        for t, shape in zip(call.outputs, known):
            t.set_shape(shape)
    result = dict(zip(fn.results, call.outputs))
    result[None] = call
    return result


def task_order(rw, tasks: Dict[Key, List[ops.Operation]]) -> Tuple[Optional[List[Key]], str]:
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


def _task_name(rw, key: Key) -> str:
    stage, kind = key
    what = {"F": "forward", "B": "backward", "W": "weight gradients"}[kind]
    return f"the {what} of TaskGraph '{rw.placement.task_graph_names[stage]}'"


def call_tasks(graph: ops.Graph, rw, tasks: Dict[Key, List[ops.Operation]], order: List[Key],
               seeds: Sequence[tensor_lib.Tensor], fetchable: Set[tensor_lib.Tensor],
               optimize: bool = False) -> None:
    """Every version of every task as a call of its function (module doc), in
    ``order``, each optimizing its body when instantiated if ``optimize``.
    The originals are the template: their ``seeds`` are scaled by version 0's
    batch share (a weight each call passes its own of), the rest
    of what they read maps to each version's counterpart; they no longer run.
    Besides what other ops read, a forward task returns its tensors that hold
    batch rows (a later fetch merges any tensor from them: concatenated, or
    recomputed from the rows it reduced), a backward one those of
    ``fetchable`` (what ``tf.gradients`` returned) and of its ops that
    ``tf.gradients`` did not make (a loss reading a gradient)."""
    step = rw.selection.step_ops_set
    layout = rw.layout
    markers: Dict[str, ops.Operation] = {}
    reads = rw.outside_tasks = _read_variables(graph, rw) | _constants(rw)
    for stage, kind in order:
        members = [op for op in tasks[(stage, kind)] if op not in reads]
        inside = set(members)
        for seed in seeds:
            if seed.op in inside:
                members += scale_seed(rw, seed, [0])
        fn = define_task(graph, members, f"tfpar_stage_{stage}_{kind}",
                         rw.batch_axes.holds_rows if kind == "F" else
                         (lambda t: t in fetchable or t.op not in rw.selection.backward))
        outside = _outside_controls(rw, members, inside)
        for v in range(layout.num_versions(stage)):
            j, m = layout.slot(stage, v)
            device = rw.bridges.device(stage, v)
            values = call_task(
                graph, fn, [_counterpart(rw, x, stage, v, j) for x in fn.arguments],
                _call_controls(rw, outside, stage, v) + _marker(graph, device, markers),
                device, f"{rw.prefix(stage, j)}/micro_{m}/{kind}", optimize, rw.precision)
            call = values.pop(None)
            rw.version_values[stage][v].update(values)
            rw.version_maps[stage][v].update((op, call) for op in members if op in step)


def _marker(graph: ops.Graph, device: str, markers: Dict[str, ops.Operation]
            ) -> List[ops.Operation]:
    """The reference-variable marker the calls on ``device`` wait on (module
    doc), made once per device in ``markers``; none in a tf.function, whose
    bodies hold no reference variables."""
    if graph.building_function:
        return []
    if device not in markers:
        with graph.as_default(), ops.device(device), ops.control_dependencies(None), \
                ops.name_scope(None):
            markers[device] = gen_state_ops.variable_v2(
                [0], dtypes.float32, name="tfpar_call_marker").op
    return [markers[device]]


def _read_variables(graph: ops.Graph, rw) -> Set[ops.Operation]:
    """The step's plain variable reads run outside the task functions, once per
    stage device (each version on it reads the value there), so that calls pass
    values, not variable handles: TensorFlow's placer inspects the body of
    every call that takes a resource, once per call. Returns the reads moved."""
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
            rw.version_maps[stage][v][read] = on_device[j]
            rw.version_values[stage][v][read.outputs[0]] = on_device[j].outputs[0]
    return reads


def _constants(rw) -> Set[ops.Operation]:
    """The step's constants leave the tasks: every version reads the one
    constant, and a body that reads it holds a copy (``define_task``)."""
    constants = {op for op in rw.selection.step_ops if _is_constant(op)}
    for op in constants:
        stage = rw.placement.stage(op)
        for v in range(rw.layout.num_versions(stage)):
            rw.version_maps[stage][v][op] = op
            rw.version_values[stage][v][op.outputs[0]] = op.outputs[0]
    return constants


def _counterpart(rw, x: tensor_lib.Tensor, stage: int, version: int,
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


def _outside_controls(rw, members, inside) -> List[ops.Operation]:
    """The control inputs of ``members`` from outside the task, as the script
    built them."""
    found: Dict[ops.Operation, None] = {}
    for op in members:
        for p in rw.built_controls(op):
            if p not in inside:
                found.setdefault(p)
    return list(found)


def _call_controls(rw, outside: Sequence[ops.Operation], stage: int, version: int
                   ) -> List[ops.Operation]:
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
