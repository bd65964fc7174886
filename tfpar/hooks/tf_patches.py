"""The TensorFlow seams tfpar intercepts. Each wrapper records, then forwards.

* ``Graph._create_op_internal``: a placeholder declared with a static batch
  dimension is made with that dimension unknown (``batch_shapes``).
* ``Graph._create_op_helper``: every new op joins the open scope / phase.
* ``gradients_util._GradientsHelper``: ops made by ``tf.gradients`` (and hence
  ``Optimizer.compute_gradients``) are BACKWARD; the call is recorded, with the
  seeds ``gradients_util._DefaultGradYs`` returned for it.
* ``Optimizer.apply_gradients`` (and subclasses' overrides) and keras'
  ``OptimizerV2.apply_gradients`` (``tf.keras.optimizers.legacy``, used by
  ``model.fit`` in graph mode): APPLY; recorded (keras' ``iterations`` counts
  as the global step).
* With fp16 mixed precision, gradient seeds, gradients and updates are
  loss-scaled there (``loss_scaling``).
* ``backprop._gradient_function`` (a GradientTape's gradient of one op, in a
  tf.function step): built under ``_original_op(forward op)``, as
  ``tf.gradients`` builds it.
* ``SparseTensor.__init__``: a SparseTensor made of fed placeholders
  (``sparse_placeholder``) is recorded, so the batch split cuts it by rows.
* ``FunctionCaptures.capture_by_value``: a tensor of eager code a TF2 step
  reads as its batch is captured with its batch dimension unknown when the
  step is traced again with its batch relaxed.
* ``BaseSession.__init__``: tfpar's devices are merged into the ConfigProto.
* ``DatasetV1._make_one_shot_iterator`` / ``_make_initializable_iterator``:
  with ``io.shard_dataset`` each process / worker iterates over its shard.
* ``BaseSession.run``, ``BaseSession._make_callable_from_options`` (keras'
  graph functions) and ``Graph.finalize``: the graph is rewritten before it
  first runs or freezes; fetches are translated to their parallel versions.
* keras ``fit`` / ``train_on_batch`` / ``set_weights`` / ``load_weights``:
  the training function is built before they run the session (``keras_patches``).
* keras ``Layer.__init__`` / ``__call__``: a layer made or called in a scope
  entered in TF2 eager code is called in that scope in each step (``keras_scopes``).
* ``ResourceVariable.__init__``: a variable's declared aggregation is
  recorded (``variable_aggregation``).
* keras ``BatchNormalization``: synchronized layers (every one with
  ``batch_norm.sync``) sum their statistics over tfpar's replicas
  (``sync_batch_norm``).
* keras optimizers' slot variables and checkpoint children: slots of split
  weights are numbered as for the whole weight (``optimizer_slots``);
  checkpoint restores, which learn that a whole weight became split
  (``checkpoint_bindings``).
"""
import contextlib
import threading
import weakref
from typing import Any

from keras.src.optimizers import optimizer as keras_optimizer
from keras.src.optimizers.legacy import optimizer_v2 as keras_optimizer_v2
from tensorflow.core.function.capture import capture_container
from tensorflow.core.protobuf import config_pb2
from tensorflow.python import pywrap_tfe
from tensorflow.python.client import pywrap_tf_session as c_session
from tensorflow.python.client import session as tf_session
from tensorflow.python.data.ops import dataset_ops
from tensorflow.python.eager import backprop, context
from tensorflow.python.eager.polymorphic_function import tracing_compilation, transform
from tensorflow.python.framework import errors as tf_errors
from tensorflow.python.framework import func_graph
from tensorflow.python.framework import ops, sparse_tensor
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, gradients_util
from tensorflow.python.ops import resource_variable_ops
from tensorflow.python.training import optimizer as tf_optimizer
from tensorflow.python.util import nest

