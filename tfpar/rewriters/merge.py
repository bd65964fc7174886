"""Merging a step tensor's per-unit versions back into its global-batch value.

* not derived from the batch (a variable read): unit 0's value;
* batch-major (one row per example: dimension 0 unknown at build time or equal
  to the static global batch): the versions concatenated along dimension 0;
* reduced over the rows in the forward pass (a loss, a count of correct
  predictions, ``tf.shape(x)[0]``): the ops that reduced it are recomputed
  once on the concatenated rows they read (``analysis.batch_reductions``), so
  sums, counts, means and shapes are the single-device values;
* backward tensors (their versions carry the unit's weight or the seed's):
  summed, weighted by n_u / N unless the versions are weighted already.
"""
import logging
from typing import List, Optional

from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, math_ops

from tfpar.analysis.batch_reductions import reduction_region
from tfpar.rewriters import graph_edit

__all__ = ["is_batch_major", "merge_step_tensor"]

log = logging.getLogger("tfpar")


def merge_step_tensor(rw, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
    """The global-batch value of step tensor ``t`` of rewrite ``rw`` (module doc)."""
    sel = rw.selection
    if t.op not in sel.batch_dependent:
        return t
    with ops.name_scope(None), ops.name_scope("tfpar_merge"):
        if _is_rows(rw, t):
            return _rows(rw, t)
        if t.op not in sel.backward and t.op not in rw.seed_weighted:
            inputs_of = lambda op: rw.original_inputs.get(op, op.inputs)  # noqa: E731
            region, why = reduction_region(t, sel.batch_dependent, lambda x: _is_rows(rw, x),
                                           lambda op: op not in sel.backward, inputs_of)
            if region is not None:
                rows = {x: _rows(rw, x) for x in region.frontier}
                copies = graph_edit.clone_ops(t.graph, region.ops, "recomputed", None, rows,
                                              inputs_of)
                return copies[t.op].outputs[t.value_index]
            log.warning("tfpar: fetching '%s' merges its per-replica values by their batch "
                        "shares: it cannot be recomputed from the merged batch because %s",
                        t.name, why)
        return _weighted_sum(rw, t)


def _is_rows(rw, t: tensor_lib.Tensor) -> bool:
    return is_batch_major(t, rw.selection.batch_inputs[0].shape[0])


def _versions(rw, t: tensor_lib.Tensor) -> List[tensor_lib.Tensor]:
    return [op.outputs[t.value_index] for op in rw.versions(t.op)]


def _rows(rw, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
    """Every row of batch-major ``t``: its versions concatenated (across Horovod
    processes too); a batch input outside the step already holds them all."""
    if t.op not in rw.selection.step_ops_set:
        return t
    rows = array_ops.concat(_versions(rw, t), 0)
    return rw.processes.gather(rows) if rw.processes is not None else rows


def _weighted_sum(rw, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
    """Versions summed, weighted by n_u / N unless weighted already; other
    dtypes: unit 0's value."""
    versions = _versions(rw, t)
    if not t.dtype.is_floating:
        return versions[0]
    stage = rw.placement.stage(t.op)
    if t.op not in rw.seed_weighted:
        versions = [v * math_ops.cast(rw.bridges.weight(stage, i), t.dtype)
                    for i, v in enumerate(versions)]
    merged = math_ops.add_n(versions)
    return rw.processes.sum(merged) if rw.processes is not None else merged


def is_batch_major(t: tensor_lib.Tensor, static_batch: Optional[int]) -> bool:
    shape = t.shape
    return (shape.rank is not None and shape.rank >= 1
            and (shape[0] is None or shape[0] == static_batch))
