"""Gradient summation across replicas with TF collectives, fused into buckets.

Each bucket concatenates the flattened gradients of one dtype, up to
``fusion_bytes``, and runs one ``CollectiveReduceV2`` per replica (ring on CPU,
NCCL hint on GPU). Buckets run in the same order on every device.
"""
import dataclasses
from typing import List, Sequence

from tensorflow.python.framework import ops
from tensorflow.python.framework import tensor as tensor_lib
from tensorflow.python.ops import array_ops, collective_ops

__all__ = ["CollectiveKeys", "all_reduce_sum", "bucketize", "communication_hint"]


def communication_hint(device_type: str) -> str:
    """NCCL between GPUs, ring everywhere else."""
    return "nccl" if device_type.upper() == "GPU" else "ring"


@dataclasses.dataclass
class CollectiveKeys:
    """Deterministic group / instance keys (same build order -> same keys in
    every process; never Python ``hash``), and the last collective built on each
    device: every collective waits for the previous one on its device, so all
    devices launch them in one order (unordered collectives can deadlock)."""

    next_group: int = 1
    next_instance: int = 1
    last_on_device: dict = dataclasses.field(default_factory=dict)

    def after_previous(self, device: str):
        """Control dependencies that order a new collective on ``device``."""
        last = self.last_on_device.get(device)
        return ops.control_dependencies([last] if last is not None else [])

    def launched(self, device: str, op) -> None:
        self.last_on_device[device] = op

    def group(self) -> int:
        self.next_group += 1
        return self.next_group - 1

    def instance(self) -> int:
        self.next_instance += 1
        return self.next_instance - 1


def bucketize(sizes_bytes: Sequence[int], dtypes_: Sequence, fusion_bytes: float) -> List[List[int]]:
    """Group tensor indices into buckets of one dtype, each at most
    ``fusion_bytes`` (a single larger tensor gets a bucket of its own)."""
    buckets: List[List[int]] = []
    open_by_dtype = {}
    for i, (size, dtype) in enumerate(zip(sizes_bytes, dtypes_)):
        current = open_by_dtype.get(dtype)
        if current is None or current[1] + size > fusion_bytes:
            current = open_by_dtype[dtype] = ([], 0)
            buckets.append(current[0])
        current[0].append(i)
        open_by_dtype[dtype] = (current[0], current[1] + size)
    return buckets


def all_reduce_sum(per_replica: Sequence[Sequence[tensor_lib.Tensor]], devices: Sequence[str],
                   keys: CollectiveKeys, fusion_bytes: float, hint: str,
                   timeout_s: float) -> List[List[tensor_lib.Tensor]]:
    """Sum aligned tensor lists across replicas; every replica gets the sums.

    Args:
      per_replica: ``per_replica[r][i]`` is tensor i of replica r (same shapes).
      devices: device of each replica.

    Returns:
      ``result[r][i]``: the sum over replicas of tensor i, on ``devices[r]``.
      Reading any result runs every replica's collective, so a partial fetch
      cannot leave a collective waiting for its peers.
    """
    n = len(devices)
    first = per_replica[0]
    sizes = [_num_bytes(t) for t in first]
    buckets = bucketize(sizes, [t.dtype for t in first], fusion_bytes)
    group_key = keys.group()
    result = [[None] * len(first) for _ in range(n)]
    for bucket in buckets:
        instance_key = keys.instance()
        reduced = []
        for r, device in enumerate(devices):
            with ops.device(device):
                parts = [array_ops.reshape(per_replica[r][i], [-1]) for i in bucket]
                flat = parts[0] if len(parts) == 1 else array_ops.concat(parts, 0)
                with keys.after_previous(device):
                    reduced.append(collective_ops.all_reduce_v2(
                        flat, group_size=n, group_key=group_key, instance_key=instance_key,
                        merge_op="Add", final_op="Id", communication_hint=hint,
                        timeout=timeout_s))
                keys.launched(device, reduced[-1].op)
        for r, device in enumerate(devices):
            with ops.device(device), ops.control_dependencies([t.op for t in reduced]):
                flat = array_ops.identity(reduced[r])
                pieces = array_ops.split(flat, [_num_elements(per_replica[r][i]) for i in bucket]) \
                    if len(bucket) > 1 else [flat]
                for i, piece in zip(bucket, pieces):
                    result[r][i] = array_ops.reshape(piece, array_ops.shape(per_replica[r][i]))
    return result


def _num_elements(t: tensor_lib.Tensor) -> int:
    if not t.shape.is_fully_defined():
        raise ValueError(f"tfpar: gradient {t.name} has unknown shape {t.shape}; "
                         "all-reduce needs static gradient shapes")
    return t.shape.num_elements()


def _num_bytes(t: tensor_lib.Tensor) -> int:
    return _num_elements(t) * t.dtype.size
