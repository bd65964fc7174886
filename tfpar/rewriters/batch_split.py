"""Split the fed global batch into contiguous per-unit slices.

Unit u of U gets rows ``[N*u//U, N*(u+1)//U)`` of every batch input (uneven N
allowed) and weight ``n_u / N``, so weighted sums of per-unit batch means equal
the global batch mean.
"""
import dataclasses
from typing import List, Sequence

from tensorflow.python.framework import dtypes, ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, array_ops_stack, check_ops, math_ops

__all__ = ["BatchSplit", "split_batch"]


@dataclasses.dataclass
class BatchSplit:
    """``parts[i][u]``: slice u of batch input i; ``weights[u]``: n_u / N (float32);
    ``sizes[u]``: n_u (int32)."""

    parts: List[List[tensor_lib.Tensor]]
    weights: List[tensor_lib.Tensor]
    sizes: List[tensor_lib.Tensor]


def split_batch(inputs: Sequence[tensor_lib.Tensor], num_units: int) -> BatchSplit:
    """Slice every tensor of ``inputs`` along dimension 0 into ``num_units`` parts.

    Raises at run time (InvalidArgumentError naming the tensors) when the
    inputs disagree on the batch size or the batch is smaller than the units.
    """
    with ops.name_scope("tfpar_split"):
        n = array_ops.shape(inputs[0], out_type=dtypes.int32)[0]
        checks = [check_ops.assert_greater_equal(
            n, num_units, message=f"tfpar: the global batch of {inputs[0].name} has fewer "
                                  f"rows than the {num_units} replicas x micro-batches")]
        for t in inputs[1:]:
            checks.append(check_ops.assert_equal(
                array_ops.shape(t, out_type=dtypes.int32)[0], n,
                message=f"tfpar: batch inputs {inputs[0].name} and {t.name} differ in "
                        "dimension 0; every rank>=1 feed or iterator output consumed by a "
                        "replicated TaskGraph is split as a batch"))
        with ops.control_dependencies(checks):
            n = array_ops.identity(n)
        bounds = [(n * u) // num_units for u in range(num_units + 1)]
        sizes = [bounds[u + 1] - bounds[u] for u in range(num_units)]
        nf = math_ops.cast(n, dtypes.float32)
        weights = [math_ops.cast(s, dtypes.float32) / nf for s in sizes]
        size_vec = array_ops_stack.stack(sizes)
        parts = [array_ops.split(t, size_vec, num=num_units, axis=0) for t in inputs]
    return BatchSplit(parts=parts, weights=weights, sizes=sizes)
