"""The human-readable table of a plan (``Plan.summary``, ``print(plan)``):
its TaskGraphs, alike ones written once, sharded layers, shares, estimate,
what it assumes and how it was found, its devices, measurements and notes."""
import re
from typing import Any, Dict, List, Sequence, Tuple

from tfpar.ir.compact import device_ranges, numbered, task_of
from tfpar.ir.measured import human_bytes as _human_bytes, table as _measured_table
from tfpar.ir.outcome import Outcome

__all__ = ["summary"]


def summary(plan) -> str:
    """A human-readable table of ``plan`` (an ``ir.plan.Plan``)."""
    lines = [
        f"tfpar plan: data_parallel_degree={plan.data_parallel_degree} "
        f"num_micro_batch={plan.num_micro_batch} schedule={plan.schedule}"
        + (f" virtual_stages={plan.virtual_stages} (interleaved)"
           if plan.virtual_stages > 1 else ""),
    ]
    estimated = any(tg.estimate for tg in plan.task_graphs)
    header = ("TaskGraph", "strategy", "devices", "ops", "params", "placement") + (
        ("est. time", "memory/dev", "comm") if estimated else ())
    rows = [header]
    groups = _alike(plan.task_graphs, estimated)
    every = [d for tg in plan.task_graphs for d in tg.devices]
    for name, group in groups:
        columns = _columns(group[0], estimated)
        placement = device_ranges([d for tg in group for d in tg.devices], every)
        rows.append((name,) + columns[:4] + (placement,) + columns[4:])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    for i, row in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += _footnote(plan) if estimated else []
    # A TaskGraph's patterns folded (h{0..95}/mlp/c_fc), then alike lines of
    # TaskGraphs (split_{1,5}: layer_{0,1}/attention/q).
    lines += [f"  {line}" for line in numbered(
        [f"{name}: {line}" for name, group in groups for line in numbered(
            [f"{unit} -> {pattern}" for tg in group for unit, pattern in tg.patterns.items()])])]
    if plan.sharding:
        sequence = ", sequence parallel" if plan.sharding.get("sequence_parallel") else ""
        lines += _wrapped(f"sharded layers (tensor degree {plan.sharding['tensor_degree']}"
                          f"{sequence}):", numbered([f"{scope} -> {how}" for scope, how
                                                     in plan.sharding["layers"].items()]))
    for tg in plan.task_graphs:
        if tg.shard_shares:
            lines.append(f"{tg.name} shards per device (hardware-aware, Whale §3.3.1): "
                         + _percentages(tg.shard_shares))
    if plan.batch_shares:
        lines.append("batch rows per replica (hardware-aware, Whale §3.3.1): "
                     + _percentages(plan.batch_shares))
    est = plan.estimate
    if est:
        step = est.get("step_time_s")
        mem = est.get("memory_bytes_per_device") or [0]
        lines.append(
            "estimate: step_time=" + ("none" if step is None else f"{step * 1e3:.2f} ms")
            + f"  peak memory/device={_human_bytes(max(mem))}"
            + f"  comm/step={_human_bytes(est.get('comm_bytes', 0))}"
            + ("  needs: " + ", ".join(est["memory_techniques"])
               if est.get("memory_techniques") else ""))
        if step is None:
            lines.append("  (not costed: tfpar costs the plans it makes for a graph)")
        lines += _stated(est, plan.measured or {})
    lines += _logical_devices(plan)
    lines += [_measured_table(plan.measured)] if plan.measured else []
    lines += [f"note: {note}" for note in plan.notes]
    return "\n".join(lines)


def _columns(tg, estimated: bool) -> Tuple[str, ...]:
    """A TaskGraph's summary columns but its name and placement."""
    est = tg.estimate
    return (tg.strategy, str(len(tg.devices)), str(tg.num_ops), _human_bytes(tg.param_bytes)) + ((
        f"{est.get('time_s', 0) * 1e3:.3f} ms", _human_bytes(est.get("memory_bytes", 0)),
        _human_bytes(est.get("comm_bytes", 0))) if estimated else ())


def _footnote(plan) -> List[str]:
    """What the columns of several TaskGraphs' estimates count, where the
    estimate line counts otherwise: a TaskGraph's busy time (the step waits
    besides), its part of its devices' memory (theirs is the sum), its
    traffic but the activations sent between stages."""
    if len(plan.task_graphs) < 2:
        return []
    return ["(est. time: a TaskGraph's busy time a step, every micro-batch; "
            "the step adds bubble and waits)",
            "(memory/dev: on each of its devices, TaskGraphs on the same ones add up; "
            "comm: without transfers)"]


