"""Multi-worker clusters: real processes on localhost (TF_CONFIG, gRPC servers),
each with a timeout. Marked slow (CI runs them; `make test-fast` skips them)."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from equivalence import assert_equivalent, checkpoint_session, make_data, mlp_classifier, train

import tfpar as wh
from tfpar.runtime.launcher import hosts_commands, tf_config

pytestmark = pytest.mark.slow
HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "multiworker_script.py")
DATA = make_data(steps=4, batch=8)


def launch(*args, devices=2, timeout=240, env=None):
    """``tfpar launch`` of 2 workers; on a timeout the launcher and its workers
    (one process group) are killed, none left running."""
    command = [sys.executable, "-m", "tfpar.cli", "launch", "--workers", "2",
               "--devices-per-worker", str(devices), *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def results(path):
    """(losses, variables) a script saved after proving its plan ran
    (``proof.assert_parallel`` in the script's own process): its numbers are
    compared with ``parallel=False`` here."""
    saved = np.load(path)
    assert "plan_ran" in saved.files, f"{path} holds no proof that the plan ran"
    return saved["losses"], {k.replace("|", "/"): saved[k] for k in saved.files
                             if k not in ("losses", "plan_ran")}


@pytest.mark.parametrize("mode", ["dp", "dp-data"])
def test_data_parallel_on_two_workers_matches_one_device(mode, tmp_path):
    """2 workers x 2 logical devices: 4 replicas across processes, collectives over
    gRPC; every step equals single-device training on the global batch."""
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--mode", mode)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "[worker 0] step 3" in out.stdout
    reference = train(mlp_classifier(), DATA, use_dataset=mode == "dp-data")
    assert_equivalent(reference, results(tmp_path / "out.npz"), parallel=False)


@pytest.mark.parametrize("mode", ["pipeline", "split"])
def test_stages_and_shards_on_different_workers(mode, tmp_path):
    """A 2-stage pipeline with one stage per worker; a split head with one shard
    per worker."""
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--mode", mode, devices=1)
    assert out.returncode == 0, out.stdout[-3000:]
    from multiworker_script import BUILDS
    plain = train(lambda x, y: _unscoped(BUILDS[mode], x, y), DATA)
    assert_equivalent(plain, results(tmp_path / "out.npz"), parallel=False)


def _unscoped(build, x, y):
    """The model without tfpar: scopes become no-ops."""
    originals = wh.replicate, wh.split
    wh.replicate = wh.split = lambda *a, **k: _Null()
    try:
        return build(x, y)
    finally:
        wh.replicate, wh.split = originals


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_checkpoint_written_by_two_workers_restores_on_one_device(tmp_path):
    ckpt = str(tmp_path / "model")
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--save", ckpt)
    assert out.returncode == 0, out.stdout[-3000:]
    _, saved = results(tmp_path / "out.npz")
    _, restored = checkpoint_session(mlp_classifier(), ckpt, None, None, (DATA[0][:0],
                                                                         DATA[1][:0]))
    for name, value in saved.items():
        np.testing.assert_allclose(restored[name], value, rtol=1e-6)


def test_restarted_workers_resume_from_the_last_checkpoint(tmp_path):
    """Two steps, save, stop; restart every worker from the checkpoint for two
    more: the same as four steps on one device."""
    ckpt = str(tmp_path / "model")
    first = launch(SCRIPT, str(tmp_path / "a.npz"), "--steps", "2", "--save", ckpt)
    assert first.returncode == 0, first.stdout[-3000:]
    second = launch(SCRIPT, str(tmp_path / "b.npz"), "--steps", "2", "--restore", ckpt,
                    "--first-step", "2")
    assert second.returncode == 0, second.stdout[-3000:]
    losses_a, _ = results(tmp_path / "a.npz")
    losses_b, values = results(tmp_path / "b.npz")
    assert_equivalent(train(mlp_classifier(), DATA),
                      (np.concatenate([losses_a, losses_b]), values), parallel=False)


def _free_ports(n):
    from tfpar.runtime.launcher import _free_ports
    return _free_ports(n)


def test_each_worker_reads_its_own_shard(tmp_path):
    """io.shard_dataset in a TF_CONFIG cluster: every worker iterates over its
    shard (alternate half batches) on its own CPU; the rows of all workers form
    the global batch, as on one device with whole batches."""
    env = dict(os.environ, TFPAR_IO_SHARD_DATASET="true")
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--mode", "dp-shard", env=env)
    assert out.returncode == 0, out.stdout[-3000:]
    assert_equivalent(train(mlp_classifier(), DATA, use_dataset=True),
                      results(tmp_path / "out.npz"), parallel=False)


def test_a_worker_that_never_starts_is_named_in_time(tmp_path):
    ports = _free_ports(2)
    workers = [f"127.0.0.1:{p}" for p in ports]
    env = dict(os.environ, TF_CONFIG=tf_config(workers, 0), TFPAR_COMMUNICATION_TIMEOUT_S="3")
    start = time.monotonic()
    out = subprocess.run([sys.executable, SCRIPT, str(tmp_path / "out.npz")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "/job:worker/task:1" in out.stderr and "did not start within 3 s" in out.stderr
    assert time.monotonic() - start < 60


def test_a_worker_lost_mid_run_is_named_in_time(tmp_path):
    ports = _free_ports(2)
    workers = [f"127.0.0.1:{p}" for p in ports]
    env = dict(os.environ, TFPAR_COMMUNICATION_TIMEOUT_S="5", TFPAR_CLUSTER_NUM_DEVICES="1")
    worker = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "w.npz")],
                              env=dict(env, TF_CONFIG=tf_config(workers, 1)),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    chief = subprocess.Popen([sys.executable, SCRIPT, str(tmp_path / "c.npz"), "--steps", "200",
                              "--sleep", "0.2"], env=dict(env, TF_CONFIG=tf_config(workers, 0)),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in chief.stdout:
            if line.startswith("step 2 "):
                break
        worker.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = chief.communicate(timeout=120)
        assert chief.returncode != 0
        assert "ClusterError" in stderr and "/job:worker/task:1" in stderr, stderr[-2000:]
        assert time.monotonic() - killed < 60
    finally:
        for proc in (worker, chief):
            if proc.poll() is None:
                proc.kill()


def test_launcher_returns_the_first_failure_and_stops_the_rest(tmp_path):
    script = tmp_path / "fail.py"
    # Worker 1 fails once worker 0 has said hello (output after a failure is dropped).
    script.write_text("import json, os, sys, time\n"
                      "index = json.loads(os.environ['TF_CONFIG'])['task']['index']\n"
                      "print('hello from', index, flush=True)\n"
                      "said = sys.argv[0] + '.said'\n"
                      "if index == 0:\n    open(said, 'w').close()\n    time.sleep(120)\n"
                      "deadline = time.monotonic() + 30\n"
                      "while not os.path.exists(said) and time.monotonic() < deadline:\n"
                      "    time.sleep(0.05)\n"
                      "time.sleep(0.5)\n"
                      "raise SystemExit(3)\n")
    start = time.monotonic()
    out = launch(str(script), timeout=100)
    assert out.returncode == 3
    assert "[worker 1] hello from 1" in out.stdout and "[worker 0] hello from 0" in out.stdout
    assert "tfpar launch: worker 1 failed with exit code 3:" in out.stdout.splitlines()[-2:]
    assert time.monotonic() - start < 60


# Every worker: wh.init (the chief waits for the others, which serve), one step
# on both workers in a session left open (closed as the chief exits), then the
# chief fails if told to, else prints when it ended.
SESSION_SCRIPT = """import sys, time
import tensorflow as tf
import tfpar as wh
v1 = tf.compat.v1
v1.disable_eager_execution()
wh.init({"communication.timeout_s": 20.0})
with tf.device("/job:worker/task:1"):
    x = tf.constant(1.0) + 1.0
sess = v1.Session()
print("result", sess.run(x), flush=True)
if sys.argv[1:] == ["--fail"]:
    raise RuntimeError("boom from the chief")
print("ended at", time.time(), flush=True)
"""


def test_a_failing_chief_is_the_last_thing_printed(tmp_path):
    """The launch ends with the chief's error, not with gRPC errors of the
    shutdown that follows it."""
    script = tmp_path / "session.py"
    script.write_text(SESSION_SCRIPT)
    out = launch(str(script), "--fail", timeout=120)
    assert out.returncode == 1, out.stdout[-3000:]
    last = [line for line in out.stdout.splitlines() if line.strip()][-5:]
    assert last[0] == "tfpar launch: worker 0 (chief) failed with exit code 1:", out.stdout[-3000:]
    assert last[1] == "[worker 0] Traceback (most recent call last):"
    assert last[-1] == "[worker 0] RuntimeError: boom from the chief"
    assert "UNAVAILABLE" not in out.stdout.split("boom from the chief", 1)[1], out.stdout[-3000:]


def test_launches_end_promptly_and_quietly(tmp_path):
    """The chief's sessions to the other workers close before those exit: no
    gRPC UNAVAILABLE errors, no 30 s wait for a session to close."""
    script = tmp_path / "session.py"
    script.write_text(SESSION_SCRIPT)
    for _ in range(3):
        out = launch(str(script), timeout=120)
        shutdown_s = time.time() - float(out.stdout.split("ended at ")[1].split()[0])
        assert out.returncode == 0, out.stdout[-3000:]
        text = out.stdout + out.stderr
        assert "UNAVAILABLE" not in text and "failed to close" not in text, text[-3000:]
        assert shutdown_s < 15, out.stdout[-3000:]


def test_hosts_form_prints_each_hosts_tf_config():
    text = hosts_commands(["a", "b"], 2222, "train.py", ["--x", "1"])
    configs = [json.loads(line.split("'")[1]) for line in text.splitlines()
               if line.startswith("TF_CONFIG")]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    assert configs[0]["cluster"]["worker"] == ["a:2222", "b:2222"]
    assert "train.py --x 1" in text


@pytest.mark.horovod
@pytest.mark.parametrize("mode", ["dp", "dp-data", "dp-shard"])
def test_horovod_backend_on_two_processes(mode, tmp_path):
    """communication.backend 'horovod' under horovodrun (Gloo): every process is
    fed the global batch, keeps its share, all-reduces with Horovod; with
    io.shard_dataset each reads alternate half batches of its own instead."""
    horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.fail("Horovod is not installed: `make test` builds it (`make horovod`)")
    out = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                          SCRIPT, str(tmp_path / "out"), "--mode", mode, "--horovod"],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    reference = train(mlp_classifier(), DATA, use_dataset=mode != "dp")
    for rank in range(2):
        assert_equivalent(reference, results(tmp_path / f"out.rank{rank}.npz"), parallel=False)


def test_single_device_checkpoint_continues_on_two_workers(tmp_path):
    ckpt = str(tmp_path / "single")
    first, _ = checkpoint_session(mlp_classifier(), None, ckpt, None, (DATA[0][:2], DATA[1][:2]))
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--steps", "2", "--restore", ckpt,
                 "--first-step", "2")
    assert out.returncode == 0, out.stdout[-3000:]
    losses, values = results(tmp_path / "out.npz")
    assert_equivalent(train(mlp_classifier(), DATA), (np.concatenate([first, losses]), values),
                      parallel=False)
