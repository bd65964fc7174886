"""Walks of a captured graph: consumers (data and control) built once per
pass, descendants and ancestors. Nothing here mutates."""
import collections
from typing import Dict, Iterable, List, Optional, Set, Tuple

from tfpar.compat.tf import ops

__all__ = ["GraphIndex", "ancestors", "data_ancestors", "post_order"]


class GraphIndex:
    """Consumer indexes of a graph, built once per rewrite pass."""

    def __init__(self, graph: ops.Graph) -> None:
        self.graph = graph
        self.ops: List[ops.Operation] = graph.get_operations()
        self.control_consumers: Dict[ops.Operation, List[ops.Operation]] = (
            collections.defaultdict(list))
        for op in self.ops:
            for dep in op.control_inputs:
                self.control_consumers[dep].append(op)

    def descendants(self, sources: Iterable[ops.Operation],
                    control: bool = False) -> Set[ops.Operation]:
        """Ops reachable from ``sources`` along data edges, and control edges
        too when ``control`` (sources excluded)."""
        seen: Set[ops.Operation] = set()
        stack = list(sources)
        while stack:
            op = stack.pop()
            following = [c for t in op.outputs for c in t.consumers()]
            if control:
                following += self.control_consumers.get(op, [])
            for c in following:
                if c not in seen:
                    seen.add(c)
                    stack.append(c)
        return seen


def ancestors(roots: Iterable[ops.Operation], stop) -> Set[ops.Operation]:
    """Ops ``roots`` depend on (data and control edges), roots included,
    not walking through ops for which ``stop(op)`` is true (they are excluded)."""
    seen: Set[ops.Operation] = set()
    stack = [op for op in roots if not stop(op)]
    seen.update(stack)
    while stack:
        op = stack.pop()
        for dep in list(op.control_inputs) + [t.op for t in op.inputs]:
            if dep not in seen and not stop(dep):
                seen.add(dep)
                stack.append(dep)
    return seen


def data_ancestors(roots: Iterable[ops.Operation], within) -> Set[ops.Operation]:
    """``roots`` and the ops they depend on by data edges only, walking
    through ops for which ``within(op)`` is true (a control edge is a wait,
    not a use: ``ancestors`` follows both)."""
    found: Set[ops.Operation] = set()
    stack = list(roots)
    while stack:
        op = stack.pop()
        if op not in found:
            found.add(op)
            stack.extend(t.op for t in op.inputs if within(t.op))
    return found


def post_order(start: ops.Operation, expand) -> Tuple[Optional[List[ops.Operation]], str]:
    """The ops reached from ``start`` along what ``expand(op)`` names, each
    after those it names (a topological order), without recursion (deep
    models): ``expand(op)`` returns (the ops to visit before it, "") or
    (None, why) to stop the walk, which then returns (None, why)."""
    order: List[ops.Operation] = []
    seen: Set[ops.Operation] = set()
    stack: List[Tuple[ops.Operation, bool]] = [(start, False)]
    while stack:
        op, expanded = stack.pop()
        if expanded:
            order.append(op)
            continue
        if op in seen:
            continue
        seen.add(op)
        before, why = expand(op)
        if before is None:
            return None, why
        stack.append((op, True))
        stack += [(x, False) for x in before if x not in seen]
    return order, ""
