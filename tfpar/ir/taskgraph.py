"""TaskGraph and Phase: plain data describing how captured ops are grouped."""
import dataclasses
import enum
from typing import Optional

__all__ = ["Phase", "Strategy", "TaskGraphSpec"]


class Phase(str, enum.Enum):
    """Training phase an op was created in (Whale §3.1)."""

    FORWARD = "forward"
    BACKWARD = "backward"
    APPLY = "apply"


class Strategy(str, enum.Enum):
    """Parallel primitive of a TaskGraph (Whale §2.1)."""

    REPLICATE = "replicate"
    SPLIT = "split"


@dataclasses.dataclass(frozen=True)
class TaskGraphSpec:
    """One annotated scope: what the user asked for, before devices are known.

    Attributes:
      index: creation order of the scope in the graph (0-based).
      name: user-given or generated name (``"replicate_0"``).
      strategy: ``Strategy.REPLICATE`` or ``Strategy.SPLIT``.
      device_count: devices requested; ``None`` means all devices.
      implicit: True for the whole-model TaskGraph tfpar makes when the user
        wrote no scope at all.
    """

    index: int
    name: str
    strategy: Strategy
    device_count: Optional[int]
    implicit: bool = False
