"""Ada-Grouper's online tuning of k (§5.2, §5.4), for pipelines that Session.run steps.

Every ``pipeline.retune_steps`` training steps one step is traced (the
profile); its task timeline gives each stage's forward and backward times and
the cross-stage transfer time (``planner.grouper.profile_pipeline``). Stage
times are stable, the network is not (the paper's preempted network): from the
profile the simulator predicts every k's step, and k moves to the smallest
within ``pipeline.retune_tolerance`` of the shortest that fits in memory. The
pipeline of a new k is built once, as new ops beside the others
(``rewriters.schedule_versions``); going back to a k built before builds
nothing.
"""
import dataclasses
import logging
from typing import Dict, List, Optional, Sequence

from tfpar.planner.grouper import (PipelineProfile, group_lengths, preferred_group_size,
                                   profile_pipeline)
from tfpar.ir.compact import plain
from tfpar.ir.simulate import TimedTask

__all__ = ["GroupRetuner", "Retuning"]

log = logging.getLogger("tfpar")


@dataclasses.dataclass(frozen=True)
class Retuning:
    """One profiled step and what the tuner chose.

    Attributes:
      step: training steps run under tfpar when it was profiled.
      profile: stage and transfer times (microseconds).
      predicted: k -> predicted pipeline length (microseconds), for every k
        that fits in memory.
      before / after: k before and after.
    """

    step: int
    profile: PipelineProfile
    predicted: Dict[int, float]
    before: int
    after: int


class GroupRetuner:
    """Decides k of a kFkB pipeline from profiled steps.

    Args:
      num_micro_batch / num_stages: the pipeline's.
      group_size: the planned k.
      fixed_bytes / activation_bytes / memory_limit: the memory model of the
        planned k (``planner.grouper.tune_group_size``).
      every: profile one training step in this many (at least 2: the first
        step of a new k builds its executor, and is not profiled).
      tolerance: ``pipeline.retune_tolerance``.

    Attributes:
      history: every profiled step (``Retuning``).
    """

    def __init__(self, num_micro_batch: int, num_stages: int, group_size: int,
                 fixed_bytes: Sequence[float], activation_bytes: Sequence[float],
                 memory_limit: float, every: int, tolerance: float) -> None:
        self.num_micro_batch = num_micro_batch
        self.num_stages = num_stages
        self.group_size = group_size
        self._memory = (tuple(fixed_bytes), tuple(activation_bytes), memory_limit)
        self._every = every
        self._tolerance = tolerance
        self._since = 0
        self.steps = 0
        self.pending = False
        self.history: List[Retuning] = []

    def profile_due(self) -> bool:
        """Count a training step about to run; True if it is to be profiled
        (one in ``every``: a step that yields no profile is not retried)."""
        self.steps += 1
        self._since += 1
        self.pending = self._since >= self._every
        if self.pending:
            self._since = 0
        return self.pending

    def profiled(self, tasks: Sequence[TimedTask]) -> Optional[int]:
        """The profiled step's timed tasks (first device of every stage); the
        new k, or None if k stays."""
        self.pending = False
        profile = profile_pipeline(tasks, self.num_stages)
        fixed, activations, limit = self._memory
        lengths = group_lengths(self.num_micro_batch, profile.forward, profile.backward,
                                profile.transfer, fixed, activations, limit)
        before = self.group_size
        after = preferred_group_size(lengths, self._tolerance) if lengths else before
        self.history.append(Retuning(self.steps, profile, lengths, before, after))
        log.info("tfpar: Ada-Grouper profiled step %d: cross-stage transfer %.3g ms (%d "
                 "waited for), pipeline %.3g ms with k=%d; predicted: %s", self.steps,
                 profile.transfer / 1e3, profile.samples, profile.length / 1e3, before,
                 ", ".join(f"k={k} {plain(v / 1e3, 3)} ms" for k, v in sorted(lengths.items())))
        if after == before:
            return None
        self.group_size = after
        return after
