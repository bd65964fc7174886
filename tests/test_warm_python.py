"""The suite's warm Python runs (``warm_python.py``) behave as fresh processes."""
import json
import os
import subprocess
import sys
import time

import pytest

import warm_python

PROBE = """\
import atexit, json, os, random, sys
import numpy as np
atexit.register(lambda: print("atexit ran"))
print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "path0": sys.path[0],
                  "name": __name__, "probe": os.environ.get("PROBE"),
                  "random": [random.random(), float(np.random.rand())],
                  "group": os.getpgrp() == os.getpid(),
                  "descriptors": sorted(os.listdir("/proc/self/fd"))}))
sys.stderr.write("to stderr\\n")
os.write(2, b"on the descriptor\\n")
if len(sys.argv) > 1 and sys.argv[1] == "fail":
    def deeper():
        raise ValueError("the run failed")
    deeper()
sys.exit(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
"""


@pytest.fixture(name="probe")
def _probe(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    return str(script)


def _both(args, **kwargs):
    """(cold, warm) runs of the same command."""
    cold = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    return cold, warm_python.run(args, timeout=120, **kwargs)


def _printed(done):
    fields = json.loads(done.stdout.splitlines()[0])
    fields.pop("random")
    return fields


def test_a_warm_script_run_prints_exits_and_sees_what_a_fresh_one_does(probe, tmp_path):
    env = {**os.environ, "PROBE": "yes"}
    cold, warm = _both([sys.executable, probe, "3", "x"], cwd=tmp_path, env=env)
    assert warm.returncode == cold.returncode == 3
    assert _printed(warm) == _printed(cold)
    assert warm.stdout.splitlines()[1:] == cold.stdout.splitlines()[1:] == ["atexit ran"]
    assert warm.stderr.endswith("to stderr\non the descriptor\n")


def test_a_warm_run_fails_with_a_fresh_runs_traceback(probe):
    cold, warm = _both([sys.executable, probe, "fail"])
    assert warm.returncode == cold.returncode == 1
    traceback = warm.stderr[warm.stderr.index("Traceback"):]
    assert traceback == cold.stderr[cold.stderr.index("Traceback"):]
    assert "warm_python" not in traceback and "runpy" not in traceback


def test_code_and_modules_run_as_main(tmp_path):
    code = "import sys, os; print(__name__, sys.argv, repr(sys.path[0]))"
    cold, warm = _both([sys.executable, "-c", code, "a"], cwd=tmp_path)
    assert warm.stdout == cold.stdout == "__main__ ['-c', 'a'] ''\n"
    (tmp_path / "module_probe.py").write_text(code)
    cold, warm = _both([sys.executable, "-m", "module_probe", "b"], cwd=tmp_path)
    assert warm.stdout == cold.stdout


def test_runs_draw_their_own_random_numbers_and_time_out(probe):
    first, second = (warm_python.run([sys.executable, probe]) for _ in range(2))
    assert first.stdout != second.stdout  # the seeds are fresh, not the server's
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        warm_python.run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=1)
    assert time.monotonic() - started < 10


def test_another_import_environment_gets_another_server(probe):
    warm_python.run([sys.executable, probe])
    quiet = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    warm_python.run([sys.executable, probe], env=quiet)
    assert warm_python.import_environment(dict(os.environ)) in warm_python.SERVERS
    assert warm_python.import_environment(quiet) in warm_python.SERVERS
    runtime = {**os.environ, "TF_CONFIG": "{}", "TFPAR_STRICT": "1"}
    assert warm_python.import_environment(runtime) == warm_python.import_environment(
        dict(os.environ))


def test_interpreter_options_start_cold():
    done = warm_python.run([sys.executable, "-S", "-c", "import sys; print('site' in sys.modules)"])
    assert done.stdout == "False\n"


def test_a_server_that_cannot_import_tensorflow_says_why(tmp_path):
    (tmp_path / "tensorflow.py").write_text("raise ImportError('no TensorFlow here')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(RuntimeError, match="(?s)server exited.*no TensorFlow here"):
        warm_python.run([sys.executable, "-c", "print('ran')"], env=env)
