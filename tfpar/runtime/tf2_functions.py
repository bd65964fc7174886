"""TF2 training steps: a tf.function traced from eager code is planned and
rewritten like a graph, traced again with its batch relaxed, or left to
train on one device, saying why."""
from typing import Any, Callable, Optional

from tfpar import fallback
from tfpar.compat.tf import context, ops
from tfpar.hooks.capture import GraphCapture, existing_capture
from tfpar.ir.plan import Plan, TaskGraphPlan
from tfpar.rewriters.function_outputs import rewire_outputs
from tfpar.analysis.op_kinds import is_input, reads_as_batch
from tfpar.runtime.captured_batches import captured_batch, unsplittable
from tfpar.runtime.context import Runtime, active
from tfpar.rewriters.horovod_backend import HorovodProcesses
from tfpar.runtime.graph_state import existing_state, state_of
from tfpar.runtime.measured_calls import taken_over
from tfpar.runtime.planning import plan_for

__all__ = ["before_call", "function_gradients", "keras_3_steps", "retrace_failed",
           "retraces_relaxed", "rewrite_function"]

_PASS_THE_BATCH = ("Pass the batch to the step as arguments (step(x, y)), or read it from a "
                   "tf.data iterator in the step, for tfpar to split it")


def rewrite_function(graph: ops.Graph, rewrite: Callable[[ops.Graph], Optional[Any]]) -> None:
    """A tf.function traced from eager code, before TensorFlow makes it a
    function: if it trains (tfpar recorded its gradients), it is planned and
    rewritten like a graph (``rewrite``: the runtime's ``before_run``), and
    returns the merged values of what it returned
    (``rewriters.function_outputs``). Its variables stay where they are (one
    copy, outside the function): replicas read them and their summed
    gradients update them once."""
    rt = active()
    capture = existing_capture(graph)
    if capture is not None and capture.relaxed:
        reads_as_batch(graph, capture.batch_captured)
    if rt is None or capture is None or not capture.gradient_calls:
        return
    if _plan_changes_nothing(rt):  # the step as traced is the plan: not retraced nor rewritten
        with graph.as_default():
            rt.function_plan, rt.function_pick = plan_for(graph, capture, rt), None
        return
    if not capture.relaxed and _traced_again(rt, graph, capture):
        return
    why, remedy = _unsplit_why(rt, graph, capture)
    if why:
        train_on_one_device(rt, graph, why, remedy)
        return
    if capture.batch_captured:
        fallback.fall_back(
            f"the tf.function {graph.name!r}, data parallel over {len(rt.devices)} devices, "
            "reading no batch through its arguments or iterators", "tfpar takes the tensors "
            "its losses read that it captures from eager code (shapes "
            + ", ".join(str(t.shape.as_list()) for t in capture.batch_captured)
            + ") for its batch, and splits their rows over the replicas", _PASS_THE_BATCH,
            graph)
    with graph.as_default():
        translate = rewrite(graph)
        if translate is not None:
            rewire_outputs(graph, translate)
            taken_over(graph)
            rt.function_plan = state_of(graph).plan
            rt.function_pick = state_of(graph).sharded_plan


def _traced_again(rt: Runtime, graph: ops.Graph, capture: GraphCapture) -> bool:
    """Whether the first trace of a step is left as it is: it reads a static
    batch, or a batch captured from eager code, and is traced again with that
    batch relaxed (that trace is rewritten); or its captured batch cannot be
    split, and it trains on one device."""
    static = _static_batch_inputs(graph)
    captured, why = captured_batch(graph, capture)
    if why:
        train_on_one_device(rt, graph, why, _PASS_THE_BATCH)
        return True
    if static or captured:
        capture.batch_captured = captured
        capture.retrace = True  # traced again, batch relaxed; that trace is rewritten
        return True
    return False


def _unsplit_why(rt: Runtime, graph: ops.Graph, capture: GraphCapture):
    """(why the step cannot be split over the replicas, the remedy), or ("", "")."""
    why = unsplittable(graph, capture) if capture.batch_captured else ""
    if why:
        return why, ("Make each loss a mean or a sum over the rows of the batch (of "
                     "per-example losses) for tfpar to split it")
    static = _static_batch_inputs(graph)
    if static:
        return (f"it reads a batch of static size ({static[0].name}: {static[0].shape}), "
                "which TensorFlow built into the step"), ("Make the dataset or iterator after "
                                                          "wh.init()")
    present = len(context.context().list_logical_devices(rt.device_type))
    if present < len(rt.devices):
        return (f"TensorFlow's eager context has {present} {rt.device_type} device(s) and the "
                f"plan {len(rt.devices)}"), ("Call wh.init() before the script runs its first "
                                              "TensorFlow op (logical CPU devices can only be "
                                              "made then)")
    return "", ""


def train_on_one_device(rt: Runtime, graph: Optional[ops.Graph], why: str,
                        remedy: str) -> None:
    """Say, once per function (``graph``; None: eager code), that its step
    runs as traced, on one device: the plan ``wh.current_plan()`` returns."""
    name = graph.name if graph is not None else None
    said = rt.warned_one_device.get(name)
    if said is None:
        where = "eager code" if name is None else f"the tf.function {name!r}"
        unchecked = (" (and check.finite_gradients does not check its gradients)"
                     if rt.config.get("check.finite_gradients") else "")
        rt.warned_one_device[name] = fallback.fall_back(
            f"{where}, data parallel over {len(rt.devices)} devices",
            f"it trains on one device, as it would without tfpar{unchecked}: {why}", remedy,
            graph)
    else:  # a trace of it for another batch: said of its plan too
        fallback.note(said, graph)
    rt.function_plan, rt.function_pick = _as_traced(rt, graph), None


