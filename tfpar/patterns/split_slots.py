"""Optimizer slots of TF2 split weights, as checkpoints see them.

A Keras optimizer numbers its variables, and a checkpoint names them by those
numbers: ``_variables`` holds ``iterations`` and then each weight's slots in
the order of the weights (Adam: ``m``, ``v``), and per-kind lists
(``_momentums``, ``_velocities``...) hold one slot per weight. A split weight is
one variable per shard, each with its slots, so a split model's numbers are not
a plain one's. A ``SlotList`` is what a checkpoint sees instead of such a list:
the slots of one kind of one split weight's shards become one ``SplitWeight``
(saved as slices of the full shape, like the weight), at the place of the
first of them; the numbers are then the plain run's, and an optimizer's state
restores across plans (plain, split over 2 or 4 devices) as the weights do.
"""
import dataclasses
import weakref
from typing import Any, Dict, List, Optional, Tuple

from tfpar.compat.tf import trackable
from tfpar.patterns.sharded import SplitContext
from tfpar.patterns.split_weights import SplitWeight, split_weight_of, unsplit_name

__all__ = ["SlotList", "has_split_slots", "record_slot"]


@dataclasses.dataclass
class _Group:
    """The slots of one kind of a split weight's shards, and once all exist,
    the one SplitWeight every SlotList of the optimizer shows for them."""

    weight: SplitWeight
    kind: str
    slots: List[Any]
    whole: Optional[SplitWeight] = None

    def complete(self) -> Optional[SplitWeight]:
        if self.whole is None and all(slot is not None for slot in self.slots):
            self.whole = SplitWeight(unsplit_name(self.slots[0]), self.slots,
                                     self.weight.axis, self.weight.shape)
        return self.whole


# optimizer -> {(id of split weight, slot kind): its _Group}; a slot knows its
# key (``tfpar_slot_key``: variables are not hashable).
_groups: "weakref.WeakKeyDictionary[Any, Dict[Tuple[int, str], _Group]]" = (
    weakref.WeakKeyDictionary())


def record_slot(optimizer, model_variable, kind: str, slot) -> None:
    """``slot`` of ``kind`` was made for ``model_variable``: if that is a
    shard of a split weight (and the slot has its shape), it joins the
    weight's group of that kind."""
    weight = split_weight_of(model_variable)
    if weight is None or slot.shape != model_variable.shape:
        return
    key = (id(weight), kind)
    groups = _groups.setdefault(optimizer, {})
    group = groups.setdefault(key, _Group(weight, kind, [None] * len(weight)))
    group.slots[SplitContext.shard_index(model_variable)] = slot
    slot.tfpar_slot_key = key


def has_split_slots(optimizer) -> bool:
    return bool(_groups.get(optimizer))


class SlotList(trackable.Trackable):
    """A checkpoint's view of ``owner.<attribute>`` (a list of variables) with
    each complete group of split slots as one ``SplitWeight``."""

    def __init__(self, owner, attribute: str):
        self._maybe_initialize_trackable()
        self._owner, self._attribute = owner, attribute

    def elements(self) -> List[Any]:
        found, seen = [], set()
        groups = _groups.get(self._owner, {})
        for item in getattr(self._owner, self._attribute, ()):
            key = getattr(item, "tfpar_slot_key", None)
            whole = groups[key].complete() if key in groups else None
            if whole is None:
                found.append(item)
            elif key not in seen:
                seen.add(key)
                found.append(whole)
        return found

    def _trackable_children(self, save_type=trackable.SaveType.CHECKPOINT, **kwargs):
        return {str(i): item for i, item in enumerate(self.elements())}

    def restore_pending(self) -> None:
        """Restore what a checkpoint read before its elements existed (deferred)
        into the elements there now."""
        if not self._deferred_dependencies:
            return
        elements = self.elements()
        for name in list(self._deferred_dependencies):
            if name.isdigit() and int(name) < len(elements):
                self._handle_deferred_dependencies(name, elements[int(name)])
