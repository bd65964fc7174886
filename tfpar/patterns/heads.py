"""Attention built from raw ops, split by heads (Megatron-LM, Shoeybi et al.
2019, §3, Fig. 3b): what keeps a tensor split along its heads from the
column-split q, k, v projections to the row-split output projection.

A split tensor stays split (each device runs TensorFlow's op on its shard,
no communication) through:

* ``reshaped``: a reshape that cuts the split axis into heads and their
  width, or merges them back, when every shard holds whole heads, or that
  cuts it into q/k/v, heads and their width (each device gathers its heads
  of q, k and v first);
* ``transposed``: a transpose (the split axis moves);
* ``batch_matmul``: a batched matmul split along a batch axis (``Q K^T`` and
  ``softmax(.) V`` per head); the other operand is split alike, broadcast
  along it, or cut locally;
* ``broadcast``: an elementwise op with a tensor constant along the split
  axis (the ``1/sqrt(d)`` scale, a ``[B, 1, T, T]`` or ``[T, T]`` mask);
* ``per_shard``, ``split_alongside``, ``joined``: an op along another axis
  (softmax over keys; a split, unstack, index or concat of another axis:
  a rotary embedding's halves, q k v of a heads-interleaved projection);
* ``redistributed``: a piece of the split axis (``tf.split`` of a fused
  ``qkv`` projection into q, k and v), re-cut so device i holds its heads
  of that piece (the columns it lacks move between devices).

Each op runs as ``compute(*operands, name)`` (``sharded.on_each_device``:
device 0's op takes the whole op's name); tfpar's own slices and joins
take name scopes of their own.
"""
import math
from typing import Callable, List, Optional, Sequence

from tfpar.compat.tf import array_ops, constant_op, ops, tensor_util
from tfpar.patterns.sharded import ShardedTensor, on_each_device, pieces_alongside, slice_along

__all__ = ["batch_matmul", "broadcast", "joined", "per_shard", "redistributed", "reshaped",
           "reshaped_axis", "sliced_axis", "split_alongside", "transposed"]


def _widths(sharded: ShardedTensor) -> Optional[List[int]]:
    widths = [s.shape[sharded.axis] for s in sharded.shards]
    return None if None in widths else [int(w) for w in widths]


def _own_scope(index: int):
    """The name scope of tfpar's ops for device ``index``."""
    return ops.name_scope(f"tfpar_shard_{index}" if index else "tfpar_heads")


