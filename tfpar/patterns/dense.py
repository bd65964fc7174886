"""Sharding patterns for a dense layer ``act(x @ W + b)`` (Whale Fig. 6).

* ``column`` (Whale SP1): W split by columns; device i computes output columns
  i from the whole input. Output split on its last dimension; the backward pass
  sums the input gradient over devices.
* ``row`` (Whale SP2): W split by rows; device i multiplies input columns i (a
  local slice, or the shards of a column-split input: column then row needs no
  gather, as in Megatron) and the partial products are summed. Output whole,
  or, with ``split.sequence_parallel``, split along its sequence
  (``sequence.py``: the sum is a reduce-scatter).

The layer's weights keep its regularizers and constraints (``weights.py``); a
pattern matches only if it splits no axis a constraint needs whole.

Costs are float32 bytes per batch row moved between devices.
"""
import dataclasses

from tfpar.compat.tf import dtypes, math_ops, ops
from tfpar.errors import ShardingError
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns import sequence
from tfpar.patterns.matcher import choose
from tfpar.patterns.weights import describe, keeps_whole, whole_axes

__all__ = ["COLUMN", "DENSE_PATTERNS", "ROW", "choose_dense", "dense_unit"]

# A pattern's ``build(ctx, layer, x, getter)`` gets its weights from
# ``getter(name, shape, dtype, initializer, axis, regularizer=, constraint=)``:
# the layer's weight ``name`` split along ``axis`` (None: whole), made once.


class _Column:
    name = "column"
    splits = {"kernel": 1, "bias": 0}

    def matches(self, unit: ShardingUnit) -> bool:
        return unit.kind == "dense" and keeps_whole(unit, self.splits)

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        gather = unit.sizes["in"] if unit.inputs[0].axis is not None else 0
        return 4.0 * (gather + unit.sizes["in"])  # gather input; all-reduce its gradient

    @staticmethod
    def build(ctx, layer, x, getter):
        units, d_in, dtype = layer.units, int(x.shape[-1]), _dtype(layer, x)
        kernel = getter("kernel", [d_in, units], dtype, layer.kernel_initializer, 1,
                        regularizer=layer.kernel_regularizer, constraint=layer.kernel_constraint)
        bias = getter("bias", [units], dtype, layer.bias_initializer, 0,
                      regularizer=layer.bias_regularizer,
                      constraint=layer.bias_constraint) if layer.use_bias else None
        biases = list(bias) if bias is not None else [None] * ctx.size
        shards = []
        for kernel_i, bias_i in zip(kernel, biases):
            index = ctx.shard_index(kernel_i)
            with ops.device(ctx.devices[index]):
                y = math_ops.matmul(ctx.local(x, index), kernel_i)
                if bias_i is not None:
                    y = y + bias_i
                shards.append(layer.activation(y) if layer.activation is not None else y)
        return ctx.sharded(shards, -1)


class _Row:
    name = "row"
    splits = {"kernel": 0}

    def matches(self, unit: ShardingUnit) -> bool:
        return (unit.kind == "dense" and keeps_whole(unit, self.splits)
                and unit.inputs[0].axis in (None, len(unit.inputs[0].dims) - 1))

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        gather = unit.sizes["in"] if unit.inputs[0].axis is None else 0
        return 4.0 * (unit.sizes["out"] + gather)  # all-reduce output; gather input gradient

    @staticmethod
    def build(ctx, layer, x, getter):
        units, d_in, dtype = layer.units, int(x.shape[-1]), _dtype(layer, x)
        kernel = list(getter("kernel", [d_in, units], dtype, layer.kernel_initializer, 0,
                             regularizer=layer.kernel_regularizer,
                             constraint=layer.kernel_constraint))
        sharded = ctx.lookup(x)
        partials = []
        offset = 0
        for kernel_i in kernel:
            index, rows = ctx.shard_index(kernel_i), int(kernel_i.shape[0])
            with ops.device(ctx.devices[index]):
                x_i = (sharded.shards[index] if sharded is not None
                       else ctx.local(x, index)[..., offset:offset + rows])
                partials.append((index, math_ops.matmul(x_i, kernel_i)))
            offset += rows
        with ops.device(ctx.devices[0]):
            bias = getter("bias", [units], dtype, layer.bias_initializer, None,
                          regularizer=layer.bias_regularizer,
                          constraint=layer.bias_constraint) if layer.use_bias else None

        def finish(y):
            y = y + bias if bias is not None else y
            return layer.activation(y) if layer.activation is not None else y
        if sequence.applies(ctx, partials[0][1].shape):
            return sequence.reduce_scatter(ctx, partials, finish)
        with ops.device(ctx.devices[0]):
            return finish(math_ops.add_n([p for _, p in partials]))


def _dtype(layer, x):
    """The layer's variable dtype (keras stores a name) or the input's."""
    return dtypes.as_dtype(layer.dtype) if layer.dtype else x.dtype


COLUMN, ROW = _Column(), _Row()
DENSE_PATTERNS = (COLUMN, ROW)


def dense_unit(ctx, layer, x) -> ShardingUnit:
    """The ShardingUnit of calling ``layer`` on ``x``; ``sizes["whole"]`` holds,
    per weight, the axes its constraint needs whole."""
    d_in, dtype = int(x.shape[-1]), _dtype(layer, x)
    whole = {"kernel": whole_axes(layer.kernel_constraint, [d_in, layer.units], dtype)}
    if layer.use_bias:
        whole["bias"] = whole_axes(layer.bias_constraint, [layer.units], dtype)
    return ShardingUnit(ctx.unit_name(_visible_name(layer)), "dense", (ctx.info(x),),
                        {"in": d_in, "out": layer.units, "whole": whole})


def _visible_name(layer) -> str:
    """The name users see in the layer's variables: a ``tf.compat.v1.layers``
    layer's variable scope (``dense_1`` while keras may call the object
    ``dense_2``), else the keras layer name."""
    scope = getattr(layer, "_scope", None)
    return scope.name if scope is not None else layer.name


def choose_dense(ctx, layer, x):
    """The pattern for calling ``layer`` on ``x``. A ShardingError names the
    layer and its constraints when they rule out every pattern, or the one
    ``split.patterns`` forces."""
    unit = dense_unit(ctx, layer, x)
    free = dataclasses.replace(unit, sizes={k: v for k, v in unit.sizes.items() if k != "whole"})
    forced = ctx.forced_pattern(unit.name)
    ruled_out = [p for p in DENSE_PATTERNS if p.matches(free) and not p.matches(unit)
                 and (forced is None or forced == p.name)]
    if ruled_out and (forced is not None or not any(p.matches(unit) for p in DENSE_PATTERNS)):
        constraint = {"kernel": layer.kernel_constraint, "bias": layer.bias_constraint}
        why = "; ".join(
            f"{p.name} splits {weight} axis {axis}"
            for p in ruled_out for weight, axis in p.splits.items()
            if axis in unit.sizes["whole"].get(weight, ()))
        needs = ", ".join(
            f"{weight}_constraint {describe(constraint[weight])} needs axes {list(axes)} whole"
            for weight, axes in unit.sizes["whole"].items() if axes)
        raise ShardingError(
            f"wh.split cannot shard layer '{layer.name}': its {needs} ({why}). Each shard "
            f"applies the constraint alone, so tfpar supports elementwise constraints (NonNeg, "
            f"clipping) and MaxNorm / MinMaxNorm / UnitNorm along an axis that is not split; "
            f"build this layer outside wh.split or change the constraint")
    return choose(ctx, unit, DENSE_PATTERNS)
