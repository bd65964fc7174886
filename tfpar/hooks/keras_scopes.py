"""Scopes around building a Keras model in TF2 eager code.

A ``wh.replicate`` / ``wh.split`` scope entered in eager code has no graph to
record its ops in: a functional model's layers run there on symbolic inputs,
and the ops that train run later, in the step's ``tf.function``. So each Keras
layer made in the scope, or called in it (a functional or Sequential model
calls its layers while it is built; ``x + 1`` on a symbolic input is a layer
too), remembers the scope; a layer called in a scope takes that one over the
one it was made in (a functional model made in a scope does not remember it:
its layers do). Whenever a TF2 step is traced, each such layer's call is
wrapped in its scope (``_Scope.reopened``): all layers of one scope form one
TaskGraph of that step, as the same code inside the step would.

Keras 3's layers (tf.keras on TensorFlow 2.16+) are not remembered yet: one made or
called in a scope entered in eager code, or called in a ``wh.split`` scope in a step
(whose patterns shard Keras 2's layers and TensorFlow's ops), raises a ``PlanError``
naming the layer and the Keras version, rather than running as if the scope were not
there. Ops of Keras 3 layers called in a ``wh.replicate`` scope in a step are recorded
like any other ops.
"""
import contextlib
import functools
import threading

from tfpar.compat import keras as keras_internals
from tfpar.compat.keras import base_layer, functional
from tfpar.compat.tf import context, ops
from tfpar.errors import AnnotationError, PlanError
from tfpar.hooks.split_scope import open_split_context
from tfpar.hooks.step_graphs import is_step_function

__all__ = ["add_keras_scope_patches", "enter_eagerly", "exit_eagerly"]

_state = threading.local()


def _open():
    """[scope, layers recorded] of the scope entered in eager code, or None."""
    return getattr(_state, "open", None)


def enter_eagerly(scope) -> None:
    if _open() is not None:
        raise AnnotationError(f"tfpar: {scope.describe()} is nested inside another scope; "
                              "replicate/split scopes cannot be nested")
    _state.open = [scope, 0]


def exit_eagerly(scope) -> int:
    """How many Keras layers remembered ``scope``, which closes."""
    entry = _open()
    _state.open = None
    return entry[1] if entry is not None and entry[0] is scope else 0


def add_keras_scope_patches(patches) -> None:
    patches.add(base_layer.Layer, "__init__", _remembering_made)
    patches.add(base_layer.Layer, "__call__", _reopening)
    keras_3 = keras_internals.keras_3()
    if keras_3 is not None:
        patches.add(keras_3.layer, "__init__", lambda original: _refusing_keras_3(
            original, keras_3.version, "made"))
        patches.add(keras_3.layer, "__call__", lambda original: _refusing_keras_3(
            original, keras_3.version, "called"))


_KERAS_2 = ("Use Keras 2 for it (pip install tf-keras; TF_USE_LEGACY_KERAS=1 makes tf.keras "
            "Keras 2)")


def _refusing_keras_3(original, version: str, verb: str):
    """A Keras 3 layer made or called in a scope entered in eager code, or called in
    a split scope in a step, is refused (``PlanError``) naming it and Keras' version."""
    def wrapped(self, *args, **kwargs):
        made = original(self, *args, **kwargs) if verb == "made" else None
        what = f"Keras 3 layer '{self.name}' ({type(self).__name__}, keras {version})"
        if _open() is not None and context.executing_eagerly():
            raise PlanError(
                f"tfpar: {what} is {verb} in {_open()[0].describe()} entered in eager code: "
                "tfpar does not yet carry scopes around building or calling Keras 3 layers "
                "into the step (the layer would run as if the scope were not there). "
                f"{_KERAS_2}, or open the scope inside the tf.function step")
        if verb == "called" and open_split_context() is not None:
            raise PlanError(
                f"tfpar: wh.split cannot shard {what} yet: its patterns shard Keras 2's layers "
                f"and TensorFlow's ops. {_KERAS_2}, or call the layer outside the split scope")
        return made if verb == "made" else original(self, *args, **kwargs)
    return wrapped


def _remember(layer, called: bool) -> None:
    entry = _open()
    scope, by_call = layer.__dict__.get("_tfpar_scope", (None, False))
    if by_call and called and scope is not entry[0]:
        raise AnnotationError(
            f"tfpar: Keras layer '{layer.name}' is called in {scope.describe()} and again in "
            f"{entry[0].describe()}; a layer of a model built in eager code belongs to one "
            "scope (make one layer per scope, or put the scopes inside the tf.function step)")
    if not by_call:
        object.__setattr__(layer, "_tfpar_scope", (entry[0], called))  # untracked by keras
    entry[1] += 1


@contextlib.contextmanager
def _call_in_scope(layer, scope):
    """While a functional model calls ``layer`` on symbolic inputs, keras
    traces its ``call`` in a scratch graph to learn its outputs, and the
    weights its sublayers make there are made for good: that trace runs in
    ``scope`` too, as the step's will (a split pattern chosen there must be
    the one the step's ops are split for)."""
    call, own = layer.call, layer.__dict__.get("call")

    def scoped(*args, **kwargs):
        graph = ops.get_default_graph()
        if not is_step_function(graph):
            return call(*args, **kwargs)
        with scope.reopened(graph, layer.name):
            return call(*args, **kwargs)
    object.__setattr__(layer, "call", functools.wraps(call)(scoped))  # untracked by keras
    try:
        yield
    finally:
        if own is None:
            object.__delattr__(layer, "call")
        else:
            object.__setattr__(layer, "call", own)


def _remembering_made(original):
    """A functional model (Sequential too) made in a scope does not remember
    it: its layers remember the scopes they were made or called in."""
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if (_open() is not None and context.executing_eagerly()
                and not isinstance(self, functional.Functional)):
            _remember(self, called=False)
    return __init__


def _reopening(original):
    def __call__(self, *args, **kwargs):
        if _open() is not None and context.executing_eagerly():
            _remember(self, called=True)
            with _call_in_scope(self, _open()[0]):
                return original(self, *args, **kwargs)
        scope = self.__dict__.get("_tfpar_scope", (None,))[0]
        graph = ops.get_default_graph() if scope is not None else None
        if graph is None or not is_step_function(graph):
            return original(self, *args, **kwargs)
        with scope.reopened(graph, self.name):
            return original(self, *args, **kwargs)
    return __call__

