"""Resource variables made in a graph: their declared aggregation
(``tf.VariableAggregation``) is recorded in the graph's capture, by variable
op name. Keras declares MEAN for BatchNorm's moving statistics and SUM for
metric totals; the rewrite averages or sums the replicas' updates of a
variable the step writes accordingly (``rewriters.select``). A tf.function
reads its variables' declarations from ``FuncGraph.variables`` instead."""
from tfpar.compat.tf import ops, resource_variable_ops
from tfpar.hooks import capture as cap_lib

__all__ = ["add_variable_aggregation_patches"]


def add_variable_aggregation_patches(patches) -> None:
    """Wrap ``ResourceVariable.__init__``."""
    patches.add(resource_variable_ops.ResourceVariable, "__init__", _recording)


def _recording(original):
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        handle = getattr(self, "_handle", None)
        declared = getattr(self.aggregation, "name", "NONE")
        if declared != "NONE" and handle is not None and not isinstance(handle, ops.EagerTensor):
            cap_lib.capture_for(handle.graph).aggregations[handle.op.name] = declared
    return __init__
