"""Pipeline tasks as graph functions: a step graph that does not grow with
micro-batches (issue 18).

A task is the ops a stage runs for one micro-batch in one direction
(``pipeline.task_ops``). Its ops in version 0 (the originals, already wired to
their rows and stages) become one function of the graph's library: its
arguments are the tensors the task reads from outside it, its results the
tensors anything else may read. Every other version of the task is one call of
that function on its stage device, reading its own counterparts of the
arguments. TensorFlow then optimizes a task's body once per device, however
many micro-batches call it, and the graph grows by one op per call, not by a
copy of the stage. The calls are marked ``_noinline`` so that TensorFlow does
not inline them back into the graph before optimizing it.
"""
import dataclasses
from typing import Callable, Dict, List, Sequence, Set

from tensorflow.core.framework import attr_value_pb2
from tensorflow.python.framework import dtypes, function, graph_to_function_def, ops
from tensorflow.python.framework import tensor as tensor_lib

__all__ = ["TaskFunction", "call_task", "define_task"]

# Results a function cannot pass (kept inside the task).
_UNPASSABLE = (dtypes.resource, dtypes.variant)


@dataclasses.dataclass
class TaskFunction:
    """A task's ops as a library function.

    Attributes:
      ops: the task's ops (version 0), graph order.
      arguments: the tensors it reads from outside, in argument order.
      controls: the ops outside the task its ops wait on.
      results: the tensors it returns, in result order.
      function: the library function (``function._DefinedFunction``).
    """

    ops: List[ops.Operation]
    arguments: List[tensor_lib.Tensor]
    controls: List[ops.Operation]
    results: List[tensor_lib.Tensor]
    function: object


def define_task(graph: ops.Graph, task: Sequence[ops.Operation], name: str,
                exported: Callable[[tensor_lib.Tensor], bool]) -> TaskFunction:
    """Add the function of ``task`` (ops of ``graph``) to the graph's library.

    Its results are the task's tensors read by ops outside it, and those
    ``exported(t)`` asks for (tensors a later fetch may need).
    """
    inside: Set[ops.Operation] = set(task)
    arguments: Dict[tensor_lib.Tensor, None] = {}
    controls: Dict[ops.Operation, None] = {}
    results: List[tensor_lib.Tensor] = []
    for op in task:
        for t in op.inputs:
            if t.op not in inside:
                arguments.setdefault(t)
        for dep in op.control_inputs:
            if dep not in inside:
                controls.setdefault(dep)
        for t in op.outputs:
            if t.dtype.base_dtype in _UNPASSABLE:
                continue
            if exported(t) or any(c not in inside for c in t.consumers()):
                results.append(t)
    definition = graph_to_function_def.graph_to_function_def(
        graph, list(task), list(arguments), results)
    definition.signature.name = graph.unique_name(name, mark_as_used=True).replace("/", "_")
    names = {op.name for op in task}
    for node in definition.node_def:
        node.device = ""  # the body runs where its call does
        if "_class" in node.attr:
            del node.attr["_class"]
        kept = [x for x in node.input if not x.startswith("^") or x[1:] in names]
        del node.input[:]
        node.input.extend(kept)
    definition.attr["_noinline"].CopyFrom(attr_value_pb2.AttrValue(b=True))
    library_function = function._from_definition(definition)  # pylint: disable=protected-access
    library_function.add_to_graph(graph)
    return TaskFunction(list(task), list(arguments), list(controls), results, library_function)


def call_task(graph: ops.Graph, fn: TaskFunction, arguments: Sequence[tensor_lib.Tensor],
              controls: Sequence[ops.Operation], device: str, name: str
              ) -> Dict[tensor_lib.Tensor, tensor_lib.Tensor]:
    """One call of ``fn`` on ``device`` reading ``arguments`` (one per
    ``fn.arguments``), after ``controls``; returns result tensor of version 0
    -> the call's tensor, and the call op under the key None."""
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
                "config_proto": attr_value_pb2.AttrValue(s=b""),
                "executor_type": attr_value_pb2.AttrValue(s=b"")})
    result = dict(zip(fn.results, call.outputs))
    result[None] = call
    return result
