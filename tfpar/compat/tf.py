"""TensorFlow internals tfpar uses (``tensorflow.python``, ``tensorflow.core``),
and the private members it reaches, each behind a function named for what it
does. Importing this module checks the TensorFlow version."""
# pylint: disable=protected-access,unused-import
import contextlib
import os

import tensorflow as _tf

# The TensorFlow versions tfpar is tested on: 2.15 (tf.estimator, Keras 2 as tf.keras) and
# 2.16-2.21 (no tf.estimator; Keras 3 as tf.keras, Keras 2 as the tf_keras package).
TESTED_RANGE = ((2, 15), (2, 21))
TESTED = "2.15-2.21"
ALLOW_UNTESTED = "TFPAR_ALLOW_UNTESTED_TENSORFLOW"
VERSION = tuple(int(part) for part in _tf.__version__.split(".")[:2])
if (not TESTED_RANGE[0] <= VERSION <= TESTED_RANGE[1]
        and os.environ.get(ALLOW_UNTESTED, "") in ("", "0")):
    raise ImportError(
        f"tfpar is built and tested on TensorFlow {TESTED} (2.15.x, and 2.16.x to 2.21.x), and "
        f"this is TensorFlow {_tf.__version__}: tfpar rewrites graphs through TensorFlow's "
        f"internals, which change between versions. Install tensorflow==2.15.1 or "
        f"tensorflow==2.21.* (or tensorflow-cpu), or set {ALLOW_UNTESTED}=1 to try this version "
        f"at your own risk")


# IMPORTS (every tensorflow.python / tensorflow.core name tfpar uses)
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2
from tensorflow.core.function.capture import capture_container
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2
from tensorflow.python import pywrap_tfe
from tensorflow.python.checkpoint import checkpoint
from tensorflow.python.client import pywrap_tf_session as c_session, session as tf_session
from tensorflow.python.data.ops import dataset_ops
from tensorflow.python.distribute import distribute_lib
from tensorflow.python.eager import backprop, context
from tensorflow.python.eager.polymorphic_function import (concrete_function, tracing_compilation,
                                                         transform)
from tensorflow.python.framework import (config, constant_op, device as device_lib, dtypes,
                                         errors as tf_errors, func_graph, function, importer,
                                         indexed_slices, ops, sparse_tensor, tensor as tensor_lib,
                                         tensor_conversion_registry, tensor_shape, tensor_util)
from tensorflow.python.ops import (array_ops, array_ops_stack, check_ops, collective_ops, cond_v2,
                                   control_flow_ops, custom_gradient, data_flow_ops, gen_array_ops,
                                   gen_control_flow_ops, gen_linalg_ops, gen_logging_ops,
                                   gen_math_ops, gen_nn_ops, gen_resource_variable_ops,
                                   gen_sparse_ops, gen_state_ops, gradients_util, handle_data_util,
                                   init_ops, math_ops, nn_ops, resource_variable_ops,
                                   special_math_ops, state_ops, variable_scope,
                                   variables as variables_lib)
from tensorflow.python.profiler.internal import _pywrap_profiler as profiler
from tensorflow.python.trackable import base as trackable
from tensorflow.python.training import optimizer as tf_optimizer, server_lib
from tensorflow.python.training.saving import saveable_object_util
from tensorflow.python.util import nest
from tensorflow.tsl.profiler.protobuf import trace_events_pb2
# END IMPORTS


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


def placeholder_capture(container, graph, tensor, name: str):
    """A placeholder of ``graph`` capturing ``tensor`` by value, as
    ``capture_container`` makes one for a non-constant tensor."""
    return container._create_placeholder_helper(graph, tensor, name)


def raw_assert(condition, data, name=None):
    """An Assert op itself (``tf.debugging.Assert`` guards some data with a
    conditional, a function call per step)."""
    return gen_logging_ops._assert(condition, data, name=name)


def eager_context_initialized() -> bool:
    """Whether the eager context has made its devices (their configuration is then fixed)."""
    return context.context()._initialized


def connect_eager_to_cluster(cluster_spec, job: str, task: int) -> None:
    """This process's eager context joins ``cluster_spec`` as ``job``'s task
    ``task``, serving on that task's port: its tf.functions then place ops on
    every task's devices by name (TensorFlow's eager remote context)."""
    _tf.config.experimental_connect_to_cluster(cluster_spec, job_name=job, task_index=task,
                                               protocol="grpc")


