"""The report's pipeline schedule: the simulator's Gantt chart of one step
and, when the plan has run, the traced step's beside it, each with its
bubble share."""
from typing import Optional, Sequence, Tuple

from tfpar.ir.compact import plain
from tfpar.ir.report.grid import Stage
from tfpar.ir.report.svg import esc, rect, svg, text
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import SimulationResult, simulate

__all__ = ["planned_step", "schedule_section"]

_KIND = {"F": ("forward", "hsl(210,60%,55%)"), "B": ("backward", "hsl(20,70%,55%)"),
         "W": ("weight gradients", "hsl(120,40%,50%)")}
_WIDTH, _ROW, _LEFT = 520, 22, 70


def planned_step(plan, stages: Sequence[Stage]) -> Tuple[SimulationResult, str]:
    """The simulated step of the plan's schedule over its stages, and its
    time unit: seconds from the stages' estimated busy time per step (a
    third forward, two thirds backward, per micro-batch), else op counts."""
    micro = plan.num_micro_batch
    seconds = [sum(tg.estimate.get("time_s", 0) for tg in s.task_graphs) for s in stages]
    if all(seconds):
        unit, busy = "ms", [1e3 * t / micro for t in seconds]
    else:
        unit, busy = "ops", [float(max(sum(tg.num_ops for tg in s.task_graphs), 1))
                             for s in stages]
    group = plan.group_size if isinstance(plan.group_size, int) else 1
    schedule, groups = (plan.task_schedule() if len(stages) == len(plan.task_graphs)
                        else (build_schedule(plan.schedule, len(stages), micro, group), None))
    return simulate(schedule, [b / 3 for b in busy], [2 * b / 3 for b in busy],
                    device_groups=groups), unit


def _chart(result: SimulationResult, unit: str, label: str) -> str:
    """One Gantt chart: a row per stage, a bar per task (hover: what and when)."""
    rows = len(result.peak_in_flight)
    scale = (_WIDTH - _LEFT - 10) / (result.length or 1.0)
    body = [text(4, 30 + s * _ROW + 11, f"stage {s}", 10) for s in range(rows)]
    for t in result.tasks:
        what, fill = _KIND[t.task.kind]
        x = _LEFT + t.start * scale
        body.append(rect(x, 30 + t.stage * _ROW, (t.end - t.start) * scale, _ROW - 4, fill,
                         f"stage {t.stage}: {what} of micro-batch {t.task.micro_batch}, "
                         f"{plain(t.start)}-{plain(t.end)} {unit}", stroke="#fff"))
        if (t.end - t.start) * scale > 14:
            body.append(text(x + 2, 30 + t.stage * _ROW + 12, f"{t.task}", 9, fill="#fff"))
    body.append(text(4, 16, f"{label}: {plain(result.length)} {unit}, bubble "
                            f"{result.bubble_fraction:.1%}", 12))
    return svg(_WIDTH, 40 + rows * _ROW, "".join(body), label)


def schedule_section(plan, stages: Sequence[Stage],
                     traced: Optional[SimulationResult] = None) -> str:
    """The simulated chart and, with ``traced``, the traced step's (microseconds)."""
    result, unit = planned_step(plan, stages)
    legend = " ".join(f'<span class="swatch" style="background:{fill}"></span>{esc(what)}'
                      for what, fill in _KIND.values())
    charts = _chart(result, unit, f"simulated {plan.schedule}")
    if traced is not None:
        charts += _chart(traced, "us", "traced step")
    else:
        charts += ("<p class=\"aside\">No traced step yet: the report written after the "
                   "first step (config key <code>report</code>) shows it here.</p>")
    return (f"<p>{len(stages)} stage(s) x {plan.num_micro_batch} micro-batch(es), schedule "
            f"{esc(plan.schedule)}; the bubble share is the idle part of stages x step time "
            f"({'estimated seconds' if unit == 'ms' else 'op counts as time: no estimate'}). "
            f"{legend}</p><div class=\"side\">{charts}</div>")