from tfpar.hooks import batch_shapes
from tfpar.hooks import capture as cap_lib
from tfpar.hooks import loss_scaling
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.session_close import add_session_close_patches, lost_worker
from tfpar.hooks.keras_patches import add_keras_patches
from tfpar.hooks.keras_scopes import add_keras_scope_patches
from tfpar.hooks.optimizer_slots import add_optimizer_slot_patches
from tfpar.hooks.checkpoint_bindings import add_checkpoint_binding_patches
from tfpar.hooks.split_patches import add_split_patches
from tfpar.hooks.step_graphs import is_step_function
from tfpar.hooks.sync_batch_norm import add_sync_batch_norm_patches
from tfpar.hooks.variable_aggregation import add_variable_aggregation_patches
from tfpar.errors import ClusterError
from tfpar.ir.taskgraph import Phase

__all__ = ["install", "installed", "uninstall"]

_patches = PatchSet()
# Set by install(): what the runtime does at each seam (``runtime.engine``).
_runtime: Any = None


def installed() -> bool:
    return _patches.installed


def install(runtime: Any) -> None:
    """Install every patch (idempotent); ``runtime`` (``tfpar.runtime.engine``,
    looked up at each call) provides:

      session_config: (ConfigProto-or-None, graph-or-None) -> ConfigProto for
        new sessions.
      session_target: target -> target for new sessions (a cluster's server).
      before_run: graph -> fetch translator (or None); called before each run,
        before a keras callable is made and before a graph is finalized.
      run_options: (RunOptions-or-None, graph) -> RunOptions for each run (a
        deadline, a trace to profile the step);
      after_run: (graph, RunMetadata-or-None) -> None, after each run that succeeded;
      made_callable: graph -> None, after a callable's fetches were translated;
      run_failed: called with the TensorFlow error a run raised (may raise a
        clearer one).
      rewrites_next: graph -> whether its next run rewrites it.
      ran_before_rewrite: (graph, number of variables carried) -> whether a
        session that ran the graph before its rewrite must be reopened
        (called after the rewrite; may raise).
      make_iterator: (dataset, make) -> iterator, where ``make(dataset)`` is
        TensorFlow's; may shard the dataset or make more iterators.
      setup_capture: prepares the capture of each new graph (a pinned plan's
        split layers).
      function_gradients: called with the default graph when a tf.GradientTape,
        or tf.gradients inside a tf.function, computes gradients that tfpar
        does not record.
      rewrite_function: called with each tf.function traced from eager code,
        before TensorFlow makes it a function (it may rewrite the graph).
      retraces_relaxed: FuncGraph -> whether to trace its function again
        with the batch dimension of its arguments unknown.
      loss_scaled: graph -> whether its gradients are loss-scaled (fp16; may
        raise).
      sync_batch_norm: () -> whether every BatchNormalization layer made now
        is synchronized (``batch_norm.sync``).
    """
    global _runtime
    _runtime = runtime
    cap_lib.set_capture_setup(runtime.setup_capture)
    if _patches.installed:
        return
    _patches.add(ops.Graph, "_create_op_internal", _wrap_create_op_internal)
    _patches.add(ops.Graph, "_create_op_helper", _wrap_create_op)
    _patches.add(ops.Graph, "finalize", _wrap_finalize)
    _patches.add(gradients_util, "_GradientsHelper", _wrap_gradients)
    _patches.add(gradients_util, "_DefaultGradYs", _wrap_default_grad_ys)
    _patch_optimizer_class(tf_optimizer.Optimizer)
    _patches.add(tf_optimizer.Optimizer, "__init__", _wrap_optimizer_init)
    _patches.add(tf_session.BaseSession, "__init__", _wrap_session_init)
    _patches.add(tf_session.BaseSession, "run", _wrap_session_run)
    _patches.add(tf_session.BaseSession, "_make_callable_from_options", _wrap_make_callable)
    _patches.add(keras_optimizer_v2.OptimizerV2, "apply_gradients", _wrap_keras_apply)
    _patches.add(keras_optimizer.Optimizer, "apply_gradients", _wrap_keras_apply)
    _patches.add(transform, "apply_func_graph_transforms", _wrap_func_graph_transforms)
    _patches.add(tracing_compilation, "_create_concrete_function",
                 _wrap_create_concrete_function)
    _patches.add(func_graph, "func_graph_from_py_func", _wrap_func_graph_from_py_func)
    _patches.add(capture_container.FunctionCaptures, "capture_by_value",
                 _wrap_capture_by_value)
    _patches.add(sparse_tensor.SparseTensor, "__init__", _wrap_sparse_tensor_init)
    _patches.add(backprop.GradientTape, "gradient", _wrap_tape_gradient)
    _patches.add(backprop, "_gradient_function", _wrap_gradient_function)
    pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)
    _patches.add(dataset_ops.DatasetV2, "__iter__", _wrap_eager_iter)
    for name in ("_make_one_shot_iterator", "_make_initializable_iterator"):
        _patches.add(dataset_ops.DatasetV1, name, _wrap_make_iterator)
    add_split_patches(_patches)
    add_keras_patches(_patches, lambda: _runtime is not None)
    add_keras_scope_patches(_patches)
    add_optimizer_slot_patches(_patches)
    add_checkpoint_binding_patches(_patches)
    add_variable_aggregation_patches(_patches)
    add_session_close_patches(_patches)
    add_sync_batch_norm_patches(_patches, lambda: _runtime is not None
                                and _runtime.sync_batch_norm())


