"""ZeRO over mirrored replicas (``memory.zero``, issue 15): the same numbers
as plain TF; in a traced step every variable's optimizer update runs on one
device, the one holding its slots, the others copy its new value, and with
stage 2 no gradient is all-reduced. The planner applies the stage it chose."""
import functools
import logging
import re

import numpy as np
import pytest
import tensorflow as tf

from equivalence import (assert_equivalent, assert_same_variables, checkpoint_session, fed_graph,
                         initialized, make_data, plan_of, traced_first_step, train,
                         variable_values)
import tfpar as wh
from test_expert_plans import gpt_loss
from test_memory_techniques import adam, blocks
from tfpar.runtime.step_trace import executed_ops

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=16)
MIRRORED = {"cluster.num_devices": 2, "communication.backend": "collective"}
ADAM_SLOTS = ("/Adam", "/Adam_1")


def traced_step(config, build):
    """(the rewritten graph's ops by name, op name -> devices it ran on) of one
    traced step of ``build``."""
    with fed_graph(config) as (graph, x, y):
        _, train_op = build(x, y)
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
        return {op.name: op for op in graph.get_operations()}, executed_ops(metadata)


def assert_sharded(config, build, stage, devices, stages=(0,)):
    """In a traced step of ``build`` under ``config``: each Adam slot exists
    once, both of a variable's slots on the device its update ran on (one);
    every one of ``devices`` owns some slots; each variable's new value is
    copied to the other devices of its stage (``stages``: the devices are split
    evenly among them); stage 2 all-reduces no gradient, stage 1 does."""
    graph_ops, ran = traced_step(config, build)
    updates = {name: op for name, op in graph_ops.items() if op.type == "ResourceApplyAdam"}
    owners = {}
    for name, op in updates.items():
        assert len(ran[name]) == 1, (name, ran[name])
        slots = [t.op for t in op.inputs[1:3]]
        assert [s.name[len(s.name) - len(suffix):] for s, suffix in zip(slots, ADAM_SLOTS)] \
            == list(ADAM_SLOTS)
        assert {s.device for s in slots} == ran[name], (name, [s.device for s in slots])
        owners[name] = next(iter(ran[name]))
    assert set(owners.values()) == set(devices)
    slot_names = [n for n in graph_ops if n.endswith(ADAM_SLOTS) and graph_ops[n].type ==
                  "VarHandleOp"]
    assert len(slot_names) == 2 * len(updates)  # no copies
    copies = [n for n in ran if re.search(r"/zero(_\d+)?/AssignVariableOp$", n)]
    assert len(copies) == len(updates) * (len(devices) // len(stages) - 1)
    reduced = [n for n in ran if graph_ops.get(n) is not None
               and graph_ops[n].type == "CollectiveReduceV2"]
    assert bool(reduced) == (stage == 1), reduced


CPUS = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(4)]


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_shards_adam_over_two_replicas(stage):
    """Adam on 3 blocks, 2 mirrored replicas: plain TF's numbers; each update
    on its slots' device, both devices owning some."""
    config = {**MIRRORED, "memory.zero": stage}
    build = blocks(3, adam)
    assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-5)
    assert_sharded(config, build, stage, CPUS[:2])


def test_zero_shards_each_stage_of_two_pipelines_over_its_replicas():
    """Two stages, each on 2 devices (two pipelines), 2 micro-batches, ZeRO-2:
    plain TF's numbers; every device owns some of its stage's slots."""
    config = {"cluster.num_devices": 4, "communication.backend": "collective",
              "auto.num_task_graph": 2, "pipeline.num_micro_batch": 2, "memory.zero": 2}
    build = blocks(3, adam)
    assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-5)
    assert_sharded(config, build, 2, CPUS, stages=(0, 1))


def momentum_gpt(x, y):
    """test_expert_plans' GPT-2 graph (2 blocks, hidden 32, 4 heads, 50
    tokens; v1 dense layers on 3-D activations, an embedding), momentum (a
    slot per weight; Adam would turn the float noise in the attention keys'
    bias gradients, zero but for rounding, into visible steps)."""
    del y
    with v1.variable_scope("", initializer=v1.glorot_uniform_initializer(seed=1)):
        loss = gpt_loss(2, 32, 4, vocab=50)(x)
    return loss, v1.train.MomentumOptimizer(0.1, 0.9).minimize(loss)


GPT_DATA = (np.random.RandomState(0).randint(0, 50, size=(3, 8, 16)).astype(np.int32),
            np.zeros((3, 8), np.int64))


@functools.lru_cache(maxsize=None)
def plain_gpt():
    """``momentum_gpt`` trained on one device: the reference of every
    parametrization of ``test_a_gpt_on_mirrored_replicas``."""
    return train(momentum_gpt, GPT_DATA)


