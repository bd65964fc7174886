"""Predicted against measured on every run (config key ``measure.after_steps``):
the cost model's compute time and peak memory of each TaskGraph, costed when
the graph is rewritten, set beside what a traced training step measured
(per device: the ops' busy time, and the variables it holds plus the most
bytes the step's allocations kept alive; of the last ``BEST_OF`` steps up to
the N-th, the shortest time and the largest memory). The table is printed, kept in the
plan (``Plan.measured``), warned about when off by more than
``measure.tolerance``, and with ``measure.calibrate`` fitted into a device
entry the next plan can use (``cluster.hardware``)."""
import collections
import dataclasses
import json
import logging
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from tfpar.analysis.op_kinds import is_variable
from tfpar.analysis.variables import variable_bytes
from tfpar.cluster.devices import short_name
from tfpar.cluster.hardware import device_kind
from tfpar.compat.tf import ops
from tfpar.ir import measured as compare
from tfpar.ir.plan import Plan
from tfpar.planner.plan_costs import device_memory, per_task_graph
from tfpar.runtime.context import Runtime, active
from tfpar.runtime.graph_state import existing_state
from tfpar.runtime.prediction import Predicted
from tfpar.runtime.step_trace import step_allocations, step_spans

__all__ = ["BEST_OF", "after_step", "concluded", "fed_rows", "measure_due", "measures",
           "traced_steps"]

log = logging.getLogger("tfpar")
BEST_OF = 5  # steps traced; each TaskGraph's time is the shortest (least disturbed)


def measures(rt: Runtime) -> bool:
    """Whether training steps are measured (``measure.after_steps`` is not
    0): a graph's run by ``Session.run``, a tf.function step's calls
    (``measured_calls``)."""
    return bool(rt.config.get("measure.after_steps"))


def traced_steps(after_steps: int) -> range:
    """The training steps measured for ``measure.after_steps`` N: up to the
    last ``BEST_OF`` to N, not the first (it builds kernels and allocates)
    unless N is 1."""
    return range(max(min(2, after_steps), after_steps - BEST_OF + 1), after_steps + 1)


def measure_due(graph: Optional[ops.Graph]) -> bool:
    """Whether the next run of ``graph`` is a training step to measure."""
    rt = active()
    state = existing_state(graph) if graph is not None else None
    return (rt is not None and state is not None and state.predicted is not None
            and state.rewrite is not None and state.rewrite.stepped
            and state.training_steps + 1 in traced_steps(rt.config.get("measure.after_steps")))


def after_step(graph: ops.Graph, run_metadata, feed_dict=None) -> Optional[Dict[str, Any]]:
    """After a run of ``graph``: count its training steps, measure those
    ``measure_due`` traced, and after the last compare, say, keep and
    calibrate. Returns the comparison when it was made."""
    state = existing_state(graph)
    due = measure_due(graph)
    if state is None or state.rewrite is None or not state.rewrite.stepped:
        return None
    state.training_steps += 1
    if not due or run_metadata is None or not run_metadata.step_stats.dev_stats:
        return None
    if state.variables_held is None:  # the rewritten graph's variables stay where they are
        state.variables_held = _variables_held(graph, state.plan)
    state.samples.append(_measured(graph, state.plan, run_metadata, state.variables_held))
    if state.training_steps != active().config.get("measure.after_steps"):
        return None
    return concluded(state, fed_rows(feed_dict))


def concluded(state, rows: List[int], not_measured: str = "") -> Dict[str, Any]:
    """After the last step measured: compare (``rows``: the leading
    dimensions of the step's inputs; ``not_measured``: what could not be
    measured, and why), calibrate if asked, keep in ``state``'s plan and
    say. Returns the comparison."""
    cfg = active().config
    measured = _compared(state, rows, cfg.get("measure.tolerance"))
    if not_measured:
        measured["not_measured"] = not_measured
    if cfg.get("measure.calibrate") and measured["comparable"]:
        measured["calibrated"] = _calibrate(cfg.get("measure.calibrate"), state.predicted, measured)
    elif cfg.get("measure.calibrate"):
        measured["not_calibrated"] = (f"the {measured['hardware']} entry is not fitted to "
                                      f"timings of {measured['ran_on']} devices")
    state.plan = dataclasses.replace(state.plan, measured=measured)
    _say(measured)
    return measured


