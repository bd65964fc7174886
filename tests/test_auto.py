"""auto.auto_parallel: the cost-model search over data x pipeline degrees."""
import dataclasses
import logging
import warnings

import pytest
import tensorflow as tf

import equivalence
from equivalence import (assert_equivalent, make_data, mlp_classifier, plan_of,
                         traced_first_step, train)
from test_cost_model import deep_mlp_layers, graph_view, hand_memory, planned_stages
from test_expert_plans import mlp
from test_pipeline import assert_follows

import tfpar as wh
from tfpar.cluster.hardware import CATALOG, Hardware
from tfpar.planner.comm import allreduce
from tfpar.runtime.automatic import cluster_hardware
from tfpar.runtime.context import active
from tfpar.planner.auto import (Candidate, ModelView, _meshes, _scattered, choose, search,
                               search_all, stage_units)
from tfpar.planner.schedule import build_schedule

v1 = tf.compat.v1
DATA = make_data(steps=3, batch=8)


deep_mlp = equivalence.deep_mlp(6)


def test_whale_example_3_auto_pipeline():
    """Example 3 as written: auto_parallel with num_task_graph 2 and 8 micro-batches."""
    config = wh.Config({"num_micro_batch": 8, "num_task_graph": 2, "auto_parallel": True,
                        "cluster.num_devices": 2})
    assert_equivalent(train(deep_mlp, DATA), train(deep_mlp, DATA, config))
    plan = plan_of(deep_mlp, config)
    assert [tg.name for tg in plan.task_graphs] == ["stage_0", "stage_1"]
    assert plan.estimate["step_time_s"] > 0


def test_the_searched_schedule_is_the_one_that_trains():
    """Example 3's pipeline of 8 micro-batches: the search prefers ZB-H1
    (its weight gradients fill 1F1B's bubbles); the plan builds it, a traced
    step follows it (the first stage sends no gradient: its backward is
    weight gradients only), and the numbers are the single device's."""
    config = {"auto.auto_parallel": True, "auto.num_task_graph": 2, "cluster.num_devices": 2,
              "pipeline.num_micro_batch": 8}
    plan = plan_of(deep_mlp, config)
    assert (plan.schedule, plan.num_micro_batch) == ("zero_bubble", 8)
    assert_equivalent(train(deep_mlp, DATA), train(deep_mlp, DATA, config))
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        x, y = v1.placeholder(tf.float32, [None, 6]), v1.placeholder(tf.int64, [None])
        _, train_op = deep_mlp(x, y)
        result = wh.step_timeline(traced_first_step(train_op, {x: DATA[0][0], y: DATA[1][0]}))
    wh.reset()
    planned = build_schedule("zero_bubble", 2, 8)
    planned[0] = [t for t in planned[0] if t.kind != "B"]
    assert_follows(result, planned)
    pinned = plan_of(deep_mlp, {**config, "pipeline.schedule": "1f1b"})
    assert pinned.schedule == "1f1b"
    assert pinned.estimate["step_time_s"] > plan.estimate["step_time_s"]


def test_small_mlp_on_8_devices_is_data_parallel():
    """A small model with a large global batch: compute dominates, and replicas
    need no pipeline bubble."""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 8,
              "auto.global_batch": 65536}
    plan = plan_of(mlp_classifier(), config)
    assert plan.data_parallel_degree == 8 and len(plan.task_graphs) == 1
    assert "step_time=" in plan.summary() and "step_time=none" not in plan.summary()
    data = make_data(steps=3, batch=16)
    assert_equivalent(train(mlp_classifier(), data), train(mlp_classifier(), data, config))


