"""Pinned plans (issue 44): validated once against the contract, every
field a user can see pinned as written."""
import copy

import pytest
import tensorflow as tf

import tfpar as wh
from equivalence import assert_equivalent, dense, layer, make_data, plan_of, train

v1 = tf.compat.v1
PLAN = {"data_parallel_degree": 2, "pipeline": {"num_micro_batch": 1, "schedule": "1f1b"},
        "task_graphs": [{"name": "all", "strategy": "replicate", "device_count": 1,
                         "devices": ["/cpu:0", "/cpu:1"], "patterns": {}}]}


def broken(path, value):
    """PLAN with the field at ``path`` (keys and indexes) set to ``value``, or
    removed when ``value`` is ``...``."""
    plan = copy.deepcopy(PLAN)
    *parents, last = path
    node = plan
    for key in parents:
        node = node[key]
    if value is ...:
        del node[last]
    else:
        node[last] = value
    return plan


@pytest.mark.parametrize("path, value, message", [
    (("data_parallel_degree",), ..., "plan.data_parallel_degree must be present"),
    (("data_parallel_degree",), "2", "plan.data_parallel_degree must be of type int, not '2'"),
    (("task_graphs",), ..., "plan.task_graphs must be present"),
    (("task_graphs",), [], "plan.task_graphs must be at least one TaskGraph"),
    (("task_graphs", 0, "strategy"), "mirror",
     "plan.task_graphs[0].strategy must be 'replicate' or 'split', not 'mirror'"),
    (("task_graphs", 0, "device_count"), ..., "plan.task_graphs[0].device_count must be present"),
    (("task_graphs", 0, "devices"), ..., "plan.task_graphs[0].devices must be present"),
    (("pipeline", "num_micro_batch"), 1.5, "plan.pipeline.num_micro_batch must be of type int"),
    (("task_graphs", 0), "all", "plan.task_graphs[0] must be a JSON object, not str")])
def test_a_pinned_plan_missing_a_field_is_refused_naming_it(path, value, message):
    """By wh.init. Before: a bare KeyError at the first run ({"plan":
    {"data_parallel_degree": 2}})."""
    with pytest.raises(wh.PlanError, match=r"tfpar: .*" + message.replace("[", r"\[").replace(
            "]", r"\]").replace(".", r"\.")):
        wh.init({"cluster.num_devices": 2, "plan": broken(path, value)})
    wh.reset()


@pytest.mark.parametrize("path, value, message", [
    (("data_parallel_degree",), 4, "plan.data_parallel_degree must be 2, the copies of the "
                                   "model its TaskGraphs' replicas make"),
    (("task_graphs", 0, "device_count"), 4,
     "plan.task_graphs[0].device_count must be a divisor of its 2 devices"),
    (("task_graphs", 0, "replicas"), [["/cpu:0", "/cpu:1"]],
     "plan.task_graphs[0].replicas must be one device each"),
    (("task_graphs", 0), {"name": "all", "strategy": "split", "device_count": 2,
                          "replicas": [["/cpu:0"], ["/cpu:1"]]},
     "plan.task_graphs[0].device_count must be the devices of each of its replicas"),
    (("pipeline", "num_micro_batch"), 0, "plan.pipeline.num_micro_batch must be an int >= 1, "
                                         "not 0"),
    (("pipeline", "group_size"), 0, "plan.pipeline.group_size must be an int >= 1 or 'auto'"),
    (("task_graphs", 0, "device_count"), -1,
     "plan.task_graphs[0].device_count must be an int >= 1")])
def test_a_pinned_plan_contradicting_its_devices_is_refused_naming_the_field(path, value,
                                                                               message):
    """Issue 64 item 2: before, a data_parallel_degree or device_count that
    contradicts the devices and replicas was silently ignored (the devices
    decided), and num_micro_batch 0 was a bare ValueError of ir/schedule.py
    at the first run. Now wh.init refuses each, naming the field."""
    escaped = message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")
    with pytest.raises(wh.PlanError, match=r"tfpar: the pinned plan's " + escaped
                       + r".*docs/plan-json\.md"):
        wh.init({"cluster.num_devices": 2, "plan": broken(path, value)})
    wh.reset()


def test_a_pinned_replicate_task_graph_without_replicas_has_one_device_each():
    """Without "replicas" (the contract's shape), a replicate TaskGraph's
    devices are one replica each, as to_dict writes them; before, they were
    cut in groups of device_count, and replicate(2) on 4 devices ran 2
    replicas, on the first device of each pair."""
    plan = broken(("task_graphs", 0, "device_count"), 2)
    plan["task_graphs"][0]["devices"] = [f"/cpu:{i}" for i in range(4)]
    plan["data_parallel_degree"] = 4
    read = wh.Plan.from_dict(plan)
    assert read.task_graphs[0].replicas == tuple((f"/cpu:{i}",) for i in range(4))
    assert read.data_parallel_degree == 4


def two_blocks(x, y):
    """Two residual MLP blocks whose layers have the same names in two
    variable scopes (block0/fc1, block1/fc1...)."""
    h = dense(x, 16, "embed", seed=1)
    for b in range(2):
        with v1.variable_scope(f"block{b}"):
            inner = layer(h, 64, "fc1", seed=2 + b, activation=tf.nn.relu)
            h = h + layer(inner, 16, "fc2", seed=4 + b)
    loss = v1.losses.sparse_softmax_cross_entropy(y, dense(h, 3, "logits", seed=4))
    return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)


def test_a_pinned_layer_pattern_is_keyed_by_its_whole_scope():
    """block0/fc2 pinned 'column', block1/fc2 left 'row' (the search's
    Megatron MLP): before, pins were keyed by the last scope component, so
    'fc2' of block0 decided block1's too (the last pin won)."""
    device = {"name": "small", "tflops": 0.01, "memory_gb": 16}
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2, "auto.num_task_graph": 1,
              "cluster.hardware": [device]}
    need = max(plan_of(two_blocks, config).estimate["memory_bytes_per_device"])
    config["cluster.hardware"] = [{**device, "memory_gb": 0.7 * need / 2 ** 30}]
    plan = plan_of(two_blocks, config).to_dict()
    assert plan["sharding"]["layers"]["block1/fc2"] == "row"
    plan["sharding"]["layers"]["block0/fc2"] = "column"
    pinned = {**config, "plan": plan}
    built = plan_of(two_blocks, pinned).task_graphs[1].patterns
    assert (built["block0/fc2"], built["block1/fc2"]) == ("column", "row")
    data = make_data(steps=2, batch=8)
    assert_equivalent(train(two_blocks, data), train(two_blocks, data, pinned))
