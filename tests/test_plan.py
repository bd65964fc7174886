"""The plan is visible before any session runs, serialisable, and pinnable."""
import copy
import dataclasses
import json
import pathlib
import re

import pytest
import tensorflow as tf

from equivalence import assert_equivalent, make_data, mlp_classifier, train

import tfpar as wh
from tfpar.cluster import assign_devices, device_names
from tfpar.ir.compact import device_ranges, numbered
from tfpar.ir.plan import Plan, TaskGraphPlan


def _plan(config, scope=None):
    with tf.Graph().as_default():
        wh.init(config)
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        if scope is None:
            mlp_classifier()(x, y)
        else:
            with scope:
                mlp_classifier()(x, y)
        return wh.current_plan()


def test_plan_summary_and_json():
    plan = _plan({"cluster.num_devices": 4})
    data = json.loads(plan.to_json())
    assert data["data_parallel_degree"] == 4
    assert data["pipeline"] == {"num_micro_batch": 1, "schedule": "1f1b", "group_size": 1,
                                "num_stages": 1}
    tg = data["task_graphs"][0]
    assert tg["strategy"] == "replicate" and len(tg["devices"]) == 4
    assert tg["devices"][3].endswith("device:CPU:3")
    assert tg["param_bytes"] == 4 * (6 * 8 + 8 + 8 * 3 + 3)
    assert set(data["estimate"]) >= {"step_time_s", "memory_bytes_per_device", "comm_bytes"}
    assert Plan.from_dict(data) == plan
    text = plan.summary()
    assert "replicate_all" in text and "CPU:0-3" in text


def test_scope_plan_uses_its_devices():
    plan = _plan({"cluster.num_devices": 4}, scope=wh.replicate(2, name="body"))
    # replicate(2) on 4 devices: nested data parallelism of degree 2.
    assert plan.task_graphs[0].name == "body"
    assert plan.data_parallel_degree == 4


def test_pinned_plan_is_followed():
    plan = _plan({"cluster.num_devices": 4}).to_dict()
    plan["task_graphs"][0]["replicas"] = [[d] for d in plan["task_graphs"][0]["devices"][2:]]
    plan["task_graphs"][0]["devices"] = plan["task_graphs"][0]["devices"][2:]
    plan["task_graphs"][0]["device_count"] = 2  # the VirtualDevice: both devices
    plan["data_parallel_degree"] = 2  # copies of the model (else refused: test_pinned_plans)
    pinned = _plan({"cluster.num_devices": 4, "plan": plan})
    assert pinned.data_parallel_degree == 2
    assert [d[-5:] for d in pinned.task_graphs[0].devices] == ["CPU:2", "CPU:3"]
    data = make_data(steps=2, batch=8)
    build = mlp_classifier()
    assert_equivalent(train(build, data), train(build, data, {"cluster.num_devices": 4,
                                                              "plan": plan}))


def test_pinned_plan_with_unknown_device():
    plan = _plan({"cluster.num_devices": 2}).to_dict()
    plan["task_graphs"][0]["devices"] = ["/job:localhost/replica:0/task:0/device:CPU:7"]
    plan["task_graphs"][0]["replicas"] = [plan["task_graphs"][0]["devices"]]
    plan["task_graphs"][0]["device_count"], plan["data_parallel_degree"] = 1, 1
    with pytest.raises(wh.PlanError, match="CPU:7"):
        _plan({"cluster.num_devices": 2, "plan": plan})


def test_virtual_devices_disjoint_nested_and_shared():
    devs = device_names("GPU", 8)
    a = assign_devices([("s0", 2), ("s1", 2)], devs)
    assert a.nested_dp == 2
    assert a.virtual_devices[0] == (tuple(devs[0:2]), tuple(devs[4:6]))
    assert a.virtual_devices[1] == (tuple(devs[2:4]), tuple(devs[6:8]))
    shared = assign_devices([("backbone", 8), ("head", 8)], devs)  # Whale Example 2
    assert shared.nested_dp == 1 and shared.virtual_devices[1] == (tuple(devs),)
    forced = assign_devices([("a", 4), ("b", 4)], devs, share=True)
    assert forced.nested_dp == 2 and forced.virtual_devices[1][1] == tuple(devs[4:8])
    odd = assign_devices([("a", 3)], device_names("CPU", 4))
    assert odd.nested_dp == 1
    with pytest.raises(wh.AnnotationError, match="'big' asks for 9 devices"):
        assign_devices([("big", 9)], devs)


