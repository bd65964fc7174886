"""What the hooks recorded about one graph as its model was built, as the
analysis and the rewriters read it (``hooks.capture.GraphCapture.recorded``):
plain data holding TensorFlow objects, never assigned to downstream."""
import dataclasses
from typing import Any, FrozenSet, List, Mapping, Optional, Tuple

from tfpar.ir.taskgraph import Phase

__all__ = ["ApplyCall", "GradientCall", "Recorded"]


@dataclasses.dataclass
class GradientCall:
    """One ``tf.gradients`` call: ys differentiated, xs, the returned grads, and
    the seeds (``grad_ys``: TF's default ones or the user's) backprop started from."""

    ys: List[Any]
    xs: List[Any]
    grads: List[Any]
    seeds: List[Any] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ApplyCall:
    """One ``Optimizer.apply_gradients`` call and the op it returned;
    ``slots``: the optimizer's state per parameter, as it made it (Adam 2,
    Momentum 1, SGD 0; None: not known)."""

    grads_and_vars: List[Any]
    global_step: Any
    train_op: Any
    slots: Optional[float] = None


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The capture's tables a graph is analysed and rewritten by (each as
    ``GraphCapture`` documents it; mappings are read-only views of its own).

    Attributes:
      op_task_graph: op name -> TaskGraph index, for ops created inside a scope.
      op_phase: op name -> Phase of ops created in backward/apply phases.
      differentiates: backward op name -> the forward op it differentiates.
      copied_from: recomputed copy's op name -> the forward op it copies.
      gradient_calls / apply_calls: the training API calls seen.
      declared_batch: batch source (op or iterator name) -> declared static batch.
      aggregations: variable op name -> its declared tf.VariableAggregation name.
      replica_sums: names of identities summed over a micro-batch's replicas.
      sparse_feeds: (indices, values, dense shape) of fed SparseTensors.
      worker_iterators: chief's iterator op -> the other workers' iterators.
    """

    op_task_graph: Mapping[str, int]
    op_phase: Mapping[str, Phase]
    differentiates: Mapping[str, Any]
    copied_from: Mapping[str, str]
    gradient_calls: Tuple[GradientCall, ...]
    apply_calls: Tuple[ApplyCall, ...]
    declared_batch: Mapping[str, int]
    aggregations: Mapping[str, str]
    replica_sums: FrozenSet[str]
    sparse_feeds: Tuple[Any, ...]
    worker_iterators: Mapping[Any, List[Any]]