def test_memory_forces_a_pipeline():
    """Devices too small for the whole model's weights, gradients and optimizer
    slots: the search splits it into stages (and says so). Both plans' memory is
    computed by hand from the layers' sizes (``test_cost_model.hand_memory``)."""
    base = {"auto.auto_parallel": True, "cluster.num_devices": 4,
            "pipeline.num_micro_batch": 2, "pipeline.schedule": "1f1b"}  # hand_memory's
    # Data parallel, 32 / 4 = 8 rows a device in 2 micro-batches (gradients
    # accumulated): 4 x (224 + 5 x 288 + 108) weight bytes + 4 x (6 x 32 +
    # 12) bytes kept per row of one micro-batch (the tanh outputs and the
    # cross-entropy's backprop).
    need = 4 * 1772 + 4 * 204
    assert hand_memory(deep_mlp_layers(6), 32, 4, micro=2) == [need]
    data_parallel = plan_of(deep_mlp, {**base, "auto.num_task_graph": 1})
    assert max(data_parallel.estimate["memory_bytes_per_device"]) == need
    tiny = {"name": "tiny", "tflops": 1, "memory_gb": 0.9 * need / 2 ** 30}  # DP does not fit
    config = {**base, "cluster.hardware": [tiny]}
    plan, stages = planned_stages(deep_mlp, config)
    assert len(plan.task_graphs) > 1 and not plan.sharding  # stages, not sharded layers
    by_hand = hand_memory(deep_mlp_layers(6), 32, 4, stages, len(plan.task_graphs), micro=2)
    assert max(by_hand) <= 0.9 * need  # the chosen stages fit the device
    assert max(plan.estimate["memory_bytes_per_device"]) == max(by_hand)
    assert_equivalent(train(deep_mlp, DATA), train(deep_mlp, DATA, config))


def test_search_refuses_when_nothing_fits():
    view = ModelView(flops=[10.0, 10.0], activation_bytes=[4.0, 4.0],
                     param_bytes=[1e9, 1e9], edges=[(0, 1, 4.0)])
    with pytest.raises(wh.PlanError, match="no plan that fits tiny"):
        search(view, 2, Hardware("tiny", 1.0, 1.0), global_batch=8, num_micro_batch=2)


def test_search_reports_every_candidate_and_prefers_the_fastest():
    lines = []
    view = ModelView(flops=[1e6] * 4, activation_bytes=[64.0] * 4, param_bytes=[1e3] * 4,
                     edges=[(i, i + 1, 64.0) for i in range(3)])
    best = search(view, 4, Hardware("big", 1.0, 16.0), global_batch=64, num_micro_batch=4,
                  progress=lines.append, schedules=("1f1b",))
    assert len(lines) == 3  # pipeline 1, 2, 4
    assert best.pipeline == 1  # tiny weights: data parallelism has no bubble
    # ZB-H1 fills the bubble, and two stages launch half the kernels each.
    zero_bubble = search(view, 4, Hardware("big", 1.0, 16.0), global_batch=64,
                         num_micro_batch=4)
    assert (zero_bubble.pipeline, zero_bubble.schedule) == (2, "zero_bubble")
    assert zero_bubble.step_time_s < 0.9 * best.step_time_s


def test_auto_parallel_with_scopes_is_an_error():
    def build(x, y):
        with wh.replicate(1):
            return mlp_classifier()(x, y)
    with pytest.raises(wh.PlanError, match="plans the whole model"):
        plan_of(build, {"auto.auto_parallel": True, "cluster.num_devices": 2})


def test_collectives_across_nodes_use_the_inter_node_network():
    """Data-parallel replicas over 2 nodes all-reduce over the slow network;
    a tensor group inside a node keeps the fast links."""
    view = ModelView(flops=[1e3, 1e3], activation_bytes=[4.0, 4.0], param_bytes=[4e8, 0.0],
                     edges=[(0, 1, 4.0)])
    one_node = Hardware("fast", 10.0, 80.0, intra_node_gbps=100, inter_node_gbps=1)
    two_nodes = dataclasses.replace(one_node, devices_per_node=2)
    assert two_nodes.bandwidth(2) == 100e9 and one_node.bandwidth(4) == 100e9
    # One device a node (2 apart): a ring over the inter-node links.
    assert two_nodes.bandwidth(2, stride=2) == 1e9 and two_nodes.link(4) == 1e9
    # Two a node: each moves 2 (2-1)/2 per byte of the tensor over NVLink-like
    # links and 2 (2-1)/2 / 2 between the nodes; a ring's 2 (4-1)/4 as long.
    assert two_nodes.bandwidth(4) == pytest.approx(1.5 / (1 / 100 + 0.5 / 1) * 1e9)
    same = search(view, 4, one_node, global_batch=8, num_micro_batch=1, pipeline=1)
    spread = search(view, 4, two_nodes, global_batch=8, num_micro_batch=1, pipeline=1)
    # The all-reduce sends 2 (4-1)/4 x 4e8 bytes a device at either bandwidth.
    assert spread.step_time_s - same.step_time_s == pytest.approx(
        6e8 / two_nodes.bandwidth(4) - 6e8 / 100e9)