@pytest.mark.parametrize("functions", [True, False], ids=["task functions", "copies"])
@pytest.mark.parametrize("zero", [0, 1, 2])
def test_a_gpt_on_mirrored_replicas(zero, functions):
    """A GPT with an unknown batch dimension on 2 mirrored replicas, with and
    without ZeRO: plain TF's numbers. The replicas' copies of the weight
    gradients of dense layers on 3-D inputs lost the static shape Tensordot
    sets, and the all-reduce refused them (before tfpar gave them back)."""
    config = {**MIRRORED, "memory.zero": zero, "pipeline.task_functions": functions}
    assert_equivalent(plain_gpt(), train(momentum_gpt, GPT_DATA, config), rtol=1e-4)


def embedded(x, y):
    """The labels' embedding (an IndexedSlices gradient) next to the features,
    a 3-class head, Adam."""
    table = v1.get_variable("table", initializer=np.random.RandomState(3).randn(3, 4)
                            .astype(np.float32))
    h = tf.concat([x, tf.nn.embedding_lookup(table, y)], 1)
    kernel = v1.get_variable("kernel", initializer=np.random.RandomState(4).randn(10, 3)
                             .astype(np.float32) / 3)
    loss = v1.losses.sparse_softmax_cross_entropy(y, tf.matmul(h, kernel))
    return loss, adam().minimize(loss)


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_an_embedding(stage):
    """The embedding's sparse gradient is concatenated on the table's owner
    (a gather collective would wait forever on the device whose update does
    not run): plain TF's numbers; the table's slots on one device, the
    kernel's on the other, the slots' sparse updates ran on their device only."""
    config = {**MIRRORED, "memory.zero": stage, "communication.timeout_s": 30}
    assert_equivalent(train(embedded, DATA), train(embedded, DATA, config), rtol=1e-5)
    graph_ops, ran = traced_step(config, embedded)
    slots = {name: op.device for name, op in graph_ops.items() if name.endswith(ADAM_SLOTS)
             and op.type == "VarHandleOp"}
    assert len(slots) == 4 and set(slots.values()) == set(CPUS[:2]), slots
    writers = {name: ran[name] for name, op in graph_ops.items() if name in ran
               and any(t.op.name.startswith("table/Adam") for t in op.inputs)
               and op.type.startswith("Resource")}  # the slots' scatter updates
    assert writers and all(devices == {slots["table/Adam"]} for devices in writers.values()), \
        writers


def clipped_adam():
    """Adam on gradients clipped by their global norm: every device's norm reads
    every gradient, summed on its owner under ZeRO-2."""
    class Clipped:
        def minimize(self, loss):
            opt = adam()
            grads, variables = zip(*opt.compute_gradients(loss))
            clipped, _ = tf.clip_by_global_norm(grads, 0.5)
            return opt.apply_gradients(zip(clipped, variables))
    return Clipped()


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_with_global_norm_clipping(stage):
    build = blocks(2, clipped_adam)
    config = {**MIRRORED, "memory.zero": stage}
    assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-5)
    assert_sharded(config, build, stage, CPUS[:2])