def uninstall() -> None:
    global _runtime
    _patches.remove()
    pywrap_tfe.TFE_Py_RegisterGradientFunction(backprop._gradient_function)
    cap_lib.set_capture_setup(None)
    _runtime = None


def _wrap_create_op(original):
    def _create_op_helper(self, op, compute_device=True):
        original(self, op, compute_device)
        if not cap_lib.is_paused() and _recorded(self):
            # tf.gradients builds each gradient function under _original_op(forward op).
            cap_lib.capture_for(self).record_op(op, self._default_original_op)
    return _create_op_helper


def _wrap_create_op_internal(original):
    def _create_op_internal(self, op_type, inputs, dtypes=None, input_types=None, name=None,
                            attrs=None, op_def=None, compute_device=True):
        declared = None
        retracing = self is getattr(_retracing, "graph", None)
        if (op_type == "Placeholder" and attrs is not None and not cap_lib.is_paused()
                and (not self.building_function or retracing and _retracing.arguments)):
            attrs, declared = batch_shapes.relaxed_placeholder_attrs(attrs)
        op = original(self, op_type, inputs, dtypes, input_types, name, attrs, op_def,
                      compute_device)
        if declared is not None:
            cap_lib.capture_for(self).declared_batch[op.name] = declared
        return op
    return _create_op_internal


def _wrap_finalize(original):
    def finalize(self):
        if not self.finalized and _runtime is not None:
            _runtime.before_run(self)
        original(self)
    return finalize


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


# Seeds returned by _DefaultGradYs during the innermost running _GradientsHelper.
_seeds = threading.local()


def _wrap_gradients(original):
    def _GradientsHelper(ys, xs, *args, **kwargs):  # pylint: disable=invalid-name
        graph = ops.get_default_graph()
        if not _recorded(graph):
            if _runtime is not None and type(graph) is func_graph.FuncGraph and not _backward_of(
                    args, kwargs):
                _runtime.function_gradients(graph)  # a tf.function's, not If / While's
            # Gradients TF takes inside function graphs (If / While gradients)
            # have seeds of their own: keep them out of the outer call's.
            outer = getattr(_seeds, "value", None)
            _seeds.value = None
            try:
                return original(ys, xs, *args, **kwargs)
            finally:
                _seeds.value = outer
        cap = cap_lib.capture_for(graph)
        outer = getattr(_seeds, "value", None)
        _seeds.value = []
        try:
            with cap.phase(Phase.BACKWARD):
                grads = original(ys, xs, *args, **kwargs)
                scale = _loss_scale(graph)
                if scale is not None:
                    grads = scale.unscaled(grads)
            seeds = _seeds.value
        finally:
            _seeds.value = outer
        xs_list = [_handle_in(graph, x) for x in _as_list(xs)]
        cap.gradient_calls.append(cap_lib.GradientCall(
            ys=_as_list(ys), xs=xs_list, grads=list(grads), seeds=seeds))
        return grads
    return _GradientsHelper


