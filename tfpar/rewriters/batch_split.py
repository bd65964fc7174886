"""Split the fed global batch into contiguous per-unit slices.

Unit u of U gets rows ``[N*u//U, N*(u+1)//U)`` of every batch input (uneven N
allowed; a batch of fewer than U rows leaves some units none, as a dataset's
last partial batch may) and weight ``n_u / N``, so weighted sums of per-unit
batch means equal the global batch mean; a unit without rows weighs 0. Units
given integer shares s_u instead get rows ``[N*S_u//S, N*S_(u+1)//S)``, S_u
the shares before u and S their sum (replicas on faster devices take more
rows: Whale §3.3.1), with the same weights.

A SparseTensor input (indices, values, dense shape) holds its rows in
dimension 0 of its dense shape: a slice is ``tf.sparse.slice`` of those rows,
whose indices count rows from the slice's start, as the dense slices do.
"""
import dataclasses
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tfpar.compat.tf import (array_ops, array_ops_stack, check_ops, dtypes, gen_sparse_ops,
                             math_ops, ops, tensor_lib)

__all__ = ["BatchSplit", "concat_rows", "split_batch", "split_sources"]

Sparse = Tuple[tensor_lib.Tensor, tensor_lib.Tensor, tensor_lib.Tensor]


@dataclasses.dataclass
class BatchSplit:
    """``parts[i][u]``: slice u of batch input i; ``weights[u]``: n_u / N (float32);
    ``sizes[u]``: n_u (int32); ``starts[u]``: the first row of slice u (int32);
    ``sparse``: batch input index -> (its SparseTensor, which component)."""

    parts: List[List[tensor_lib.Tensor]]
    weights: List[tensor_lib.Tensor]
    sizes: List[tensor_lib.Tensor]
    starts: List[tensor_lib.Tensor] = dataclasses.field(default_factory=list)
    sparse: Dict[int, Tuple[Sparse, int]] = dataclasses.field(default_factory=dict)
    _joined: Dict[tuple, Sparse] = dataclasses.field(default_factory=dict)

    def rows(self, index: int, pieces: range) -> tensor_lib.Tensor:
        """Batch input ``index`` over the consecutive slices ``pieces``."""
        if index not in self.sparse or len(pieces) == 1:
            return concat_rows([self.parts[index][p] for p in pieces])
        group, component = self.sparse[index]
        key = (id(group[0]), pieces.start, pieces.stop)
        if key not in self._joined:
            sizes = [self.sizes[p] for p in pieces]
            self._joined[key] = sparse_rows(group, self.starts[pieces.start], math_ops.add_n(sizes))
        return self._joined[key][component]


def concat_rows(parts: List[tensor_lib.Tensor], axis: int = 0) -> tensor_lib.Tensor:
    """``parts`` joined along their batch ``axis``."""
    return parts[0] if len(parts) == 1 else array_ops.concat(parts, axis)


def sparse_rows(group: Sparse, start: tensor_lib.Tensor, size: tensor_lib.Tensor) -> Sparse:
    """Rows ``[start, start + size)`` of the SparseTensor ``group`` (int32 bounds)."""
    indices, values, shape = group
    rest = shape[1:]
    begin = array_ops.concat([math_ops.cast(start, dtypes.int64)[None], array_ops.zeros_like(rest)], 0)
    extent = array_ops.concat([math_ops.cast(size, dtypes.int64)[None], rest], 0)
    return tuple(gen_sparse_ops.sparse_slice(indices, values, shape, begin, extent))