def test_tensor_groups_never_straddle_two_nodes():
    """On 24 devices in nodes of 8 a tensor group is 2, 4 or 8 devices (a
    divisor of a node) or 24 (whole nodes); 3, 6 and 12 would straddle two
    nodes. With a pipeline, groups stay inside a node."""
    names = [f"l{i}/MatMul" for i in range(4)]
    view = dataclasses.replace(_chain(4), names=names, types=["MatMul"] * 4)
    nodes = dataclasses.replace(CATALOG["A100-80GB"], devices_per_node=8)
    meshes = _meshes(view, 24, None, nodes)
    assert sorted({t for t, p in meshes if p == 1}) == [1, 2, 4, 8, 24]
    assert sorted({t for t, p in meshes if p > 1}) == [1, 2, 4, 8]


def test_a_pinned_search_plan_is_rebuilt_without_searching(caplog):
    """plan.to_json() fed back: the same stages (the partition is deterministic)
    and estimates, no search, same training."""
    config = {"auto.auto_parallel": True, "cluster.num_devices": 2,
              "pipeline.num_micro_batch": 2, "auto.num_task_graph": 2}
    with caplog.at_level(logging.INFO, "tfpar.progress"):
        plan = plan_of(deep_mlp, config)
        assert caplog.messages[0].startswith("tfpar auto [1/")
        caplog.clear()
        pinned = {**config, "plan": plan.to_json()}
        again = plan_of(deep_mlp, pinned)
        assert not caplog.messages
    assert again.to_dict() == plan.to_dict()
    assert_equivalent(train(deep_mlp, DATA), train(deep_mlp, DATA, pinned))


def _chain(ops: int, labels=None) -> ModelView:
    return ModelView(flops=[1e6] * ops, activation_bytes=[64.0] * ops, param_bytes=[1e3] * ops,
                     edges=[(i, i + 1, 64.0) for i in range(ops - 1)], labels=labels)


def test_only_meshes_that_give_every_replica_and_micro_batch_a_row_are_planned():
    """8 devices, a batch of 4, 2 micro-batches per pipeline: data 8 (8 rows
    needed) and data 4 x pipeline 2 (8) are left out; data 2 x pipeline 4 (4)
    stays; 8 stages outnumber the 4 ops. Before: data 8 was planned with half
    a row per replica."""
    lines = []
    found = search_all(_chain(4), 8, Hardware("big", 1.0, 16.0), global_batch=4,
                       num_micro_batch=2, progress=lines.append)
    assert [(c.data, c.pipeline) for c in found] == [(2, 4)]
    assert lines[0] == ("tfpar auto: 3 of 4 meshes left out: 2 would leave a replica x "
                        "micro-batch without a row of the batch of 4; 1 would have more stages "
                        "than the model's 4 layers")
    assumed = search_all(_chain(4), 8, Hardware("big", 1.0, 16.0), global_batch=4,
                         num_micro_batch=2, batch_known=False)
    assert [(c.data, c.pipeline) for c in assumed] == [(8, 1), (4, 2), (2, 4)]


def test_no_feasible_mesh_is_a_plan_error_that_says_why():
    with pytest.raises(wh.PlanError, match="no feasible mesh of 8 devices: 4 would leave a "
                                           "replica x micro-batch without a row of the batch "
                                           "of 1; 1 would have more stages"):
        search(_chain(4), 8, Hardware("big", 1.0, 16.0), global_batch=1, num_micro_batch=2)


def test_stages_are_cut_between_repeated_blocks_at_most():
    """A 2-layer transformer's ops: embedding (2 ops), 3 ops per layer, head
    and loss (3 ops): 4 units (before: every op outside the blocks was one,
    so a 30-layer GPT of 80 ops outside its blocks was cut into 64 stages)."""
    labels = [None, None] + ["layer_0"] * 3 + ["layer_1"] * 3 + [None] * 3
    assert stage_units(_chain(11, labels)) == 4
    assert stage_units(_chain(8)) == 8 == stage_units(_chain(8, [None] * 8))


