"""Interleaved pipelines (``pipeline.virtual_stages``, Narayanan et al. SC'21
§2.2; issue 45): each device group runs several non-adjacent stages, their
tasks interleaved in one 1F1B order, so the pipeline's bubble shrinks by the
number of virtual stages. The placement, the schedule and its simulation by
hand; a tied GPT of four stages on two devices trains with the numbers of
one device, each stage where the plan put it, each device's tasks chained
across its stages."""
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, layer, train
from proof import TRACER
from test_split import DATA as SPLIT_DATA, scope
from tied_gpt import FOUR, gpt, token_data

import tfpar as wh
from tfpar.cluster import assign_devices, device_names
from tfpar.ir.schedule import build_schedule, interleaved_schedule, validate_schedule
from tfpar.ir.simulate import simulate

v1 = tf.compat.v1
DATA = token_data(batch=8)
CPU = "/job:localhost/replica:0/task:0/device:CPU:"
INTERLEAVED = {"cluster.num_devices": 2, "pipeline.num_micro_batch": 4,
               "pipeline.virtual_stages": 2}


def test_task_graphs_are_dealt_round_robin_to_device_groups():
    cpus = device_names("CPU", 4)

    def placed(count, devices, virtual):
        assignment = assign_devices([(f"tg{i}", devices) for i in range(count)], cpus,
                                    virtual_stages=virtual)
        return assignment.nested_dp, [[cpus.index(d) for d in vds[0]]
                                      for vds in assignment.virtual_devices]
    assert placed(4, 1, 2) == (2, [[0], [1], [0], [1]])  # and a second copy on CPU:2-3
    assert placed(8, 1, 2) == (1, [[0], [1], [2], [3], [0], [1], [2], [3]])
    assert placed(4, 2, 2) == (1, [[0, 1], [2, 3], [0, 1], [2, 3]])
    with pytest.raises(wh.AnnotationError, match="virtual_stages 2"):
        placed(3, 1, 2)


@pytest.mark.parametrize("groups,virtual,micro", [(2, 2, 4), (4, 2, 8), (4, 4, 8), (3, 2, 6),
                                                   (4, 2, 4)])
def test_the_interleaved_bubble_is_one_over_the_virtual_stages(groups, virtual, micro):
    """Every stage runs each forward and backward once (forward first), no
    device waits on itself (no deadlock), and with stages of F = 1 / V and
    B = 2 / V (a device's whole model costs 1 + 2 a micro-batch) a step lasts
    M x 3 + (G - 1) x 3 / V: 1F1B's bubble divided by V (SC'21 §2.2.1)."""
    schedule = interleaved_schedule(groups, virtual, micro)
    validate_schedule(schedule, micro)
    stages = groups * virtual
    result = simulate(schedule, 1 / virtual, 2 / virtual, device_groups=groups)
    assert result.length == pytest.approx(micro * 3 + (groups - 1) * 3 / virtual)
    one_f_one_b = simulate(build_schedule("1f1b", groups, micro), 1.0, 2.0)
    assert one_f_one_b.length == pytest.approx(micro * 3 + (groups - 1) * 3)
    assert len({task.slot for s in range(0, stages, groups) for task in schedule[s]}) == \
        2 * micro * virtual  # group 0's tasks: one slot each


def test_micro_batches_come_in_rounds_of_the_groups():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        interleaved_schedule(4, 2, 6)


@pytest.fixture(scope="module")
def reference():
    return train(gpt(), DATA)


