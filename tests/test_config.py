"""Tests for tfpar.config and tfpar.errors (pure Python, no TensorFlow)."""
import copy
import json
import os
import pathlib
import pickle
import subprocess
import sys

import pytest

from tfpar.cluster.hardware import device_hardware
from tfpar.config import Config
from tfpar.config_schema import ALIASES, SCHEMA, describe
from tfpar.errors import (AnnotationError, ConfigError, PlanError, ShardingError,
                          TfparError)
from tfpar.ir.taskgraph import Strategy, TaskGraphSpec
from tfpar.planner import plan_from_annotations

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The smallest plan the contract allows (docs/plan-json.md).
PLAN = {"data_parallel_degree": 1, "task_graphs": [
    {"name": "all", "strategy": "replicate", "device_count": 1, "devices": ["/cpu:0"]}]}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """Tests never see the ambient TFPAR_* variables."""
    for var in list(os.environ):
        if var.startswith("TFPAR_"):
            monkeypatch.delenv(var)


def error(fn, *args, **kwargs):
    with pytest.raises(ConfigError) as info:
        fn(*args, **kwargs)
    return str(info.value)


# --- errors ---------------------------------------------------------------

@pytest.mark.parametrize("cls", [ConfigError, AnnotationError, PlanError, ShardingError])
def test_errors_are_value_errors(cls):
    assert issubclass(cls, TfparError) and issubclass(cls, ValueError)


