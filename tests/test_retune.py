"""Ada-Grouper's online tuning of k (§5.2, §5.4): with pipeline.group_size
'auto', profiled steps move k when the network's transfer time changes; the
pipeline of each k is built once; the numbers stay single-device."""
import time

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.framework import ops

import test_entry_points as entry_points
from equivalence import assert_equivalent, make_data, train
from proof import TRACER
from test_pipeline import DATA, assert_follows, mlp_stages

import tfpar as wh
from tfpar.hooks.capture import recording_paused
from tfpar.runtime.graph_state import existing_state
from tfpar.planner.grouper import group_lengths, preferred_group_size, profile_pipeline
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import simulate
from tfpar.rewriters import graph_edit
from tfpar.runtime import engine
from tfpar.runtime.retune import GroupRetuner

v1 = tf.compat.v1
STAGES, MICRO, ROWS, WIDTH = 4, 8, 256, 512
DELAY_S = 0.04
SLOW_STEPS = range(6, 12)  # the link is slow for these steps (of 18)
FORWARD, BACKWARD = [1.0, 2.0, 1.5], [2.0, 3.0, 2.5]
MEMORY = dict(fixed_bytes=[0.0] * 3, activation_bytes=[1.0] * 3, memory_limit=100.0)


@pytest.mark.parametrize("k,transfer", [(1, 0.7), (2, 0.7), (3, 4.0), (6, 0.0)])
def test_a_profile_recovers_stage_and_transfer_times(k, transfer):
    """From a step's timed tasks: every stage's times and the transfer time,
    whether 1F1B waits for every transfer or kFkB hides most of them."""
    result = simulate(build_schedule("kfkb", 3, 6, k), FORWARD, BACKWARD, transfer)
    profile = profile_pipeline(result.tasks, 3)
    assert profile.forward == pytest.approx(FORWARD) and profile.backward == pytest.approx(BACKWARD)
    assert profile.transfer == pytest.approx(transfer) and profile.samples > 0
    assert profile.length == pytest.approx(result.length)


def test_tolerance_prefers_the_smallest_k_nearly_as_short():
    lengths = {1: 10.4, 2: 10.2, 3: 10.0, 4: 10.0}
    assert preferred_group_size(lengths) == 3
    assert preferred_group_size(lengths, tolerance=0.05) == 1
    assert preferred_group_size(lengths, tolerance=0.03) == 2


def test_the_retuner_follows_the_network():
    """Simulated steps (the planner's model, no TensorFlow): a slow network
    moves k up to the best k for it, a fast one back to 1F1B; steps between
    profiles are not profiled."""
    retuner = GroupRetuner(6, 3, 1, every=3, tolerance=0.05, **MEMORY)
    forward, backward = [1.0] * 3, [2.0] * 3  # like stages: without transfers 1F1B is best

    def run_steps(transfer):
        decisions = []
        for _ in range(3):
            if retuner.profile_due():
                result = simulate(build_schedule("kfkb", 3, 6, retuner.group_size), forward,
                                  backward, transfer)
                decisions.append(retuner.profiled(result.tasks))
        return decisions

    assert run_steps(0.01) == [None]
    slow = preferred_group_size(group_lengths(6, forward, backward, 4.0, **MEMORY), 0.05)
    assert slow > 1 and run_steps(4.0) == [slow] and run_steps(4.0) == [None]
    assert run_steps(0.01) == [1]
    assert [(r.before, r.after) for r in retuner.history] == [(1, 1), (1, slow), (slow, slow),
                                                                (slow, 1)]
    assert retuner.history[1].profile.transfer == pytest.approx(4.0)


def wide_stages(tfpar):
    """build(x, y): a 4-stage tanh MLP of WIDTH units per stage, wide enough
    that a stage computes for longer than a transfer between CPU devices takes."""
    return mlp_stages(STAGES, tfpar, lambda: v1.train.GradientDescentOptimizer(0.1),
                      units=WIDTH)


class SlowLink:
    """Delays every cross-stage transfer of the rewritten pipeline by
    ``delay`` seconds (a sleep on the receiving device) while it is set: a
    preempted network. Versions of other k copy the sleeps with the tasks."""

    def __init__(self, monkeypatch):
        self.delay = 0.0
        self.links = 0
        rewrite = engine._rewrite

        def rewrite_with_slow_links(graph, capture, rt):
            rewrite(graph, capture, rt)
            rw = existing_state(graph).rewrite.rewrite
            stage = {op: key[1] for key, members in rw.task_ops.items() for op in members}
            with graph_edit.unfinalized(graph), graph.as_default(), recording_paused():
                for consumer, s in stage.items():
                    for k, t in enumerate(consumer.inputs):
                        if stage.get(t.op, s) != s:
                            with ops.device(consumer.device):
                                late = tf.numpy_function(self._sleep, [t], t.dtype)
                            late.set_shape(t.shape)
                            graph_edit.update_input(consumer, k, late)
                            self.links += 1
        monkeypatch.setattr(engine, "_rewrite", rewrite_with_slow_links)

    def _sleep(self, x):
        time.sleep(self.delay)
        return x


