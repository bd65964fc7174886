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
"""
import dataclasses
import functools
from typing import Callable, Dict, List, Optional, Sequence, Set

from tfpar.compat import tf as internals
from tfpar.compat.tf import (attr_value_pb2, config_pb2, context, dtypes, function_pb2, ops,
                             rewriter_config_pb2, tensor_lib)

__all__ = ["TaskFunction", "call_task", "define_task", "is_constant"]


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
    library_function = internals.function_from_definition(definition)
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
            if t.op not in inside and is_constant(t.op):
                found.setdefault(t.op)
    return list(found)


def is_constant(op: ops.Operation) -> bool:
    """A constant that waits on nothing."""
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
