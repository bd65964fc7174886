"""Sharding patterns for a keras ``EinsumDense`` layer ``act(einsum(eq, x, W) + b)``
(Whale §3.2.2; the attention projections of Megatron-LM, Shoeybi et al. 2019, §3).

The equation's letters say what can be split:

* ``column``: W split along its first letter that the output keeps and the
  input lacks (``MultiHeadAttention``'s query, key and value ``abc,cde->abde``:
  the heads ``d``); each device computes its slice of the output from the whole
  input, and the output stays split along that letter. A bias holding the
  letter is split with it; another bias is added whole on every device.
  An input split along its sequence is gathered on each device first.
* ``row``: W split along a letter it contracts with the input (the attention
  output ``abcd,cde->abe``: the heads ``c``); each device contracts its slice
  of the input (its shard, when the input is split along that letter: column
  then row needs no gather) and the partial outputs are summed; the bias is
  added once. With ``split.sequence_parallel``, an output whose axis 1 comes
  from the input is reduce-scattered along it instead (``sequence.py``).
* ``whole``: an equation that offers neither (a per-feature scale
  ``abc,c->abc``), or weights too narrow for one slice per device, or
  constraints that need the axis whole: the layer computes as on one device,
  on the TaskGraph's first device, said by ``fall_back`` unless forced.

Costs are float32 bytes per batch row moved, as for the dense patterns.
"""
import dataclasses
import math
from typing import Dict, Optional

from tfpar.compat import keras as keras_internals
from tfpar.compat.tf import dtypes, math_ops, ops, special_math_ops, tensor_shape
from tfpar.fallback import fall_back
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns import sequence
from tfpar.patterns.matcher import choose
from tfpar.patterns.sharded import slice_along
from tfpar.patterns.weights import keeps_whole, whole_axes

__all__ = ["EINSUM_DENSE_PATTERNS", "choose_einsum_dense"]


@dataclasses.dataclass(frozen=True)
class _Equation:
    """An EinsumDense equation: input, kernel and output letters, and where
    the input's and output's dimensions elided by ``...`` are."""

    source: str
    kernel: str
    output: str

    @classmethod
    def parse(cls, equation: str) -> "_Equation":
        inputs, output = equation.replace(" ", "").split("->")
        source, kernel = inputs.split(",")
        return cls(source, kernel, output)

    @staticmethod
    def axis(spec: str, letter: str) -> int:
        """The axis of ``letter`` in a tensor of ``spec`` (negative after a
        leading ``...``)."""
        if spec.startswith("..."):
            rest = spec[3:]
            return rest.index(letter) - len(rest)
        return spec.replace("...", "").index(letter)

    def letter_at(self, axis: int, rank: int, spec: str = "") -> str:
        """The input's (or ``spec``'s) letter at ``axis`` of a rank-``rank``
        tensor, or '' (an axis ``...`` stands for)."""
        spec = spec or self.source
        letters = spec.replace("...", "")
        position = axis - (rank - len(letters)) if spec.startswith("...") else axis
        return letters[position] if 0 <= position < len(letters) else ""


def _shapes(layer, x):
    """(kernel shape, bias shape or None, full output shape), as keras'
    ``EinsumDense.build`` computes them."""
    return keras_internals.analyze_einsum_string(
        layer.equation, layer.bias_axes, tensor_shape.TensorShape(x.shape),
        layer.partial_output_shape)


def _bias_axis(layer, equation: _Equation, letter: str) -> Optional[int]:
    """The axis of the bias along ``letter`` (None: the bias lacks it)."""
    if not layer.bias_axes or letter not in layer.bias_axes:
        return None
    letters = equation.output.replace("...", "")
    return letters.index(letter) - min(letters.index(c) for c in layer.bias_axes)


def _dtype(layer, x):
    return dtypes.as_dtype(layer.dtype) if layer.dtype else x.dtype


