"""Mixed precision (``memory.mixed_precision``, issue 15).

* bf16 (this machine's oneDNN CPUs): the same numbers as TensorFlow's own bf16
  rewrite on one device, within bf16's rounding; a traced step cast to bf16 on
  every device; variables and checkpoints stay float32 with their names.
* fp16 runs on GPUs only (CPUs have no fp16 kernels, and TensorFlow's CPU
  emulation aborts on common graphs): its dynamic loss scaling is tested with
  float32 compute (the ``precision`` seam below): the same numbers as
  TensorFlow's ``MixedPrecisionLossScaleOptimizer``, a step with non-finite
  gradients skipped on every plan.
"""
import contextlib

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import config_pb2, rewriter_config_pb2

from equivalence import (assert_equivalent, dense, fed_graph, make_data, plan_of,
                         traced_first_step, train)
import tfpar as wh
from test_memory_techniques import adam, blocks
from test_tf2 import run_eager
from test_zero import keras_fit
from tfpar.hooks import loss_scaling
from tfpar.planner.step_model import technique_space
from tfpar.rewriters import task_functions
from tfpar.runtime import context, engine, precision
from tfpar.runtime.step_trace import executed_ops

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=16)
CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(2)]
PLANS = {
    "replicas": {"cluster.num_devices": 2},
    "mirrored": {"cluster.num_devices": 2, "communication.backend": "collective"},
    "pipeline": {"cluster.num_devices": 2, "auto.num_task_graph": 2,
                 "pipeline.num_micro_batch": 2},
    "pipeline, stage copies": {"cluster.num_devices": 2, "auto.num_task_graph": 2,
                               "pipeline.num_micro_batch": 2, "pipeline.task_functions": False},
}
BF16 = precision.onednn_computes_bf16()
needs_bf16 = pytest.mark.skipif(not BF16, reason="oneDNN computes no bf16 on this CPU (see "
                                "test_bf16_is_refused_where_onednn_computes_none)")


@contextlib.contextmanager
def tensorflow_bf16():
    """Plain TensorFlow sessions with its own bf16 rewrite on."""
    option = "auto_mixed_precision_onednn_bfloat16"
    tf.config.optimizer.set_experimental_options({option: True})
    try:
        yield
    finally:
        tf.config.optimizer.set_experimental_options({option: None})  # unset again


def cast_devices(config, build, kind):
    """The devices on which a traced step of ``build`` ran the casts to
    ``kind`` ("Bf16") that grappler's mixed precision inserts."""
    with fed_graph(config) as (_, x, y):
        _, train_op = build(x, y)
        return devices_casting(
            executed_ops(traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})), kind)


def devices_casting(ran, kind):
    """Of ``ran`` (op name -> devices it ran on), the devices that ran casts to ``kind``."""
    return {d for name, devices in ran.items() if f"CastTo{kind}" in name for d in devices}


@needs_bf16
@pytest.mark.parametrize("plan", PLANS.values(), ids=PLANS)
def test_bf16_trains_like_tensorflows_own_bf16_rewrite(plan):
    """Three blocks, SGD: tfpar's bf16 on two devices gives TensorFlow's bf16
    numbers on one within bf16's rounding (half-batches round their own
    partial sums), and float32's within twice that; the variables stay
    float32, under their names; every device ran casts to bf16."""
    build = blocks(3)
    config = {**plan, "memory.mixed_precision": "bf16"}
    fp32 = train(build, DATA)
    with tensorflow_bf16():
        reference = train(build, DATA)
    got = train(build, DATA, config)
    assert_equivalent(reference, got, rtol=2e-2, atol=2e-2)
    assert_equivalent(fp32, got, rtol=4e-2, atol=4e-2, parallel=False)
    assert {v.dtype for v in got[1].values()} == {np.dtype(np.float32)}
    assert cast_devices(config, build, "Bf16") == set(CPUS)
    assert not cast_devices(plan, build, "Bf16")  # none without it


@pytest.fixture
def fp16_in_float32(monkeypatch):
    """fp16's loss scaling with float32 compute: the CPU's refusal lifted,
    no grappler rewrite (``rewrite_option`` knows none for CPUs)."""
    monkeypatch.setattr(precision, "check_supported", lambda *args: None)


