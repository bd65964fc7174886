"""``tfpar launch``: run one script as N local workers of a TF_CONFIG cluster.

Each worker gets free localhost ports in its ``TF_CONFIG`` (and
``TFPAR_CLUSTER_NUM_DEVICES`` when ``--devices-per-worker`` is given). Output
lines are prefixed with the worker index. The launch ends when the chief ends
(the chief releases the other workers at exit; stragglers are stopped after a
grace period) or when any worker fails: then the rest are killed and its exit
code returned. ``hosts_commands`` prints what to run on real hosts instead.
"""
import json
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence

__all__ = ["hosts_commands", "launch", "tf_config"]

GRACE_S = 30.0


def tf_config(workers: Sequence[str], index: int) -> str:
    return json.dumps({"cluster": {"worker": list(workers)},
                       "task": {"type": "worker", "index": index}})


def hosts_commands(hosts: Sequence[str], port: int, script: str, args: Sequence[str]) -> str:
    """The command to run on each host of a real cluster."""
    workers = [f"{h}:{port}" for h in hosts]
    quoted = " ".join([script, *args])
    return "\n".join(f"# on {host}\nTF_CONFIG='{tf_config(workers, i)}' python {quoted}"
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


def _pump(index: int, stream, out) -> None:
    for line in iter(stream.readline, ""):
        out.write(f"[worker {index}] {line}")
        out.flush()


def launch(workers: int, script: str, args: Sequence[str], devices_per_worker: Optional[int] = None,
           out=None) -> int:
    """Run ``script args`` as ``workers`` local workers; returns the exit code."""
    out = out or sys.stdout
    addresses = [f"127.0.0.1:{p}" for p in _free_ports(workers)]
    processes: List[subprocess.Popen] = []
    pumps = []
    for i in range(workers):
        env: Dict[str, str] = dict(os.environ, TF_CONFIG=tf_config(addresses, i))
        if devices_per_worker is not None:
            env["TFPAR_CLUSTER_NUM_DEVICES"] = str(devices_per_worker)
        proc = subprocess.Popen([sys.executable, script, *args], env=env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        processes.append(proc)
        pumps.append(threading.Thread(target=_pump, args=(i, proc.stdout, out), daemon=True))
        pumps[-1].start()
    try:
        return _wait(processes)
    finally:
        for proc in processes:
            if proc.poll() is None:
                proc.kill()
        for pump in pumps:
            pump.join(timeout=5)


def _wait(processes: List[subprocess.Popen]) -> int:
    """First failure wins; else the chief's success, once the rest have ended
    (or the grace period is over)."""
    chief_done = None
    while True:
        codes = [p.poll() for p in processes]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            return failed[0]
        if codes[0] == 0:
            chief_done = chief_done or time.monotonic()
            if all(c is not None for c in codes) or time.monotonic() - chief_done > GRACE_S:
                return 0
        time.sleep(0.1)