def test_a_summary_of_thousands_of_devices_stays_short():
    """A 3-D plan on 1024 GPUs (data 16 x tensor 8 x pipeline 8, 96 blocks):
    one row for the six alike middle stages, device ranges, and each
    sharded layer of the 96 blocks written once."""
    gpus = [f"/job:worker/replica:0/task:0/device:GPU:{i}" for i in range(1024)]

    def stage(s, first, last):
        units = {f"h{i}/mlp/c_fc": "column" for i in range(first, last)}
        return TaskGraphPlan(f"stage_{s}", "split", 128, tuple(
            tuple(gpus[s * 128 + r * 8: s * 128 + r * 8 + 8]) for r in range(16)),
            units, 900, 2 ** 30, {"time_s": 0.5, "memory_bytes": 2 ** 35, "comm_bytes": 1e9})
    stages = [stage(0, 0, 12)] + [stage(s, 12 * s, 12 * s + 12) for s in range(1, 7)]
    last = dataclasses.replace(stage(7, 84, 96), num_ops=950)
    plan = Plan(tuple(stages + [last]), 16, 64, sharding={
        "tensor_degree": 8, "layers": {f"h{i}/{name}": how for i in range(96) for name, how
                                       in (("mlp/c_fc", "column"), ("mlp/c_proj", "row"))}})
    lines = plan.summary().splitlines()
    assert len(lines) == 10, plan.summary()  # 2 of them the columns' note
    assert any(line.startswith("stage_{0..6}") and "GPU:0-895" in line for line in lines)
    assert any(line.startswith("stage_7") and "GPU:896-1023" in line for line in lines)
    assert "  stage_{0..6}: h{0..83}/mlp/c_fc -> column" in lines
    assert lines[-1] == ("sharded layers (tensor degree 8): h{0..95}/mlp/c_fc -> column, "
                         "h{0..95}/mlp/c_proj -> row")


def test_names_that_differ_in_one_number_are_written_once():
    assert device_ranges([f"/device:CPU:{i}" for i in (0, 1, 2, 3, 5, 6)]
                         + ["/device:GPU:0"]) == "CPU:0-3,CPU:5,CPU:6,GPU:0"
    assert numbered([f"h{i}/fc" for i in range(4)] + ["emb", "d_1", "d_3", "d_5", "x1y2", "x2y3",
                                                      "x3y3"]) == \
        ["h{0..3}/fc", "emb", "d_{1,3,5}", "x1y2", "x2y3", "x3y3"]
    assert numbered([f"h{i}/ln{k}" for i in range(4) for k in (1, 2)]) == ["h{0..3}/ln1",
                                                                           "h{0..3}/ln2"]


