"""Graph-surgery verbs. The only module that calls TF's private op mutators
(through ``tfpar.compat.tf``).

Every verb takes explicit ops/tensors and returns what it created, so tests
can assert on it. A graph must not be mutated after a session ran it.
"""
from typing import Callable, Dict, Iterable, List, Mapping, Sequence, Union

from tfpar.compat import tf as internals
from tfpar.compat.tf import attr_value_pb2, graph_pb2, importer, ops, tensor_lib

__all__ = ["add_control_input", "clear_colocation", "clone_ops", "remove_control_input",
           "reroute", "set_device", "unfinalized", "update_input"]

_VARIABLE_TYPES = ("VarHandleOp", "VariableV2", "Variable")


def update_input(op: ops.Operation, index: int, tensor: tensor_lib.Tensor) -> None:
    """Make ``op`` read ``tensor`` as its input ``index``."""
    internals.update_input(op, index, tensor)


def reroute(consumer: ops.Operation, old: tensor_lib.Tensor, new: tensor_lib.Tensor) -> int:
    """Make every input of ``consumer`` that is ``old`` read ``new``; returns how many."""
    count = 0
    for k, x in enumerate(consumer.inputs):
        if x is old:
            update_input(consumer, k, new)
            count += 1
    return count


def add_control_input(op: ops.Operation, dep: ops.Operation) -> None:
    """Make ``op`` run after ``dep``."""
    if dep not in op.control_inputs:
        internals.add_control_input(op, dep)


def remove_control_input(op: ops.Operation, dep: ops.Operation) -> None:
    """Make ``op`` no longer wait for ``dep``."""
    if dep in op.control_inputs:
        kept = [d for d in op.control_inputs if d is not dep]
        internals.set_control_inputs(op, kept)


def set_device(op: ops.Operation, device: str) -> None:
    internals.set_device(op, device)


def clear_colocation(op: ops.Operation) -> None:
    """Drop ``op``'s colocation constraints: its device alone places it."""
    if "_class" in op.node_def.attr:
        internals.clear_attr(op, "_class")


class unfinalized:  # pylint: disable=invalid-name
    """Context manager that lets tfpar add ops to a finalized graph, then re-finalizes."""

    def __init__(self, graph: ops.Graph) -> None:
        self._graph = graph
        self._was_final = graph.finalized

    def __enter__(self) -> ops.Graph:
        if self._was_final:
            internals.unfinalize(self._graph)
        return self._graph

    def __exit__(self, *exc) -> None:
        if self._was_final:
            internals.refinalize(self._graph)


def clone_ops(graph: ops.Graph, op_list: Sequence[ops.Operation], prefix: str,
              device: Union[None, str, Callable[[ops.Operation], str]],
              input_map: Mapping[tensor_lib.Tensor, tensor_lib.Tensor],
              inputs_of: Callable[[ops.Operation], Sequence[tensor_lib.Tensor]] = None,
              controls_of: Callable[[ops.Operation], Sequence[ops.Operation]] = None,
              control_map: Mapping[ops.Operation, ops.Operation] = None
              ) -> Dict[ops.Operation, ops.Operation]:
    """Copy ``op_list`` into ``graph`` under a fresh name scope ``prefix``, on
    ``device`` (a name, a function of the original op, or None: unchanged).
    ``inputs_of(op)`` / ``controls_of(op)`` give the data / control inputs to
    copy (default: ``op.inputs`` / ``op.control_inputs``).

    Edges between copied ops point at the copies. A data input from outside the
    set reads ``input_map[t]`` when given, else the original tensor ``t``; a
    control input from outside waits for ``control_map[op]`` when given, else
    the original op. Variables get
    a ``shared_name`` of their own so a copy is a distinct variable. Colocation
    constraints follow the copies.

    Returns:
      original op -> copied op.
    """
    names = {op.name for op in op_list}
    scope = graph.unique_name(prefix, mark_as_used=False)
    graph_def = graph_pb2.GraphDef()
    graph_def.versions.CopyFrom(graph.graph_def_versions)
    external: Dict[str, tensor_lib.Tensor] = {}
    outside_controls: List[tuple] = []
    for op in op_list:
        node = graph_def.node.add()
        node.CopyFrom(op.node_def)
        if device is not None:
            node.device = device(op) if callable(device) else device
        del node.input[:]
        for t in (inputs_of(op) if inputs_of is not None else op.inputs):
            node.input.append(t.name)
            if t.op.name not in names:
                external[t.name] = input_map.get(t, t)
        for dep in (controls_of(op) if controls_of is not None else op.control_inputs):
            if dep.name in names:
                node.input.append("^" + dep.name)
            else:
                outside_controls.append((op.name, (control_map or {}).get(dep, dep)))
        _retarget_colocation(node, names)
        if op.type in _VARIABLE_TYPES:
            shared = op.get_attr("shared_name").decode() or op.name
            node.attr["shared_name"].s = f"{scope}/{shared}".encode()
    with ops.name_scope(None):
        imported = importer.import_graph_def(
            graph_def, input_map=external, return_elements=[op.name for op in op_list],
            name=scope)
    mapping = dict(zip(op_list, imported))
    by_name = {op.name: new for op, new in mapping.items()}
    for name, dep in outside_controls:
        add_control_input(by_name[name], dep)
    return mapping


def _retarget_colocation(node, names: Iterable[str]) -> None:
    """Keep ``loc:@op`` constraints to copied ops (the importer prefixes them); drop the rest."""
    if "_class" not in node.attr:
        return
    kept = []
    for loc in node.attr["_class"].list.s:
        target = loc.decode()[len("loc:@"):]
        if target in names:
            kept.append(f"loc:@{target}".encode())
    if kept:
        node.attr["_class"].CopyFrom(attr_value_pb2.AttrValue(
            list=attr_value_pb2.AttrValue.ListValue(s=kept)))
    else:
        del node.attr["_class"]
