"""How a planner search ended, as data a plan shows (issue "Say what you did")."""
import dataclasses
from typing import Any, Dict

__all__ = ["Outcome"]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """``path``: "optimal" (proved), "feasible" (a solution not proved
    optimal) or, for stage cuts, "balanced cut" (the most balanced
    contiguous cut); ``method``: what found it; ``why``: why it is not
    proved optimal ("" when it is); ``timed_out``: a time limit decided it
    (then the runtime says so as a fallback)."""

    path: str
    method: str
    why: str = ""
    timed_out: bool = False

    def describe(self) -> str:
        """'optimal (chain DP)', 'feasible (stage ILP: stopped at its time limit)'."""
        return f"{self.path} ({self.method}{': ' + self.why if self.why else ''})"

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "Outcome":
        """Inverse of :meth:`to_dict` (a plan's JSON)."""
        return cls(**{f.name: data[f.name] for f in dataclasses.fields(cls) if f.name in data})
