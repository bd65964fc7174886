"""What users read: printed plans and simulations, `tfpar config`, CLI errors,
and a `tfpar` command that starts without TensorFlow (issue 19 item 9)."""
import subprocess
import sys

import pytest
import tensorflow as tf

from equivalence import mlp_classifier

import tfpar as wh
from tfpar import cli
from tfpar.cluster.hardware import HOST_CPU
from tfpar.cluster.host_speed import host_cpu
from tfpar.config import Config
from tfpar.config_schema import SCHEMA, describe
from tfpar.ir.plan import Plan, TaskGraphPlan
from tfpar.ir.schedule import build_schedule
from tfpar.ir.simulate import simulate

CPU = "/job:localhost/replica:0/task:0/device:CPU:"


def _run(*code_or_args, cwd=None):
    """Run ``python *code_or_args`` in a fresh process."""
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def _plan(step_time_s):
    tg = TaskGraphPlan("replicate_all", "replicate", 1, ((CPU + "0",), (CPU + "1",)),
                       num_ops=30, param_bytes=1000)
    return Plan(task_graphs=(tg,), data_parallel_degree=2,
                estimate={"step_time_s": step_time_s, "memory_bytes_per_device": [2000, 2000],
                          "comm_bytes": 1000})


# --- print(plan), print(plan.simulate()) ----------------------------------------

def test_print_plan_shows_its_summary():
    plan = _plan(None)
    assert str(plan) == plan.summary()
    assert repr(plan).startswith("Plan(task_graphs=(TaskGraphPlan(")


def test_print_simulation_is_one_readable_line():
    result = simulate(build_schedule("1f1b", 2, 4), 1.0, 2.0)
    assert str(result) == "length 15, bubble 20.0%, micro-batches in flight per stage [2, 1]"
    assert repr(result).startswith("SimulationResult(tasks=[")
    assert str(_plan(None).simulate()).startswith("length 30, bubble 0.0%")


