"""Which candidate the automatic search picks (``choose``), and the hint that
more memory techniques would make one much faster (no TensorFlow)."""
import dataclasses
from typing import Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.errors import PlanError
from tfpar.ir.compact import plain
from tfpar.planner.candidate import Candidate

__all__ = ["HINT_SPEED_UP", "TENSOR_TOLERANCE", "TOLERANCE", "choose",
           "faster_with_techniques"]

# Estimates are rough: within TOLERANCE of the fastest, fewer pipeline stages
# win (bubbles and stage balance are where the model errs most; interleaved
# stages count, V per device group: ``Candidate.stage_count``); among those,
# the lower tensor degree within TENSOR_TOLERANCE (a split's cost is computed
# from its collectives: a gain of a few percent is noise, one of 9% - Whale's
# 100K-class head on 8 GPUs - is not), then the fewer virtual stages (each
# doubles the transfers a step is exposed to on a slower link than assumed).
TOLERANCE = 0.1
TENSOR_TOLERANCE = 0.02
# A plan this many times faster with memory techniques the search was not
# allowed is worth a hint (``faster_with_techniques``).
HINT_SPEED_UP = 1.5


def choose(candidates: Sequence[Candidate], hardware: Hardware) -> Candidate:
    """The fastest of ``candidates`` whose memory fits.

    Raises:
      PlanError: none fits, naming the smallest memory need.
    """
    capacity = hardware.memory_gb * 2 ** 30
    fitting = [c for c in candidates if c.memory_bytes <= capacity]
    if not fitting:
        fits = "" if not any(c.faster_with for c in candidates) else (
            "; with more memory techniques one would: " + faster_with_techniques(
                candidates, None)[1])
        if not candidates:
            raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits "
                            f"{hardware.name}'s {hardware.memory_gb:g} GB per device")
        least = min(candidates, key=lambda c: c.memory_bytes)
        raise PlanError(f"tfpar: auto.auto_parallel found no plan that fits {hardware.name}'s "
                        f"{hardware.memory_gb:g} GB per device; the smallest needs "
                        f"{least.memory_bytes / 2 ** 30:.3g} GB ({least.describe()}){fits}")
    fastest = min(c.step_time_s for c in fitting)
    near = [c for c in fitting if c.step_time_s <= fastest * (1 + TOLERANCE)]
    stages = min(c.stage_count for c in near)
    near = [c for c in near if c.stage_count == stages]
    fastest = min(c.step_time_s for c in near)
    return min((c for c in near if c.step_time_s <= fastest * (1 + TENSOR_TOLERANCE)),
               key=lambda c: (c.tensor, c.virtual_stages, c.step_time_s))


def faster_with_techniques(candidates: Sequence[Candidate], chosen: Optional[Candidate]
                           ) -> Optional[Tuple[float, str, Tuple[str, ...]]]:
    """When the fastest of ``candidates``' settings with every memory
    technique (``Candidate.faster_with``) is at least ``HINT_SPEED_UP``
    times faster than ``chosen`` (None: than nothing): (its speed-up, what
    it is, the technique names it uses that the search was not allowed);
    else None."""
    options = [c for c in candidates if c.faster_with]
    if not options:
        return None
    candidate = min(options, key=lambda c: c.faster_with.step_time_s)
    best = candidate.faster_with
    speed_up = (chosen.step_time_s / best.step_time_s if chosen is not None
                else float("inf"))
    if speed_up < HINT_SPEED_UP:
        return None
    what = dataclasses.replace(candidate, micro_batches=best.micro_batches,
                               techniques=best.techniques, schedule=best.schedule,
                               group_size=best.group_size).describe()
    allowed = candidate.search.techniques if candidate.search else ()
    return (speed_up, f"{what}, estimated {plain(best.step_time_s * 1e3)} ms/step",
            tuple(name for name in best.techniques.names if name not in allowed))