def _backward_of(args, kwargs) -> bool:
    """Whether a ``_GradientsHelper`` call (arguments after ``ys, xs``) builds
    TensorFlow's own backward of a function, loop or branch graph (it passes
    the graph differentiated, ``src_graph``), not gradients a script asked for."""
    return kwargs.get("src_graph", args[7] if len(args) > 7 else None) is not None


def _wrap_tape_gradient(original):
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=backprop.UnconnectedGradients.NONE):
        graph = ops.get_default_graph()
        if _runtime is None or not is_step_function(graph):
            if _runtime is not None:
                _runtime.function_gradients(graph)
            return original(self, target, sources, output_gradients, unconnected_gradients)
        _loss_scale(graph)  # raises: not in tf.function steps
        cap = cap_lib.capture_for(graph)
        targets = nest.flatten(target)
        with cap.phase(Phase.BACKWARD):
            seeds = []
            if output_gradients is None:  # TF's default, made here to be recorded
                seeds = [array_ops.ones_like(t) for t in targets]
                output_gradients = nest.pack_sequence_as(target, seeds)
            grads = original(self, target, sources, output_gradients, unconnected_gradients)
        xs = [_handle_in(graph, x) for x in nest.flatten(sources)]
        cap.gradient_calls.append(cap_lib.GradientCall(
            ys=targets, xs=xs, grads=nest.flatten(grads), seeds=seeds))
        return grads
    return gradient


def _wrap_gradient_function(original):
    """A GradientTape builds each op's gradient without telling the graph
    which op it differentiates (tf.gradients does: ``_original_op``). In a
    step tfpar records, it is told here, so that backward ops join their
    forward op's TaskGraph as in graph mode (not that of the gradient they
    read first, which comes from the next TaskGraph)."""
    def gradient_function(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                          skip_input_indices, forward_pass_name_scope):
        graph = ops.get_default_graph()
        forward = (_taped_op(graph, op_name, inputs, outputs)
                   if _runtime is not None and is_step_function(graph) else None)
        with graph._original_op(forward) if forward is not None else contextlib.nullcontext():
            return original(op_name, attr_tuple, num_inputs, inputs, outputs, out_grads,
                            skip_input_indices, forward_pass_name_scope)
    return gradient_function


def _taped_op(graph, op_type: str, inputs, outputs):
    """The op of ``graph`` the tape recorded: that of its outputs the tape
    kept, else the one op of ``op_type`` reading all its inputs the tape kept
    (each op's gradient keeps what it needs), else None."""
    def kept(tensors):
        return [t for t in tensors or () if isinstance(t, tensor_lib.Tensor)
                and getattr(t, "graph", None) is graph]
    if kept(outputs):
        return kept(outputs)[0].op
    readers = [{c for c in t.consumers() if c.type == op_type} for t in kept(inputs)]
    common = set.intersection(*readers) if readers else set()
    return common.pop() if len(common) == 1 else None


# The FuncGraph being traced again with its arguments' batch relaxed
# (``_wrap_create_concrete_function``) or None, and whether its argument
# placeholders (or its captured batch's) are being made (the function's own
# placeholders keep their shapes).
_retracing = threading.local()