def test_four_stages_on_two_devices_interleaved_train_as_one_device(reference):
    """Stages 0 and 2 on CPU:0, 1 and 3 on CPU:1 (asked: no sharing said);
    the numbers of plain TF; every stage ran where placed (``proof``); and
    a device's tasks are chained across its stages (a barrier before stage
    2's first forward on CPU:0 waits for stage 0's second)."""
    result = train(gpt(FOUR), DATA, INTERLEAVED)
    entry, = TRACER.graphs.values()
    plan = entry.plan
    assert [tg.devices[0][-1] for tg in plan.task_graphs] == list("0101")
    assert plan.virtual_stages == 2 and "virtual_stages=2 (interleaved)" in plan.summary()
    assert wh.Plan.from_dict(plan.to_dict()).virtual_stages == 2  # pinned as planned
    assert not plan.notes
    task_of = {op: (s, kind + str(m)) for (_, s, kind, m), members in entry.rewrite.task_ops.items()
               for op in members}
    chained = {(task_of[a], task_of[b]) for a, b in entry.rewrite.schedule_edges
               if a in task_of and b in task_of}
    # CPU:0 runs stage 0's F0 F1, stage 2's F0 F1, stage 0's F2, stage 2's B0, ...
    assert ((2, "F0"), (0, "F1")) in chained and ((0, "F2"), (2, "F1")) in chained
    assert ((2, "B0"), (0, "F2")) in chained
    assert all(a[0] % 2 == b[0] % 2 for a, b in chained)  # only within a device
    assert_equivalent(reference, result)


def test_virtual_stages_need_rounds_of_micro_batches_and_1f1b():
    with pytest.raises(wh.PlanError, match="multiple of the 2 groups"):
        train(gpt(FOUR), DATA, {**INTERLEAVED, "pipeline.num_micro_batch": 3})
    with pytest.raises(wh.ConfigError, match="pipeline.virtual_stages"):
        wh.init({**INTERLEAVED, "pipeline.schedule": "gpipe"})


def _split_stages(tfpar, stages=4):
    """An MLP of ``stages`` layers, each in its own ``wh.split(2)`` scope."""
    def build(x, y):
        h = x
        for i in range(stages - 1):
            with scope(tfpar, "split", 2):
                h = layer(h, 12, f"fc{i}", seed=i + 1, activation=tf.nn.tanh)
        with scope(tfpar, "split", 2):
            logits = layer(h, 10, "logits", seed=9)
            loss = v1.losses.sparse_softmax_cross_entropy(y, logits)
        return loss, v1.train.GradientDescentOptimizer(0.5).minimize(loss)
    return build


@pytest.mark.filterwarnings("ignore:.*they are copies of its ops:tfpar.FallbackWarning")
def test_split_stages_interleave_on_their_device_groups():
    """Tensor x pipeline x virtual stages: four split(2) stages on 4 devices,
    V = 2, are built on the device group each is dealt to (stages 0 and 2
    sharded over CPU:0-1, 1 and 3 over CPU:2-3: known as each scope opens,
    2 groups of 2 devices), train as plain TF and run where planned."""
    config = {"cluster.num_devices": 4, "pipeline.num_micro_batch": 2,
              "pipeline.virtual_stages": 2}
    result = train(_split_stages(True), SPLIT_DATA, config)
    entry, = TRACER.graphs.values()
    plan = entry.plan
    assert [tg.replicas for tg in plan.task_graphs] == [((CPU + "0", CPU + "1"),),
                                                        ((CPU + "2", CPU + "3"),)] * 2
    assert plan.virtual_stages == 2 and [tg.strategy for tg in plan.task_graphs] == ["split"] * 4
    # Each group's tasks are chained across its stages in interleaved order:
    # CPU:0-1 runs stage 0's F0 F1, stage 2's F0 F1 B0 B1, stage 0's B0 B1.
    task_of = {op: (s, kind + str(m)) for (_, s, kind, m), members in entry.rewrite.task_ops.items()
               for op in members}
    waits = {barrier.name.split("/")[-1]: {task_of.get(op) for op in barrier.control_inputs}
             for _, barrier in entry.rewrite.schedule_edges}
    assert waits["before_s2_d0_F0"] == {(0, "F1")} and waits["before_s0_d0_B0"] == {(2, "B1")}
    assert waits["before_s3_d0_F0"] == {(1, "F1")} and waits["before_s1_d0_B0"] == {(3, "B1")}
    assert_equivalent(train(_split_stages(False), SPLIT_DATA), result)


def test_split_stages_that_do_not_fill_the_groups_say_how_many_to_build():
    """Three split(2) stages cannot be dealt to 2 groups of 2 devices, V = 2."""
    with pytest.raises(wh.AnnotationError, match="virtual_stages 2"):
        train(_split_stages(True, 3), SPLIT_DATA, {"cluster.num_devices": 4,
                                                  "pipeline.num_micro_batch": 2,
                                                  "pipeline.virtual_stages": 2})
