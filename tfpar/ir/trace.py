"""Chrome-trace (about://tracing, Perfetto) view of a simulated schedule; no TensorFlow."""
import json
from typing import Dict, Optional, Sequence

from tfpar.ir.simulate import SimulationResult

__all__ = ["chrome_trace", "write_chrome_trace"]

PROCESS_NAME = "tfpar pipeline schedule"
_PID = 0
_CATEGORIES = {"F": "forward", "B": "backward", "W": "weight gradients"}


def chrome_trace(result: SimulationResult, stage_names: Optional[Sequence[str]] = None,
                 time_unit_us: float = 1.0) -> Dict:
    """Chrome-trace JSON object of a simulated schedule.

    One row (tid) per stage, named by ``stage_names`` (default "stage s"), with a
    complete ("X") event per task named like "F3"/"B3"/"W3"; one row per transfer
    direction ("transfer s->d"); "M" events name the process and every row.
    ``ts``/``dur`` are in microseconds: simulated time * ``time_unit_us``.
    """
    num_stages = len(result.peak_in_flight)
    if stage_names is None:
        stage_names = [f"stage {s}" for s in range(num_stages)]
    if len(stage_names) != num_stages:
        raise ValueError(f"stage_names has {len(stage_names)} names for {num_stages} stages")
    links = sorted({(t.src_stage, t.dst_stage) for t in result.transfers})
    link_tid = {link: num_stages + i for i, link in enumerate(links)}

    events = [_metadata("process_name", 0, PROCESS_NAME)]
    events += [_metadata("thread_name", s, name) for s, name in enumerate(stage_names)]
    events += [_metadata("thread_name", tid, f"transfer {src}->{dst}")
               for (src, dst), tid in link_tid.items()]
    events += [_complete(str(t.task), _CATEGORIES[t.task.kind], t.stage,
                         t.start, t.end, time_unit_us,
                         {"stage": t.stage, "micro_batch": t.task.micro_batch, "kind": t.task.kind})
               for t in result.tasks]
    events += [_complete(f"{t.kind}{t.micro_batch} {t.src_stage}->{t.dst_stage}", "transfer",
                         link_tid[(t.src_stage, t.dst_stage)], t.start, t.end, time_unit_us,
                         {"src_stage": t.src_stage, "dst_stage": t.dst_stage,
                          "micro_batch": t.micro_batch, "kind": t.kind})
               for t in result.transfers]
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(trace: Dict, path: str) -> str:
    """Write ``trace`` as JSON to ``path``; return ``path``."""
    with open(path, "w") as f:
        json.dump(trace, f)
    return path


def _metadata(name: str, tid: int, value: str) -> Dict:
    return {"name": name, "ph": "M", "pid": _PID, "tid": tid, "args": {"name": value}}


def _complete(name: str, category: str, tid: int, start: float, end: float, unit: float,
              args: Dict) -> Dict:
    return {"name": name, "cat": category, "ph": "X", "pid": _PID, "tid": tid,
            "ts": start * unit, "dur": (end - start) * unit, "args": args}
