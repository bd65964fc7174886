"""Split the fed global batch into contiguous per-unit slices.

Unit u of U gets rows ``[N*u//U, N*(u+1)//U)`` of every batch input (uneven N
allowed; a batch of fewer than U rows leaves some units none, as a dataset's
last partial batch may) and weight ``n_u / N``, so weighted sums of per-unit
batch means equal the global batch mean; a unit without rows weighs 0.
"""
import dataclasses
from typing import Callable, List, Optional, Sequence, Tuple

from tensorflow.python.framework import dtypes, ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, array_ops_stack, check_ops, math_ops

__all__ = ["BatchSplit", "split_batch", "split_sources"]


@dataclasses.dataclass
class BatchSplit:
    """``parts[i][u]``: slice u of batch input i; ``weights[u]``: n_u / N (float32);
    ``sizes[u]``: n_u (int32)."""

    parts: List[List[tensor_lib.Tensor]]
    weights: List[tensor_lib.Tensor]
    sizes: List[tensor_lib.Tensor]


def split_batch(inputs: Sequence[tensor_lib.Tensor], num_units: int,
                share: Tuple[int, int] = (0, 1),
                global_rows: Optional[Callable[[tensor_lib.Tensor], tensor_lib.Tensor]] = None
                ) -> BatchSplit:
    """Slice every tensor of ``inputs`` along dimension 0 into ``num_units`` parts.

    With ``share`` = (process p, processes P) (a Horovod job, where every
    process is fed the global batch), the batch is cut into P * ``num_units``
    parts and this process keeps parts p*U .. (p+1)*U-1; weights stay shares of
    the global batch. ``global_rows`` instead maps this process's row count
    (float32) to the global batch's when every process reads its own part of
    the data (``io.shard_dataset``).

    Raises at run time (InvalidArgumentError naming the tensors) when the
    inputs disagree on the batch size or the batch is empty.
    """
    with ops.name_scope("tfpar_split"):
        process, processes = share
        total = num_units * processes
        n = _rows(inputs, 1)
        first = process * num_units
        bounds = [(n * u) // total for u in range(first, first + num_units + 1)]
        sizes = [bounds[u + 1] - bounds[u] for u in range(num_units)]
        rows = math_ops.cast(n, dtypes.float32)
        if global_rows is not None:
            rows = global_rows(rows)
        mine = [t if processes == 1 else t[bounds[0]:bounds[-1]] for t in inputs]
        return _cut(mine, sizes, rows)


def split_sources(sources: Sequence[Sequence[tensor_lib.Tensor]], num_units: int) -> BatchSplit:
    """Like ``split_batch`` for one batch per source (each worker reading its own
    shard of the data): ``sources[w][i]`` is input i of source w; each source is
    cut into ``num_units / len(sources)`` consecutive parts, and weights are
    shares of all sources' rows together."""
    per_source = num_units // len(sources)
    with ops.name_scope("tfpar_split"):
        counts = [_rows(inputs, per_source) for inputs in sources]
        rows = math_ops.cast(math_ops.add_n(counts), dtypes.float32)
        cuts = [_cut(inputs, [(n * (u + 1)) // per_source - (n * u) // per_source
                              for u in range(per_source)], rows)
                for inputs, n in zip(sources, counts)]
    return BatchSplit(parts=[[p for cut in cuts for p in cut.parts[i]]
                             for i in range(len(sources[0]))],
                      weights=[w for cut in cuts for w in cut.weights],
                      sizes=[s for cut in cuts for s in cut.sizes])


def _rows(inputs: Sequence[tensor_lib.Tensor], minimum: int) -> tensor_lib.Tensor:
    """Rows of the batch (int32), checked at run time: at least ``minimum``,
    the same in every input."""
    n = array_ops.shape(inputs[0], out_type=dtypes.int32)[0]
    fewer = ("no rows" if minimum == 1 else
             f"fewer rows than the {minimum} replicas x micro-batches of each worker")
    checks = [check_ops.assert_greater_equal(
        n, minimum, message=f"tfpar: the global batch of {inputs[0].name} has {fewer}")]
    for t in inputs[1:]:
        checks.append(check_ops.assert_equal(
            array_ops.shape(t, out_type=dtypes.int32)[0], n,
            message=f"tfpar: batch inputs {inputs[0].name} and {t.name} differ in "
                    "dimension 0; every rank>=1 feed or iterator output consumed by a "
                    "replicated TaskGraph is split as a batch"))
    with ops.control_dependencies(checks):
        return array_ops.identity(n)


def _cut(inputs: Sequence[tensor_lib.Tensor], sizes, rows: tensor_lib.Tensor) -> BatchSplit:
    weights = [math_ops.cast(s, dtypes.float32) / rows for s in sizes]
    size_vec = array_ops_stack.stack(sizes)
    parts = [array_ops.split(t, size_vec, num=len(sizes), axis=0) for t in inputs]
    return BatchSplit(parts=parts, weights=weights, sizes=sizes)