def loss_scaled(optimizer):
    return lambda: v1.mixed_precision.MixedPrecisionLossScaleOptimizer(optimizer(), "dynamic")


NAN_STEP = make_data(steps=4, batch=16)
NAN_STEP[0][1][3, 2] = np.nan  # step 1's gradients are not finite


@pytest.mark.parametrize("plan", [*PLANS.values(), {**PLANS["mirrored"], "memory.zero": 2}],
                         ids=[*PLANS, "ZeRO-2"])
def test_fp16_loss_scaling_matches_tensorflows_loss_scale_optimizer(plan, fp16_in_float32):
    """Adam, a step whose gradients are NaN: tfpar skips it on every plan
    as TensorFlow's MixedPrecisionLossScaleOptimizer does on one device
    (plain TF's variables turn NaN), and the scaled steps around it give
    its numbers (the scale is a power of 2: exact in float32)."""
    reference = train(blocks(3, loss_scaled(adam)), NAN_STEP)
    got = train(blocks(3, adam), NAN_STEP, {**plan, "memory.mixed_precision": "fp16"})
    names = set(got[1])
    assert_equivalent((reference[0], {k: v for k, v in reference[1].items() if k in names}),
                      got, rtol=1e-5)
    assert np.isnan(got[0][1]) and np.isfinite(got[0][2:]).all()
    plain = train(blocks(3, adam), NAN_STEP)
    assert np.isnan(plain[0][2:]).all()


def test_fp16_loss_scaling_in_keras_fit_matches_keras_loss_scale_optimizer(fp16_in_float32):
    """Keras fit in graph mode (legacy Adam), a batch of NaN in the first
    epoch: tfpar's mirrored replicas skip it as Keras' own
    LossScaleOptimizer does on one device, and plain Keras turns NaN."""
    data = make_data(steps=3, batch=16)
    data[0][1][3, 2] = np.nan
    adam_ = tf.keras.optimizers.legacy.Adam
    reference = keras_fit(None, lambda: tf.keras.mixed_precision.LossScaleOptimizer(adam_(0.05)),
                          data)
    got = keras_fit({**PLANS["mirrored"], "memory.mixed_precision": "fp16"},
                    lambda: adam_(0.05), data)
    np.testing.assert_allclose(got[0], reference[0], rtol=1e-5)
    assert_equivalent((reference[0], reference[1]), got[:2], rtol=1e-5)
    assert np.isfinite(got[1][sorted(got[1])[0]]).all()
    assert np.isnan(keras_fit(None, lambda: adam_(0.05), data)[0][-1])


def test_the_loss_scale_halves_on_overflow_and_grows_after_finite_steps(fp16_in_float32,
                                                                         monkeypatch):
    """S starts at 2**15, halves after a non-finite step, doubles after
    GROWTH_STEPS (2 here) finite ones; the skipped step's train op completes
    and leaves the variables and the global step as they were; checkpoints
    hold the script's variables only."""
    monkeypatch.setattr(loss_scaling, "GROWTH_STEPS", 2)
    data = make_data(steps=5, batch=16)
    data[0][1][0, 0] = np.inf
    with fed_graph({**PLANS["mirrored"], "memory.mixed_precision": "fp16"}) as (graph, x, y):
        step = v1.train.get_or_create_global_step()
        loss = blocks(2)(x, y)[0]
        train_op = v1.train.GradientDescentOptimizer(0.5).minimize(loss, step)
        saved = v1.train.Saver()._var_list  # pylint: disable=protected-access
        assert [v.name for v in saved] == [v.name for v in v1.global_variables()]
        value = tf.raw_ops.ReadVariableOp(
            resource=graph.get_tensor_by_name("tfpar_loss_scale/scale:0"), dtype=tf.float32)
        seen = []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for xs, ys in zip(*data):
                before = sess.run(v1.trainable_variables())
                sess.run(train_op, {x: xs, y: ys})
                after = sess.run(v1.trainable_variables())
                seen.append((sess.run(value), sess.run(step),
                             all(np.array_equal(a, b) for a, b in zip(before, after))))
    assert seen == [(2.0 ** 15, 1, False), (2.0 ** 14, 1, True), (2.0 ** 14, 2, False),
                    (2.0 ** 15, 3, False), (2.0 ** 15, 4, False)]
    assert not any("tfpar" in v.name for v in saved)


