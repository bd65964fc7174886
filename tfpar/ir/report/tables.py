"""The report's layers, memory, candidates and notes: what the plan holds,
written for reading (repeated blocks folded into one row)."""
from typing import Any, Dict, List, Sequence

from tfpar.ir.compact import device_ranges, numbered, plain
from tfpar.ir.measured import table as measured_table
from tfpar.ir.report.grid import Stage
from tfpar.ir.report.svg import colour, esc, rect, svg, text

__all__ = ["candidates_table", "layers_table", "measured_section", "memory_section", "notes_list"]

_GB = 2 ** 30
_PARTS = (("weights", "hsl(210,60%,50%)"), ("gradients", "hsl(30,75%,55%)"),
          ("optimizer", "hsl(280,45%,55%)"), ("activations", "hsl(120,40%,48%)"))


def _table(header: Sequence[str], rows: List[Sequence[Any]]) -> str:
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>"
                   for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def layers_table(plan, stages: Sequence[Stage]) -> str:
    """Layers in model order with their stage, devices and sharding; names
    equal but for a block's number written once (``h{0..95}/mlp/c_fc``)."""
    stage_of = {tg.name: s for s in stages for tg in s.task_graphs}
    entries: List[str] = []
    where: Dict[str, str] = {}
    layers = plan.sharding.get("layers", {})
    placed = plan.sharding.get("stages", {})
    for scope, how in layers.items():
        entries.append(f"{scope}\t{how}\t{placed.get(scope, 0) if placed else 'all'}")
    if not layers:
        for tg in plan.task_graphs:
            units = list(tg.patterns.items()) or [("(whole TaskGraph)", tg.strategy)]
            entries += [f"{unit}\t{pattern}\t{stage_of[tg.name].index}" for unit, pattern in units]
    rows = []
    for entry in numbered(entries):
        scope, how, stage = entry.split("\t")
        if stage not in where:
            where[stage] = (device_ranges(stages[int(stage)].devices,
                                          [d for s in stages for d in s.devices])
                            if stage.isdigit()
                            else f"every stage's tensor groups of {plan.sharding['tensor_degree']}")
        rows.append((scope, how, stage, where[stage]))
    count = len(entries)
    return (f"<p>{count} layer(s) or sharding unit(s) in model order, {len(rows)} row(s) "
            "once repeated blocks are folded.</p>"
            + _table(("layer", "sharding", "stage", "devices"), rows))


def memory_section(plan, stages: Sequence[Stage]) -> str:
    """Per stage, bytes per device against the devices' capacity; the
    fullest device's weights, gradients, optimizer state and activations."""
    est = plan.estimate
    capacity = (est.get("assumptions") or {}).get("memory_gb")
    bars = []
    for s in stages:
        used = sum(tg.estimate.get("memory_bytes", 0) for tg in s.task_graphs)
        weights = sum(tg.param_bytes / (tg.device_count if tg.strategy == "split" else 1)
                      for tg in s.task_graphs)
        bars.append((f"stage {s.index}", used, weights))
    estimated = any(used for _, used, _ in bars)
    top = max([capacity * _GB if capacity else 0.0]
              + [max(used, weights) for _, used, weights in bars]) or 1.0
    body, width = [], 560
    for i, (name, used, weights) in enumerate(bars):
        value, what = (used, "estimated bytes per device") if estimated else (
            weights, "weights per device (the plan was not costed)")
        y = 8 + i * 20
        body.append(text(0, y + 12, name, 10))
        body.append(rect(70, y, (width - 80) * value / top, 14, colour(i),
                         f"{name}: {value / _GB:.3f} GB, {what}"))
    if capacity:
        x = 70 + (width - 80) * capacity * _GB / top
        body.append(rect(x, 0, 2, 16 + 20 * len(bars), "#c00",
                         f"capacity {capacity:g} GB per device"))
    drawing = svg(width, 16 + 20 * len(bars), "".join(body), "memory per device per stage")
    said = (f"capacity {capacity:g} GB per device (red line)" if capacity else
            "no device capacity known: cluster.hardware describes none")
    return f"<p>{said}.</p>{drawing}" + _fullest(est, capacity)


def _fullest(est: Dict[str, Any], capacity) -> str:
    """The fullest device's memory by kind, as a stacked bar."""
    parts = est.get("memory")
    if not parts:
        return ("<p class=\"aside\">Gradients, optimizer state and activations are estimated "
                "for the plans tfpar costs (every plan it makes for a graph).</p>")
    total = sum(parts.values())
    top = max(total, (capacity or 0) * _GB) or 1.0
    x, body = 0.0, []
    for name, fill in _PARTS:
        w = 540 * parts.get(name, 0) / top
        body.append(rect(x, 0, w, 18, fill, f"{name}: {parts.get(name, 0) / _GB:.2f} GB"))
        x += w
    legend = ", ".join(f'<span class="swatch" style="background:{fill}"></span>{name} '
                       f"{parts.get(name, 0) / _GB:.2f} GB" for name, fill in _PARTS)
    return (f"<p>Fullest device: {total / _GB:.2f} GB ({legend}).</p>"
            + svg(540, 18, "".join(body), "memory of the fullest device by kind"))


def candidates_table(plan) -> str:
    """The searched candidates with their estimates and why each lost."""
    est = plan.estimate
    rows = est.get("candidates")
    if not rows:
        return ("<p class=\"aside\">This plan records no search (only auto.auto_parallel "
                "plans do).</p>")
    search = est.get("search", {})
    table = [(f"{r['data']} x {r['tensor']} x {r['pipeline']}",
              _schedule(r) if "schedule" in r else "-", r.get("micro_batches", "-"),
              r.get("techniques", "-"),
              f"{plain(r['step_time_s'] * 1e3)} ms" if "step_time_s" in r else "-",
              f"{r['memory_bytes'] / _GB:.2f} GB" if "memory_bytes" in r else "-", r["why"])
             for r in rows]
    said = (f"{search.get('planned', '?')} of {search.get('meshes', '?')} meshes planned in "
            f"{search.get('seconds', 0):.1f} s. " if search else "")
    return (f"<p>{said}Mesh is data x tensor x pipeline.</p>"
            + _table(("mesh", "schedule", "micro-batches", "memory techniques",
                      "est. step", "est. memory/device", "outcome"), table))


def _schedule(row: Dict[str, Any]) -> str:
    if row.get("virtual_stages", 1) > 1:
        return f"1f1b, {row['virtual_stages']} virtual stages"
    return f"kfkb k={row['group_size']}" if row["schedule"] == "kfkb" else row["schedule"]


def notes_list(plan) -> str:
    """The plan's notes: where tfpar runs other than what was asked."""
    if not plan.notes:
        return "<p>None: tfpar runs what the script and config asked.</p>"
    return "<ul>" + "".join(f"<li>{esc(note)}</li>" for note in plan.notes) + "</ul>"


def measured_section(plan) -> str:
    """The cost model against a traced step (``Plan.measured``), once measured."""
    if not plan.measured:
        return ("<p>Not measured yet: after training step <code>measure.after_steps</code> "
                "(3 by default) tfpar sets each TaskGraph's predicted compute time and peak "
                "memory beside the traced step's.</p>")
    said = plan.measured.get("calibrated")
    fitted = (f"<p>Calibrated device entry written to <code>{esc(said['path'])}</code>: "
              f"{esc(said['from'])}.</p>" if said else "")
    return f"<pre>{esc(measured_table(plan.measured))}</pre>{fitted}"
