"""A plan made for a cluster (``tfpar plan --model`` on 1024 A100s), read back
from its JSON and pinned on the 4 devices here (issue 64): it is built with
fewer copies of the model, each split by heads as planned, and trains to one
device's numbers; a plan one copy of which needs more devices than are here
is refused naming both counts."""
import json

import numpy as np
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, variable_values
from proof import executed_nodes

import tfpar as wh
from tfpar import cli
from tfpar.errors import FallbackWarning, PlanError
from tfpar.models.gpt import gpt_train_op

v1 = tf.compat.v1
# The planned GPT: 2 blocks wide enough that 1024 A100s split each by heads.
PLANNED = ["--model", "gpt", "--layers", "2", "--hidden", "12288", "--heads", "96", "--seq",
           "2048", "--vocab", "51200", "--batch", "1024", "--cluster", "1024 x A100-80GB"]
# The GPT built here: the same blocks (so the same names), small.
LAYERS, HIDDEN, SEQ, VOCAB, HEADS, BATCH = 2, 32, 8, 48, 8, 8


def planned(tmp_path_factory, *options):
    """The plan's JSON, written by ``tfpar plan --out`` and read back."""
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    assert cli.main(["plan", *PLANNED, *options, "--out", str(path)]) == 0
    wh.reset()
    return json.loads(path.read_text())


@pytest.fixture(scope="module")
def cluster_plan(tmp_path_factory):
    """Float32 (no memory techniques), so one device's numbers are exact here."""
    return planned(tmp_path_factory, "--config", '{"auto.memory_techniques": []}')


def same_everywhere(shape, dtype=tf.float32, partition_info=None):
    """Initial values from numpy for the whole variable (its slice, when
    split): the same in a plain graph and a split one."""
    full = partition_info.full_shape if partition_info is not None else shape
    offset = partition_info.var_offset if partition_info is not None else [0] * len(shape)
    values = np.random.RandomState(sum(full)).uniform(-0.2, 0.2, full)
    return tf.constant(values[tuple(slice(o, o + n) for o, n in zip(offset, shape))], dtype)


def gpt_steps(config, steps=3, trace=False):
    """(losses, variables) of ``steps`` Adam steps of the small GPT under
    ``config`` (None: plain), and with ``trace`` the devices each attention
    scores matmul ran on in the last step, traced."""
    graph = tf.Graph()
    rng = np.random.RandomState(0)
    ids, labels = (rng.randint(0, VOCAB, (BATCH, SEQ)) for _ in range(2))
    with graph.as_default():
        if config is not None:
            wh.init(config)
        with v1.variable_scope("", initializer=same_everywhere):
            train_op = gpt_train_op(LAYERS, HIDDEN, SEQ, VOCAB, HEADS, batch=BATCH)
        loss = graph.get_tensor_by_name("sparse_softmax_cross_entropy_loss/value:0")
        feed = {"ids:0": ids, "labels:0": labels}
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            losses = [sess.run([loss, train_op], feed)[0] for _ in range(steps - trace)]
            ran = {}
            if trace:
                metadata = v1.RunMetadata()
                losses.append(sess.run([loss, train_op], feed, run_metadata=metadata,
                                       options=v1.RunOptions(
                                           trace_level=v1.RunOptions.FULL_TRACE))[0])
                ran = {name: devices for name, devices in executed_nodes([metadata]).items()
                       if "_grad" not in name and (name.endswith("attention/MatMul") or (
                           "attention/MatMul/" in name and name.endswith("BatchMatMulV2")))}
            values = variable_values(sess, v1.global_variables())
    wh.reset()
    return (losses, values), ran


def test_a_1024_gpu_plan_splitting_heads_is_built_on_the_4_devices_here(cluster_plan):
    sharding = cluster_plan["sharding"]
    tensor = sharding["tensor_degree"]
    assert tensor in (2, 4) and cluster_plan["data_parallel_degree"] == 1024 // tensor
    assert [sharding["layers"][f"layer_0/attention/{n}"] for n in ("q", "MatMul", "out")] == [
        "column", "heads", "row"], sharding["layers"]
    plain, _ = gpt_steps(None)
    copies = "1 copy" if tensor == 4 else "2 copies"
    with pytest.warns(FallbackWarning, match=f"made for 1024 devices: it is built on the 4 here "
                                             f"with {copies} of the model"):
        pinned, ran = gpt_steps({"cluster.num_devices": 4, "plan": cluster_plan,
                                 "pipeline.task_functions": False}, trace=True)
    assert_equivalent(plain, pinned, rtol=1e-4, atol=1e-5)
    assert not np.isclose(plain[0][0], plain[0][-1]), "nothing trained"
    here = [f"CPU:{i}" for i in range(4)]
    for layer in range(LAYERS):  # each device computed its share of every block's heads
        shards = {n: d for n, d in ran.items() if f"layer_{layer}/attention/MatMul" in n}
        assert sorted({d.rsplit("device:", 1)[-1] for ds in shards.values() for d in ds}) == \
            here, shards


def test_a_plan_one_copy_of_which_needs_more_devices_than_are_here_is_refused(
        tmp_path_factory):
    """The plan as ``tfpar plan`` makes it (mixed precision: data 256 x tensor
    4) on 2 devices. Before: PlanError listing each of its 1020 missing devices."""
    plan = planned(tmp_path_factory)
    assert plan["sharding"]["tensor_degree"] == 4
    with pytest.raises(PlanError, match=r"made for 1024 devices; one copy of the model in it "
                                        r"needs 4 \(tensor 4 x 10 TaskGraphs\), more than the 2 "
                                        "here"):
        gpt_steps({"cluster.num_devices": 2, "plan": plan}, steps=1)
    wh.reset()
