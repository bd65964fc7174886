"""Memory techniques as terms of the planner's memory and time model (no
TensorFlow): what a device keeps, and what it costs, with each.

Per op of a ``ModelView`` (so that a pipeline stage sums its ops' terms):

  * activation recomputation (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", 2022, §4-§5):
      - ``none`` keeps every op's output for the backward pass;
      - ``selective`` drops attention's ``a s^2`` tensors - the ops from a
        weightless contraction (``Q K^T``) through element-wise ops and the
        softmax up to the next weightless contraction (attention over ``V``),
        their §5 - and recomputes them (their forward FLOPs again);
      - ``full`` keeps only what enters each repeated block (a transformer
        layer's input) and recomputes the block's forward in its backward pass;
    while one block's (or attention core's) dropped outputs are rebuilt, they
    are held once more (``transient_bytes``).
  * ZeRO (Rajbhandari et al., SC'20, §5.1-§5.2): stage 1 shards the
    optimizer slots (and mixed precision's float32 master weights) over the
    ``d`` data-parallel replicas, stage 2 the gradients as well; the
    reduce-scatter and all-gather send what the all-reduce did.
  * mixed precision (Micikevicius et al., ICLR'18): compute and activations
    in 16 bits, float32 master weights. Per parameter 2 (fp16 weights) + 2
    (gradients) + 4 (master) + 8 (Adam's two slots) = 16 bytes, as float32's
    4 + 4 + 8: ``state_bytes`` counts both from the graph's float32 weights.
  * optimizer offload (ZeRO-Offload, Ren et al., USENIX ATC'21, §4): the
    slots and the update live on the host; the device still holds the
    weights it reads and the gradients it sends. A step moves the weights to
    the device and the gradients to the host over the host link, and the
    host's update streams 7 float32 arrays per parameter (Adam reads weight,
    gradient and 2 slots, writes 3) through host memory: ``offload_seconds``,
    counted after the step (not overlapped: an upper bound).
"""
import collections
import dataclasses
from typing import Dict, List, Sequence, Tuple

from tfpar.ir.contractions import CONTRACTIONS

__all__ = ["HOST_LINK_BYTES_S", "HOST_MEMORY_BYTES_S", "RECOMPUTE", "Recomputation",
           "Techniques", "offload_seconds", "recomputation", "state_bytes", "state_parts",
           "state_per_weight"]

RECOMPUTE = ("none", "selective", "full")
SLOTS = 2  # optimizer slots per weight when the script's optimizer is unknown (Adam's m and v)
# Bytes of activations (kept, transient, sent) under mixed precision per
# float32 byte: grappler's rewrite computes in 16 bits what its allow and
# infer lists hold (contractions, element-wise ops between them), and keeps
# in float32 what its deny list does (softmax, normalization statistics, the
# loss): a GPT's step peak fell to 0.65 of float32's, not 0.5
# (benchmarks/memory.py, bf16 on a oneDNN CPU).
MIXED_ACTIVATIONS = 0.65
# A device's link to its host (PCIe 3.0 x16, one way, as measured) and the
# host memory bandwidth its update streams at (a share of a server's DRAM).
HOST_LINK_BYTES_S = 12e9
HOST_MEMORY_BYTES_S = 50e9
UPDATE_ARRAYS = 7  # float32 arrays an Adam update reads or writes per parameter
# Ops that act on an attention core's tensors element by element (or per row).
_CORE_OPS = frozenset({"Mul", "AddV2", "Add", "Sub", "RealDiv", "Softmax", "Select", "SelectV2",
                       "Maximum", "Minimum", "Cast", "Identity", "Neg", "Exp", "Greater",
                       "GreaterEqual", "RandomUniform", "Floor"})


@dataclasses.dataclass(frozen=True, order=True)
class Techniques:
    """One point of the memory-technique space: activation recomputation
    (``RECOMPUTE``), ZeRO stage (0, 1, 2), 16-bit mixed precision, optimizer
    offload."""

    recompute: str = "none"
    zero: int = 0
    mixed_precision: bool = False
    offload: bool = False

    def describe(self) -> str:
        """'recompute full, ZeRO-1, mixed precision, optimizer offload', or 'none'."""
        parts = ([f"recompute {self.recompute}"] if self.recompute != "none" else []) + (
            [f"ZeRO-{self.zero}"] if self.zero else []) + (
            ["mixed precision"] if self.mixed_precision else []) + (
            ["optimizer offload"] if self.offload else [])
        return ", ".join(parts) or "none"

    @property
    def names(self) -> List[str]:
        """The techniques used, as ``auto.memory_techniques`` names them."""
        return (["recompute"] if self.recompute != "none" else []) + (
            ["zero"] if self.zero else []) + (
            ["mixed_precision"] if self.mixed_precision else []) + (
            ["offload"] if self.offload else [])


def state_bytes(param_bytes: float, data: int, zero: int, offload: bool = False,
                slots: float = SLOTS) -> float:
    """Bytes per device of weights, gradients and optimizer slots for weights
    of ``param_bytes`` (float32) on ``d`` = ``data`` replicas, with ``slots``
    optimizer slots per weight (``ModelView.optimizer_slots``: Adam 2, 16
    bytes per parameter; SGD 0, 8): ZeRO-1 shards the slots and ZeRO-2 the
    gradients too, and ``offload`` keeps the slots on the host. Mixed
    precision's split (Adam: 2 + 2 + 4 + 8) is the same: its master weights
    shard with the slots."""
    return param_bytes * sum(_state_shares(data, zero, offload, slots))


