"""TensorFlow internals tfpar uses (``tensorflow.python``, ``tensorflow.core``),
and the private members it reaches, each behind a function named for what it
does. Importing this module checks the TensorFlow version."""
# pylint: disable=protected-access,unused-import
import os

import tensorflow as _tf

TESTED = "2.15."
ALLOW_UNTESTED = "TFPAR_ALLOW_UNTESTED_TENSORFLOW"
if not _tf.__version__.startswith(TESTED) and not os.environ.get(ALLOW_UNTESTED):
    raise ImportError(
        f"tfpar is built and tested on TensorFlow {TESTED}x, and this is TensorFlow "
        f"{_tf.__version__}: tfpar rewrites graphs through TensorFlow's internals, which change "
        f"between versions. Install tensorflow==2.15.1 (or tensorflow-cpu), or set "
        f"{ALLOW_UNTESTED}=1 to try this version at your own risk")

# IMPORTS (every tensorflow.python / tensorflow.core name tfpar uses)
from tensorflow.python.checkpoint import checkpoint
from tensorflow.python.eager import context
from tensorflow.python.framework import ops
from tensorflow.python.ops import gen_logging_ops


def update_input(op, index: int, tensor) -> None:
    """``op`` reads ``tensor`` as its input ``index``."""
    op._update_input(index, tensor)


def add_control_input(op, dep) -> None:
    op._add_control_input(dep)


def set_control_inputs(op, deps) -> None:
    """``op`` waits for exactly ``deps``."""
    op._remove_all_control_inputs()
    op._add_control_inputs(deps)


def set_device(op, device: str) -> None:
    op._set_device(device)


def clear_attr(op, name: str) -> None:
    op._clear_attr(name)


def unfinalize(graph) -> None:
    """Let ops be added to a finalized ``graph`` (``refinalize`` undoes it)."""
    graph._unsafe_unfinalize()


def refinalize(graph) -> None:
    graph._finalized = True


def raw_assert(condition, data, name=None):
    """An Assert op itself (``tf.debugging.Assert`` guards some data with a
    conditional, a function call per step)."""
    return gen_logging_ops._assert(condition, data, name=name)


def eager_context_initialized() -> bool:
    """Whether the eager context has made its devices (their configuration is then fixed)."""
    return context.context()._initialized


def graph_of_inputs(inputs):
    """The graph ``inputs`` belong to (the default graph if none)."""
    return ops._get_graph_from_inputs(inputs)


def restore_coordinator_class():
    """The class every checkpoint restore makes to hold its bindings."""
    return checkpoint._CheckpointRestoreCoordinator


def take_restore_identity(new, old) -> None:
    """``new`` counts as restored as far as ``old`` was."""
    new._maybe_initialize_trackable()
    new._self_update_uid = old._update_uid


def initialize_trackable(trackable) -> None:
    trackable._maybe_initialize_trackable()


def deferred_restores(trackable) -> dict:
    """The restores waiting for children of ``trackable`` not made yet, by child name
    (the dict itself: callers take from it and add to it)."""
    return trackable._deferred_dependencies


def checkpoint_children(trackable) -> list:
    """The references to ``trackable``'s checkpointed children (``.name``, ``.ref``)."""
    return trackable._checkpoint_dependencies
