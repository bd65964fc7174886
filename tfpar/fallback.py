"""Saying what tfpar did instead of what was asked (``docs/fallbacks.md``).

Wherever tfpar runs something other than what the script or config asked,
it calls ``fall_back``: the text (what was asked, what runs instead, how to
get what was asked) is warned as a ``tfpar.FallbackWarning``, which users and
tests can escalate with the ``warnings`` filters, and recorded as a note of
the plan (``Plan.notes``: in ``summary()``, ``print(plan)`` and the JSON).
With ``strict: true`` in the config it raises ``PlanError`` instead.
``advise`` records advice the same way - what runs is what was asked, but
something the config left out would do better - as a note and a warning of
the ``tfpar`` logger, never an error.

Imports nothing of TensorFlow: graphs are only keys here.
"""
import logging
import warnings
import weakref
from typing import Any, List, Optional, Tuple

from tfpar.errors import FallbackWarning, PlanError

__all__ = ["advise", "configure", "fall_back", "note", "notes", "reset"]

log = logging.getLogger("tfpar")

_strict = [False]
# Graph -> its notes, in the order said; notes said of no graph (the
# process: devices, cluster) belong to every plan made after them.
_graph_notes: "weakref.WeakKeyDictionary[Any, List[str]]" = weakref.WeakKeyDictionary()
_process_notes: List[str] = []


def configure(strict: bool) -> None:
    """``strict``: every fallback from now on raises ``PlanError``."""
    _strict[0] = bool(strict)


def fall_back(asked: str, instead: str, remedy: str, graph: Optional[Any] = None) -> str:
    """Say that ``instead`` runs where ``asked`` was asked, and ``remedy``
    (how to get what was asked, or how to silence it by asking for what
    runs): a ``FallbackWarning`` and a note of ``graph``'s plan (of every
    plan, without a graph). Returns the text.

    Raises:
      PlanError: under ``strict: true``, with the same text.
    """
    text = f"tfpar: {asked}: {instead}. {remedy}"
    if _strict[0]:
        raise PlanError(f"{text} (strict: true makes this an error)")
    note(text, graph)
    warnings.warn(text, FallbackWarning, stacklevel=2)
    return text


def advise(text: str, graph: Optional[Any] = None) -> str:
    """Say ``text`` (advice, starting "tfpar: "): a warning of the ``tfpar``
    logger, once, and a note of ``graph``'s plan (of every plan, without a
    graph), under ``strict: true`` too. Returns the text."""
    if note(text, graph):
        log.warning("%s", text)
    return text


def note(text: str, graph: Optional[Any] = None) -> bool:
    """Record ``text`` as a note of ``graph``'s plan (of every plan, without a
    graph), once. False when it was noted already."""
    said = _process_notes if graph is None else _graph_notes.setdefault(graph, [])
    if text in said:
        return False
    said.append(text)
    return True


def notes(graph: Optional[Any] = None) -> Tuple[str, ...]:
    """What was said of ``graph`` and of the process, in order."""
    return tuple(_process_notes) + tuple(_graph_notes.get(graph, ()) if graph is not None else ())


def reset() -> None:
    """Forget every note and leave strict mode (``wh.reset``)."""
    _strict[0] = False
    _graph_notes.clear()
    _process_notes.clear()
