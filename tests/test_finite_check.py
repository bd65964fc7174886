"""check.finite_gradients: every replica's and micro-batch's gradients checked
before they are summed; a NaN or Inf fails the step naming where it was."""
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, initialized, make_data, plan_of, train
from test_multiworker import SCRIPT, launch
from test_pipeline import mlp_stages
from test_tf2 import run_eager

import tfpar as wh
from tfpar.runtime import precision

v1 = tf.compat.v1
CHECKED = {"check.finite_gradients": True}
DATA = make_data(steps=4, batch=8)
# (config, pipeline stages): rows of a batch of 8 per (replica, micro-batch)
PLANS = {"dp": ({"cluster.num_devices": 4, "pipeline.num_micro_batch": 2}, False),
         "pipeline": ({"cluster.num_devices": 4, "pipeline.num_micro_batch": 2}, True),
         "one_device": ({"cluster.num_devices": 1}, False)}
NAN_ROW = 5  # of step 2's batch
# Where row 5 is computed: (replica, micro-batch). DP: 8 pieces of one row,
# piece u = replica * 2 + micro-batch; pipeline: 2 pipeline replicas x 2
# micro-batches of 2 rows each.
WHERE = {"dp": (2, 1), "pipeline": (1, 0), "one_device": (0, 0)}


def adam():
    return v1.train.AdamOptimizer(0.01)


@pytest.mark.parametrize("plan", PLANS)
def test_checked_training_equals_one_device(plan):
    """The checks change no number: losses and every variable (Adam's slots
    too) equal one device's."""
    config, pipelined = PLANS[plan]
    reference = train(mlp_stages(2, False, adam), DATA)
    assert_equivalent(reference, train(mlp_stages(2, pipelined, adam), DATA, {**config, **CHECKED}))


def _nan_data():
    xs, ys = make_data(steps=4, batch=8)
    xs[2][NAN_ROW, 3] = np.nan
    return xs, ys


@pytest.mark.parametrize("plan", PLANS)
def test_a_non_finite_gradient_is_named_with_its_step_replica_and_stage(plan):
    """A NaN in row 5 of step 2's batch: the step fails naming a variable
    whose gradient it made non-finite, step 3 (counted from 1), the replica
    and micro-batch that computed row 5, its TaskGraph, stage and device."""
    config, pipelined = PLANS[plan]
    with pytest.raises(tf.errors.InvalidArgumentError) as failed:
        train(mlp_stages(2, pipelined, adam), _nan_data(), {**config, **CHECKED})
    found = re.search(r"tfpar: check\.finite_gradients: the gradient of (\w+)/(\w+) \(\S+\) holds "
                      r"NaN or Inf, computed by replica (\d+) of TaskGraph (\w+) \(stage (\d)\), "
                      r"micro-batch (\d+), on (\S+); the step failed.*The step \(counted from "
                      r"1\):\] \[(\d+)\]", failed.value.message)
    assert found, failed.value.message[:2000]
    layer, _, replica, task_graph, stage, micro_batch, device, step = found.groups()
    expected_stage = 0 if layer == "stage0" or not pipelined else 1
    plan_graph = plan_of(mlp_stages(2, pipelined, adam), config)
    wh.reset()
    assert (int(step), (int(replica), int(micro_batch))) == (3, WHERE[plan])
    assert (int(stage), task_graph) == (expected_stage,
                                        plan_graph.task_graphs[expected_stage].name)
    assert device == plan_graph.task_graphs[expected_stage].replicas[int(replica)][0]


def test_the_plan_says_what_is_checked():
    """6 variables' gradients (3 dense layers), each on 4 replicas x 2 micro-batches."""
    config, _ = PLANS["dp"]
    with initialized(mlp_stages(2, False, adam), {**config, **CHECKED}):
        notes = wh.current_plan().notes
    assert ("tfpar: check.finite_gradients: 48 gradient tensors (every replica's and "
            "micro-batch's) are checked for NaN and Inf before they are summed") in notes, notes


