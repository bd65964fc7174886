"""The iterators scripts make under tfpar: batch dimension relaxed, and with
``io.shard_dataset`` one shard per Horovod process or TF_CONFIG worker."""
from tfpar import fallback
from tfpar.compat import tf as internals
from tfpar.compat.tf import ops
from tfpar.hooks.batch_shapes import relaxed_dataset
from tfpar.hooks.capture import capture_for
from tfpar.runtime.context import Runtime, active

__all__ = ["eager_dataset", "make_iterator"]


def make_iterator(ds, make):
    """Iterators read the dataset with its static batch dimension relaxed
    (``hooks.batch_shapes``). ``io.shard_dataset``: in a Horovod job each
    process iterates over its shard of the dataset; in a TF_CONFIG cluster the
    chief makes one iterator per worker, on that worker, over its shard
    (recorded in the capture for the rewrite). Shards are whole elements:
    batches, if the dataset batches."""
    rt = active()
    if rt is None:
        return make(ds)
    ds, declared = relaxed_dataset(ds)
    iterator, shards = _sharded_iterator(rt, ds, make)
    if declared is not None:  # the global batch: every shard's
        capture = capture_for(ops.get_default_graph())
        capture.declared_batch[internals.iterator_resource(iterator).op.name] = declared * shards
    return iterator


def eager_dataset(ds):
    """The dataset eager code iterates over (a TF2 custom loop, Keras fit):
    with ``io.shard_dataset`` in a Horovod job, this process's shard (whole
    elements); in a TF_CONFIG cluster the chief's eager code feeds every
    step, so it reads the whole dataset, said."""
    rt = active()
    if rt is None or not rt.config.get("io.shard_dataset"):
        return ds
    if rt.config.get("communication.backend") == "horovod":
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        return ds.shard(hvd.size(), hvd.rank())
    if "io.shard_dataset" in rt.warned_one_device:  # said once
        return ds
    rt.warned_one_device.add("io.shard_dataset")
    fallback.fall_back(
        "io.shard_dataset", "a TF2 script's steps are fed by its eager code, which reads the "
        "whole dataset on the chief (the other workers serve their devices)", "Use Horovod "
        "(communication.backend 'horovod') for each process to read its own shard, or a "
        "graph-mode script", None)
    return ds


def _sharded_iterator(rt: Runtime, ds, make):
    """(the iterator this process reads, how many shards the global batch is
    read in): ``make_iterator``'s ``io.shard_dataset``."""
    if not rt.config.get("io.shard_dataset"):
        return make(ds), 1
    if rt.config.get("communication.backend") == "horovod":
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
        return make(ds.shard(hvd.size(), hvd.rank())), hvd.size()
    if rt.cluster is None:
        fallback.fall_back(
            "io.shard_dataset", "this process runs alone (no TF_CONFIG cluster nor Horovod job), "
            "so it reads the whole dataset", "Set io.shard_dataset only for jobs of several "
            "workers or processes", ops.get_default_graph())
        return make(ds), 1
    count = len(rt.cluster.workers)
    iterator = make(ds.shard(count, 0))
    others = []
    for task in range(1, count):
        with ops.device(rt.cluster.host_cpu(task)):
            others.append(make(ds.shard(count, task)))
    capture = capture_for(ops.get_default_graph())
    capture.worker_iterators[internals.iterator_resource(iterator).op] = others
    return iterator, count
