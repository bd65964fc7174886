"""The automatic search chooses virtual stages (issue 45): interleaved 1F1B
(Narayanan et al. SC'21 §2.2) costed term by term by hand - its bubble, its
transfers, its first group's activations - chosen where the bubble dominates
and the link is fast, left where its transfers cost more than the bubble
saves (the verdicts say both), and the chosen V trains as one device."""
import dataclasses
import random

import pytest

from test_expert_plans import DGX_A100
from test_head_split import gpt_view

from equivalence import assert_equivalent, deep_mlp, layer, make_data, plan_of, train
from proof import TRACER

from tfpar.cluster.hardware import Hardware
from tfpar.ir.schedule import interleaved_schedule
from tfpar.ir.simulate import simulate
from tfpar.planner.auto import search_all
from tfpar.planner.choice import TOLERANCE, choose
from tfpar.planner.comm import Cost
from tfpar.planner.interleaved import (group_peaks, interleaved_length, replayed,
                                       virtual_stage_counts)
from tfpar.planner.memory import Techniques
from tfpar.planner.model_view import ModelView
from tfpar.planner.step_model import Space, StageModel, best_setting
from tfpar.planner.verdicts import candidate_rows

DATA = make_data(steps=3, batch=8)
CPU = "/job:localhost/replica:0/task:0/device:CPU:"


def stage(compute_s, kept=0.0):
    """A stage of ``compute_s`` seconds per row (forward and backward),
    nothing else but ``kept`` activation bytes per row."""
    return StageModel(compute_s, 0.0, 0.0, 0.0, 0.0, Cost(0.0, 0.0), (kept,) * 4, (0.0,) * 4,
                      (0.0,) * 4, 0.0)


def setting(stages, virtual, micro=4, cut_bytes=0.0, bandwidth=1.0):
    """The setting of one row per micro-batch through ``stages``."""
    space = Space((micro,), (Techniques(),), ("1f1b",), None, virtual)
    return best_setting(stages, 1, float(micro), space, cut_bytes, bandwidth, 1.0, float("inf"))


def test_the_bubble_shrinks_by_the_virtual_stages():
    """Two devices, each 3 s of work a micro-batch, 4 micro-batches,
    transfers of no bytes (a latency each, ``LATENCY_S``, next test). 1F1B:
    4 x 3 + (2 - 1) x 3 = 15 s, 3 s of it bubble. Two virtual stages (4
    stages of 1.5 s): 4 x 3 + (2 - 1) x 3 / 2 = 13.5 s, a bubble of 1.5 s;
    four (8 of 0.75 s): 12 + 0.75."""
    plain = setting([stage(3.0)] * 2, 1)
    assert (plain.step_time_s - plain.transfer_s, plain.bubble_s) == pytest.approx((15, 3))
    two = setting([stage(1.5)] * 4, 2)
    assert (two.step_time_s - two.transfer_s, two.bubble_s, two.virtual_stages) == \
        pytest.approx((13.5, 1.5, 2))
    assert setting([stage(0.75)] * 8, 4).bubble_s == pytest.approx(0.75)


def test_interleaving_waits_for_v_times_the_transfers_to_fill_and_drain():
    """Each transfer 0.05 s (the bytes of a boundary over the bandwidth; no
    latency here as ``interleaved_length`` is given it). 1F1B on 2 stages:
    fill and drain cross 1 boundary each way (2 x 0.05), and of 4
    micro-batches one in the steady state waits for a round trip (2 x
    0.05): 0.2 s. Interleaved, 4 stages: 3 boundaries each way, 2 x 3 x
    0.05 = 0.3 s, the steady state's round trips hidden behind the other
    stage's work."""
    assert interleaved_length([1.5] * 4, 2, 4, 0.05) - 13.5 == pytest.approx(0.3)
    slow = setting([stage(1.5)] * 4, 2, cut_bytes=3 * 0.05e6, bandwidth=1e6)
    # cut_bytes: 3 boundaries of 0.05e6 bytes per row, 1 row a micro-batch;
    # a transfer carries their mean, 0.05e6 bytes at 1e6 B/s plus 10 us.
    assert slow.transfer_s == pytest.approx(6 * (0.05 + 10e-6))
    plain = setting([stage(3.0)] * 2, 1, cut_bytes=0.05e6, bandwidth=1e6)
    assert plain.transfer_s == pytest.approx(4 * (0.05 + 10e-6))
    # Every boundary's bytes are sent each way per micro-batch: 3 x as many.
    assert slow.comm_bytes == pytest.approx(3 * plain.comm_bytes) == 2 * 3 * 0.05e6 * 4


