"""Variables read by several pipeline stages (tied weights: GPT-2, BERT and
T5 read the input embedding again as the output projection, a gather in the
first stage and ``matmul(h, wte, transpose_b=True)`` in the last).

Such a variable lives once, on the devices of its own stage (the scope that
made it, else the first stage that reads it; ``stages``); the other stages
read its value there, once per step and device (outside the task functions).
``tf.gradients`` sums the stages' contributions to its gradient in one op
per micro-batch (``AddN``, or two ``ConcatV2`` of an ``IndexedSlices``),
which would make the stages' backward tasks wait on each other both ways.
Instead, each contribution (a term) is reduced as a gradient of its own, on
its own stage's devices: weighted and summed over that stage's micro-batches
and replicas (``gradients.reduce_gradients``); the sum op then runs once per
copy of the variable, on the reduced terms, in front of the optimizer.

This is what Megatron-LM computes (Narayanan et al. 2021, §3: a copy of the
embedding on the first and the last stage, their gradients all-reduced
between the two before identical updates), with one copy instead of two:
the same bytes cross between the stages per step (the weight to each
reading stage, each stage's summed contribution back), the optimizer's
slots and update exist once, and nothing has to be kept equal.
"""
import dataclasses
from typing import Callable, Dict, Tuple

from tfpar.analysis.op_kinds import gradient_tensors
from tfpar.analysis.stages import stage_terms
from tfpar.compat.tf import ops, tensor_lib
from tfpar.rewriters.select import Selection

__all__ = ["reduce_per_stage"]


def reduce_per_stage(sel: Selection, stage: Callable[[ops.Operation], int]
                     ) -> Tuple[Selection, Dict[tensor_lib.Tensor, tensor_lib.Tensor]]:
    """``sel`` with every variable gradient summed across stages replaced by
    its terms (module doc), its sum ops moved from the step to the update
    ops; and each term's tensors -> the gradient's they add into."""
    raw_grads, sums, whole_of = [], set(), {}
    for g, var in sel.raw_grads:
        found = stage_terms(g, stage)
        if found is None or any(c in sel.step_ops_set for op in found[1] for t in op.outputs
                                for c in t.consumers()):  # the step reads the sum itself
            raw_grads.append((g, var))
            continue
        terms, summing = found
        sums.update(summing)
        raw_grads += [(term, var) for term in terms]
        for term in terms:
            whole_of.update(zip(gradient_tensors(term), gradient_tensors(g)))
    if not sums:
        return sel, {}
    order = {op: i for i, op in enumerate(sel.step_ops)}
    return dataclasses.replace(
        sel, raw_grads=raw_grads, step_ops=[op for op in sel.step_ops if op not in sums],
        update_ops=sorted(sums, key=order.get) + sel.update_ops,
        backward=sel.backward - sums), whole_of
