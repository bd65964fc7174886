"""Dynamic loss scaling for fp16 mixed precision (``memory.mixed_precision:
"fp16"``; Micikevicius et al. 2018 §3.2), built into the training graph as
the script builds it, so that every rewrite sees ordinary ops:

* the seeds backprop starts from are multiplied by the loss scale S, and the
  gradients ``tf.gradients`` returns divided by it (S is a power of 2: in
  float32 both are exact), so small fp16 gradients do not flush to zero;
* ``apply_gradients`` updates only if every gradient it is given (summed over
  replicas and micro-batches by then) is finite: the gradients pass through a
  ``Switch`` on that, so on overflow the update and everything after it (slot
  updates, the global step) do not run; the returned op still completes;
* S follows TensorFlow's ``DynamicLossScale``: it starts at 2**15, halves
  (not below 1) after a step with a non-finite gradient and doubles after
  2000 finite steps in a row.

S and its count of finite steps are variables of no collection: checkpoints
keep the script's names, and a new session starts S anew (read as 2**15 until
the first step writes it).
"""
from typing import Any, Callable, List, Optional, Sequence

from tfpar.compat import tf as internals
from tfpar.compat.tf import (array_ops, array_ops_stack, constant_op, control_flow_ops, dtypes,
                             gen_control_flow_ops, gen_math_ops, indexed_slices, math_ops, ops,
                             resource_variable_ops, tensor_lib)

__all__ = ["LossScale", "INITIAL_SCALE", "GROWTH_STEPS"]

INITIAL_SCALE = 2.0 ** 15
GROWTH_STEPS = 2000
_FACTOR = 2.0


class LossScale:
    """The loss scale of one graph: its two variables, and the value of S a
    step reads (once; every use shares it)."""

    def __init__(self, graph: ops.Graph) -> None:
        with graph.as_default(), ops.init_scope(), ops.device(None), \
                ops.name_scope("tfpar_loss_scale/"):
            self.scale = _variable(INITIAL_SCALE, dtypes.float32, "scale")
            self.good_steps = _variable(0, dtypes.int64, "good_steps")
            self.value = internals.read_or(self.scale, INITIAL_SCALE)
            self.steps = internals.read_or(self.good_steps, 0)

    def scaled(self, seeds: Sequence[Any]) -> List[Any]:
        """``seeds`` times S (floating ones; others as they are)."""
        return [s * math_ops.cast(self.value, s.dtype) if _floating(s) else s for s in seeds]

    def unscaled(self, grads: Sequence[Any]) -> List[Any]:
        """``grads`` divided by S (IndexedSlices: their values)."""
        def unscale(g):
            if isinstance(g, indexed_slices.IndexedSlices):
                return indexed_slices.IndexedSlices(unscale(g.values), g.indices, g.dense_shape)
            return g * math_ops.cast(1.0 / self.value, g.dtype) if _floating(g) else g
        return [unscale(g) for g in grads]

    def gated_apply(self, grads_and_vars, apply: Callable[[Any], Any],
                    counted: Optional[Callable[[], Any]] = None) -> ops.Operation:
        """``apply(grads_and_vars)`` run only if every gradient is finite, then
        S updated; returns an op that completes either way. ``counted``
        gives the step counter a skipped step still increments (Keras'
        ``iterations``, as Keras' LossScaleOptimizer does; TensorFlow's
        skips the global step with the update)."""
        grads = [g for g, _ in grads_and_vars if g is not None]
        with ops.name_scope("tfpar_loss_scale"):
            finite = math_ops.reduce_all(array_ops_stack.stack(
                [math_ops.reduce_all(gen_math_ops.is_finite(_values(g))) for g in grads]))
            gated = [(None if g is None else _switched(g, finite), v)
                     for g, v in grads_and_vars]
        applied = apply(gated)
        with ops.name_scope("tfpar_loss_scale"):
            skipped, ran = gen_control_flow_ops.switch(finite, finite)
            with ops.control_dependencies([applied]):
                ran = array_ops.identity(ran)
            skipped = array_ops.identity(skipped)  # dead, and what waits on it, if it ran
            if counted is not None:
                with ops.control_dependencies([skipped]):
                    skipped = control_flow_ops.with_dependencies(
                        [counted().assign_add(1, read_value=False)], skipped)
            done = control_flow_ops.merge([ran, skipped])[0]
            return control_flow_ops.group(done, *self._updated(finite))

    def _updated(self, finite: tensor_lib.Tensor) -> List[ops.Operation]:
        """The writes of S and its finite-step count after a step whose
        gradients were ``finite`` or not (``DynamicLossScale.update``)."""
        grow = math_ops.logical_and(finite, self.steps + 1 >= GROWTH_STEPS)
        doubled = self.value * _FACTOR
        doubled = array_ops.where(gen_math_ops.is_finite(doubled), doubled, self.value)
        scale = array_ops.where(finite, array_ops.where(grow, doubled, self.value),
                                math_ops.maximum(self.value / _FACTOR, 1.0))
        steps = array_ops.where(math_ops.logical_and(finite, math_ops.logical_not(grow)),
                                self.steps + 1, array_ops.zeros_like(self.steps))
        return [self.scale.assign(scale, read_value=False),
                self.good_steps.assign(steps, read_value=False)]


def _variable(initial, dtype, name):
    return resource_variable_ops.ResourceVariable(
        constant_op.constant(initial, dtype), trainable=False, collections=[], name=name)


def _floating(t) -> bool:
    return isinstance(t, tensor_lib.Tensor) and t.dtype.is_floating


def _values(g):
    return g.values if isinstance(g, indexed_slices.IndexedSlices) else g


def _switched(g, finite):
    """``g`` through a Switch on ``finite`` (dead, and so is what reads it, if not)."""
    if isinstance(g, indexed_slices.IndexedSlices):
        return indexed_slices.IndexedSlices(
            _switched(g.values, finite), _switched(g.indices, finite),
            None if g.dense_shape is None else _switched(g.dense_shape, finite))
    return gen_control_flow_ops.switch(g, finite)[1]
