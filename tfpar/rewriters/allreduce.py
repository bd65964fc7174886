"""Summing (dense) and gathering (sparse) gradients across replicas.

Two reducers with one interface (``sum``, ``gather``):

* ``CollectiveReducer``: TF collectives. Each bucket concatenates the flattened
  gradients of one dtype, up to ``fusion_bytes``, and runs one
  ``CollectiveReduceV2`` per replica (ring on CPU, NCCL hint on GPU); buckets run
  in the same order on every device. Works across processes.
* ``LocalReducer``: ``AddN`` / ``ConcatV2`` on the first replica's device, read
  by every replica. Only for replicas that are CPU devices of one process: they
  share one address space, so a cross-device read hands over a buffer, a ring
  only adds synchronisation, and the replicas can share one copy of each
  variable, updated once per step (``mirrors_variables`` is False).

``make_reducer`` picks one from ``communication.backend``.
"""
import dataclasses
from typing import List, Sequence

from tfpar.compat.tf import array_ops, collective_ops, device_lib, math_ops, ops, tensor_lib

__all__ = ["CollectiveKeys", "CollectiveReducer", "LocalReducer", "bucketize",
           "communication_hint", "make_reducer"]


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


# ``per_replica[r][i]`` is tensor i of replica r; results are indexed the same way.
PerReplica = Sequence[Sequence[tensor_lib.Tensor]]


def make_reducer(backend: str, devices: Sequence[str], device_type: str, keys: CollectiveKeys,
                 fusion_bytes: float, timeout_s: float):
    """The reducer for ``communication.backend``: "auto" is local for CPU
    devices of one process, collective otherwise; "collective" always collective."""
    if backend == "auto" and device_type.upper() == "CPU" and _one_process(devices):
        return LocalReducer(list(devices))
    return CollectiveReducer(list(devices), keys, fusion_bytes,
                             communication_hint(device_type), timeout_s)


def _one_process(devices: Sequence[str]) -> bool:
    tasks = {device_lib.DeviceSpec.from_string(d).replace(device_type=None, device_index=None)
             .to_string() for d in devices}
    return len(tasks) == 1


@dataclasses.dataclass
class LocalReducer:
    """Sum / concatenate on ``devices[0]``; every replica reads the one result."""

    devices: List[str]
    mirrors_variables = False

    def sum(self, per_replica: PerReplica) -> List[List[tensor_lib.Tensor]]:
        with ops.device(self.devices[0]):
            sums = [math_ops.add_n(list(ts)) for ts in zip(*per_replica)]
        return [sums for _ in self.devices]

    def gather(self, per_replica: PerReplica) -> List[List[tensor_lib.Tensor]]:
        with ops.device(self.devices[0]):
            joined = [array_ops.concat(list(ts), 0) for ts in zip(*per_replica)]
        return [joined for _ in self.devices]


@dataclasses.dataclass
class CollectiveReducer:
    """Fused ``CollectiveReduceV2`` sums and ``CollectiveGatherV2`` gathers.

    Reading any result runs every replica's collective, so a partial fetch
    cannot leave a collective waiting for its peers."""

    devices: List[str]
    keys: CollectiveKeys
    fusion_bytes: float
    hint: str
    timeout_s: float
    mirrors_variables = True

    def sum(self, per_replica: PerReplica) -> List[List[tensor_lib.Tensor]]:
        n = len(self.devices)
        first = per_replica[0]
        buckets = bucketize([_num_bytes(t) for t in first], [t.dtype for t in first],
                            self.fusion_bytes)
        group_key = self.keys.group()
        result = [[None] * len(first) for _ in range(n)]
        for bucket in buckets:
            instance_key = self.keys.instance()
            reduced = []
            for r, device in enumerate(self.devices):
                with ops.device(device):
                    parts = [array_ops.reshape(per_replica[r][i], [-1]) for i in bucket]
                    flat = parts[0] if len(parts) == 1 else array_ops.concat(parts, 0)
                    reduced.append(self._launch(device, lambda x: collective_ops.all_reduce_v2(
                        x, group_size=n, group_key=group_key, instance_key=instance_key,
                        merge_op="Add", final_op="Id", communication_hint=self.hint,
                        timeout=self.timeout_s), flat))
            for r, device in enumerate(self.devices):
                with ops.device(device), ops.control_dependencies([t.op for t in reduced]):
                    flat = array_ops.identity(reduced[r])
                    pieces = array_ops.split(
                        flat, [_num_elements(per_replica[r][i]) for i in bucket]) \
                        if len(bucket) > 1 else [flat]
                    for i, piece in zip(bucket, pieces):
                        result[r][i] = array_ops.reshape(piece, array_ops.shape(per_replica[r][i]))
        return result

    def gather(self, per_replica: PerReplica) -> List[List[tensor_lib.Tensor]]:
        n = len(self.devices)
        group_key = self.keys.group()
        result = [[] for _ in range(n)]
        for i in range(len(per_replica[0])):
            instance_key = self.keys.instance()
            for r, device in enumerate(self.devices):
                with ops.device(device):
                    result[r].append(self._launch(device, lambda x: collective_ops.all_gather_v2(
                        x, group_size=n, group_key=group_key, instance_key=instance_key,
                        communication_hint=self.hint, timeout=self.timeout_s),
                        per_replica[r][i]))
        return result

    def _launch(self, device: str, collective, x: tensor_lib.Tensor) -> tensor_lib.Tensor:
        """Build ``collective(x)`` after the previous collective on ``device``."""
        with self.keys.after_previous(device):
            out = collective(x)
        self.keys.launched(device, out.op)
        return out


def _num_elements(t: tensor_lib.Tensor) -> int:
    if not t.shape.is_fully_defined():
        raise ValueError(f"tfpar: gradient {t.name} has unknown shape {t.shape}; "
                         "all-reduce needs static gradient shapes")
    return t.shape.num_elements()


def _num_bytes(t: tensor_lib.Tensor) -> int:
    return _num_elements(t) * t.dtype.size
