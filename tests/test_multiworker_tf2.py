"""TF2 scripts across processes (issue 61): a ``tf.function`` loop and Keras
``fit`` on two ``tfpar launch`` workers (TF_CONFIG; the chief's eager context
reaches the other's devices) and under ``horovodrun`` (every process its
rank's share, gradients summed by Horovod, variables from rank 0), each
compared with one device on every logged value and every variable, with the
proof that the step ran on every process's devices. Real processes on
localhost, each with a timeout; marked slow (CI runs them)."""
import functools
import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from test_faults import read_until
from test_multiworker import launch
import warm_python

pytestmark = pytest.mark.slow
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "multiworker_tf2_script.py")


def worker_devices(task: int, count: int) -> list:
    return [f"/job:worker/replica:0/task:{task}/device:CPU:{i}" for i in range(count)]


@functools.lru_cache(maxsize=None)
def plain(mode: str, directory: str) -> dict:
    """The script on one device, without tfpar (``loop`` for a pipeline)."""
    out = os.path.join(directory, f"plain_{mode}.npz")
    done = warm_python.run([sys.executable, SCRIPT, out, "--mode",
                            "loop" if mode == "pipeline" else mode, "--plain"],
                           capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return dict(np.load(out, allow_pickle=True))


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("plain"))
    return lambda mode: plain(mode, directory)


def assert_one_devices_numbers(reference: dict, got: dict) -> None:
    np.testing.assert_allclose(got["logged"], reference["logged"], rtol=1e-5, atol=1e-6,
                               err_msg="a logged value differs")
    names = sorted(k for k in reference if k.startswith("v"))
    assert names == sorted(k for k in got if k.startswith("v")), "different variables"
    for name in names:
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-4, atol=1e-6,
                                   err_msg=f"variable {name} differs")


def saved(path) -> dict:
    return dict(np.load(path, allow_pickle=True))


@pytest.mark.parametrize("mode", ["loop", "fit"])
def test_a_tf2_script_on_two_workers_matches_one_device(mode, references, tmp_path):
    """Before: the step trained on the chief's 2 devices alone, saying the eager
    context had 2 devices and asking for wh.init() first, which it was."""
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--mode", mode, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = saved(tmp_path / "out.npz")
    assert_one_devices_numbers(references(mode), got)
    every = worker_devices(0, 2) + worker_devices(1, 2)
    assert sorted(got["planned"]) == every, got["planned"]
    assert set(every) <= set(got["devices"]), f"the step ran on {got['devices']} only"


@pytest.mark.parametrize("mode", ["pipeline", "split"])
def test_tf2_stages_and_shards_on_two_workers(mode, references, tmp_path):
    """A 2-stage pipeline (2 micro-batches) with a stage per worker; a split
    head with a shard per worker (its weights compared whole)."""
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--mode", mode, devices=1, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = saved(tmp_path / "out.npz")
    assert_one_devices_numbers(references(mode), got)
    assert set(worker_devices(0, 1) + worker_devices(1, 1)) <= set(got["devices"])


def test_a_tf2_checkpoint_of_two_workers_restores_on_one_device(tmp_path):
    """The variables stay the chief's: its tf.train.Checkpoint restores into a
    plain model (the plain script resumes from it with nothing left to run)."""
    ckpt = str(tmp_path / "ckpt")
    out = launch(SCRIPT, str(tmp_path / "out.npz"), "--checkpoint-dir", ckpt, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    restored = tmp_path / "restored.npz"
    done = warm_python.run([sys.executable, SCRIPT, str(restored), "--plain",
                            "--checkpoint-dir", ckpt], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got, back = saved(tmp_path / "out.npz"), saved(restored)
    for name in ("v0", "v1", "v2", "v3"):  # the model's (the optimizer makes slots at a step)
        np.testing.assert_allclose(back[name], got[name], rtol=1e-6, err_msg=name)


def test_a_restarted_tf2_launch_ends_as_an_uninterrupted_run(references, tmp_path):
    """A worker killed (SIGKILL) after step 2 of 6: `tfpar launch --max-restarts
    1` starts both again, the script resumes from its last checkpoint (one per
    step), and every loss printed and the final variables are one device's."""
    out = tmp_path / "out.npz"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tfpar.cli", "launch", "--workers", "2", "--devices-per-worker",
         "2", "--max-restarts", "1", SCRIPT, str(out), "--checkpoint-dir", str(tmp_path / "ckpt"),
         "--sleep", "0.5"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)
    try:
        seen = []
        read_until(proc.stdout, "[worker 0] step 2 ", seen)
        pid = next(int(line.split()[-1]) for line in seen if line.startswith("[worker 1] pid"))
        os.kill(pid, signal.SIGKILL)
        text = "".join(seen) + proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, text[-3000:]
    assert "tfpar launch: restarting every worker (restart 1 of 1)\n" in text
    reference = references("loop")
    losses = reference["logged"][0::2]
    printed = [line.split()[3:6:2] for line in text.splitlines()
               if line.startswith("[worker 0] step ")]
    assert sorted({int(step) for step, _ in printed}) == list(range(1, 7)), printed
    for step, loss in printed:
        np.testing.assert_allclose(float(loss), losses[int(step) - 1], rtol=1e-5)
    got = saved(out)
    for name in (k for k in reference if k.startswith("v")):
        np.testing.assert_allclose(got[name], reference[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def horovodrun(*args, tmp_path):
    runner = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(runner):
        pytest.fail("Horovod is not installed: `make test` builds it (`make horovod`)")
    out = tmp_path / "out"
    done = subprocess.run([runner, "-np", "2", "-H", "localhost:2", "--gloo", sys.executable,
                           SCRIPT, str(out), "--horovod", *args],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [saved(f"{out}.rank{rank}.npz") for rank in (0, 1)]


@pytest.mark.horovod
@pytest.mark.parametrize("mode,extra", [("loop", ("--seed-per-rank",)), ("fit", ()),
                                        ("shards", ())],
                         ids=["loop_seed_per_rank", "fit", "shard_dataset"])
def test_a_tf2_script_under_horovod_matches_one_device(mode, extra, references, tmp_path):
    """Before: gradients were summed within each process only (fit: 2.0633
    where one device logs 1.9226), silently. ``shard_dataset``: each process
    reads alternate 4-row batches, one device 8-row ones; ``seed_per_rank``:
    the ranks initialize differently (rank 0 as one device), and take rank
    0's variables."""
    for got in horovodrun("--mode", mode, *extra, tmp_path=tmp_path):
        assert_one_devices_numbers(references(mode), got)
        assert sorted(got["planned"]) == sorted(got["devices"]) == [
            f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (0, 1)], got["devices"]
