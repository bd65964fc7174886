"""One captured graph as analysis reads it, made once per rewrite pass (and
again after recomputation adds ops): the graph's index, what capture
recorded, and the model view, computed at its first use and kept, so the
plan, its costs, the balance and the measured prediction read one view."""
import dataclasses
import functools
from typing import List, Tuple

from tfpar.analysis.graph_index import GraphIndex
from tfpar.analysis.model_view import model_view
from tfpar.compat.tf import ops
from tfpar.ir.recorded import Recorded
from tfpar.planner.model_view import ModelView

__all__ = ["Analysed"]


@dataclasses.dataclass(frozen=True)
class Analysed:
    """``index`` and ``recorded`` of one graph, read only."""

    index: GraphIndex
    recorded: Recorded

    @property
    def graph(self) -> ops.Graph:
        return self.index.graph

    @functools.cached_property
    def view(self) -> Tuple[List[ops.Operation], ModelView]:
        """The forward ops and their ``ModelView`` (``analysis.model_view``)."""
        return model_view(self.index, self.recorded)
