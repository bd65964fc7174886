"""Whale's hardware-aware balance (§3.3, Algorithm 1): the load ratios, replicas
on mixed devices taking rows in proportion, split TaskGraphs cutting shards in
proportion, and pipeline stages cut by speed within memory."""
import numpy as np
import pytest
import tensorflow as tf

from equivalence import (assert_equivalent, deep_mlp, fed_graph, make_data,
                         mlp_classifier, plan_of, traced_first_step, train)
from test_pipeline import mlp_stages
from test_split import DATA as SPLIT_DATA, classifier as split_classifier
from test_split import embedding_model, gshard_moe, megatron_mlp, moe_model
import tfpar as wh
from tfpar.cluster.hardware import CATALOG
from tfpar.ir.plan import Plan
from tfpar.planner.balance import balance_load, balance_stages, integer_shares, step_time
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import simulate

v1 = tf.compat.v1
V100, P100 = CATALOG["V100-32GB"], CATALOG["P100-16GB"]
GIB = 2 ** 30
DATA = make_data(steps=3, batch=16)


# ---------------------------------------------------------------- Algorithm 1

def test_load_ratios_follow_single_precision_speed_when_memory_allows():
    speeds = [V100.flops_per_s("fp32"), P100.flops_per_s("fp32")]
    balance = balance_load(speeds, [32 * GIB, 16 * GIB], batch_bytes=4 * GIB, fixed_bytes=GIB)
    assert balance.fits
    assert balance.ratios == pytest.approx([15.7 / 25.0, 9.3 / 25.0])


def test_mixed_gpus_step_as_much_faster_as_whale_reports():
    """Whale §3.3.1 (Fig. 4): even batches on a V100 and a P100 leave the V100
    idle at the barrier; balanced, the step is 1.3-1.4x faster (here 25 /
    (2 x 9.3) = 1.34x, compute only)."""
    speeds = [V100.flops_per_s("fp32"), P100.flops_per_s("fp32")]
    balanced = balance_load(speeds, [32 * GIB, 16 * GIB], batch_bytes=GIB).ratios
    ratio = step_time([0.5, 0.5], speeds, 1e12) / step_time(balanced, speeds, 1e12)
    assert ratio == pytest.approx(25.0 / 18.6)
    assert 1.3 <= ratio <= 1.4


def test_load_shifts_from_a_device_out_of_memory_to_the_least_loaded_with_room():
    """Lines 11-18: the fast device's 3/4 of the activations does not fit;
    the excess moves to the device with room and the lowest FLOP utilization,
    as much as it can take; a valley without room leaves the free devices."""
    balance = balance_load([3.0, 1.0], [4.0, 100.0], batch_bytes=6.0, fixed_bytes=1.0)
    assert balance.fits and balance.ratios == pytest.approx([0.5, 0.5])
    # Two fast devices over; the first excess goes to the device with the most
    # room (FLOP utilizations tie at first), the second to the less loaded one
    # until it is full, then the rest back to the first valley.
    balance = balance_load([2.0, 2.0, 1.0, 1.0], [1.0, 1.0, 1.5, 100.0], batch_bytes=6.0)
    assert balance.fits
    assert balance.ratios == pytest.approx([1 / 6, 1 / 6, 1 / 4, 5 / 12])


def test_a_batch_that_fits_nowhere_is_reported_not_hidden():
    balance = balance_load([2.0, 1.0], [1.0, 1.0], batch_bytes=10.0)
    assert not balance.fits and sum(balance.ratios) == pytest.approx(1.0)


def test_integer_shares():
    assert integer_shares([0.5, 0.5]) == ()
    assert integer_shares([0.628, 0.372]) == (1000, 592)
    assert integer_shares([0.999, 0.001]) == (1000, 1)


# ---------------------------------------------------------------- inter-TaskGraph (§3.3.2)

def stage_sizes(stages):
    return [stages.count(s) for s in range(max(stages) + 1)]