def test_the_first_group_holds_g_plus_g_minus_1_over_v_shares_of_activations():
    """Group g runs 2 (G - g - 1) + (V - 1) G forward chunks before its first
    backward and one more while it waits: G = 2, V = 2, 4 micro-batches,
    each stage keeping 1 byte a micro-batch: group 0 holds 2 + 2 + 1 = 5
    (its share keeps A = 2: (G + (G - 1) / V) A = 2.5 x 2), group 1
    0 + 2 + 1 = 3; 1F1B's stage 0 holds 2 micro-batches of 2 bytes, 4.
    With as many micro-batches as groups every forward runs first: 2 x 2."""
    assert group_peaks([1.0] * 4, 2, 4) == [5.0, 3.0]
    assert group_peaks([1.0] * 4, 2, 2) == [4.0, 4.0]
    assert group_peaks([1.0] * 8, 4, 8) == [11.0, 9.0, 7.0, 5.0]  # 2 (3 - g) + 4 + 1
    two = setting([stage(1.5, kept=1.0)] * 4, 2)
    assert two.memory_bytes == (5.0, 3.0, 5.0, 3.0)  # each stage says its device's
    assert setting([stage(3.0, kept=2.0)] * 2, 1).memory_bytes == (4.0, 2.0)


def test_virtual_stages_need_layers_for_each():
    assert virtual_stage_counts(2, 8) == [2, 4]
    assert virtual_stage_counts(4, 8) == [2]
    assert virtual_stage_counts(4, 7) == [] and virtual_stage_counts(1, 64) == []


def chain_search(gbps):
    """Eight ops of 4 GB of weights each on two devices of 80 GB (data
    parallelism does not fit), two micro-batches: a pipeline of two, whose
    bubble is a third of its step under 1F1B."""
    view = ModelView(flops=[1e9] * 8, activation_bytes=[1e4] * 8, param_bytes=[4e9] * 8,
                     edges=[(i, i + 1, 1e4) for i in range(7)])
    hardware = Hardware("dev", 1.0, 80.0, intra_node_gbps=gbps, inter_node_gbps=gbps)
    candidates = search_all(view, 2, hardware, global_batch=8, num_micro_batch=2,
                            schedules=("1f1b",))
    best = choose(candidates, hardware)
    return best, {r["virtual_stages"]: r for r in candidate_rows(candidates, best, hardware)
                  if r["pipeline"] == 2}


def test_a_fast_link_interleaves_and_a_slow_one_does_not():
    """100 GB/s: each transfer of 40 KB takes under a microsecond, the
    bubble shrinks from 69 ms to 17 ms with 4 virtual stages; 1 MB/s: a
    transfer takes 40 ms, 2 (G V - 1) of them fill and drain, more than the
    bubble saves. The verdicts say both terms."""
    fast, rows = chain_search(100.0)
    assert (fast.pipeline, fast.virtual_stages) == (2, 4)
    assert rows[4]["bubble_s"] == pytest.approx(rows[1]["bubble_s"] / 4)
    assert "slower by" in rows[1]["why"] and "1 virtual stage: bubble" in rows[1]["why"]
    assert "chosen 4 virtual stages" in rows[1]["why"]
    slow, rows = chain_search(0.001)
    assert (slow.pipeline, slow.virtual_stages) == (2, 1)
    assert rows[2]["transfer_s"] - rows[1]["transfer_s"] > rows[1]["bubble_s"] - rows[2]["bubble_s"]
    assert rows[2]["why"].startswith("slower by") and "waits for transfers" in rows[2]["why"]


def described(gbps):
    """Two pipeline stages of a deep MLP (Whale Example 3's keys) on two
    devices described as slow at compute (30 MFLOPS: the bubble is what
    the step wastes) with a link of ``gbps``."""
    return {"auto.auto_parallel": True, "auto.num_task_graph": 2, "cluster.num_devices": 2,
            "auto.global_batch": 8, "pipeline.num_micro_batch": 2, "pipeline.schedule": "1f1b",
            "cluster.hardware": [{"name": "slow", "tflops": 3e-5, "memory_gb": 1,
                                  "intra_node_gbps": gbps}]}


def test_the_chosen_virtual_stages_train_as_one_device():
    """The search interleaves two stages per device: four TaskGraphs, 0 and 2
    on CPU:0, 1 and 3 on CPU:1; the numbers of plain TF; every stage ran
    where placed (``proof``, in ``assert_equivalent``); each device's tasks
    are chained across its two stages. On a slow link it does not."""
    build = deep_mlp(6)
    reference = train(build, DATA)
    result = train(build, DATA, described(100.0))
    entry, = TRACER.graphs.values()
    plan = entry.plan
    assert (plan.virtual_stages, len(plan.task_graphs)) == (2, 4)
    assert [tg.devices[0][-1] for tg in plan.task_graphs] == list("0101")
    assert "virtual_stages=2 (interleaved)" in plan.summary()
    task_of = {op: s for (_, s, _, _), members in entry.rewrite.task_ops.items()
               for op in members}
    chained = {(task_of[a], task_of[b]) for a, b in entry.rewrite.schedule_edges
               if a in task_of and b in task_of}
    assert {(2, 0), (0, 2), (3, 1), (1, 3)} <= chained  # a device's two stages, both ways
    assert all(a % 2 == b % 2 for a, b in chained)
    assert_equivalent(reference, result)
    assert plan_of(build, described(0.001)).virtual_stages == 1


