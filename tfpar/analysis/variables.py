"""Variables of a captured graph: their size, the ops writing them, their
declared aggregation, and which of them the training step averages (moving
statistics) rather than trains. Nothing here mutates."""
import collections
from typing import Dict, List, NamedTuple, Set, Tuple

from tfpar.compat import tf as internals
from tfpar.ir.recorded import Recorded
from tfpar.analysis.graph_index import data_ancestors
from tfpar.analysis.op_kinds import (READ_ONLY_RESOURCE_TYPES, REF_READ_TYPES, is_resource_variable,
                                     is_variable)
from tfpar.compat.tf import dtypes, handle_data_util, ops, tensor_lib, tensor_shape

__all__ = ["Averaged", "all_variables", "averaged_variables", "declared_aggregations",
           "trainable_variables", "variable_bytes", "variable_writers", "writers_of",
           "written_variables"]


def variable_bytes(handle: tensor_lib.Tensor) -> int:
    """Bytes of the variable behind ``handle`` (0 if its shape is unknown):
    its op's attributes, or, captured by a tf.function, the handle's
    resource data."""
    op = handle.op
    if op.type != "Placeholder":
        shape, dtype = op.get_attr("shape"), op.get_attr("dtype")
    else:
        shape_and_type = handle_data_util.get_resource_handle_data(handle).shape_and_type[0]
        shape, dtype = shape_and_type.shape, shape_and_type.dtype
    return (tensor_shape.TensorShape(shape).num_elements() or 0) * dtypes.as_dtype(dtype).size


def variable_writers(var_op: ops.Operation) -> List[ops.Operation]:
    """Ops that modify the variable defined by ``var_op`` (a ``tf.cond`` or
    loop whose body only reads it does not)."""
    handle = var_op.outputs[0]
    result = []
    for c in handle.consumers():
        if is_resource_variable(var_op):
            if c.type not in READ_ONLY_RESOURCE_TYPES and _may_write(c, handle):
                result.append(c)
        elif c.type not in REF_READ_TYPES:
            result.append(c)
    return result


# Ops running functions on their inputs: attributes naming the functions, and
# how many inputs come before those the functions take.
_FUNCTIONAL = {"If": (("then_branch", "else_branch"), 1),
               "StatelessIf": (("then_branch", "else_branch"), 1),
               "Case": (("branches",), 1), "StatelessCase": (("branches",), 1),
               "While": (("cond", "body"), 0), "StatelessWhile": (("cond", "body"), 0),
               "PartitionedCall": (("f",), 0), "StatefulPartitionedCall": (("f",), 0)}


def _may_write(op: ops.Operation, handle: tensor_lib.Tensor) -> bool:
    """Whether ``op``, which reads the resource ``handle``, may write it: any op
    but a function-running one whose functions only read it (looked into,
    nested ones too; a function tfpar cannot see counts as writing)."""
    if op.type not in _FUNCTIONAL:
        return True
    attrs, skip = _FUNCTIONAL[op.type]
    positions = [k - skip for k, t in enumerate(op.inputs) if t is handle and k >= skip]
    for attr in attrs:
        value = op.get_attr(attr)
        for fn in value if isinstance(value, list) else [value]:
            defined = internals.library_function(op.graph, fn.name)
            body = getattr(defined, "graph", None)
            if body is None:
                return True
            for k in positions:
                inner = body.inputs[k]
                if any(c.type not in READ_ONLY_RESOURCE_TYPES and _may_write(c, inner)
                       for c in inner.consumers()):
                    return True
    return False


def written_variables(op: ops.Operation) -> List[ops.Operation]:
    """Variable ops that ``op`` writes."""
    return [t.op for t in op.inputs if is_variable(t.op)
            and op in variable_writers(t.op)]


def writers_of(var_ops) -> Set[ops.Operation]:
    """Ops that modify any of the variables ``var_ops``."""
    return {w for v in var_ops for w in variable_writers(v)}


def all_variables(graph: ops.Graph) -> list:
    """The graph's global and local variables, each once."""
    seen, result = set(), []
    for key in (ops.GraphKeys.GLOBAL_VARIABLES, ops.GraphKeys.LOCAL_VARIABLES):
        for v in graph.get_collection(key):
            if id(v) not in seen:
                seen.add(id(v))
                result.append(v)
    return result


