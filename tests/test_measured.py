"""Predicted against measured (issue 45): after ``measure.after_steps``
training steps tfpar sets each TaskGraph's predicted compute time and peak
memory beside the traced step's, prints the table, keeps it in the plan,
warns when off by more than ``measure.tolerance``, and ``measure.calibrate``
fits a device entry that brings the next run's prediction within it."""
import contextlib
import json
import time

import numpy as np
import pytest
import tensorflow as tf

from equivalence import fed_graph, traced_first_step

import tfpar as wh
from tfpar import ConfigError
from tfpar.ir import measured as compare
from tfpar.runtime.measured import traced_steps
from tfpar.runtime.step_trace import step_devices, step_spans

v1 = tf.compat.v1
# A device whose speed makes the cost model easy to check by hand: 1 GFLOP/s.
SLOW = {"name": "slow", "tflops": 0.001, "memory_gb": 16, "efficiency": 1.0}


def train(config, steps=3, batch=64, width=256, sleep_s=0.0, stages=1, micro=1, split=False):
    """Train an MLP (32 -> width -> 10, Momentum) for ``steps`` steps under
    ``config`` on 2 devices; ``sleep_s``: the last layer's input waits that
    long (a slow op); ``stages`` 2: a pipeline of two replicate(1) scopes;
    ``split``: the model in one wh.split(2) scope. Returns the plan after
    training."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2, "pipeline.num_micro_batch": micro, **config})
        x = v1.placeholder(tf.float32, [None, 32])
        y = v1.placeholder(tf.int64, [None])
        stage = wh.replicate if stages == 2 else lambda _: contextlib.nullcontext()
        with wh.split(2) if split else contextlib.nullcontext():
            with stage(1):
                h = v1.layers.dense(x, width, tf.nn.relu)
            with stage(1):
                if sleep_s:
                    h = tf.numpy_function(lambda a: (time.sleep(sleep_s), a)[1], [h], tf.float32,
                                          stateful=False)
                    h.set_shape([None, width])
                loss = v1.losses.sparse_softmax_cross_entropy(y, v1.layers.dense(h, 10))
        train_op = v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)
        rng = np.random.RandomState(0)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for _ in range(steps):
                sess.run(train_op, {x: rng.randn(batch, 32), y: rng.randint(0, 10, batch)})
        plan = wh.current_plan()
    wh.reset()
    return plan


def forward_flops_per_row(width):
    """The MLP's matrix products per row (the cost model adds its few
    element-wise FLOPs: bias, relu, softmax)."""
    return 2 * 32 * width + 2 * width * 10


def test_the_table_comes_after_n_steps_of_a_data_parallel_graph(capsys, tmp_path):
    plan = train({"measure.after_steps": 2, "cluster.hardware": [SLOW]}, steps=3)
    out = capsys.readouterr().err
    assert out.count("tfpar: predicted vs measured, training step 2 (batch 64, fed") == 1
    measured = plan.measured
    assert measured["step"] == 2 and measured["batch"] == 64 and measured["hardware"] == "slow"
    (row,) = measured["task_graphs"]
    assert row["name"] == "replicate_all" and row["devices"] == ["CPU:0", "CPU:1"]
    # The cost model's: forward + backward (3x forward) of 32 rows per replica at 1 GFLOP/s,
    # and the planner's kernel launches (3 kernels of 5 us per op that computes).
    launches = row["predicted_launch_s"]
    assert launches > 0 and launches / 15e-6 == pytest.approx(round(launches / 15e-6))
    by_hand = 3 * forward_flops_per_row(256) * 32 / 1e9 + launches
    assert by_hand <= row["predicted_time_s"] <= 1.05 * by_hand
    assert 0 < row["measured_time_s"] and row["measured_memory_bytes"] > 0
    assert row["predicted_memory_bytes"] >= (32 * 256 + 256 * 10) * 4 * 3  # weights, grads, momentum
    assert json.loads(plan.to_json())["measured"] == measured
    assert wh.Plan.from_dict(plan.to_dict()).measured == measured
    report = open(plan.to_html(str(tmp_path / "report.html"))).read()
    assert "<h2>Predicted vs measured</h2><pre>tfpar: predicted vs measured, training step 2" in report


def test_a_two_stage_pipeline_is_compared_stage_by_stage():
    plan = train({"measure.after_steps": 3, "cluster.hardware": [SLOW]}, stages=2, micro=2)
    rows = {r["name"]: r for r in plan.measured["task_graphs"]}
    assert [r["devices"] for r in rows.values()] == [["CPU:0"], ["CPU:1"]]
    first, second = rows.values()
    # Stage 0 holds the 32 x 256 layer, stage 1 the 256 x 10 one and the loss (and each
    # its kernel launches, for each of the 2 micro-batches).
    assert first["predicted_time_s"] - first["predicted_launch_s"] == pytest.approx(
        3 * 2 * 32 * 256 * 64 / 1e9, rel=0.05)
    assert second["predicted_time_s"] - second["predicted_launch_s"] == pytest.approx(
        3 * 2 * 256 * 10 * 64 / 1e9, rel=0.3)
    assert all(r["measured_time_s"] > 0 and r["measured_memory_bytes"] > 0 for r in rows.values())


def test_a_split_only_graph_is_measured_too():
    """Issue 64 item 6: a graph whose one TaskGraph is a split (nothing for
    tfpar to rewrite after the split scope built it) printed no table,
    though every run is checked: its fetches were never seen to train."""
    plan = train({"measure.after_steps": 2}, split=True)
    (row,) = plan.measured["task_graphs"]
    assert row["name"] == "split_0" and row["devices"] == ["CPU:0", "CPU:1"]
    assert row["measured_time_s"] > 0 and row["predicted_time_s"] > 0


def test_a_slow_op_makes_its_stage_measure_longer_and_only_its_stage():
    fast = train({}, stages=2, micro=2).measured["task_graphs"]
    slow = train({}, stages=2, micro=2, sleep_s=0.05).measured["task_graphs"]
    assert slow[1]["measured_time_s"] >= 2 * 0.05 > fast[1]["measured_time_s"]  # 2 micro-batches
    assert slow[0]["measured_time_s"] < 0.05
    assert slow[1]["predicted_time_s"] == pytest.approx(fast[1]["predicted_time_s"], rel=0.1)


def test_off_by_more_than_the_tolerance_warns_and_calibration_brings_it_within(tmp_path,
                                                                             tfpar_log):
    """A device entry 1000x too fast: the prediction is far off and said so;
    the calibrated entry it writes puts the next run within tolerance, and
    nothing is said. A wider model, so that the step's few milliseconds
    are mostly its products; the shortest of steps 4-8; tolerance 1
    (0.5x-2x) and up to three pairs of runs: this host is shared."""
    path = str(tmp_path / "calibrated.json")
    fast = {"name": "too fast", "tflops": 100.0, "memory_gb": 16, "efficiency": 1.0}
    config = {"measure.tolerance": 1.0, "measure.after_steps": 8}
    for _ in range(3):  # a pair of runs another job disturbed is run again
        tfpar_log.truncate(0)
        tfpar_log.seek(0)
        before = train({**config, "cluster.hardware": [fast], "measure.calibrate": path},
                       steps=8, batch=512, width=1024).measured
        warned = tfpar_log.getvalue()
        tfpar_log.truncate(0)
        tfpar_log.seek(0)
        after = train({**config, "cluster.hardware": path}, steps=8, batch=512,
                      width=1024).measured
        if after["task_graphs"][0]["time_within"]:
            break
    assert "off by more than measure.tolerance (100%) for replicate_all: time" in warned
    assert before["task_graphs"][0]["time_ratio"] > 2  # out of tolerance 1 (0.5x-2x)
    entry = json.load(open(path))
    assert entry["name"] == "too fast (calibrated)" and 0 < entry["efficiency"] < 0.1
    assert before["calibrated"]["entry"] == entry
    (row,) = after["task_graphs"]
    assert after["hardware"] == "too fast (calibrated)"
    assert row["time_within"] and row["memory_within"], compare.table(after)
    assert "off by more" not in tfpar_log.getvalue()


def test_described_gpus_measured_on_cpus_are_not_comparable(capsys, tmp_path, tfpar_log):
    """Issue 64: a plan for A100s run on this CPU host was compared with the
    CPUs' timings, flagged OFF and warned about, and calibration fitted the
    A100 entry to them. Now the table says the prediction is for the
    devices described and the ratios are no check of the cost model, no
    TaskGraph is OFF, nothing is warned and nothing calibrated."""
    path = tmp_path / "calibrated.json"
    plan = train({"cluster.hardware": "2 x A100-80GB", "measure.after_steps": 2,
                  "measure.calibrate": str(path)}, steps=2)
    measured, err = plan.measured, capsys.readouterr().err
    assert compare.off_rows(measured) == [] and not path.exists()
    assert (measured["ran_on"], measured["comparable"]) == ("CPU", False)
    assert "OFF" not in err and "not comparable" in err, err
    assert ("not comparable: predicted for A100-80GB devices, measured on CPU devices: the "
            "ratios do not check the cost model") in err
    assert ("measure.calibrate: nothing written: the A100-80GB entry is not fitted to timings of "
            "CPU devices") in err
    assert "off by more" not in tfpar_log.getvalue()


def test_on_cpus_the_host_s_measured_throughput_is_the_device(capsys):
    plan = train({"measure.after_steps": 1}, steps=1)
    assert plan.measured["hardware"].startswith("host-CPU (measured ")
    assert "GFLOP/s" in capsys.readouterr().err


def test_zero_steps_measure_nothing_and_its_keys_need_it(capsys):
    plan = train({"measure.after_steps": 0}, steps=4)
    assert plan.measured == {} and "predicted vs measured" not in capsys.readouterr().err
    with pytest.raises(ConfigError, match="measure.tolerance"):
        wh.Config({"measure.after_steps": 0, "measure.tolerance": 0.2})


def test_busy_time_counts_overlaps_once_and_peaks_follow_releases():
    assert compare.busy_seconds([(0, 10), (5, 20), (30, 40)]) == pytest.approx(30e-6)
    assert compare.peak_bytes([(0, 100), (1, 50), (2, -100), (2, 30), (3, -50)]) == 150
    assert compare.within(1.4, 0.5) and compare.within(1 / 1.4, 0.5)
    assert not compare.within(1.6, 0.5) and not compare.within(None, 0.5)


def test_calibration_fits_the_efficiency_and_raises_the_peak_only_above_one():
    rows = {"task_graphs": [{"predicted_time_s": 1.0, "measured_time_s": 4.0}]}
    entry = {"name": "x", "tflops": 2.0, "memory_gb": 1, "efficiency": 0.5}
    assert compare.calibrated_entry(entry, rows)["efficiency"] == 0.125
    rows["task_graphs"][0]["measured_time_s"] = 0.25
    fitted = compare.calibrated_entry(entry, rows)
    assert (fitted["tflops"], fitted["efficiency"]) == (4.0, 1.0)


def test_the_steps_measured_skip_the_first_unless_it_is_the_only_one():
    assert [list(traced_steps(n)) for n in (1, 2, 3, 10)] == [[1], [2], [2, 3], [6, 7, 8, 9, 10]]


def test_the_plan_s_summary_ends_with_the_table():
    plan = train({"measure.after_steps": 2}, steps=2)
    assert compare.table(plan.measured) in plan.summary()
    assert "predicted vs measured" not in train({"measure.after_steps": 0}, steps=2).summary()


def test_a_step_measured_within_its_kernel_launches_keeps_the_entry_and_trains(tmp_path):
    """Measured shorter than the planner's kernel launches, there is no
    arithmetic to fit: the entry is written unchanged and says why (before,
    the calibration raised and the training run failed)."""
    measured = {"steps": [2, 3], "launch_s": 1.0,
                "task_graphs": [{"predicted_time_s": 1.1, "measured_time_s": 0.9}]}
    with pytest.raises(ValueError, match="kernel launches"):
        compare.calibrated_entry({"name": "x", "tflops": 1.0, "efficiency": 0.5}, measured)
    from tfpar.cluster.hardware import CATALOG  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.measured import Predicted, _calibrate  # pylint: disable=import-outside-toplevel
    said = _calibrate(str(tmp_path / "entry.json"), Predicted(None, CATALOG["V100-32GB"], 32),
                      measured)
    assert said["from"].startswith("nothing fitted, the entry kept")
    assert json.load(open(tmp_path / "entry.json"))["efficiency"] == CATALOG["V100-32GB"].efficiency


def test_a_fused_gelu_gradient_counts_for_its_task_graph():
    """Grappler fuses a GELU gradient's chain of unary ops into one node named
    ``.../Exp/unary_ops_composition``: its time and its device belong to the
    TaskGraph of the op it ends with (measured as that TaskGraph's, and where
    the step ran), not to "other"."""
    with fed_graph({"cluster.num_devices": 2}) as (graph, x, y):
        with wh.replicate(1):
            h = v1.layers.dense(x, 64, lambda t: tf.nn.gelu(t, approximate=False), name="ffn")
        with wh.replicate(1):
            logits = v1.layers.dense(h, 3, name="logits")
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=y, logits=logits))
        train_op = v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        metadata = traced_first_step(train_op, {x: np.ones((8, 6), np.float32),
                                                y: np.zeros(8, np.int64)})
        fused = [node for device in metadata.step_stats.dev_stats for node in device.node_stats
                 if node.node_name.endswith("unary_ops_composition")]
        assert fused, "grappler fused no unary ops: the test checks nothing"
        ran = step_devices(metadata, graph)
        spans = step_spans(metadata, graph)
    assert ran["replicate_0"].keys() == {"CPU:0"} and ran["replicate_1"].keys() == {"CPU:1"}
    fused_spans = {(n.all_start_micros, n.all_start_micros + n.all_end_rel_micros) for n in fused}
    assert fused_spans <= set(spans["replicate_0", "CPU:0"])
    assert not fused_spans & set(spans.get(("other", "CPU:0"), ()))