def state_parts(state: float, data: int, zero: int, offload: bool = False,
                slots: float = SLOTS) -> Dict[str, float]:
    """``state`` bytes per device (``state_bytes``) as its weights,
    gradients and optimizer slots, in the proportions ``state_bytes`` counts."""
    shares = _state_shares(data, zero, offload, slots)
    param_bytes = state / sum(shares)
    return dict(zip(("weights", "gradients", "optimizer"), (param_bytes * s for s in shares)))


def _state_shares(data: int, zero: int, offload: bool,
                  slots: float) -> Tuple[float, float, float]:
    """Bytes of weights, gradients and slots per device per float32 weight byte."""
    slots = 0.0 if offload else float(slots)
    return (1.0, 1.0 / data if zero >= 2 else 1.0, slots / data if zero >= 1 else slots)


def state_per_weight(slots: float) -> float:
    """Bytes of weights, gradients and optimizer slots per byte of weights
    (float32, no ZeRO): the one factor every memory estimate uses."""
    return 2.0 + slots


def offload_seconds(param_bytes: float) -> float:
    """Seconds an offloaded optimizer adds to a step for weights of
    ``param_bytes`` (float32; module docstring)."""
    return (2 * param_bytes / HOST_LINK_BYTES_S
            + UPDATE_ARRAYS * param_bytes / HOST_MEMORY_BYTES_S)


@dataclasses.dataclass(frozen=True)
class Recomputation:
    """Per op of a model view and per ``RECOMPUTE`` mode: bytes per row kept
    for the backward pass (``kept``), forward FLOPs per row run again
    (``flops``), and per op the recomputed unit (a block or attention core)
    it belongs to, with each unit's dropped bytes per row (held while it is
    rebuilt)."""

    kept: Dict[str, List[float]]
    flops: Dict[str, List[float]]
    unit: Dict[str, List[int]]
    unit_bytes: Dict[str, List[float]]

    def transient_bytes(self, mode: str, ops: Sequence[int]) -> float:
        """Bytes per row rebuilt at once among ``ops``: the largest unit's."""
        units = set(map(self.unit[mode].__getitem__, ops))
        units.discard(-1)
        return max(map(self.unit_bytes[mode].__getitem__, units), default=0.0)


def recomputation(view) -> Recomputation:
    """The recomputation terms of ``view`` (a ``ModelView``)."""
    count = len(view.flops)
    kept = {"none": list(view.kept)}
    flops = {"none": [0.0] * count}
    unit = {"none": [-1] * count}
    unit_bytes: Dict[str, List[float]] = {"none": []}
    cores = _attention_cores(view)
    kept["selective"] = list(view.kept)
    flops["selective"] = [0.0] * count
    unit["selective"] = [-1] * count
    unit_bytes["selective"] = []
    for number, core in enumerate(cores):
        for i in core:
            kept["selective"][i] = 0.0
            flops["selective"][i] = view.flops[i]
            unit["selective"][i] = number
        unit_bytes["selective"].append(sum(view.kept[i] for i in core))
    kept["full"], flops["full"], unit["full"], unit_bytes["full"] = _full(view)
    return Recomputation(kept, flops, unit, unit_bytes)


def _attention_cores(view) -> List[List[int]]:
    """Each run of ops from a weightless contraction through element-wise ops
    and softmaxes that reaches another weightless contraction (Q K^T to the
    attention over V), the first contraction included."""
    consumers = collections.defaultdict(list)
    for i, j, size in view.edges:
        if size:
            consumers[i].append(j)
    types = view.types or [""] * len(view.flops)

    def weightless(i):
        return types[i] in CONTRACTIONS and not view.param_bytes[i]
    cores = []
    for start in (i for i in range(len(view.flops)) if weightless(i)):
        seen, frontier, closed = {start}, [start], False
        while frontier:
            i = frontier.pop()
            for j in consumers[i]:
                if weightless(j):
                    closed = True
                elif types[j] in _CORE_OPS and j not in seen:
                    seen.add(j)
                    frontier.append(j)
        if closed:
            cores.append(sorted(seen))
    return cores


def _full(view):
    """Full recomputation: an op of a repeated block keeps nothing but the
    block's inputs (each producer outside it once, at its largest edge in),
    kept by the block's first op; ops outside blocks keep their outputs."""
    labels = view.labels or [None] * len(view.flops)
    blocks: Dict[str, List[int]] = collections.defaultdict(list)
    for i, label in enumerate(labels):
        if label is not None:
            blocks[label].append(i)
    inputs: Dict[str, Dict[int, float]] = collections.defaultdict(dict)
    for i, j, size in view.edges:
        label = labels[j]
        if label is not None and labels[i] != label:
            inputs[label][i] = max(inputs[label].get(i, 0.0), size)
    kept = [b if label is None else 0.0 for b, label in zip(view.kept, labels)]
    flops = [0.0 if label is None else f for f, label in zip(view.flops, labels)]
    unit, unit_bytes = [-1] * len(view.flops), []
    for number, (label, members) in enumerate(blocks.items()):
        kept[members[0]] = sum(inputs[label].values())
        for i in members:
            unit[i] = number
        unit_bytes.append(sum(view.kept[i] for i in members))
    return kept, flops, unit, unit_bytes
