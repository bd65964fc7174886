"""Plans the search did not make are costed by the same model as the ones it
made (issue 45: one op-kind table and one memory model for annotated and
searched plans alike): a plan from scopes or config gets a step time, memory
per device and what fills the fullest device, from the stage costs the
measured-vs-predicted table compares with."""
import pytest
import tensorflow as tf

from equivalence import plan_of
from test_cost_model import adam_mlp

import tfpar as wh
from tfpar.cluster.hardware import Hardware
from tfpar.ir.plan import Plan, TaskGraphPlan
from tfpar.planner.plan_costs import per_task_graph, plan_estimate
from tfpar.planner.stage_costs import StageCosts
from tfpar.planner.step_model import pipeline_length

v1 = tf.compat.v1
CPU = "/job:localhost/replica:0/task:0/device:CPU:"
# The generic host CPU, written out so that scope plans (costed on the
# measured host when cluster.hardware is unset) and searched plans assume it.
HOST = {"name": "host-CPU", "tflops": 0.05, "memory_gb": 16, "intra_node_gbps": 10,
        "inter_node_gbps": 1.25, "efficiency": 1.0}
ALPHA = 10e-6  # comm.py's latency per message
LAUNCHES = 3 * 5e-6  # step_model: per op that computes or allocates, 3 kernels of 5 us


def two_scopes(x, y):
    with wh.replicate(1):
        h = v1.layers.dense(x, 16, tf.nn.relu, name="l0")
    with wh.replicate(1):
        h = v1.layers.dense(h, 16, tf.nn.relu, name="l1")
        logits = v1.layers.dense(h, 3, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y,
                                                                            logits=logits))
    return loss, v1.train.AdamOptimizer(1e-3).minimize(loss)


def test_a_data_parallel_plan_from_config_is_costed_as_the_search_costs_it():
    """adam_mlp on 4 replicas, global batch 32 (test_cost_model's hand
    derivation): memory 4 x 1740 + 8 rows x 140 = 8080 bytes per device,
    comm 2 x 3/4 x 1740 = 2610, step 3 x 869 FLOPs x 8 rows / 0.05e12 + 4
    alpha + 2610 / 10e9 + 10 ops x 3 launches; the searched plan of the same
    model (one TaskGraph) has the very same numbers."""
    config = {"cluster.num_devices": 4, "cluster.hardware": [HOST]}
    plain = plan_of(adam_mlp, config)
    searched = plan_of(adam_mlp, {**config, "auto.auto_parallel": True,
                                  "auto.num_task_graph": 1})
    assert plain.data_parallel_degree == searched.data_parallel_degree == 4
    est, by_search = plain.estimate, searched.estimate
    assert est["memory_bytes_per_device"] == [4 * 1740 + 8 * 140] * 4
    assert est["memory_bytes_per_device"] == by_search["memory_bytes_per_device"]
    assert est["comm_bytes"] == pytest.approx(2610) == by_search["comm_bytes"]
    by_hand = 3 * 869 * 8 / 0.05e12 + 4 * ALPHA + 2610 / 10e9 + 10 * LAUNCHES
    assert est["step_time_s"] == pytest.approx(by_hand, rel=1e-9)
    assert by_search["step_time_s"] == pytest.approx(by_hand, rel=1e-9)
    assert est["memory"] == pytest.approx({"weights": 1740, "gradients": 1740,
                                           "optimizer": 2 * 1740, "activations": 8 * 140})
    said = est["assumptions"]
    assert (said["device"], said["global_batch"], said["optimizer_slots"]) == ("host-CPU", 32, 2)
    assert "step_time=" in plain.summary() and "not costed" not in plain.summary()
    assert "assumes: 4 x host-CPU" in plain.summary()


def test_a_pipeline_from_scopes_is_costed_stage_by_stage():
    """Two replicate(1) scopes on 4 devices (2 replicas each), 1F1B, 2
    micro-batches of 32 / 2 / 2 = 8 rows (test_cost_model's pipeline by
    hand): stage 0 holds 4 x 448 + 64 x 8 x 2 in flight = 2816 bytes, stage 1
    4 x 1292 + 76 x 8 x 1 = 5776; each TaskGraph's estimate is its own."""
    plan = plan_of(two_scopes, {"cluster.num_devices": 4, "cluster.hardware": [HOST],
                                "pipeline.num_micro_batch": 2, "pipeline.schedule": "1f1b"})
    assert [tg.param_bytes for tg in plan.task_graphs] == [448, 1292]
    assert [tg.estimate["memory_bytes"] for tg in plan.task_graphs] == [2816, 5776]
    assert sorted(plan.estimate["memory_bytes_per_device"]) == [2816, 2816, 5776, 5776]
    # Each stage's gradients all-reduced over its 2 replicas: 2 x 1/2 x its bytes.
    assert [tg.estimate["comm_bytes"] for tg in plan.task_graphs] == [448, 1292]
    assert plan.estimate["step_time_s"] > sum(tg.estimate["time_s"] for tg in plan.task_graphs) / 2


