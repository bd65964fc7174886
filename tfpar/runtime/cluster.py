"""Multi-worker clusters from ``TF_CONFIG``, on TensorFlow's distributed runtime.

Every worker process runs the same script. ``wh.init`` starts a
``tf.distribute.Server`` for the process's task. The chief (task 0) builds and
runs the whole parallel graph (in-graph replication): its devices span every
worker (``/job:worker/replica:0/task:t/device:...``), data moves over gRPC, and
collectives span processes with task 0 as group leader. The other workers
serve their devices; ``wh.init`` does not return there: released at the
chief's exit, they exit once the chief's process has ended, or with an error
naming the chief when its port has refused connections for
``communication.timeout_s`` (it never started, or died unreleasing them).
Before the chief trains, every worker must answer within
``communication.timeout_s``, and a worker lost later fails the step with an
error naming it, never a hang.
"""
import atexit
import dataclasses
import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Mapping, Optional

from tfpar.cluster.devices import device_names
from tfpar.compat import tf as internals
from tfpar.compat.tf import (config_pb2, data_flow_ops, dtypes, ops, server_lib, tf_errors,
                             tf_session)
from tfpar.errors import ClusterError, ConfigError

log = logging.getLogger("tfpar")

__all__ = ["Cluster", "LOST", "START", "from_tf_config"]

JOB = "worker"
_RELEASE_QUEUE = "tfpar_release"
_GET_STATUS = "/tensorflow.WorkerService/GetStatus"
START = ("start every worker of TF_CONFIG (or use `tfpar launch`), or raise "
         "communication.timeout_s")
LOST = ("restart every worker (`tfpar launch --max-restarts R` does): the chief resumes from "
        "its last checkpoint; or raise communication.timeout_s")
_WATCH_S = 1.0  # how often a worker checks that the chief is up
# The release waits as long as the chief trains: not communication.timeout_s,
# the server's deadline for every other run.
_NO_DEADLINE_MS = 2 ** 40


