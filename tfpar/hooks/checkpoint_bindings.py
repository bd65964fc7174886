"""Checkpoint restores that see a whole weight become a split one.

A TF2 layer restored from a checkpoint before a step splits it (the shards are
cut from the restored value) is bound, in that restore's bookkeeping, to the
whole weight it had then; ``status.assert_consumed()`` would then report the
split weight as unmatched. Every live restore is remembered
(``_CheckpointRestoreCoordinator.__init__``), and ``rebind`` moves their
bindings of the whole weight to the split one.
"""
import weakref

from tfpar.compat import tf as internals

__all__ = ["add_checkpoint_binding_patches", "rebind"]

_restores: "weakref.WeakSet" = weakref.WeakSet()


def add_checkpoint_binding_patches(patches) -> None:
    patches.add(internals.restore_coordinator_class(), "__init__", _remembered)


def _remembered(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _restores.add(self)
    return __init__


def rebind(old, new) -> None:
    """Restores that bound ``old`` bind ``new`` in its place (its value is
    ``old``'s, restored as far as ``old`` was)."""
    internals.take_restore_identity(new, old)
    for restore in list(_restores):
        for node, bound in list(restore.object_by_proto_id.items()):
            if bound is old:
                restore.object_by_proto_id[node] = new
