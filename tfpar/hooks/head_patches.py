"""Hooks that keep attention built from raw ops split by heads inside a
``wh.split`` scope (``patterns/heads.py``; Megatron-LM §3): reshapes into
heads and back, transposes, batched matmuls (``Q K^T``, ``P V``), softmax,
``tf.split`` of a column-split fused projection, and the splits, unstacks,
strided slices and concats along other axes that heads-interleaved q/k/v
and rotary embeddings use. On anything else, on whole tensors, or outside
split scopes, TensorFlow's own op runs (on the gathered tensor: always
correct, not parallel).

A pinned plan's attention-core layers (``auto.split_heads``) are matched by
the op names built here; each batched matmul built per head is recorded as
ShardingUnit ``heads`` under its op's name.
"""
import functools

from tfpar.compat.tf import (context, gen_array_ops, gen_math_ops, gen_nn_ops, ops,
                             tensor_util)
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.split_scope import open_split_context
from tfpar.patterns import heads

__all__ = ["add_head_patches"]


def add_head_patches(patches: PatchSet) -> None:
    patches.add(gen_array_ops, "reshape", _wrap_reshape)
    patches.add(gen_array_ops, "transpose", _wrap_transpose)
    patches.add(gen_nn_ops, "softmax", _wrap_softmax)
    patches.add(gen_array_ops, "split", _wrap_split)
    patches.add(gen_array_ops, "split_v", _wrap_split_v)
    patches.add(gen_array_ops, "unpack", _wrap_unpack)
    patches.add(gen_array_ops, "strided_slice", _wrap_strided_slice)
    patches.add(gen_array_ops, "concat_v2", _wrap_concat)
    for name in ("batch_mat_mul_v2", "batch_mat_mul_v3"):
        if hasattr(gen_math_ops, name):
            patches.add(gen_math_ops, name, _wrap_batch_matmul)


def _split_input(x, op_name):
    """(SplitContext, the split form of ``x``, the full name of the op about
    to be made) in a split scope when ``x`` is split along a feature axis,
    else (None, None, None). ``op_name``: the op's name when the call gives
    none (TensorFlow opens no name scope for these ops: a planned layer is
    found by the op's own name)."""
    if context.executing_eagerly():  # no split scope: the hot path of eager code
        return None, None, None
    name = _op_name(op_name)
    ctx = open_split_context(name)
    sharded = ctx.lookup(x) if ctx is not None else None
    return (ctx, sharded, name) if sharded is not None else (None, None, None)


def _op_name(name: str) -> str:
    """The full name of an op about to be made with ``name`` (a name scope
    of its own, ending in "/", when the op's wrapper opened one)."""
    if name.endswith("/"):
        return name[:-1]
    return ops.get_default_graph().unique_name(name, mark_as_used=False)


def _built(ctx, unit, build, whole):
    """``build()`` while ``ctx`` builds; ``whole()`` when ``ctx`` is None or
    ``build`` returns None. What was built marks a pinned plan's layer
    ``unit`` (split by heads) as built so."""
    if ctx is None:
        return whole()
    with ctx.building():
        result = build()
    if result is None:
        return whole()
    ctx.forced_pattern(unit)
    return result


def _wrap_reshape(original):
    def reshape(tensor, shape, name=None):
        ctx, sharded, unit = _split_input(tensor, name or "Reshape")
        return _built(ctx, unit, lambda: heads.reshaped(ctx, sharded, shape, name, original),
                      lambda: original(tensor, shape, name=name))
    return reshape


def _wrap_transpose(original):
    def transpose(x, perm, name=None):
        ctx, sharded, unit = _split_input(x, name or "transpose")
        return _built(ctx, unit, lambda: heads.transposed(
            ctx, sharded, perm, name, lambda shard, local: original(shard, perm, name=local)),
            lambda: original(x, perm, name=name))
    return transpose


def _wrap_softmax(original):
    def softmax(logits, name=None):
        ctx, sharded, unit = _split_input(logits, name or "Softmax")
        last = sharded is not None and sharded.axis == sharded.full.shape.rank - 1
        return _built(None if last else ctx, unit,
                      lambda: heads.per_shard(ctx, sharded, name, original),
                      lambda: original(logits, name=name))
    return softmax