def test_stages_take_ops_in_proportion_to_their_devices_speed():
    """The cut whose slowest stage (cost / rate) is fastest: 4 of 6 like ops
    on a device twice as fast; 48 layers on 2 V100s and 2 P100s (15.7 and
    9.3 TFLOP/s): 15, 15, 9, 9."""
    stages, fits = balance_stages([1.0] * 6, [0.0] * 6, [1.0] * 6, [2, 1], [2.0, 1.0],
                                  [100.0, 100.0])
    assert fits and stages == [0, 0, 0, 0, 1, 1]
    speeds = [hw.flops_per_s("fp32") for hw in (V100, V100, P100, P100)]
    stages, fits = balance_stages([1.0] * 48, [0.0] * 48, [0.0] * 48, [4, 3, 2, 1], speeds,
                                  [32.0, 32.0, 16.0, 16.0])
    assert fits and stage_sizes(stages) == [15, 15, 9, 9]


def test_stage_load_moves_from_the_peak_to_the_valley_along_the_chain():
    """Algorithm 1 on cuts: the first stage keeps 4 micro-batches of 3 ops'
    activations (12 bytes) in 5; one op at a time moves towards the valley
    (the least FLOP-utilized stage with room, ties by memory: the last), each
    stage between giving one at one end and taking one at the other, until
    the peak fits (1 op, 4 bytes)."""
    stages, fits = balance_stages([1.0] * 8, [0.0] * 8, [1.0] * 8, [4, 3, 2, 1],
                                  [2.0, 2.0, 1.0, 1.0], [5.0, 100.0, 100.0, 100.0])
    assert fits and stages == [0, 1, 1, 1, 2, 2, 3, 3]
    # Weights that fit nowhere else stay, reported.
    stages, fits = balance_stages([1.0] * 4, [9.0, 0.0, 0.0, 0.0], [0.0] * 4, [2, 1],
                                  [1.0, 1.0], [5.0, 5.0])
    assert not fits and stages == [0, 0, 1, 1]


def test_balanced_stages_on_mixed_gpus_simulate_as_whale_reports():
    """Whale §3.3.2 (Fig. 18): a 4-stage pipeline of 48 like layers on 2 V100s
    and 2 P100s, 32 micro-batches of 1F1B in the simulator: even stages (12
    layers each) wait on the P100s; balanced (15, 15, 9, 9) the step is
    1.30x faster (Whale: 1.3-1.4x for hardware-aware balance)."""
    speeds = [hw.flops_per_s("fp32") for hw in (V100, V100, P100, P100)]
    stages, _ = balance_stages([1.0] * 48, [0.0] * 48, [0.0] * 48, [4, 3, 2, 1], speeds,
                               [32.0, 32.0, 16.0, 16.0])
    schedule = build_schedule("1f1b", 4, 32)

    def length(sizes):
        forward = [1e12 * n / speed for n, speed in zip(sizes, speeds)]
        return simulate(schedule, forward, [2 * f for f in forward]).length

    ratio = length([12] * 4) / length(stage_sizes(stages))
    assert ratio == pytest.approx(1.30, abs=0.01)


# ---------------------------------------------------------------- rewritten graphs

def rows_per_device(config, build=None):
    """(plan, {device: rows of the first layer's MatMul}) of one traced step of
    ``build`` (the 2-layer MLP) on a batch of 16 under ``config``."""
    with fed_graph(config) as (graph, x, y):
        _, train_op = (build or mlp_classifier())(x, y)
        plan = wh.current_plan()
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
    rows = {}
    for device in metadata.step_stats.dev_stats:
        for node in device.node_stats:
            if node.node_name.endswith("/MatMul") and "grad" not in node.node_name \
                    and node.output and node.node_name.split("/")[-2] in ("hidden", "stage0"):
                rows[device.device.split("device:")[-1]] = int(
                    node.output[0].tensor_description.shape.dim[0].size)
    return plan, rows


@pytest.mark.parametrize("optimizer", [lambda: v1.train.GradientDescentOptimizer(0.5),
                                       lambda: v1.train.AdamOptimizer(0.05)])
