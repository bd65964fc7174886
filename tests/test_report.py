"""The plan report's renderer without a browser: what each section says of a
plan, repeated blocks folded, nothing fetched; and why candidates lost."""
import re

from tfpar.cluster.hardware import CATALOG
from tfpar.ir.plan import Plan, TaskGraphPlan
from tfpar.ir.report import render_report
from tfpar.ir.simulate import measured, TimedTask
from tfpar.ir.schedule import Task
from tfpar.planner.candidate import Candidate
from tfpar.planner.memory import Techniques, state_bytes
from tfpar.planner.verdicts import candidate_rows, memory_parts

GB = 2 ** 30


def _pipeline(stages=4, per_stage=2, micro=4):
    """A pipeline of ``stages`` split stages, each costed, 3 blocks a stage."""
    tgs = tuple(TaskGraphPlan(
        name=f"stage_{s}", strategy="split", device_count=per_stage,
        replicas=((f"/job:worker/replica:0/task:{s}/device:GPU:0",
                   f"/job:worker/replica:0/task:{s}/device:GPU:1"),),
        patterns={f"h{b}/mlp/c_fc": "column" for b in range(3 * s, 3 * s + 3)},
        num_ops=100, param_bytes=GB, estimate={"time_s": 0.3, "memory_bytes": 40 * GB})
        for s in range(stages))
    return Plan(task_graphs=tgs, data_parallel_degree=1, num_micro_batch=micro,
                estimate={"step_time_s": 1.5, "assumptions": {"memory_gb": 80, "devices": 8,
                                                              "device": "A100-80GB"},
                          "memory": {"weights": GB, "gradients": GB, "optimizer": 2 * GB,
                                     "activations": 36 * GB}},
                notes=("tfpar: asked <this>, runs that",))


def test_each_section_shows_the_plan():
    page = render_report(_pipeline())
    for title in ("Devices", "Layers and their sharding", "Pipeline schedule",
                  "Memory per device", "Searched candidates", "Notes"):
        assert f"<h2>{title}</h2>" in page
    assert page.count("<rect") > 8 + 4 * 4 * 2  # devices, nodes and every task
    assert "worker 3" in page  # a node per worker task
    assert "<td>h{0..2}/mlp/c_fc</td><td>column</td><td>0</td>" in page  # a stage's blocks
    assert "<td>h{9..11}/mlp/c_fc</td><td>column</td><td>3</td>" in page  # folded, each
    assert "capacity 80 GB" in page and "activations 36.00 GB" in page
    assert "asked &lt;this&gt;, runs that" in page  # notes, escaped


def test_the_schedule_shows_simulated_and_traced_bubbles():
    plan = _pipeline(stages=2, micro=2)
    tasks = [TimedTask(s, Task(k, m), start, start + 10) for s, k, m, start in
             ((0, "F", 0, 0), (0, "F", 1, 10), (1, "F", 0, 20), (1, "B", 0, 30),
              (1, "F", 1, 40), (1, "B", 1, 50), (0, "B", 0, 60), (0, "B", 1, 70))]
    traced = measured(tasks, 2)
    page = render_report(plan, traced)
    simulated = plan.simulate(forward_time=[0.3e3 / 2 / 3] * 2, backward_time=[0.3e3 / 2 * 2 / 3] * 2)
    assert f"bubble {simulated.bubble_fraction:.1%}" in page
    assert f"traced step: 80 us, bubble {traced.bubble_fraction:.1%}" in page
    assert "micro-batch 1" in page


def test_the_page_fetches_nothing_and_runs_no_script():
    page = render_report(_pipeline())
    assert "<script" not in page and "<link" not in page and "@import" not in page
    assert not re.search(r"(src|href)\s*=", page)
    assert "http" not in page


def test_thousands_of_devices_keep_one_box_per_node():
    devices = [f"/job:worker/replica:0/task:{d // 8}/device:GPU:{d % 8}" for d in range(4096)]
    plan = Plan(task_graphs=(TaskGraphPlan("replicate_all", "replicate", 1,
                                           tuple((d,) for d in devices)),),
                data_parallel_degree=4096)
    page = render_report(plan)
    assert "4096 devices on 512 node(s)" in page
    assert page.count("<title>worker ") == 512


