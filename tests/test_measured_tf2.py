"""Predicted against measured for TF2 steps (issue 45): after
``measure.after_steps`` calls of a tf.function step tfpar rewrote (a custom
loop, Keras ``fit``), each TaskGraph's predicted compute time is set beside
the time its ops ran on its devices in the profiled calls, as for graphs
(``test_measured.py``); memory, which TensorFlow does not record for a
function's ops on CPUs, is said to be not measured. The scripts run in
fresh processes (``tf2_script.py``; config keys by environment variables)."""
import json

import numpy as np
import pytest

from tfpar.ir.host_trace import step_ops
from test_tf2 import run_script

HEADER = "tfpar: predicted vs measured, training step"


def measured_run(scenario, devices, monkeypatch, **keys):
    """(results, stderr) of ``scenario`` with ``measure.KEY`` = value for ``keys``."""
    for key, value in keys.items():
        monkeypatch.setenv(f"TFPAR_MEASURE_{key.upper()}", str(value))
    return run_script(scenario, devices)


def assert_rows_measured(measured, names, devices):
    rows = measured["task_graphs"]
    assert [r["name"] for r in rows] == names and [r["devices"] for r in rows] == devices
    for r in rows:
        assert r["predicted_time_s"] > 0 and r["measured_time_s"] > 0, r
        assert r["time_ratio"] == pytest.approx(r["measured_time_s"] / r["predicted_time_s"])
        assert r["predicted_memory_bytes"] > 0
        assert r["measured_memory_bytes"] is None and r["memory_within"] is None, r
    assert measured["not_measured"].startswith("memory: TensorFlow keeps no record")


def test_a_custom_loop_is_measured_after_its_third_step_and_calibrates(monkeypatch, tmp_path):
    path = tmp_path / "entry.json"
    got, err = measured_run("tape_adam", 2, monkeypatch, calibrate=path)
    measured = got["measured"]
    assert err.count(HEADER) == 1 and "training steps 2-3, the shortest (batch 16, fed" in err
    assert measured["step"] == 3 and measured["batch"] == 16
    assert_rows_measured(measured, ["replicate_all"], [["CPU:0", "CPU:1"]])
    assert "not measured: memory" in err and "n/a" in err
    entry = json.loads(path.read_text())
    assert measured["calibrated"]["entry"] == entry and entry["name"].endswith("(calibrated)")


def test_keras_fit_is_measured(monkeypatch):
    got, err = measured_run("fit", 2, monkeypatch)
    assert err.count(HEADER) == 1
    assert got["measured"]["batch_from"] == "assumed"  # read from a dataset in the step
    assert_rows_measured(got["measured"], ["replicate_all"], [["CPU:0", "CPU:1"]])


def test_each_stage_of_a_tf2_pipeline_is_measured_on_its_own_device(monkeypatch):
    """Stages run as task functions called from the step: their ops are
    found through the calls (``ir.host_trace``), each on its stage's device."""
    got, _ = measured_run("pipeline", 2, monkeypatch, after_steps=2)
    assert_rows_measured(got["measured"], ["replicate_0", "replicate_1"], [["CPU:0"], ["CPU:1"]])


def test_a_tight_tolerance_warns(monkeypatch):
    # 1e-9, not 0.001: a step measured within 0.1% of its prediction happens
    # (a fresh clone's make test saw one), and then nothing is off.
    got, err = measured_run("tape_adam", 2, monkeypatch, tolerance=1e-9)
    assert "off by more than measure.tolerance (0%) for replicate_all: time" in err
    assert got["measured"]["task_graphs"][0]["time_within"] is False


def test_zero_steps_measure_nothing_and_measuring_leaves_the_losses_alone(monkeypatch):
    off, err = measured_run("tape_adam", 2, monkeypatch, after_steps=0)
    assert off["measured"] == {} and "predicted vs measured" not in err
    on, _ = measured_run("tape_adam", 2, monkeypatch, after_steps=4)  # 3 steps profiled
    assert on["measured"]["step"] == 4
    np.testing.assert_allclose(on["losses"], off["losses"], rtol=1e-6)
    for a, b in zip(on["weights"], off["weights"]):
        np.testing.assert_allclose(a, b, rtol=1e-6)


def _events(thread, *spans):
    return [(thread, name, start, end, args) for name, start, end, args in spans]


def test_ops_of_a_called_function_are_named_through_their_call():
    """Two calls of one function body on one thread: each op is named by the
    executor it ran in, under the call that started that executor."""
    process = "ExecutorState::Process"
    events = _events(
        1, (process, 0, 100, {"id": "step"}),
        ("StatefulPartitionedCall", 1, 2, {"long_name": "r0/F:StatefulPartitionedCall"}),
        ("ExecutorState::ProcessAsync::Start", 3, 10,
         {"step_id": "step", "kernel_type": "StatefulPartitionedCall", "name": "r0/F"}),
        ("FunctionRun", 5, 6, {"id": "a"}),
        ("ExecutorState::ProcessAsync::Start", 11, 20,
         {"step_id": "step", "kernel_type": "StatefulPartitionedCall", "name": "r1/F"}),
        ("FunctionRun", 12, 13, {"id": "b"}),
        ("AddN", 90, 95, {"long_name": "sum:AddN"}))
    events += _events(2, (process, 30, 50, {"id": "a"}), ("MatMul", 31, 40, {"long_name": "mm:MatMul"}),
                      (process, 60, 80, {"id": "b"}), ("MatMul", 61, 70, {"long_name": "mm:MatMul"}))
    assert sorted(step_ops(events)) == [("r0/F", 1, 2), ("r0/F/mm", 31, 40), ("r1/F/mm", 61, 70),
                                        ("sum", 90, 95)]