def test_replicas_on_mixed_devices_take_rows_by_speed_and_compute_the_same_numbers(optimizer):
    """A V100 and a P100: rows 10 and 6 of 16 (62.8% / 37.2%), gradients
    weighted by rows, so the numbers are the single-device ones."""
    config = {"cluster.num_devices": 2, "cluster.hardware": ["V100-32GB", "P100-16GB"]}
    assert_equivalent(train(mlp_classifier(optimizer), DATA),
                      train(mlp_classifier(optimizer), DATA, config))
    plan, rows = rows_per_device(config)
    assert plan.batch_shares == (1000, 592)
    assert "62.8% 37.2%" in plan.summary()
    assert rows == {"CPU:0": 10, "CPU:1": 6}


def test_balance_off_or_like_devices_cut_even_rows():
    mixed = {"cluster.num_devices": 2, "cluster.hardware": ["V100-32GB", "P100-16GB"]}
    for config in ({**mixed, "balance.hardware_aware": False},
                   {"cluster.num_devices": 2, "cluster.hardware": ["P100-16GB"] * 2}):
        plan, rows = rows_per_device(config)
        assert plan.batch_shares == () and rows == {"CPU:0": 8, "CPU:1": 8}


def test_four_mixed_devices_and_a_pipeline_of_two_replicas():
    """Four devices, two of each: data parallelism gives each its speed's
    rows; a 2-stage pipeline replicated twice (micro-batches of it included)
    gives each replica its slowest stage's."""
    hardware = ["V100-32GB", "P100-16GB", "V100-32GB", "P100-16GB"]
    config = {"cluster.num_devices": 4, "cluster.hardware": hardware}
    assert_equivalent(train(mlp_classifier(), DATA), train(mlp_classifier(), DATA, config))
    plan, rows = rows_per_device(config)
    assert rows == {"CPU:0": 5, "CPU:1": 3, "CPU:2": 5, "CPU:3": 3}

    # Stage 0 takes the V100s (more memory, Whale §3.3.2): replicas run at
    # their P100's and their T4's speeds.
    pipeline = {**config, "pipeline.num_micro_batch": 2,
                "cluster.hardware": ["V100-32GB", "P100-16GB", "V100-32GB", "T4"]}
    assert_equivalent(train(mlp_stages(2, False), DATA),
                      train(mlp_stages(2, True), DATA, pipeline))
    plan, _ = rows_per_device(pipeline, mlp_stages(2, True))
    assert plan.data_parallel_degree == 2
    assert sorted(plan.batch_shares) == [round(1000 * 8.1 / 9.3), 1000]


def test_pinned_plans_keep_their_shares():
    plan = Plan.from_dict({**rows_per_device({"cluster.num_devices": 2, "cluster.hardware": [
        "V100-32GB", "P100-16GB"]})[0].to_dict(), "batch_shares": [3, 1]})
    assert plan.batch_shares == (3, 1)
    pinned, rows = rows_per_device({"cluster.num_devices": 2, "plan": plan.to_dict()})
    assert pinned.batch_shares == (3, 1) and rows == {"CPU:0": 12, "CPU:1": 4}
    with pytest.raises(wh.PlanError, match=r"batch_shares \[3, 1, 1\] must be one int >= 1 per "
                                           r"replica of the model \(2\)"):
        rows_per_device({"cluster.num_devices": 2,
                         "plan": {**plan.to_dict(), "batch_shares": [3, 1, 1]}})


def layer_devices(config, build):
    """{layer scope: device} of each forward MatMul in one traced step."""
    with fed_graph(config) as (graph, x, y):
        _, train_op = build(x, y)
        plan = wh.current_plan()
        metadata = traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]})
    return plan, {node.node_name.split("/")[-2]: device.device.split("device:")[-1]
                  for device in metadata.step_stats.dev_stats for node in device.node_stats
                  if node.node_name.endswith("/MatMul") and "grad" not in node.node_name}


