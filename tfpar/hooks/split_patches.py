"""Hooks that turn TensorFlow calls inside a ``wh.split`` scope into
ShardingUnits (Whale §3.2.2): each wrapper asks the matcher for a pattern and
builds its distributed implementation; outside split scopes, or for inputs
the patterns do not cover, the original TensorFlow function runs. Keras
layers are ``split_layer_patches``'.

* ``gen_nn_ops`` softmax cross-entropy (sparse and dense; every ``tf.nn`` and
  ``tf.compat.v1.losses`` variant ends there) on class-split logits;
* ``gen_math_ops.arg_max`` (``tf.argmax``) over the split dimension;
* ``VariableScope.get_variable``: a variable made inside a split scope without a
  partitioner is split along its first dimension (a ``ShardedVariable``), or
  a matrix along its last where a pinned plan splits its scope by columns,
  keeping its regularizer and constraint;
* ``_VariableStore._get_single_variable``: while a sharded variable is made,
  TensorFlow builds each slice here; the slice goes to its shard's device and is
  recorded in the SplitContext's side table (shard identity comes from the
  slice's offset, never from its name);
* ``variable_scope._iter_slices``: the slices of a sharded variable are its
  SplitContext's widths (in proportion to its devices' speeds when they are
  mixed), not TensorFlow's even cut;
* ``gen_array_ops.gather_v2`` (``tf.gather``, ``tf.nn.embedding_lookup``) on a
  row-split table: vocabulary-sharded lookup;
* ``gen_math_ops.mat_mul`` (``tf.matmul``) and ``gen_linalg_ops.einsum``
  (``tf.einsum``) on split operands: contraction patterns;
* elementwise activations (relu, tanh, sigmoid, ``tf.nn.silu``, negation) of a split
  tensor act on its shards, so it stays split (along the sequence too:
  ``sequence_patches`` keeps the rest of a sequence-parallel region split);
* products, quotients, sums and differences of two tensors split alike
  along their features (SwiGLU's ``silu(gate) * up`` of two column-split
  layers), or of a split tensor and one constant along its split axis (an
  attention scale or mask), act on their shards too, so the row-split layer
  after them reads the shards;
* attention built from raw ops stays split by heads (``head_patches``).
"""
import functools
import inspect

from tfpar.compat import tf as internals
from tfpar.compat.tf import (context, gen_array_ops, gen_linalg_ops, gen_math_ops, gen_nn_ops,
                             math_ops, ops, silu_exports, special_math_ops, tensor_util,
                             variable_scope)
from tfpar.errors import ShardingError
from tfpar.hooks.head_patches import add_head_patches
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.sequence_patches import add_sequence_patches
from tfpar.hooks.split_layer_patches import add_split_layer_patches
from tfpar.hooks.split_scope import open_split_context
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns import heads, moe
from tfpar.patterns.argmax import sharded_argmax
from tfpar.patterns.contraction import (CONTRACTION_PATTERNS, GATHER as GATHER_OPERANDS,
                                        contraction_unit, sharded_contraction)
from tfpar.patterns.embedding import vocab_lookup
from tfpar.patterns.matcher import choose
from tfpar.patterns.sharded import creation_slices, on_each_device, shard_being_created
from tfpar.patterns.sharded_variable import ShardedVariable, sharded_variable
from tfpar.patterns.softmax_xent import GATHER, XENT_PATTERNS, softmax_xent

__all__ = ["add_split_patches"]


def add_split_patches(patches: PatchSet) -> None:
    add_split_layer_patches(patches)
    add_sequence_patches(patches)
    patches.add(gen_nn_ops, "sparse_softmax_cross_entropy_with_logits",
                lambda original: _wrap_xent(original, sparse=True))
    patches.add(gen_nn_ops, "softmax_cross_entropy_with_logits",
                lambda original: _wrap_xent(original, sparse=False))
    patches.add(gen_math_ops, "arg_max", _wrap_arg_max)
    patches.add(variable_scope.VariableScope, "get_variable", _wrap_get_variable)
    patches.add(internals.variable_store_class(), "_get_single_variable", _wrap_get_single_variable)
    patches.add(variable_scope, "_iter_slices", _wrap_iter_slices)
    patches.add(gen_array_ops, "gather_v2", _wrap_gather)
    patches.add(gen_math_ops, "mat_mul", _wrap_mat_mul)
    patches.add(gen_linalg_ops, "einsum", _wrap_einsum)
    for module, name in ((gen_nn_ops, "relu"), (gen_math_ops, "tanh"),
                         (gen_math_ops, "sigmoid"), (gen_math_ops, "neg")):
        patches.add(module, name, _wrap_elementwise)
    for module, name in silu_exports():
        patches.add(module, name, _wrap_silu)
    for name in ("add_v2", "sub", "mul", "real_div"):
        patches.add(gen_math_ops, name, _wrap_binary)
    add_head_patches(patches)