def _wrap_create_concrete_function(original):
    """A tf.function traced from eager code that trains with arguments of a
    static batch size (TF2 traces with the shapes of the values it is called
    with), or with a batch captured from eager code, is traced a second time
    with that dimension unknown, as graph-mode placeholders are made
    (``batch_shapes``): TensorFlow would otherwise build the full batch's
    size into the step the replicas split."""
    def _create_concrete_function(function_type, type_context, func_graph, tracing_options):
        concrete = original(function_type, type_context, func_graph, tracing_options)
        if _runtime is None or not _runtime.retraces_relaxed(func_graph):
            return concrete
        relaxed = func_graph.__class__(func_graph.name)
        capture = cap_lib.capture_for(relaxed)
        capture.relaxed = True
        capture.batch_captured = cap_lib.capture_for(func_graph).batch_captured
        _retracing.graph, _retracing.arguments = relaxed, True
        try:
            again = original(function_type, type_context, relaxed, tracing_options)
        finally:
            _retracing.graph = None
        # Not rewritten (the step runs on one device): the first trace, as without tfpar.
        return again if capture.rewrite is not None else concrete
    return _create_concrete_function


def _wrap_capture_by_value(original):
    """In the trace with the batch relaxed, a tensor of eager code the step
    reads as its batch (``GraphCapture.batch_captured``) is captured by a
    placeholder with dimension 0 unknown, like the arguments, however small
    (TensorFlow makes a tensor of at most 128 values a constant)."""
    def capture_by_value(self, graph, tensor, name=None):
        if graph is not getattr(_retracing, "graph", None) or not any(
                tensor is t for t in cap_lib.capture_for(graph).batch_captured):
            return original(self, graph, tensor, name)
        arguments, _retracing.arguments = _retracing.arguments, True
        try:
            return self._create_placeholder_helper(  # pylint: disable=protected-access
                graph, tensor, name or str(ops.uid()))
        finally:
            _retracing.arguments = arguments
    return capture_by_value


def _wrap_func_graph_from_py_func(original):
    def func_graph_from_py_func(*args, **kwargs):
        _retracing.arguments = False  # they exist: placeholders made now are captures
        return original(*args, **kwargs)
    return func_graph_from_py_func


def _wrap_func_graph_transforms(original):
    def apply_func_graph_transforms(graph):
        original(graph)
        if _runtime is not None and is_step_function(graph):
            with _tensors_by_identity():
                _runtime.rewrite_function(graph)
    return apply_func_graph_transforms


@contextlib.contextmanager
def _tensors_by_identity():
    """Tensors compare and hash by identity, as in graph mode, while tfpar
    rewrites a tf.function (TF2 makes a function's tensors unhashable and
    compares them elementwise)."""
    used = tensor_lib.Tensor._USE_EQUALITY  # pylint: disable=protected-access
    tensor_lib.disable_tensor_equality()
    try:
        yield
    finally:
        tensor_lib.Tensor._USE_EQUALITY = used  # pylint: disable=protected-access


def _recorded(graph) -> bool:
    """Whether tfpar records what is built in ``graph``: a graph, or a tf.function
    traced from eager code."""
    return not graph.building_function or is_step_function(graph)


def _wrap_default_grad_ys(original):
    def _DefaultGradYs(*args, **kwargs):  # pylint: disable=invalid-name
        grad_ys = original(*args, **kwargs)
        if getattr(_seeds, "value", None) is not None:
            scale = _loss_scale(ops.get_default_graph())
            if scale is not None:
                grad_ys = scale.scaled(grad_ys)
            _seeds.value = list(grad_ys)
        return grad_ys
    return _DefaultGradYs


