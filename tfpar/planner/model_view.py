"""``ModelView``: the planner's view of a model - its forward ops' FLOPs,
bytes and edges - and what the search reads off it (no TensorFlow)."""
import dataclasses
from typing import Optional, Sequence, Tuple

from tfpar.cluster.hardware import Hardware
from tfpar.planner.memory import SLOTS
from tfpar.planner.roofline import timed_flops

__all__ = ["ModelView", "sent_bytes", "stage_units", "timed"]

# Op types (prefixes) that draw random numbers: RandomUniform,
# StatelessRandomUniformV2, TruncatedNormal, ...
RANDOM_OPS = ("Random", "StatelessRandom", "TruncatedNormal", "StatelessTruncatedNormal",
              "ParameterizedTruncatedNormal", "Multinomial", "StatelessMultinomial")


@dataclasses.dataclass(frozen=True)
class ModelView:
    """The forward ops of a model in topological order.

    Attributes:
      flops: FLOPs per batch row of each op.
      activation_bytes: bytes per row each op's output allocates (none for
        one that is its input's buffer: a reshape): whether it runs a kernel.
      param_bytes: bytes of the weights each op reads (counted once).
      edges: (i, j, bytes per row) between ops.
      labels: each op's repeated block (``pruning.block_labels``) or None.
      names, types: op names and types (the sharding search groups ops into
        layers by name scope; without them only pipelines are searched).
      input_bytes: bytes per row each op reads from the model's inputs.
      batch: the global batch the model's inputs declare (None: unknown).
      compute_dtype: the dtype of most of its FLOPs (``hardware.DTYPES``;
        "tf32": float32 that TensorFlow may run as TF32).
      traffic_bytes: bytes per row each op reads and writes in device
        memory (None: unknown, FLOPs alone time the ops).
      kept_bytes: bytes per row of each op's outputs the backward pass reads
        (kept from the forward pass until then; None: unknown, and ``kept``
        is every output, about twice as much on a GPT:
        ``benchmarks/memory.py``).
      optimizer_slots: the optimizer's state per weight, as the script's
        optimizer made it (SGD 0, Momentum 1, Adam 2); Adam's when unknown.
      attention_heads: (name scope, heads) of each keras MultiHeadAttention
        (read from its query kernel, ``[model, heads, width]``).
      core_heads: (name scope, heads) of each batched contraction of four or
        more axes (an attention core's ``Q K^T``, ``[B, heads, T, T]``; with
        grouped queries ``[B, kv heads, group, T, T]``): how many heads a
        core of raw ops is split along (``hooks/head_patches.py``).
    """

    flops: Sequence[float]
    activation_bytes: Sequence[float]
    param_bytes: Sequence[float]
    edges: Sequence[Tuple[int, int, float]]
    labels: Optional[Sequence[Optional[str]]] = None
    names: Optional[Sequence[str]] = None
    types: Optional[Sequence[str]] = None
    input_bytes: Optional[Sequence[float]] = None
    batch: Optional[int] = None
    compute_dtype: str = "fp32"
    traffic_bytes: Optional[Sequence[float]] = None
    kept_bytes: Optional[Sequence[float]] = None
    optimizer_slots: float = SLOTS
    attention_heads: Tuple[Tuple[str, int], ...] = ()
    core_heads: Tuple[Tuple[str, int], ...] = ()

    @property
    def kept(self) -> Sequence[float]:
        """Bytes per row each op keeps for the backward pass: ``kept_bytes``,
        else (unknown) every output."""
        return self.activation_bytes if self.kept_bytes is None else self.kept_bytes

    @property
    def draws_random_numbers(self) -> bool:
        """Whether its forward draws random numbers (dropout's masks)."""
        return any(t.startswith(RANDOM_OPS) for t in self.types or ())



def stage_units(model: ModelView) -> int:
    """How many stages the model can be cut into: its runs of ops of one
    repeated block (a transformer layer) and of ops outside blocks, each op
    its own unit when there are no blocks."""
    if not model.labels or all(label is None for label in model.labels):
        return len(model.flops)
    runs = [label for i, label in enumerate(model.labels)
            if i == 0 or label != model.labels[i - 1]]
    return len(runs)



def timed(model: ModelView, hardware: Hardware) -> ModelView:
    """``model`` with each op's FLOPs its roofline time on ``hardware``
    (``roofline.timed_flops``) and the traffic folded in (None)."""
    if model.traffic_bytes is None:
        return model
    return dataclasses.replace(
        model, flops=timed_flops(model.flops, model.traffic_bytes, hardware, model.compute_dtype),
        traffic_bytes=None)


def sent_bytes(edges: Sequence[Tuple[int, int, float]], stage_of: Sequence[int]) -> float:
    """Bytes per row the stages ``stage_of`` (per op) send each other: a
    tensor once to each stage that reads it, however many of its ops do (a
    residual stream read by a layer norm's two ops and by the residual add
    crosses once; a producer's edges of one size to one stage are taken
    for one tensor)."""
    sent = {(i, stage_of[j], size) for i, j, size in edges if stage_of[i] != stage_of[j]}
    return sum(size for _, _, size in sent)