def test_modules_do_not_import_tensorflow():
    code = (
        "import importlib.util, sys, types\n"
        f"root = {str(ROOT / 'tfpar')!r}\n"
        "pkg = types.ModuleType('tfpar'); pkg.__path__ = [root]; sys.modules['tfpar'] = pkg\n"
        "for name in ('errors', 'config'):\n"
        "    spec = importlib.util.spec_from_file_location('tfpar.' + name, f'{root}/{name}.py')\n"
        "    mod = importlib.util.module_from_spec(spec); sys.modules[spec.name] = mod\n"
        "    spec.loader.exec_module(mod)\n"
        "assert sys.modules['tfpar.config'].Config(env={}).pipeline.num_micro_batch == 1\n"
        "assert 'tensorflow' not in sys.modules, 'tensorflow imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd="/")


# --- defaults and access ----------------------------------------------------

def test_defaults():
    cfg = Config()
    for key, option in SCHEMA.items():
        assert cfg.get(key) == option.default
    assert cfg.to_dict() == {
        "cluster": {"num_devices": None, "hardware": None, "devices_per_node": None,
                    "colocate_split_and_replicate": False, "trusted_network": False},
        "pipeline": {"num_micro_batch": 1, "schedule": "auto", "task_functions": True,
                     "group_size": 1, "virtual_stages": 1, "retune_steps": 100,
                     "retune_tolerance": 0.05},
        "split": {"patterns": None, "sequence_parallel": False},
        "auto": {"auto_parallel": False, "num_task_graph": None, "opt_level": "O2",
                 "global_batch": None, "search_time_limit_s": 60.0, "memory_techniques": [],
                 "split_heads": False, "planning_pass": True},
        "memory": {"recompute": [], "offload_optimizer": False, "zero": 0,
                   "mixed_precision": None},
        "balance": {"hardware_aware": True},
        "batch_norm": {"sync": False},
        "communication": {"backend": "auto", "fusion_mb": 64.0, "timeout_s": 60.0},
        "io": {"shard_dataset": False},
        "check": {"finite_gradients": False},
        "measure": {"after_steps": 3, "tolerance": 0.5, "calibrate": None},
        "plan": None,
        "report": None,
        "strict": False,
    }


def test_access_forms():
    cfg = Config({"pipeline.num_micro_batch": 4, "plan": PLAN})
    assert cfg.get("pipeline.num_micro_batch") == 4
    assert cfg["pipeline.num_micro_batch"] == 4
    assert cfg["num_micro_batch"] == 4  # alias
    assert cfg.pipeline.num_micro_batch == 4
    assert cfg.plan == PLAN
    assert "num_micro_batch=4" in repr(cfg.pipeline)
    with pytest.raises(AttributeError):
        cfg.pipeline.num_micro_batches
    with pytest.raises(AttributeError):
        cfg.pipelines
    assert "did you mean 'pipeline.num_micro_batch'" in error(cfg.get, "pipeline.num_microbatch")


def test_immutable():
    plan = copy.deepcopy(PLAN)
    cfg = Config({"plan": plan})
    with pytest.raises(AttributeError):
        cfg.pipeline.num_micro_batch = 2
    with pytest.raises(AttributeError):
        cfg.plan = None
    plan["task_graphs"].append("mutated")  # the caller's dict is copied
    cfg.plan["task_graphs"].append("mutated")  # so is what get() returns
    cfg.to_dict()["plan"]["task_graphs"].append("mutated")
    assert cfg.plan == PLAN


def test_replace_equality_repr_pickle():
    cfg = Config({"pipeline.num_micro_batch": 4})
    new = cfg.replace({"pipeline": {"schedule": "gpipe"}}, num_task_graph=2)
    assert new.pipeline.schedule == "gpipe" and new.auto.num_task_graph == 2
    assert new.pipeline.num_micro_batch == 4 and cfg.pipeline.schedule == "auto"
    assert cfg.replace(**{"pipeline.num_micro_batch": 8})["pipeline.num_micro_batch"] == 8
    with pytest.raises(ConfigError):
        cfg.replace(num_micro_batch=0)
    assert cfg == Config(num_micro_batch=4) and cfg != Config() and cfg != 4
    assert repr(cfg) == "Config({'pipeline.num_micro_batch': 4})"
    assert eval(repr(new), {"Config": Config}) == new
    assert pickle.loads(pickle.dumps(new)) == new


def test_replace_ignores_environment(monkeypatch):
    monkeypatch.setenv("TFPAR_PIPELINE_NUM_MICRO_BATCH", "4")
    cfg = Config()
    assert cfg.pipeline.num_micro_batch == 4
    assert cfg.replace(num_micro_batch=8).pipeline.num_micro_batch == 8


def test_describe_lists_every_key():
    text = describe()
    words = " ".join(text.split())  # help text is wrapped over lines
    for key, option in SCHEMA.items():
        assert key in text and option.help in words


# --- accepted input forms ---------------------------------------------------

EXPECTED = {"pipeline.num_micro_batch": 4, "auto.auto_parallel": True, "auto.num_task_graph": 2}


def check_expected(cfg):
    for key, value in EXPECTED.items():
        assert cfg[key] == value


@pytest.mark.parametrize("mapping", [
    {"pipeline.num_micro_batch": 4, "auto.auto_parallel": True, "auto.num_task_graph": 2},
    {"pipeline": {"num_micro_batch": 4}, "auto": {"auto_parallel": True, "num_task_graph": 2}},
    {"num_micro_batch": 4, "auto_parallel": True, "num_task_graph": 2},
    {"num_micro_batch": 4, "auto": {"auto_parallel": True}, "auto.num_task_graph": 2},
    {"num_micro_batch": 4, "pipeline.num_micro_batch": 4, "auto": {"auto_parallel": True},
     "auto.num_task_graph": 2},  # same key twice with one value is fine
], ids=["dotted", "nested", "aliases", "mixed", "duplicate-agreeing"])
def test_mapping_forms(mapping):
    check_expected(Config(mapping))
    check_expected(Config.load(mapping))


def test_kwargs_forms():
    check_expected(Config(num_micro_batch=4, auto={"auto_parallel": True, "num_task_graph": 2}))
    check_expected(Config({"num_micro_batch": 4}, auto_parallel=True, num_task_graph=2))


def test_all_aliases_resolve():
    for alias, key in ALIASES.items():
        assert key in SCHEMA


def test_load_config_returns_it():
    cfg = Config(num_micro_batch=4)
    assert Config.load(cfg) is cfg


@pytest.mark.parametrize("as_path", [str, pathlib.Path])
def test_load_json_file(tmp_path, as_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"pipeline": {"num_micro_batch": 4}, "auto_parallel": True,
                                "auto.num_task_graph": 2}))
    check_expected(Config.load(as_path(path)))


def test_load_json_text():
    check_expected(Config.load('  {"num_micro_batch": 4, "auto": {"auto_parallel": true, '
                               '"num_task_graph": 2}}'))


def test_load_none_without_env_gives_defaults():
    assert Config.load() == Config() == Config.load(None, env={})


def test_load_none_reads_tfpar_config_path(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(EXPECTED))
    monkeypatch.setenv("TFPAR_CONFIG", str(path))
    check_expected(Config.load())
    check_expected(Config.load(env={"TFPAR_CONFIG": str(path)}))


