"""Interleaved 1F1B in the automatic search (virtual stages; Narayanan et
al., SC'21 §2.2): the model is cut into G V stages and device group g runs
stages g, g + G, ..., each 1/V of what it would run without interleaving
(no TensorFlow).

What it changes, for a device whose share of the model takes ``T`` per
micro-batch (forward and backward) and ``M`` micro-batches a multiple of G:
  * the bubble: a step lasts ``M T + (G - 1) T / V`` instead of 1F1B's
    ``M T + (G - 1) T`` - the first micro-batch reaches the last group
    after G - 1 chunks of ``T / V``, not G - 1 whole shares (§2.2.1);
  * the transfers: a micro-batch crosses G V - 1 stage boundaries each way
    instead of G - 1, V times as many point-to-point transfers, each
    costed on the link as 1F1B's are (``step_model``: latency plus the
    mean bytes of a boundary over the bandwidth). Filling and draining
    the pipeline waits for ``2 (G V - 1)`` of them;
  * the activations: group g runs ``2 (G - g - 1) + (V - 1) G`` forward
    chunks before its first backward (``ir.schedule.interleaved_schedule``)
    and one more before that backward ends, so the first group holds at
    its peak ``min(G V + G - 1, M V)`` chunks' activations of a
    micro-batch, each 1/V of its share: ``(G + (G - 1) / V) A`` for a
    share keeping ``A`` a micro-batch, against 1F1B's ``G A``.
The step and the peaks are not closed forms here: the planner replays the
schedule (``ir.simulate``'s replay with its device-group lanes, ordered
once per schedule and timed per setting; the peaks
by walking each group's task order), which holds for unequal stages and for
transfers too slow for the steady state to hide. A search tries thousands
of micro-batches on a large batch, so at most ``replayed(G, V)`` = 2 G (V +
2) are replayed: a longer step grows by the mean a micro-batch added over
the replay's second half (within 3% of the whole replay for stages within
10% of each other and transfers up to three stages long:
``tests/test_virtual_stage_search.py``), and its peaks are the replay's
(the steady state repeats every G micro-batches).
"""
import functools
from typing import List, Sequence, Tuple

import numpy

from tfpar.ir.schedule import interleaved_schedule
from tfpar.ir.simulate import replay_order, replay_times

__all__ = ["MAX_VIRTUAL_STAGES", "group_peaks", "interleaved_length", "replayed",
           "virtual_stage_counts"]

# Virtual stages tried per device group: 2, 4, ... up to this (Megatron-LM's
# published runs use at most a handful; each doubles the transfers).
MAX_VIRTUAL_STAGES = 8


def virtual_stage_counts(groups: int, units: int) -> List[int]:
    """V > 1 (powers of two up to ``MAX_VIRTUAL_STAGES``) for which each of
    ``groups`` device groups can hold V stages of a model of ``units``
    stage units (``model_view.stage_units``)."""
    counts, v = [], 2
    while v <= MAX_VIRTUAL_STAGES and groups * v <= units and groups > 1:
        counts.append(v)
        v *= 2
    return counts


def replayed(groups: int, virtual: int) -> int:
    """The most micro-batches a step of ``groups`` x ``virtual`` stages is
    replayed with (a multiple of ``groups``)."""
    return 2 * groups * (virtual + 2)


@functools.lru_cache(maxsize=16)
def _order(groups: int, virtual: int, micro: int):
    """``interleaved_schedule``'s ``ir.simulate.Replay`` (made once: a search
    replays it with many stage times)."""
    return replay_order(interleaved_schedule(groups, virtual, micro), groups)


@functools.lru_cache(maxsize=4096)
def _replayed(times: Tuple[float, ...], groups: int, micro: int, transfer: float) -> float:
    """``simulate``'s length of the step, timed on its cached ``Replay``."""
    replay = _order(groups, len(times) // groups, micro)
    _, ends = replay_times(replay, {"F": [t / 3 for t in times], "B": [2 * t / 3 for t in times]},
                           transfer)
    return max(ends)


def interleaved_length(times: Sequence[float], groups: int, micro: int,
                       transfer: float) -> float:
    """Seconds from the first forward to the last backward of ``micro``
    micro-batches through stages of ``times`` each (forward a third, as
    ``step_model`` counts it; stage s on group ``s % groups``) with
    ``transfer`` between neighbouring stages, replayed (extrapolated past
    ``replayed``)."""
    cap = replayed(groups, len(times) // groups)
    if micro <= cap:
        return _replayed(tuple(times), groups, micro, transfer)
    half, whole = (_replayed(tuple(times), groups, m, transfer) for m in (cap // 2, cap))
    return whole + (micro - cap) * (whole - half) / (cap - cap // 2)


def group_peaks(kept: Sequence[float], groups: int, micro: int) -> List[float]:
    """Per device group, the most activation bytes it holds at once: a
    stage's forward keeps its ``kept`` bytes (one micro-batch's) until its
    backward, in the order ``interleaved_schedule`` gives the group (of at
    most ``replayed`` micro-batches)."""
    virtual = len(kept) // groups
    per_stage = numpy.asarray(kept, dtype=float)
    return [float(numpy.cumsum(per_stage[stages] * signs).max(initial=0.0))
            for stages, signs in _walks(groups, virtual, min(micro, replayed(groups, virtual)))]


@functools.lru_cache(maxsize=256)
def _walks(groups: int, virtual: int, micro: int):
    """Per device group, the stage of each of its tasks in the order it runs
    them (a ``Replay`` keeps each group's order) and +1 for a forward (which
    keeps its activations), -1 for a backward (which frees them)."""
    replay = _order(groups, virtual, micro)
    stages = numpy.array(replay.stages, dtype=int)
    signs = numpy.array([1.0 if task.kind == "F" else -1.0 for task in replay.tasks])
    return [(stages[mine], signs[mine]) for mine in (stages % groups == g for g in range(groups))]
