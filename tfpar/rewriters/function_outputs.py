"""What a rewritten tf.function step returns and must run (issue 13).

A graph-mode script fetches what it wants at each ``Session.run``; a
tf.function fixes it when traced: the tensors it returns
(``FuncGraph.outputs`` / ``structured_outputs``) and the ops it must run
(``control_outputs``: the stateful ops, which TensorFlow's automatic control
dependencies collect). After the rewrite the original step ops are the
template of their versions and no longer run, so both lists are translated
like fetches: a returned step tensor becomes its value merged over replicas
and micro-batches, a step op to run becomes every version of it, and a writer
the rewrite completes (the translator's ``sync_ops``: a moving average's
copies averaged into the variable, a mirrored variable copied to its
replicas) becomes that completion, which runs its versions too. A step that
returns nothing (Horovod's synthetic benchmark) runs only its control
outputs: without the completion, BatchNorm's moving statistics never moved.
"""
from typing import Dict

from tfpar.compat.tf import nest, ops

__all__ = ["rewire_outputs"]


def rewire_outputs(graph, translate) -> None:
    """Point ``graph``'s (a FuncGraph) outputs and control outputs at what
    runs after its rewrite; ``translate`` is its ``FetchTranslator``."""
    old = list(graph.outputs)
    new = translate(old)
    merged: Dict[int, object] = {id(a): b for a, b in zip(old, new)}
    graph.outputs = list(new)
    graph.structured_outputs = nest.map_structure(
        lambda t: merged.get(id(t), t), graph.structured_outputs, expand_composites=True)
    rw, syncs = translate.rewrite, translate.sync_ops
    step = rw.selection.step_ops_set
    controls: Dict[ops.Operation, None] = {}
    for op in graph.control_outputs:
        if op in syncs:
            controls.setdefault(syncs[op])
            continue
        for version in (rw.versions(op) if op in step else [op]):
            controls.setdefault(version)
    graph.control_outputs = list(controls)
