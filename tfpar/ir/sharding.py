"""ShardingInfo and ShardingUnit (Whale §3.2.2): plain data, no TensorFlow.

A ShardingInfo lists, per tensor dimension, whether the tensor is split across
the devices of a split TaskGraph (1) or not (0): ``[0, 1]`` is a matrix split by
columns. A ShardingUnit is one hooked API call (a dense layer, a matmul, an
embedding lookup, a softmax cross-entropy...) with the ShardingInfo of each
input; a sharding pattern maps it to a distributed implementation.
"""
import dataclasses
from typing import Any, Dict, Optional, Tuple

__all__ = ["ShardingInfo", "ShardingUnit"]


@dataclasses.dataclass(frozen=True)
class ShardingInfo:
    """Per dimension: 1 if split across the TaskGraph's devices."""

    dims: Tuple[int, ...]

    @classmethod
    def full(cls, rank: int) -> "ShardingInfo":
        return cls((0,) * rank)

    @classmethod
    def split(cls, rank: int, axis: int) -> "ShardingInfo":
        axis = axis % rank
        return cls(tuple(int(i == axis) for i in range(rank)))

    @property
    def axis(self) -> Optional[int]:
        """The split dimension (None when not split)."""
        return self.dims.index(1) if 1 in self.dims else None

    def __str__(self) -> str:
        return "[" + ",".join(map(str, self.dims)) + "]"


@dataclasses.dataclass(frozen=True)
class ShardingUnit:
    """One hooked API call inside a split scope.

    Attributes:
      name: unique name (the layer or op name), used to force a pattern.
      kind: ``"dense"``, ``"matmul"``, ``"embedding"``, ``"softmax_xent"``,
        ``"argmax"``.
      inputs: ShardingInfo of each input.
      sizes: sizes the cost model needs (``in``, ``out``, ``classes``...), per row.
    """

    name: str
    kind: str
    inputs: Tuple[ShardingInfo, ...]
    sizes: Dict[str, Any] = dataclasses.field(default_factory=dict)