def _alike(task_graphs: Sequence[Any], estimated: bool
           ) -> List[Tuple[str, List[Any]]]:
    """Runs of consecutive TaskGraphs with equal columns whose names differ
    in one number (a pipeline's middle stages), each as (its name written
    once, ``stage_{2..61}``, its TaskGraphs); any other TaskGraph alone."""
    runs: List[List[Any]] = []
    for tg in task_graphs:
        if runs and _columns(runs[-1][-1], estimated) == _columns(tg, estimated):
            runs[-1].append(tg)
        else:
            runs.append([tg])
    groups = []
    for run in runs:
        names = numbered([tg.name for tg in run])
        groups += [(names[0], run)] if len(names) == 1 else [(tg.name, [tg]) for tg in run]
    return groups


def _logical_devices(plan) -> List[str]:
    """The line saying the plan's devices are logical CPU devices, and for a
    described cluster (``cluster.hardware``) what they stand in for."""
    logical = sorted({d for tg in plan.task_graphs for d in tg.devices
                      if re.search(r"/device:CPU:[1-9]", d)},
                     key=lambda d: (d.rsplit(":", 1)[0], int(d.rsplit(":", 1)[1])))
    if not logical:  # one process has one CPU device; the others are TensorFlow's logical ones
        return []
    described = ((plan.estimate or {}).get("assumptions") or {}).get("device")
    what = (f"standing in for the {described} devices described"
            if described is not None and not described.startswith("host-CPU")
            else "sharing its cores (no GPU is visible)")
    hosts = len({task_of(d) for d in logical})
    where = "one host" if hosts == 1 else f"each of {hosts} hosts"
    return [f"devices: logical CPU devices of {where}, {what}, e.g. {device_ranges(logical)}"]


def _stated(est: Dict[str, Any], measured: Dict[str, Any]) -> List[str]:
    """Summary lines of what an estimate assumes (the batch a measured step
    was fed, when it was) and how its plan was found."""
    lines, said = [], est.get("assumptions")
    if said:
        batch = f"batch {said['global_batch']} ({said['batch_from']})"
        if measured.get("batch_from") == "fed":
            batch = f"batch {measured['batch']} (fed" + (
                ")" if measured["batch"] == said["global_batch"] else
                f"; the estimate assumed {said['global_batch']}: {said['batch_from']})")
        node = f", {said['devices_per_node']} a node" if said.get("devices_per_node") else ""
        dtype, peak = said["compute_dtype"], said["peak_dtype"]
        why = {"tf32": " (float32 matmuls as TF32, TensorFlow's default on Ampere and later)",
               "fp16": " (mixed precision)"}.get(dtype, "") if dtype == peak else (
            f" ({said['device']} runs {dtype} at its {peak} peak)")
        lines.append(f"assumes: {said['devices']} x {said['device']}{node}; {dtype} at "
                     f"{said['peak_tflops']:g} TFLOP/s peak x efficiency "
                     f"{said['efficiency']:g}{why}; {batch}")
    if "flops_per_step" in est:
        again = est["recomputed_flops_per_step"]
        lines.append(f"FLOPs: {est['flops_per_step']:.3g} a step (model FLOPs: 3 x forward), "
                     f"{est['model_tflops_per_device']:.3g} TFLOP/s per device" + (
                         f"; {est['hardware_tflops_per_device']:.3g} with the {again:.3g} "
                         "recomputation adds (hardware FLOPs)" if again else ""))
    found = []
    if "search" in est:
        search = est["search"]
        skipped = len(search["not_searched"])
        found.append(f"{search['planned']} of {search['meshes']} meshes planned in "
                     f"{search['seconds']:.1f} s (limit {search['time_limit_s']:g} s"
                     + (f", {skipped} not searched" if skipped else "") + ")")
    for key, what in (("stage_search", "stages"), ("sharding_search", "sharding")):
        if key in est:
            found.append(f"{what} {Outcome.from_dict(est[key]).describe()}")
    return lines + (["search: " + "; ".join(found)] if found else [])


def _wrapped(head: str, items: Sequence[str], width: int = 100) -> List[str]:
    """``head`` and ``items`` separated by commas, in lines of about
    ``width`` characters broken between items, the later ones indented."""
    lines, line = [], head
    for k, item in enumerate(items):
        piece = item + ("," if k + 1 < len(items) else "")
        if len(line) + 1 + len(piece) > width and line.strip() != head:
            lines.append(line)
            line = "   "
        line += " " + piece
    return lines + [line]


def _percentages(shares: Sequence[int]) -> str:
    return " ".join(f"{share / sum(shares):.1%}" for share in shares)
