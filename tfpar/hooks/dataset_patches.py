"""Datasets: eager iteration (keras fit) reads batches of unknown size;
graph-mode iterators are made by the runtime (``io.shard_dataset``)."""
from tfpar.compat.tf import context, dataset_ops
from tfpar.hooks import batch_shapes, seams
from tfpar.hooks.patching import PatchSet

__all__ = ["add_dataset_patches"]


def add_dataset_patches(patches: PatchSet) -> None:
    patches.add(dataset_ops.DatasetV2, "__iter__", _wrap_eager_iter)
    for name in ("_make_one_shot_iterator", "_make_initializable_iterator"):
        patches.add(dataset_ops.DatasetV1, name, _wrap_make_iterator)


def _wrap_eager_iter(original):
    def __iter__(self):
        if seams.runtime is not None and context.executing_eagerly():
            # A tf.function that reads it (keras fit) sees its batch unknown;
            # with io.shard_dataset a Horovod process reads its shard.
            return original(seams.runtime.eager_dataset(batch_shapes.relaxed_dataset(self)[0]))
        return original(self)
    return __iter__


def _wrap_make_iterator(original):
    def make_iterator(self, *args, **kwargs):
        def make(dataset):
            return original(dataset, *args, **kwargs)
        return seams.runtime.make_iterator(self, make) if seams.runtime is not None else make(self)
    return make_iterator