def test_search_time_limit_stops_the_mesh_enumeration():
    view = ModelView(flops=[10.0] * 4, activation_bytes=[4.0] * 4, param_bytes=[4.0] * 4,
                     edges=[(i, i + 1, 4.0) for i in range(3)])
    lines = []
    best = search(view, 4, Hardware("t", 1.0, 16.0), global_batch=8, num_micro_batch=2,
                  time_limit_s=1e-9, progress=lines.append)
    assert best.pipeline == 1  # the first mesh planned
    assert lines[0].startswith("tfpar auto [1/3] data 4 x tensor 1 x pipeline 1")
    assert "search time limit reached after 1 of 3 meshes" in lines[-1]


def test_choose_prefers_fewer_stages_within_10_percent_then_a_lower_tensor_degree_within_2():
    """``auto.choose``: a pipeline must beat the fastest plan without one by
    more than 10% (bubbles, balance), a split by more than 2% (before, 10%
    too: Whale's 100K-class head, estimated 9% faster split on 8 V100s,
    stayed data parallel)."""
    def plan(step_ms, tensor=1, pipeline=1):
        return Candidate(data=8 // (tensor * pipeline), pipeline=pipeline, stages=(),
                         step_time_s=step_ms / 1e3, memory_bytes=0.0, comm_bytes=0.0,
                         tensor=tensor)
    hardware = CATALOG["V100-32GB"]
    dp, split = plan(1.0), plan(0.91, tensor=8)
    assert choose([dp, split], hardware) is split
    assert choose([dp, split, plan(0.85, pipeline=2)], hardware) is split
    assert choose([dp, plan(0.99, tensor=8)], hardware) is dp
    assert choose([dp, plan(0.92, pipeline=2)], hardware) is dp
    assert choose([dp, plan(0.80, pipeline=2)], hardware).pipeline == 2


def test_all_reduce_across_nodes_sharing_a_link_grows_with_the_node_count():
    """Whale's setting: 8 V100s a node share 50 Gb/s (6.25 GB/s, 1/8 of it a
    device). A hierarchical all-reduce sends 2 (N-1)/N of the tensor through
    each node's link (1x on 2 nodes, 1.5x on 4) after a reduce-scatter over
    the 150 GB/s inside; a flat ring would send 1.875x and 1.94x."""
    whale = dataclasses.replace(CATALOG["V100-32GB"], devices_per_node=8,
                                inter_node_gbps=6.25 / 8)
    size = 920e6
    seconds = {n: allreduce(n, size, whale.bandwidth(n), latency=False).seconds for n in (16, 32)}
    inside = 2 * 7 / 8 * size / 150e9
    assert seconds[16] == pytest.approx(inside + 1.0 * size / 6.25e9)
    assert seconds[32] == pytest.approx(inside + 1.5 * size / 6.25e9)


def test_progress_lines_reach_stderr_until_logging_is_configured(tmp_path):
    """The search's lines go to the ``tfpar.progress`` logger (before:
    print): on stderr as before while the script configures no logging,
    through its handlers once it does, silenced by a level."""
    import subprocess
    import sys
    line = "from tfpar.runtime.progress import progress; progress('tfpar auto [1/1] x')"
    configured = ("import logging, sys; logging.basicConfig(stream=sys.stdout, "
                  "format='%(name)s: %(message)s'); ")
    silenced = "import logging; logging.getLogger('tfpar.progress').setLevel(30); "
    runs = [subprocess.run([sys.executable, "-c", before + line], capture_output=True,
                           text=True, cwd=tmp_path, check=True, env={
                               "PYTHONPATH": ":".join(sys.path)})
            for before in ("", configured, silenced)]
    assert (runs[0].stdout, runs[0].stderr) == ("", "tfpar auto [1/1] x\n")
    assert (runs[1].stdout, runs[1].stderr) == ("tfpar.progress: tfpar auto [1/1] x\n", "")
    assert (runs[2].stdout, runs[2].stderr) == ("", "")


