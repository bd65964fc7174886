"""Multi-head attention split by heads (Megatron-LM, Shoeybi et al. 2019, §3).

The query, key and value projections of a keras ``MultiHeadAttention`` are
column-split by heads (``einsum_dense``); the attention core then needs no
communication: ``heads`` runs keras' own attention
(``MultiHeadAttention._compute_attention``: scaling, scores, mask, softmax,
dropout, weighted sum of values) on each device's heads, and its output stays
split by heads for the output projection to read as rows. ``gather`` runs it
once on the gathered query, key and value (what an attention whose
projections were not split by heads gets).

Costs are float32 bytes per batch row moved.
"""
from typing import Callable, List, Optional, Sequence

from tfpar.compat.tf import ops
from tfpar.ir.sharding import ShardingUnit
from tfpar.patterns.matcher import Gather

__all__ = ["ATTENTION_PATTERNS", "HEADS", "attention_unit", "heads_attention"]


class _Heads:
    name = "heads"

    @staticmethod
    def matches(unit: ShardingUnit) -> bool:
        return unit.sizes["heads"]

    @staticmethod
    def cost(unit: ShardingUnit) -> float:
        return 0.0


HEADS = _Heads()
ATTENTION_PATTERNS = (HEADS, Gather("gathered"))


def _head_shards(ctx, query, key, value) -> Optional[List[Sequence]]:
    """The shards of ``query``, ``key`` and ``value`` (``[batch, ..., heads,
    dim]``) when all three are split along their heads with the same widths,
    else None."""
    found = [ctx.lookup(x) for x in (query, key, value)]
    if any(s is None or s.axis != s.full.shape.rank - 2 for s in found):
        return None
    widths = {tuple(int(shard.shape[s.axis]) for shard in s.shards) for s in found}
    return [s.shards for s in found] if len(widths) == 1 else None


def attention_unit(ctx, layer, query, key, value) -> ShardingUnit:
    """The unit of ``layer``'s attention core; ``heads`` when its inputs are
    split by heads, ``gathered`` the elements per row of those that are split."""
    gathered = sum(x.shape[1:].num_elements() or 0 for x in (query, key, value)
                   if ctx.lookup(x) is not None)
    return ShardingUnit(ctx.unit_name(layer.name), "attention",
                        tuple(ctx.info(x) for x in (query, key, value)),
                        {"heads": _head_shards(ctx, query, key, value) is not None,
                         "gathered": gathered})


def heads_attention(ctx, compute: Callable, query, key, value, dot_product_equation: str):
    """``compute(q, k, v) -> (output, scores)`` on each device's heads; returns
    the output (split along its heads, as the query) and the scores (split
    along theirs)."""
    outputs, scores = [], []
    for q, k, v, device in zip(*_head_shards(ctx, query, key, value), ctx.devices):
        with ops.device(device):
            output, score = compute(q, k, v)
        outputs.append(output)
        scores.append(score)
    operands, result = dot_product_equation.replace(" ", "").split("->")
    heads = operands.split(",")[1][-2]  # the query's heads letter
    return (ctx.sharded(outputs, query.shape.rank - 2),
            ctx.sharded(scores, result.index(heads)))
