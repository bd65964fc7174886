"""Keras (graph mode, ``training_v1.Model``): the training step exists before
Keras first runs its session.

tfpar rewrites a graph when a session first runs it with its training step
built; TensorFlow ignores later changes to nodes a session already ran. Keras
runs its session before building its training function in ordinary scripts
(``get_weights`` / ``set_weights`` / ``load_weights`` before the first ``fit``,
``fit`` on a ``tf.data.Dataset`` initializing its iterator). So while tfpar is
active, every compiled model is remembered, and whenever Keras fetches its
session (``backend.get_session``, which every such call goes through) the
models of that graph first build the training function Keras would build at
their first step (``_make_train_function``; no session run): the first run
then rewrites the whole step.

Keras 3 (tf.keras on TensorFlow 2.16+) calls its step in a tf.function nested
in another (its ``steps_per_execution`` loop); where tfpar runs in parallel
(``keras_3_steps``), its train and test functions call the step as a
tf.function of one batch from eager code instead, as Keras 2's do.
"""
import weakref

from tfpar.compat.keras import backend, training_v1
from tfpar.compat import keras as keras_internals, tf as internals
from tfpar.compat.tf import ops
from tfpar.hooks import seams

__all__ = ["add_keras_patches"]

# graph -> the compiled models built in it.
_compiled: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def add_keras_patches(patches, active) -> None:
    """Wrap ``Model.compile`` and ``backend.get_session`` (``active()``: tfpar is on)."""
    patches.add(training_v1.Model, "compile", lambda original: _remembering(original, active))
    patches.add(backend, "get_session", lambda original: _building_first(original, active))
    keras_3 = keras_internals.keras_3()
    if keras_3 is not None:
        patches.add(keras_3.trainer, "_make_function",
                    lambda original: _step_by_step(original, keras_3.version))


def _step_by_step(original, version: str):
    def make_function(self, step_function):
        if seams.runtime is not None and seams.runtime.keras_3_steps(
                self.name, version, bool(self.jit_compile)):
            return keras_internals.keras_3_step_by_step(self, step_function)
        return original(self, step_function)
    return make_function


def _remembering(original, active):
    def compile(self, *args, **kwargs):  # pylint: disable=redefined-builtin
        result = original(self, *args, **kwargs)
        if active():
            _compiled.setdefault(ops.get_default_graph(), weakref.WeakSet()).add(self)
        return result
    return compile


def _building_first(original, active):
    def get_session(op_input_list=()):
        if active():
            graph = internals.graph_of_inputs(op_input_list)
            for model in list(_compiled.get(graph, ())):
                _build_train_function(model)
        return original(op_input_list)
    return get_session


def _build_train_function(model) -> None:
    """A compiled model's training function, unless built or not buildable yet
    (a subclassed model learns its inputs at its first call)."""
    if (getattr(model, "_is_compiled", False) and getattr(model, "train_function", None) is None
            and getattr(model, "total_loss", None) is not None and not model.run_eagerly):
        keras_internals.make_train_function(model)