def test_a_described_cluster_larger_than_a_node_is_made_of_dgx_nodes():
    """Issue 44: 1536 described A100s without cluster.devices_per_node were
    planned as one node (a tensor group of 96 on "NVLink"). Now described
    A100, H100 and V100 clusters of more than 8 get DGX / HGX nodes of 8,
    said as a fallback (strict refuses); other types must say their node
    size; a node's worth, a stated size, or a TF_CONFIG cluster are as said."""
    def planned(config):
        with tf.Graph().as_default():
            wh.init({"cluster.num_devices": 16, **config})
            hardware = cluster_hardware(active())
            notes = wh.fallback.notes()
        wh.reset()
        return hardware, notes
    with pytest.warns(wh.FallbackWarning, match="16 A100-80GB devices and no cluster.devices_"
                                               "per_node: they are planned in nodes of 8"):
        hardware, notes = planned({"cluster.hardware": "16 x A100-80GB"})
    assert hardware.devices_per_node == 8 and hardware.bandwidth(16) < hardware.bandwidth(8)
    assert notes[0].endswith("Set cluster.devices_per_node to the devices a node holds")
    with warnings.catch_warnings():
        warnings.simplefilter("error", wh.FallbackWarning)
        assert planned({"cluster.hardware": "16 x H100-80GB",
                        "cluster.devices_per_node": 16})[0].devices_per_node == 16
        assert planned({"cluster.hardware": "A100-80GB", "cluster.num_devices": 8}
                       )[0].devices_per_node is None
    with pytest.raises(wh.ConfigError, match="describes 16 devices \\(T4\\) but not how many a "
                                            "node holds: set cluster.devices_per_node"):
        planned({"cluster.hardware": "16 x T4"})
    with pytest.raises(wh.PlanError, match="planned in nodes of 8"):
        planned({"cluster.hardware": "16 x V100-32GB", "strict": True})


def test_a_described_cluster_has_nodes():
    """``cluster.devices_per_node`` splits the described devices into nodes:
    a collective over more than one node runs at the inter-node bandwidth."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 4, "cluster.hardware": "4 x A100-80GB",
                 "cluster.devices_per_node": 2})
        nodes = cluster_hardware(active())
        wh.init({"cluster.num_devices": 4, "cluster.hardware": "4 x A100-80GB"})
        one = cluster_hardware(active())
    wh.reset()
    assert nodes.devices_per_node == 2 and nodes.bandwidth(2) == 300e9
    assert nodes.link(4) == 25e9 and nodes.bandwidth(2, stride=2) == 25e9
    assert one.bandwidth(4) == 300e9


def test_split_stages_scatter_their_activations_over_the_group():
    """Megatron's scatter/gather (SC'21, §4.1): each of a tensor group's 8
    A100s sends an eighth over its own 25 GB/s link, and the next stage
    all-gathers the eighths over NVLink (300 GB/s); within one node, plain
    NVLink."""
    a100 = dataclasses.replace(CATALOG["A100-80GB"], devices_per_node=8)
    assert _scattered(a100, 8, 2) == pytest.approx(1 / (1 / (8 * 25e9) + 7 / (8 * 300e9)))
    assert _scattered(a100, 2, 2) == pytest.approx(300e9)


def test_tensor_degrees_across_nodes_stop_once_they_plan_slower():
    """16 V100s, 2 a node, a 3-layer MLP of width 1024 on 4096 rows: across
    nodes tensor 8 plans slower than tensor 4 (its collectives grow, its
    compute is small), so tensor 16 is left out, and the search says so."""
    _, view = graph_view(lambda: mlp(1024)(v1.placeholder(tf.float32, [4096, 1024]),
                                           v1.placeholder(tf.int32, [4096]))[0])
    hardware = dataclasses.replace(CATALOG["V100-32GB"], devices_per_node=2, memory_gb=0.05)
    lines = []
    candidates = search_all(view, 16, hardware, 4096, 1, pipeline=1, progress=lines.append)
    steps = {c.tensor: c.step_time_s for c in candidates}
    assert sorted(steps) == [1, 2, 4, 8] and steps[8] > steps[4]
    assert lines[-1] == ("tfpar auto [5/5] tensor 16 x pipeline 1: left out (tensor 8 across "
                         "nodes planned slower than 4)")
