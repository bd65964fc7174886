"""Optimizer updates as they are built: ``Optimizer.apply_gradients`` (and
subclasses' overrides) and keras' (``tf.keras.optimizers.legacy``, used by
``model.fit`` in graph mode; Keras 3's too) build APPLY ops, recorded (keras' ``iterations``
counts as the global step), loss-scaled with fp16 (``loss_scaling``)."""
import functools
from typing import Optional

from tfpar.compat import keras as keras_internals
from tfpar.compat.keras import keras_optimizer, keras_optimizer_v2
from tfpar.compat.tf import context, ops, tf_optimizer
from tfpar.hooks import capture as cap_lib
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.recording import handle_in, loss_scale, recorded
from tfpar.ir.recorded import ApplyCall
from tfpar.ir.taskgraph import Phase

__all__ = ["add_optimizer_patches"]


def add_optimizer_patches(patches: PatchSet) -> None:
    _patch_optimizer_class(patches, tf_optimizer.Optimizer)
    patches.add(tf_optimizer.Optimizer, "__init__",
                functools.partial(_wrap_optimizer_init, patches=patches))
    patches.add(keras_optimizer_v2.OptimizerV2, "apply_gradients", _wrap_keras_apply)
    patches.add(keras_optimizer.Optimizer, "apply_gradients", _wrap_keras_apply)
    keras_3 = keras_internals.keras_3()
    if keras_3 is not None:  # Keras 3's optimizers (tf.keras on TensorFlow 2.16+)
        patches.add(keras_3.optimizer, "apply_gradients", _wrap_keras_3_apply)


def _recorded_apply(grads_and_vars, global_step, apply, optimizer=None):
    """Run ``apply(grads_and_vars)`` in the APPLY phase; record the outermost call.
    ``global_step``: the variable, or a function giving it after ``apply`` ran
    (keras creates its ``iterations`` inside its own name scope there, and
    counts a step whose loss-scaled update was skipped); ``optimizer``: the
    one applying, whose state per parameter is recorded (``optimizer_slots``)."""
    graph = ops.get_default_graph()
    if not recorded(graph):
        return apply(grads_and_vars)
    cap = cap_lib.capture_for(graph)
    grads_and_vars = tuple(grads_and_vars)
    nested = cap.applying
    scale = None if nested else loss_scale(graph)
    cap.applying = True
    try:
        with cap.phase(Phase.APPLY):
            result = apply(grads_and_vars) if scale is None else scale.gated_apply(
                grads_and_vars, apply, global_step if callable(global_step) else None)
    finally:
        cap.applying = nested
    if not nested:
        cap.apply_calls.append(ApplyCall(
            grads_and_vars=list(grads_and_vars),
            global_step=handle_in(graph, global_step() if callable(global_step) else global_step),
            train_op=result, slots=optimizer_slots(optimizer, grads_and_vars)))
    return result


def optimizer_slots(optimizer, grads_and_vars) -> Optional[float]:
    """Elements of ``optimizer``'s state per element of the variables it
    updates, read from what it made (``get_slot`` of TF1 and Keras legacy
    optimizers; a Keras optimizer's ``variables`` but its scalars, such as
    ``iterations``); None when unknown."""
    variables = [v for _, v in grads_and_vars if v is not None]
    size = sum(_elements(v) for v in variables)
    if optimizer is None or not size:
        return None
    if hasattr(optimizer, "get_slot_names"):
        state = sum(_elements(optimizer.get_slot(v, name)) for v in variables
                    for name in optimizer.get_slot_names())
    else:
        state = sum(_elements(v) for v in optimizer.variables if v.shape.rank)
    return state / size


def _elements(variable) -> int:
    """Elements of ``variable`` (0 when None or of unknown shape)."""
    if variable is None or not variable.shape.is_fully_defined():
        return 0
    return variable.shape.num_elements()


def _wrap_apply(original):
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return _recorded_apply(grads_and_vars, global_step, lambda gv: original(
            self, gv, global_step=global_step, name=name), self)
    return apply_gradients


def _wrap_keras_apply(original):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if context.executing_eagerly():
            return original(self, grads_and_vars, *args, **kwargs)
        return _recorded_apply(grads_and_vars, lambda: self.iterations, lambda gv: original(
            self, gv, *args, **kwargs), self)
    return apply_gradients


def _wrap_keras_3_apply(original):
    """Keras 3's ``apply_gradients`` returns its ``iterations`` variable: the update
    recorded is a read of it after the update (automatic control dependencies order
    the read after the writes)."""
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if context.executing_eagerly():
            return original(self, grads_and_vars, *args, **kwargs)
        returned = []

        def apply(gv):
            returned.append(original(self, gv, *args, **kwargs))
            return self.iterations.value.read_value()
        _recorded_apply(grads_and_vars, lambda: self.iterations, apply, self)
        return returned[0]
    return apply_gradients


def _patch_optimizer_class(patches: PatchSet, cls) -> None:
    """Wrap ``apply_gradients`` where ``cls`` defines it itself."""
    if "apply_gradients" in cls.__dict__ and not patches.is_patched(cls, "apply_gradients"):
        patches.add(cls, "apply_gradients", _wrap_apply)


def _wrap_optimizer_init(original, patches: PatchSet):
    def __init__(self, *args, **kwargs):
        # Subclasses defined after install() get their overrides wrapped here.
        for klass in type(self).__mro__:
            if isinstance(klass, type) and issubclass(klass, tf_optimizer.Optimizer):
                _patch_optimizer_class(patches, klass)
        original(self, *args, **kwargs)
    return __init__