def test_fp16_is_refused_on_cpus_and_bf16_on_gpus():
    """CPUs have no fp16 kernels (and TF's emulation aborts); TF 2.15 has no
    bf16 rewrite for GPUs: both raise at wh.init / planning, naming why."""
    with pytest.raises(wh.PlanError, match="CPUs have no fp16 kernels"):
        train(blocks(1), DATA, {"cluster.num_devices": 2, "memory.mixed_precision": "fp16"})
    with pytest.raises(wh.PlanError, match="rewrites graphs to bf16 for oneDNN CPUs only"):
        precision.check_supported("bf16", "GPU")


@pytest.mark.skipif(BF16, reason="oneDNN computes bf16 on this CPU (see "
                    "test_bf16_trains_like_tensorflows_own_bf16_rewrite)")
def test_bf16_is_refused_where_onednn_computes_none():
    with pytest.raises(wh.PlanError, match="do not compute in bf16 on this CPU"):
        train(blocks(1), DATA, {"cluster.num_devices": 2, "memory.mixed_precision": "bf16"})


def test_gpu_sessions_and_task_calls_turn_on_the_fp16_rewrite():
    """On GPUs fp16 is grappler's auto_mixed_precision: in tfpar's sessions
    and in the config of task function calls that optimize their bodies."""
    runtime = context.Runtime(config=wh.Config({"memory.mixed_precision": "fp16"}),
                              devices=["/gpu:0", "/gpu:1"], device_type="GPU")
    context.activate(runtime)
    try:
        rewriting = engine.session_config(None, tf.Graph()).graph_options.rewrite_options
    finally:
        context.deactivate()
    on = rewriter_config_pb2.RewriterConfig.ON
    assert rewriting.auto_mixed_precision == on
    assert rewriting.auto_mixed_precision_onednn_bfloat16 != on
    call_config = task_functions._call_config  # pylint: disable=protected-access
    call = config_pb2.ConfigProto.FromString(call_config(True, precision.rewrite_option("fp16",
                                                                                         "GPU")))
    assert call.graph_options.rewrite_options.auto_mixed_precision == on


def _two_layers(x, y):
    h = dense(x, 64, "l0", seed=1, activation=tf.nn.relu)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 10, "out", seed=2))
    return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)


def test_the_planners_mixed_precision_is_applied_when_pinned_before_the_graph():
    """The search picks mixed precision for its speed (an fp16 peak 8x the
    fp32 one). Found at the first run, it is refused: the sessions were
    made without it. Pinned at wh.init (as the planning pass pins a
    script's plan), the graph computes in the device type's 16 bits (bf16
    on CPUs): plain TF's bf16 numbers, or a refusal where oneDNN has none."""
    device = {"name": "gpu", "tflops": 10, "memory_gb": 16, "tflops_fp16": 80}
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2, "cluster.hardware": [device],
              "auto.memory_techniques": ["mixed_precision"]}
    plan = plan_of(_two_layers, config, shape=(64, 32))
    assert "needs: mixed_precision" in plan.summary()
    data = make_data(steps=2, batch=64, features=32)
    with pytest.raises(wh.PlanError, match="which the graph's sessions were made without"):
        train(_two_layers, data, config, static_batch=True)
    wh.reset()
    pinned = {**config, "plan": plan.to_dict()}
    if not BF16:
        with pytest.raises(wh.PlanError, match="do not compute in bf16 on this CPU"):
            train(_two_layers, data, pinned, static_batch=True)
        return
    with tensorflow_bf16():
        reference = train(_two_layers, data, static_batch=True)
    assert_equivalent(reference, train(_two_layers, data, pinned, static_batch=True),
                      rtol=2e-2, atol=2e-2)
    graph = tf.Graph()
    with graph.as_default():
        wh.init(pinned)
        x, y = v1.placeholder(tf.float32, [64, 32]), v1.placeholder(tf.int64, [64])
        ran = executed_ops(traced_first_step(_two_layers(x, y)[1],
                                             {x: data[0][0], y: data[1][0]}))
        wh.reset()
    assert devices_casting(ran, "Bf16") == set(CPUS)


