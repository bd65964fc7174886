"""``tfpar launch``: run one script as N local workers of a TF_CONFIG cluster.

Each worker gets free localhost ports in its ``TF_CONFIG`` (and
``TFPAR_CLUSTER_NUM_DEVICES`` when ``--devices-per-worker`` is given). Output
lines are prefixed with the worker index. The launch ends when the chief ends
(the chief releases the other workers at exit; stragglers are stopped after a
grace period) or when any worker fails: then the rest are stopped, their output
from then on dropped (consequences, not causes), and the launch ends with a
summary of the failing worker's error; its exit code is returned.
``hosts_commands`` prints what to run on real hosts instead.
"""
import collections
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["hosts_commands", "launch", "tf_config"]

GRACE_S = 30.0  # workers still running this long after the chief's success are stopped
STOP_S = 5.0  # a stopped worker gets SIGTERM, then SIGKILL after this
# TensorFlow's C++ log lines and the lines some add (gRPC errors, the CPU
# banner): not a script's error.
_TF_LOG = re.compile(r'\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IWE] '
                     r'|Additional GRPC error|:\{"created"|To enable the following instructions')


def tf_config(workers: Sequence[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": list(workers)},
                       "task": {"type": "worker", "index": index}})


def hosts_commands(hosts: Sequence[str], port: int, script: str, args: Sequence[str]) -> str:
    """The command to run on each host of a real cluster, every word quoted
    for a POSIX shell (an argument holding a space, a quote or a ``;`` reaches
    the script whole, never the shell)."""
    workers = [f"{h}:{port}" for h in hosts]
    command = shlex.join(["python", script, *args])
    return "\n".join(f"# on {host}\nTF_CONFIG={shlex.quote(tf_config(workers, i))} {command}"
                     for i, host in enumerate(hosts))


def _free_ports(count: int) -> List[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class _Worker:
    """A worker process whose output is printed, prefixed with its index, and
    whose last lines (TensorFlow's log lines aside) are kept, until it is stopped."""

    def __init__(self, index: int, proc: subprocess.Popen, out, lock: threading.Lock):
        self.index, self.proc = index, proc
        self.stopping = False
        self.lines: "collections.deque[str]" = collections.deque(maxlen=200)
        self._out, self._lock = out, lock
        self.pump = threading.Thread(target=self._print, daemon=True)
        self.pump.start()

    def _print(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            with self._lock:
                if self.stopping:
                    continue
                if not _TF_LOG.match(line):
                    self.lines.append(line.rstrip("\n"))
                self._out.write(f"[worker {self.index}] {line}")
                self._out.flush()

    def error_lines(self) -> List[str]:
        """Its last Python traceback, else its last lines."""
        starts = [i for i, line in enumerate(self.lines)
                  if line.startswith("Traceback (most recent call last)")]
        return list(self.lines)[starts[-1] if starts else -10:]

    def summary(self) -> str:
        """How it failed, then its error lines: the launch's last lines."""
        code = self.proc.returncode
        how = f"exit code {code}" if code > 0 else f"signal {-code}"
        role = " (chief)" if self.index == 0 else ""
        return "".join([f"tfpar launch: worker {self.index}{role} failed with {how}:\n"] +
                       [f"[worker {self.index}] {line}\n" for line in self.error_lines()])


def launch(workers: int, script: str, args: Sequence[str], devices_per_worker: Optional[int] = None,
           out=None) -> int:
    """Run ``script args`` as ``workers`` local workers; returns the exit code."""
    out = out or sys.stdout
    addresses = [f"127.0.0.1:{p}" for p in _free_ports(workers)]
    lock = threading.Lock()
    started: List[_Worker] = []
    for i in range(workers):
        env: Dict[str, str] = dict(os.environ, TF_CONFIG=tf_config(addresses, i))
        if devices_per_worker is not None:
            env["TFPAR_CLUSTER_NUM_DEVICES"] = str(devices_per_worker)
        proc = subprocess.Popen([sys.executable, script, *args], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started.append(_Worker(i, proc, out, lock))
    try:
        failed = _wait(started)
    finally:
        _stop([w for w in started if w.proc.poll() is None], lock)
        for worker in started:
            worker.pump.join(timeout=5)
    if failed is None:
        return 0
    out.write(failed.summary())
    out.flush()
    return failed.proc.returncode


def _wait(workers: List[_Worker]) -> Optional[_Worker]:
    """The first worker to fail; None on the chief's success, once the rest have
    ended (or the grace period is over)."""
    chief_done = None
    while True:
        codes = [w.proc.poll() for w in workers]
        failed = [w for w, c in zip(workers, codes) if c not in (None, 0)]
        if failed:
            return failed[0]
        if codes[0] == 0:
            chief_done = chief_done or time.monotonic()
            if all(c is not None for c in codes) or time.monotonic() - chief_done > GRACE_S:
                return None
        time.sleep(0.1)


def _stop(workers: List[_Worker], lock: threading.Lock) -> None:
    """Drop their output from now on, SIGTERM them, SIGKILL those still running
    ``STOP_S`` later."""
    with lock:
        for worker in workers:
            worker.stopping = True
    for worker in workers:
        worker.proc.terminate()
    deadline = time.monotonic() + STOP_S
    for worker in workers:
        try:
            worker.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait()
