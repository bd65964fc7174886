"""Every copy of the step reads a loss's normalizers computed on the whole
batch (``analysis.normalizers``: a mask's sum a loss divides by, Keras'
``size(mask) / reduce_sum(mask)`` weight of each unmasked entry).

Before: each copy divides its rows' sum by its own count, so its tokens weigh
1 / (its count), and replicas weighted by their share of the rows do not add up
to one device's loss (a seq2seq model's first loss already differs).
After: the ops computing the normalizer are copied once, reading the batch
inputs whole (where they read only the shape of what the model computes,
``OnesLike`` of the per-example losses, the shape of the tensor it is
multiplied with stands in), and every copy's readers of it read that copy:
each copy's loss is its rows' part of one device's, and weighs 1.
"""
from typing import Sequence

from tfpar.analysis.normalizers import whole_batch
from tfpar.compat.tf import tensor_lib
from tfpar.errors import PlanError
from tfpar.rewriters import graph_edit
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["read_whole_batch"]


def read_whole_batch(rw: RewriteBuilder, normalizers: Sequence[tensor_lib.Tensor],
                     sharded: bool) -> int:
    """Reroute the step's readers of each of ``normalizers`` to its value on the
    whole batch (module doc); returns the in-place edits of original ops.
    ``sharded``: each worker reads its own rows (``io.shard_dataset``), so no
    worker holds the whole batch.

    Raises:
      PlanError: ``sharded``.
    """
    if normalizers and sharded:
        raise PlanError(f"tfpar: the loss divides or multiplies by '{normalizers[0].name}', a "
                        "reduction over the batch every replica must read computed on the whole "
                        "batch, which no worker reads with io.shard_dataset; turn "
                        "io.shard_dataset off (every worker then reads the global batch)")
    sel = rw.selection
    step = sel.step_ops_set
    edits = 0
    for t in normalizers:
        region, _ = whole_batch(t, set(sel.batch_inputs), sel.batch_dependent, rw.built_inputs,
                                rw.batch_axes.axis)
        copies = graph_edit.clone_ops(
            t.graph, region.ops, "tfpar_whole_batch", rw.placement.device(t.op), {},
            lambda op, region=region: region.inputs_of(op, rw.built_inputs), lambda op: [])
        whole = copies[t.op].outputs[t.value_index]
        for c in list(t.consumers()):
            if c in step:
                edits += graph_edit.reroute(c, t, whole)
    return edits
