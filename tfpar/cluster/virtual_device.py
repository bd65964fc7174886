"""VirtualDevice generation (Whale §3.2.1).

Each TaskGraph i asks for d_i devices. Devices are taken in order, disjoint
when ``sum(d_i) <= K``; when the requests add up to more than the K devices but
each fits (Whale Example 2 gives both scopes ``total_gpu``), or when sharing is
forced, every TaskGraph takes its devices from the start of the list. When K is
a multiple of the devices one model copy uses, the whole model is replicated
``K // used`` times (nested data parallelism) on the following devices.
"""
import dataclasses
from typing import Optional, Sequence, Tuple

from tfpar.errors import AnnotationError

__all__ = ["DeviceAssignment", "assign_devices"]


@dataclasses.dataclass(frozen=True)
class DeviceAssignment:
    """Result of VirtualDevice generation.

    Attributes:
      nested_dp: degree of nested data parallelism over the whole model.
      virtual_devices: per TaskGraph, one VirtualDevice (tuple of device names,
        length d_i) per nested replica.
    """

    nested_dp: int
    virtual_devices: Tuple[Tuple[Tuple[str, ...], ...], ...]


def assign_devices(requests: Sequence[Tuple[str, Optional[int]]], devices: Sequence[str],
                   share: bool = False) -> DeviceAssignment:
    """Map TaskGraph device requests onto ``devices``.

    Args:
      requests: (TaskGraph name, device_count or None for all devices) per TaskGraph.
      devices: available device names, in order.
      share: ``cluster.colocate_split_and_replicate``: TaskGraphs share devices.

    Raises:
      AnnotationError: a request is not a positive int or exceeds the devices.
    """
    k = len(devices)
    counts = []
    for name, count in requests:
        if count is None:
            count = k
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise AnnotationError(
                f"TaskGraph '{name}': device_count must be a positive integer or None, "
                f"got {count!r}")
        if count > k:
            raise AnnotationError(
                f"TaskGraph '{name}' asks for {count} devices but only {k} exist "
                f"({', '.join(devices)}); lower device_count or set cluster.num_devices")
        counts.append(count)
    shared = share or sum(counts) > k
    used = max(counts) if shared else sum(counts)
    nested = k // used if k % used == 0 else 1
    per_tg = []
    offset = 0
    for count in counts:
        start = 0 if shared else offset
        per_tg.append(tuple(tuple(devices[j * used + start: j * used + start + count])
                            for j in range(nested)))
        offset += count
    return DeviceAssignment(nested_dp=nested, virtual_devices=tuple(per_tg))
