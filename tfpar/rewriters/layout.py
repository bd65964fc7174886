"""Index arithmetic of a rewritten step: which rows each copy of a stage computes.

R pipeline replicas x M micro-batches make R*M units (unit u = r*M + m, in batch
order). Stage s runs ``width[s]`` sub-replicas per pipeline replica (a stage
replicated wider than its neighbours, joined to them by bridge layers, Whale
§3.2.3), so it has R*M*width[s] versions: version v = u*width[s] + k, on stage
device j = r*width[s] + k. The global batch is cut into R*M*L pieces, L the
least common multiple of the widths: version v of stage s reads pieces
``pieces(s, v)``. Version 0 of every stage is the original ops, unless every
version is a call of the stage's task functions (``task_functions``).
"""
import dataclasses
import math
from typing import Sequence, Tuple

__all__ = ["Layout"]


@dataclasses.dataclass(frozen=True)
class Layout:
    """Attributes: num_replicas (R), num_micro_batch (M), widths (per stage)."""

    num_replicas: int
    num_micro_batch: int
    widths: Sequence[int]

    @property
    def pieces_per_unit(self) -> int:
        return math.lcm(*self.widths)

    @property
    def num_units(self) -> int:
        return self.num_replicas * self.num_micro_batch

    @property
    def num_pieces(self) -> int:
        return self.num_units * self.pieces_per_unit

    def num_versions(self, stage: int) -> int:
        return self.num_units * self.widths[stage]

    def slot(self, stage: int, version: int) -> Tuple[int, int]:
        """(stage device index j, micro-batch m) of a version."""
        width = self.widths[stage]
        unit, k = divmod(version, width)
        r, m = divmod(unit, self.num_micro_batch)
        return r * width + k, m

    def version(self, stage: int, device: int, micro_batch: int) -> int:
        width = self.widths[stage]
        r, k = divmod(device, width)
        return (r * self.num_micro_batch + micro_batch) * width + k

    def unit(self, stage: int, version: int) -> int:
        return version // self.widths[stage]

    def pieces(self, stage: int, version: int) -> range:
        """Batch pieces version ``version`` of ``stage`` computes."""
        per_version = self.pieces_per_unit // self.widths[stage]
        start = self.unit(stage, version) * self.pieces_per_unit + (
            version % self.widths[stage]) * per_version
        return range(start, start + per_version)

    def unit_versions(self, stage: int, unit: int) -> range:
        """The versions of ``stage`` that together compute ``unit``."""
        width = self.widths[stage]
        return range(unit * width, (unit + 1) * width)

    def peer(self, device: int, stage: int, other: int) -> int:
        """The device of stage ``other`` standing for device ``device`` of
        ``stage``: the same one when the widths agree, else the first device of
        the same pipeline replica (for values every device holds alike)."""
        if self.widths[stage] == self.widths[other]:
            return device
        return device // self.widths[stage] * self.widths[other]
