"""Faults of multi-worker runs: processes lost, stopped or killed, and launches
restarted from checkpoints. Real processes on localhost (TF_CONFIG, gRPC),
each wait bounded; marked slow (CI runs them)."""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from equivalence import assert_equivalent, make_data, mlp_classifier, train
from test_multiworker import results
from tfpar.runtime.launcher import _free_ports, tf_config

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "multiworker_script.py")
DATA = make_data(steps=4, batch=8)  # multiworker_script.py's


class Processes:
    """Processes started by a test, each killed at its end if still running."""

    def __init__(self):
        self.started = []

    def start(self, command, **kwargs):
        proc = subprocess.Popen(command, text=True, start_new_session=True, **kwargs)
        self.started.append(proc)
        return proc

    def kill_all(self):
        for proc in self.started:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.fixture
def processes():
    started = Processes()
    yield started
    started.kill_all()


def read_until(stream, prefix, seen=None):
    """Lines of ``stream`` up to the first starting with ``prefix`` (returned)."""
    for line in stream:
        if seen is not None:
            seen.append(line)
        if line.startswith(prefix):
            return line
    raise AssertionError(f"the stream ended before a line starting with {prefix!r}")


def cluster(processes, tmp_path, timeout_s, chief_args=()):
    """A chief and a worker of a 2-worker TF_CONFIG cluster (1 device each)
    running the test script, the chief with ``chief_args``: (chief, worker,
    addresses)."""
    addresses = [f"127.0.0.1:{p}" for p in _free_ports(2)]
    env = dict(os.environ, TFPAR_COMMUNICATION_TIMEOUT_S=str(timeout_s),
               TFPAR_CLUSTER_NUM_DEVICES="1")
    worker = processes.start([sys.executable, SCRIPT, str(tmp_path / "w.npz")],
                             env=dict(env, TF_CONFIG=tf_config(addresses, 1)),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    chief = processes.start([sys.executable, SCRIPT, str(tmp_path / "c.npz"), *chief_args],
                            env=dict(env, TF_CONFIG=tf_config(addresses, 0)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    return chief, worker, addresses


@pytest.mark.parametrize("victim,sig,timeout_s,said", [
    ("chief", signal.SIGKILL, 5, "ClusterError: tfpar: the chief /job:worker/task:0 ({0}) is "
                                 "unreachable for 5 s: worker /job:worker/task:1 exits"),
    ("worker", signal.SIGSTOP, 3, "ClusterError: tfpar: worker /job:worker/task:1 ({1}) is not "
                                  "responding within 2 s (its process is stopped or hung)"),
], ids=["chief-killed", "worker-stopped"])
def test_a_lost_peer_is_named_in_time(victim, sig, timeout_s, said, processes, tmp_path):
    """After step 2 of 200: the chief killed (no release at its exit): the
    other worker, which only serves, exits naming it once its port has
    refused connections for communication.timeout_s (it served forever); a
    worker stopped (SIGSTOP: its port still accepts connections, nothing
    answers): the chief's step fails at its deadline naming it (it was
    TensorFlow's DeadlineExceededError, naming no one)."""
    chief, worker, addresses = cluster(processes, tmp_path, timeout_s,
                                       ["--steps", "200", "--sleep", "0.2"])
    read_until(chief.stdout, "step 2 ")
    (chief if victim == "chief" else worker).send_signal(sig)
    hit = time.monotonic()
    other = worker if victim == "chief" else chief
    _, stderr = other.communicate(timeout=90)
    assert other.returncode == 1, stderr[-2000:]
    assert said.format(*addresses) in stderr, stderr[-2000:]
    assert time.monotonic() - hit < 30


def test_a_run_longer_than_the_timeout_keeps_its_workers(processes, tmp_path):
    """communication.timeout_s bounds each step, not the run: a worker serves
    for as long as the chief trains (it left after timeout_s, waiting for its
    release under the server's deadline, and the chief's next step failed)."""
    chief, worker, _ = cluster(processes, tmp_path, 3, ["--steps", "25", "--sleep", "0.2"])
    _, stderr = chief.communicate(timeout=120)
    assert chief.returncode == 0, stderr[-2000:]
    _, stderr = worker.communicate(timeout=60)
    assert worker.returncode == 0, stderr[-2000:]


def _running(pid):
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in "ZX"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_worker_outlives_its_launcher(sig, processes, tmp_path):
    """The launcher stopped (SIGTERM: it stops its workers and exits 128 + 15)
    or killed (SIGKILL: each worker gets SIGTERM from the kernel): no worker
    is left running (they ran on, orphaned)."""
    script = tmp_path / "sleeper.py"
    script.write_text("import os, time\nprint('pid', os.getpid(), flush=True)\ntime.sleep(120)\n")
    launch = processes.start([sys.executable, "-m", "tfpar.cli", "launch", "--workers", "2",
                              str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen, pids = [], []
    while len(pids) < 2:
        pids.append(int(read_until(launch.stdout, "[worker ", seen).split()[-1]))
    launch.send_signal(sig)
    assert launch.wait(timeout=60) == (128 + sig if sig == signal.SIGTERM else -sig)
    deadline = time.monotonic() + 20
    while any(map(_running, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [pid for pid in pids if _running(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "".join(seen)


@pytest.mark.parametrize("victim", [1, 0], ids=["worker", "chief"])
def test_a_restarted_launch_ends_as_an_uninterrupted_run(victim, processes, tmp_path):
    """A worker, or the chief, killed (SIGKILL) after step 1 of 4: `tfpar launch
    --max-restarts 1` stops the other, starts both again, and the script
    resumes from its last checkpoint (it saves one every step and feeds each
    step the batch of its global step): every step printed, repeated or not,
    has the loss of that step on one device, and the final variables are
    those of 4 uninterrupted steps on one device."""
    out, ckpt = tmp_path / "out.npz", tmp_path / "ckpt"
    launch = processes.start(
        [sys.executable, "-m", "tfpar.cli", "launch", "--workers", "2", "--devices-per-worker",
         "2", "--max-restarts", "1", SCRIPT, str(out), "--checkpoint-dir", str(ckpt),
         "--sleep", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen = []
    read_until(launch.stdout, "[worker 0] step 1 ", seen)
    pids = {int(line[8]): int(line.split()[-1]) for line in seen if " pid " in line}
    os.kill(pids[victim], signal.SIGKILL)
    text = "".join(seen) + launch.communicate(timeout=240)[0]
    assert launch.returncode == 0, text[-3000:]
    role = " (chief)" if victim == 0 else ""
    assert f"tfpar launch: worker {victim}{role} failed with signal 9 (SIGKILL):\n" in text, text[-3000:]
    assert "tfpar launch: restarting every worker (restart 1 of 1)\n" in text
    printed = [line.split()[3:6:2] for line in text.splitlines()
               if line.startswith("[worker 0] step ")]
    reference_losses, reference_values = train(mlp_classifier(), DATA)
    assert sorted({int(step) for step, _ in printed}) == [0, 1, 2, 3], printed
    for step, loss in printed:
        np.testing.assert_allclose(float(loss), reference_losses[int(step)], rtol=1e-5)
    losses, values = results(out)  # the last run's: from its checkpoint's step to the end
    assert_equivalent((reference_losses[-len(losses):], dict(reference_values, global_step=4)),
                      (losses, values), parallel=False)