def test_stages_on_a_v100_and_a_p100_are_cut_by_speed_and_compute_the_same_numbers():
    """Whale Example 4 (num_task_graph 2) on a P100 and a V100: the first
    stage goes to the V100 (more memory, §3.3.2) and takes the layers in
    proportion to its speed (15.7 vs 9.3 TFLOP/s: 7 of the 10 tanh layers,
    where like devices cut 5 and 5); the numbers are the single device's."""
    build = deep_mlp(10)
    config = {"cluster.num_devices": 2, "cluster.hardware": ["P100-16GB", "V100-32GB"],
              "auto.num_task_graph": 2, "pipeline.num_micro_batch": 2}
    assert_equivalent(train(build, DATA), train(build, DATA, config))
    plan, devices = layer_devices(config, build)
    assert plan.task_graphs[0].devices[0].endswith("CPU:1")
    assert [devices[f"layer{i}"] for i in range(10)] == ["CPU:1"] * 7 + ["CPU:0"] * 3
    _, even = layer_devices({**config, "balance.hardware_aware": False}, build)
    assert [even[f"layer{i}"] for i in range(10)] == ["CPU:0"] * 5 + ["CPU:1"] * 5


# ---------------------------------------------------------------- split TaskGraphs

MIXED = {"cluster.num_devices": 2, "cluster.hardware": ["V100-32GB", "P100-16GB"]}


def shard_widths(build, config, features=6, dtype=tf.float32):
    """{variable: [width of each slice along its split axis, by device]} as
    ``build`` makes them under ``config``."""
    graph = tf.Graph()
    try:
        with graph.as_default():
            wh.init(config)
            build(v1.placeholder(dtype, [None, features]), v1.placeholder(tf.int64, [None]))
            slices = {}
            for v in v1.global_variables():
                info = v._save_slice_info  # pylint: disable=protected-access
                if info is not None:
                    axis = next(i for i, (a, b) in enumerate(zip(info.var_shape,
                                                                 info.full_shape)) if a != b)
                    slices.setdefault(info.full_name, []).append(
                        (v.device.rsplit(":", 1)[-1], info.var_shape[axis]))
    finally:
        wh.reset()
    return {name: [width for _, width in sorted(parts)] for name, parts in slices.items()}


def test_split_shards_follow_device_speed_and_compute_the_same_numbers():
    """Whale §3.3.1 inside a split TaskGraph: on a V100 and a P100 every
    dimension a shard cuts goes 62.8% / 37.2% (16 columns: 10 / 6), so each
    device's part of a layer takes as long; the numbers are the single
    device's, and each device computes its own width's gradient in a traced step."""
    assert_equivalent(train(megatron_mlp(False), SPLIT_DATA),
                      train(megatron_mlp(True), SPLIT_DATA, MIXED))
    widths = shard_widths(megatron_mlp(True), MIXED)
    expected = {"fc1/kernel": [10, 6], "fc1/bias": [10, 6], "fc2/kernel": [10, 6],
                "logits/kernel": [6, 4], "logits/bias": [6, 4]}
    assert widths == {**expected, **{f"{name}/Momentum": w for name, w in expected.items()}}
    plan = plan_of(megatron_mlp(True), MIXED)
    assert plan.task_graphs[0].shard_shares == (1000, 592)
    # Weights, gradients and Momentum's slot per device: 338 float32 weights,
    # shared by speed; the activations too.
    fast, slow = plan.estimate["memory_bytes_per_device"]
    assert fast / slow == pytest.approx(1000 / 592)
    state = plan.estimate["memory"]
    assert state["weights"] + state["gradients"] + state["optimizer"] == pytest.approx(
        3 * 1352 * 1000 / 1592)
    assert fast == pytest.approx(3 * 1352 * 1000 / 1592 + state["activations"])
    assert "split_0 shards per device (hardware-aware, Whale §3.3.1): 62.8% 37.2%" in str(plan)
    with fed_graph(MIXED) as (graph, x, y):
        _, train_op = megatron_mlp(True)(x, SPLIT_DATA[1][0])
        metadata = traced_first_step(train_op, {x: SPLIT_DATA[0][0]})
    columns = {device.device.split("device:")[-1]: int(node.output[0].tensor_description.shape
                                                      .dim[-1].size)
               for device in metadata.step_stats.dev_stats for node in device.node_stats
               if node.node_name.startswith("gradients/fc1/MatMul")  # the kernel's gradient
               and node.node_name.endswith("/MatMul_1") and node.output}
    assert columns == {"CPU:0": 10, "CPU:1": 6}
    # The simulated compute of a layer so cut vs even shards (Whale: 1.3-1.4x).
    speeds = [V100.flops_per_s("fp32"), P100.flops_per_s("fp32")]
    ratio = step_time([0.5, 0.5], speeds, 1e12) / step_time([10 / 16, 6 / 16], speeds, 1e12)
    assert ratio == pytest.approx(1.33, abs=0.01)


