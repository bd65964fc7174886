"""Issue 48 item 7: more pipeline scopes than devices, and fewer.

More ``replicate(1)`` scopes than devices: consecutive TaskGraphs share a
device (Whale lets VirtualDevices overlap), each still a stage of task
functions, and tfpar says so. Before, every scope took device 0 and the
whole 5-stage pipeline ran 4 times (nested data parallelism), each stage
on every device. Fewer scopes than devices, the count not a multiple: the
unused devices are said to stay idle."""
import warnings

import pytest
import tensorflow as tf

from equivalence import assert_equivalent, train
from proof import TRACER
from tied_gpt import FIVE, gpt, token_data

import tfpar as wh
from tfpar.cluster import assign_devices, device_names

v1 = tf.compat.v1
DATA = token_data()
THREE = [["embedding", 0], [1], [2, "head"]]


def test_consecutive_task_graphs_share_devices_when_there_are_more_than_devices():
    cpus = device_names("CPU", 4)

    def placed(counts, share=False):
        assignment = assign_devices([(f"tg{i}", c) for i, c in enumerate(counts)], cpus, share)
        return assignment.nested_dp, [[cpus.index(d) for d in vds[0]]
                                      for vds in assignment.virtual_devices]
    assert placed([1] * 5) == (1, [[0], [0], [1], [2], [3]])
    assert placed([1] * 6) == (1, [[0], [0], [1], [2], [2], [3]])
    assert placed([2] * 3) == (1, [[0, 1], [0, 1], [2, 3]])
    assert placed([4, 4]) == (1, [[0, 1, 2, 3]] * 2)  # Whale Example 2: one group
    assert placed([1] * 5, share=True) == (4, [[0]] * 5)  # forced: all from the first
    assert placed([1] * 3) == (1, [[0], [1], [2]])  # CPU:3 idle


def said_during(run):
    """(what ``run()`` returns, the FallbackWarnings it gave)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", wh.FallbackWarning)
        result = run()
    return result, [str(w.message) for w in said if issubclass(w.category, wh.FallbackWarning)]


def built(scopes, config, rewrite=True):
    """(the graph of ``gpt(scopes)`` built under ``config``, its plan), the graph
    rewritten (at its initializer) if ``rewrite``."""
    graph = tf.Graph()
    with graph.as_default():
        wh.init(config)
        gpt(scopes)(v1.placeholder(tf.int64, [None, DATA[0].shape[-1]]), None)
        if rewrite:
            with v1.Session() as sess:
                sess.run(v1.global_variables_initializer())
        plan = wh.current_plan()
    wh.reset()
    return graph, plan


@pytest.fixture(scope="module")
def reference():
    return train(gpt(), DATA)


def test_a_tied_gpt_in_five_scopes_on_four_devices(reference):
    """The embedding in a scope of its own shares CPU:0 with the first block;
    every stage is task functions: from 4 to 8 micro-batches the graph grows
    by a few ops per call (10 calls per micro-batch), not by a copy of the
    stages (about 2,200 ops per micro-batch with copies)."""
    config = {"cluster.num_devices": 4, "pipeline.num_micro_batch": 4}
    result, said = said_during(lambda: train(gpt(FIVE), DATA, config))
    entry, = TRACER.graphs.values()
    assert [tg.devices[0][-1] for tg in entry.plan.task_graphs] == list("00123")
    assert said == [
        "tfpar: 5 TaskGraphs asking for 5 devices in all, on 4: they share devices: "
        "'replicate_0', 'replicate_1' on CPU:0; 'replicate_2' on CPU:1; 'replicate_3' on "
        "CPU:2; 'replicate_4' on CPU:3. For devices of their own, use 5 devices "
        "(cluster.num_devices) or fewer scopes"]
    assert entry.rewrite.functions and said[0] in entry.plan.notes
    assert_equivalent(reference, result, rtol=1e-4)
    ops = [len(said_during(lambda m=m: built(FIVE, {**config, "pipeline.num_micro_batch": m})
                           )[0][0].get_operations()) for m in (4, 8)]
    grown = ops[1] - ops[0]
    assert 0 < grown <= 4 * 10 * 2


def test_three_stages_on_four_devices_leave_one_idle_and_say_so(reference):
    config = {"cluster.num_devices": 4, "pipeline.num_micro_batch": 2}
    result, said = said_during(lambda: train(gpt(THREE), DATA, config))
    assert said == [
        "tfpar: 4 devices: CPU:3 left idle: one copy of the model uses 3, and 4 is not a "
        "multiple of 3, so the model is not replicated on the rest (nested data "
        "parallelism). Use a multiple of 3 devices (cluster.num_devices), or ask for the idle "
        "ones in a scope (a larger replicate(n))"]
    assert_equivalent(reference, result, rtol=1e-4)
    # On 6 devices the pipeline runs twice (nested data parallelism), silently.
    (_, plan), said = said_during(lambda: built(THREE, {**config, "cluster.num_devices": 6},
                                              rewrite=False))
    assert plan.data_parallel_degree == 2 and not said
