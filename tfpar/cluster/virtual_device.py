"""VirtualDevice generation (Whale §3.2.1).

Each TaskGraph i asks for d_i devices. Devices are taken in order, disjoint
when ``sum(d_i) <= K``. When the requests add up to more than the K devices
but each fits, TaskGraphs share devices (Whale lets VirtualDevices overlap):

* all asking for the same d (more ``replicate(1)`` stages than devices): the
  devices form ``K // d`` groups of d, and consecutive TaskGraphs share a
  group, TaskGraph i of n taking group ``i * groups // n``, so a pipeline
  still spans every group (5 stages on 4 devices: the first two share one);
  Whale Example 2 (both scopes ``total_gpu``) is the case of one group;
* else every TaskGraph takes its devices from the start of the list.

Sharing is forced by ``cluster.colocate_split_and_replicate``: every TaskGraph
from the start; with V ``virtual_stages`` (interleaved pipelines, Narayanan
et al. SC'21 §2.2) the n TaskGraphs, all asking for the same d, are dealt to
G = n / V groups of d devices round-robin: TaskGraph i takes group ``i % G``. When K is a multiple of the devices one model copy uses, the
whole model is replicated ``K // used`` times (nested data parallelism) on
the following devices; otherwise the devices past ``used`` stay idle.
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
                   share: bool = False, virtual_stages: int = 1) -> DeviceAssignment:
    """Map TaskGraph device requests onto ``devices``.

    Args:
      requests: (TaskGraph name, device_count or None for all devices) per TaskGraph.
      devices: available device names, in order.
      share: ``cluster.colocate_split_and_replicate``: TaskGraphs share devices.
      virtual_stages: ``pipeline.virtual_stages``: TaskGraphs per device group.

    Raises:
      AnnotationError: a request is not a positive int or exceeds the devices,
        or virtual stages do not deal evenly.
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
    if virtual_stages > 1:
        used, starts = _interleaved(requests, counts, k, virtual_stages)
    elif share or sum(counts) <= k or len(set(counts)) > 1:
        shared = share or sum(counts) > k
        used = max(counts) if shared else sum(counts)
        starts = [0 if shared else sum(counts[:i]) for i in range(len(counts))]
    else:  # consecutive TaskGraphs share groups of counts[0] devices
        groups = k // counts[0]
        used = groups * counts[0]
        starts = [i * groups // len(counts) * counts[0] for i in range(len(counts))]
    nested = k // used if k % used == 0 else 1
    per_tg = tuple(tuple(tuple(devices[j * used + start: j * used + start + count])
                         for j in range(nested)) for start, count in zip(starts, counts))
    return DeviceAssignment(nested_dp=nested, virtual_devices=per_tg)


def _interleaved(requests, counts, k: int, virtual_stages: int):
    """(devices used, first device of each TaskGraph) of TaskGraphs dealt
    round-robin to groups of their device count."""
    groups = len(counts) // virtual_stages
    if len(counts) % virtual_stages or len(set(counts)) > 1 or groups * counts[0] > k:
        raise AnnotationError(
            f"pipeline.virtual_stages {virtual_stages}: the TaskGraphs "
            f"({', '.join(f'{name!r}: {c}' for (name, _), c in zip(requests, counts))}) must ask "
            f"for the same devices each and be a multiple of {virtual_stages} in number, "
            f"{virtual_stages} per group of devices, within the {k} devices")
    return groups * counts[0], [i % groups * counts[0] for i in range(len(counts))]
