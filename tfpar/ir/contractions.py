"""The op types that contract operands (matrix products and einsums), one
table for the planner's layers, its memory model and the graph's model view;
and what an einsum contracts, read from its equation."""
import math
from typing import Optional, Sequence

__all__ = ["CONTRACTIONS", "einsum_depth"]

CONTRACTIONS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum"})


def einsum_depth(equation: str, shapes: Sequence[Optional[Sequence[Optional[int]]]]
                 ) -> Optional[int]:
    """The multiply-adds per output element of ``equation`` (its summed
    letters' sizes multiplied: ``"bsh,hk->bsk"`` on [.., .., 512] x [512, 64]
    is 512), from the operands' ``shapes`` (None where unknown); None when a
    summed letter's size is unknown in every operand. Letters of ``...`` are
    kept in the output, so never summed."""
    inputs, _, output = equation.replace(" ", "").partition("->")
    operands = inputs.split(",")
    summed = set("".join(operands).replace(".", "")) - set(output)
    sizes = {}
    for spec, shape in zip(operands, shapes):
        if shape is None:
            continue
        head, dots, tail = spec.partition("...")
        letters = list(head) + ([None] * (len(shape) - len(head) - len(tail)) if dots else []) \
            + list(tail)
        for letter, size in zip(letters, shape):
            if letter in summed and size is not None:
                sizes[letter] = size
    if set(sizes) != summed:
        return None
    return math.prod(sizes.values())
