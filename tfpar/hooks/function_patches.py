"""tf.functions traced from eager code: a step that trains with a static
batch is traced again with it relaxed (arguments, and the eager tensors it
captures as its batch); a traced step is handed to the runtime to rewrite
before TensorFlow makes it a function; the runtime may measure its calls."""
import threading

from tfpar.compat import tf as internals
from tfpar.errors import TfparError
from tfpar.compat.tf import (capture_container, concrete_function, func_graph, ops,
                             tracing_compilation, transform)
from tfpar.hooks import capture as cap_lib
from tfpar.hooks import seams
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.step_graphs import is_step_function

__all__ = ["add_function_patches", "retracing"]


def add_function_patches(patches: PatchSet) -> None:
    patches.add(transform, "apply_func_graph_transforms", _wrap_func_graph_transforms)
    patches.add(tracing_compilation, "_create_concrete_function",
                _wrap_create_concrete_function)
    patches.add(func_graph, "func_graph_from_py_func", _wrap_func_graph_from_py_func)
    patches.add(capture_container.FunctionCaptures, "capture_by_value",
                _wrap_capture_by_value)
    patches.add(concrete_function.ConcreteFunction, "_call_flat", _wrap_call_flat)


# The FuncGraph being traced again with its arguments' batch relaxed
# (``_wrap_create_concrete_function``) or None, and whether its argument
# placeholders (or its captured batch's) are being made (the function's own
# placeholders keep their shapes).
retracing = threading.local()


def _wrap_create_concrete_function(original):
    """A tf.function traced from eager code that trains with arguments of a
    static batch size (TF2 traces with the shapes of the values it is called
    with), or with a batch captured from eager code, is traced a second time
    with that dimension unknown, as graph-mode placeholders are made
    (``batch_shapes``): TensorFlow would otherwise build the full batch's
    size into the step the replicas split. Where that trace fails (the script
    reads its batch size as a Python number, ``x.shape[0]``, which it leaves
    unknown; or tfpar fails), the first trace runs, on one device, and the
    runtime says why (``retrace_failed``); tfpar's own refusals propagate."""
    def _create_concrete_function(function_type, type_context, func_graph, tracing_options):
        concrete = original(function_type, type_context, func_graph, tracing_options)
        if seams.runtime is None or not seams.runtime.retraces_relaxed(func_graph):
            return concrete
        relaxed = func_graph.__class__(func_graph.name)
        capture = cap_lib.capture_for(relaxed)
        capture.relaxed = True
        capture.batch_captured = cap_lib.capture_for(func_graph).batch_captured
        retracing.graph, retracing.arguments = relaxed, True
        try:
            again = original(function_type, type_context, relaxed, tracing_options)
        except TfparError:
            raise
        except Exception as error:  # pylint: disable=broad-except
            # The first trace runs as the script wrote it; the runtime says why.
            seams.runtime.retrace_failed(func_graph, error)
            return concrete
        finally:
            retracing.graph = None
        if not seams.runtime.rewritten(relaxed):
            return concrete  # not rewritten (it runs on one device): as without tfpar
        capture.first_trace = concrete  # its graph lives on, as long as this trace
        return again
    return _create_concrete_function


def _wrap_capture_by_value(original):
    """In the trace with the batch relaxed, a tensor of eager code the step
    reads as its batch (``GraphCapture.batch_captured``) is captured by a
    placeholder with dimension 0 unknown, like the arguments, however small
    (TensorFlow makes a tensor of at most 128 values a constant)."""
    def capture_by_value(self, graph, tensor, name=None):
        if graph is not getattr(retracing, "graph", None) or not any(
                tensor is t for t in cap_lib.capture_for(graph).batch_captured):
            return original(self, graph, tensor, name)
        arguments, retracing.arguments = retracing.arguments, True
        try:
            return internals.placeholder_capture(self, graph, tensor, name or str(ops.uid()))
        finally:
            retracing.arguments = arguments
    return capture_by_value


def _wrap_func_graph_from_py_func(original):
    def func_graph_from_py_func(*args, **kwargs):
        retracing.arguments = False  # they exist: placeholders made now are captures
        return original(*args, **kwargs)
    return func_graph_from_py_func


def _wrap_func_graph_transforms(original):
    def apply_func_graph_transforms(graph):
        original(graph)
        if seams.runtime is not None and is_step_function(graph):
            with internals.tensors_by_identity():
                seams.runtime.rewrite_function(graph)
    return apply_func_graph_transforms




def _wrap_call_flat(original):
    """A call of a tf.function is announced to the runtime (``before_call``);
    one the runtime measures (``measured_call``) runs through it, every other
    as it is."""
    def _call_flat(self, tensor_inputs, captured_inputs):
        if seams.runtime is not None:
            seams.runtime.before_call(self.graph)
        measure = None if seams.runtime is None else seams.runtime.measured_call(self.graph)
        if measure is None:
            return original(self, tensor_inputs, captured_inputs)
        return measure(lambda: original(self, tensor_inputs, captured_inputs), tensor_inputs)
    return _call_flat
