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
    indices of its ops."""
    depth = max((name.count("/") for name in names), default=0)
    found = []
    for level in range(depth, 0, -1):
        blocks: Dict[str, List[int]] = collections.defaultdict(list)
        for i, name in enumerate(names):
            parts = name.split("/")
            if len(parts) > level:
                blocks["/".join(parts[:level])].append(i)
        by_composition = collections.defaultdict(list)
        for prefix, members in blocks.items():
            composition = tuple(sorted(collections.Counter(op_types[i] for i in members).items()))
            by_composition[composition].append(prefix)
        similar = max(by_composition.values(), key=len, default=[])
        if len(similar) < min_duplicate:
            break
        found.append({prefix: blocks[prefix] for prefix in similar})
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
