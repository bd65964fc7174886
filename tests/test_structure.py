"""House rules that keep tfpar maintainable and deterministic."""
import json
import os
import re
import subprocess
import sys


import numpy as np
import pytest
import tensorflow as tf

from equivalence import mlp_classifier
from proof import assert_parallel

import tfpar as wh
import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_planner_ir_cluster_import_without_tensorflow():
    """Every module file under tfpar/planner, tfpar/ir and tfpar/cluster (listed from
    disk, so new modules are covered) imports with TensorFlow blocked."""
    names = ["tfpar.config"] + [
        f"tfpar.{package}" + ("" if name == "__init__.py" else f".{name[:-3]}")
        for package in ("planner", "ir", "cluster")
        for name in sorted(os.listdir(os.path.join(ROOT, "tfpar", package)))
        if name.endswith(".py")]
    code = ("import importlib, sys, traceback, types\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] == 'tensorflow':\n"
            "            raise ImportError('tensorflow blocked')\n"
            "sys.meta_path.insert(0, Block())\n"
            "pkg = types.ModuleType('tfpar'); pkg.__path__ = ['tfpar']; sys.modules['tfpar'] = pkg\n"
            f"for name in {names!r}:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception:\n"
            "        print(name, traceback.format_exc(limit=-2))\n"
            "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert len(names) > 10 and out.stdout.strip() == "ok", out.stdout + out.stderr


def _rewritten_graph_def():
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2, "pipeline.num_micro_batch": 2})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        loss, train_op = mlp_classifier(lambda: tf.compat.v1.train.AdamOptimizer(0.1))(x, y)
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run([loss, train_op], {x: np.ones((4, 6), np.float32), y: np.zeros(4, np.int64)})
        graph_def = graph.as_graph_def()
    wh.reset()
    return graph_def


def test_rewrite_is_deterministic():
    assert _rewritten_graph_def() == _rewritten_graph_def()


