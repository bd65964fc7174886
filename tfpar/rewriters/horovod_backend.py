"""``communication.backend: horovod``: processes started by ``horovodrun``.

Every process is fed the global batch and keeps its share (``batch_split``
``share``), weighted as a share of the global batch; with ``io.shard_dataset``
every process reads its own shard of the data instead and its rows are
weighted by the rows of all processes together. Gradients are summed
within the process by the local reducer, then across processes with
``hvd.allreduce`` (IndexedSlices: ``hvd.allgather``). Fetched tensors are
completed across processes (rows gathered in rank order, partial means summed),
and every write of a variable outside training (initializer, restore) is
followed by a broadcast from rank 0, so processes never diverge.
"""
from typing import List, Sequence, Tuple

__all__ = ["HorovodProcesses", "HorovodReducer"]


def _hvd():
    import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    return hvd


class HorovodProcesses:
    """This process's place in the Horovod job, and the cross-process ops."""

    def __init__(self, shard_dataset: bool = False) -> None:
        hvd = _hvd()
        self.rank, self.size = hvd.rank(), hvd.size()
        self.shard_dataset = shard_dataset

    @property
    def share(self) -> Tuple[int, int]:
        """(part, parts) of the fed batch this process keeps."""
        return (0, 1) if self.shard_dataset else (self.rank, self.size)

    def global_rows(self):
        """Local rows -> global rows, when each process reads its own data."""
        return self.sum if self.shard_dataset else None

    @staticmethod
    def gather(t):
        return _hvd().allgather(t)

    @staticmethod
    def sum(t):
        return _hvd().allreduce(t, op=_hvd().Sum)

    @staticmethod
    def broadcast(t):
        return _hvd().broadcast(t, root_rank=0)

    @staticmethod
    def broadcast_variables(variables) -> None:
        """Set ``variables`` (eager ones) to rank 0's values, in every process."""
        _hvd().broadcast_variables(list(variables), root_rank=0)


class HorovodReducer:
    """The local reducer's sums across this process's devices, then Horovod's
    across processes; every local replica reads the result."""

    cross_process = True

    def __init__(self, local) -> None:
        self.local = local
        self.mirrors_variables = local.mirrors_variables

    def sum(self, per_replica: Sequence[Sequence]) -> List[List]:
        local = self.local.sum(per_replica) if len(per_replica) > 1 else per_replica
        totals = [HorovodProcesses.sum(t) for t in local[0]]
        return [totals for _ in per_replica]

    def gather(self, per_replica: Sequence[Sequence]) -> List[List]:
        local = self.local.gather(per_replica) if len(per_replica) > 1 else per_replica
        gathered = [HorovodProcesses.gather(t) for t in local[0]]
        return [gathered for _ in per_replica]