def _recorded_apply(grads_and_vars, global_step, apply):
    """Run ``apply(grads_and_vars)`` in the APPLY phase; record the outermost call.
    ``global_step``: the variable, or a function giving it after ``apply`` ran
    (keras creates its ``iterations`` inside its own name scope there, and
    counts a step whose loss-scaled update was skipped)."""
    graph = ops.get_default_graph()
    if not _recorded(graph):
        return apply(grads_and_vars)
    cap = cap_lib.capture_for(graph)
    grads_and_vars = tuple(grads_and_vars)
    nested = getattr(cap, "_applying", False)
    scale = None if nested else _loss_scale(graph)
    cap._applying = True  # pylint: disable=protected-access
    try:
        with cap.phase(Phase.APPLY):
            result = apply(grads_and_vars) if scale is None else scale.gated_apply(
                grads_and_vars, apply, global_step if callable(global_step) else None)
    finally:
        cap._applying = nested  # pylint: disable=protected-access
    if not nested:
        cap.apply_calls.append(cap_lib.ApplyCall(
            grads_and_vars=list(grads_and_vars),
            global_step=_handle_in(graph, global_step() if callable(global_step) else global_step),
            train_op=result))
    return result


def _loss_scale(graph):
    """The loss scale of ``graph`` (made on first use) if its gradients are
    loss-scaled (fp16 mixed precision), else None."""
    if _runtime is None or not _runtime.loss_scaled(graph):
        return None
    cap = cap_lib.capture_for(graph)
    if cap.loss_scale is None:
        with cap.phase(None):
            cap.loss_scale = loss_scaling.LossScale(graph)
    return cap.loss_scale


def _handle_in(graph, x):
    """A variable as ``graph`` reads it: its handle, which a tf.function
    reads through the placeholder capturing it; anything else as it is."""
    if not resource_variable_ops.is_resource_variable(x):
        return x
    return graph.capture(x.handle) if graph.building_function else x.handle


def _wrap_apply(original):
    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        return _recorded_apply(grads_and_vars, global_step, lambda gv: original(
            self, gv, global_step=global_step, name=name))
    return apply_gradients


def _wrap_keras_apply(original):
    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        if context.executing_eagerly():
            return original(self, grads_and_vars, *args, **kwargs)
        return _recorded_apply(grads_and_vars, lambda: self.iterations, lambda gv: original(
            self, gv, *args, **kwargs))
    return apply_gradients


def _patch_optimizer_class(cls) -> None:
    """Wrap ``apply_gradients`` where ``cls`` defines it itself."""
    if "apply_gradients" in cls.__dict__ and not _patches.is_patched(cls, "apply_gradients"):
        _patches.add(cls, "apply_gradients", _wrap_apply)


def _wrap_optimizer_init(original):
    def __init__(self, *args, **kwargs):
        # Subclasses defined after install() get their overrides wrapped here.
        for klass in type(self).__mro__:
            if isinstance(klass, type) and issubclass(klass, tf_optimizer.Optimizer):
                _patch_optimizer_class(klass)
        original(self, *args, **kwargs)
    return __init__


def _wrap_sparse_tensor_init(original):
    def __init__(self, indices, values, dense_shape):
        original(self, indices, values, dense_shape)
        components = (self.indices, self.values, self.dense_shape)
        if (not isinstance(self.indices, ops.EagerTensor)
                and self.indices.op.type in _FEED_TYPES and self.values.op.type in _FEED_TYPES):
            capture = cap_lib.capture_for(self.indices.graph)
            if not any(group[0] is self.indices for group in capture.sparse_feeds):
                capture.sparse_feeds.append(components)
    return __init__


_FEED_TYPES = ("Placeholder", "PlaceholderWithDefault")


def _wrap_session_init(original):
    def __init__(self, target="", graph=None, config=None):
        if _runtime is not None:
            config = _runtime.session_config(config, graph)
            target = _runtime.session_target(target)
        original(self, target, graph, config)
    return __init__


def _wrap_eager_iter(original):
    def __iter__(self):
        if _runtime is not None and context.executing_eagerly():
            # A tf.function that reads it (keras fit) sees its batch unknown.
            return original(batch_shapes.relaxed_dataset(self)[0])
        return original(self)
    return __iter__


def _wrap_make_iterator(original):
    def make_iterator(self, *args, **kwargs):
        def make(dataset):
            return original(dataset, *args, **kwargs)
        return _runtime.make_iterator(self, make) if _runtime is not None else make(self)
    return make_iterator