def test_a_slow_link_moves_k_up_and_back_building_each_pipeline_once(monkeypatch):
    """A 4-stage pipeline of 8 micro-batches, k 'auto', profiled every 3
    steps: while the links are slow, k grows, and a traced step follows the
    new kFkB schedule; when they are fast again k goes back without building
    anything. Every step computes the single-device numbers."""
    data = make_data(steps=18, batch=MICRO * ROWS, features=WIDTH)
    link = SlowLink(monkeypatch)
    config = {"cluster.num_devices": STAGES, "pipeline.num_micro_batch": MICRO,
              "pipeline.schedule": "kfkb", "pipeline.group_size": "auto",
              "pipeline.retune_steps": 3}
    xs, ys = data
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, WIDTH])
        y = v1.placeholder(tf.int64, [None])
        loss, train_op = wide_stages(True)(x, y)
        variables = v1.global_variables()
        losses, sizes, metadata = [], [], v1.RunMetadata()
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            for step in range(len(xs)):
                link.delay = DELAY_S if step in SLOW_STEPS else 0.0
                traced = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE)
                losses.append(sess.run([loss, train_op], {x: xs[step], y: ys[step]},
                                       options=traced if step == 10 else None,
                                       run_metadata=metadata if step == 10 else None)[0])
                sizes.append(len(graph.get_operations()))
                if step == 10:  # the traced step: what the slow link's k ran
                    timeline = wh.step_timeline(metadata, graph=graph)
                    devices = wh.step_devices(metadata, graph=graph)
            values = {v.op.name: value for v, value in zip(variables, sess.run(variables))}
        state = existing_state(graph)
        history = state.retuner.history
        plan = wh.current_plan()
    wh.reset()
    assert link.links >= 2 * (STAGES - 1) * MICRO
    # Profiled at steps 3 and 6 (fast links), 9 and 12 (slow), 15 and 18 (fast).
    assert [r.step for r in history] == [3, 6, 9, 12, 15, 18]
    assert all(a.after == b.before for a, b in zip(history, history[1:]))
    slow_profiles = [r.profile.transfer for r in history[2:4]]
    fast_profiles = [r.profile.transfer for r in history[:2] + history[4:]]
    assert min(slow_profiles) > 0.8 * DELAY_S * 1e6 > 4 * max(fast_profiles)  # microseconds
    slow = history[2].after
    assert slow > history[2].before and history[3].after == slow  # up when the link slows
    assert history[4].after < slow  # down when it is fast again
    # Each k's pipeline is built once, when k first moves to it: ops are added
    # at the first step only, and at the profiled step moving to a new k and
    # the step after it (the version's copies of what the step fetches).
    known, building = {history[0].before}, set()
    for r in history:
        if r.after not in known:
            building |= {r.step - 1, r.step}
        known.add(r.after)
    assert {i for i in range(1, len(sizes)) if sizes[i] != sizes[i - 1]} <= building
    assert set(state.rewrite.versions) == known and len(known) >= 2
    assert_follows(timeline, build_schedule("kfkb", STAGES, MICRO, slow))
    assert {d for per in devices.values() for d in per} >= {f"CPU:{i}" for i in range(STAGES)}
    assert plan.group_size == history[-1].after
    plain = train(wide_stages(False), data)
    assert_equivalent(plain, (losses, values), rtol=1e-5, atol=1e-5)


def test_tf2_steps_keep_the_planned_k_and_say_so(monkeypatch):
    """Online tuning profiles Session.run steps: a tf.function step keeps k,
    with a warning naming the key, and trains as before."""
    from test_tf2 import assert_same_training, plain as plain_tf2, run_script
    monkeypatch.setenv("TFPAR_PIPELINE_SCHEDULE", "kfkb")
    monkeypatch.setenv("TFPAR_PIPELINE_GROUP_SIZE", "auto")
    got, stderr = run_script("pipeline", 2)
    assert "pipeline.retune_steps (online tuning of kFkB's k): k stays" in stderr
    assert "tf.function" in stderr
    assert_same_training(plain_tf2("pipeline"), got)


