"""The split scope ops are being built in, as the split hooks see it."""
from tfpar.compat.tf import ops
from tfpar.hooks import capture as cap_lib
from tfpar.hooks.step_graphs import is_step_function

__all__ = ["open_split_context"]


def open_split_context(name=None):
    """The SplitContext of the split scope (or planned split layer) the default
    graph builds in, unless a pattern is building it already; None outside,
    in functions other than a TF2 step, and while an optimizer applies its
    updates (its slots of a split weight's slices are each one whole
    variable: ``Optimizer.minimize`` inside a split scope). A planned layer is found by
    the current name scope, or by ``name``: the full name of the op about
    to be made (for a function that opens no name scope)."""
    graph = ops.get_default_graph()
    if graph.building_function and not is_step_function(graph):
        return None
    capture = cap_lib.existing_capture(graph)
    ctx = (capture.current_split(name or graph.get_name_scope())
           if capture is not None and not capture.applying else None)
    return None if ctx is None or ctx.busy else ctx