# Writes of a whole value, and of an increment, by resource and reference.
_SET_TYPES = frozenset({"AssignVariableOp", "Assign"})
_ADD_TYPES = frozenset({"AssignAddVariableOp", "AssignSubVariableOp", "AssignAdd", "AssignSub"})


class Averaged(NamedTuple):
    """Why a variable's updates are averaged, and the step ops writing it."""

    why: str
    writers: Tuple[ops.Operation, ...]


def trainable_variables(graph: ops.Graph) -> list:
    """(op, variable) per trainable variable of ``graph``: its collection's, or
    for a TF2 step, the variables it reads (their op: the handle it captured)."""
    if not graph.building_function:
        return [(v.op, v) for v in graph.get_collection(ops.GraphKeys.TRAINABLE_VARIABLES)]
    return [(placeholder.op, v) for placeholder, v in _captured_variables(graph) if v.trainable]


def _captured_variables(graph: ops.Graph) -> list:
    """(placeholder of its handle, variable) per variable a tf.function's graph captured."""
    inner = {id(outer): placeholder for outer, placeholder in graph.captures}
    return [(inner[id(v.handle)], v) for v in graph.variables if id(v.handle) in inner]


def averaged_variables(step: Set[ops.Operation], excluded: Set[ops.Operation],
                       declared: Dict[ops.Operation, str]) -> Dict[ops.Operation, Averaged]:
    """The variables ``step`` writes (but ``excluded``: the global step and
    what gradients train) whose versions' updates are averaged, not summed
    (``docs/semantics.md``; MirroredStrategy's rule for Keras' ON_READ
    variables), each with why: declared MEAN (or ONLY_FIRST_REPLICA: the
    first version's update is kept), or undeclared and written from its own value (an
    exponential moving average, ``assign_sub((v - batch_mean) * decay)``, or
    a whole value assigned: the fused BatchNorm kernel's running mean), or
    written inside an op tfpar cannot look into (a ``tf.cond``): a guess the
    rewrite says. Declared SUM, or undeclared increments that do not read the
    variable (a metric's total and count), are accumulators."""
    writers: Dict[ops.Operation, List[ops.Operation]] = collections.defaultdict(list)
    for op in sorted(step, key=lambda op: op.name):
        for var in written_variables(op):
            if var not in excluded:
                writers[var].append(op)
    found = {}
    for var, ops_ in writers.items():
        kind, why = declared.get(var), None
        if kind in ("MEAN", "ONLY_FIRST_REPLICA"):
            why = f"declared {kind}"
        elif kind is None:
            opaque = [w for w in ops_ if w.type not in _SET_TYPES | _ADD_TYPES]
            if opaque:
                why = f"written inside {opaque[0].type} '{opaque[0].name}'"
            elif any(w.type in _SET_TYPES or _reads(w.inputs[1], var, step) for w in ops_):
                why = "written from its own value"
        if why is not None:
            found[var] = Averaged(why, tuple(ops_))
    return found


def _reads(value: tensor_lib.Tensor, var: ops.Operation, step: Set[ops.Operation]) -> bool:
    """Whether ``value``, a step tensor, is computed from a read of ``var``."""
    reads = READ_ONLY_RESOURCE_TYPES | REF_READ_TYPES
    return any(t.op is var for op in data_ancestors(
        [value.op], lambda op: op in step or op.type in reads) for t in op.inputs)


def declared_aggregations(graph: ops.Graph, recorded: Recorded) -> Dict[ops.Operation, str]:
    """Variable op -> its declared ``tf.VariableAggregation`` name, where
    declared: recorded as the graph made it, or for a tf.function, read from
    the variables it captured (the op is the placeholder of their handle)."""
    if not graph.building_function:
        return {graph.get_operation_by_name(name): kind
                for name, kind in recorded.aggregations.items()}
    return {placeholder.op: v.aggregation.name for placeholder, v in _captured_variables(graph)
            if v.aggregation.name != "NONE"}
