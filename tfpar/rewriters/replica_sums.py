"""Sums over the replicas of a micro-batch, marked by the script's graph
(``hooks.sync_batch_norm.replica_sum``: synchronized batch norm's statistics
and their gradients): every version's marked identity reads the sum, over the
versions computing the same micro-batch on the stage's devices, of what those
versions' marks read (the gradients' reducer: a sum on one device, or an
all-reduce across mirrored devices and processes).

Versions are copies here (``data_parallel``): a sum between the calls of one
task function would have to be inside its body. Built in graph order, so the
forward marks' collectives come before the backward ones' on every device.
"""
from typing import List

from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.ir.recorded import Recorded
from tfpar.rewriters import graph_edit
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["marked_sums", "sum_across_replicas"]


def marked_sums(rw: RewriteBuilder, recorded: Recorded) -> List[ops.Operation]:
    """The step's marked identities, in graph order.

    Raises:
      PlanError: marks with several micro-batches (a micro-batch's statistics
        cannot wait for the later ones', and one device's numbers are out of
        reach: batch statistics are a micro-batch's then).
    """
    marks = [op for op in rw.selection.step_ops if op.name in recorded.replica_sums]
    if marks and rw.num_micro_batch > 1:
        raise PlanError(
            f"tfpar: batch statistics synchronized over replicas ('{marks[0].name}': "
            "batch_norm.sync, or BatchNormalization(synchronized=True)) need "
            f"pipeline.num_micro_batch 1, not {rw.num_micro_batch}: each micro-batch would "
            "normalize with its own statistics anyway. Use one micro-batch, or unsynchronized "
            "batch norm")
    return marks


def sum_across_replicas(rw: RewriteBuilder, marks: List[ops.Operation], reducer_for) -> int:
    """Every version of every mark in ``marks`` reads the sum over its
    micro-batch's versions (module docstring); returns the in-place edits of
    original ops."""
    layout, placement = rw.layout, rw.placement
    edits = 0
    for mark in marks:
        stage = placement.stage(mark)
        devices = [placement.device(mark, j) for j in range(len(placement.stage_devices[stage]))]
        versions = rw.versions(mark)
        picks = [layout.version(stage, j, 0) for j in range(len(devices))]
        sums = reducer_for(devices).sum([[versions[v].inputs[0]] for v in picks])
        for v, (total,) in zip(picks, sums):
            graph_edit.update_input(versions[v], 0, total)
            edits += 1 if v == 0 else 0
    return edits
