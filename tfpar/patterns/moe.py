"""Mixture-of-experts dispatch and combine by all-to-all (GShard-style einsums
in a split scope; Whale Example 5).

* ``tokens`` dispatch: an einsum contracting a token index shared by both
  operands, whose output starts with an expert index of the first operand
  (``bec,bd->ecd``). Each device dispatches its own token rows to every expert;
  the device of expert shard j sums the pieces addressed to its experts: an
  all-to-all. The output is split along the expert index with the expert
  weights' shards (TensorFlow's partition sizes), so the expert einsums that
  follow need no communication.
* ``tokens`` combine: an einsum contracting the expert index of a split
  activation while keeping a token index (``bec,ecd->bd``). Each expert device
  combines its experts' outputs for every device's token rows and sends each
  device its rows; each device sums what it receives: an all-to-all. The output
  is split along the token index.
* ``replicated`` (dispatch only): TensorFlow's einsum on one device.

Costs: float32 bytes of the einsum's output crossing devices.
"""
import itertools
from typing import Dict, List, Optional, Tuple

from tfpar.compat.tf import array_ops, array_ops_stack, dtypes, math_ops, ops, special_math_ops
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.sharded import slice_along

__all__ = ["DISPATCH_PATTERNS", "TOKENS", "combine_token", "dispatch_indices",
           "dispatch_unit", "index_sizes", "reads_weight", "tokens_combine", "tokens_dispatch"]


class _Tokens:
    name = "tokens"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return unit.sizes.get("token") is not None

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        k = unit.sizes["devices"]
        return 4.0 * unit.sizes["out"] * (k - 1) / k


class _Replicated:
    name = "replicated"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return True

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        return 4.0 * unit.sizes["out"] * (unit.sizes["devices"] - 1)  # sent to every device


TOKENS, REPLICATED = _Tokens(), _Replicated()
DISPATCH_PATTERNS = (TOKENS, REPLICATED)


def dispatch_indices(equation: str, operands) -> Optional[Tuple[str, str]]:
    """(token, expert) indices of a dispatch einsum, or None. Both operands
    are activations and the expert index has a static size: an einsum with a
    weight is a projection (``abc,cde->abde`` of keras' attention), whose
    leading index is the batch, no expert."""
    if "..." in equation or "->" not in equation or equation.count(",") != 1:
        return None
    inputs, output = equation.split("->")
    a, b = inputs.split(",")
    tokens = [c for c in a if c in b and c not in output]
    if len(tokens) != 1 or not output or output[0] not in a or output[0] in b:
        return None
    if any(reads_weight(x) for x in operands) or index_sizes(equation, operands)[output[0]] is None:
        return None
    return tokens[0], output[0]


def reads_weight(x) -> bool:
    """``x`` is a variable's value (through identities and casts)."""
    op = x.op
    while op.type in ("Identity", "Cast") and op.inputs:
        op = op.inputs[0].op
    return op.type in ("ReadVariableOp", "VariableV2", "VarHandleOp")


def index_sizes(equation: str, operands) -> Dict[str, Optional[int]]:
    """Static size of every einsum index (None when unknown)."""
    return {c: dim for spec, x in zip(equation.split("->")[0].split(","), operands)
            for c, dim in zip(spec, x.shape.as_list())}


def dispatch_unit(ctx, equation: str, operands, token: str) -> ShardingUnit:
    """The unit of a dispatch einsum; ``out`` is its output's static elements."""
    sizes = index_sizes(equation, operands)
    out = 1
    for c in equation.split("->")[1]:
        out *= sizes.get(c) or 1
    return ShardingUnit(ctx.unit_name("einsum"), "einsum", tuple(ctx.info(x) for x in operands),
                        {"token": token, "out": out, "devices": ctx.size})


def combine_token(equation: str, split_operand: int, letter: str) -> Optional[str]:
    """The token index a combine einsum keeps while contracting the split
    ``letter`` of operand ``split_operand``, or None."""
    if "..." in equation or equation.count(",") != 1:
        return None
    inputs, output = equation.split("->")
    specs = inputs.split(",")
    other = specs[1 - split_operand]
    if letter in output or letter not in other:
        return None
    kept = [c for c in other if c in output and c not in specs[split_operand]]
    return kept[0] if kept else None


def _token_rows(ctx, x, axis: int) -> List:
    """``x`` cut into one block of token rows per device, in proportion to
    the devices' shares (uneven allowed)."""
    n = array_ops.shape(x, out_type=dtypes.int32)[axis]
    bounds = list(itertools.accumulate(ctx.shares or [1] * ctx.size, initial=0))
    sizes = array_ops_stack.stack([(n * b) // bounds[-1] - (n * a) // bounds[-1]
                                   for a, b in zip(bounds, bounds[1:])])
    return array_ops.split(x, sizes, num=ctx.size, axis=axis)


def tokens_dispatch(ctx, equation: str, a, b, token: str, expert: str):
    specs, output = equation.split("->")[0].split(","), equation.split("->")[1]
    rows_a = _token_rows(ctx, a, specs[0].index(token))
    rows_b = _token_rows(ctx, b, specs[1].index(token))
    widths = ctx.widths(int(a.shape[specs[0].index(expert)]))
    chunks = []
    for i, device in enumerate(ctx.devices):
        with ops.device(device):
            partial = special_math_ops.einsum(equation, rows_a[i], rows_b[i])
            chunks.append(array_ops.split(partial, widths, axis=output.index(expert)))
    shards = []
    for j, device in enumerate(ctx.devices):
        with ops.device(device):
            shards.append(_sum([chunk[j] for chunk in chunks]))
    return ctx.sharded(shards, output.index(expert))


def tokens_combine(ctx, equation: str, operands, split_operand: int, sharded, token: str):
    specs, output = equation.split("->")[0].split(","), equation.split("->")[1]
    other = 1 - split_operand
    letter = specs[split_operand][sharded.axis]
    rows = _token_rows(ctx, operands[other], specs[other].index(token))
    axis = specs[other].index(letter)
    widths = [int(s.shape[sharded.axis]) for s in sharded.shards]
    partials = [[None] * ctx.size for _ in range(ctx.size)]  # [expert device][token device]
    for j, device in enumerate(ctx.devices):
        with ops.device(device):
            for i, block in enumerate(rows):
                pair = [None, None]
                pair[other] = slice_along(block, axis, sum(widths[:j]), widths[j])
                pair[split_operand] = sharded.shards[j]
                partials[j][i] = special_math_ops.einsum(equation, *pair)
    outputs = []
    for i, device in enumerate(ctx.devices):
        with ops.device(device):
            outputs.append(_sum([partials[j][i] for j in range(ctx.size)]))
    return ctx.sharded(outputs, output.index(token))


def _sum(parts):
    return parts[0] if len(parts) == 1 else math_ops.add_n(parts)
