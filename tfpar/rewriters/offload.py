"""ZeRO-Offload (``memory.offload_optimizer``): the optimizer's variables and
updates on the host CPU of their stage's device."""
from tfpar.analysis.stages import host_device
from tfpar.compat.tf import ops
from tfpar.errors import PlanError
from tfpar.rewriters import graph_edit
from tfpar.rewriters.rewrite_record import RewriteBuilder

__all__ = ["offload_optimizer"]


def offload_optimizer(graph: ops.Graph, rw: RewriteBuilder) -> None:
    """``memory.offload_optimizer`` (ZeRO-Offload, Ren et al. 2021, keeps the
    optimizer on the host): the variables and the update ops run on the host
    CPU of their stage's device. An update op must run where every variable it
    writes lives, so the weights move with their slots; the step reads them
    (one copy to the device), and sends its summed gradients to the host once.

    Raises:
      PlanError: mirrored variables (a copy per device would mean a copy per
        device on the host) or a tf.function's variables (made before the
        rewrite, where they stay).
    """
    if rw.mirrored:
        raise PlanError("tfpar: memory.offload_optimizer keeps one copy of each variable on "
                        "the host, but this plan mirrors variables on every device of a stage "
                        "(communication.backend 'collective', several processes or GPUs): "
                        "use it with pipelines, or with data parallelism on the CPU devices "
                        "of one process")
    if graph.building_function:
        raise PlanError("tfpar: memory.offload_optimizer cannot move the variables of a "
                        "tf.function step: they were made before tfpar rewrote the step; "
                        "build the model in a graph (TF1 style or Keras in graph mode)")
    for op in rw.selection.update_ops + rw.selection.variables:
        graph_edit.set_device(op, host_device(rw.placement.device(op)))
