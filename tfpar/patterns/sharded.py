"""Sharded tensors of one split TaskGraph, and which device each slice of its
sharded variables is on (the variables themselves: ``sharded_variable``).

Variables are TensorFlow partitioned variables (slices with ``save_slice_info``),
so a checkpoint stores each under its single-device name and full shape, and
slice i lives on device i: the full weight is never allocated. Which shard a
slice is, and so its device, is recorded in a side table of the SplitContext as
TensorFlow creates the slice (``ShardCreation``), from the slice's offset in
the full variable, never from its name. A sharded tensor is its per-device
shards plus a full view (their concatenation) that is computed only if
something outside the patterns reads it (Whale's split bridge: gather along the
split dimension). With ``split.sequence_parallel``, a tensor can also be
sharded along its sequence (``ShardedTensor.sequence``): the patterns that
split weights see it whole, and read it on each device gathered there
(``SplitContext.local``).
"""
import contextlib
import dataclasses
import weakref
from typing import Dict, List, Optional, Sequence, Set

from tfpar.compat.tf import array_ops, ops, tensor_lib, variables_lib
from tfpar.errors import ShardingError
from tfpar.ir.sharding import ShardingInfo

__all__ = ["ShardCreation", "ShardedTensor", "SplitContext", "creation_slices",
           "on_each_device", "pieces_alongside", "shard_being_created", "slice_along",
           "slice_offsets"]


@dataclasses.dataclass
class ShardedTensor:
    """``shards[i]`` on ``devices[i]``, split along ``axis``; ``full`` is the
    concatenated view (on ``devices[0]``); ``sequence``: split along the
    sequence (axis 1) by sequence parallelism, not by a weight's split."""

    shards: List[tensor_lib.Tensor]
    axis: int
    full: tensor_lib.Tensor
    sequence: bool = False

    @property
    def sizes(self) -> List[tensor_lib.Tensor]:
        """Dynamic size of each shard along ``axis``."""
        return [array_ops.shape(s)[self.axis] for s in self.shards]


