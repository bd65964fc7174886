"""Compact text for plans of thousands of devices and layers: device ranges
(``GPU:0-7``), names that differ only in one number written once
(``h{0..95}/attn/c_attn``) and numbers without an exponent (``19170``)."""
import math
import re
from typing import Dict, List, Sequence, Tuple

__all__ = ["device_ranges", "numbered", "plain", "task_of"]

_NUMBER = re.compile(r"(?<![{,\d])\d+(?![,}\d])")  # not one a set already holds
_TASK = re.compile(r"/job:([^/]+)/(?:replica:\d+/)?task:(\d+)")


def device_ranges(devices: Sequence[str], among: Sequence[str] = ()) -> str:
    """``.../device:CPU:3`` as ``CPU:3``; three or more consecutive devices
    of one type as a range: ``CPU:0-3,GPU:0,GPU:1``. When ``devices`` (or
    ``among``, the devices the text must tell them apart from) are on more
    than one task, each is written with its job and task:
    ``worker0:CPU:0-3,worker1:CPU:0-3``."""
    tasks = {task_of(d) for d in (among or devices)}
    runs: List[Tuple[str, int, int]] = []  # (type, first, last); a name without a number: -1
    for device in devices:
        short = device.rsplit("device:", 1)[-1]
        if len(tasks) > 1:
            short = "".join(task_of(device)) + ":" + short
        kind, _, index = short.rpartition(":")
        if not index.isdigit():
            runs.append((short, -1, -1))
        elif runs and runs[-1][0] == kind and runs[-1][1] >= 0 and runs[-1][2] + 1 == int(index):
            runs[-1] = (kind, runs[-1][1], int(index))
        else:
            runs.append((kind, int(index), int(index)))
    parts = []
    for kind, first, last in runs:
        if first < 0:
            parts.append(kind)
        elif last - first >= 2:
            parts.append(f"{kind}:{first}-{last}")
        else:
            parts += [f"{kind}:{n}" for n in range(first, last + 1)]
    return ",".join(parts)


def task_of(device: str) -> Tuple[str, str]:
    """The job and task of a device name (empty strings when it names none)."""
    found = _TASK.search(device)
    return (found.group(1), found.group(2)) if found else ("", "")


def numbered(names: Sequence[str]) -> List[str]:
    """``names`` in order, those equal but for one number (three or more of
    them; where several numbers vary, the one with most values) written once
    where the first stood, the numbers sorted:
    ``h{0..95}/mlp/c_fc`` for a run, ``h{0,2..8}/mlp/c_fc`` for more than
    four equally far apart, ``h{0,2,5}/mlp/c_fc`` otherwise; numbers that
    rise together as sets side by side (``split_{1,3,5}: h{0..2}/attn/q``);
    then folded again by another number while that writes fewer:
    ``h{0..23}/attn/Reshape_{1..3}``."""
    text = list(names)
    while True:
        once = _fold(text)
        if len(once) == len(text):
            return text
        text = once


def _fold(names: Sequence[str]) -> List[str]:
    """``names`` folded once, by one number (or by numbers rising together)."""
    groups: Dict[Tuple, List[Tuple[int, ...]]] = {}
    for name in names:
        numbers = tuple(int(n) for n in _NUMBER.findall(name))
        groups.setdefault((tuple(_NUMBER.split(name)), len(numbers)), []).append(numbers)
    text = []
    for key, members in groups.items():
        varying = [k for k in range(key[1]) if len({m[k] for m in members}) > 1]
        if len(members) < 3 or not varying:
            text += [_join(key[0], m) for m in members]
            continue
        if len(varying) > 1 and _together(members, varying):
            # Numbers rising together (split_1: layer_0, split_5: layer_1, ...)
            # are written as sets side by side: split_{1,5,9}: layer_{0..2}.
            text.append(_join(key[0], tuple(_span({m[k] for m in members}) if k in varying
                                            else n for k, n in enumerate(members[0]))))
            continue
        # The number that varies most (a layer's index) is written as a set,
        # per value of the others (h{0..95}/ln1, h{0..95}/ln2).
        position = max(varying, key=lambda k: len({m[k] for m in members}))
        rest: Dict[Tuple[int, ...], List[Tuple[int, ...]]] = {}
        for m in members:
            rest.setdefault(m[:position] + m[position + 1:], []).append(m)
        for same in rest.values():
            if len(same) < 3:
                text += [_join(key[0], m) for m in same]
                continue
            span = _span({m[position] for m in same})
            text.append(_join(key[0], tuple(span if k == position else n
                                            for k, n in enumerate(same[0]))))
    return text


def _together(members: Sequence[Tuple[int, ...]], varying: Sequence[int]) -> bool:
    """Whether each of the ``varying`` numbers of ``members`` tells them apart
    and all rise together (sorted by one, the others are sorted too)."""
    rows = sorted(tuple(m[k] for k in varying) for m in members)
    return all(a[k] < b[k] for a, b in zip(rows, rows[1:]) for k in range(len(varying)))


def _span(numbers) -> str:
    """``{0..3}`` for a run of numbers, ``{1,5..93}`` for more than four
    equally far apart, ``{0,2,4}`` otherwise."""
    values = sorted(numbers)
    step = values[1] - values[0]
    if values == list(range(values[0], values[-1] + 1, step)) and (step == 1 or len(values) > 4):
        return (f"{{{values[0]}..{values[-1]}}}" if step == 1
                else f"{{{values[0]},{values[1]}..{values[-1]}}}")
    return "{" + ",".join(str(v) for v in values) + "}"


def _join(pieces: Sequence[str], numbers: Sequence) -> str:
    out = [pieces[0]]
    for number, piece in zip(numbers, pieces[1:]):
        out += [str(number), piece]
    return "".join(out)


def plain(value: float, digits: int = 4) -> str:
    """``value`` to ``digits`` significant digits as ``:g`` writes it, but
    never with an exponent: ``19170``, ``12.35``, ``0.5``, ``0.001234``."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
