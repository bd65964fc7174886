"""TF2 scripts under ``wh.init()`` (issue 13): a tf.function training step
called from eager code (tf.GradientTape or tf.gradients, Keras optimizers new
and legacy; Keras ``fit`` / ``evaluate`` / ``predict``) is rewritten like a
graph before TensorFlow makes it a function, and trains with the
single-device numbers on every device. What tfpar does not parallelise trains
as without tfpar, and tfpar says once that it runs on one device.

The equivalence tests run ``tf2_script.py`` in fresh processes (TensorFlow
makes logical CPU devices only before its first op; this suite runs in graph
mode). The others run their script eagerly inside ``context.eager_mode()``."""
import functools
import json
import os
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.eager import context

import tfpar as wh
from tfpar.runtime.context import active
import warm_python

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf2_script.py")
RNG = np.random.RandomState(0)
X, Y = RNG.randn(40, 4).astype(np.float32), RNG.randn(40, 2).astype(np.float32)


def run_script(scenario: str, devices: int, late_init: bool = False, directory=None,
               restore=None, resume=None):
    """(results, stderr) of ``tf2_script.py`` in a fresh process."""
    done = warm_python.run([sys.executable, SCRIPT, scenario, str(devices)]
                           + (["--late-init"] if late_init else [])
                           + (["--dir", str(directory)] if directory else [])
                           + (["--restore", str(restore)] if restore else [])
                           + (["--resume", str(resume)] if resume else []),
                           capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


PARALLEL = [
    ("tape_adam", 2), ("tape_adam", 4), ("tape_legacy_adam", 2), ("gradients_adam", 4),
    ("pipeline", 2), ("pipeline", 4), ("pipeline_fit", 2), ("pipeline_fit", 4),
    ("fit", 2), ("fit", 4), ("next_in_step", 2), ("split", 2), ("split", 4),
    ("split_gradients", 2), ("split_fit", 2), ("split_fit", 4),
    ("functional_pipeline_fit", 2), ("functional_pipeline_fit", 4), ("functional_split_fit", 2),
    ("split_mixed_fit", 2), ("made_in_stages", 4), ("pipeline_interleaved", 2),
    ("made_in_first_trace", 2)]


@functools.lru_cache(maxsize=None)
def batch(devices: int) -> dict:
    """scenario -> {"plain", "tfpar"} of every scenario of ``PARALLEL`` on
    ``devices`` CPUs, trained plainly and with tfpar in one process
    (``tf2_script.py --batch``: a process per scenario cost ~4 s each). Plain
    runs use one device: beyond 2 devices, those the 2-device batch made are
    given to the script rather than trained again."""
    scenarios = [s for s, d in PARALLEL if d == devices]
    known = []
    if devices != 2:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump({s: run["plain"] for s, run in batch(2).items()}, f)
        known = ["--plain", f.name]
    try:
        done = warm_python.run([sys.executable, SCRIPT, "--batch", str(devices), *known,
                                *scenarios], capture_output=True, text=True, timeout=600)
    finally:
        if known:
            os.remove(known[1])
    assert done.returncode == 0, done.stderr[-4000:]
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {run["scenario"]: run for run in runs}


@functools.lru_cache(maxsize=None)
def plain(scenario: str):
    """The scenario without tfpar (a pipeline's or an automatic plan's: the same
    loop without scopes or config): the 2-device batch's if it ran already,
    else a process of its own."""
    alike = "tape_adam" if scenario in ("pipeline", "pipeline_interleaved", "auto") else scenario
    if batch.cache_info().currsize:
        return batch(2)[alike]["plain"]
    return run_script(alike, 0)[0]


def assert_same_training(expected, got):
    np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5, atol=1e-6)
    assert not np.isclose(expected["losses"][0], expected["losses"][1]), "nothing trained"
    for a, b in zip(expected["weights"], got["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def assert_parallelised(got, devices: int) -> list:
    """The script's step ran on each of ``devices`` CPUs, as its
    ``wh.current_plan()`` says (a step tfpar left alone runs on one); returns
    those devices."""
    planned = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(devices)]
    assert set(planned) <= set(got["devices"]), (
        f"the step was never parallelised: work ran only on {got['devices']}")
    assert set(got["planned"]) == set(planned), "wh.current_plan() is not the plan that ran"
    return planned


@pytest.mark.parametrize("scenario,devices", PARALLEL)
def test_a_tf2_step_trains_in_parallel_with_the_single_device_numbers(scenario, devices):
    """Before: wh.init() switched TensorFlow to graph mode, every step(x, y)
    returned a symbolic tensor and nothing trained, without a word. A split
    head in a TF2 step was refused, and so was a scope around building a
    model in eager code."""
    got = batch(devices)[scenario]["tfpar"]
    assert_same_training(batch(devices)[scenario]["plain"], got)
    planned = assert_parallelised(got, devices)
    if scenario == "pipeline_interleaved":  # both stages on one group, copied on each device
        assert got["strategies"] == [["replicate", devices]] * 2, got["strategies"]
    elif "pipeline" in scenario or scenario == "made_in_stages":  # two stages, each data parallel
        assert got["strategies"] == [["replicate", devices // 2]] * 2, got["strategies"]
    if "split" in scenario:
        assert ["split", devices] in got["strategies"], got["strategies"]
        assert got["shard_devices"] == [planned], "the head's kernel is not one shard per device"
        assert got["slot_devices"] == [[d] for d in planned], "a shard's slots are off its device"
        # A V100 and a P100: 8 classes cut 5 / 3 by speed (Whale §3.3.1); else 4 / 4.
        assert got["shard_widths"] == ([[5, 3]] if "mixed" in scenario else
                                       [[8 // devices] * devices]), got["shard_widths"]


def test_auto_parallel_plans_a_tf2_step_once_and_trains_with_the_single_device_numbers():
    """The step is traced three times (static batch, relaxed, the last smaller
    batch); the search runs once in the planning pass and once in the script,
    which says nothing the pass said (issue 64 item 6: its progress lines
    were printed twice)."""
    got, log = run_script("auto", 4)
    assert_same_training(plain("auto"), got)
    assert got["strategies"] == [["replicate", 4]], "a small MLP is data parallel"
    assert len(set(got["devices"])) == 4
    assert "tfpar auto: planning pass" in log
    assert log.count("tfpar auto [1/") == 1, log


def test_current_plan_before_the_first_step_of_an_eager_script_says_what_to_do():
    """Before: wh.current_plan() in eager code planned the empty global graph
    and failed with an IndexError deep in the planner."""
    with context.eager_mode():
        wh.init({"cluster.num_devices": 2})
        with pytest.raises(wh.PlanError, match="no training step of this eager script"):
            wh.current_plan()


@pytest.mark.parametrize("scenario,devices", [("tape_adam", 2), ("pipeline", 4)])
def test_a_checkpoint_of_a_parallel_tf2_run_restores_into_a_plain_model(tmp_path, scenario,
                                                                         devices):
    """The variables are the script's own: tf.train.Checkpoint saves and
    restores them as without tfpar. The run is parallel (its step ran on
    every device) and trained with the single-device numbers; the plain
    model restores exactly the weights it ended with."""
    got, _ = run_script(scenario, devices, directory=tmp_path)
    assert_parallelised(got, devices)
    assert_same_training(plain(scenario), got)
    with context.eager_mode():
        net = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                   tf.keras.layers.Dense(3)])
        checkpoint = tf.train.Checkpoint(model=net, optimizer=tf.keras.optimizers.Adam(0.01))
        status = checkpoint.restore(tf.train.latest_checkpoint(str(tmp_path)))
        status.assert_existing_objects_matched().expect_partial()  # slots come at a first step
        restored = [w.numpy() for w in net.weights]
    assert len(restored) == len(got["weights"])
    for a, b in zip(got["weights"], restored):
        np.testing.assert_array_equal(b, np.asarray(a, np.float32))


def test_a_split_head_checkpoint_is_interchangeable_with_a_plain_one(tmp_path):
    """A split weight saves as one value under its single-device key and full
    shape: the split run's checkpoint restores into a plain model, and a plain
    run's into the split model's shards."""
    plain_dir, split_dir = tmp_path / "plain", tmp_path / "split"
    expected, _ = run_script("split", 0, directory=plain_dir)
    got, _ = run_script("split", 2, directory=split_dir, restore=plain_dir)
    for a, b in zip(expected["weights"], got["restored"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    with context.eager_mode():
        net = tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                   tf.keras.layers.Dense(8)])
        status = tf.train.Checkpoint(model=net).restore(tf.train.latest_checkpoint(str(split_dir)))
        status.assert_existing_objects_matched().expect_partial()
        restored = [w.numpy() for w in net.weights]
    for a, b in zip(expected["weights"], restored):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_optimizer_state_of_a_split_head_resumes_across_plans(tmp_path):
    """Keras numbers an optimizer's slots; a split weight's shards each have
    theirs, so a checkpoint regroups them as the whole weight's. Training
    resumed from a checkpoint (restored before the first step) continues as
    the plain run resumed from a plain checkpoint, whichever plans wrote and
    read it; with the slots restored to zero, Adam's steps would differ.
    Before: plain -> split failed on shapes, and the slots' numbers shifted."""
    plain_dir, split_dir = tmp_path / "plain", tmp_path / "split"
    run_script("split", 0, directory=plain_dir)
    run_script("split", 2, directory=split_dir)
    expected, _ = run_script("split", 0, directory=tmp_path / "a", resume=plain_dir)
    fresh = plain("split")
    assert not np.allclose(expected["losses"], fresh["losses"]), "the resume changed nothing"
    for devices, source in ((2, plain_dir), (0, split_dir), (4, split_dir)):
        got, _ = run_script("split", devices, directory=tmp_path / str(devices), resume=source)
        np.testing.assert_allclose(got["losses"], expected["losses"], rtol=1e-5, atol=1e-6,
                                   err_msg=f"{devices} devices resumed from {source.name}")
        for a, b in zip(expected["weights"], got["weights"]):
            np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


def test_an_optimizer_built_before_its_layer_is_split_is_refused_by_name():
    with context.eager_mode():
        wh.init({"cluster.num_devices": 2})
        head = tf.keras.layers.Dense(4, name="head")
        head.build((None, 4))
        optimizer = tf.keras.optimizers.Adam()
        optimizer.build(head.trainable_variables)
        with pytest.raises(wh.ShardingError, match="optimizer 'Adam' made its slots for "
                                                   "'kernel:0' whole before layer 'head'"):
            _split_step(lambda: head)(tf.constant(X))


def run_eager(code: str) -> str:
    """The stdout and stderr of ``code`` run in a fresh process after a TF2
    prelude (numpy, tensorflow, tfpar, X; tfpar's log to stderr): this
    suite's eager context has one device, made before any test ran."""
    prelude = ("import logging, sys\nimport numpy as np\nimport tensorflow as tf\n"
               "import tfpar as wh\n"
               "logging.getLogger('tfpar').addHandler(logging.StreamHandler(sys.stderr))\n"
               "X = np.random.RandomState(0).randn(40, 4).astype(np.float32)\n")
    done = warm_python.run([sys.executable, "-c", prelude + code], capture_output=True,
                           text=True, timeout=300, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout + done.stderr


SPLIT_STEP = """
def split_step(head, optimizer=None):
    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with wh.split(2):
                loss = tf.reduce_sum(head(x))
        grads = tape.gradient(loss, head.trainable_variables)
        if optimizer is not None:
            optimizer.apply_gradients(zip(grads, head.trainable_variables))
    return step
"""


def test_a_legacy_optimizer_says_it_does_not_save_the_slots_of_split_weights():
    out = run_eager(SPLIT_STEP + """
wh.init({"cluster.num_devices": 2})
head = tf.keras.layers.Dense(4, name="head")
split_step(head, tf.keras.optimizers.legacy.Adam())(tf.constant(X))
""")
    assert "checkpoints of legacy optimizer 'Adam' to hold its slots ('m') of split weight " \
        "'head/kernel:0': it keeps them by shard, and checkpoints do not save them" in out


def _split_step(make_head):
    """A TF2 step calling ``make_head()``'s layer on X in ``wh.split(2)``."""
    head = make_head()

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            with wh.split(2):
                loss = tf.reduce_sum(head(x))
        return tape.gradient(loss, head.trainable_variables)
    return step


def test_a_split_head_narrower_than_its_devices_is_refused_by_name():
    with context.eager_mode():
        wh.init({"cluster.num_devices": 2})
        step = _split_step(lambda: tf.keras.layers.Dense(1, name="narrow"))
        with pytest.raises(wh.ShardingError, match=r"cannot cut 'kernel' \(shape \[4, 1\]\) "
                                                   r"into 2 slices along axis 1"):
            step(tf.constant(X))


@pytest.mark.parametrize("scope", [wh.split, wh.replicate])
def test_a_scope_in_eager_code_without_keras_layers_says_it_changes_nothing(scope):
    with context.eager_mode(), pytest.warns(
            wh.FallbackWarning, match=rf"{scope.__name__}\(2\) around eager code: no Keras layer "
            "was made or called in it, so it changes nothing"):
        wh.init({"cluster.num_devices": 2})
        with scope(2):
            tf.constant(1.0) + 1.0


def test_a_layer_called_in_two_eager_scopes_is_refused_by_name():
    """A functional model's layer belongs to one TaskGraph of each step."""
    with context.eager_mode():
        wh.init({"cluster.num_devices": 2})
        inputs, shared = tf.keras.Input((4,)), tf.keras.layers.Dense(4, name="shared")
        with wh.replicate(1):
            hidden = shared(inputs)
        with pytest.raises(wh.AnnotationError, match=r"layer 'shared' is called in replicate\(1\) "
                                                     r"and again in replicate\(1\)"):
            with wh.replicate(1):
                shared(hidden)


def test_a_layer_of_an_eager_scope_called_inside_another_step_scope_is_refused_by_name():
    """Inside a scope of the same kind it joins that scope (a model's call
    opens the scope in the step as it did when the model was called eagerly)."""
    out = run_eager(SPLIT_STEP + """
wh.init({"cluster.num_devices": 2})
with wh.split(2):
    same = tf.keras.layers.Dense(4, name="same")
with wh.replicate(1):
    head = tf.keras.layers.Dense(4, name="head")
split_step(same)(tf.constant(X))
print("shards:", [shard.device[-5:] for shard in same.kernel])
try:
    split_step(head)(tf.constant(X))
except wh.AnnotationError as error:
    print("refused:", error)
""")
    assert "shards: ['CPU:0', 'CPU:1']" in out
    assert "refused: tfpar: Keras layer 'head' was made or called in replicate(1) and is now " \
        "called inside another scope" in out


def test_get_variable_in_a_split_scope_of_a_tf2_step_is_refused_by_name():
    class GetVariable(tf.Module):
        def __call__(self, x):
            w = tf.compat.v1.get_variable("w", [4, 2])
            return tf.matmul(x, w)

    with context.eager_mode():
        wh.init({"cluster.num_devices": 2})
        with pytest.raises(wh.ShardingError, match="variable 'w' is made with "
                                                   "tf.compat.v1.get_variable inside wh.split"):
            _split_step(GetVariable)(tf.constant(X))


def test_wh_init_after_the_first_op_trains_on_one_device_and_says_why():
    """Issue 64 item 3: wh.current_plan() then said that no training step had
    been traced yet; it now returns the plan that ran: one device, and why."""
    got, log = run_script("tape_adam", 2, late_init=True)
    assert_same_training(plain("tape_adam"), got)
    assert "the tf.function 'step', data parallel over 2 devices: it trains on one device" in log
    assert "Call wh.init() before the script runs its first TensorFlow op" in log
    assert got["strategies"] == [["replicate", 1]], got["strategies"]
    assert got["planned"] == ["/job:localhost/replica:0/task:0/device:CPU:0"]
    assert any("it trains on one device" in note for note in got["notes"]), got["notes"]


def _trained_w(train_w, config):
    """``w`` (4 x 2, ones) after ``train_w(w, SGD)`` in eager code, under
    tfpar with ``config`` (None: without)."""
    with context.eager_mode():
        if config is not None:
            wh.init(config)
        w = tf.Variable(tf.ones([4, 2]))
        train_w(w, tf.keras.optimizers.SGD(0.1))
        wh.reset()
        return w.numpy()


def _assert_trains_as_without_tfpar(train_w):
    np.testing.assert_array_equal(_trained_w(train_w, None),
                                  _trained_w(train_w, {"cluster.num_devices": 2}))


def test_eager_gradients_outside_functions_train_as_without_tfpar_and_say_so(fallbacks):
    """And wh.current_plan() says what ran: one device (issue 64 item 3:
    before, "no training step ... has been traced yet")."""
    plans = []

    def train_w(w, opt):
        for _ in range(3):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(X, w) - Y))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        if active() is not None:  # under tfpar
            plans.append(wh.current_plan())
    _assert_trains_as_without_tfpar(train_w)
    assert "eager code, data parallel over 2 devices: it trains on one device" in \
        fallbacks.getvalue()
    assert [(tg.strategy, len(tg.devices)) for tg in plans[0].task_graphs] == [("replicate", 1)]
    assert plans[0].data_parallel_degree == 1
    assert any("eager code, data parallel over 2 devices: it trains on one device" in note
               for note in plans[0].notes), plans[0].notes


def test_a_dataset_loop_inside_a_step_trains_as_without_tfpar_and_says_so(fallbacks):
    """Gradients inside the step's own loop (a While body) are not at its top
    level: the step runs on one device, and tfpar says why and what to do."""
    def train_w(w, opt):
        ds = tf.data.Dataset.from_tensor_slices((X, Y)).batch(10)

        @tf.function
        def epoch():
            for x, y in ds:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
                opt.apply_gradients([(tape.gradient(loss, w), w)])
        epoch()
    _assert_trains_as_without_tfpar(train_w)
    assert "the tf.function 'epoch" in fallbacks.getvalue()
    assert "inside a loop, branch or tf.function within the step" in fallbacks.getvalue()


def test_a_tf_function_called_in_a_graph_mode_script_says_it_runs_on_one_device(fallbacks):
    """Before: its gradients were ignored by the hooks, and it trained on one
    device without a word."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        w = tf.Variable(tf.ones([4, 2]))

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
            w.assign_sub(0.1 * tape.gradient(loss, w))
            return loss

        loss = step(tf.constant(X), tf.constant(Y))
        with tf.compat.v1.Session() as sess:
            sess.run(w.initializer)
            first, second = sess.run(loss), sess.run(loss)
    assert second < first
    assert "the tf.function 'step', data parallel over 2 devices: it trains on one device" in \
        fallbacks.getvalue()
    assert "not one built into a graph" in fallbacks.getvalue()


def _model():
    return tf.keras.Sequential([tf.keras.layers.Dense(8, activation="relu", input_shape=(4,)),
                                tf.keras.layers.Dense(2)])


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "graph"])
def test_a_seed_set_before_wh_init_still_decides_the_initial_weights(eager):
    """Issue 19 item 5: before, wh.init() switched TensorFlow to graph mode, and
    a seed set before it no longer reached the model. It now leaves the
    execution mode alone (a TF1 script switches to graph mode itself)."""
    def initial_weights(with_tfpar):
        tf.keras.utils.set_random_seed(11)
        if with_tfpar:
            wh.init({"cluster.num_devices": 2})
        assert tf.executing_eagerly() == eager
        model = _model()
        if eager:
            weights = [w.numpy() for w in model.weights]
        else:
            with tf.compat.v1.Session() as sess:
                sess.run(tf.compat.v1.global_variables_initializer())
                weights = sess.run(model.weights)
        wh.reset()
        return weights

    def in_mode(with_tfpar):
        if eager:
            with context.eager_mode():
                return initial_weights(with_tfpar)
        with tf.Graph().as_default():
            return initial_weights(with_tfpar)
    for a, b in zip(in_mode(False), in_mode(True)):
        np.testing.assert_array_equal(a, b)


def test_on_one_device_the_step_runs_as_traced():
    """One device, whole batches: every plan is the step itself, so tfpar
    neither traces it again with the batch relaxed nor rewrites it (the
    benchmark's tfpar1_loop started in 2.0 s instead of plain TF2's 1.1 s),
    and wh.current_plan() still describes it."""
    traces, plans = [], []

    def train_w(w, opt):
        @tf.function
        def step(x, y):
            traces.append(x.shape[0])
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(tf.matmul(x, w) - y))
            opt.apply_gradients([(tape.gradient(loss, w), w)])
        for _ in range(2):
            step(tf.constant(X), tf.constant(Y))
        if plans == ["tfpar"]:
            plans[0] = wh.current_plan()
    plain = _trained_w(train_w, None)
    plain_traces = list(traces)
    traces.clear()
    plans.append("tfpar")
    np.testing.assert_array_equal(_trained_w(train_w, {"cluster.num_devices": 1}), plain)
    assert traces == plain_traces and None not in traces, "traced again with the batch relaxed"
    assert [(tg.strategy, len(tg.devices)) for tg in plans[0].task_graphs] == [("replicate", 1)]


@pytest.mark.parametrize("setting,refusal", [
    ('"memory.offload_optimizer": True',
     "memory.offload_optimizer cannot move the variables of a tf.function step"),
    ('"memory.zero": 1', "memory.zero cannot place the optimizer state of a tf.function step"),
    ('"memory.mixed_precision": "fp16"',
     "memory.mixed_precision 'fp16' cannot loss-scale a tf.function step"),
], ids=["offload", "zero", "fp16"])
def test_what_tfpar_builds_into_the_graph_of_a_tf2_step_is_refused_by_name(setting, refusal):
    """A tf.function step's variables were made eagerly before tfpar rewrote
    the step, so their optimizer state cannot move to the host or be sharded
    over replicas; fp16's loss scaling is built into graphs as they are
    built: memory.offload_optimizer, memory.zero and fp16 raise, naming why,
    instead of training without them (fp16 with the CPU's refusal lifted,
    as ``test_mixed_precision`` tests its loss scaling)."""
    out = run_eager("""
from tfpar.runtime import precision
precision.check_supported = lambda *args: None
wh.init({"cluster.num_devices": 2, %s})
layer = tf.keras.layers.Dense(2)
optimizer = tf.keras.optimizers.SGD(0.1)

@tf.function
def step(x):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(layer(x) ** 2)
    grads = tape.gradient(loss, layer.trainable_variables)
    optimizer.apply_gradients(zip(grads, layer.trainable_variables))

try:
    step(X[:8])
    print("TRAINED")
except wh.PlanError as error:
    print("REFUSED", error)
""" % setting)
    assert f"REFUSED tfpar: {refusal}" in out, out
    assert "TRAINED" not in out
