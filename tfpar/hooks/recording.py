"""What the recording hooks share: which graphs tfpar records, a variable as
a graph reads it, and a graph's loss scale."""
from tfpar.compat.tf import resource_variable_ops
from tfpar.hooks import capture as cap_lib
from tfpar.hooks import loss_scaling, seams
from tfpar.hooks.step_graphs import is_step_function

__all__ = ["handle_in", "loss_scale", "recorded"]


def recorded(graph) -> bool:
    """Whether tfpar records what is built in ``graph``: a graph, or a tf.function
    traced from eager code."""
    return not graph.building_function or is_step_function(graph)


def loss_scale(graph):
    """The loss scale of ``graph`` (made on first use) if its gradients are
    loss-scaled (fp16 mixed precision), else None."""
    if seams.runtime is None or not seams.runtime.loss_scaled(graph):
        return None
    cap = cap_lib.capture_for(graph)
    if cap.loss_scale is None:
        with cap.phase(None):
            cap.loss_scale = loss_scaling.LossScale(graph)
    return cap.loss_scale


def handle_in(graph, x):
    """A variable as ``graph`` reads it: its handle, which a tf.function
    reads through the placeholder capturing it; anything else as it is."""
    if not resource_variable_ops.is_resource_variable(x):
        return x
    return graph.capture(x.handle) if graph.building_function else x.handle