def test_cli_simulate_prints_the_same_line_with_its_unit(capsys):
    """The length is in the unit of --forward and --backward, and says so:
    times three as long, the length is three times as long."""
    assert cli.main(["simulate", "--stages", "2", "--micro-batches", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("1f1b schedule, 2 stages x 4 micro-batches: length 15 (in the unit of "
                        "--forward 1 and --backward 2), bubble 20.0%, micro-batches in flight "
                        "per stage [2, 1]")
    assert lines[1].startswith("  vs 1f1b: length 15 (same unit), bubble 20.0%")
    assert cli.main(["simulate", "--stages", "2", "--micro-batches", "4", "--forward", "3",
                     "--backward", "6"]) == 0
    assert "length 45 (in the unit of --forward 3 and --backward 6)" in capsys.readouterr().out


def test_tfpar_help_says_what_it_is_and_lists_its_commands(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "tfpar: plan, inspect and launch TensorFlow training on several devices." in text
    assert "The ``tfpar`` command" not in text
    for command in ("tfpar config", "tfpar plan [--config", "tfpar plan --model",
                    "tfpar launch --workers", "tfpar simulate --stages"):
        assert command in text, command


# --- step_time without an estimate --------------------------------------------

def test_summary_says_why_a_plan_has_no_step_time():
    text = _plan(None).summary()
    assert "n/a" not in text
    assert "step_time=none" in text and "not costed: tfpar costs the plans it makes" in text
    costed = _plan(0.005).summary()
    assert "step_time=5.00 ms" in costed and "costed" not in costed


def test_scope_plans_are_costed():
    """A plan from scopes has a step time, from the model the search and the
    measured-vs-predicted table use (``tests/test_plan_costs.py`` by hand),
    and says what it assumes."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        x = tf.compat.v1.placeholder(tf.float32, [None, 6])
        y = tf.compat.v1.placeholder(tf.int64, [None])
        with wh.replicate(2):
            mlp_classifier()(x, y)
        plan = wh.current_plan()
    assert plan.estimate["step_time_s"] > 0
    assert "not costed" not in str(plan) and "assumes: 2 x host-CPU (measured" in str(plan)


def test_automatic_plans_are_costed_on_the_host_the_prediction_assumes():
    """Issue 64: an automatic plan's summary assumed the generic host CPU
    (0.05 TFLOP/s) while the predicted-vs-measured table of the same run
    predicted on the host's measured throughput. One function
    (``cluster_hardware``) decides the device for the search, the estimate
    and the prediction."""
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2, "auto.auto_parallel": True,
                 "auto.planning_pass": False, "auto.global_batch": 8})
        x = tf.compat.v1.placeholder(tf.float32, [8, 6])
        y = tf.compat.v1.placeholder(tf.int64, [8])
        mlp_classifier()(x, y)
        plan = wh.current_plan()
    wh.reset()
    assert plan.estimate["assumptions"]["device"] == host_cpu().name, plan.estimate
    assert f"assumes: 2 x {host_cpu().name}; " in str(plan)


# --- tfpar config ---------------------------------------------------------------

def test_config_listing_fits_100_columns(capsys):
    assert cli.main(["config"]) == 0
    text = capsys.readouterr().out
    assert text == describe() + "\n"
    assert max(len(line) for line in text.splitlines()) <= 100
    words = " ".join(text.split())
    for key, option in SCHEMA.items():
        assert key in text and " ".join(option.help.split()) in words


def test_config_says_what_an_unset_hardware_means():
    """Not "detected": the planner assumes the generic host CPU, GPUs or not,
    on CPU devices at the host's measured throughput (the prediction's)."""
    from tfpar.runtime.automatic import cluster_hardware  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.context import active  # pylint: disable=import-outside-toplevel
    text = " ".join(SCHEMA["cluster.hardware"].help.split())
    assert "detected" not in text.replace("nothing is detected", "")
    assert (f"generic host CPU ({HOST_CPU.memory_gb:g} GB; on CPU devices at this host's "
            f"measured float32 matmul throughput, else {HOST_CPU.tflops:g} TFLOPS" in text)
    with tf.Graph().as_default():
        wh.init({"cluster.num_devices": 2})
        try:
            assumed = cluster_hardware(active())
            assert (assumed.name, assumed.flops_per_s("fp32"), assumed.memory_gb) == (
                host_cpu().name, host_cpu().tflops * 1e12, HOST_CPU.memory_gb)
        finally:
            wh.reset()


def test_every_built_schedule_is_a_valid_config_value():
    for kind in ("gpipe", "1f1b", "kfkb", "zero_bubble"):
        config = Config({"pipeline.schedule": kind, "pipeline.num_micro_batch": 2}, env={})
        assert config.pipeline.schedule == kind
    assert "'zero_bubble'" in describe()


# --- missing scripts --------------------------------------------------------------

@pytest.mark.parametrize("command", [["plan"], ["launch", "--workers", "2"]])
def test_missing_script_is_named_without_traceback(command, tmp_path):
    out = _run("-m", "tfpar.cli", *command, "nosuch.py", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == f"tfpar {command[0]}: nosuch.py: no such file\n"
    assert out.stdout == ""


# --- no TensorFlow for commands that do not need it -----------------------------

@pytest.mark.parametrize("argv", [["--help"], ["config"], ["plan", "--help"],
                                  ["simulate", "--stages", "2", "--micro-batches", "4"]])
def test_commands_without_tensorflow_do_not_import_it(argv):
    code = ("import sys\n"
            "import tfpar.cli\n"
            "try:\n"
            f"    tfpar.cli.main({argv!r})\n"
            "except SystemExit as exc:\n"
            "    assert exc.code == 0, exc.code\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n")
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tensorflow" not in out.stderr


def test_import_tfpar_without_tensorflow_then_lazy_names():
    code = ("import sys\n"
            "import tfpar as wh\n"
            "from tfpar import Config, ConfigError, Plan, PlanError\n"
            "import tfpar.config, tfpar.errors, tfpar.ir.plan, tfpar.ir.simulate\n"
            "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
            "from tfpar import step_timeline\n"
            "assert 'tensorflow' in sys.modules\n")
    out = _run("-c", code)
    assert out.returncode == 0, out.stderr[-2000:]


def test_public_names_are_the_defining_modules_objects():
    from tfpar import api, errors  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import step_trace  # pylint: disable=import-outside-toplevel
    assert wh.init is api.init and wh.replicate is api.replicate and wh.Plan is Plan
    assert wh.step_timeline is step_trace.step_timeline and wh.PlanError is errors.PlanError
    namespace = {}
    exec("from tfpar import *", namespace)  # pylint: disable=exec-used
    assert {name for name in namespace if name != "__builtins__"} == set(wh.__all__)
    assert set(wh.__all__) <= set(dir(wh))
    with pytest.raises(AttributeError, match="no attribute 'nosuch'"):
        wh.nosuch  # pylint: disable=pointless-statement


def test_cli_simulate_interleaves_virtual_stages(capsys):
    """``--virtual-stages 2``: each of 4 devices runs two stages of half its
    times, interleaved; the bubble falls from 27.3% to 15.8% (SC'21 §2.2)."""
    assert cli.main(["simulate", "--stages", "4", "--micro-batches", "8",
                     "--virtual-stages", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("interleaved 1f1b schedule, 4 devices x 2 virtual stages x 8 "
                               "micro-batches: length 28.5 (in the unit of --forward 1 and "
                               "--backward 2), bubble 15.8%")
    assert lines[1].startswith("  vs 1f1b: length 33 (same unit), bubble 27.3%")
    assert len([line for line in lines if line.startswith("  stage ")]) == 8
    assert cli.main(["simulate", "--stages", "4", "--micro-batches", "6",
                     "--virtual-stages", "2"]) == 2
    assert "not a multiple of 4" in capsys.readouterr().err
