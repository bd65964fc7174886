"""The batch inputs a data-parallel rewrite cuts into replicas and
micro-batches: whether they can be cut, and with ``io.shard_dataset`` in a
cluster, what each worker's own iterator reads instead."""
from tfpar.compat import tf as internals
from tfpar.compat.tf import dtypes, nest, ops, tensor_util
from tfpar.errors import PlanError
from tfpar.ir.recorded import Recorded
from tfpar.rewriters.select import Selection

__all__ = ["refuse_fixed_blocks", "refuse_unsplittable", "worker_sources"]


def refuse_unsplittable(sel: Selection) -> None:
    """Batch inputs keep their batch dimension unknown (``hooks.batch_shapes``
    relaxes placeholders and tf.data iterators made after ``wh.init``); one
    that fixes it (a queue's dequeue, a source made before ``wh.init``) let
    TensorFlow build its size into the graph, which copies on fewer rows would
    silently contradict. Composite inputs other than SparseTensors (a ragged
    tensor from an iterator arrives as one variant tensor) cannot be cut by
    rows yet.

    Raises:
      PlanError: no batch input, or one that cannot be cut.
    """
    if not sel.batch_inputs:
        raise PlanError(
            "tfpar: found no batch input to split into replicas / micro-batches: feed the "
            "model through a tf.compat.v1.placeholder or a tf.data iterator")
    sparse = {t for group in sel.sparse_inputs for t in group}
    for t in sel.batch_inputs:
        if t.dtype == dtypes.variant:
            consumers = ", ".join(f"'{c.name}' ({c.type})" for c in t.consumers()[:3])
            raise PlanError(
                f"tfpar: batch input '{t.name}' ({t.op.type}) is a composite tensor (a "
                f"ragged tensor or other composite from a tf.data iterator, read by {consumers}); "
                "tfpar cannot cut it into replicas / micro-batches by rows yet. Make it dense "
                "or a SparseTensor in the input pipeline (Dataset.map)")
        if t not in sparse and t.shape.rank and t.shape[0] is not None:
            queue = t.op.type.startswith("QueueDequeue")
            raise PlanError(
                f"tfpar: batch input '{t.name}' ({t.op.type}) has the static batch size "
                f"{t.shape[0]}, which TensorFlow built into the ops that read it; tfpar cannot "
                "split it over replicas / micro-batches. " + (
                    "Queue-based input (tf.train.batch, slice_input_producer) fixes it: read "
                    "the data with tf.data instead (Dataset.from_tensor_slices(...).batch(n))"
                    if queue else "Create it after wh.init(), or with its batch dimension "
                    "unknown (placeholder([None, ...]))"))


def refuse_fixed_blocks(sel: Selection, axis_of) -> None:
    """A block of rows the step builds itself, concatenated along the batch
    axis with the batch's rows (a GAN's fixed number of generated rows), would
    be copied whole into every replica next to its share of the batch: each
    would train on all of the block. Refuse it, naming the concatenation.

    Args:
      axis_of: the batch axis of a step tensor (``analysis.batch_axes``).

    Raises:
      PlanError: such a concatenation.
    """
    for op in sel.step_ops:
        if op.type != "ConcatV2" or op in sel.backward or axis_of(op.outputs[0]) is None:
            continue
        dim = tensor_util.constant_value(op.inputs[-1])
        rank = op.outputs[0].shape.rank
        if dim is None or rank is None or int(dim) % rank != axis_of(op.outputs[0]):
            continue
        block = next((x for x in op.inputs[:-1] if axis_of(x) is None and x.shape.rank), None)
        if block is not None:
            raise PlanError(
                f"tfpar: '{op.name}' joins the batch's rows with '{block.name}' "
                f"{block.shape.as_list()}, a block of rows the step makes itself, not from the "
                "batch: every replica would train on all of it beside its share of the batch. "
                "Make the block as many rows as the batch (tf.shape(x)[0] rows: each replica "
                "then makes its own), or pass it to the step with the batch")


def worker_sources(recorded: Recorded, sel: Selection, num_pieces: int):
    """With ``io.shard_dataset`` in a cluster: per worker, the batch inputs as
    read by that worker's own iterator (worker 0: the originals), or None."""
    if not recorded.worker_iterators:
        return None
    batch_inputs = sel.batch_inputs
    if sel.sparse_inputs:
        raise PlanError(f"tfpar: io.shard_dataset cannot split the SparseTensor input "
                        f"'{sel.sparse_inputs[0][0].name}' yet; turn io.shard_dataset off (every "
                        "worker then reads the global batch and takes its rows)")
    workers = 1 + len(next(iter(recorded.worker_iterators.values())))
    if num_pieces % workers:
        raise PlanError(f"tfpar: io.shard_dataset splits the rows of {workers} workers into "
                        f"{num_pieces} replicas x micro-batches; use a multiple of {workers}")
    sources = [list(batch_inputs)] + [[] for _ in range(workers - 1)]
    read = {}
    for t in batch_inputs:
        resource = t.op.inputs[0].op if t.op.type.startswith("IteratorGetNext") else None
        if resource not in recorded.worker_iterators:
            raise PlanError(f"tfpar: with io.shard_dataset in a cluster every batch input must "
                            f"come from a tf.data iterator; '{t.name}' does not")
        if t.op not in read:
            read[t.op] = []
            for iterator in recorded.worker_iterators[resource]:
                with ops.device(internals.iterator_resource(iterator).device):
                    read[t.op].append(nest.flatten(iterator.get_next()))
        for worker, outputs in enumerate(read[t.op], start=1):
            sources[worker].append(outputs[t.value_index])
    return sources