class _Split:
    """``unit.sizes[name]``: weight -> the axis the pattern splits (None: no
    letter to split along)."""

    name = ""

    def matches(self, unit: ShardingUnit) -> bool:
        splits = unit.sizes[self.name]
        return splits is not None and keeps_whole(unit, splits)


class _Column(_Split):
    name = "column"

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        gather = unit.sizes["in"] if unit.inputs[0].axis is not None else 0
        return 4.0 * (gather + unit.sizes["in"])  # gather input; all-reduce its gradient

    @staticmethod
    def build(ctx, layer, x, getter, unit):
        letter, equation = unit.sizes["column_letter"], _Equation.parse(layer.equation)
        kernel, bias = _weights(layer, x, getter, unit.sizes["column"])
        biases = list(bias) if unit.sizes["column"].get("bias") is not None else [bias] * ctx.size
        shards = []
        for kernel_i, bias_i in zip(kernel, biases):
            index = ctx.shard_index(kernel_i)
            with ops.device(ctx.devices[index]):
                shards.append(_finish(layer, special_math_ops.einsum(
                    layer.equation, ctx.local(x, index), kernel_i), bias_i))
        return ctx.sharded(shards, _Equation.axis(equation.output, letter))


class _Row(_Split):
    name = "row"

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        gather = unit.sizes["in"] if unit.inputs[0].axis is None else 0
        return 4.0 * (unit.sizes["out"] + gather)  # all-reduce output; gather input gradient

    @staticmethod
    def build(ctx, layer, x, getter, unit):
        equation = _Equation.parse(layer.equation)
        axis = _Equation.axis(equation.source, unit.sizes["row_letter"]) % x.shape.rank
        kernel, bias = _weights(layer, x, getter, unit.sizes["row"])
        sharded = ctx.lookup(x)
        sharded = sharded if sharded is not None and sharded.axis == axis else None
        partials, offset = [], 0
        for kernel_i in kernel:
            index = ctx.shard_index(kernel_i)
            rows = int(kernel_i.shape[unit.sizes["row"]["kernel"]])
            with ops.device(ctx.devices[index]):
                if sharded is not None:
                    x_i = sharded.shards[index]
                else:
                    x_i = slice_along(ctx.local(x, index), axis, offset, rows)
                partials.append((index, special_math_ops.einsum(layer.equation, x_i, kernel_i)))
            offset += rows
        shape = partials[0][1].shape
        if sequence.applies(ctx, shape) and not set(
                equation.letter_at(1, shape.rank, equation.output)) & set(equation.kernel):
            return sequence.reduce_scatter(ctx, partials, lambda y: _finish(layer, y, bias))
        with ops.device(ctx.devices[0]):
            return _finish(layer, math_ops.add_n([p for _, p in partials]), bias)


class _Whole:
    name = "whole"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return True

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        return math.inf  # only when nothing else can split it

    @staticmethod
    def build(ctx, layer, x, getter, unit):
        kernel, bias = _weights(layer, x, getter, {})
        with ops.device(ctx.devices[0]):
            return _finish(layer, special_math_ops.einsum(layer.equation, x, kernel), bias)


def _weights(layer, x, getter, splits: Dict[str, Optional[int]]):
    """The layer's kernel and bias (None without one), each split along
    ``splits[name]`` (absent or None: whole)."""
    kernel_shape, bias_shape, layer.full_output_shape = _shapes(layer, x)
    dtype = _dtype(layer, x)
    kernel = getter("kernel", kernel_shape, dtype, layer.kernel_initializer,
                    splits.get("kernel"), regularizer=layer.kernel_regularizer,
                    constraint=layer.kernel_constraint)
    bias = None if bias_shape is None else getter(
        "bias", bias_shape, dtype, layer.bias_initializer, splits.get("bias"),
        regularizer=layer.bias_regularizer, constraint=layer.bias_constraint)
    return kernel, bias


def _finish(layer, y, bias):
    if bias is not None:
        y = y + bias
    return layer.activation(y) if layer.activation is not None else y


