"""Sequence parallelism (Korthikanti et al. 2022, §4.2.2), ``split.sequence_parallel``.

Inside a split TaskGraph, the output of a row-parallel layer is a sum of
per-device partial products. Instead of summing them whole on one device, a
reduce-scatter leaves device i with the sum of the partials' sequence slice i
(``reduce_scatter``): a tensor split along its sequence (axis 1). Residual
adds, elementwise ops, ``LayerNormalization`` over the last axis and
``Dropout`` then run on each device's slice (``per_shard``, ``binary``); a
column-parallel layer reading it concatenates the slices on each of its
devices (an all-gather, ``SplitContext.local``), and anything else reads the
full view (the split bridge). Each device sends and receives the same bytes as
in one all-reduce of the whole output, and keeps 1/t of those regions'
activations.
"""
from typing import Callable, List, Optional, Sequence, Tuple

from tfpar.compat.tf import math_ops, ops
from tfpar.patterns.sharded import pieces_alongside, slice_along

__all__ = ["applies", "binary", "per_shard", "reduce_scatter"]


def applies(ctx, output_shape) -> bool:
    """Whether a row-parallel output of ``output_shape`` is reduce-scattered:
    sequence parallelism is on, the output has a sequence axis (rank >= 3,
    axis 1) of a known length with a position for every device."""
    rank = output_shape.rank
    return bool(ctx.sequence_parallel and rank is not None and rank >= 3
                and output_shape[1] is not None and int(output_shape[1]) >= ctx.size)


def reduce_scatter(ctx, partials: Sequence[Tuple[int, object]], finish: Callable):
    """``partials``: (device index, partial product on that device). Device
    i sums every partial's sequence slice i (each slice cut on its partial's
    device) and applies ``finish`` (bias, activation) to the sum; returns the
    full view of the result, split along the sequence."""
    length = int(partials[0][1].shape[1])
    widths = ctx.widths(length)
    offsets = [sum(widths[:i]) for i in range(ctx.size)]
    pieces: List[List] = [[] for _ in range(ctx.size)]
    for index, partial in partials:
        with ops.device(ctx.devices[index]):
            for i, (offset, width) in enumerate(zip(offsets, widths)):
                pieces[i].append(slice_along(partial, 1, offset, width))
    shards = []
    for i, device in enumerate(ctx.devices):
        with ops.device(device):
            shards.append(finish(math_ops.add_n(pieces[i])))
    return ctx.sharded(shards, 1, sequence=True)


def per_shard(ctx, x, compute: Callable) -> Optional[object]:
    """``compute`` on each device's sequence slice of ``x``, on that device;
    the result's full view, or None when ``x`` is not split along the
    sequence."""
    sharded = ctx.lookup(x, sequence=True)
    if sharded is None or not sharded.sequence:
        return None
    shards = []
    for shard, device in zip(sharded.shards, ctx.devices):
        with ops.device(device):
            shards.append(compute(shard))
    return ctx.sharded(shards, 1, sequence=True)


def binary(ctx, compute: Callable, x, y) -> Optional[object]:
    """``compute(x, y)`` (broadcasting elementwise) on each device's sequence
    slice, when one operand is split along the sequence and the other is too
    (alike), or can be cut along it, or broadcasts along it; else None."""
    found = [ctx.lookup(t, sequence=True) for t in (x, y)]
    found = [s if s is not None and s.sequence else None for s in found]
    lead = next((s for s in found if s is not None), None)
    if lead is None:
        return None
    widths = [int(s.shape[1]) for s in lead.shards]
    operands = []
    for t, sharded in zip((x, y), found):
        if sharded is not None and [int(s.shape[1]) for s in sharded.shards] != widths:
            return None
        parts = (sharded.shards if sharded is not None
                 else pieces_alongside(ctx, t, lead.full, 1, widths))
        if parts is None:
            return None
        operands.append(parts)
    shards = []
    for a, b, device in zip(*operands, ctx.devices):
        with ops.device(device):
            shards.append(compute(a, b))
    return ctx.sharded(shards, 1, sequence=True)