def test_load_none_reads_tfpar_config_text(monkeypatch):
    monkeypatch.setenv("TFPAR_CONFIG", json.dumps(EXPECTED))
    check_expected(Config.load())
    assert Config().pipeline.num_micro_batch == 1  # only load() reads TFPAR_CONFIG


def test_plan_as_json_text():
    plan = PLAN
    assert Config(plan=json.dumps(plan)).plan == plan
    assert Config.load({"plan": plan}).plan == plan
    assert "line 1 column 2" in error(Config, plan="{oops}")
    assert "JSON object" in error(Config, plan="[1, 2]")


def test_int_accepted_for_float():
    cfg = Config({"communication.fusion_mb": 32, "auto.search_time_limit_s": 0.5,
                  "auto.auto_parallel": True})
    assert cfg.communication.fusion_mb == 32.0 and isinstance(cfg.communication.fusion_mb, float)


def test_group_size_auto_and_hardware():
    hardware = ["V100-32GB", {"name": "custom", "tflops": 10, "memory_gb": 16.0},
                {"name": "linked", "tflops": 1, "memory_gb": 8, "inter_node_gbps": 3.0}]
    cfg = Config({"pipeline.group_size": "auto", "pipeline.schedule": "kfkb",
                  "pipeline.num_micro_batch": 4, "cluster.hardware": tuple(hardware)})
    assert cfg.pipeline.group_size == "auto" and cfg.cluster.hardware == hardware


def test_compact_hardware_is_written_out_per_device(monkeypatch):
    """'N x name': N devices of a catalog name, in a list or alone (also from
    the environment); each resolves to the catalog entry."""
    mixed = Config({"cluster.hardware": ["2 x V100-32GB", "2x P100-16GB"]}).cluster.hardware
    assert [h.name for h in device_hardware(mixed, 4)] == ["V100-32GB"] * 2 + ["P100-16GB"] * 2
    monkeypatch.setenv("TFPAR_CLUSTER_HARDWARE", "1024 x A100-80GB")
    alike = device_hardware(Config().cluster.hardware, 1024)
    assert len(alike) == 1024 and {h.name for h in alike} == {"A100-80GB"}
    with pytest.raises(ConfigError, match="lists 4 devices but there are 8"):
        device_hardware(mixed, 8)
    with pytest.raises(ConfigError, match="unknown device 'A101'"):
        device_hardware("8 x A101", 8)


@pytest.mark.parametrize("aware, stage_devices", [(True, ["/cpu:1", "/cpu:0"]),
                                                   (False, ["/cpu:0", "/cpu:1"])])
def test_hardware_aware_puts_the_first_stage_on_more_memory(aware, stage_devices):
    """balance.hardware_aware (default true): pipeline stages take the
    cluster.hardware devices by memory, most first (Whale §3.3.2); false keeps the
    device order."""
    specs = [TaskGraphSpec(i, f"stage{i}", Strategy.REPLICATE, 1) for i in range(2)]
    cfg = Config({"cluster.hardware": ["P100-16GB", "V100-32GB"],
                  "balance.hardware_aware": aware})
    plan = plan_from_annotations(specs, ["/cpu:0", "/cpu:1"], cfg,
                                 {"num_ops": [1, 1], "param_bytes": [4, 4]})
    assert [tg.devices[0] for tg in plan.task_graphs] == stage_devices


# --- environment overrides -------------------------------------------------

