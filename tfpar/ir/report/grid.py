"""The report's device grid: a box per node, a cell per device coloured by
its stage (TaskGraphs on the same devices), shaded by its tensor group, each
with a hover title; node boxes name their device range, so thousands of
devices stay readable."""
import re
from typing import Dict, List, Sequence, Tuple

from tfpar.ir.compact import device_ranges, numbered
from tfpar.ir.report.svg import colour, esc, rect, svg, text

__all__ = ["Stage", "device_grid", "stages_of"]

_CELL, _GAP, _ROW_NODES, _WIDTH = 12, 2, 16, 1100


class Stage:
    """TaskGraphs that run on the same devices, in plan order: one pipeline
    stage (or all of a plan without one)."""

    def __init__(self, index: int, task_graphs: List) -> None:
        self.index = index
        self.task_graphs = task_graphs
        self.devices = task_graphs[0].devices

    @property
    def name(self) -> str:
        return ", ".join(numbered([tg.name for tg in self.task_graphs]))


def stages_of(plan) -> List[Stage]:
    """Consecutive TaskGraphs with the same devices, as stages."""
    stages: List[Stage] = []
    for tg in plan.task_graphs:
        if stages and set(stages[-1].devices) == set(tg.devices):
            stages[-1].task_graphs.append(tg)
        else:
            stages.append(Stage(len(stages), [tg]))
    return stages


def _nodes(devices: Sequence[str], per_node) -> List[Tuple[str, List[str]]]:
    """(node name, its devices): by the task in the device name, or, for one
    process's devices of a described cluster, ``per_node`` at a time."""
    tasks: Dict[str, List[str]] = {}
    for device in devices:
        match = re.search(r"/job:([^/]+)/replica:\d+/task:(\d+)", device)
        key = f"{match.group(1)} {match.group(2)}" if match else "host"
        tasks.setdefault(key, []).append(device)
    if len(tasks) > 1 or not per_node:
        return list(tasks.items())
    return [(f"node {i // per_node}", list(devices[i:i + per_node]))
            for i in range(0, len(devices), per_node)]


def _roles(stages: Sequence[Stage]) -> Dict[str, Tuple[int, int, str]]:
    """Device -> (stage, tensor group, its hover title)."""
    roles = {}
    for stage in stages:
        for tg in stage.task_graphs:
            for replica, group in enumerate(tg.replicas):
                for rank, device in enumerate(group):
                    if device in roles:
                        continue
                    role = (f"shard {rank + 1} of {len(group)} of tensor group {replica}"
                            if tg.strategy == "split" else f"replica {replica}")
                    roles[device] = (stage.index, replica,
                                     f"{device_ranges([device])}: stage {stage.index} "
                                     f"({stage.name}), {role}")
    return roles


def device_grid(plan, stages: Sequence[Stage]) -> str:
    """The grid (SVG) and its legend (HTML)."""
    devices = list(dict.fromkeys(d for tg in plan.task_graphs for d in tg.devices))
    per_node = (plan.estimate.get("assumptions") or {}).get("devices_per_node")
    nodes = _nodes(devices, per_node)
    roles = _roles(stages)
    widest = max(len(members) for _, members in nodes)
    columns = min(widest, 8)
    node_w = columns * (_CELL + _GAP) + 6
    node_h = -(-widest // columns) * (_CELL + _GAP) + 18
    per_row = max(1, min(_ROW_NODES, _WIDTH // (node_w + 6)))
    body = []
    for n, (name, members) in enumerate(nodes):
        x0, y0 = (n % per_row) * (node_w + 6), (n // per_row) * (node_h + 6)
        body.append(rect(x0, y0, node_w, node_h, "#f4f4f4",
                         f"{name}: {device_ranges(members)}", stroke="#999"))
        body.append(text(x0 + 3, y0 + 11, name, size=9, fill="#555"))
        for i, device in enumerate(members):
            stage, group, title = roles.get(device, (None, 0, f"{device}: unused"))
            body.append(rect(x0 + 3 + (i % columns) * (_CELL + _GAP),
                             y0 + 15 + (i // columns) * (_CELL + _GAP), _CELL, _CELL,
                             "#ccc" if stage is None else colour(stage, group), title))
    rows = -(-len(nodes) // per_row)
    drawing = svg(per_row * (node_w + 6), rows * (node_h + 6), "".join(body),
                  f"{len(devices)} devices on {len(nodes)} nodes")
    legend = "".join(
        f'<li><span class="swatch" style="background:{colour(s.index)}"></span>'
        f'<span class="swatch" style="background:{colour(s.index, 1)}"></span> '
        f"stage {s.index}: {esc(s.name)} on {esc(device_ranges(s.devices, devices))} "
        f"({len(s.devices)} devices)</li>" for s in stages)
    return (f"<p>{len(devices)} devices on {len(nodes)} node(s); a cell's colour is its stage, "
            "its shade its tensor group (or replica): rest the pointer on a cell or node "
            f"for its name.</p>{drawing}<ul class=\"legend\">{legend}</ul>")
