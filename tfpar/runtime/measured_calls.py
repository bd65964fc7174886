"""Predicted against measured for TF2 steps (``runtime.measured`` for
graphs): the calls of a tf.function step tfpar rewrote are counted up to
``measure.after_steps``; those of the steps measured run under TensorFlow's
profiler (host activity only; the other calls run as they are), and after
the last the comparison is made, as for a graph. Measured per device: on
CPUs the ops' busy time (memory: TensorFlow keeps no record of a function's
allocations on CPUs), on GPUs the allocator's peak (time: the host sees
kernels launched, not run)."""
import dataclasses
import functools
from typing import Any, Callable, List, Optional, Sequence, Tuple

from tfpar.cluster.devices import short_name
from tfpar.compat.tf import config, context, ops, profiled_events, profiler_started
from tfpar.ir import measured as compare
from tfpar.runtime.context import active
from tfpar.runtime.graph_state import GraphState, existing_state
from tfpar.runtime.measured import concluded, traced_steps
from tfpar.runtime.step_trace import function_spans

__all__ = ["measured_call", "taken_over"]

_NO_CPU_MEMORY = ("memory: TensorFlow keeps no record of a tf.function's allocations on CPUs "
                  "(the peak of a Session.run step is measured)")
_NO_GPU_TIME = "time: the host profiler sees GPU kernels launched, not run"
_NO_TRACE = "time: another profile was being taken during the steps measured"


def measured_call(graph: ops.Graph) -> Optional[Callable[[Callable[[], Any], Sequence], Any]]:
    """For a call of the tf.function whose graph is ``graph``, from eager
    code: ``measure(call, tensor_inputs)``, which runs it as a training step
    counted (and measured if due); None once nothing is left to measure
    (every other tf.function, every call after the comparison)."""
    state = existing_state(graph)
    if state is None or state.predicted is None or not context.executing_eagerly():
        return None
    return functools.partial(_step, graph, state)


def taken_over(graph: ops.Graph) -> None:
    """A trace of a tf.function step measured already (traced again for
    another batch size, say) with the same TaskGraphs on the same devices:
    its plan takes the measurement over, and its calls are not measured."""
    state, rt = existing_state(graph), active()
    done = rt.measured_steps.get(graph.name)
    if state is None or state.plan is None or done is None or _where(done) != _where(state.plan):
        return
    state.plan = dataclasses.replace(state.plan, measured=done.measured)
    state.predicted = None


def _where(plan) -> list:
    return [(tg.name, tg.strategy, list(tg.devices)) for tg in plan.task_graphs]


def _step(graph: ops.Graph, state: GraphState, call: Callable[[], Any], inputs: Sequence) -> Any:
    """Run ``call`` as the next training step of ``graph``: traced when
    ``traced_steps`` measures it; after the last, compared."""
    last = active().config.get("measure.after_steps")
    state.training_steps += 1
    if state.training_steps not in traced_steps(last):
        return call()
    devices = sorted({d for tg in state.plan.task_graphs for d in tg.devices})
    gpus = [d for d in devices if "GPU:" in short_name(d)]
    for device in gpus:
        config.reset_memory_stats(device)
    session = profiler_started() if not gpus else None
    try:
        result = call()
    finally:
        ran = profiled_events(session) if session is not None else None
    peaks = {short_name(d): config.get_memory_info(d)["peak"] for d in gpus}
    state.samples.append(_measured(graph, state, ran, peaks))
    if state.training_steps == last:
        rows = [int(t.shape[0]) for t in inputs
                if t.shape.rank and t.shape[0] is not None and t.dtype.name != "resource"]
        before, rt = state.plan, active()
        concluded(state, rows, _unmeasured(state.samples, bool(gpus)))
        if rt.function_plan is before:  # what current_plan() shows
            rt.function_plan = state.plan
        rt.measured_steps[graph.name] = state.plan
        state.predicted = None  # nothing left to measure: later calls run as they are
    return result


def _measured(graph: ops.Graph, state: GraphState, ran, peaks) -> List[Tuple[Any, Any]]:
    """Per TaskGraph, on its busiest device in a traced call: the seconds its
    ops ran (overlaps once; None when not profiled) and the allocator's peak
    bytes (None when not measured)."""
    spans = function_spans(ran, graph) if ran is not None else {}
    said = []
    for tg in state.plan.task_graphs:
        devices = [short_name(d) for d in tg.devices]
        time_s = (max(compare.busy_seconds(spans.get((tg.name, d), ())) for d in devices)
                  if ran is not None else None)
        said.append((time_s, max(peaks[d] for d in devices) if peaks else None))
    return said


def _unmeasured(samples, gpus: bool) -> str:
    """What the steps measured did not measure, and why ('' if nothing)."""
    if gpus:
        return _NO_GPU_TIME
    if any(time_s is None for sample in samples for time_s, _ in sample):
        return f"{_NO_CPU_MEMORY}; {_NO_TRACE}"
    return _NO_CPU_MEMORY