RETUNED = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 2, "pipeline.schedule": "kfkb",
           "pipeline.group_size": "auto", "pipeline.retune_steps": 2}


@pytest.fixture
def retuners(monkeypatch):
    """The online tuners tfpar makes in the test; test_entry_points' pipeline
    mode runs RETUNED."""
    made = []
    make = engine._retuner

    def recorded(*args):
        made.append(make(*args))
        return made[-1]
    monkeypatch.setattr(engine, "_retuner", recorded)
    monkeypatch.setitem(entry_points.CONFIGS, "pipeline", RETUNED)
    return made


@pytest.mark.parametrize("session", ["plain", "monitored"])
def test_tfpar_traces_the_steps_it_profiles(session, retuners):
    """Without RunOptions from the script (nor the proof tracer of this
    suite), tfpar traces every retune_steps-th step itself, in a Session or a
    MonitoredTrainingSession loop."""
    TRACER.uninstall()
    losses, _ = train(mlp_stages(2, True), DATA, RETUNED, session=session)
    assert [r.step for r in retuners[0].history] == [2]
    assert [len(r.profile.forward) for r in retuners[0].history] == [2]
    np.testing.assert_allclose(losses, train(mlp_stages(2, False), DATA)[0], rtol=1e-5)


@pytest.mark.estimator
def test_an_estimator_is_tuned_online(retuners, tmp_path):
    """Estimator.train runs Session.run steps: they are profiled (steps 2 and
    4 of 4), and train, evaluate and predict give the plain numbers
    (test_entry_points' test, in its pipeline mode). The evaluation graph
    (its model_fn builds a train op too) runs forward tasks only: no profile."""
    entry_points.test_estimator_train_evaluate_predict("pipeline", tmp_path)
    assert [[r.step for r in t.history] for t in retuners if t is not None] == [[2, 4], []]


def test_keras_fit_keeps_the_planned_k_and_says_so(retuners):
    """Keras fit runs its steps through a Session callable, whose fetches are
    fixed: tfpar says k stays, and fit trains as plainly."""
    with pytest.warns(wh.FallbackWarning, match="k stays 1 as planned: the training step runs "
                      "through a Session callable"):
        entry_points.test_keras_fit_and_evaluate("pipeline")
    assert all(not t.history for t in retuners if t is not None)


@pytest.mark.horovod
def test_horovod_keeps_the_planned_k_and_says_so(retuners):
    """Each Horovod process runs its own session: they would each choose a k."""
    with pytest.warns(wh.FallbackWarning, match="k stays .* as planned: each Horovod process"):
        losses, _ = train(mlp_stages(2, True), DATA, {**RETUNED,
                                                      "communication.backend": "horovod"})
    assert retuners == [None]
    np.testing.assert_allclose(losses, train(mlp_stages(2, False), DATA)[0], rtol=1e-5)


@pytest.mark.parametrize("functions", [True, False])
def test_another_k_computes_the_same_numbers_and_follows_its_schedule(functions):
    """The pipeline of another k, built after steps ran (as the tuner builds
    it), with task functions or a copy of each stage per micro-batch: a
    traced step runs its kFkB schedule, every step the single-device numbers,
    and going back to the first k builds nothing."""
    config = {**RETUNED, "pipeline.num_micro_batch": 4, "pipeline.group_size": 1,
              "pipeline.task_functions": functions}
    del config["pipeline.retune_steps"]  # k is fixed: the test moves it itself
    xs, ys = DATA
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        x = v1.placeholder(tf.float32, [None, 6])
        y = v1.placeholder(tf.int64, [None])
        loss, train_op = mlp_stages(2, True)(x, y)
        variables = v1.global_variables()
        traced, metadata, losses = v1.RunOptions(trace_level=v1.RunOptions.FULL_TRACE), \
            v1.RunMetadata(), []
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            translator = existing_state(graph).rewrite
            for step, k in enumerate([1, 4, 1]):
                built = translator.use_group_size(k, build_schedule("kfkb", 2, 4, k))
                assert built == (step == 1)
                losses.append(sess.run([loss, train_op], {x: xs[step], y: ys[step]},
                                       options=traced, run_metadata=metadata)[0])
                assert_follows(wh.step_timeline(metadata, graph=graph),
                               build_schedule("kfkb", 2, 4, k))
            values = {v.op.name: value for v, value in zip(variables, sess.run(variables))}
    wh.reset()
    assert_equivalent(train(mlp_stages(2, False), DATA), (losses, values))