def keras_fit(config, optimizer, data=DATA):
    """Keras model.fit in graph mode: (losses, weights, {slot name: device})."""
    features, labels = data[0].reshape(-1, 6), data[1].reshape(-1)
    graph = tf.Graph()
    with graph.as_default():
        if config:
            wh.init(config)
        inputs = tf.keras.Input((6,))
        h = tf.keras.layers.Dense(8, "tanh", kernel_initializer=tf.keras.initializers.Constant(
            np.random.RandomState(1).randn(6, 8).astype(np.float32) / 2))(inputs)
        logits = tf.keras.layers.Dense(3, kernel_initializer=tf.keras.initializers.Constant(
            np.random.RandomState(2).randn(8, 3).astype(np.float32) / 2))(h)
        model = tf.keras.Model(inputs, logits)
        model.compile(optimizer(), tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(features, labels, batch_size=16, epochs=2, shuffle=False, verbose=0)
        weights = variable_values(v1.keras.backend.get_session(), model.weights)
        slots = {op.name: op.device for op in graph.get_operations()
                 if op.type == "VarHandleOp" and op.name.endswith(("/m", "/v"))}
        if config:
            wh.reset()
    return np.array(history.history["loss"]), weights, slots


@pytest.mark.parametrize("zero", [0, 2])
@pytest.mark.parametrize("optimizer", [tf.keras.optimizers.legacy.Adam,
                                       tf.keras.optimizers.legacy.Nadam])
def test_keras_fit_with_mirrored_replicas(optimizer, zero):
    """Keras' fused Adam and its Nadam (updates written as TF ops) with
    mirrored replicas, with and without ZeRO-2: plain TF's numbers; with ZeRO
    each of the 8 slots exists once (without, twice), on both devices between
    them. (Without
    ZeRO this also covers Keras' initializer group, built after the rewrite:
    it waits for the copies to the mirrored variables.)"""
    plain = keras_fit(None, lambda: optimizer(0.05))
    losses, weights, slots = keras_fit({**MIRRORED, "memory.zero": zero},
                                       lambda: optimizer(0.05))
    assert_equivalent(plain[:2], (losses, weights), rtol=1e-5)
    assert len(slots) == (8 if zero else 16)  # mirrored: a copy on each device
    if zero:
        assert set(slots.values()) == set(CPUS[:2]), slots


def test_zero_checkpoints_keep_single_device_names(tmp_path):
    """A checkpoint saved under ZeRO-1 restores into plain TF as plain TF's own
    does (slots included), and plain TF's restores under ZeRO-2."""
    build = blocks(2, adam)
    zero_saved = str(tmp_path / "zero")
    plain_saved = str(tmp_path / "plain")
    checkpoint_session(build, None, zero_saved, {**MIRRORED, "memory.zero": 1}, DATA)
    checkpoint_session(build, None, plain_saved, None, DATA)
    from_plain = checkpoint_session(build, plain_saved, None, None, DATA)
    assert_same_variables(from_plain[1], checkpoint_session(build, zero_saved, None, None, DATA)[1])
    assert_same_variables(from_plain[1], checkpoint_session(
        build, plain_saved, None, {**MIRRORED, "memory.zero": 2}, DATA)[1])


@pytest.mark.parametrize("config,why", [
    ({"cluster.num_devices": 2}, "share one copy of each variable"),
    pytest.param({"cluster.num_devices": 1, "communication.backend": "horovod"},
                 "a Horovod job runs a graph per process", marks=pytest.mark.horovod)],
    ids=["shared", "horovod"])
def test_zero_without_mirrored_variables_is_refused(config, why):
    """Replicas on the CPUs of one process share one copy of each variable,
    and a Horovod process holds its own copy: nothing to shard among a
    graph's devices, so an explicit memory.zero raises rather than doing
    nothing."""
    with pytest.raises(wh.PlanError, match=why):
        train(blocks(1, adam), DATA, {**config, "memory.zero": 1})
    wh.reset()


class DecayedAdam(v1.train.AdamOptimizer):
    """Adam with a weight decay written as an op of its own before each update
    (after the gradient: the forward pass has read the variable by then;
    before, the decay could run first, and the step's loss varied)."""

    def _resource_apply_dense(self, grad, var):
        with tf.control_dependencies([grad]):
            decay = var.assign_sub(0.01 * var)
        with tf.control_dependencies([decay]):
            return super()._resource_apply_dense(grad, var)


def test_a_variable_another_update_op_writes_keeps_its_state_mirrored_and_says_so(fallbacks):
    """Issue 64 item 4: before, such variables kept their optimizer state on
    every replica without a word (ZeRO's owner alone would run an update the
    other write must follow). The numbers are plain TF's; a FallbackWarning
    and a plan note name them; strict refuses."""
    build, config = blocks(1, lambda: DecayedAdam(0.05)), {**MIRRORED, "memory.zero": 1}
    assert_equivalent(train(build, DATA), train(build, DATA, config))
    said = ("ZeRO-1 (memory.zero, or the plan's), to shard the optimizer state of every "
            "trainable variable over its replicas: 6 variable(s) keep their optimizer state "
            "mirrored on every replica ('block0/inner/bias', ")
    assert said in fallbacks.getvalue()
    assert "(writers: AssignSubVariableOp; a weight decay" in fallbacks.getvalue()
    with initialized(build, config):
        assert any(said in note for note in wh.current_plan().notes)
    with pytest.raises(wh.PlanError, match=r"keep their optimizer state mirrored .*strict: true"):
        train(build, DATA, {**config, "strict": True})


def test_the_planner_shards_the_optimizer_when_memory_forces_it(caplog):
    """Adam blocks on 2 devices, one TaskGraph (443 parameters: 7088 bytes of
    state, 1632 of activations): 8720 bytes a device without ZeRO. On 8000
    bytes the plan is ZeRO-1 (the 3544 slot bytes halve: 6948); on 5000,
    ZeRO-2 and 4 micro-batches (weights 1772 + gradients 886 + slots 1772 +
    activations 408). Both train with it, searched and pinned; with replicas
    that share variables the plan's ZeRO is skipped, said in the log."""
    base = {**MIRRORED, "auto.auto_parallel": True, "auto.num_task_graph": 1,
            "auto.global_batch": 16, "auto.memory_techniques": ["zero"]}
    device = {"name": "small", "tflops": 1}
    build = blocks(3, adam)
    roomy = plan_of(build, {**base, "cluster.hardware": [{**device, "memory_gb": 1}]})
    assert roomy.estimate["memory_bytes_per_device"] == [8720, 8720]
    for memory, stage, needs in ((8000, 1, 6948), (5000, 2, 4838)):
        config = {**base, "cluster.hardware": [{**device, "memory_gb": memory / 2 ** 30}]}
        plan = plan_of(build, config)
        assert (plan.estimate["zero"], plan.estimate["memory_bytes_per_device"]) == (
            stage, [needs, needs])
        assert_equivalent(train(build, DATA), train(build, DATA, config), rtol=1e-5)
        assert_sharded(config, build, stage, CPUS[:2])
        assert_sharded({**config, "plan": plan.to_dict()}, build, stage, CPUS[:2])
    with caplog.at_level(logging.INFO, logger="tfpar"):
        shared = {**config, "communication.backend": "auto"}
        assert_equivalent(train(build, DATA), train(build, DATA, shared), rtol=1e-5)
    assert "the plan's ZeRO-2 is not needed: its replicas share one copy" in caplog.text