def reshaped_axis(shape: Sequence[Optional[int]], axis: int, target: Sequence[Optional[int]],
                  widths: Sequence[int]) -> Optional[tuple]:
    """(target axis, widths along it) when reshaping a tensor of ``shape``
    split along ``axis`` into ``widths`` to ``target`` (None: unknown) keeps
    every shard one block of one target axis, else None. The split axis's
    dimension and those after it must be known, and so must the target's from
    the found axis on: a block of ``axis`` (stride ``S``) is a block of target
    axis ``b`` (stride ``S_b``) when both span the same period and the widths
    divide evenly into the finer stride."""
    inner = shape[axis + 1:]
    if shape[axis] is None or None in inner:
        return None
    stride, period = math.prod(inner), shape[axis] * math.prod(inner)
    target_stride = 1
    for b in range(len(target) - 1, -1, -1):
        if target[b] is None:
            return None
        if target[b] * target_stride == period:
            if target_stride >= stride and target_stride % stride == 0:
                factor = target_stride // stride
                if all(w % factor == 0 for w in widths):
                    return b, [w // factor for w in widths]
            elif stride % target_stride == 0:
                return b, [w * stride // target_stride for w in widths]
            return None
        target_stride *= target[b]
    return None


def reshaped(ctx, sharded: ShardedTensor, shape, name, reshape: Callable) -> Optional[object]:
    """``reshape(shard, shard_shape, name)`` on each device when the reshape
    to ``shape`` keeps the shards whole blocks (``reshaped_axis``), or after
    regrouping them by heads (``_regrouped``); else None."""
    widths = _widths(sharded)
    if widths is None or sharded.full.shape.rank is None:
        return None
    with _own_scope(0):
        shape = ops.convert_to_tensor(shape)
    target = tensor_util.constant_value_as_shape(shape)
    if target.rank is None:
        return None
    found = reshaped_axis(sharded.full.shape.as_list(), sharded.axis, target.as_list(), widths)
    if found is None:
        return _regrouped(ctx, sharded, shape, target.as_list(), name, reshape)
    axis, new_widths = found
    constant = tensor_util.constant_value(shape)

    def local(width):
        if constant is not None:
            return [width if i == axis else int(d) for i, d in enumerate(constant)]
        return array_ops.concat([shape[:axis], constant_op.constant([width], shape.dtype),
                                 shape[axis + 1:]], 0)
    shapes = []
    for i, (width, device) in enumerate(zip(new_widths, ctx.devices)):
        with ops.device(device), _own_scope(i):
            shapes.append(local(width))
    return ctx.sharded(on_each_device(ctx, name, reshape, sharded.shards, shapes), axis)


def transposed(ctx, sharded: ShardedTensor, perm, name, transpose: Callable) -> Optional[object]:
    """``transpose(shard, name)`` on each device (a constant ``perm``); else
    None."""
    order = tensor_util.constant_value(perm)
    if order is None:
        return None
    axis = [int(p) for p in order].index(sharded.axis)
    return per_shard(ctx, sharded, name, transpose, axis)


def per_shard(ctx, sharded: ShardedTensor, name, compute: Callable,
              axis: Optional[int] = None):
    """``compute(shard, name)`` on each device, split along ``axis`` (None:
    as ``sharded``)."""
    return ctx.sharded(on_each_device(ctx, name, compute, sharded.shards),
                       sharded.axis if axis is None else axis)


def split_alongside(ctx, sharded: ShardedTensor, name, split: Callable,
                    axis: Optional[int] = None) -> List:
    """``split(shard, name)`` (pieces along another axis) on each device:
    the k-th pieces of every device, split along ``axis`` (None: as
    ``sharded``)."""
    pieces = on_each_device(ctx, name, split, sharded.shards)
    axis = sharded.axis if axis is None else axis
    return [ctx.sharded(list(part), axis) for part in zip(*pieces)]


def joined(ctx, parts: Sequence[ShardedTensor], axis: int, name, concat: Callable):
    """``concat(shards, name)`` of the i-th shards of ``parts`` on each device
    i, when all are split alike and joined along another ``axis`` (a rotary
    embedding's halves); else None."""
    lead = parts[0]
    widths = _widths(lead)
    if widths is None or axis == lead.axis or any(
            p.axis != lead.axis or _widths(p) != widths for p in parts):
        return None
    return ctx.sharded(on_each_device(ctx, name, lambda *shards: concat(
        list(shards[:-1]), shards[-1]), *[p.shards for p in parts]), lead.axis)


def sliced_axis(rank: int, axis: int, strides: Sequence[int], begin_mask: int,
                end_mask: int, ellipsis_mask: int, new_axis_mask: int,
                shrink_axis_mask: int) -> Optional[int]:
    """Where axis ``axis`` of a rank-``rank`` tensor lands in a strided
    slice (``t[:, :, i]``) that keeps it whole, or None (it is cut, or the
    slice uses an ellipsis or new axes)."""
    if ellipsis_mask or new_axis_mask or len(strides) > rank:
        return None
    if axis < len(strides) and not (begin_mask >> axis & 1 and end_mask >> axis & 1
                                    and strides[axis] == 1 and not shrink_axis_mask >> axis & 1):
        return None
    return axis - sum(shrink_axis_mask >> i & 1 for i in range(min(axis, len(strides))))


def _regrouped(ctx, sharded: ShardedTensor, shape, target, name,
               reshape: Callable) -> Optional[object]:
    """A reshape to ``shape`` (a tensor; ``target`` its known entries)
    cutting the split axis into several axes of which a middle one is the
    heads (``[B, S, 3 x H x D]`` to ``[B, S, 3, H, D]``: a fused projection
    GPT-2 ports index or unstack): each device gathers its heads' columns of
    every outer block (``redistributed``) and reshapes them; None when the
    split axis is no such group or its shards' widths would not be whole
    heads."""
    group = _target_group(sharded.full.shape.as_list(), sharded.axis, target)
    constant = tensor_util.constant_value(shape)
    if group is None or constant is None:
        return None
    first, last = group
    for heads in range(first + 1, last):
        inner = math.prod(target[heads + 1:last + 1])
        block = target[heads] * inner
        shares = ctx.widths(target[heads])
        if min(shares) < 1 or [w * inner for w in shares] != ctx.widths(block):
            continue
        pieces = [ctx.lookup(redistributed(ctx, sharded, o * block, block)).shards
                  for o in range(math.prod(target[first:heads]))]
        joined_shards = []
        for i, device in enumerate(ctx.devices):
            with ops.device(device), _own_scope(i):
                joined_shards.append(array_ops.concat([p[i] for p in pieces], sharded.axis))
        shapes = [[w if j == heads else int(d) for j, d in enumerate(constant)] for w in shares]
        return ctx.sharded(on_each_device(ctx, name, reshape, joined_shards, shapes), heads)
    return None


def _target_group(shape, axis: int, target) -> Optional[tuple]:
    """(first, last) target axes the split axis of ``shape`` is cut into
    exactly (their product its size, what follows the same), or None."""
    inner = shape[axis + 1:]
    if shape[axis] is None or None in inner:
        return None
    stride, size = math.prod(inner), shape[axis]
    after = 1
    for last in range(len(target) - 1, -1, -1):
        if after == stride:
            product = 1
            for first in range(last, -1, -1):
                if target[first] is None:
                    return None
                product *= target[first]
                if product == size:
                    return (first, last) if first < last else None
                if product > size:
                    return None
            return None
        if target[last] is None or after > stride:
            return None
        after *= target[last]
    return None


def _aligned(ctx, other, sharded: ShardedTensor, widths: Sequence[int]) -> Optional[List]:
    """``other`` as each device reads it when combined, broadcasting, with
    ``sharded``: its shards where it is split alike, else as a whole tensor
    (``pieces_alongside``); None when neither holds."""
    found = ctx.lookup(other)
    if found is not None:
        at = sharded.axis - (sharded.full.shape.rank - found.full.shape.rank)
        if at >= 0 and other.shape[at] != 1:
            return found.shards if found.axis == at and _widths(found) == list(widths) else None
    with _own_scope(0):
        return pieces_alongside(ctx, other, sharded.full, sharded.axis, widths)


def broadcast(ctx, sharded: ShardedTensor, other, name, compute: Callable,
              sharded_first: bool) -> Optional[object]:
    """``compute(a, b, name)`` elementwise of each shard and ``other`` as
    device i reads it (``_aligned``), the split tensor first when
    ``sharded_first``; None when ``other`` varies along the split axis
    otherwise."""
    widths, rank = _widths(sharded), sharded.full.shape.rank
    if widths is None or rank is None:
        return None
    pieces = _aligned(ctx, other, sharded, widths)
    if pieces is None:
        return None
    out_rank = max(rank, getattr(getattr(other, "shape", None), "rank", 0))
    pairs = (sharded.shards, pieces) if sharded_first else (pieces, sharded.shards)
    return ctx.sharded(on_each_device(ctx, name, compute, *pairs), sharded.axis + out_rank - rank)


def batch_matmul(ctx, x, y, name, compute: Callable) -> Optional[object]:
    """``compute(x_i, y_i, name)`` on each device for a batched matmul whose
    split operand is split along a batch axis (not one of its two matrix
    axes); the other operand as ``broadcast`` reads it. None otherwise."""
    first = ctx.lookup(x)
    sharded = first if first is not None else ctx.lookup(y)
    rank = sharded.full.shape.rank
    if rank is None or sharded.axis >= rank - 2:
        return None
    return broadcast(ctx, sharded, y if first is not None else x, name, compute,
                     first is not None)


def redistributed(ctx, sharded: ShardedTensor, begin: int, size: int):
    """Entries ``begin`` to ``begin + size`` of the split axis, split anew:
    device i gets its share of them (``ctx.widths``), each made of the
    pieces of the shards that hold them (sliced where they are, joined on
    device i)."""
    widths = _widths(sharded)
    bounds = [sum(widths[:j]) for j in range(len(widths) + 1)]
    shards, start = [], begin
    for i, (width, device) in enumerate(zip(ctx.widths(size), ctx.devices)):
        pieces = []
        for j, source in enumerate(sharded.shards):
            low, high = max(start, bounds[j]), min(start + width, bounds[j + 1])
            if low < high:
                with ops.device(ctx.devices[j]), _own_scope(j):
                    pieces.append(slice_along(source, sharded.axis, low - bounds[j], high - low))
        with ops.device(device), _own_scope(i):
            shards.append(pieces[0] if len(pieces) == 1
                          else array_ops.concat(pieces, sharded.axis))
        start += width
    return ctx.sharded(shards, sharded.axis)