def test_even_shards_with_the_balance_off_or_like_devices():
    for config in ({**MIXED, "balance.hardware_aware": False},
                   {"cluster.num_devices": 2, "cluster.hardware": ["P100-16GB"] * 2}):
        assert shard_widths(megatron_mlp(True), config)["fc1/kernel"] == [8, 8]
        assert plan_of(megatron_mlp(True), config).task_graphs[0].shard_shares == ()


def test_a_split_stage_on_mixed_devices_keeps_the_devices_it_was_built_on():
    """Whale Example 2 as a pipeline on 2 V100s and 2 P100s: replicate(2),
    then a split(2) head, built on CPU:2 (V100) and CPU:3 (P100) and cut by
    speed there. Before: stages were reordered by memory after the head was
    built, and the plan raised that its scopes moved it."""
    config = {"cluster.num_devices": 4,
              "cluster.hardware": ["V100-32GB", "P100-16GB", "V100-32GB", "P100-16GB"]}
    assert_equivalent(train(split_classifier(False), SPLIT_DATA),
                      train(split_classifier(True, devices=2), SPLIT_DATA, config))
    assert shard_widths(split_classifier(True, devices=2), config)["logits/kernel"] == [6, 4]
    assert plan_of(split_classifier(True, devices=2), config).task_graphs[1].devices == [
        f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in (2, 3)]


def test_pinned_plans_keep_their_shard_shares():
    plan = plan_of(megatron_mlp(True), MIXED).to_dict()
    plan["task_graphs"][0]["shard_shares"] = [3, 1]
    pinned = {"cluster.num_devices": 2, "plan": plan}
    assert shard_widths(megatron_mlp(True), pinned)["fc1/kernel"] == [12, 4]
    assert_equivalent(train(megatron_mlp(False), SPLIT_DATA),
                      train(megatron_mlp(True), SPLIT_DATA, pinned))
    plan["task_graphs"][0]["shard_shares"] = [3, 1, 1]
    with pytest.raises(wh.PlanError, match=r"shard_shares \[3, 1, 1\] of TaskGraph 'split_0' "
                                           r"must be one int >= 1 per device \(2\)"):
        shard_widths(megatron_mlp(True), pinned)


def test_uneven_vocabulary_shards_and_experts_compute_the_same_numbers():
    """A 20-row table cut 12 / 8 (lookups mask by each shard's rows); Whale
    Example 5 and routed experts with token rows cut by speed too (their
    replicated gating takes rows by speed as well)."""
    rng = np.random.RandomState(3)
    ids = (rng.randint(0, 20, size=(3, 8, 2)).astype(np.int64),
           rng.randint(0, 3, size=(3, 8)).astype(np.int64))
    assert_equivalent(train(embedding_model(False), ids),
                      train(embedding_model(True, 2), ids, MIXED))
    assert shard_widths(embedding_model(True, 2), MIXED, 2, tf.int64)["table"] == [12, 8]
    data = make_data(steps=3, batch=8, classes=3)
    for build in (moe_model, gshard_moe):
        assert_equivalent(train(build(False), data), train(build(True, 2), data, MIXED))