def _candidate(data, tensor, pipeline, step, memory, **kw):
    return Candidate(data=data, pipeline=pipeline, stages=(), step_time_s=step,
                     memory_bytes=memory * GB, comm_bytes=0, tensor=tensor, **kw)


def test_each_candidate_says_why_it_lost():
    a100 = CATALOG["A100-80GB"]
    chosen = _candidate(8, 1, 1, 1.0, 40)
    rows = candidate_rows([chosen, _candidate(4, 2, 1, 1.2, 30),
                           _candidate(8, 1, 1, 0.8, 90), _candidate(4, 1, 2, 0.95, 20)],
                          chosen, a100)
    assert [r["why"] for r in rows][:3] == ["chosen", "slower by 20.0%",
                                            "does not fit: needs 90.0 GB, 10.0 GB over 80 GB"]
    assert rows[3]["why"].startswith("within 10% of the fastest, where fewer pipeline stages")
    page = render_report(Plan(task_graphs=_pipeline().task_graphs, data_parallel_degree=1,
                              estimate={"candidates": rows}))
    assert "slower by 20.0%" in page and "4 x 2 x 1" in page


def test_the_fullest_devices_memory_splits_as_the_memory_model_counts():
    tech = Techniques(zero=1)
    state = state_bytes(GB, 8, 1)
    parts = memory_parts(_candidate(8, 1, 1, 1.0, state / GB + 3, techniques=tech,
                                    state_bytes=state))
    assert parts["weights"] == parts["gradients"] == GB
    assert parts["optimizer"] == GB * 2 / 8
    assert abs(parts["activations"] - 3 * GB) < 1


def test_the_report_key_writes_after_a_step_that_runs_the_train_op_alone(
        tmp_path, capsys, caplog):
    """``wh.init({"report": path})``: the first training step is traced and
    the report written after it, also when the script fetches only the
    optimizer's train op (before, such a run was not seen as the step).
    Its path is said once, also to a script that logs at INFO (before,
    it was printed and logged, so such a script showed it twice)."""
    import logging  # pylint: disable=import-outside-toplevel
    import numpy as np  # pylint: disable=import-outside-toplevel
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    import tfpar as wh  # pylint: disable=import-outside-toplevel
    v1 = tf.compat.v1
    caplog.set_level(logging.INFO)
    path = tmp_path / "report.html"
    graph = tf.Graph()
    with graph.as_default():
        wh.init({"cluster.num_devices": 2, "report": str(path)})
        x = v1.placeholder(tf.float32, [None, 4])
        loss = tf.reduce_mean(v1.layers.dense(x, 1) ** 2)
        train = v1.train.AdamOptimizer(0.1).minimize(loss)
        with v1.Session() as sess:
            sess.run(v1.global_variables_initializer())
            assert not path.exists()
            sess.run(train, {x: np.ones((8, 4), np.float32)})
    wh.reset()
    text = path.read_text(encoding="utf-8")
    assert "traced step: " in text and "CPU:1" in text
    said = capsys.readouterr().out + caplog.text
    assert said.count("plan report written") == 1, said


def test_layers_keep_model_order_and_times_have_no_exponent():
    """Issue 64: the layer table sorted a TaskGraph's units by name (the
    head before the embedding) and times read ``1.917e+04 ms``."""
    units = {"wte": "vocab", **{f"h{i}/mlp/c_fc": "column" for i in range(12)},
             "lm_head": "column"}
    tg = TaskGraphPlan("split_0", "split", 2, (("/device:GPU:0", "/device:GPU:1"),),
                       patterns=units, estimate={"time_s": 19.17, "memory_bytes": GB})
    rows = candidate_rows([_candidate(1, 2, 1, 19.17, 40)], _candidate(1, 2, 1, 19.17, 40),
                          CATALOG["A100-80GB"])
    page = render_report(Plan((tg,), 1, estimate={"step_time_s": 19.17, "candidates": rows}))
    layers = re.findall(r"<tr><td>([^<]*)</td><td>(?:vocab|column)</td>", page)
    assert layers == ["wte", "h{0..11}/mlp/c_fc", "lm_head"], layers
    assert "e+" not in page
    assert "estimated step 19170 ms" in page and "<td>19170 ms</td>" in page