def test_the_summary_says_what_an_estimate_assumes_and_how_the_plan_was_found():
    """A costed plan's summary states its device and node size, compute
    dtype and the peak it used (a V100 has no TF32 units: its fp32 peak),
    efficiency, batch and where it came from, the FLOPs it counts (model and,
    with recomputation, hardware), and how the search went. The JSON keeps
    them, and a pinned plan reads them back."""
    tg = TaskGraphPlan("replicate_all", "replicate", 1, (("/cpu:0",),),
                       estimate={"time_s": 0.5, "memory_bytes": 1, "comm_bytes": 1})
    plan = Plan((tg,), 16, estimate={
        "step_time_s": 0.5, "memory_bytes_per_device": [1], "comm_bytes": 1,
        "assumptions": {"device": "V100-32GB", "devices": 16, "devices_per_node": 8,
                        "compute_dtype": "tf32", "peak_dtype": "fp32", "peak_tflops": 15.7,
                        "efficiency": 0.7, "memory_gbps": 900, "global_batch": 256,
                        "batch_from": "the model's inputs"},
        "flops_per_step": 6e13, "recomputed_flops_per_step": 2e13,
        "model_tflops_per_device": 7.5, "hardware_tflops_per_device": 10.0,
        "search": {"meshes": 12, "planned": 9, "not_searched": [[4, 4], [8, 2]],
                   "left_out": [[16, 1]], "time_limit_s": 60, "seconds": 61.2},
        "stage_search": {"path": "balanced cut", "method": "balanced partition",
                         "why": "the stage ILP found no assignment within its time limit",
                         "timed_out": True},
        "sharding_search": {"path": "optimal", "method": "O2 segments", "why": "",
                            "timed_out": False}})
    lines = plan.summary().splitlines()[-3:]
    assert lines == [
        "assumes: 16 x V100-32GB, 8 a node; tf32 at 15.7 TFLOP/s peak x efficiency 0.7 "
        "(V100-32GB runs tf32 at its fp32 peak); batch 256 (the model's inputs)",
        "FLOPs: 6e+13 a step (model FLOPs: 3 x forward), 7.5 TFLOP/s per device; 10 with the "
        "2e+13 recomputation adds (hardware FLOPs)",
        "search: 9 of 12 meshes planned in 61.2 s (limit 60 s, 2 not searched); stages "
        "balanced cut (balanced partition: the stage ILP found no assignment within its time "
        "limit); sharding optimal (O2 segments)"]
    assert Plan.from_dict(json.loads(plan.to_json())) == plan


# --- the plan JSON's page (issue 64 item 5) -----------------------------------------

ROOT = pathlib.Path(__file__).resolve().parents[1]
PLAN_PAGE = ROOT / "docs" / "plan-json.md"


def documented_fields():
    """{field path: its "required" cell} of docs/plan-json.md's table."""
    rows = re.findall(r"^\| `([^`]+)` \| [^|]+ \| ([^|]+) \|", PLAN_PAGE.read_text(), re.M)
    return {path: required.strip() for path, required in rows}


def documented_example():
    """The page's example plan (the block marked ``readme-test: plan json``)."""
    text = PLAN_PAGE.read_text()
    block = re.search(r"<!-- readme-test: plan json -->\n```\n(.*?)\n```", text, re.S)
    return json.loads(block.group(1))


def field_paths(data):
    """The paths of a plan dict's fields as the page names them."""
    paths = set(data) | {f"pipeline.{key}" for key in data.get("pipeline", {})}
    return paths | {f"task_graphs[].{key}" for tg in data["task_graphs"] for key in tg}


def without(data, path):
    """A copy of plan dict ``data`` without field ``path`` (in every TaskGraph)."""
    data = copy.deepcopy(data)
    *parents, last = path.replace("[]", "").split(".")
    nodes = [data]
    for key in parents:
        nodes = [n for node in nodes for n in (node[key] if isinstance(node[key], list)
                                               else [node[key]])]
    for node in nodes:
        node.pop(last, None)
    return data


def test_the_plan_json_page_lists_every_field_plan_writes_and_reads():
    """docs/plan-json.md's table is the fields to_dict writes (a pipeline of
    virtual stages writes them all), no more; a field it says is required
    is refused by from_dict when absent, naming it; one it says is not is
    read without it. Before, errors cited a design document that is not
    in the repository."""
    fields = documented_fields()
    plan = _plan({"cluster.num_devices": 4})
    written = field_paths(dataclasses.replace(plan, virtual_stages=2).to_dict())
    assert set(fields) == written, (sorted(set(fields) - written), sorted(written - set(fields)))
    example = documented_example()
    for path, required in fields.items():
        if required.startswith("yes, unless"):  # devices, when replicas are given
            with_replicas = copy.deepcopy(example)
            for tg in with_replicas["task_graphs"]:
                width = tg["device_count"] if tg["strategy"] == "split" else 1
                tg["replicas"] = [tg["devices"][i:i + width]
                                  for i in range(0, len(tg["devices"]), width)]
            Plan.from_dict(without(with_replicas, path))
        if required.startswith("yes"):
            name = "plan." + path.replace("[]", "[0]")
            with pytest.raises(wh.PlanError, match=re.escape(f"the pinned plan's {name} must")):
                Plan.from_dict(without(example, path))
        else:
            assert Plan.from_dict(without(example, path)).task_graphs