def test_fetches_are_merged():
    """Fetched logits are the concatenation; fetched gradients are the global ones."""
    xs = np.random.RandomState(0).randn(8, 6).astype(np.float32)
    ys = np.arange(8) % 3

    def run(config):
        with tf.Graph().as_default():
            if config:
                wh.init(config)
            x = tf.compat.v1.placeholder(tf.float32, [None, 6])
            y = tf.compat.v1.placeholder(tf.int64, [None])
            opt = tf.compat.v1.train.GradientDescentOptimizer(0.1)
            loss, _ = mlp_classifier(lambda: opt)(x, y)
            logits = tf.compat.v1.get_default_graph().get_tensor_by_name("logits/add:0")
            grads = [g for g, _ in opt.compute_gradients(loss)]
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                out = sess.run({"logits": logits, "grads": grads, "loss": "sparse_softmax_cross_entropy_loss/value:0"},
                               {x: xs, y: ys})
        wh.reset()
        return out

    plain, parallel = run(None), run({"cluster.num_devices": 4})
    np.testing.assert_allclose(parallel["logits"], plain["logits"], rtol=1e-5)
    np.testing.assert_allclose(parallel["loss"], plain["loss"], rtol=1e-5)
    for a, b in zip(parallel["grads"], plain["grads"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert_parallel()


def _run(*args, timeout=300):
    return warm_python.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)


def test_example_runs_and_is_equivalent():
    out = _run("examples/data_parallel_mlp.py", "--devices", "2", "--steps", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(equivalent)" in out.stdout and "replicate_all" in out.stdout
    assert_ran(out.stdout, {"replicate_all": ["CPU:0", "CPU:1"]})


def test_pipeline_example_runs_and_is_equivalent(tmp_path):
    out = _run("examples/pipeline_transformer.py", "--devices", "2", "--steps", "2",
               "--micro-batches", "2", "--trace-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(equivalent)" in out.stdout and "replicate_1" in out.stdout
    assert (tmp_path / "plan_timeline.json").exists() and (tmp_path / "step_timeline.json").exists()


@pytest.mark.parametrize("script,flags", [
    ("examples/tf2_custom_loop.py", ["--steps", "3"]),
    ("examples/tf2_custom_loop.py", ["--steps", "3", "--fit"]),
    ("examples/keras_fit.py", ["--mode", "pipeline"]), ("examples/keras_fit.py", ["--mode", "split"])],
    ids=["custom_loop", "fit", "keras_fit_pipeline", "keras_fit_split"])
def test_tf2_example_runs_and_is_equivalent(script, flags):
    out = _run(script, "--devices", "2", *flags)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "(equivalent)" in out.stdout
    assert "the training step ran on: CPU:0, CPU:1\n" in out.stdout, out.stdout


def assert_ran(stdout, task_graphs):
    """The example's traced step ran each TaskGraph on exactly its devices."""
    for name, devices in task_graphs.items():
        ran = " ".join(f"{d} \\(\\d+\\)," for d in devices).rstrip(",")
        assert re.search(rf"^  {name}: {ran}$", stdout, re.M), stdout


@pytest.mark.parametrize("script,mode,task_graphs", [
    ("examples/keras_fit.py", "dp", {"replicate_all": ["CPU:0", "CPU:1"]}),
    ("examples/keras_fit.py", "split", {"split_0": ["CPU:0", "CPU:1"]}),
    pytest.param("examples/estimator_classifier.py", "pipeline",
                 {"replicate_0": ["CPU:0"], "replicate_1": ["CPU:1"]},
                 marks=pytest.mark.estimator)])
def test_entry_point_examples_run_and_are_equivalent(script, mode, task_graphs, tmp_path):
    args = ["--mode", mode] + (["--model-dir", str(tmp_path)] if "estimator" in script
                               else ["--graph"])
    out = _run(script, *args)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "equivalent" in out.stdout and "NOT" not in out.stdout
    assert_ran(out.stdout, task_graphs)


def test_auto_parallel_example_plans_first_then_builds_the_head_split():
    """The planning pass (a child run of the script) finds the sharded head; the
    script then builds it split and trains like one device."""
    out = _run("examples/auto_parallel.py", "--classes", "8000", "--steps", "3")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tfpar auto: planning pass" in out.stderr
    assert "split_1    split" in out.stdout and "head -> column" in out.stdout
    assert "(equivalent)" in out.stdout
    assert_ran(out.stdout, {tg: ["CPU:0", "CPU:1", "CPU:2", "CPU:3"] for tg in ("default_0", "split_1")})


def test_cli_plan_writes_the_plan_file(tmp_path):
    path = tmp_path / "plan.json"
    out = _run("-m", "tfpar.cli", "plan", "--out", str(path), "examples/auto_parallel.py",
               "--classes", "8000", "--steps", "1")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == f"tfpar plan: wrote the plan's JSON to {path}"
    plan = json.loads(path.read_text())
    assert plan["sharding"]["layers"]["head"] == "column"
    assert "planning pass" not in out.stderr  # `tfpar plan` is itself the planning pass


def test_cli_plan_prints_the_plan_without_training():
    out = _run("-m", "tfpar.cli", "plan", "--json", "--config", '{"cluster.num_devices": 3}',
               "examples/data_parallel_mlp.py", "--steps", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    assert '"data_parallel_degree": 3' in out.stdout
    config = _run("-m", "tfpar.cli", "config")
    assert "pipeline.num_micro_batch" in config.stdout


def test_every_package_directory_is_packaged():
    """find_packages only ships directories with an __init__.py."""
    package = os.path.join(ROOT, "tfpar")
    for folder, _, files in os.walk(package):
        if "__pycache__" not in folder and any(f.endswith(".py") for f in files):
            assert "__init__.py" in files, f"{folder} has no __init__.py"


def test_cli_simulate_replays_a_schedule(tmp_path):
    trace = tmp_path / "trace.json"
    out = _run("-m", "tfpar.cli", "simulate", "--stages", "2", "--micro-batches", "4",
               "--trace", str(trace))
    assert out.returncode == 0, out.stderr[-2000:]
    assert "bubble 20.0%" in out.stdout and "stage 1: F0 B0 F1 B1" in out.stdout
    assert trace.exists()
    bad = _run("-m", "tfpar.cli", "simulate", "--stages", "0", "--micro-batches", "4")
    assert bad.returncode == 2 and "num_stages" in bad.stderr
