"""Merging a tensor's per-unit versions back into its global-batch value."""
from typing import List, Optional, Set

from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, math_ops

__all__ = ["is_batch_major", "merge_units"]


def merge_units(t: tensor_lib.Tensor, versions: List[tensor_lib.Tensor], weights: List[tensor_lib.Tensor],
                batch_dependent: Set[ops.Operation], static_batch: Optional[int],
                weighted: bool = False) -> tensor_lib.Tensor:
    """Merge ``versions`` (one per unit, in batch order) of step tensor ``t``.

    * not derived from the batch (a variable read): unit 0's value;
    * rank >= 1 with dimension 0 unknown at build time or equal to the static
      global batch ``static_batch``: concatenated along dimension 0;
    * float, otherwise (batch means, per-class means): weighted by n_u / N, or
      summed when ``weighted`` (the versions already carry their weights);
    * other dtypes: unit 0's value.
    """
    if t.op not in batch_dependent:
        return versions[0]
    with ops.name_scope("tfpar_merge"):
        if is_batch_major(t, static_batch):
            return array_ops.concat(versions, 0)
        if t.dtype.is_floating and weighted:
            return math_ops.add_n(versions)
        if t.dtype.is_floating:
            return math_ops.add_n([v * math_ops.cast(w, t.dtype)
                                   for v, w in zip(versions, weights)])
        return versions[0]


def is_batch_major(t: tensor_lib.Tensor, static_batch: Optional[int]) -> bool:
    shape = t.shape
    return (shape.rank is not None and shape.rank >= 1
            and (shape[0] is None or shape[0] == static_batch))