def _before_run(session):
    """The runtime's fetch translator for ``session``'s graph (rewriting it first
    if need be), or None. A session that already ran the graph before the
    rewrite keeps the nodes it was sent (TensorFlow ignores later changes to
    them): it is reopened on the rewritten graph, with the values its variables
    had (``_reopen``)."""
    if _runtime is None:
        return None
    graph = session.graph
    early = session in _sessions_that_ran and _runtime.rewrites_next(graph)
    carried = _variable_values(session) if early and not graph.finalized else {}
    translate = _runtime.before_run(graph)
    if early and _runtime.ran_before_rewrite(graph, len(carried)):
        _reopen(session)
        if carried:
            session.run([v.initializer for v in carried],
                        {v.initializer.inputs[1]: value for v, value in carried.items()})
    _sessions_that_ran.add(session)
    return translate


# Sessions that have run (their graph's nodes so far were sent to them).
_sessions_that_ran: "weakref.WeakSet" = weakref.WeakSet()
# BaseSession.run as TensorFlow defines it (set when the patch is installed).
_plain_run: Any = None


def _variable_values(session) -> dict:
    """Variable -> its value in ``session``, for every initialized variable of
    the session's graph."""
    graph = session.graph
    variables = list({id(v): v for key in (ops.GraphKeys.GLOBAL_VARIABLES,
                                           ops.GraphKeys.LOCAL_VARIABLES)
                      for v in graph.get_collection(key)}.values())
    if not variables:
        return {}
    with graph.as_default(), cap_lib.recording_paused(), ops.name_scope(None):
        with ops.name_scope("tfpar_carry"):
            flags = [v.is_initialized() for v in variables]
    live = [v for v, ok in zip(variables, _plain_run(session, flags))
            if ok and len(v.initializer.inputs) == 2]  # an assign of its initial value
    return dict(zip(live, _plain_run(session, live)))


def _reopen(session) -> None:
    """Give ``session`` a new TensorFlow session on its (rewritten) graph, in
    place of the one that ran the graph before: the state it held (variables,
    iterators, tables) starts anew; variables are restored by the caller."""
    # pylint: disable=protected-access
    c_session.TF_CloseSession(session._session)
    c_session.TF_DeleteSession(session._session)
    options = c_session.TF_NewSessionOptions(target=session._target, config=session._config)
    try:
        with session._graph._c_graph.get() as c_graph:
            session._session = c_session.TF_NewSessionRef(c_graph, options)
    finally:
        c_session.TF_DeleteSessionOptions(options)


def _wrap_make_callable(original):
    def _make_callable_from_options(self, callable_options):
        translate = _before_run(self)
        if translate is not None:
            callable_options = _translated_options(callable_options, translate)
            _runtime.made_callable(self.graph)
        return original(self, callable_options)
    return _make_callable_from_options


def _translated_options(options, translate):
    """A copy of CallableOptions whose fetch tensors and target ops are the
    parallel versions (names in, names out)."""
    translated = type(options)()
    translated.CopyFrom(options)
    fetch, target = translate([list(options.fetch), list(options.target)])  # one translation
    del translated.fetch[:]
    translated.fetch.extend(fetch)
    del translated.target[:]
    translated.target.extend(target)
    return translated


def _wrap_session_run(original):
    global _plain_run
    _plain_run = original

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        translate = _before_run(self)
        if translate is not None:
            fetches = translate(fetches)
        if _runtime is not None:
            options = _runtime.run_options(options, self.graph)
            if run_metadata is None and options is not None and options.trace_level:
                run_metadata = config_pb2.RunMetadata()  # a step the runtime profiles
        try:
            result = original(self, fetches, feed_dict, options, run_metadata)
        except tf_errors.OpError as error:
            if _runtime is not None:
                try:
                    _runtime.run_failed(error)
                except ClusterError:
                    lost_worker(self)
                    raise
            raise
        if _runtime is not None:
            _runtime.after_run(self.graph, run_metadata)
        return result
    return run