def _compared(state, rows: List[int], tolerance: float) -> Dict[str, Any]:
    """``Plan.measured``: each TaskGraph's prediction for the fed batch beside
    the shortest time and largest memory of the steps measured (None: memory
    not measured); the kind of device that ran (``ran_on``) and whether it
    is the kind predicted on (``comparable``: not when GPUs were described
    and CPUs ran; an entry of another name is taken to be what ran)."""
    batch, batch_from = _batch(rows, state.predicted.batch)
    steps = traced_steps(state.training_steps)
    predicted = per_task_graph(state.plan, state.predicted.costs, state.predicted.launch_s,
                               batch)
    on_device = device_memory(state.plan, predicted)
    rows = []
    for i, (tg, (time_s, _)) in enumerate(zip(state.plan.task_graphs, predicted)):
        times, peaks = ([s[i][k] for s in state.samples] for k in (0, 1))
        measured = (None if None in times else min(times), None if None in peaks else max(peaks))
        memory = max(on_device[d] for d in tg.devices)
        rows.append(dict(compare.row(tg.name, [short_name(d) for d in tg.devices],
                                     (time_s, memory), measured, tolerance),
                         predicted_launch_s=state.predicted.launch_s[i] * state.plan.num_micro_batch))
    launches = sum(row["predicted_launch_s"] for row in rows)
    ran_on = active().device_type
    return {"step": state.training_steps, "steps": [steps[0], steps[-1]], "batch": batch,
            "batch_from": batch_from, "hardware": state.predicted.hardware.name,
            "tolerance": tolerance, "task_graphs": rows, "launch_s": launches,
            "ran_on": ran_on,
            "comparable": device_kind(state.predicted.hardware) in (None, ran_on)}


def _measured(graph: ops.Graph, plan: Plan, run_metadata, held: Dict[str, int]
              ) -> List[Tuple[float, int]]:
    """Per TaskGraph, on its busiest device in a traced step: the seconds its
    ops ran (overlaps once) and the bytes of the variables there plus the
    most the step's allocations kept alive."""
    spans = step_spans(run_metadata, graph)
    peaks = {short_name(d): compare.peak_bytes(r)
             for d, r in step_allocations(run_metadata).items()}
    said = []
    for tg in plan.task_graphs:
        devices = [short_name(d) for d in tg.devices]
        said.append((max(compare.busy_seconds(spans.get((tg.name, d), ())) for d in devices),
                     max(peaks.get(d, 0) + held.get(d, 0) for d in devices)))
    return said


def _variables_held(graph: ops.Graph, plan: Plan) -> Dict[str, int]:
    """Bytes of the variables (weights, optimizer slots) on each device
    (short name; unplaced: the plan's first device)."""
    first = short_name(plan.task_graphs[0].devices[0])
    held: Dict[str, int] = collections.Counter()
    for op in graph.get_operations():
        if is_variable(op):
            held[short_name(op.device) if op.device else first] += variable_bytes(op.outputs[0])
    return held


def fed_rows(feed_dict) -> List[int]:
    """The leading dimension of each array fed (sparse values and other
    non-arrays left out)."""
    return [np.shape(v)[0] for v in (feed_dict or {}).values()
            if (isinstance(v, np.ndarray) or type(v) in (list, tuple)) and np.ndim(v) >= 1]


def _batch(rows: List[int], assumed: int) -> Tuple[int, str]:
    """The global batch of the measured step: the leading dimension most of
    its inputs share, else what the plan assumed (static or 32)."""
    if rows:
        return collections.Counter(rows).most_common(1)[0][0], "fed"
    return assumed, "assumed"


def _calibrate(path: str, predicted: Predicted, measured: Dict[str, Any]) -> Dict[str, Any]:
    """Fit the device entry's efficiency to the measurement, write it to
    ``path`` and say what was fitted from what (the entry unchanged, and
    why, when the steps measured no longer than their kernel launches: a
    training run never fails for its calibration)."""
    hw, (first, last) = predicted.hardware, measured["steps"]
    entry = {"name": hw.name, "tflops": hw.tflops, "memory_gb": hw.memory_gb,
             "intra_node_gbps": hw.intra_node_gbps, "inter_node_gbps": hw.inter_node_gbps,
             "efficiency": hw.efficiency}
    how = (f"efficiency {hw.efficiency:g} x predicted / measured compute time of training "
           f"steps {first}-{last} (the shortest), summed over the TaskGraphs, kernel launches "
           "apart; memory is not fitted")
    try:
        fitted = compare.calibrated_entry(entry, measured)
    except ValueError as unfit:
        fitted = {**entry, "name": hw.name.split(" (")[0] + " (calibrated)"}
        how = f"nothing fitted, the entry kept: {unfit}"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(fitted, f, indent=2)
    return {"path": path, "entry": fitted, "from": how}


def _say(measured: Dict[str, Any]) -> None:
    """Print (on stderr) and log the table; warn (once: one step is measured)
    when off."""
    text = compare.table(measured)
    if "calibrated" in measured:
        said = measured["calibrated"]
        text += (f"\ntfpar: calibrated device entry written to {said['path']} "
                 f"(tflops {said['entry']['tflops']:g}, efficiency "
                 f"{said['entry']['efficiency']:g}: {said['from']}); plan with it: "
                 f"cluster.hardware \"{said['path']}\"")
    elif "not_calibrated" in measured:
        text += f"\ntfpar: measure.calibrate: nothing written: {measured['not_calibrated']}"
    log.info("%s", text)
    print(text, file=sys.stderr)  # stdout stays the script's (a --json output, say)
    off = compare.off_rows(measured)
    if off:
        log.warning("tfpar: the cost model is off by more than measure.tolerance (%.0f%%) for "
                    "%s; measure.calibrate fits the device entry to this machine",
                    measured["tolerance"] * 100, "; ".join(off))