def test_the_plan_json_pages_example_pins_whale_example_2():
    """The page's example is a plan: pinned, a model of Whale's Example 2
    (a replicated backbone, a split head) on 4 devices runs it."""
    example = documented_example()
    assert field_paths(example) <= set(documented_fields())
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 4, "plan": example})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        with wh.replicate(4):
            h = tf.compat.v1.layers.dense(x, 8, tf.nn.relu)
        with wh.split(4):
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(
                y, tf.compat.v1.layers.dense(h, 16))
        tf.compat.v1.train.GradientDescentOptimizer(0.1).minimize(loss)
        plan = wh.current_plan()
    assert [(tg.strategy, len(tg.replicas), tg.devices) for tg in plan.task_graphs] == [
        (tg["strategy"], 4 if tg["strategy"] == "replicate" else 1, tg["devices"])
        for tg in example["task_graphs"]]
    assert plan.data_parallel_degree == example["data_parallel_degree"] == 1
    assert plan.task_graphs[1].patterns == example["task_graphs"][1]["patterns"]


def test_nothing_cites_a_design_document_the_repository_lacks():
    """Issue 64 item 5: error messages and docstrings cited a design
    document that is not in the repository; they cite docs/ now."""
    missing = "DESIGN" + ".md"
    citing = [str(path.relative_to(ROOT)) for folder in ("tfpar", "docs", "tests", "examples",
                                                           "benchmarks")
              for path in sorted((ROOT / folder).rglob("*"))
              if path.suffix in (".py", ".md") and missing in path.read_text()]
    assert not (ROOT / missing).exists() and not citing, citing


def test_devices_of_different_workers_stay_apart():
    """Issue 64: devices of two workers were both written ``CPU:0``; their
    job and task now tell them apart, in a placement of both and beside
    one another (one worker alone keeps the short names)."""
    workers = [[f"/job:worker/replica:0/task:{t}/device:CPU:{i}" for i in range(4)]
               for t in range(2)]
    assert device_ranges([workers[0][0], workers[1][0]]) == "worker0:CPU:0,worker1:CPU:0"
    assert device_ranges(workers[1]) == "CPU:0-3"
    assert device_ranges(workers[1], workers[0] + workers[1]) == "worker1:CPU:0-3"
    plan = Plan((TaskGraphPlan("stage_0", "replicate", 1, tuple((d,) for d in workers[0])),
                 TaskGraphPlan("stage_1", "replicate", 1, tuple((d,) for d in workers[1])),
                 TaskGraphPlan("both", "replicate", 1, ((workers[0][0],), (workers[1][0],)))),
                4)
    lines = plan.summary().splitlines()
    assert {line.split()[0]: line.split()[-1] for line in lines[3:6]} == {
        "stage_0": "worker0:CPU:0-3", "stage_1": "worker1:CPU:0-3",
        "both": "worker0:CPU:0,worker1:CPU:0"}, plan.summary()
    assert lines[6].startswith("devices: logical CPU devices of each of 2 hosts,"), lines[6]


