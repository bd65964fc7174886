"""Predicted against measured, per TaskGraph (no TensorFlow): the busy time
and peak memory a traced step measured, set beside the cost model's, as the
rows ``Plan.measured`` keeps, the table tfpar prints, and the device entry a
calibration fits."""
import itertools
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

__all__ = ["busy_seconds", "calibrated_entry", "human_bytes", "off_rows", "peak_bytes", "ratio", "row",
           "table", "within"]


def busy_seconds(spans: Iterable[Tuple[int, int]]) -> float:
    """Seconds covered by ``spans`` (start, end) in microseconds, overlaps
    counted once: how long a device was running any of them."""
    busy, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            busy += end - start
            reach = end
        elif end > reach:
            busy += end - reach
            reach = end
    return busy / 1e6


def peak_bytes(records: Iterable[Tuple[int, int]]) -> int:
    """The most bytes alive at once from allocation records (microsecond,
    bytes; a release is negative), releases first at equal times."""
    live = itertools.accumulate(size for _, size in sorted(records))
    return max(live, default=0)


def ratio(measured: float, predicted: float) -> Optional[float]:
    """measured / predicted (None when nothing was predicted)."""
    return measured / predicted if predicted > 0 else None


def within(value: Optional[float], tolerance: float) -> bool:
    """Whether a measured / predicted ratio is within ``tolerance``: between
    1 / (1 + tolerance) and 1 + tolerance (0.5: from 0.67x to 1.5x)."""
    return value is not None and 1 / (1 + tolerance) <= value <= 1 + tolerance


def row(name: str, devices: Sequence[str], predicted: Tuple[float, float],
        measured: Tuple[Optional[float], Optional[float]], tolerance: float) -> Dict[str, Any]:
    """One TaskGraph's row: ``predicted`` and ``measured`` are (seconds of
    compute a step, peak bytes) on its busiest device; a value not measured
    is None, and so are its ratio and whether it is within."""
    said = {"name": name, "devices": list(devices)}
    for what, (guess, got) in zip(("time", "memory"), zip(predicted, measured)):
        value = ratio(got, guess) if got is not None else None
        said.update({f"{what}_ratio": value,
                     f"{what}_within": within(value, tolerance) if got is not None else None})
    said.update(predicted_time_s=predicted[0], measured_time_s=measured[0],
                predicted_memory_bytes=int(predicted[1]),
                measured_memory_bytes=None if measured[1] is None else int(measured[1]))
    return said


def off_rows(measured: Dict[str, Any]) -> List[str]:
    """'name: time 3.1x' per TaskGraph off by more than the tolerance (none
    when the device predicted on is not the kind that ran: ``comparable``)."""
    said = []
    if measured.get("comparable") is False:
        return said
    for r in measured.get("task_graphs", []):
        parts = [f"{what} {_times(r[f'{what}_ratio'])}" for what in ("time", "memory")
                 if r[f"{what}_within"] is False]
        if parts:
            said.append(f"{r['name']}: " + ", ".join(parts))
    return said


def table(measured: Dict[str, Any]) -> str:
    """``Plan.measured`` as the table tfpar prints."""
    steps = measured.get("steps") or [measured["step"]] * 2
    which = f"step {steps[0]}" if steps[0] == steps[1] else f"steps {steps[0]}-{steps[1]}, the shortest"
    lines = [f"tfpar: predicted vs measured, training {which} (batch "
             f"{measured['batch']}, {measured['batch_from']}; predicted on "
             f"{measured['hardware']}; tolerance {measured['tolerance']:.0%})"]
    rows = [("TaskGraph", "devices", "time pred.", "measured", "ratio", "memory pred.",
             "measured", "ratio", "")]
    comparable = measured.get("comparable") is not False
    for r in measured["task_graphs"]:
        ok = r["time_within"] is not False and r["memory_within"] is not False
        verdict = ("within" if ok else "OFF") if comparable else "not comparable"
        rows.append((r["name"], _devices(r["devices"]), _ms(r["predicted_time_s"]),
                     _unmeasured(r["measured_time_s"], _ms), _times(r["time_ratio"]),
                     human_bytes(r["predicted_memory_bytes"]),
                     _unmeasured(r["measured_memory_bytes"], human_bytes),
                     _times(r["memory_ratio"]), verdict))
    widths = [max([least] + [len(r[i]) for r in rows]) for i, least in enumerate(_WIDTHS)]
    for i, cells in enumerate(rows):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths).rstrip())
    if not comparable:
        lines.append(f"not comparable: predicted for {measured['hardware']} devices, measured on "
                     f"{measured['ran_on']} devices: the ratios do not check the cost model")
    if measured.get("not_measured"):
        lines.append(f"not measured: {measured['not_measured']}")
    return "\n".join(lines)


def calibrated_entry(entry: Dict[str, Any], measured: Dict[str, Any]) -> Dict[str, Any]:
    """``entry`` (a ``cluster.hardware`` dict) with the efficiency that makes
    the predicted compute time of the step equal what was measured (summed
    over TaskGraphs), kernel launches (``launch_s``, the planner's fixed
    cost per kernel) apart; above 1, the peak rises instead (efficiency
    stays 1)."""
    if any(r["measured_time_s"] is None for r in measured["task_graphs"]):
        raise ValueError("the step's compute time was not measured")
    launches = measured.get("launch_s", 0.0)
    predicted = sum(r["predicted_time_s"] for r in measured["task_graphs"]) - launches
    spent = sum(r["measured_time_s"] for r in measured["task_graphs"]) - launches
    if predicted <= 0 or spent <= 0:
        raise ValueError("nothing but kernel launches was both predicted and measured to fit")
    fitted = entry.get("efficiency", 1.0) * predicted / spent
    tflops = entry["tflops"] * max(fitted, 1.0)
    return {**entry, "name": entry["name"].split(" (")[0] + " (calibrated)",
            "tflops": float(f"{tflops:.6g}"), "efficiency": float(f"{min(fitted, 1.0):.6g}")}


# Columns at least this wide: tables of usual values line up alike run after run.
_WIDTHS = (0, 0, 10, 10, 8, 12, 10, 8, 6)


def _devices(devices: Sequence[str]) -> str:
    short = [d.split("device:")[-1] for d in devices]
    return ",".join(short) if len(short) <= 3 else f"{short[0]}..{short[-1]} ({len(short)})"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _unmeasured(value, said) -> str:
    """``said(value)``, or 'n/a' for a value not measured."""
    return "n/a" if value is None else said(value)


def _times(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def human_bytes(n: float) -> str:
    """``n`` bytes as '512 B', '1.5 KiB', ... up to GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024.0
    return f"{n:.1f} GiB"