@dataclasses.dataclass
class Cluster:
    """The workers (``host:port``) and this process's task."""

    workers: List[str]
    task: int
    server: Optional[server_lib.Server] = None

    @property
    def is_chief(self) -> bool:
        return self.task == 0

    def device_names(self, device_type: str, per_worker: int) -> List[str]:
        """Every worker's devices, task-major."""
        return [d for t in range(len(self.workers))
                for d in device_names(device_type, per_worker, job=JOB, task=t)]

    @staticmethod
    def host_cpu(task: int) -> str:
        """The first CPU of worker ``task``."""
        return device_names("CPU", 1, job=JOB, task=task)[0]

    def server_config(self, device_type: str, per_worker: int,
                      timeout_s: float) -> config_pb2.ConfigProto:
        config = config_pb2.ConfigProto(operation_timeout_in_ms=int(timeout_s * 1000))
        if device_type == "CPU":
            config.device_count["CPU"] = per_worker
        config.experimental.collective_group_leader = f"/job:{JOB}/replica:0/task:0"
        return config

    def start(self, config: config_pb2.ConfigProto, timeout_s: float, eager: bool) -> None:
        """Serve this task; on the chief wait for every worker, elsewhere serve
        until released, then exit the process. An ``eager`` chief (a TF2
        script) joins the cluster with its eager context instead of a server
        of its own, so that its tf.functions reach every worker's devices."""
        spec = server_lib.ClusterSpec({JOB: self.workers})
        if self.is_chief and eager:
            self.wait_for_workers(timeout_s)
            internals.connect_eager_to_cluster(spec, JOB, self.task)
            atexit.register(self.release_workers, timeout_s)
            return
        self.server = server_lib.Server(spec, job_name=JOB, task_index=self.task, config=config)
        if self.is_chief:
            self.wait_for_workers(timeout_s)
            atexit.register(self.release_workers, timeout_s)
        else:
            self._serve_until_released(timeout_s)

    @property
    def target(self) -> str:
        """The chief's session target: its server's, or the eager context's."""
        return self.server.target if self.server is not None else f"grpc://{self.workers[0]}"

    def missing_workers(self, timeout_s: float) -> List[int]:
        """Tasks whose server does not accept a connection within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        missing = list(range(1, len(self.workers)))
        while True:
            missing = [t for t in missing if not _reachable(self.workers[t])]
            if not missing or time.monotonic() >= deadline:
                return missing
            time.sleep(0.2)

    def lost_workers(self, timeout_s: float) -> Dict[int, str]:
        """Tasks (the chief aside) whose server does not answer a status request
        within ``timeout_s`` -> what is wrong: nothing listens, or it does not
        answer (its process is stopped or hung, though its port still accepts
        connections)."""
        answers: Dict[int, Optional[str]] = {}
        probes = [threading.Thread(target=lambda t=t: answers.update({t: _status(
            self.workers[t], timeout_s)})) for t in range(1, len(self.workers))]
        for probe in probes:  # threads, not an executor: this also runs at exit
            probe.start()
        for probe in probes:
            probe.join()
        return {t: why for t, why in sorted(answers.items()) if why}

    def wait_for_workers(self, timeout_s: float) -> None:
        missing = self.missing_workers(timeout_s)
        if missing:
            raise ClusterError(self.describe({t: f"did not start within {timeout_s:g} s"
                                              for t in missing}, START))

    def describe(self, why: Dict[int, str], remedy: str) -> str:
        """The error text of workers (task -> what is wrong), then ``remedy``."""
        names = "; ".join(f"worker /job:{JOB}/task:{t} ({self.workers[t]}) {what}"
                          for t, what in sorted(why.items()))
        return f"tfpar: {names}; {remedy}"

    def release_workers(self, timeout_s: float) -> None:
        """Tell every other worker still up that it may exit (best effort, bounded;
        only live workers are contacted: a session to a dead one would wait)."""
        lost = self.lost_workers(timeout_s=2.0)  # a session to a hung one would wait too
        live = [t for t in range(1, len(self.workers)) if t not in lost]
        if not live:
            return
        graph = ops.Graph()
        with graph.as_default():
            ops_ = []
            for t in live:
                with ops.device(self.host_cpu(t)):
                    queue = data_flow_ops.FIFOQueue(1, dtypes.int32, shared_name=_RELEASE_QUEUE)
                    ops_.append(queue.enqueue(0))
            options = config_pb2.RunOptions(timeout_in_ms=int(timeout_s * 1000))
            only_live = config_pb2.ConfigProto(device_filters=[
                f"/job:{JOB}/task:{t}" for t in [0] + live])
            try:
                with tf_session.Session(self.target, graph=graph, config=only_live) as sess:
                    sess.run(ops_, options=options)
            except (tf_errors.UnavailableError, tf_errors.DeadlineExceededError,
                    tf_errors.CancelledError) as gone:
                # A worker went in the meantime: it needs no release, and the
                # others exit by themselves once the chief's port is gone.
                log.info("tfpar: releasing the workers: %s", gone.message.splitlines()[0])

    def _serve_until_released(self, timeout_s: float) -> None:
        graph = ops.Graph()
        with graph.as_default(), ops.device(self.host_cpu(self.task)):
            queue = data_flow_ops.FIFOQueue(1, dtypes.int32, shared_name=_RELEASE_QUEUE)
            release = queue.dequeue()
        # Only this task's devices: contacting a chief that is not up yet would put
        # the channel to it in gRPC's back-off and fail the first step's transfers.
        own = config_pb2.ConfigProto(device_filters=[f"/job:{JOB}/task:{self.task}"])
        released = threading.Event()

        def serve():
            with tf_session.Session(self.server.target, graph=graph, config=own) as sess:
                sess.run(release, options=config_pb2.RunOptions(timeout_in_ms=_NO_DEADLINE_MS))
            released.set()
        threading.Thread(target=serve, daemon=True).start()
        if not self._chief_alive(released, timeout_s):
            sys.stderr.write(f"ClusterError: tfpar: the chief /job:{JOB}/task:0 "
                             f"({self.workers[0]}) is unreachable for {timeout_s:g} s: worker "
                             f"/job:{JOB}/task:{self.task} exits; {LOST}\n")
            self._exit(1)
        # The chief still closes its sessions (the release's, the script's unclosed
        # ones), which call this server: leaving earlier fails those calls (gRPC
        # UNAVAILABLE logs) or even the release step in flight (its session then
        # takes 30 s to close).
        deadline = time.monotonic() + timeout_s
        while _reachable(self.workers[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._exit(0)

    def _chief_alive(self, released: threading.Event, timeout_s: float) -> bool:
        """Wait for the chief's release: False when the chief's port refuses
        connections for ``timeout_s`` in a row first (not started, or gone)."""
        last_seen = time.monotonic()
        while not released.wait(_WATCH_S):
            if _reachable(self.workers[0]):
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen > timeout_s:
                return False
        return True

    @staticmethod
    def _exit(code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # pylint: disable=protected-access  (gRPC server teardown can block)


def _status(address: str, timeout_s: float) -> Optional[str]:
    """None when the TensorFlow server at ``address`` answers a status request
    (``WorkerService.GetStatus``: an empty request, its devices in reply)
    within ``timeout_s``, else what is wrong."""
    import grpc  # pylint: disable=import-outside-toplevel  (TensorFlow's dependency)
    with grpc.insecure_channel(address) as channel:
        try:
            channel.unary_unary(_GET_STATUS)(b"", timeout=timeout_s)
            return None
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return (f"is not responding within {timeout_s:g} s (its process is stopped or "
                        "hung)")
            return "is unreachable"


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


def from_tf_config(environ: Mapping[str, str]) -> Optional[Cluster]:
    """The cluster described by ``TF_CONFIG`` (None when unset or one worker).

    Raises:
      ConfigError: malformed TF_CONFIG, naming what is wrong.
    """
    text = environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        spec = json.loads(text)
        workers = list(spec["cluster"][JOB])
        task = spec.get("task", {})
        index = int(task.get("index", 0))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"TF_CONFIG must be JSON like {{\"cluster\": {{\"worker\": "
                          f"[\"host:port\", ...]}}, \"task\": {{\"type\": \"worker\", "
                          f"\"index\": 0}}}}: {exc}") from exc
    if task.get("type", JOB) != JOB:
        raise ConfigError(f"TF_CONFIG task type '{task.get('type')}': tfpar clusters have only "
                          "'worker' tasks (task 0 is the chief)")
    if not 0 <= index < len(workers):
        raise ConfigError(f"TF_CONFIG task index {index} is not one of the {len(workers)} "
                          "workers")
    if len(workers) < 2:
        return None
    return Cluster(workers=workers, task=index)