def test_long_steps_are_extrapolated_from_a_replay():
    """Past ``replayed`` micro-batches a step grows by the replay's mean
    per micro-batch: within 3% of the whole replay for stages within 10% of
    each other and transfers up to three stages long; the peaks are the
    replay's."""
    rng = random.Random(45)
    for groups in (2, 3, 8):
        for virtual in (2, 4):
            for share in (0.0, 0.01, 0.1, 1.0, 3.0):
                times = [rng.uniform(0.9, 1.1) for _ in range(groups * virtual)]
                cap = replayed(groups, virtual)
                for micro in (cap + groups, 2 * cap):
                    whole = simulate(interleaved_schedule(groups, virtual, micro),
                                     [t / 3 for t in times], [2 * t / 3 for t in times],
                                     share * max(times), device_groups=groups).length
                    assert interleaved_length(times, groups, micro, share * max(times)) == \
                        pytest.approx(whole, rel=0.03), (groups, virtual, share, micro)
            kept = [rng.uniform(0.5, 1.5) for _ in range(groups * virtual)]
            assert group_peaks(kept, groups, 2 * cap) == pytest.approx(_walked(kept, groups, 2 * cap))


def _walked(kept, groups, micro):
    """The peaks by hand: every task of the whole schedule walked."""
    schedule = interleaved_schedule(groups, len(kept) // groups, micro)
    peaks = []
    for g in range(groups):
        held = peak = 0.0
        for task, s in sorted(((task, s) for s in range(g, len(kept), groups)
                               for task in schedule[s]), key=lambda pair: pair[0].slot):
            held += kept[s] if task.kind == "F" else -kept[s]
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def split_described(gbps, memory_bytes=2 ** 30):
    """Two device groups of a 10-layer MLP on 4 devices slow at compute,
    holding ``memory_bytes`` each, with a link of ``gbps``."""
    return {"auto.auto_parallel": True, "auto.num_task_graph": 2, "cluster.num_devices": 4,
            "pipeline.num_micro_batch": 2, "pipeline.schedule": "1f1b",
            "cluster.hardware": [{"name": "slow", "tflops": 3e-5,
                                  "memory_gb": memory_bytes / 2 ** 30, "intra_node_gbps": gbps}]}


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
def test_split_stages_interleave_too_and_the_pinned_plan_trains_as_one_device():
    """Tensor x pipeline x virtual stages: devices with 85% of the memory a
    data parallel pipeline needs force every stage split over 2 devices;
    the fast link and slow compute make the bubble worth interleaving (2
    micro-batches: a step of 1F1B is 3 stage shares, interleaved 2.5): 4
    split stages, 2 per group (CPU:0-1 runs 0 and 2). Pinned, the model is
    built so and trains with the numbers of one device, every stage where
    planned; on a slow link the search does not interleave."""
    build = deep_mlp(10, layer)  # tf.compat.v1.layers: split as the plan says
    data_parallel = plan_of(build, split_described(0.001))
    assert not data_parallel.sharding
    tight = 0.85 * max(data_parallel.estimate["memory_bytes_per_device"])
    plan = plan_of(build, split_described(100.0, tight))
    assert (plan.sharding["tensor_degree"], plan.virtual_stages) == (2, 2)
    groups = [tg.replicas for tg in plan.task_graphs]
    assert groups == [((CPU + "0", CPU + "1"),), ((CPU + "2", CPU + "3"),)] * 2
    pinned = {**split_described(100.0, tight), "plan": plan.to_dict()}
    assert_equivalent(train(build, DATA), train(build, DATA, pinned))
    built = plan_of(build, pinned)
    assert built.virtual_stages == 2 and [tg.replicas for tg in built.task_graphs] == groups
    slow = plan_of(build, split_described(0.001, tight))
    assert (slow.sharding["tensor_degree"], slow.virtual_stages) == (2, 1)


def test_split_stages_in_mixed_precision_are_weighed_on_the_step_they_run():
    """Eight GPT blocks of width 4096 on 16 A100s in 16-bit mixed precision,
    a pipeline of 4 with 8 micro-batches: a tensor-split mesh's 1F1B step
    is about (8 + 3) / 8 of its busy seconds, and 2 virtual stages make it
    more than ``TOLERANCE`` faster. The search weighs the seconds its
    setting runs (``busy_s``) and tries the interleaved mesh (it did not
    before); its layers' seconds (``parts``) are that setting's, shared out
    (issue 64: they were at the compute dtype, without mixed precision's
    speed-up, and added up to more than the step)."""
    view = dataclasses.replace(gpt_view(layers=8, hidden=4096, heads=32, batch=16, seq=2048,
                                        vocab=1024), compute_dtype="tf32")
    found = search_all(view, 16, DGX_A100, 16, 8, pipeline=4, split_heads=True,
                       techniques=(Techniques("none", 0, True),), schedules=("1f1b",))
    split = {c.virtual_stages: c for c in found if c.tensor == 2}
    base = split[1]
    assert sum(part.seconds for part in base.parts) / 4 == pytest.approx(base.busy_s)
    assert base.busy_s <= base.step_time_s - base.bubble_s - base.transfer_s
    assert base.step_time_s > (1 + TOLERANCE) * base.busy_s
    assert split[2].step_time_s * (1 + TOLERANCE) < base.step_time_s
