"""Graphs that train but were built before ``wh.init``: tfpar did not see
them being built, and runs them unchanged, saying so once per graph."""
import weakref
from typing import Optional

from tfpar import fallback
from tfpar.compat.tf import ops
from tfpar.hooks.capture import existing_capture

__all__ = ["built_before_init_message", "unseen_training", "warn_unseen_training"]

# Graphs already checked for training built before wh.init (warned once each).
_warned_unseen: "weakref.WeakSet[ops.Graph]" = weakref.WeakSet()
_UPDATE_PREFIXES = ("Apply", "ResourceApply", "SparseApply", "ResourceSparseApply")


def unseen_training(graph: ops.Graph) -> Optional[str]:
    """The name of an optimizer update op of ``graph`` that tfpar did not see
    being built (the model was built before ``wh.init``), or None."""
    capture = existing_capture(graph)
    if capture is not None and capture.apply_calls:
        return None
    return next((op.name for op in graph.get_operations()
                 if op.type.startswith(_UPDATE_PREFIXES)), None)


def built_before_init_message(op_name: str) -> str:
    return (f"tfpar: this graph trains ('{op_name}') but was built before wh.init(): tfpar "
            "did not see it being built and cannot parallelise it; it runs unchanged. Call "
            "wh.init() before building the model")


def warn_unseen_training(graph: ops.Graph) -> None:
    """Say, once per graph, that it trains unchanged if tfpar did not see its
    training being built."""
    if graph in _warned_unseen:
        return
    _warned_unseen.add(graph)
    unseen = unseen_training(graph)
    if unseen is not None:
        fallback.fall_back(f"data parallelism for this graph's training ('{unseen}')",
                           "it was built before wh.init(), so tfpar did not see it being "
                           "built and runs it unchanged", "Call wh.init() before building "
                           "the model", graph)