def graph_of_inputs(inputs):
    """The graph ``inputs`` belong to (the default graph if none)."""
    return ops._get_graph_from_inputs(inputs)


def restore_coordinator_class():
    """The class every checkpoint restore makes to hold its bindings."""
    return checkpoint._CheckpointRestoreCoordinator


def take_restore_identity(new, old) -> None:
    """``new`` counts as restored as far as ``old`` was."""
    initialize_trackable(new)
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


def register_tape_gradient_function() -> None:
    """Make eager tapes call the gradient function ``backprop`` holds now
    (tapes call the function registered with them, not the module attribute)."""
    pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)


def original_op_scope(graph, op):
    """Ops made in this context record ``op`` as the op they came from."""
    return graph._original_op(op)


def variable_store_class():
    """The class behind ``tf.compat.v1.get_variable`` that makes variables."""
    return variable_scope._VariableStore


def iterator_resource(iterator):
    """The resource tensor of a graph-mode dataset iterator."""
    return iterator._iterator_resource


@contextlib.contextmanager
def tensors_by_identity():
    """Tensors compare and hash by identity, as in graph mode, inside this
    context (TF2 makes a function's tensors unhashable and compares them
    elementwise)."""
    used = tensor_lib.Tensor._USE_EQUALITY
    tensor_lib.disable_tensor_equality()
    try:
        yield
    finally:
        tensor_lib.Tensor._USE_EQUALITY = used


def reopen_session(session) -> None:
    """Give ``session`` a new TensorFlow session on its graph, in place of its
    own: the state it held (variables, iterators, tables) starts anew."""
    c_session.TF_CloseSession(session._session)
    c_session.TF_DeleteSession(session._session)
    options = c_session.TF_NewSessionOptions(target=session._target, config=session._config)
    try:
        with session._graph._c_graph.get() as c_graph:
            session._session = c_session.TF_NewSessionRef(c_graph, options)
    finally:
        c_session.TF_DeleteSessionOptions(options)


def is_stateful(op) -> bool:
    """Whether TensorFlow treats ``op`` as stateful (its kernel's own flag)."""
    return op._is_stateful


def library_function(graph, name: str):
    """The function ``name`` of ``graph``'s library (or an outer graph's), or None."""
    return graph._get_function(name)


def function_from_definition(definition):
    """A ``FunctionDef`` as a function that can be added to a graph's library."""
    return function._from_definition(definition)


def read_or(variable, initial) -> tensor_lib.Tensor:
    """The variable's value, or ``initial`` while it has none (a new session):
    a branch (cond_v2, so it may run inside task functions) reads it only
    once it was written."""
    return cond_v2.cond_v2(variable.is_initialized(), variable.read_value,
                           lambda: constant_op.constant(initial, variable.dtype))


def silu_exports():
    """(module, name) of every public API name of ``tf.nn.silu`` (``swish``
    too, in ``tf.nn``, ``tf.compat.v1.nn`` and ``tf.compat.v2.nn``, which
    keras calls): patching the function's module would miss them."""
    silu = _tf.nn.silu
    return [(module, name) for module in (_tf.nn, _tf.compat.v1.nn, _tf.compat.v2.nn)
            for name in ("silu", "swish") if getattr(module, name, None) is silu]


def profiler_started():
    """TensorFlow's profiler, started on host activity only; None when
    another profile is being taken (one at a time)."""
    session = profiler.ProfilerSession()
    try:
        session.start("", {"host_tracer_level": 2, "device_tracer_level": 0,
                           "python_tracer_level": 0})
    except tf_errors.OpError:
        return None
    return session


def profiled_events(session):
    """Stop ``session`` (``profiler_started``): what the host did meanwhile,
    per event (thread, name, start, end in microseconds, its arguments)."""
    trace = trace_events_pb2.Trace.FromString(session.stop())
    return [(event.resource_id, event.name, event.timestamp_ps / 1e6,
             (event.timestamp_ps + event.duration_ps) / 1e6, dict(event.args))
            for event in trace.trace_events]
