"""Merging a step tensor's per-unit versions back into its global-batch value.

* not derived from the batch (a variable read): unit 0's value;
* carrying the batch rows on some axis (``analysis.batch_axes``: axis 0 for
  the inputs, moved by transposes and einsums): the versions concatenated
  along that axis;
* reduced over the rows in the forward pass (a loss, a count of correct
  predictions, ``tf.shape(x)[0]``): the ops that reduced it are recomputed
  once on the concatenated rows they read (``analysis.batch_reductions``), so
  sums, counts, means and shapes are the single-device values;
* backward tensors (their versions carry the unit's weight or the seed's):
  summed, weighted by n_u / N unless the versions are weighted already.
"""
from typing import List

from tfpar import fallback
from tfpar.analysis.batch_reductions import reduction_region
from tfpar.compat.tf import math_ops, ops, tensor_lib
from tfpar.errors import PlanError
from tfpar.rewriters import graph_edit
from tfpar.rewriters.batch_split import concat_rows

__all__ = ["merge_step_tensor"]

def merge_step_tensor(rw, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
    """The global-batch value of step tensor ``t`` of rewrite ``rw`` (module doc)."""
    sel = rw.selection
    if t.op not in sel.batch_dependent:
        return t
    with ops.name_scope(None), ops.name_scope("tfpar_merge"):
        if rw.batch_axes.holds_rows(t):
            return _rows(rw, t)
        if t.op not in sel.backward and t.op not in rw.seed_weighted:
            region, why = reduction_region(t, sel.batch_dependent, rw.batch_axes.holds_rows,
                                           lambda op: op not in sel.backward, rw.built_inputs)
            if region is not None:
                rows = {x: _rows(rw, x) for x in region.frontier}
                copies = graph_edit.clone_ops(t.graph, region.ops, "recomputed", None, rows,
                                              rw.built_inputs)
                return copies[t.op].outputs[t.value_index]
            _say_merged(t, why)
        return _weighted_sum(rw, t)


def _say_merged(t: tensor_lib.Tensor, why: str) -> None:
    """A forward tensor fetched that cannot be recomputed from the merged
    batch: a float is the versions' average by batch shares, said; another
    dtype has no such average.

    Raises:
      PlanError: ``t`` is not a float.
    """
    if not t.dtype.is_floating:
        raise PlanError(f"tfpar: fetching '{t.name}' ({t.dtype.name}) cannot give its "
                        f"single-device value: it cannot be recomputed from the merged batch "
                        f"because {why}, and replicas' values of a {t.dtype.name} have no "
                        "average; fetch the tensors it is computed from instead")
    fallback.fall_back(f"fetching '{t.name}'", "it is its replicas' and micro-batches' values "
                       f"averaged by their batch shares (it cannot be recomputed from the "
                       f"merged batch because {why})", "Fetch the tensors it is computed from "
                       "to compute it on the whole batch", t.graph)


def _versions(rw, t: tensor_lib.Tensor) -> List[tensor_lib.Tensor]:
    return [rw.version_tensor(t, v) for v in range(len(rw.versions(t.op)))]


def _rows(rw, t: tensor_lib.Tensor) -> tensor_lib.Tensor:
    """Every row of ``t``: its versions concatenated along its batch axis (across
    Horovod processes too); a batch input outside the step already holds them."""
    if t.op not in rw.selection.step_ops_set:
        return t
    axis = rw.batch_axes.axis(t)
    rows = concat_rows(_versions(rw, t), axis)
    if rw.processes is None:
        return rows
    if axis:
        raise PlanError(f"tfpar: fetching '{t.name}' needs its rows from every Horovod process, "
                        f"and they are on axis {axis}; fetch a tensor with the batch first")
    return rw.processes.gather(rows)


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