class SplitContext:
    """What the patterns of one split TaskGraph share.

    Attributes:
      name: the TaskGraph's name.
      devices: its devices; shard i goes to ``devices[i]``.
      forced: ShardingUnit name -> pattern name (``split.patterns`` config).
      planned: a pinned plan's sharded layers, name scope -> pattern, matched
        to units by ``forced_pattern``.
      decisions: ShardingUnit name -> chosen pattern, in build order.
      shares: per device, its integer weight in every split dimension (mixed
        devices: Whale §3.3.1); empty: even, as TensorFlow partitions.
      followed: the pinned plan's layers (``planned``) a unit was forced
        to build as planned (``forced_pattern``).
      sequence_parallel: ``split.sequence_parallel``; ``sequence_regions``
        counts the tensors built split along the sequence.
      made_shards: how many sharded tensors and variables it made (none, and
        no ``decisions``: nothing of the TaskGraph is sharded).
      graph: the graph it was made in.
    """

    def __init__(self, name: str, devices: Sequence[str], forced: Optional[Dict[str, str]],
                 registry: Optional[Dict] = None, shares: Sequence[int] = (),
                 planned: Optional[Dict[str, str]] = None, sequence_parallel: bool = False):
        """``registry``: full view (its ``ref()``) -> (devices, ShardedTensor),
        shared by the split TaskGraphs of a graph, so one on the same devices reads another's shards
        directly (Whale: a gather followed by a partition along the same
        dimension is fused away)."""
        self.name = name
        self.devices = list(devices)
        self.shares = tuple(shares)
        self.forced = dict(forced or {})
        self.planned = dict(planned or {})
        self.decisions: Dict[str, str] = {}
        self.followed: Set[str] = set()
        self.sequence_parallel = sequence_parallel
        self.sequence_regions = 0
        self.made_shards = 0
        self.graph = ops.get_default_graph()  # the one its fallbacks are noted in
        self._gathered: Dict = {}
        self._sharded = registry if registry is not None else {}
        self._units: Dict[str, int] = {}
        self._depth = 0

    @property
    def busy(self) -> bool:
        """True while a pattern builds its implementation (its own TF calls are
        not ShardingUnits)."""
        return self._depth > 0

    @contextlib.contextmanager
    def building(self):
        self._depth += 1
        try:
            with ops.colocate_with(None, ignore_existing=True):
                yield
        finally:
            self._depth -= 1

    @property
    def size(self) -> int:
        return len(self.devices)

    def widths(self, size: int) -> List[int]:
        """The sizes of the shards a dimension of ``size`` is cut into."""
        bounds = slice_offsets(size, self.size, self.shares) + [size]
        return [b - a for a, b in zip(bounds, bounds[1:])]

    def forced_pattern(self, unit: str) -> Optional[str]:
        """The pattern forced on ShardingUnit ``unit``: by ``split.patterns``,
        else by the pinned plan's layer of that name scope (the whole scope,
        or the one scope ending with the unit's name or ending it: a TF2
        step's ops are named inside its model's scope; of several, the one
        the ops are being built in: keras names the sublayers of every
        MultiHeadAttention ``query``, ``key``...).

        Raises:
          ShardingError: several planned layers end with the unit's name.
        """
        if unit in self.forced:
            return self.forced[unit]
        found = ([unit] if unit in self.planned
                 else [scope for scope in self.planned if _names_layer(unit, scope)])
        if len(found) > 1:
            building = ops.get_default_graph().get_name_scope()
            found = [scope for scope in found if _names_layer(building, scope)
                     or building.startswith(scope + "/")] or found
        if len(found) > 1:
            raise ShardingError(f"tfpar: ShardingUnit '{unit}' could be the pinned plan's layer "
                                f"{' or '.join(map(repr, found))}; name its layers uniquely")
        if not found:
            return None
        self.followed.add(found[0])
        return self.planned[found[0]]

    def unit_name(self, base: str) -> str:
        """A unique ShardingUnit name from a layer / op name."""
        count = self._units.get(base, 0)
        self._units[base] = count + 1
        return base if count == 0 else f"{base}_{count}"

    def lookup(self, t, sequence: bool = False) -> Optional[ShardedTensor]:
        """The sharded form of ``t``, looking through reshapes that keep the
        last (split) dimension; one split along the sequence only if
        ``sequence``."""
        if not isinstance(t, tensor_lib.Tensor):
            return None
        devices, sharded = self._sharded.get(t.ref(), (None, None))
        if sharded is not None and devices == self.devices:
            return sharded if sequence or not sharded.sequence else None
        # TensorFlow's cross-entropies flatten logits to [-1, classes]; for a
        # [batch, classes] input that reshape is the identity.
        if t.op.type in ("Reshape", "Identity") and t.shape.rank == 2:
            inner = self.lookup(t.op.inputs[0])
            if inner is not None and inner.full.shape.rank == 2 and inner.axis == 1 and (
                    t.shape[1] in (None, inner.full.shape[1])):
                return ShardedTensor(inner.shards, 1, t)
        return None

    def info(self, t) -> ShardingInfo:
        sharded = self.lookup(t)
        rank = t.shape.rank if isinstance(t, tensor_lib.Tensor) and t.shape.rank else 0
        return ShardingInfo.split(rank, sharded.axis) if sharded else ShardingInfo.full(rank)

    def sharded(self, shards: List[tensor_lib.Tensor], axis: int,
                sequence: bool = False) -> tensor_lib.Tensor:
        """Register ``shards`` (on this TaskGraph's devices) split along ``axis``
        (the sequence, if ``sequence``); returns the full view the user sees."""
        with ops.device(self.devices[0]):
            full = array_ops.concat(shards, axis, name="gather_shards")
        self._sharded[full.ref()] = (
            self.devices, ShardedTensor(list(shards), axis % full.shape.rank, full, sequence))
        self.sequence_regions += bool(sequence)
        self.made_shards += 1
        return full

    def cut(self, x, axis: int, widths: Sequence[int]) -> List[tensor_lib.Tensor]:
        """``x`` cut along ``axis`` into ``widths``, piece i on device i."""
        pieces, offset = [], 0
        for width, device in zip(widths, self.devices):
            with ops.device(device):
                pieces.append(slice_along(x, axis, offset, width))
            offset += width
        return pieces

    def local(self, x, index: int):
        """``x`` as device ``index`` reads it: split along the sequence, its
        shards concatenated on that device (one device's part of an
        all-gather), made once; else ``x``."""
        sharded = self.lookup(x, sequence=True)
        if sharded is None or not sharded.sequence:
            return x
        key = (x.ref(), index)
        if key not in self._gathered:
            with ops.device(self.devices[index]):
                self._gathered[key] = array_ops.concat(sharded.shards, 1, name="gather_sequence")
        return self._gathered[key]

    @contextlib.contextmanager
    def creating_shards(self, shape: Sequence[int], axis: int):
        """While TensorFlow creates the slices of a variable of full ``shape``
        split along ``axis``, the variable-store hook (``hooks.split_patches``)
        builds slice i on device i and records it (``shard_being_created``)."""
        creation = ShardCreation(self, shape, axis)
        self.made_shards += 1
        _creations.append(creation)
        try:
            yield creation
        finally:
            _creations.remove(creation)

    @staticmethod
    def record_shard(variable, index: int) -> None:
        """``variable`` was made as shard ``index`` of a split TaskGraph (an
        eager variable, a TF2 step's, carries it)."""
        if _eager(variable):
            variable.tfpar_shard = index
        else:
            _shard_of.setdefault(variable.graph, {})[variable.op.name] = index

    @staticmethod
    def shard_index(variable) -> int:
        """Which shard ``variable`` (a slice of a sharded variable) is."""
        if _eager(variable):
            return variable.tfpar_shard
        return _shard_of[variable.graph][variable.op.name]

    def device_of(self, variable) -> str:
        """The device of shard ``variable`` among this TaskGraph's devices."""
        return self.devices[self.shard_index(variable)]