@needs_bf16
def test_the_planner_costs_every_plan_in_16_bits_when_the_config_sets_it():
    """memory.mixed_precision with auto_parallel: the graph computes in bf16
    whatever the plan, so the search costs every candidate so, even without
    "mixed_precision" among auto.memory_techniques; its plan then trains at
    the first run with TensorFlow's bf16 numbers (before: it was costed in
    float32, its memory and time over-estimated)."""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2,
              "memory.mixed_precision": "bf16"}
    low, full = (plan_of(_two_layers, c, shape=(64, 32))
                 for c in (config, {k: v for k, v in config.items()
                                    if k != "memory.mixed_precision"}))
    assert "needs: mixed_precision" in low.summary()
    assert "mixed_precision" not in full.estimate.get("memory_techniques", [])
    assert max(low.estimate["memory_bytes_per_device"]) < max(
        full.estimate["memory_bytes_per_device"])
    data = make_data(steps=2, batch=64, features=32)
    with tensorflow_bf16():
        reference = train(_two_layers, data, static_batch=True)
    assert_equivalent(reference, train(_two_layers, data, config, static_batch=True),
                      rtol=2e-2, atol=2e-2)


def test_a_fixed_precision_is_the_only_one_searched():
    assert {t.mixed_precision for t in technique_space(["mixed_precision", "zero"], 2, True)} \
        == {False, True}
    assert {t.mixed_precision for t in technique_space(["zero"], 2, False, True)} == {True}
    assert {t.mixed_precision for t in technique_space([], 2, True, True)} == {True}


@needs_bf16
def test_a_tf2_step_computes_in_bf16_until_reset():
    """tf.functions run with the eager context's grappler options: wh.init
    turns bf16 on there, wh.reset off. Three steps of two tfpar replicas
    leave float32's numbers by bf16's rounding, as TensorFlow's own bf16
    (its option set by hand) does: its task calls rewrite their bodies."""
    out = run_eager("""
def trained(config=None):
    if config is not None:
        wh.init(config)
    layer = tf.keras.layers.Dense(64, kernel_initializer=tf.keras.initializers.GlorotUniform(1))
    hidden = tf.keras.layers.Dense(1, kernel_initializer=tf.keras.initializers.GlorotUniform(2))
    optimizer = tf.keras.optimizers.SGD(0.1)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(hidden(tf.nn.relu(layer(x))) ** 2)
        grads = tape.gradient(loss, layer.trainable_variables + hidden.trainable_variables)
        optimizer.apply_gradients(zip(grads, layer.trainable_variables +
                                      hidden.trainable_variables))

    for _ in range(3):
        step(tf.constant(X[:16]))
    if config is not None:
        print("OPTION", tf.config.optimizer.get_experimental_options().get(OPTION))
        wh.reset()
    return layer.kernel.numpy()

OPTION = "auto_mixed_precision_onednn_bfloat16"
tfpar = trained({"cluster.num_devices": 2, "memory.mixed_precision": "bf16"})
print("RESET", tf.config.optimizer.get_experimental_options().get(OPTION))
fp32 = trained()
tf.config.optimizer.set_experimental_options({OPTION: True})
bf16 = trained()
print("TO BF16 %.2g" % np.abs(tfpar - bf16).max(), "TO FP32 %.2g" % np.abs(tfpar - fp32).max())
""")
    assert "OPTION True" in out and "RESET None" in out and "one device" not in out, out
    to_bf16, to_fp32 = (float(out.split(key)[1].split()[0]) for key in ("TO BF16", "TO FP32"))
    # float32 on two replicas is plain TF's within 1e-7 (3e-8 seen, bf16 off)
    assert to_fp32 > 1e-6 and to_bf16 < 1e-3, out
