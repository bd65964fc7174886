"""Roofline op times (Williams, Waterman and Patterson, CACM 52(4), 2009; no
TensorFlow): an op runs for the longer of its FLOPs at the device's
sustained throughput and its memory traffic (the bytes it reads and writes)
at the device's sustained memory bandwidth.

A transformer's matrix products are bound by FLOPs; its elementwise ops,
softmax, layer norms, transposes and gathers by memory. Per row, a layer's
FLOPs grow with the square of the hidden size and its traffic with the
hidden size (and the attention scores with heads x sequence), so the share
of the step those ops take shrinks as models widen: Megatron-LM's per-GPU
throughput rises from 137 to 163 TFLOP/s between its 1.7B and 1T GPTs
(Narayanan et al., SC'21, Table 1).

The planner times ops as FLOPs at the model's compute dtype; ``timed_flops``
turns each op's time into such FLOPs (traffic x throughput / bandwidth for
a memory-bound op), and ``low_precision_speed_up`` is the speed-up mixed
precision gives the same ops: FLOPs at the 16-bit peak, half the traffic.
"""
from typing import List, Optional, Sequence

from tfpar.cluster.hardware import Hardware

__all__ = ["LOW_PRECISION", "low_precision_speed_up", "timed_flops"]

LOW_PRECISION = "fp16"


def timed_flops(flops: Sequence[float], traffic: Sequence[float], hardware: Hardware,
                dtype: str) -> List[float]:
    """Each op's roofline time, as FLOPs at ``dtype``."""
    ratio = hardware.flops_per_s(dtype) / hardware.memory_bytes_per_s()
    return [max(f, b * ratio) for f, b in zip(flops, traffic)]


def low_precision_speed_up(flops: Sequence[float], traffic: Optional[Sequence[float]],
                           hardware: Hardware, dtype: str) -> float:
    """How many times faster the ops run in ``LOW_PRECISION`` than in
    ``dtype`` (1 for a model already in 16 bits)."""
    if dtype in ("fp16", "bf16"):
        return 1.0
    bandwidth = hardware.memory_bytes_per_s()
    traffic = [0.0] * len(flops) if traffic is None else traffic

    def seconds(compute_dtype: str, bytes_scale: float) -> float:
        speed = hardware.flops_per_s(compute_dtype)
        return sum(max(f / speed, b * bytes_scale / bandwidth) for f, b in zip(flops, traffic))
    low = seconds(LOW_PRECISION, 0.5)
    return seconds(dtype, 1.0) / low if low else hardware.peak(LOW_PRECISION) / hardware.peak(dtype)