COLUMN, ROW, WHOLE = _Column(), _Row(), _Whole()
EINSUM_DENSE_PATTERNS = (COLUMN, ROW, WHOLE)


def _splits(layer, equation: _Equation, letter: str, bias: bool) -> Optional[Dict]:
    """weight -> axis split along ``letter`` (None: no letter)."""
    if not letter:
        return None
    splits = {"kernel": equation.kernel.index(letter)}
    if bias:
        splits["bias"] = _bias_axis(layer, equation, letter)
    return splits


def _letters(equation: _Equation, sizes: Dict[str, int], devices: int, split_letter: str):
    """(column letter, row letter), '' for none: the kernel's first letter
    only the output has; the input's split letter if the kernel contracts
    it, else (an input not split) the kernel's first contracted letter; each
    with at least one kernel entry per device."""
    wide = [c for c in equation.kernel if sizes[c] >= devices]
    column = next((c for c in wide if c in equation.output and c not in equation.source), "")
    contracted = [c for c in wide if c in equation.source and c not in equation.output]
    if split_letter:
        return column, split_letter if split_letter in contracted else ""
    return column, contracted[0] if contracted else ""


def einsum_dense_unit(ctx, layer, x) -> ShardingUnit:
    """The ShardingUnit of calling ``layer`` on ``x``: its column and row
    splits (weight -> axis, None when impossible) and their letters."""
    equation = _Equation.parse(layer.equation)
    kernel_shape, bias_shape, _ = _shapes(layer, x)
    sharded = ctx.lookup(x)
    split_letter = equation.letter_at(sharded.axis, x.shape.rank) if sharded is not None else ""
    sizes = {c: int(d) for c, d in zip(equation.kernel, kernel_shape)}
    column, row = _letters(equation, sizes, ctx.size, split_letter)
    dtype = _dtype(layer, x)
    whole = {"kernel": whole_axes(layer.kernel_constraint, kernel_shape, dtype)}
    if bias_shape is not None:
        whole["bias"] = whole_axes(layer.bias_constraint, bias_shape, dtype)
    return ShardingUnit(ctx.unit_name(layer.name), "einsum_dense", (ctx.info(x),), {
        "column": _splits(layer, equation, column, bias_shape is not None),
        "row": _splits(layer, equation, row, False),
        "column_letter": column, "row_letter": row, "whole": whole,
        "kernel": [int(d) for d in kernel_shape],
        "in": math.prod(n for c, n in sizes.items() if c in equation.source),
        "out": math.prod(n for c, n in sizes.items() if c not in equation.source)})


@dataclasses.dataclass(frozen=True)
class _Chosen:
    """A pattern with the unit it was chosen for (its letters)."""

    pattern: object
    unit: ShardingUnit

    @property
    def name(self) -> str:
        return self.pattern.name

    def build(self, ctx, layer, x, getter):
        return self.pattern.build(ctx, layer, x, getter, self.unit)


def choose_einsum_dense(ctx, layer, x) -> _Chosen:
    """The pattern for calling ``layer`` on ``x``; ``whole`` (unless forced)
    is said by ``fall_back``."""
    unit = einsum_dense_unit(ctx, layer, x)
    pattern = choose(ctx, unit, EINSUM_DENSE_PATTERNS)
    if pattern is WHOLE and ctx.forced_pattern(unit.name) is None:
        fall_back(f"wh.split asked to shard EinsumDense layer '{layer.name}' "
                  f"('{layer.equation}', kernel {unit.sizes['kernel']})",
                  f"it runs whole on {ctx.devices[0]} (its equation has no output-only or "
                  f"contracted kernel index with at least {ctx.size} entries whose split its "
                  "constraints allow)",
                  "Build it outside wh.split, or force it with split.patterns "
                  f"{{'{unit.name}': 'whole'}} to silence this", ops.get_default_graph())
    return _Chosen(pattern, unit)