def _as_traced(rt: Runtime, graph: Optional[ops.Graph]) -> Plan:
    """The plan of a step that trains as traced, on one device (eager code's:
    ``graph`` None): what ``wh.current_plan()`` shows, with what was said."""
    name = "eager_code" if graph is None else graph.name
    return Plan(task_graphs=(TaskGraphPlan(
        name=name, strategy="replicate", device_count=1, replicas=((rt.devices[0],),),
        num_ops=len(graph.get_operations()) if graph is not None else 0),),
        data_parallel_degree=1, notes=fallback.notes(graph))


def _plan_changes_nothing(rt: Runtime) -> bool:
    """One device in one process, whole batches, no check to add: any plan runs
    the step as it is."""
    return (len(rt.devices) == 1 and rt.cluster is None
            and rt.config.get("communication.backend") != "horovod"
            and rt.config.get("pipeline.num_micro_batch") == 1
            and not rt.config.get("check.finite_gradients"))


def retraces_relaxed(graph: ops.Graph) -> bool:
    """Whether the tf.function just traced into ``graph`` trains with a static
    batch size: it is traced again with its arguments' batch dimension unknown."""
    capture = existing_capture(graph)
    return capture is not None and capture.retrace


def before_call(graph: ops.Graph) -> None:
    """A call of the tf.function traced into ``graph``: in a Horovod job,
    before the first call of a step tfpar rewrote, every variable it reads
    takes rank 0's value (Horovod's broadcast), as graph-mode steps are
    synchronised after initializers and restores: however each process made
    or restored its variables (unseeded initializers, a checkpoint only rank 0
    read), they start equal."""
    rt = active()
    if (rt is None or rt.config.get("communication.backend") != "horovod"
            or not context.executing_eagerly()):
        return
    state = existing_state(graph)
    if state is None or state.rewrite is None or state.broadcast:
        return
    state.broadcast = True
    HorovodProcesses.broadcast_variables(graph.variables)


def retrace_failed(graph: ops.Graph, error: Exception) -> None:
    """tfpar's trace of the step ``graph`` with its batch dimension unknown
    raised ``error``: the first trace runs, on one device, as without tfpar;
    say so, and what would let it be split."""
    rt = active()
    if rt is None:
        raise error
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = lines[-1].rstrip(".") if lines else ""  # TensorFlow says "in user code:" first
    if not said.startswith(type(error).__name__):
        said = f"{type(error).__name__}: {said}"
    train_on_one_device(
        rt, graph, "tracing it again with the batch dimension unknown, as tfpar splits it, "
        f"raised {said}",
        "Read the batch size with tf.shape(x)[0], not x.shape[0] (a Python number, which is "
        "unknown in that trace, as for a placeholder([None, ...]))")


def _static_batch_inputs(graph: ops.Graph) -> list:
    """A FuncGraph's batch inputs (arguments, iterator reads: not captures)
    with a known dimension 0."""
    return [t for op in graph.get_operations() if is_input(op) for t in op.outputs
            if t.shape.rank and t.shape[0] is not None]


def function_gradients(graph: ops.Graph) -> None:
    """Gradients tfpar does not record (a tf.GradientTape in eager code, a
    tf.function in a graph-mode script): their step runs on one device."""
    rt = active()
    if rt is None:
        return
    eager = context.executing_eagerly()
    step = graph
    while getattr(getattr(step, "outer_graph", None), "building_function", False):
        step = step.outer_graph  # the loop body's (or inner function's) step
    if eager:
        why, remedy = ("tfpar parallelises graphs and tf.functions called from eager code, not "
                       "eager gradients"), "Take the gradients in a tf.function step"
    elif ops.executing_eagerly_outside_functions():  # within a TF2 step
        why = ("its gradients are taken inside a loop, branch or tf.function within the step "
               "(a `for` over a dataset inside the tf.function is a loop); tfpar parallelises "
               "a step's top level")
        remedy = ("Iterate the dataset in Python or call next(iterator) in the step, and leave "
                  "the functions it calls undecorated")
    else:
        why = ("tfpar parallelises a tf.function called from eager code, not one built into "
               "a graph")
        remedy = "Use tf.gradients or an optimizer's minimize there"
    train_on_one_device(rt, None if eager else step, why, remedy)


def keras_3_steps(model_name: str, version: str, jit_compile: bool) -> bool:
    """Whether a Keras 3 model's ``fit`` / ``evaluate`` runs its step as a
    tf.function called from eager code per batch (``hooks.keras_patches``), as
    Keras 2's does, so tfpar parallelises it: Keras 3 nests that tf.function in
    another (its ``steps_per_execution`` loop), whose gradients tfpar would not
    see. Not where any plan runs the step as it is. Such a step is not
    compiled by XLA: said when ``jit_compile`` asked for it."""
    rt = active()
    if rt is None or _plan_changes_nothing(rt):
        return False
    if jit_compile:
        fallback.fall_back(
            f"the Keras 3 model '{model_name}' (keras {version}) asks for jit_compile",
            f"its steps run on {len(rt.devices)} devices uncompiled: tfpar does not rewrite "
            "XLA-compiled functions", "Compile the model with jit_compile=False to silence this")
    return True
