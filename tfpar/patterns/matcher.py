"""The matcher (Whale §3.2.2): pick a sharding pattern per ShardingUnit.

Units arrive in topological order (the order the model builds them). Of the
patterns that match a unit's kind and input ShardingInfo, the one with the
smallest communication cost is chosen, unless ``split.patterns`` forces one
by unit name (Whale §5.1.4 forces SP1 / SP2 this way).
"""
from typing import Sequence

from tfpar.errors import ShardingError
from tfpar.ir.sharding import ShardingUnit

__all__ = ["Gather", "choose"]


class Gather:
    """The fallback pattern of every unit: gather the split inputs (Whale's split
    bridge) and run TensorFlow's own op; costs 4 bytes per gathered element of
    a row, ``unit.sizes[size_key]`` of them."""

    name = "gather"

    def __init__(self, size_key: str) -> None:
        self._size_key = size_key

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return True

    def cost(self, unit: ShardingUnit) -> float:
        return 4.0 * unit.sizes[self._size_key]


def choose(ctx, unit: ShardingUnit, candidates: Sequence):
    """The pattern for ``unit`` among ``candidates`` (objects with ``name``,
    ``matches(unit)`` and ``cost(unit)`` in bytes per row); the choice is
    recorded in ``ctx.decisions``."""
    matching = [p for p in candidates if p.matches(unit)]
    forced = ctx.forced_pattern(unit.name)
    if forced is not None:
        chosen = [p for p in matching if p.name == forced]
        if not chosen:
            source = "split.patterns" if unit.name in ctx.forced else "the pinned plan"
            raise ShardingError(
                f"{source} forces '{forced}' on ShardingUnit '{unit.name}' "
                f"({unit.kind}, inputs {', '.join(map(str, unit.inputs))}); patterns that "
                f"match it: {', '.join(p.name for p in matching) or 'none'}")
        pattern = chosen[0]
    else:
        pattern = min(matching, key=lambda p: p.cost(unit))
    ctx.decisions[unit.name] = pattern.name
    return pattern