@pytest.mark.parametrize("var, text, key, value", [
    ("TFPAR_PIPELINE_NUM_MICRO_BATCH", "4", "pipeline.num_micro_batch", 4),
    ("TFPAR_COMMUNICATION_FUSION_MB", "32", "communication.fusion_mb", 32.0),
    ("TFPAR_COMMUNICATION_TIMEOUT_S", "2.5", "communication.timeout_s", 2.5),
    ("TFPAR_AUTO_AUTO_PARALLEL", "true", "auto.auto_parallel", True),
    ("TFPAR_AUTO_AUTO_PARALLEL", "YES", "auto.auto_parallel", True),
    ("TFPAR_AUTO_AUTO_PARALLEL", "1", "auto.auto_parallel", True),
    ("TFPAR_BALANCE_HARDWARE_AWARE", "False", "balance.hardware_aware", False),
    ("TFPAR_BALANCE_HARDWARE_AWARE", "no", "balance.hardware_aware", False),
    ("TFPAR_BALANCE_HARDWARE_AWARE", "0", "balance.hardware_aware", False),
    ("TFPAR_PIPELINE_SCHEDULE", "kfkb", "pipeline.schedule", "kfkb"),
    ("TFPAR_PIPELINE_GROUP_SIZE", "auto", "pipeline.group_size", "auto"),
    ("TFPAR_PIPELINE_GROUP_SIZE", "3", "pipeline.group_size", 3),
    ("TFPAR_AUTO_NUM_TASK_GRAPH", "None", "auto.num_task_graph", None),
    ("TFPAR_CLUSTER_NUM_DEVICES", "null", "cluster.num_devices", None),
    ("TFPAR_CLUSTER_NUM_DEVICES", " 8 ", "cluster.num_devices", 8),
    ("TFPAR_CLUSTER_HARDWARE", '["T4", "T4"]', "cluster.hardware", ["T4", "T4"]),
    ("TFPAR_PLAN", json.dumps(PLAN), "plan", PLAN),
    ("TFPAR_STRICT", "true", "strict", True),
])
def test_env_override(monkeypatch, var, text, key, value):
    monkeypatch.setenv(var, text)
    mode = MODES.get(key, {})  # the keys that make ``key`` do something
    source = {**mode, **({key: SCHEMA[key].default} if key != "auto.num_task_graph"
                         else {key: 5})}
    for cfg in (Config(source), Config.load(source), Config.load(json.dumps(source))):
        assert cfg[key] == value and type(cfg[key]) is type(value)
    assert Config(mode, env={var: text})[key] == value  # custom env mapping


MODES = {"pipeline.schedule": {"pipeline.num_micro_batch": 4},
         "pipeline.group_size": {"pipeline.schedule": "kfkb", "pipeline.num_micro_batch": 4}}


def test_env_overrides_file_values(tmp_path, monkeypatch):
    path = tmp_path / "cfg.json"
    path.write_text('{"pipeline": {"num_micro_batch": 2, "schedule": "gpipe"}}')
    monkeypatch.setenv("TFPAR_CONFIG", str(path))
    monkeypatch.setenv("TFPAR_PIPELINE_NUM_MICRO_BATCH", "8")
    cfg = Config.load()
    assert cfg.pipeline.num_micro_batch == 8 and cfg.pipeline.schedule == "gpipe"


def test_env_disabled(monkeypatch):
    monkeypatch.setenv("TFPAR_PIPELINE_NUM_MICRO_BATCH", "4")
    monkeypatch.setenv("TFPAR_CONFIG", '{"num_micro_batch": 2}')
    assert Config(env={}).pipeline.num_micro_batch == 1
    assert Config.load(env={}).pipeline.num_micro_batch == 1


def test_unknown_env_var(monkeypatch):
    monkeypatch.setenv("TFPAR_PIPELINE_NUM_MICROBATCH", "4")
    message = error(Config)
    assert "TFPAR_PIPELINE_NUM_MICROBATCH" in message
    assert "did you mean 'TFPAR_PIPELINE_NUM_MICRO_BATCH'" in message
    assert "TFPAR_PIPELINE_NUM_MICROBATCH" in error(Config.load)


@pytest.mark.parametrize("var, text, fragment", [
    ("TFPAR_PIPELINE_NUM_MICRO_BATCH", "four", "expects int, got 'four' (str)"),
    ("TFPAR_PIPELINE_NUM_MICRO_BATCH", "0", "must be >= 1, got 0"),
    ("TFPAR_PIPELINE_NUM_MICRO_BATCH", "none", "expects int"),
    ("TFPAR_AUTO_AUTO_PARALLEL", "maybe", "expects bool, got 'maybe'"),
    ("TFPAR_COMMUNICATION_FUSION_MB", "big", "expects float"),
    ("TFPAR_PIPELINE_SCHEDULE", "fast", "must be one of 'gpipe', '1f1b', 'kfkb'"),
    ("TFPAR_CLUSTER_HARDWARE", "[T4]", "malformed JSON in environment variable"),
    ("TFPAR_PLAN", "{", "malformed JSON"),
])
def test_bad_env_values(monkeypatch, var, text, fragment):
    monkeypatch.setenv(var, text)
    message = error(Config)
    assert fragment in message and var in message


# --- validation errors -----------------------------------------------------

def test_unknown_key_suggests_the_close_match_and_stays_short():
    message = error(Config, {"pipeline.num_micro_batches": 4})
    assert "'pipeline.num_micro_batches'" in message
    assert "did you mean 'pipeline.num_micro_batch'?" in message
    assert "`tfpar config` lists every key" in message and len(message) < 200


