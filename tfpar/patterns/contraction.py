"""Sharding patterns for ``tf.matmul`` and ``tf.einsum`` whose operands are
split along one index (a ShardedVariable's first dimension, a column-split
activation, an expert dimension).

* ``sharded``: every device contracts its slices (split operands use their
  shards, whole operands are sliced locally along the split index). When the
  split index survives in the output, the output stays split along it (expert
  outputs stay on their experts' devices); when it is contracted, the partial
  products are summed (row-split matmul, combining experts' outputs).
* ``gather``: gather the split operands and run TensorFlow's op.
"""
from typing import Callable, List, Optional, Sequence

from tfpar.compat.tf import math_ops, ops
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.matcher import Gather
from tfpar.patterns.moe import TOKENS, combine_token, index_sizes, reads_weight

__all__ = ["CONTRACTION_PATTERNS", "GATHER", "SHARDED", "contraction_unit", "sharded_contraction"]


class _Sharded:
    name = "sharded"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return unit.sizes["letter"] is not None

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        return 0.0 if unit.sizes["kept"] else 4.0 * unit.sizes["out"]  # all-reduce partials


SHARDED, GATHER = _Sharded(), Gather("gathered")
CONTRACTION_PATTERNS = (SHARDED, GATHER, TOKENS)


def split_letter(ctx, equation: str, operands: Sequence) -> Optional[str]:
    """The one einsum index the split operands are split along, or None."""
    if "..." in equation or "->" not in equation:
        return None
    specs = equation.split("->")[0].split(",")
    letters = set()
    for spec, x in zip(specs, operands):
        sharded = ctx.lookup(x)
        if sharded is not None:
            letters.add(spec[sharded.axis])
    return letters.pop() if len(letters) == 1 else None


def contraction_unit(ctx, kind: str, equation: str, operands: Sequence) -> ShardingUnit:
    """The unit of a matmul / einsum with split operands; ``token`` is set for an
    einsum of two activations that contracts the split index of one while
    keeping a token index of the other (a mixture-of-experts combine,
    ``moe.tokens_combine``; a weight's index is no token index)."""
    letter = split_letter(ctx, equation, operands)
    output = equation.split("->")[1] if "->" in equation else ""
    sizes = index_sizes(equation, operands)
    gathered = sum(int(x.shape[-1] or 1) for x in operands if ctx.lookup(x) is not None)
    split = [i for i, x in enumerate(operands) if ctx.lookup(x) is not None]
    token = None
    if kind == "einsum" and len(split) == 1 and letter and not reads_weight(
            operands[1 - split[0]]) and all(
            s.op.type != "ReadVariableOp" for s in ctx.lookup(operands[split[0]]).shards):
        token = combine_token(equation, split[0], letter)
    return ShardingUnit(ctx.unit_name(kind), kind, tuple(ctx.info(x) for x in operands),
                        {"letter": letter, "kept": bool(letter) and letter in output,
                         "out": (sizes.get(output[-1]) or 1) if output else 1,
                         "gathered": gathered, "token": token, "split_operand":
                         split[0] if len(split) == 1 else None, "devices": ctx.size})


def sharded_contraction(ctx, equation: str, operands: Sequence,
                        compute: Callable[..., object]):
    """Build the ``sharded`` pattern; ``compute(*slices)`` makes one device's op."""
    inputs, output = equation.split("->")
    specs = inputs.split(",")
    letter = split_letter(ctx, equation, operands)
    reference = next(ctx.lookup(x) for x, spec in zip(operands, specs) if ctx.lookup(x))
    widths = [int(s.shape[reference.axis]) for s in reference.shards]
    per_operand: List[List] = []
    for x, spec in zip(operands, specs):
        sharded = ctx.lookup(x)
        if sharded is not None:
            per_operand.append(sharded.shards)
        elif letter in spec:
            per_operand.append(ctx.cut(x, spec.index(letter), widths))
        else:
            per_operand.append([x] * ctx.size)
    results = []
    for i, device in enumerate(ctx.devices):
        with ops.device(device):
            results.append(compute(*(parts[i] for parts in per_operand)))
    if letter in output:
        return ctx.sharded(results, output.index(letter))
    with ops.device(ctx.devices[0]):
        return math_ops.add_n(results)


