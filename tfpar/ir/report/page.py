"""The report page: its sections in order, its style, written to one file."""
from typing import Optional

from tfpar.ir.compact import device_ranges, plain
from tfpar.ir.report.gantt import schedule_section
from tfpar.ir.report.grid import device_grid, stages_of
from tfpar.ir.report.svg import esc
from tfpar.ir.report.tables import (candidates_table, layers_table, measured_section,
                                   memory_section, notes_list)
from tfpar.ir.simulate import SimulationResult

__all__ = ["render_report", "write_report"]

_STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;max-width:1200px}
h1{font-size:20px}h2{font-size:16px;margin-top:28px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:2px 6px;
text-align:left;vertical-align:top}th{background:#f0f0f0}
.swatch{display:inline-block;width:10px;height:10px;margin:0 3px;vertical-align:middle}
.legend{columns:2;font-size:12px}.aside{color:#666}.side{display:flex;gap:16px;flex-wrap:wrap}
svg text{font-family:system-ui,sans-serif}
"""


def _headline(plan) -> str:
    """The plan in one line, with its estimate when costed."""
    devices = list(dict.fromkeys(d for tg in plan.task_graphs for d in tg.devices))
    est = plan.estimate
    step = est.get("step_time_s")
    said = est.get("assumptions") or {}
    costed = (f"; estimated step {plain(step * 1e3)} ms on {said.get('devices', len(devices))} x "
              f"{said.get('device', 'devices')}" if step is not None else "; not costed")
    return (f"{len(plan.task_graphs)} TaskGraph(s) on {len(devices)} devices "
            f"({esc(device_ranges(devices)) if len(devices) <= 64 else 'see the grid'}), "
            f"data-parallel degree {plan.data_parallel_degree}, {plan.num_micro_batch} "
            f"micro-batch(es), schedule {esc(plan.schedule)}{esc(costed)}")


def render_report(plan, traced: Optional[SimulationResult] = None) -> str:
    """The report of ``plan`` (an ``ir.Plan``) as HTML text; ``traced``: the
    step ``tfpar.step_timeline`` read from a traced run, drawn beside the
    simulated one."""
    stages = stages_of(plan)
    sections = (("Devices", device_grid(plan, stages)),
                ("Layers and their sharding", layers_table(plan, stages)),
                ("Pipeline schedule", schedule_section(plan, stages, traced)),
                ("Memory per device", memory_section(plan, stages)),
                ("Searched candidates", candidates_table(plan)),
                ("Predicted vs measured", measured_section(plan)),
                ("Notes", notes_list(plan)))
    body = "".join(f'<section><h2>{title}</h2>{html}</section>' for title, html in sections)
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<title>tfpar plan report</title>"
            f"<style>{_STYLE}</style></head><body><h1>tfpar plan report</h1>"
            f"<p>{_headline(plan)}</p>{body}</body></html>")


def write_report(plan, path: str, traced: Optional[SimulationResult] = None) -> str:
    """Write :func:`render_report` to ``path``; return ``path``."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(render_report(plan, traced))
    return path