def test_a_gpts_sharded_layers_are_folded_across_layers_and_wrapped():
    """Issue 64: a GPT sharded by the search (one split TaskGraph per
    block's attention) listed each block's Reshape and transpose units on
    lines of their own and its sharded layers on one line of thousands of
    characters. Repeated lines are now written once for every block, and
    long lines are broken between layers."""
    units = ["q", "Reshape", "Reshape_1", "Reshape_2", "Reshape_3", "transpose",
             "transpose_1", "transpose_2", "transpose_3", "k", "v", "Softmax", "out"]
    cpus = tuple((f"/job:localhost/replica:0/task:0/device:CPU:{i}",) for i in range(8))
    tgs, layers = [], {}
    for block in range(24):
        patterns = {f"layer_{block}/attention/{u}": "heads" for u in units}
        layers.update(patterns)
        tgs += [TaskGraphPlan(f"split_{2 * block + 1}", "split", 8, (sum(cpus, ()),),
                              patterns, num_ops=40 + block),
                TaskGraphPlan(f"default_{2 * block + 2}", "replicate", 1, cpus, num_ops=3)]
    lines = Plan(tuple(tgs), 8, sharding={"tensor_degree": 8, "layers": layers}
                 ).summary().splitlines()
    units_said = [line for line in lines if line.startswith("  split")]
    assert "  split_{1,3..47}: layer_{0..23}/attention/Reshape_{1..3} -> heads" in units_said
    assert len(units_said) == 9, units_said  # q, Reshape, _{1..3}, transpose, ..., out
    assert max(len(line) for line in lines) <= 100, max(lines, key=len)
    said = " ".join(lines[lines.index(next(line for line in lines
                                           if line.startswith("sharded layers"))):])
    assert "layer_{0..23}/attention/transpose_{1..3} -> heads," in said


def test_numbers_rising_together_and_sets_are_folded_once_more():
    assert numbered([f"split_{2 * i + 1}: h{i}/q" for i in range(3)]) == ["split_{1,3,5}: h{0..2}/q"]
    assert numbered([f"h{i}/Reshape_{k}" for i in range(4) for k in (1, 2, 3)]) == [
        "h{0..3}/Reshape_{1..3}"]
    assert numbered([f"d_{i}" for i in range(0, 20, 4)]) == ["d_{0,4..16}"]
    assert numbered(["x1y2", "x2y3", "x3y3"]) == ["x1y2", "x2y3", "x3y3"]  # y does not rise


def test_the_assumed_batch_gives_way_to_the_one_a_measured_step_was_fed():
    """Issue 64: the summary said "batch 32 (assumed: ...)" above a
    measured table of the same run saying "batch 64, fed"."""
    tg = TaskGraphPlan("replicate_all", "replicate", 1, (("/cpu:0",),),
                       estimate={"time_s": 0.5, "memory_bytes": 1, "comm_bytes": 1})
    assumed = "assumed: neither the model's inputs nor auto.global_batch declare one"
    plan = Plan((tg,), 1, estimate={
        "step_time_s": 0.5, "memory_bytes_per_device": [1], "comm_bytes": 1,
        "assumptions": {"device": "host-CPU", "devices": 1, "compute_dtype": "fp32",
                        "peak_dtype": "fp32", "peak_tflops": 0.05, "efficiency": 1,
                        "global_batch": 32, "batch_from": assumed}},
        measured={"step": 3, "batch": 64, "batch_from": "fed", "hardware": "host-CPU",
                  "tolerance": 0.5, "task_graphs": []})
    text = plan.summary()
    assert f"; batch 64 (fed; the estimate assumed 32: {assumed})" in text, text
    assert "batch 64, fed" in text


def test_the_task_graph_columns_say_what_they_count():
    """Issue 64: a pipeline's rows said 29.9 s a stage beside a 19.2 s step,
    unexplained. With several TaskGraphs a note under the table says the
    time is each one's busy time (the step adds bubble and waits), the
    memory is per device (TaskGraphs on the same devices add up) and the
    traffic leaves out the transfers between stages; one TaskGraph, whose
    row is the estimate, has no note."""
    def plan_of(count):
        tgs = tuple(TaskGraphPlan(f"stage_{i}", "replicate", 1, ((f"/cpu:{i}",),),
                                  estimate={"time_s": 0.5, "memory_bytes": 1, "comm_bytes": 1})
                    for i in range(count))
        return Plan(tgs, 1, estimate={"step_time_s": 0.75, "memory_bytes_per_device": [1] * count,
                                      "comm_bytes": 3})
    lines = plan_of(2).summary().splitlines()
    assert lines[5:7] == [
        "(est. time: a TaskGraph's busy time a step, every micro-batch; the step adds bubble and "
        "waits)",
        "(memory/dev: on each of its devices, TaskGraphs on the same ones add up; comm: without "
        "transfers)"], lines
    assert "(est. time" not in plan_of(1).summary()
