"""``tfpar launch``: run one script as N local workers of a TF_CONFIG cluster.

Each worker gets free localhost ports in its ``TF_CONFIG`` (and
``TFPAR_CLUSTER_NUM_DEVICES`` when ``--devices-per-worker`` is given). Output
lines are prefixed with the worker index. The launch ends when the chief ends
(the chief releases the other workers at exit; stragglers are stopped after a
grace period) or when any worker fails: then the rest are stopped, their output
from then on dropped (consequences, not causes), and the launch ends with a
summary of the failing worker's error; its exit code is returned, unless
``max_restarts`` allows starting every worker again (the script resumes from
its own checkpoint). Workers run in a network namespace of their own where the
OS allows (``netns``), and end with the launcher, even when it is killed.
``hosts_commands`` prints what to run on real hosts instead.
"""
import collections
import contextlib
import ctypes
import ctypes.util
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

from tfpar.runtime import netns

__all__ = ["NETWORKS", "hosts_commands", "launch", "tf_config"]

NETWORKS = ("auto", "private", "host")

GRACE_S = 30.0  # workers still running this long after the chief's success are stopped
STOP_S = 5.0  # a stopped worker gets SIGTERM, then SIGKILL after this
PORT_RETRIES = 3  # launches started again because a worker's port was taken
_PORT_TAKEN = "Could not start gRPC server"  # TensorFlow's error when the bind fails
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

    def lost_its_port(self) -> bool:
        """Whether its gRPC server could not bind its port: on the host's
        network another process may take a free port between ``_free_ports``
        and the worker's bind (in a private namespace nothing else binds)."""
        return any(_PORT_TAKEN in line for line in self.lines)

    def summary(self) -> str:
        """How it failed, then its error lines: the launch's last lines."""
        code = self.proc.returncode
        how = (f"exit code {code}" if code > 0
               else f"signal {-code} ({signal.Signals(-code).name})")
        role = " (chief)" if self.index == 0 else ""
        return "".join([f"tfpar launch: worker {self.index}{role} failed with {how}:\n"] +
                       [f"[worker {self.index}] {line}\n" for line in self.error_lines()])


def launch(workers: int, script: str, args: Sequence[str], devices_per_worker: Optional[int] = None,
           out=None, network: str = "auto", max_restarts: int = 0) -> int:
    """Run ``script args`` as ``workers`` local workers; returns the exit code.

    ``network``: ``private``, a network namespace of their own (loopback only;
    this process moves into it), or exit code 2 when the OS refuses one;
    ``host``, this host's network; ``auto``, private where the OS allows it,
    else the host's, saying why. ``max_restarts``: after a worker fails, stop
    every worker and start them all again, at most this many times."""
    out = out or sys.stdout
    if not _network(network, out):
        return 2
    with _stopped_by_signals():
        attempt, port_retries = 0, 0
        while True:
            failed = _attempt(workers, script, args, devices_per_worker, out)
            if failed is None:
                return 0
            out.write(failed.summary())
            if failed.lost_its_port() and port_retries < PORT_RETRIES:
                port_retries += 1
                out.write(f"tfpar launch: worker {failed.index} could not listen on its port "
                          f"(another process took it after the launcher chose it): every worker "
                          f"starts again on fresh ports (retry {port_retries} of {PORT_RETRIES}, "
                          f"not counted as a restart)\n")
            elif attempt < max_restarts:
                attempt += 1
                out.write(f"tfpar launch: restarting every worker (restart {attempt} of "
                          f"{max_restarts})\n")
            else:
                out.flush()
                return failed.proc.returncode
            out.flush()


def _network(network: str, out) -> bool:
    """Give the workers the network asked for; False (said) when it cannot."""
    if network == "host":
        return True
    why = netns.enter_private_network()
    if why is None:
        out.write("tfpar launch: the workers share a network namespace of their own (loopback "
                  "only): nothing outside this launch can reach their gRPC servers, and they "
                  "reach no other host (--network host gives them this host's network)\n")
    elif network == "private":
        out.write(f"tfpar launch: --network private: cannot give the workers a network of their "
                  f"own: {why}\n")
        return False
    else:
        out.write(f"tfpar launch: the workers use this host's network, where their gRPC servers "
                  f"are open to anyone who reaches this host: a private one was refused: {why}\n")
    out.flush()
    return True


def _attempt(workers: int, script: str, args: Sequence[str], devices_per_worker: Optional[int],
             out) -> Optional[_Worker]:
    """Start every worker on fresh ports and wait: the first to fail, or None."""
    addresses = [f"127.0.0.1:{p}" for p in _free_ports(workers)]
    procs, before_script = [], _die_with(os.getpid())
    for i in range(workers):
        env: Dict[str, str] = dict(os.environ, TF_CONFIG=tf_config(addresses, i))
        if devices_per_worker is not None:
            env["TFPAR_CLUSTER_NUM_DEVICES"] = str(devices_per_worker)
        procs.append(subprocess.Popen([sys.executable, script, *args], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      preexec_fn=before_script))
    lock = threading.Lock()  # pumps start once every worker is forked (see _die_with)
    started = [_Worker(i, proc, out, lock) for i, proc in enumerate(procs)]
    try:
        return _wait(started)
    finally:
        _stop([w for w in started if w.proc.poll() is None], lock)
        for worker in started:
            worker.pump.join(timeout=5)


def _die_with(parent: int):
    """What a worker runs before its script: it gets SIGTERM when the launcher
    ends, even killed (Linux's PR_SET_PDEATHSIG; elsewhere nothing). Runs
    between fork and exec, so the launcher forks before its pumps start."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).prctl
    pr_set_pdeathsig = 1

    def child():
        prctl(pr_set_pdeathsig, signal.SIGTERM)
        if os.getppid() != parent:  # the launcher ended before prctl
            os._exit(1)  # pylint: disable=protected-access
    return child


@contextlib.contextmanager
def _stopped_by_signals():
    """SIGTERM and SIGHUP end the launch as Ctrl-C does: the workers are
    stopped (``_attempt``'s ``finally``) and the exit code is 128 + the signal."""
    def end(signum, _frame):
        raise SystemExit(128 + signum)
    previous = {sig: signal.signal(sig, end) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


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