def test_the_check_and_fp16_loss_scaling_are_refused_together(monkeypatch):
    """fp16's loss scaling skips, on purpose, steps whose gradients overflow;
    the check would fail them (fp16 with float32 compute, as
    test_mixed_precision runs it on CPUs)."""
    monkeypatch.setattr(precision, "check_supported", lambda *args: None)
    with pytest.raises(wh.PlanError, match="check.finite_gradients would fail the steps fp16 "
                                           "loss scaling skips on purpose"):
        train(mlp_stages(2, False, adam), DATA, {"cluster.num_devices": 2, **CHECKED,
                                                 "memory.mixed_precision": "fp16"})


TF2_STEP = """
wh.init({{"cluster.num_devices": {devices}, "check.finite_gradients": True}})
model = tf.keras.Sequential([tf.keras.layers.Dense(8, "tanh"), tf.keras.layers.Dense(3)])
optimizer = tf.keras.optimizers.Adam(0.01)

@tf.function
def step(x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
            y, model(x), from_logits=True))
    grads = tape.gradient(loss, model.trainable_variables)
    optimizer.apply_gradients(zip(grads, model.trainable_variables))
    return loss

x, y = X[:8].copy(), np.arange(8) % 3
for i in range(3):
    if i == 2:
        x[{row}, 1] = np.nan
    try:
        print("loss", float(step(x, y)))
    except tf.errors.InvalidArgumentError as e:
        print(e.message)
"""


@pytest.mark.parametrize("devices,where", [
    (2, "replica 1 of TaskGraph replicate_all (stage 0), micro-batch 0, on "
        "/job:localhost/replica:0/task:0/device:CPU:1"),
    (1, "replica 0 of TaskGraph replicate_all (stage 0), micro-batch 0, on "
        "/job:localhost/replica:0/task:0/device:CPU:0")])
def test_a_tf2_step_names_a_non_finite_gradient(devices, where):
    """A tf.function step with tf.GradientTape, on 2 devices and on one (where
    tfpar otherwise runs the step as traced): its third step, a NaN in row 5,
    fails naming it."""
    out = run_eager(TF2_STEP.format(devices=devices, row=NAN_ROW))
    assert out.count("loss ") == 2, out[-3000:]
    assert re.search(r"tfpar: check\.finite_gradients: the gradient of \S+ \(\S+\) holds NaN or "
                     rf"Inf, computed by {re.escape(where)}; the step failed.*The step \(counted "
                     r"from 1\):\] \[3\]", out), out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("job", ["tf_config", pytest.param("horovod", marks=pytest.mark.horovod)])
def test_a_non_finite_gradient_is_named_with_its_worker(job, tmp_path):
    """The NaN of row 5 of step 2: 2 TF_CONFIG workers x 2 devices fail the
    chief's step 3 naming replica 2, worker 1's first device; 2 Horovod
    processes (one device each, rows 4-7 on rank 1) name rank 1."""
    env = dict(os.environ, TFPAR_CHECK_FINITE_GRADIENTS="true")
    args = [SCRIPT, str(tmp_path / "out.npz"), "--nan", "2", str(NAN_ROW)]
    if job == "tf_config":
        out = launch(*args, env=env).stdout
        where = "replica 2 of TaskGraph replicate_all (stage 0), micro-batch 0, on " \
                "/job:worker/replica:0/task:1/device:CPU:0"
    else:
        horovodrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
        done = subprocess.run([horovodrun, "-np", "2", "-H", "localhost:2", "--gloo",
                               sys.executable, *args, "--horovod"], capture_output=True,
                              text=True, timeout=240, env=env)
        out = done.stdout + done.stderr
        where = "replica 0 of TaskGraph replicate_all (stage 0), micro-batch 0, on " \
                "/job:localhost/replica:0/task:0/device:CPU:0, Horovod rank 1 of 2"
    assert re.search(rf"holds NaN or Inf, computed by {re.escape(where)}; the step failed.*The "
                     r"step \(counted from 1\):\] \[3\]", out), out[-3000:]
