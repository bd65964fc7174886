"""The planning pass of auto_parallel scripts: when it runs, and that a failed
pass is an error. The pass itself: test_structure's example."""
import os
import sys

import pytest

from tfpar.config import Config
from tfpar.errors import PlanError
from tfpar.runtime import planning_pass
import warm_python

AUTO = Config({"auto.auto_parallel": True})
SCRIPT = {"__name__": "__main__"}


@pytest.mark.parametrize("config,caller,env", [
    (Config(), SCRIPT, {}),                                         # auto off
    (AUTO.replace({"auto.planning_pass": False}), SCRIPT, {}),      # pass off
    (AUTO.replace({"plan": {"data_parallel_degree": 1, "task_graphs": [
        {"name": "all", "strategy": "replicate", "device_count": 1, "devices": []}]}}),
     SCRIPT, {}),  # plan pinned
    (AUTO, {"__name__": "tests.model"}, {}),                        # not the script
    (AUTO, SCRIPT, {planning_pass.ENV: "1"}),                       # already the pass
    (AUTO, SCRIPT, {"TF_CONFIG": "{}"}),                            # a cluster worker
])
def test_no_pass(config, caller, env, monkeypatch, tmp_path):
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('must not run')\n")
    monkeypatch.setattr(sys, "argv", [str(script)])
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    ran = []
    monkeypatch.setattr(planning_pass, "_run_pass", lambda *a: ran.append(a) or {})
    assert planning_pass.pinned_by_planning_pass(config, caller) == (config, False)
    assert not ran


def test_a_failed_pass_is_an_error(monkeypatch, tmp_path, caplog):
    """Before, a crashing pass printed a line and went on without sharding.
    (The pass's own line is a progress line of the ``tfpar.progress`` logger.)"""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit(3)\n")
    monkeypatch.setattr(sys, "argv", [str(script), "--flag"])
    with pytest.raises(PlanError, match=r"planning pass .*--flag.* failed \(exit 3.*"
                                        r"auto.planning_pass\": false"):
        planning_pass.pinned_by_planning_pass(AUTO, SCRIPT)
    assert any(m.startswith("tfpar auto: planning pass:") for m in caplog.messages)


CURRENT_PLAN_SCRIPT = '''
import numpy as np, tensorflow as tf
import tfpar as wh
v1 = tf.compat.v1
v1.disable_eager_execution()
wh.init({"cluster.num_devices": 4, "auto.auto_parallel": True})
x = v1.placeholder(tf.float32, [None, 16])
y = v1.placeholder(tf.int64, [None])
logits = v1.layers.dense(v1.layers.dense(x, 32, tf.nn.relu), 20000, name="head")
loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
train = v1.train.AdamOptimizer(1e-3).minimize(loss)
print("before:", sorted(tg.strategy for tg in wh.current_plan().task_graphs))
with v1.Session() as sess:
    sess.run(v1.global_variables_initializer())
    rng = np.random.RandomState(0)
    sess.run(train, {x: rng.randn(8, 16), y: rng.randint(0, 20000, 8)})
print("after:", sorted(tg.strategy for tg in wh.current_plan().task_graphs))
'''


@pytest.mark.slow
def test_current_plan_in_an_auto_script_searches_once(tmp_path):
    """Issue 14: ``wh.current_plan()`` before the first run of an
    ``auto_parallel`` script said "the planning pass failed (exit 1)" and ran
    the search a second time. Now the pass searches once (one progress line
    per mesh), nothing fails, and both calls show the split plan it built."""
    script = tmp_path / "train.py"
    script.write_text(CURRENT_PLAN_SCRIPT)
    done = warm_python.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if "tfpar" in line]  # not TF's own log
    assert not [line for line in said if "failed" in line], done.stderr[-3000:]
    assert done.stderr.count("tfpar auto [1/") == 1, done.stderr[-3000:]
    assert "before: ['replicate', 'split']" in done.stdout
    assert "after: ['replicate', 'split']" in done.stdout


UNSHARDED_SCRIPT = '''
import numpy as np, tensorflow as tf
import tfpar as wh
v1 = tf.compat.v1
v1.disable_eager_execution()
wh.init({"cluster.num_devices": 2, "auto.auto_parallel": True})
x = v1.placeholder(tf.float32, [None, 4])
loss = tf.reduce_mean(v1.layers.dense(v1.layers.dense(x, 8), 1) ** 2)
train = v1.train.AdamOptimizer(0.1).minimize(loss)
with v1.Session() as sess:
    sess.run(v1.global_variables_initializer())
    sess.run(train, {x: np.ones((8, 4), np.float32)})
'''


@pytest.mark.slow
def test_a_pass_that_shards_nothing_says_the_search_once(tmp_path):
    """Issue 64: when the pass's plan shards nothing, this process plans
    again; before, its search printed every progress line a second time."""
    script = tmp_path / "train.py"
    script.write_text(UNSHARDED_SCRIPT)
    done = warm_python.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tfpar auto: planning pass:" in done.stderr
    assert done.stderr.count("tfpar auto [1/") == 1, done.stderr[-3000:]