def _wrap_split(original):
    """``tf.split(value, n, axis)``: see ``_split_pieces``."""
    def split(axis, value, num_split, name=None):
        return _split_pieces(
            value, axis, name, lambda width: [width // num_split] * num_split
            if width % num_split == 0 else None,
            lambda x, along, local: original(along, x, num_split, name=local),
            functools.partial(original, axis, value, num_split, name=name))
    return split


def _wrap_split_v(original):
    """``tf.split(value, [sizes], axis)`` (Llama's fused ``qkv`` of grouped
    heads: q's width, then k's and v's): see ``_split_pieces``."""
    def split_v(value, size_splits, axis, num_split, name=None):
        def widths(width):
            sizes = tensor_util.constant_value(size_splits)
            if sizes is None or list(sizes).count(-1) > 1:
                return None
            sizes = [int(s) for s in sizes]
            return [width - sum(s for s in sizes if s >= 0) if s < 0 else s for s in sizes]
        return _split_pieces(
            value, axis, name, widths,
            lambda x, along, local: original(x, size_splits, along, num_split, name=local),
            functools.partial(original, value, size_splits, axis, num_split, name=name))
    return split_v


def _split_pieces(value, axis, name, widths, split, whole):
    """A split (op ``name``) of ``value`` along ``axis``: along the split
    axis (a fused ``qkv``), each piece (``widths(full width)``) re-cut by
    heads (``heads.redistributed``); along another, ``split(shard, axis,
    name)`` on each shard; else ``whole()``."""
    ctx, sharded, unit = _split_input(value, name or "split")
    along = tensor_util.constant_value(axis) if ctx is not None else None
    if along is None:
        return whole()
    along = int(along) % sharded.full.shape.rank
    if along != sharded.axis:
        return _built(ctx, unit, lambda: heads.split_alongside(
            ctx, sharded, name, lambda shard, local: split(shard, along, local)), whole)
    size = sharded.full.shape[along]
    pieces = widths(int(size)) if size is not None else None
    if pieces is None:
        return whole()
    starts = [sum(pieces[:k]) for k in range(len(pieces))]
    return _built(ctx, unit, lambda: [heads.redistributed(ctx, sharded, start, width)
                                      for start, width in zip(starts, pieces)], whole)


def _wrap_unpack(original):
    """``tf.unstack`` along another axis than the split one, on each shard."""
    def unpack(value, num, axis=0, name=None):
        ctx, sharded, unit = _split_input(value, name or "unstack")
        along = axis % sharded.full.shape.rank if ctx is not None else None
        if ctx is None or along == sharded.axis:
            return original(value, num, axis=axis, name=name)
        return _built(ctx, unit, lambda: heads.split_alongside(
            ctx, sharded, name, lambda shard, local: original(shard, num, axis=axis, name=local),
            sharded.axis - (along < sharded.axis)),
            lambda: original(value, num, axis=axis, name=name))
    return unpack


def _wrap_strided_slice(original):
    """``t[:, :, i]`` keeping the split axis whole, on each shard."""
    def strided_slice(input, begin, end, strides,  # pylint: disable=redefined-builtin
                      begin_mask=0, end_mask=0, ellipsis_mask=0, new_axis_mask=0,
                      shrink_axis_mask=0, name=None):
        masks = dict(begin_mask=begin_mask, end_mask=end_mask, ellipsis_mask=ellipsis_mask,
                     new_axis_mask=new_axis_mask, shrink_axis_mask=shrink_axis_mask)
        whole = functools.partial(original, input, begin, end, strides, name=name, **masks)
        ctx, sharded, unit = _split_input(input, name or "strided_slice")
        steps = tensor_util.constant_value(strides) if ctx is not None else None
        axis = None if steps is None else heads.sliced_axis(
            sharded.full.shape.rank, sharded.axis, [int(s) for s in steps], **masks)
        if axis is None:
            return whole()
        return _built(ctx, unit, lambda: heads.per_shard(
            ctx, sharded, name, lambda shard, local: original(shard, begin, end, strides,
                                                              name=local, **masks), axis), whole)
    return strided_slice


def _wrap_concat(original):
    """``tf.concat`` of tensors split alike, along another axis, on each
    shard (a rotary embedding's rotated halves)."""
    def concat_v2(values, axis, name=None):
        whole = functools.partial(original, values, axis, name=name)
        if context.executing_eagerly():
            return whole()
        unit = _op_name(name or "concat")
        ctx = open_split_context(unit)
        parts = [ctx.lookup(v) for v in values] if ctx is not None else [None]
        along = tensor_util.constant_value(axis) if None not in parts else None
        if along is None:
            return whole()
        along = int(along) % parts[0].full.shape.rank
        return _built(ctx, unit, lambda: heads.joined(
            ctx, parts, along, name, lambda shards, local: original(shards, along, name=local)),
            whole)
    return concat_v2


def _wrap_batch_matmul(original):
    def batch_matmul(x, y, adj_x=False, adj_y=False, name=None, **kwargs):
        whole = functools.partial(original, x, y, adj_x=adj_x, adj_y=adj_y, name=name, **kwargs)
        if context.executing_eagerly():
            return whole()
        unit = _op_name(name or "MatMul")
        ctx = open_split_context(unit)
        if ctx is None or (ctx.lookup(x) is None and ctx.lookup(y) is None):
            return whole()
        result = _built(ctx, unit, lambda: heads.batch_matmul(ctx, x, y, name, lambda a, b, local:
                        original(a, b, adj_x=adj_x, adj_y=adj_y, name=local, **kwargs)), whole)
        if ctx.lookup(result) is not None:
            ctx.decisions[ctx.unit_name(unit)] = "heads"
        return result
    return batch_matmul
