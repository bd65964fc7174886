"""The cost model of a plan the search did not make (from scopes, from config,
or ``auto.num_task_graph``'s stages), the same model the search and the
measured-vs-predicted table use: per TaskGraph, compute seconds and peak
bytes per device from the planner's stage costs of the ops it holds
(``stage_costs``); the step, the plan's own schedule simulated with those
times (``Plan.simulate``: 1F1B, kFkB, zero bubble, interleaved stages) plus
the slowest TaskGraph's gradient all-reduce. No TensorFlow."""
import collections
from typing import Any, Dict, List, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.ir.plan import Plan
from tfpar.planner.comm import LATENCY_S, allreduce
from tfpar.planner.interleaved import group_peaks
from tfpar.planner.memory import state_parts
from tfpar.planner.stage_costs import StageCosts
from tfpar.planner.step_model import in_flight

__all__ = ["device_memory", "per_task_graph", "plan_estimate"]


def per_task_graph(plan: Plan, costs: StageCosts, launch_s: Sequence[float],
                   batch: int) -> List[Tuple[float, float]]:
    """Per TaskGraph, for a step of ``batch`` rows: its compute seconds per
    device (forward and backward of its replica's rows, divided among a split
    TaskGraph's devices, plus ``launch_s`` kernel launches per micro-batch)
    and its peak bytes per device (weights, gradients and optimizer slots,
    plus the activations of the micro-batches its schedule keeps alive),
    from ``costs`` of one row."""
    said = []
    for s, (tg, kept) in enumerate(zip(plan.task_graphs, _activations(plan, costs, batch))):
        degree = _shards(tg)
        time_s = ((costs.forward_s[s] + costs.backward_s[s]) * batch / len(tg.replicas) / degree
                  + launch_s[s] * plan.num_micro_batch)
        said.append((time_s, (costs.fixed_bytes[s] + kept) / degree))
    return said


def _activations(plan: Plan, costs: StageCosts, batch: int) -> List[float]:
    """Per TaskGraph, the activation bytes of its replica's peak: a
    micro-batch's times the micro-batches its schedule keeps alive
    (``step_model.in_flight``). With interleaved stages, a device group's
    peak is found by walking its task order (``interleaved.group_peaks``, as
    the search counts it) and each of the group's stages is given the part of
    it its micro-batch's bytes are of the group's."""
    stages, micro = len(plan.task_graphs), plan.num_micro_batch
    one = [costs.activation_bytes[s] * batch / len(tg.replicas) / micro
           for s, tg in enumerate(plan.task_graphs)]
    if plan.virtual_stages > 1:
        groups = stages // plan.virtual_stages
        peaks = group_peaks(one, groups, micro)
        held = [sum(one[g::groups]) for g in range(groups)]
        return [peaks[s % groups] * k / held[s % groups] if held[s % groups] else 0.0
                for s, k in enumerate(one)]
    group = plan.group_size if isinstance(plan.group_size, int) else 1
    return [k * in_flight(plan.schedule, group, stages, s, micro) for s, k in enumerate(one)]


def plan_estimate(plan: Plan, costs: StageCosts, launch_s: Sequence[float], batch: int,
                  hardware: Hardware, assumptions: Dict[str, Any]
                  ) -> Tuple[Dict[str, Any], List[Dict[str, float]]]:
    """``plan``'s estimate (the keys a searched plan's has: step, memory per
    device in device-name order, what fills the fullest, traffic, what it
    assumes) and each TaskGraph's (``time_s``, ``memory_bytes``, and
    ``comm_bytes``: its gradients' all-reduce), for a step of ``batch`` rows
    on ``hardware``."""
    said = per_task_graph(plan, costs, launch_s, batch)
    on_device = device_memory(plan, said)
    comm = [allreduce(len(tg.replicas), tg.param_bytes, hardware.bandwidth(len(tg.replicas)))
            for tg in plan.task_graphs]
    fullest = _fullest_parts(plan, costs, said, max(on_device, key=on_device.get))
    estimate = {"step_time_s": _pipeline_s(plan, said, costs, batch, hardware)
                + max(c.seconds for c in comm),
                "memory_bytes_per_device": [on_device[d] for d in sorted(on_device)],
                "memory": fullest,
                "comm_bytes": sum(c.bytes for c in comm),
                "memory_techniques": [], "assumptions": assumptions}
    return estimate, [{"time_s": t, "memory_bytes": m, "comm_bytes": c.bytes}
                      for (t, m), c in zip(said, comm)]


def _pipeline_s(plan: Plan, said, costs: StageCosts, batch: int, hardware: Hardware) -> float:
    """One step of the plan's schedule: each TaskGraph's micro-batch a third
    forward and two thirds backward, activations crossing to the next stage
    (the mean cut) at the link between neighbouring devices."""
    micro, stages = plan.num_micro_batch, len(plan.task_graphs)
    per_micro = [t / micro for t, _ in said]
    rows = batch / plan.data_parallel_degree / micro
    transfer = (LATENCY_S + costs.cut_bytes * rows / (stages - 1) / hardware.link(stages)
                if stages > 1 else 0.0)
    return plan.simulate([t / 3 for t in per_micro], [2 * t / 3 for t in per_micro],
                         transfer).length


def device_memory(plan: Plan, said: Sequence[Tuple[float, float]]) -> Dict[str, float]:
    """Bytes per device of ``plan`` from ``per_task_graph``'s: TaskGraphs
    sharing a device add up; a split TaskGraph's by its shard shares."""
    on_device: Dict[str, float] = collections.Counter()
    for tg, (_, memory) in zip(plan.task_graphs, said):
        for device, part in _device_parts(tg):
            on_device[device] += memory * part
    return on_device


def _shards(tg) -> int:
    """The devices one copy of ``tg`` is spread over (a split TaskGraph's)."""
    return tg.device_count if tg.strategy == "split" else 1


def _device_parts(tg) -> List[Tuple[str, float]]:
    """(device, its part of what one device of ``tg`` holds on average): 1
    for a replica; a split TaskGraph's shard shares (Whale §3.3.1: the
    faster device takes the wider shard), even without them."""
    if tg.strategy != "split":
        return [(d, 1.0) for d in dict.fromkeys(tg.devices)]
    shares = tg.shard_shares or (1,) * tg.device_count
    return [(d, tg.device_count * share / sum(shares))
            for group in tg.replicas for d, share in zip(group, shares)]


def _fullest_parts(plan: Plan, costs: StageCosts, said, device: str) -> Dict[str, float]:
    """Bytes on ``device``: weights, gradients and optimizer slots
    (``memory.state_parts``) and activations, of every TaskGraph on it."""
    parts: Dict[str, float] = collections.Counter()
    for s, (tg, (_, memory)) in enumerate(zip(plan.task_graphs, said)):
        for on, part in _device_parts(tg):
            if on != device:
                continue
            state = costs.fixed_bytes[s] / _shards(tg) * part
            for name, size in state_parts(state, 1, 0, False, costs.optimizer_slots).items():
                parts[name] += size
            parts["activations"] += memory * part - state
    return dict(parts)