def split_batch(inputs: Sequence[tensor_lib.Tensor], num_units: int,
                share: Tuple[int, int] = (0, 1),
                global_rows: Optional[Callable[[tensor_lib.Tensor], tensor_lib.Tensor]] = None,
                sparse: Sequence[Sparse] = (), shares: Sequence[int] = ()) -> BatchSplit:
    """Slice every tensor of ``inputs`` along dimension 0 into ``num_units`` parts
    (in proportion to ``shares``, one int per unit, if given: one process
    only); those that are components of a SparseTensor of ``sparse`` by its rows.

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
        owner = {t: (group, k) for group in sparse for k, t in enumerate(group)}
        dense = [t for t in inputs if t not in owner]
        n = _rows(dense, [group[2] for group in sparse], 1)
        first = process * num_units
        bounds = ([(n * u) // total for u in range(first, first + num_units + 1)] if not shares
                  else _share_bounds(n, shares))
        sizes = [bounds[u + 1] - bounds[u] for u in range(num_units)]
        rows = math_ops.cast(n, dtypes.float32)
        if global_rows is not None:
            rows = global_rows(rows)
        mine = [t if processes == 1 else t[bounds[0]:bounds[-1]] for t in dense]
        cut = _cut(mine, sizes, rows)
        pieces = {id(group[0]): [sparse_rows(group, bounds[u], sizes[u]) for u in range(num_units)]
                  for group in sparse}
        dense_parts = iter(cut.parts)
        cut.parts = [next(dense_parts) if t not in owner else
                     [piece[owner[t][1]] for piece in pieces[id(owner[t][0][0])]] for t in inputs]
        cut.starts = bounds[:-1]
        cut.sparse = {i: owner[t] for i, t in enumerate(inputs) if t in owner}
        return cut


def _share_bounds(n: tensor_lib.Tensor, shares: Sequence[int]) -> List[tensor_lib.Tensor]:
    """Row bounds ``N*S_u//S`` of units with integer ``shares`` (int64 products)."""
    rows = math_ops.cast(n, dtypes.int64)
    before = [sum(shares[:u]) for u in range(len(shares) + 1)]
    return [math_ops.cast(rows * b // before[-1], dtypes.int32) for b in before]


def split_sources(sources: Sequence[Sequence[tensor_lib.Tensor]], num_units: int) -> BatchSplit:
    """Like ``split_batch`` for one batch per source (each worker reading its own
    shard of the data): ``sources[w][i]`` is input i of source w; each source is
    cut into ``num_units / len(sources)`` consecutive parts, and weights are
    shares of all sources' rows together."""
    per_source = num_units // len(sources)
    with ops.name_scope("tfpar_split"):
        counts = [_rows(inputs, (), per_source) for inputs in sources]
        rows = math_ops.cast(math_ops.add_n(counts), dtypes.float32)
        cuts = [_cut(inputs, [(n * (u + 1)) // per_source - (n * u) // per_source
                              for u in range(per_source)], rows)
                for inputs, n in zip(sources, counts)]
    return BatchSplit(parts=[[p for cut in cuts for p in cut.parts[i]]
                             for i in range(len(sources[0]))],
                      weights=[w for cut in cuts for w in cut.weights],
                      sizes=[s for cut in cuts for s in cut.sizes])


def _rows(inputs: Sequence[tensor_lib.Tensor], sparse_shapes: Sequence[tensor_lib.Tensor],
          minimum: int) -> tensor_lib.Tensor:
    """Rows of the batch (int32), checked at run time: at least ``minimum``,
    the same in every input (dimension 0 of ``inputs`` and of the dense shapes
    ``sparse_shapes`` of SparseTensor inputs)."""
    counts = [(t.name, array_ops.shape(t, out_type=dtypes.int32)[0]) for t in inputs]
    counts += [(f"the SparseTensor of dense shape {s.name}", math_ops.cast(s[0], dtypes.int32))
               for s in sparse_shapes]
    (first, n), rest = counts[0], counts[1:]
    fewer = ("no rows" if minimum == 1 else
             f"fewer rows than the {minimum} replicas x micro-batches of each worker")
    checks = [check_ops.assert_greater_equal(
        n, minimum, message=f"tfpar: the global batch of {first} has {fewer}")]
    for name, count in rest:
        checks.append(check_ops.assert_equal(
            count, n, message=f"tfpar: batch inputs {first} and {name} differ in "
                              "dimension 0; every rank>=1 feed or iterator output consumed by "
                              "a replicated TaskGraph is split as a batch"))
    with ops.control_dependencies(checks):
        return array_ops.identity(n)


def _cut(inputs: Sequence[tensor_lib.Tensor], sizes, rows: tensor_lib.Tensor) -> BatchSplit:
    weights = [math_ops.cast(s, dtypes.float32) / rows for s in sizes]
    size_vec = array_ops_stack.stack(sizes)
    parts = [array_ops.split(t, size_vec, num=len(sizes), axis=0) for t in inputs]
    return BatchSplit(parts=parts, weights=weights, sizes=sizes)
