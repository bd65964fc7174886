"""Alpha-beta costs of collectives (no TensorFlow): ``alpha`` per message,
``bytes / bandwidth`` per byte (Rhino §3, TAP §IV-D).

All-reduce: the ring's bytes, 2 (n-1)/n of the tensor per device, and
2 ceil(log2 n) latencies: Rabenseifner's algorithm (reduce-scatter by
recursive halving, all-gather by recursive doubling; Thakur, Rabenseifner and
Gropp, "Optimization of collective communication operations in MPICH",
IJHPCA 2005) sends as few bytes as the ring in logarithmically many steps,
and NCCL's double binary trees (NCCL 2.4) reach the ring's bandwidth at
logarithmic latency too. A ring's 2 (n-1) latencies would make a tiny
model's all-reduce over 8 replicas (14 alpha) dearer than two pipeline
stages' over 4 each plus the transfers between them (8 alpha), so that a
pipeline whose stages run one after the other beat data parallelism.
All-gather: a ring (n-1 steps), as NCCL and TensorFlow run it.
"""
import math
from typing import NamedTuple

__all__ = ["Cost", "LATENCY_S", "allgather", "allreduce", "allreduce_latency"]

LATENCY_S = 10e-6   # alpha, per message


class Cost(NamedTuple):
    """Seconds and bytes sent per device."""

    seconds: float = 0.0
    bytes: float = 0.0

    def __add__(self, other):
        return Cost(self.seconds + other.seconds, self.bytes + other.bytes)

    def __mul__(self, k):
        return Cost(self.seconds * k, self.bytes * k)


def allreduce_latency(n: int) -> float:
    """Seconds of latency of one all-reduce over ``n`` devices: 2 ceil(log2 n) alpha."""
    return 2 * math.ceil(math.log2(n)) * LATENCY_S if n > 1 else 0.0


def allreduce(n: int, size: float, bandwidth: float, latency: bool = True) -> Cost:
    """All-reduce of ``size`` bytes over ``n`` devices: 2 (n-1)/n x size sent
    per device, ``allreduce_latency(n)``. ``latency=False`` leaves the latency
    out (for a transfer fused into a bucket whose latency is counted once)."""
    if n < 2:
        return Cost()
    sent = 2 * (n - 1) / n * size
    return Cost(allreduce_latency(n) * latency + sent / bandwidth, sent)


def allgather(n: int, size: float, bandwidth: float) -> Cost:
    """Ring all-gather of a ``size``-byte tensor held in ``n`` equal pieces."""
    if n < 2:
        return Cost()
    sent = (n - 1) / n * size
    return Cost((n - 1) * LATENCY_S + sent / bandwidth, sent)
