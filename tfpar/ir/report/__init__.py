"""The plan report: one self-contained HTML page (inline SVG and CSS, no
script, nothing fetched) drawing a plan's devices, layers, schedule, memory,
searched candidates and notes (no TensorFlow)."""
from tfpar.ir.report.page import render_report, write_report

__all__ = ["render_report", "write_report"]
