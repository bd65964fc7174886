"""Shared-subgraph pruning (TAP Algorithm 1), no TensorFlow.

Op names form a tree by name scope. From the deepest level up, ops are grouped
by their scope prefix at that level; blocks whose operator composition (op
types and counts) is identical are "similar". While a level still has at least
``min_duplicate`` similar blocks, its blocks are recorded and the walk goes one
level up, to larger blocks; the first level without enough repeats ends it
(TAP §IV-B). The result is the repeated blocks of the model (transformer layers,
residual units), each searched once and its plan reused; the pipeline planner
uses them so stage boundaries fall between blocks.
"""
import collections
from typing import Dict, List, Optional, Sequence

__all__ = ["block_labels", "shared_blocks"]


def shared_blocks(names: Sequence[str], op_types: Sequence[str],
                  min_duplicate: int = 2) -> List[Dict[str, List[int]]]:
    """Per level (deepest first), the similar blocks found: scope prefix -> the
    indices of its ops. (Read per name scope, not per op: a model has
    several ops per scope.)"""
    scopes: Dict[str, List[int]] = collections.defaultdict(list)
    for i, name in enumerate(names):
        scopes[name.rpartition("/")[0]].append(i)
    scopes.pop("", None)  # ops at the root are in no block
    parts = [scope.split("/") for scope in scopes]
    kinds = [[op_types[i] for i in members] for members in scopes.values()]
    depth = max(map(len, parts), default=0)
    found = []
    for level in range(depth, 0, -1):
        blocks: Dict[str, List[int]] = collections.defaultdict(list)
        composition: Dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for scope_parts, members, types in zip(parts, scopes.values(), kinds):
            if len(scope_parts) >= level:
                prefix = "/".join(scope_parts[:level])
                blocks[prefix] += members
                composition[prefix].update(types)  # counted in C from a list
        by_composition = collections.defaultdict(list)
        for prefix, count in composition.items():
            by_composition[tuple(sorted(count.items()))].append(prefix)
        similar = max(by_composition.values(), key=len, default=[])
        if len(similar) < min_duplicate:
            break
        found.append({prefix: sorted(blocks[prefix]) for prefix in similar})
    return found


def block_labels(names: Sequence[str], op_types: Sequence[str],
                 min_duplicate: int = 2) -> List[Optional[str]]:
    """Each op's largest repeated block (its scope prefix), or None."""
    levels = shared_blocks(names, op_types, min_duplicate)
    labels: List[Optional[str]] = [None] * len(names)
    if levels:
        for prefix, members in levels[-1].items():
            for i in members:
                labels[i] = prefix
    return labels
