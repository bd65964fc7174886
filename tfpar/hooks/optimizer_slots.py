"""Keras optimizers' checkpoints of TF2 split weights' slots
(``patterns.split_slots``: a checkpoint numbers them as for the whole weight).

* ``_BaseOptimizer.add_variable_from_reference``: a slot made for a split
  weight's shard is recorded.
* ``_BaseOptimizer._trackable_children``: a checkpoint sees each list of the
  optimizer holding such slots as a ``SlotList``.
* ``_BaseOptimizer._build_index_dict`` (the start of ``build``) and
  ``apply_gradients``: a checkpoint restored before the optimizer made its
  slots (restore, then train) restores each slot when a list grows, by its
  number in the list of shards. So when an optimizer starts building slots for
  shards, the restores waiting in it and its lists are taken, and handed to
  the SlotLists once the slots exist (after ``apply_gradients`` built them, or
  when a checkpoint next reads the optimizer).
* legacy ``OptimizerV2.add_slot``: legacy optimizers keep slots by variable,
  and a checkpoint only saves slots of variables it saves (a split weight saves
  as one value, not as its shards): tfpar says once that they are not saved.
"""
import weakref
from typing import Any, Dict, List, Optional

from tfpar.compat.keras import keras_optimizer_v2 as optimizer_v2
from tfpar import fallback
from tfpar.compat import keras as keras_internals, tf as internals
from tfpar.compat.tf import ops, trackable
from tfpar.patterns.split_slots import SlotList, has_split_slots, record_slot
from tfpar.patterns.split_weights import split_weight_of

__all__ = ["add_optimizer_slot_patches", "optimizer_built_with"]


_lists: "weakref.WeakKeyDictionary[Any, Dict[str, SlotList]]" = weakref.WeakKeyDictionary()
# optimizer -> restores of its own children taken at the start of a build.
_pending: "weakref.WeakKeyDictionary[Any, Dict[str, List[Any]]]" = weakref.WeakKeyDictionary()
_warned: "weakref.WeakSet" = weakref.WeakSet()
_built: "weakref.WeakSet" = weakref.WeakSet()  # keras optimizers that made their slots


def add_optimizer_slot_patches(patches) -> None:
    base = keras_internals.base_optimizer_class()
    patches.add(base, "add_variable_from_reference", _recording)
    patches.add(base, "_trackable_children", _slot_lists)
    patches.add(base, "_build_index_dict", _taking_pending)
    patches.add(base, "apply_gradients", _restoring_pending)
    patches.add(optimizer_v2.OptimizerV2, "add_slot", _warning_legacy)


def _slot_list(optimizer, name: str) -> SlotList:
    return _lists.setdefault(optimizer, {}).setdefault(name, SlotList(optimizer, name))


def _recording(original):
    def add_variable_from_reference(self, model_variable, variable_name, shape=None,
                                    initial_value=None):
        slot = original(self, model_variable, variable_name, shape, initial_value)
        record_slot(self, model_variable, variable_name, slot)
        return slot
    return add_variable_from_reference


def _slot_lists(original):
    def _trackable_children(self, save_type=trackable.SaveType.CHECKPOINT, **kwargs):
        children = original(self, save_type, **kwargs)
        if save_type != trackable.SaveType.CHECKPOINT or not has_split_slots(self):
            return children
        _restore_pending(self)
        return {name: _slot_list(self, name) if isinstance(child, list) else child
                for name, child in children.items()}
    return _trackable_children


def _taking_pending(original):
    def _build_index_dict(self, var_list):
        _built.add(self)
        if any(split_weight_of(v) is not None for v in var_list):
            _take_pending(self)
        return original(self, var_list)
    return _build_index_dict


def optimizer_built_with(variable) -> Optional[Any]:
    """A Keras optimizer that made slots for ``variable``, or None."""
    return next((opt for opt in list(_built) if keras_internals.slot_index_has(opt, variable)),
                None)


def _take_pending(optimizer) -> None:
    """The restores waiting for ``optimizer``'s children, and for the
    elements of its lists, to be handed over once its slots exist."""
    internals.initialize_trackable(optimizer)
    waiting = internals.deferred_restores(optimizer)
    pending = _pending.setdefault(optimizer, {})
    for name in list(waiting):
        pending.setdefault(name, []).extend(waiting.pop(name))
    for reference in internals.checkpoint_children(optimizer):
        child = reference.ref
        if isinstance(child, list) and internals.deferred_restores(child):
            taken = internals.deferred_restores(_slot_list(optimizer, reference.name))
            for name, positions in internals.deferred_restores(child).items():
                taken.setdefault(name, []).extend(positions)
            internals.deferred_restores(child).clear()


def _restore_pending(optimizer) -> None:
    pending = _pending.pop(optimizer, {})
    with ops.init_scope():
        for name, positions in pending.items():
            child = getattr(optimizer, name, None)
            target = _slot_list(optimizer, name) if isinstance(child, list) else child
            if target is None:  # not made by this build: it waits on
                waiting = internals.deferred_restores(optimizer)
                waiting.setdefault(name, []).extend(positions)
                continue
            for position in positions:
                position.restore(target)
        for slot_list in _lists.get(optimizer, {}).values():
            slot_list.restore_pending()


def _restoring_pending(original):
    def apply_gradients(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self in _pending or self in _lists:
            _restore_pending(self)
        return result
    return apply_gradients


def _warning_legacy(original):
    def add_slot(self, var, slot_name, initializer="zeros", shape=None):
        weight = split_weight_of(var)
        if weight is not None and self not in _warned:
            _warned.add(self)
            name = keras_internals.optimizer_name(self)
            fallback.fall_back(
                f"checkpoints of legacy optimizer '{name}' to hold its slots ('{slot_name}') of "
                f"split weight '{weight.name}'",
                "it keeps them by shard, and checkpoints do not save them (they save the weight "
                "as one value, not its shards): a restored run starts them at zero",
                "Use Keras' new optimizers (tf.keras.optimizers.Adam), which save them", None)
        return original(self, var, slot_name, initializer, shape)
    return add_slot
