"""Bridge layers (Whale §3.2.3, Fig. 7): what a version of one stage reads from
the batch or from another stage that spreads the rows differently.

Every version holds its pieces of the batch (``layout.Layout``). A consumer
version reads a batch-major tensor of another stage as its own pieces: producer
versions it needs whole pass as they are, several are concatenated (gather), and
a producer spanning several consumers is split into their parts on its own
device (partition), so each consumer receives only its rows. Gather followed by
partition along the same (batch) dimension is thereby fused: no tensor is
gathered only to be cut again. Stages of equal width read version to version.
"""
from typing import Callable, Dict, List, Optional

from tfpar.compat.tf import array_ops, array_ops_stack, math_ops, ops, tensor_lib
from tfpar.errors import PlanError
from tfpar.rewriters.batch_split import BatchSplit, concat_rows
from tfpar.rewriters.layout import Layout
from tfpar.analysis.stages import Placement

__all__ = ["Bridges"]


class Bridges:
    """Builds (and caches) the tensors versions read across stages and batch pieces.

    Args:
      layout: the rows of every version.
      placement: stage devices and op stages.
      split: the batch pieces (``batch_split.split_batch`` with
        ``layout.num_pieces`` parts).
      version_tensor: (step tensor, version) -> that version's tensor.
      batch_dependent: ops whose values depend on the batch.
      batch_axis: tensor -> the axis carrying its rows, or None
        (``analysis.batch_axes``).
    """

    def __init__(self, layout: Layout, placement: Placement, split: BatchSplit,
                 version_tensor: Callable[[tensor_lib.Tensor, int], tensor_lib.Tensor],
                 batch_dependent, batch_axis: Callable[[tensor_lib.Tensor], Optional[int]]
                 ) -> None:
        self._layout = layout
        self._placement = placement
        self._split = split
        self._version_tensor = version_tensor
        self._batch_dependent = batch_dependent
        self._batch_axis = batch_axis
        self._cache: Dict[tuple, tensor_lib.Tensor] = {}
        # (tensor, stage) -> the key of what made it for that stage
        self._made: Dict[tuple, tuple] = {}

    def device(self, stage: int, version: int) -> str:
        return self._placement.stage_devices[stage][self._layout.slot(stage, version)[0]]

    def batch_input(self, index: int, stage: int, version: int) -> tensor_lib.Tensor:
        """Batch input ``index`` as version ``version`` of ``stage`` reads it."""
        key = ("batch", index, stage, version)
        if key not in self._cache:
            with ops.device(self.device(stage, version)):
                self._cache[key] = self._split.rows(index, self._layout.pieces(stage, version))
        return self._remember(key, stage)

    def weight(self, stage: int, version: int) -> tensor_lib.Tensor:
        """Share of the global batch a version computes (float32)."""
        key = ("weight", stage, version)
        if key not in self._cache:
            terms = [self._split.weights[p] for p in self._layout.pieces(stage, version)]
            self._cache[key] = terms[0] if len(terms) == 1 else math_ops.add_n(terms)
        return self._remember(key, stage)

    def tensor(self, t: tensor_lib.Tensor, stage: int, version: int) -> tensor_lib.Tensor:
        """What version ``version`` of ``stage`` reads for ``t``, an output of an
        op of another stage."""
        producer = self._placement.stage(t.op)
        layout = self._layout
        if layout.widths[producer] == layout.widths[stage]:
            return self._output(t, version)
        unit = layout.unit(stage, version)
        sources = layout.unit_versions(producer, unit)
        if t.op not in self._batch_dependent:
            return self._output(t, sources[0])
        axis = self._rows_axis(t, producer, stage)
        key = ("bridge", t, stage, version)
        if key not in self._cache:
            wanted = layout.pieces(stage, version)
            parts = [self._partition(t, source, stage, axis)[version] for source in sources
                     if _overlap(layout.pieces(producer, source), wanted)]
            with ops.device(self.device(stage, version)):
                self._cache[key] = concat_rows(parts, axis)
        return self._remember(key, stage)

    def _output(self, t: tensor_lib.Tensor, version: int) -> tensor_lib.Tensor:
        return self._version_tensor(t, version)

    def counterpart(self, x: tensor_lib.Tensor, stage: int, version: int
                    ) -> Optional[tensor_lib.Tensor]:
        """What version ``version`` of ``stage`` reads where version 0 reads
        ``x``, if ``x`` is a batch input, weight or bridge made for stage
        ``stage``; else None."""
        key = self._made.get((x, stage))
        if key is None:
            return None
        if key[0] == "batch":
            return self.batch_input(key[1], stage, version)
        if key[0] == "weight":
            return self.weight(stage, version)
        return self.tensor(key[1], stage, version)

    def _remember(self, key: tuple, stage: int) -> tensor_lib.Tensor:
        self._made.setdefault((self._cache[key], stage), key)
        return self._cache[key]

    def _partition(self, t: tensor_lib.Tensor, source: int, stage: int,
                   axis: int) -> Dict[int, tensor_lib.Tensor]:
        """Version ``source`` of ``t`` cut along its batch ``axis`` into the rows
        each version of ``stage`` needs from it, keyed by that version (uncut
        for just one)."""
        key = ("partition", t, source, stage)
        if key not in self._cache:
            producer = self._placement.stage(t.op)
            have = self._layout.pieces(producer, source)
            chunks = {}
            for consumer in self._layout.unit_versions(stage, self._layout.unit(producer, source)):
                common = _overlap(have, self._layout.pieces(stage, consumer))
                if common:
                    chunks[consumer] = common
            value = self._output(t, source)
            if len(chunks) == 1:
                self._cache[key] = {consumer: value for consumer in chunks}
            else:
                sizes = [_total([self._split.sizes[p] for p in rows]) for rows in chunks.values()]
                with ops.device(self.device(producer, source)):
                    cut = array_ops.split(value, array_ops_stack.stack(sizes), num=len(sizes),
                                          axis=axis)
                self._cache[key] = dict(zip(chunks, cut))
        return self._cache[key]

    def _rows_axis(self, t: tensor_lib.Tensor, producer: int, consumer: int) -> int:
        """The axis of ``t`` carrying its rows, along which a bridge regroups them."""
        axis = self._batch_axis(t)
        if axis is None:
            names = self._placement.task_graph_names
            raise PlanError(
                f"tfpar: '{t.name}' ({t.op.type}, shape {t.shape}) depends on the batch and "
                f"flows between TaskGraphs '{names[producer]}' ({self._layout.widths[producer]} "
                f"replicas) and '{names[consumer]}' ({self._layout.widths[consumer]}), but tfpar "
                "cannot tell which of its axes holds the batch rows (it was reduced over the "
                "batch, or made by an op tfpar does not follow). Move the op that makes it into "
                "the TaskGraph that reads it, or give the tensor a leading batch dimension")
        return axis


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


def _total(sizes: List[tensor_lib.Tensor]) -> tensor_lib.Tensor:
    return sizes[0] if len(sizes) == 1 else math_ops.add_n(sizes)
