"""Which graphs are TF2 training steps."""
from tfpar.compat.tf import func_graph, ops

__all__ = ["is_step_function"]


def is_step_function(graph) -> bool:
    """Whether ``graph`` is a tf.function traced from eager code (a TF2
    training step is one), not a graph-mode function or a branch / loop body."""
    return (type(graph) is func_graph.FuncGraph and ops.executing_eagerly_outside_functions()
            and not getattr(graph.outer_graph, "building_function", False))