@pytest.mark.parametrize("config, key, mode", [
    ({"pipeline.group_size": 2, "pipeline.schedule": "1f1b", "pipeline.num_micro_batch": 4},
     "pipeline.group_size", "pipeline.schedule 'kfkb'"),
    ({"pipeline.group_size": 2, "pipeline.num_micro_batch": 4}, "pipeline.group_size",
     "pipeline.schedule 'kfkb'"),
    ({"pipeline.retune_steps": 10, "pipeline.schedule": "kfkb", "pipeline.group_size": 2,
      "pipeline.num_micro_batch": 4}, "pipeline.retune_steps", "pipeline.group_size 'auto'"),
    ({"pipeline.retune_tolerance": 0.1}, "pipeline.retune_tolerance",
     "pipeline.group_size 'auto'"),
    ({"pipeline.schedule": "gpipe"}, "pipeline.schedule", "pipeline.num_micro_batch above 1"),
    ({"auto.global_batch": 64}, "auto.global_batch", "auto.auto_parallel true"),
    ({"auto.search_time_limit_s": 5.0}, "auto.search_time_limit_s", "auto.num_task_graph"),
    ({"auto.opt_level": "O3"}, "auto.opt_level", "auto.auto_parallel true"),
    ({"auto.memory_techniques": ["zero"]}, "auto.memory_techniques", "auto.auto_parallel"),
    ({"auto.split_heads": True}, "auto.split_heads", "auto.auto_parallel true"),
    ({"auto.planning_pass": False}, "auto.planning_pass", "auto.auto_parallel true"),
    ({"batch_norm.sync": True, "pipeline.num_micro_batch": 2}, "batch_norm.sync",
     "pipeline.num_micro_batch 1")])
def test_a_key_its_mode_ignores_is_an_error_naming_the_key_and_the_mode(config, key, mode):
    message = error(Config, config)
    assert f"config key {key!r}" in message and "does nothing" in message and mode in message


@pytest.mark.parametrize("config", [
    {"pipeline.group_size": 2, "pipeline.schedule": "kfkb", "pipeline.num_micro_batch": 4},
    {"pipeline.group_size": "auto", "auto.auto_parallel": True},
    {"pipeline.group_size": "auto", "pipeline.schedule": "kfkb", "pipeline.num_micro_batch": 4,
     "pipeline.retune_steps": 10, "pipeline.retune_tolerance": 0.1, "auto.global_batch": 64},
    {"pipeline.schedule": "gpipe", "auto.auto_parallel": True},
    {"auto.num_task_graph": 2, "auto.search_time_limit_s": 5.0},
    {"auto.auto_parallel": True, "auto.opt_level": "O3", "auto.memory_techniques": ["zero"],
     "auto.split_heads": True, "auto.planning_pass": False, "auto.global_batch": 8},
    {"batch_norm.sync": True}])
def test_keys_in_their_modes_are_accepted(config):
    Config(config, env={})


@pytest.mark.parametrize("mapping, unknown, suggestion", [
    ({"pipeline": {"num_micro_batchs": 4}}, "pipeline.num_micro_batchs",
     "pipeline.num_micro_batch"),
    ({"num_micro_batches": 4}, "num_micro_batches", "pipeline.num_micro_batch"),
    ({"comunication.backend": "auto"}, "comunication.backend", "communication.backend"),
    ({"auto.opt_levl": "O3"}, "auto.opt_levl", "auto.opt_level"),
])
def test_unknown_key_variants(mapping, unknown, suggestion):
    message = error(Config, mapping)
    assert repr(unknown) in message and f"did you mean {suggestion!r}?" in message


def test_unknown_key_without_close_match():
    message = error(Config, {"zzzz": 1})
    assert "'zzzz'" in message and "did you mean" not in message
    assert "`tfpar config` lists every key" in message


@pytest.mark.parametrize("key, value, fragment", [
    ("pipeline.num_micro_batch", True, "expects int, got True (bool)"),
    ("pipeline.num_micro_batch", 2.0, "expects int, got 2.0 (float)"),
    ("pipeline.num_micro_batch", "4", "expects int, got '4' (str)"),
    ("cluster.num_devices", False, "expects int|None, got False (bool)"),
    ("auto.num_task_graph", 1.5, "expects int|None, got 1.5 (float)"),
    ("pipeline.group_size", True, "expects int|str, got True (bool)"),
    ("communication.fusion_mb", True, "expects float, got True (bool)"),
    ("communication.fusion_mb", "64", "expects float, got '64' (str)"),
    ("auto.auto_parallel", 1, "expects bool, got 1 (int)"),
    ("auto.auto_parallel", "true", "expects bool, got 'true' (str)"),
    ("pipeline.schedule", None, "expects str, got None (NoneType)"),
    ("cluster.hardware", 4, "expects list|str|None, got 4 (int)"),
    ("plan", [1], "expects dict|None, got [1] (list)"),
])
def test_wrong_types(key, value, fragment):
    message = error(Config, {key: value})
    assert repr(key) in message and fragment in message


