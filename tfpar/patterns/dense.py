"""Sharding patterns for a dense layer ``act(x @ W + b)`` (Whale Fig. 6).

* ``column`` (Whale SP1): W split by columns; device i computes output columns
  i from the whole input. Output split on its last dimension; the backward pass
  sums the input gradient over devices.
* ``row`` (Whale SP2): W split by rows; device i multiplies input columns i (a
  local slice, or the shards of a column-split input: column then row needs no
  gather, as in Megatron) and the partial products are summed. Output whole.

Costs are float32 bytes per batch row moved between devices.
"""
from tensorflow.python.framework import dtypes, ops
from tensorflow.python.ops import math_ops

from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.sharded import sharded_variable

__all__ = ["COLUMN", "DENSE_PATTERNS", "ROW", "dense_unit"]


class _Column:
    name = "column"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return unit.kind == "dense"

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        gather = unit.sizes["in"] if unit.inputs[0].axis is not None else 0
        return 4.0 * (gather + unit.sizes["in"])  # gather input; all-reduce its gradient

    @staticmethod
    def build(ctx, layer, x, getter):
        units, d_in = layer.units, int(x.shape[-1])
        kernel = sharded_variable(ctx, "kernel", [d_in, units], 1, _dtype(layer, x),
                                  layer.kernel_initializer, getter=getter)
        bias = sharded_variable(ctx, "bias", [units], 0, _dtype(layer, x),
                                layer.bias_initializer, getter=getter) if layer.use_bias else None
        biases = list(bias) if bias is not None else [None] * ctx.size
        shards = []
        for device, kernel_i, bias_i in zip(ctx.devices, kernel, biases):
            with ops.device(device):
                y = math_ops.matmul(x, kernel_i)
                if bias_i is not None:
                    y = y + bias_i
                shards.append(layer.activation(y) if layer.activation is not None else y)
        return ctx.sharded(shards, -1)


class _Row:
    name = "row"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return unit.kind == "dense" and unit.inputs[0].axis in (None, len(unit.inputs[0].dims) - 1)

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        gather = unit.sizes["in"] if unit.inputs[0].axis is None else 0
        return 4.0 * (unit.sizes["out"] + gather)  # all-reduce output; gather input gradient

    @staticmethod
    def build(ctx, layer, x, getter):
        units, d_in = layer.units, int(x.shape[-1])
        dtype = _dtype(layer, x)
        kernel = list(sharded_variable(ctx, "kernel", [d_in, units], 0, dtype,
                                       layer.kernel_initializer, getter=getter))
        sharded = ctx.lookup(x)
        partials = []
        offset = 0
        for i, device in enumerate(ctx.devices):
            rows = int(kernel[i].shape[0])
            with ops.device(device):
                x_i = sharded.shards[i] if sharded is not None else x[..., offset:offset + rows]
                partials.append(math_ops.matmul(x_i, kernel[i]))
            offset += rows
        with ops.device(ctx.devices[0]):
            y = math_ops.add_n(partials)
            if layer.use_bias:
                y = y + getter("bias", shape=[units], dtype=dtype,
                               initializer=layer.bias_initializer)
            return layer.activation(y) if layer.activation is not None else y


def _dtype(layer, x):
    """The layer's variable dtype (keras stores a name) or the input's."""
    return dtypes.as_dtype(layer.dtype) if layer.dtype else x.dtype


COLUMN, ROW = _Column(), _Row()
DENSE_PATTERNS = (COLUMN, ROW)


def dense_unit(ctx, layer, x) -> ShardingUnit:
    """The ShardingUnit of calling ``layer`` on ``x``."""
    return ShardingUnit(ctx.unit_name(layer.name), "dense", (ctx.info(x),),
                        {"in": int(x.shape[-1]), "out": layer.units})
