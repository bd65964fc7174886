"""Tied weights across pipeline stages in a TF2 eager script (issue 48 item
6): a Keras ``Embedding`` reused as the output projection, 4 stages on 4
devices, trains with the single-device numbers (every variable, the
optimizer's included) as task functions. Before: the tape's gradient
functions took the shape of a stage's input in the stage before it, the
stages' backward tasks waited on each other, and every micro-batch was a
copy of its stage, silently."""
import json
import os
import re
import sys

import numpy as np

import warm_python

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf2_tied_script.py")


def run(devices: int) -> dict:
    done = warm_python.run([sys.executable, SCRIPT, str(devices)], capture_output=True,
                           text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_keras_embedding_tied_across_four_stages_trains_as_functions():
    plain, got = run(0), run(4)
    np.testing.assert_allclose(got["losses"], plain["losses"], rtol=1e-5)
    assert len(got["variables"]) == len(plain["variables"]) > 6  # Adam's slots too
    for a, b in zip(plain["variables"], got["variables"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    cpus = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]
    assert got["planned"] == [[cpu] for cpu in cpus]
    assert set(cpus) <= set(got["devices"])  # and no FallbackWarning: an error there
    stages = {re.search(r"tfpar_stage_(\d+)_", name).group(1) for name in got["task_functions"]}
    assert stages == set("0123")