def _wrap_xent(original, sparse: bool):
    kind = "sparse_softmax_xent" if sparse else "softmax_xent"

    def xent(features, labels, name=None):
        ctx = open_split_context()
        sharded = ctx.lookup(features) if ctx is not None else None
        if sharded is None:
            return original(features, labels, name=name)
        unit = ShardingUnit(ctx.unit_name(kind), kind, (ctx.info(features), ctx.info(labels)),
                            {"classes": sum(int(x.shape[-1]) for x in sharded.shards)})
        if choose(ctx, unit, XENT_PATTERNS) is GATHER:
            return original(features, labels, name=name)
        with ctx.building():
            loss = softmax_xent(ctx, sharded, labels, sparse)
        return loss, None  # callers use the loss; gradients flow through its ops
    return xent


def _wrap_arg_max(original):
    def arg_max(input, dimension, output_type=None, name=None):  # pylint: disable=redefined-builtin
        ctx = open_split_context()
        sharded = ctx.lookup(input) if ctx is not None else None
        axis = dimension if isinstance(dimension, int) else tensor_util.constant_value(dimension)
        if sharded is None or axis is None or int(axis) % input.shape.rank != sharded.axis:
            return original(input, dimension, output_type=output_type, name=name)
        ctx.decisions[ctx.unit_name("argmax")] = "sharded"
        with ctx.building():
            return sharded_argmax(ctx, sharded, output_type)
    return arg_max


def _wrap_get_variable(original):
    signature = inspect.signature(original)

    def get_variable(self, var_store, name, shape=None, dtype=None, initializer=None,
                     *args, partitioner=None, **kwargs):
        ctx = open_split_context()
        rank = len(shape) if shape is not None else getattr(initializer, "ndim", 0)
        if ctx is None or partitioner is not None or not rank:
            return original(self, var_store, name, shape, dtype, initializer, *args,
                            partitioner=partitioner, **kwargs)
        given = signature.bind(self, var_store, name, shape, dtype, initializer, *args,
                               **kwargs).arguments
        for key in ("self", "var_store", "name", "shape", "dtype", "initializer"):
            given.pop(key)
        full_name = f"{self.name}/{name}" if self.name else name
        if ops.get_default_graph().building_function:
            raise ShardingError(
                f"tfpar: variable '{full_name}' is made with tf.compat.v1.get_variable inside "
                "wh.split in a TF2 tf.function; tfpar splits keras Dense layers there. Use "
                "tf.keras.layers.Dense, or build the model in graph mode")
        axis = rank - 1 if rank == 2 and ctx.forced_pattern(self.name) == "column" else 0
        with ctx.building():
            partitioned = sharded_variable(
                ctx, name, initializer.shape if shape is None else shape, axis, dtype,
                initializer, getter=functools.partial(original, self, var_store),
                owner=f"variable '{full_name}': constraint", **given)
        return ShardedVariable(partitioned, ctx, axis)
    return get_variable


def _wrap_get_single_variable(original):
    """A slice of a sharded variable being made is built on its shard's device
    and recorded (``SplitContext.shard_index``)."""
    def _get_single_variable(self, *args, partition_info=None, **kwargs):
        slot = shard_being_created(partition_info)
        if slot is None:
            return original(self, *args, partition_info=partition_info, **kwargs)
        creation, index = slot
        with ops.device(creation.ctx.devices[index]):
            variable = original(self, *args, partition_info=partition_info, **kwargs)
        creation.record(variable, index)
        return variable
    return _get_single_variable


def _wrap_iter_slices(original):
    """The slices of a sharded variable being made are its SplitContext's
    (uneven on mixed devices), not TensorFlow's even ones."""
    def iter_slices(full_shape, num_slices, slice_dim):
        slices = creation_slices(full_shape, slice_dim, num_slices)
        return iter(slices) if slices is not None else original(full_shape, num_slices,
                                                                  slice_dim)
    return iter_slices


def _wrap_gather(original):
    def gather_v2(params, indices, axis, batch_dims=0, name=None):
        ctx = open_split_context()
        if ctx is not None:
            params = _read(params)
        sharded = ctx.lookup(params) if ctx is not None else None
        if sharded is None or sharded.axis != 0 or batch_dims or _constant(axis) != 0:
            return original(params, indices, axis, batch_dims=batch_dims, name=name)
        ctx.decisions[ctx.unit_name("embedding")] = "vocab"
        with ctx.building():
            return vocab_lookup(ctx, sharded, indices)
    return gather_v2


def _constant(x):
    return x if isinstance(x, int) else tensor_util.constant_value(x)


def _wrap_mat_mul(original):
    def mat_mul(a, b, transpose_a=False, transpose_b=False, name=None, **hints):
        # hints: TensorFlow 2.16+'s grad_a / grad_b (which operand of a forward
        # matmul's this is the gradient of: a hint to kernels, not to the value)
        equation = ("ki" if transpose_a else "ik") + "," + ("jk" if transpose_b else "kj") + "->ij"
        return _contraction(
            "matmul", equation, [a, b],
            lambda x, y: math_ops.matmul(x, y, transpose_a=transpose_a, transpose_b=transpose_b),
            lambda: original(a, b, transpose_a=transpose_a, transpose_b=transpose_b, name=name,
                             **hints))
    return mat_mul


