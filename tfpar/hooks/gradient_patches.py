"""Gradients as they are built: ``tf.gradients`` (and hence
``Optimizer.compute_gradients``) and a tf.function step's GradientTape build
BACKWARD ops, recorded with the seeds backprop started from (loss-scaled
with fp16); a tape's op gradients are built under their forward op, as
``tf.gradients`` builds them."""
import contextlib
import threading

from tfpar.compat import tf as internals
from tfpar.compat.tf import array_ops, backprop, func_graph, gradients_util, nest, ops, tensor_lib
from tfpar.errors import PlanError
from tfpar.hooks import capture as cap_lib
from tfpar.hooks import seams
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.recording import handle_in, loss_scale, recorded
from tfpar.hooks.step_graphs import is_step_function
from tfpar.ir.recorded import GradientCall
from tfpar.ir.taskgraph import Phase
from tfpar.patterns.split_weights import SplitWeight

__all__ = ["add_gradient_patches"]


def add_gradient_patches(patches: PatchSet) -> None:
    patches.add(gradients_util, "_GradientsHelper", _wrap_gradients)
    patches.add(gradients_util, "_DefaultGradYs", _wrap_default_grad_ys)
    patches.add(backprop.GradientTape, "gradient", _wrap_tape_gradient)
    patches.add(backprop, "_gradient_function", _wrap_gradient_function)
    internals.register_tape_gradient_function()


def _as_list(x):
    return list(x) if isinstance(x, (list, tuple)) else [x]


# Seeds returned by _DefaultGradYs during the innermost running _GradientsHelper.
_seeds = threading.local()


def _wrap_gradients(original):
    def _GradientsHelper(ys, xs, *args, **kwargs):  # pylint: disable=invalid-name
        _check_sources(xs)
        graph = ops.get_default_graph()
        if not recorded(graph):
            if (seams.runtime is not None and type(graph) is func_graph.FuncGraph
                    and not _backward_of(args, kwargs)):
                seams.runtime.function_gradients(graph)  # a tf.function's, not If / While's
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
                scale = loss_scale(graph)
                if scale is not None:
                    grads = scale.unscaled(grads)
            seeds = _seeds.value
        finally:
            _seeds.value = outer
        xs_list = [handle_in(graph, x) for x in _as_list(xs)]
        cap.gradient_calls.append(GradientCall(
            ys=_as_list(ys), xs=xs_list, grads=list(grads), seeds=seeds))
        return grads
    return _GradientsHelper


def _check_sources(sources) -> None:
    """A split weight as ``model.weights`` shows it (whole, as one device holds
    it) is no variable to differentiate: its shards are."""
    split = next((x for x in nest.flatten(sources) if isinstance(x, SplitWeight)), None)
    if split is not None:
        raise PlanError(
            f"tfpar: gradients asked of split weight '{split.name}' (of shape "
            f"{split.shape.as_list()}, split by wh.split into {len(split)} shard variables): "
            "model.weights shows each split weight whole, as one device holds it, for reading "
            "and setting; a step differentiates and updates its shards. Take gradients of "
            "model.trainable_variables (or trainable_weights), which hold the shards")


def _backward_of(args, kwargs) -> bool:
    """Whether a ``_GradientsHelper`` call (arguments after ``ys, xs``) builds
    TensorFlow's own backward of a function, loop or branch graph (it passes
    the graph differentiated, ``src_graph``), not gradients a script asked for."""
    return kwargs.get("src_graph", args[7] if len(args) > 7 else None) is not None


def _wrap_default_grad_ys(original):
    def _DefaultGradYs(*args, **kwargs):  # pylint: disable=invalid-name
        grad_ys = original(*args, **kwargs)
        if getattr(_seeds, "value", None) is not None:
            scale = loss_scale(ops.get_default_graph())
            if scale is not None:
                grad_ys = scale.scaled(grad_ys)
            _seeds.value = list(grad_ys)
        return grad_ys
    return _DefaultGradYs


def _wrap_tape_gradient(original):
    def gradient(self, target, sources, output_gradients=None,
                 unconnected_gradients=backprop.UnconnectedGradients.NONE):
        _check_sources(sources)
        graph = ops.get_default_graph()
        if seams.runtime is None or not is_step_function(graph):
            if seams.runtime is not None:
                seams.runtime.function_gradients(graph)
            return original(self, target, sources, output_gradients, unconnected_gradients)
        loss_scale(graph)  # raises: not in tf.function steps
        cap = cap_lib.capture_for(graph)
        targets = nest.flatten(target)
        with cap.phase(Phase.BACKWARD):
            seeds = []
            if output_gradients is None:  # TF's default, made here to be recorded
                seeds = [array_ops.ones_like(t) for t in targets]
                output_gradients = nest.pack_sequence_as(target, seeds)
            grads = original(self, target, sources, output_gradients, unconnected_gradients)
        xs = [handle_in(graph, x) for x in nest.flatten(sources)]
        cap.gradient_calls.append(GradientCall(
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
                   if seams.runtime is not None and is_step_function(graph) else None)
        with (internals.original_op_scope(graph, forward) if forward is not None
              else contextlib.nullcontext()):
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
