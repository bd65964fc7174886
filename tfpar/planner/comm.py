"""Alpha-beta costs of collectives (no TensorFlow): ``alpha`` per message,
``bytes / bandwidth`` per byte, ring algorithms (Rhino §3, TAP §IV-D)."""
from typing import NamedTuple

__all__ = ["Cost", "LATENCY_S", "allgather", "allreduce"]

LATENCY_S = 10e-6   # alpha, per message


class Cost(NamedTuple):
    """Seconds and bytes sent per device."""

    seconds: float = 0.0
    bytes: float = 0.0

    def __add__(self, other):
        return Cost(self.seconds + other.seconds, self.bytes + other.bytes)

    def __mul__(self, k):
        return Cost(self.seconds * k, self.bytes * k)


def allreduce(n: int, size: float, bandwidth: float, latency: bool = True) -> Cost:
    """Ring all-reduce of ``size`` bytes over ``n`` devices: 2 (n-1) steps of
    size / n each. ``latency=False`` leaves out the per-message term (for a
    transfer fused into a bucket whose latency is counted once)."""
    if n < 2:
        return Cost()
    sent = 2 * (n - 1) / n * size
    return Cost(2 * (n - 1) * LATENCY_S * latency + sent / bandwidth, sent)


def allgather(n: int, size: float, bandwidth: float) -> Cost:
    """Ring all-gather of a ``size``-byte tensor held in ``n`` equal pieces."""
    if n < 2:
        return Cost()
    sent = (n - 1) / n * size
    return Cost((n - 1) * LATENCY_S + sent / bandwidth, sent)