def _wrap_einsum(original):
    def einsum(inputs, equation, name=None):
        return _contraction(
            "einsum", equation.replace(" ", ""), list(inputs),
            lambda *xs: special_math_ops.einsum(equation, *xs),
            lambda: original(inputs, equation, name=name))
    return einsum


def _read(x):
    """tf.gather and tf.einsum hand variables to the gen op unconverted."""
    return x.value() if isinstance(x, ShardedVariable) else x


def _contraction(kind, equation, operands, compute, fallback):
    ctx = open_split_context()
    if ctx is None:
        return fallback()
    operands = [_read(x) for x in operands]
    if not any(ctx.lookup(x) is not None for x in operands):
        return _dispatch(ctx, kind, equation, operands, fallback)
    unit = contraction_unit(ctx, kind, equation, operands)
    pattern = choose(ctx, unit, CONTRACTION_PATTERNS)
    if pattern is GATHER_OPERANDS:
        return fallback()
    with ctx.building():
        if pattern is moe.TOKENS:
            index = unit.sizes["split_operand"]
            return moe.tokens_combine(ctx, equation, operands, index,
                                      ctx.lookup(operands[index]), unit.sizes["token"])
        return sharded_contraction(ctx, equation, operands, compute)


def _dispatch(ctx, kind, equation, operands, fallback):
    """An einsum of whole operands in a split scope: a mixture-of-experts
    dispatch may send token rows to their experts' devices (all-to-all)."""
    indices = moe.dispatch_indices(equation, operands) if kind == "einsum" else None
    if indices is None:
        return fallback()
    unit = moe.dispatch_unit(ctx, equation, operands, indices[0])
    if choose(ctx, unit, moe.DISPATCH_PATTERNS) is not moe.TOKENS:
        return fallback()
    with ctx.building():
        return moe.tokens_dispatch(ctx, equation, operands[0], operands[1], *indices)


def _wrap_elementwise(original):
    def elementwise(x, name=None):
        ctx = open_split_context()
        sharded = ctx.lookup(x, sequence=True) if ctx is not None else None
        if sharded is None:
            return original(x, name=name)
        return _on_shards(ctx, [sharded], sharded, original)
    return elementwise


def _wrap_silu(original):
    """``tf.nn.silu`` opens no name scope: a pinned plan's layer is found by
    the name of its first op with rows (``beta * features``: ``mul``). Each
    shard runs silu itself, with its custom gradient."""
    def silu(features, beta=1.0):
        graph = ops.get_default_graph()
        ctx = open_split_context(graph.unique_name("mul", mark_as_used=False))
        sharded = ctx.lookup(features, sequence=True) if ctx is not None else None
        if sharded is None:
            return original(features, beta)
        return _on_shards(ctx, [sharded], sharded, lambda shard: original(shard, beta))
    return silu


def _wrap_binary(original):
    """Outside the sequence-parallel patch of the same ops: it sees only
    what this leaves whole. Two tensors split alike act shard by shard; one
    split tensor and one constant along its split axis (a scale, a mask)
    too (``heads.broadcast``)."""
    def binary(x, y, name=None):
        if context.executing_eagerly():  # no split scope: the hot path of eager code
            return original(x, y, name=name)
        ctx = open_split_context()
        pair = [ctx.lookup(t) for t in (x, y)] if ctx is not None else [None, None]
        if None not in pair and _alike(*pair):
            return _on_shards(ctx, pair, pair[0], original)
        if pair.count(None) != 1:
            return original(x, y, name=name)
        first = pair[0] is not None
        with ctx.building():
            result = heads.broadcast(ctx, pair[0] if first else pair[1], y if first else x,
                                     name, original, first)
        if result is None:
            return original(x, y, name=name)
        ctx.forced_pattern(ops.get_default_graph().get_name_scope())  # a planned heads layer
        return result
    return binary


def _alike(a, b) -> bool:
    """Whether ``a`` and ``b`` are split along the same feature axis into
    shards of the same shapes (elementwise on shards is then exact)."""
    shapes = [[s.shape.as_list() if s.shape.rank is not None else None for s in t.shards]
              for t in (a, b)]
    return (not a.sequence and not b.sequence and a.axis == b.axis
            and None not in shapes[0] and shapes[0] == shapes[1])


def _on_shards(ctx, operands, lead, compute):
    """``compute`` of the i-th shards of ``operands`` on device i: the full
    view of the result, split as ``lead``. The first shard's ops take the
    names a whole op would (those a pinned plan knows them by), the others'
    a name scope of their own."""
    with ctx.building():
        shards = on_each_device(ctx, None, lambda *parts: compute(*parts[:-1]),
                                *(operand.shards for operand in operands))
        return ctx.sharded(shards, lead.axis, lead.sequence)