def _two_stages(micro: int, schedule: str = "1f1b") -> Plan:
    tgs = tuple(TaskGraphPlan(f"s{i}", "replicate", 1, ((CPU + str(i),),), num_ops=10,
                              param_bytes=100 * (i + 1)) for i in range(2))
    return Plan(task_graphs=tgs, data_parallel_degree=1, num_micro_batch=micro, schedule=schedule)


def test_a_plan_estimate_by_hand():
    """Two stages, one replica, 2 micro-batches of a 4-row batch (2 rows
    each), 1F1B. Per row: forward 1 s and 2 s, so a micro-batch of stage 0
    takes 3 x 1 x 2 = 6 s and of stage 1 12 s, plus 0.25 s of launches each;
    a step of stage 0 computes 2 x 6.25 = 12.5 s, stage 1 24.5 s. Memory:
    (2 + 2 slots) x 100 = 400 + 10 bytes a row x 2 rows x 2 in flight = 440;
    (2 + 2) x 200 = 800 + 20 x 2 x 1 = 840. The cut (8 bytes a row, 16 a
    micro-batch) crosses a 1 GB/s link: 10 us + 16 ns. The step is the
    1F1B pipeline of 6.25 and 12.25 s stages over 2 micro-batches,
    6.25 + 12.25 + 12.25 + 2 transfers (``step_model.pipeline_length``'s
    closed form), and no all-reduce (one replica)."""
    costs = StageCosts(forward_s=(1.0, 2.0), param_bytes=(100.0, 200.0),
                       activation_bytes=(10.0, 20.0), transfer_s=0.0, cut_bytes=8.0,
                       optimizer_slots=2.0)
    hardware = Hardware("link", tflops=1.0, memory_gb=1, intra_node_gbps=1,
                        inter_node_gbps=1, efficiency=1.0)
    plan = _two_stages(2)
    assert per_task_graph(plan, costs, (0.25, 0.25), 4) == [(12.5, 440.0), (24.5, 840.0)]
    estimate, parts = plan_estimate(plan, costs, (0.25, 0.25), 4, hardware, {})
    transfer = 10e-6 + 16 / 1e9
    assert estimate["step_time_s"] == pytest.approx(6.25 + 12.25 + 12.25 + 2 * transfer)
    assert estimate["step_time_s"] == pytest.approx(
        pipeline_length([6.25, 12.25], 2, transfer, "1f1b"))
    assert estimate["memory_bytes_per_device"] == [440.0, 840.0]
    assert estimate["memory"] == {"weights": 200.0, "gradients": 200.0, "optimizer": 400.0,
                                  "activations": 40.0}
    assert (estimate["comm_bytes"], parts) == (0, [
        {"time_s": 12.5, "memory_bytes": 440.0, "comm_bytes": 0},
        {"time_s": 24.5, "memory_bytes": 840.0, "comm_bytes": 0}])


def test_interleaved_stages_keep_their_device_groups_activations_not_one_f_one_bs():
    """Four stages dealt to 2 devices (V = 2: stages 0 and 2 on CPU:0, 1 and
    3 on CPU:1), 4 micro-batches of an 8-row batch (2 rows each), 10, 20, 30
    and 40 activation bytes a row: a micro-batch keeps 20, 40, 60 and 80.
    CPU:0 runs F0 F0 F2 F2 F0 before its first backward (B2), holding 20 +
    20 + 60 + 60 + 20 = 180 bytes, its peak (SC'21 §2.2: G V + G - 1 = 5
    chunks); CPU:1 runs F1 F1 F3, holding 40 + 40 + 80 = 160, before B3, and
    never more. Each stage gets its part of its group's peak: 180 x 20/80 =
    45 and 135, 160 x 40/120 and 160 x 80/120. With 400 bytes of weights,
    gradients and Adam slots a stage, the devices hold 980 and 960 bytes;
    1F1B over four stages would keep 4, 3, 2 and 1 micro-batches (80 + 120
    on CPU:0 and 120 + 80 on CPU:1: 1000 bytes each)."""
    costs = StageCosts(forward_s=(1.0,) * 4, param_bytes=(100.0,) * 4,
                       activation_bytes=(10.0, 20.0, 30.0, 40.0), transfer_s=0.0,
                       cut_bytes=8.0, optimizer_slots=2.0)
    tgs = tuple(TaskGraphPlan(f"s{i}", "replicate", 1, ((CPU + str(i % 2),),), num_ops=10,
                              param_bytes=100) for i in range(4))
    plan = Plan(task_graphs=tgs, data_parallel_degree=1, num_micro_batch=4, schedule="1f1b",
                virtual_stages=2)
    memory = [m for _, m in per_task_graph(plan, costs, (0.0,) * 4, 8)]
    assert memory == pytest.approx([445, 400 + 160 * 40 / 120, 535, 400 + 160 * 80 / 120])
    hardware = Hardware("link", tflops=1.0, memory_gb=1, intra_node_gbps=1,
                        inter_node_gbps=1, efficiency=1.0)
    estimate, _ = plan_estimate(plan, costs, (0.0,) * 4, 8, hardware, {})
    assert estimate["memory_bytes_per_device"] == pytest.approx([980, 960])