def _eager(variable) -> bool:
    return not getattr(variable, "_in_graph_mode", True)


# The side table, per graph: slice variable (its handle op's name, a key as in
# ``GraphCapture.op_task_graph``, never parsed) -> shard index, filled as
# TensorFlow creates the slices of sharded variables (``record_shard``).
_shard_of: "weakref.WeakKeyDictionary[ops.Graph, Dict[str, int]]" = weakref.WeakKeyDictionary()


class ShardCreation:
    """The sharded variable being created: its full shape, split axis and the
    slices made so far (``created``), each recorded in the side table."""

    def __init__(self, ctx: SplitContext, shape: Sequence[int], axis: int):
        self.ctx = ctx
        self.shape = [int(d) for d in shape]
        self.axis = axis
        self.offsets = slice_offsets(self.shape[axis], ctx.size, ctx.shares)
        self.created: List[variables_lib.Variable] = []

    def slices(self, full_shape: Sequence[int], slice_dim: int, count: int):
        """(offset, shape) of each slice, as TensorFlow's ``_iter_slices``
        yields them, when TensorFlow is slicing this variable; else None."""
        if ([int(d) for d in full_shape] != self.shape or slice_dim != self.axis
                or count != len(self.offsets)):
            return None
        bounds = self.offsets + [self.shape[self.axis]]
        result = []
        for offset, end in zip(bounds, bounds[1:]):
            start, shape = [0] * len(self.shape), list(self.shape)
            start[self.axis], shape[self.axis] = offset, end - offset
            result.append((start, shape))
        return result

    def index_of(self, partition_info) -> Optional[int]:
        """The shard a slice with TensorFlow's ``partition_info`` is (None when
        it is not a slice of this variable)."""
        if partition_info is None or list(partition_info.full_shape) != self.shape:
            return None
        offset = list(partition_info.var_offset)
        if any(o for i, o in enumerate(offset) if i != self.axis):
            return None
        return self.offsets.index(offset[self.axis]) if offset[self.axis] in self.offsets else None

    def record(self, variable, index: int) -> None:
        self.ctx.record_shard(variable, index)
        self.created.append(variable)