@pytest.mark.parametrize("key, value, fragment", [
    ("pipeline.num_micro_batch", 0, "must be >= 1, got 0"),
    ("cluster.num_devices", -1, "must be >= 1, got -1"),
    ("auto.num_task_graph", 0, "must be >= 1, got 0"),
    ("pipeline.group_size", 0, "must be >= 1 or 'auto', got 0"),
    ("pipeline.group_size", "max", "must be >= 1 or 'auto', got 'max'"),
    ("pipeline.retune_steps", 1, "must be 0 or >= 2, got 1"),
    ("pipeline.retune_tolerance", -0.1, "must be >= 0, got -0.1"),
    ("communication.fusion_mb", 0, "must be > 0, got 0"),
    ("communication.timeout_s", -1.5, "must be > 0, got -1.5"),
    ("auto.search_time_limit_s", 0.0, "must be > 0, got 0.0"),
    ("pipeline.schedule", "pipedream",
     "must be one of 'gpipe', '1f1b', 'kfkb', 'zero_bubble', 'auto', got 'pipedream'"),
    ("auto.opt_level", "O1", "must be one of 'O2', 'O3', got 'O1'"),
    ("communication.backend", "nccl",
     "must be one of 'auto', 'collective', 'horovod', got 'nccl'"),
    ("cluster.hardware", [], "must be a catalog name, or a non-empty list"),
    ("cluster.hardware", [""], "must be a catalog name, or a non-empty list"),
    ("cluster.hardware", [3], "must be a catalog name, or a non-empty list"),
    ("cluster.hardware", [{"name": "x", "tflops": 1}], "must be a catalog name, or a non-empty"),
    ("cluster.hardware", [{"name": "x", "tflops": 1, "memory_gb": 0}], "must be"),
    ("cluster.hardware", [{"name": "x", "tflops": True, "memory_gb": 1}], "must be"),
    ("cluster.hardware", [{"name": "x", "tflops": 1, "memory_gb": 1, "nvlink": 9}], "must be"),
    ("cluster.hardware", [{"name": "x", "tflops": 1, "memory_gb": 1, "efficiency": 1.5}],
     "efficiency <= 1"),
    ("cluster.hardware", [{"name": "x", "tflops": 1, "memory_gb": 1, "tflops_fp16": 0}],
     "must be"),
])
def test_out_of_range_and_bad_choices(key, value, fragment):
    message = error(Config, {key: value})
    assert repr(key) in message and fragment in message


def test_conflicting_duplicates():
    message = error(Config, {"num_micro_batch": 2, "pipeline": {"num_micro_batch": 4}})
    assert "'pipeline.num_micro_batch' given twice" in message


def test_bad_section_and_mapping_types():
    assert "section 'pipeline' must be a mapping" in error(Config, {"pipeline": 4})
    assert "Config.load()" in error(Config, "cfg.json")
    assert "cannot load a config from int" in error(Config.load, 42)


def test_missing_file(tmp_path):
    path = tmp_path / "nope.json"
    assert str(path) in error(Config.load, str(path))
    assert str(path) in error(Config.load, path)


def test_missing_file_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TFPAR_CONFIG", str(tmp_path / "nope.json"))
    assert "nope.json" in error(Config.load)


def test_malformed_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "pipeline": {\n    "num_micro_batch": 4,\n  }\n}\n')
    message = error(Config.load, path)
    assert str(path) in message and "line 4 column 3" in message


def test_malformed_json_text():
    message = error(Config.load, '{"pipeline": {"num_micro_batch": }}')
    assert "JSON text" in message and "line 1 column 34" in message


def test_non_object_json(tmp_path):
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    assert "JSON object" in error(Config.load, path)
    path.write_text('"text"')
    assert "JSON object" in error(Config.load, str(path))


def test_file_values_are_validated(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text('{"pipeline": {"num_micro_batch": true}}')
    assert "expects int, got True (bool)" in error(Config.load, path)
