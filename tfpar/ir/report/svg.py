"""SVG pieces the plan report draws with: escaped text, boxes with hover
titles, and the colours of stages (no TensorFlow, no network)."""
import html
from typing import Optional

__all__ = ["colour", "esc", "rect", "svg", "text"]

# Hues far apart for neighbouring stages; lightness tells tensor groups apart.
_HUES = (210, 30, 120, 280, 0, 170, 60, 320, 250, 90)


def esc(value) -> str:
    """``value`` as text safe inside HTML or SVG."""
    return html.escape(str(value), quote=True)


def colour(stage: int, shade: int = 0) -> str:
    """The fill of ``stage``; odd ``shade``s a lighter tone of it."""
    hue = _HUES[stage % len(_HUES)] + 7 * (stage // len(_HUES))
    return f"hsl({hue % 360},{60 if shade % 2 == 0 else 45}%,{48 if shade % 2 == 0 else 66}%)"


def rect(x: float, y: float, w: float, h: float, fill: str, title: Optional[str] = None,
         stroke: str = "none") -> str:
    """A box; ``title`` is shown when the pointer rests on it."""
    hover = f"<title>{esc(title)}</title>" if title else ""
    return (f'<rect x="{x:.2f}" y="{y:.2f}" width="{max(w, 0.5):.2f}" height="{h:.2f}" '
            f'fill="{fill}" stroke="{stroke}">{hover}</rect>')


def text(x: float, y: float, value, size: int = 11, anchor: str = "start",
         fill: str = "#222") -> str:
    return (f'<text x="{x:.2f}" y="{y:.2f}" font-size="{size}" text-anchor="{anchor}" '
            f'fill="{fill}">{esc(value)}</text>')


def svg(width: float, height: float, body: str, label: str) -> str:
    """An inline SVG drawing of ``width`` x ``height`` pixels."""
    return (f'<svg role="img" aria-label="{esc(label)}" '
            f'width="{width:.0f}" height="{height:.0f}" viewBox="0 0 {width:.0f} {height:.0f}">'
            f"{body}</svg>")