_creations: List[ShardCreation] = []


def on_each_device(ctx, name, compute, *per_device: Sequence) -> List:
    """``compute(*(items[i] for items in per_device), name_i)`` on each of
    ``ctx``'s devices i: device 0's op takes ``name`` (the name a whole op
    would: a pinned plan knows its layer by it, and the next op's default
    name counts on it), the others' None, in a name scope of their own."""
    results = []
    for i, device in enumerate(ctx.devices):
        with ops.device(device), (ops.name_scope(f"tfpar_shard_{i}") if i
                                  else contextlib.nullcontext()):
            results.append(compute(*(items[i] for items in per_device), name if not i else None))
    return results


def pieces_alongside(ctx, t, full, axis: int, widths: Sequence[int]) -> Optional[List]:
    """A whole operand ``t`` of a broadcasting elementwise op with ``full``
    (split along ``axis`` into ``widths``) as each device reads it: itself
    where it broadcasts along that axis (it lacks it, or has size 1), cut
    along it where it spans it; None when neither."""
    t = ops.convert_to_tensor(t, dtype=full.dtype)
    if t.shape.rank is None:
        return None
    at = axis - (full.shape.rank - t.shape.rank)
    if at < 0 or t.shape[at] == 1:
        return [t] * ctx.size
    if t.shape[at] is None or int(t.shape[at]) != sum(widths):
        return None
    return ctx.cut(t, at, widths)


def slice_along(t, axis: int, offset: int, width: int):
    """``width`` entries of ``t`` from ``offset`` along ``axis``."""
    begin, size = [0] * t.shape.rank, [-1] * t.shape.rank
    begin[axis], size[axis] = offset, width
    return array_ops.slice(t, begin, size)


def _names_layer(unit: str, scope: str) -> bool:
    """Whether ShardingUnit ``unit`` is a pinned plan's layer ``scope``: the
    same name, or one ends the other (a TF2 step names its ops inside its
    model's scope)."""
    return unit == scope or scope.endswith("/" + unit) or unit.endswith("/" + scope)


def creation_slices(full_shape: Sequence[int], slice_dim: int, count: int):
    """The slices of the sharded variable TensorFlow is slicing (its
    ``ShardCreation.slices``), or None when it slices another."""
    for creation in reversed(_creations):
        found = creation.slices(full_shape, slice_dim, count)
        if found is not None:
            return found
    return None


def shard_being_created(partition_info):
    """(creation, shard index) of the slice TensorFlow is about to create, or
    None when no sharded variable is being created or it is not one's slice."""
    for creation in reversed(_creations):
        index = creation.index_of(partition_info)
        if index is not None:
            return creation, index
    return None


def slice_offsets(size: int, count: int, shares: Sequence[int] = ()) -> List[int]:
    """Offsets of ``count`` slices of ``size``: as TensorFlow's partitioned
    variables cut them (the first ``size % count`` one longer), or, with
    ``shares``, slice i about ``size * shares[i] / sum(shares)`` long (each
    at least 1 when ``size >= count``)."""
    if not shares:
        offsets, offset = [], 0
        for i in range(count):
            offsets.append(offset)
            offset += size // count + (1 if i < size % count else 0)
        return offsets
    total, before, offsets = sum(shares), 0, []
    for i, share in enumerate(shares):
        cut = size * before // total
        lowest = offsets[-1] + 1 if offsets else 0
        offsets.append(min(max(cut, lowest), max(size - (count - i), lowest)))
        before += share
    return offsets

