"""tfpar configuration: schema, loading, validation and environment overrides.

Values come from (lowest to highest precedence) the schema defaults, the
mapping or JSON source, and ``TFPAR_<SECTION>_<KEY>`` environment variables.
"""

__all__ = ["Config", "Option", "Section", "SCHEMA", "ALIASES", "ENV_CONFIG", "describe",
           "does_nothing"]

import copy
import difflib
import json
import os
import re
import textwrap
from collections.abc import Mapping
from typing import Any, NamedTuple

from .cluster.hardware import OPTIONAL_KEYS
from .errors import ConfigError

ENV_CONFIG = "TFPAR_CONFIG"  # environment variable holding a config path or JSON text

_ACCEPTS = {  # type name -> accepts(value)
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, (list, tuple)),
    "dict": lambda v: isinstance(v, Mapping),
    "None": lambda v: v is None,
}


class Option(NamedTuple):
    """Schema entry of one config key."""

    type: str  # alternatives joined by "|": int, float, bool, str, list, dict, None
    default: Any
    rule: tuple  # (text, predicate) applied to non-None values; () for none
    help: str


def _at_least(low):
    return (f">= {low}", lambda v: v >= low)


def _one_of(*choices, note=""):
    return ("one of " + ", ".join(map(repr, choices)) + note, lambda v: v in choices)


def _is_device(d):
    if isinstance(d, str):
        return bool(d)
    required = {"name", "tflops", "memory_gb"}
    return (isinstance(d, Mapping) and required <= set(d) <= required | set(OPTIONAL_KEYS)
            and isinstance(d["name"], str)
            and all(_ACCEPTS["float"](d[k]) and d[k] > 0 for k in set(d) - {"name"})
            and d.get("efficiency", 1) <= 1)


_POSITIVE = ("> 0", lambda v: v > 0)
_HARDWARE = ("a catalog name, or a non-empty list of catalog names ('N x name' for N alike) "
             "or {name, tflops, memory_gb[, intra_node_gbps, inter_node_gbps, tflops_fp64, "
             "tflops_fp32, tflops_tf32, tflops_fp16, tflops_bf16, memory_gbps, efficiency <= 1]} "
             "dicts",
             lambda v: _is_device(v) if isinstance(v, str)
             else bool(v) and all(_is_device(d) for d in v))
_GROUP_SIZE = (">= 1 or 'auto'", lambda v: v == "auto" or isinstance(v, int) and v >= 1)

SCHEMA = {
    "cluster.num_devices": Option("int|None", None, _at_least(1),
                                  "devices on this host; None: all GPUs, else 1"),
    "cluster.hardware": Option("list|str|None", None, _HARDWARE,
                               "per-device specs; None: detected"),
    "cluster.devices_per_node": Option("int|None", None, _at_least(1),
                                       "devices per node of cluster.hardware (collectives "
                                       "beyond a node use its inter-node bandwidth); None: "
                                       "TF_CONFIG's devices per worker, else one node"),
    "cluster.colocate_split_and_replicate": Option("bool", False, (),
                                                   "let TaskGraphs share devices"),
    "cluster.trusted_network": Option(
        "bool", False, (), "the network of this TF_CONFIG cluster admits only its workers to "
        "their ports (a private network, a firewall): their gRPC servers, open to whoever "
        "connects, are then not said to be (see Security)"),
    "pipeline.num_micro_batch": Option("int", 1, _at_least(1),
                                       "micro-batches per step (1 with auto.auto_parallel and "
                                       "a known batch: the planner chooses)"),
    "pipeline.schedule": Option(
        "str", "auto", _one_of("gpipe", "1f1b", "kfkb", "zero_bubble", "auto"),
        "pipeline schedule; auto: the planner's choice with auto.auto_parallel, else 1f1b"),
    "pipeline.task_functions": Option(
        "bool", True, (), "run each micro-batch's stage tasks as calls of one graph function "
        "per task (off: a copy of the stage per micro-batch)"),
    "pipeline.group_size": Option("int|str", 1, _GROUP_SIZE, "k of kFkB, or 'auto' (Ada-Grouper)"),
    "pipeline.retune_steps": Option(
        "int", 100, ("0 or >= 2", lambda v: v == 0 or v >= 2), "with group_size 'auto', "
        "every this many Session.run training steps one is profiled and k moves to the best "
        "for the measured stage and transfer times (Ada-Grouper's online tuning); 0: k stays "
        "as planned"),
    "pipeline.retune_tolerance": Option(
        "float", 0.05, _at_least(0), "online tuning keeps the smallest k whose predicted step "
        "is at most this fraction longer than the shortest (fewer activations alive)"),
    "split.patterns": Option("dict|None", None, (),
                             "ShardingUnit name -> sharding pattern the matcher must use"),
    "auto.auto_parallel": Option("bool", False, (), "let the planner choose TaskGraphs"),
    "auto.num_task_graph": Option("int|None", None, _at_least(1),
                                  "stage count for auto pipeline; None: planner decides"),
    "auto.opt_level": Option("str", "O2", _one_of("O2", "O3"),
                             "O2: segmented search, O3: whole-graph ILP"),
    "auto.global_batch": Option("int|None", None, _at_least(1),
                                "global batch the planner's cost model assumes; None: the "
                                "static batch of the model's inputs, else 32"),
    "auto.search_time_limit_s": Option("float", 60.0, _POSITIVE, "planner search time limit"),
    "auto.memory_techniques": Option(
        "list", [], ("a list of 'recompute', 'zero', 'mixed_precision', 'offload'",
                     lambda v: set(v) <= {"recompute", "zero", "mixed_precision", "offload"}),
        "memory techniques the planner may choose"),
    "auto.split_heads": Option("bool", False, (),
                               "tensor groups may split attention cores by heads (Megatron's "
                               "attention; for plans only: tfpar cannot build it yet)"),
    "auto.planning_pass": Option("bool", True, (),
                                 "a script with auto_parallel plans in a child run first, "
                                 "so sharded layers are built split"),
    "memory.recompute": Option(
        "list", [], ("a list of name scopes", lambda v: all(isinstance(s, str) and s for s in v)),
        "name scopes whose forward the backward recomputes from their inputs instead of "
        "keeping their activations"),
    "memory.offload_optimizer": Option(
        "bool", False, (), "the optimizer's slots, the weights they update and the update "
        "run on the host CPU; the step reads the weights from there (pipelines, or replicas "
        "on the CPUs of one process: not with mirrored variables)"),
    "memory.zero": Option(
        "int", 0, ("0, 1 or 2", lambda v: v in (0, 1, 2)),
        "ZeRO stage over mirrored replicas: 1, each variable's optimizer slots and update "
        "live on one replica, which sends the new value to the others; 2, its gradient is "
        "also summed there only"),
    "memory.mixed_precision": Option(
        "str|None", None, _one_of("fp16", "bf16"),
        "compute what TensorFlow's auto mixed precision allows in 16 bits, variables and "
        "checkpoints in float32: fp16 (GPUs) with dynamic loss scaling, bf16 (oneDNN CPUs "
        "with AVX-512)"),
    "balance.hardware_aware": Option("bool", True, (),
                                     "on mixed cluster.hardware: batch rows, split shards and "
                                     "stage cuts by device speed (Whale §3.3.1, Algorithm 1), "
                                     "stages on devices by memory, most first (§3.3.2); false: "
                                     "even, in device order"),
    "batch_norm.sync": Option(
        "bool", False, (), "every Keras BatchNormalization layer computes its batch statistics "
        "over the rows of all replicas (as synchronized=True layers do): one device's numbers "
        "with one micro-batch"),
    "communication.backend": Option(
        "str", "auto", _one_of("auto", "collective", "horovod"),
        "auto: one-process CPUs share variables and sum on one device; else collective"),
    "communication.fusion_mb": Option("float", 64.0, _POSITIVE, "gradient fusion bucket (MB)"),
    "communication.timeout_s": Option("float", 60.0, _POSITIVE, "collective timeout"),
    "io.shard_dataset": Option("bool", False, (), "shard input datasets across replicas"),
    "check.finite_gradients": Option(
        "bool", False, (), "every replica's and micro-batch's gradients are checked before they "
        "are summed: a NaN or Inf fails the step naming the variable, the step, the replica, "
        "TaskGraph / stage, micro-batch and device"),
    "plan": Option("dict|None", None, (), "plan JSON (dict or text) that pins the plan"),
    "strict": Option("bool", False, (), "every fallback (tfpar running something other than "
                     "what was asked, a tfpar.FallbackWarning) raises PlanError instead"),
}

ALIASES = {  # Whale paper flat names
    "num_micro_batch": "pipeline.num_micro_batch",
    "num_task_graph": "auto.num_task_graph",
    "auto_parallel": "auto.auto_parallel",
}

_SECTIONS = tuple(dict.fromkeys(k.split(".")[0] for k in SCHEMA if "." in k))
_ENV_VARS = {"TFPAR_" + k.replace(".", "_").upper(): k for k in SCHEMA}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def _unknown(what, name, candidates):
    close = difflib.get_close_matches(str(name), list(candidates), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} {name!r}{hint} (`tfpar config` lists every key)")


def _loads(text, where):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"malformed JSON in {where}: {e.msg} at line {e.lineno} "
                          f"column {e.colno}") from None


def _parse_json(text, where):
    """Parse JSON text that must hold an object."""
    value = _loads(text, where)
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(value).__name__}")
    return value


def _read_json_file(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {e.strerror}") from None
    return _parse_json(text, f"config file {os.fspath(path)!r}")


def _check(key, value, origin=""):
    """Return the validated, normalised value of ``key``."""
    opt, label = SCHEMA[key], f"config key {key!r}{origin}"
    kinds = opt.type.split("|")
    if "dict" in kinds and isinstance(value, str):
        value = _parse_json(value, f"{label} (JSON text)")
    if not any(_ACCEPTS[kind](value) for kind in kinds):
        raise ConfigError(f"{label} expects {opt.type}, got {value!r} ({type(value).__name__})")
    if value is not None and opt.rule and not opt.rule[1](value):
        raise ConfigError(f"{label} must be {opt.rule[0]}, got {value!r}")
    if isinstance(value, tuple):
        value = list(value)
    elif isinstance(value, Mapping):
        value = dict(value)
    elif "float" in kinds and isinstance(value, int):
        value = float(value)
    return copy.deepcopy(value)


def _flatten(*mappings):
    """Map dotted keys, nested sections and aliases to ``{dotted_key: value}``."""
    flat = {}

    def put(key, value):
        if key not in SCHEMA:
            raise _unknown("config key", key, SCHEMA)
        if key in flat and flat[key] != value:
            raise ConfigError(f"config key {key!r} given twice: {flat[key]!r} and {value!r}")
        flat[key] = value

    for mapping in mappings:
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"Config expects a mapping, got {type(mapping).__name__}; "
                              "use Config.load() for paths and JSON text")
        for key, value in mapping.items():
            key = ALIASES.get(key, key)
            if key not in _SECTIONS:
                put(key, value)
            elif not isinstance(value, Mapping):
                raise ConfigError(f"config section {key!r} must be a mapping, got {value!r}")
            else:
                for sub, sub_value in value.items():
                    put(f"{key}.{sub}", sub_value)
    return flat


def _parse_env_value(text, kinds, var):
    text = text.strip()
    low = text.lower()
    if "None" in kinds and low in ("none", "null"):
        return None
    if "bool" in kinds and low in _BOOLS:
        return _BOOLS[low]
    if "int" in kinds and re.fullmatch(r"[+-]?\d+", text):
        return int(text)
    if "float" in kinds:
        try:
            return float(text)
        except ValueError:
            pass
    if "list" in kinds and (text.startswith("[") or "str" not in kinds):
        return _loads(text, f"environment variable {var}")
    return text  # str values; dict values are parsed by _check


def _env_overrides(env):
    """Validated ``{dotted_key: value}`` from ``TFPAR_<SECTION>_<KEY>`` variables."""
    values = {}
    for var, text in env.items():
        if not var.startswith("TFPAR_") or var == ENV_CONFIG:
            continue
        if var not in _ENV_VARS:
            raise _unknown("environment variable", var, [*_ENV_VARS, ENV_CONFIG])
        key = _ENV_VARS[var]
        value = _parse_env_value(text, SCHEMA[key].type.split("|"), var)
        values[key] = _check(key, value, f" (from environment variable {var})")
    return values


def _modes(values):
    """(key, whether the config uses it, the mode it needs) for the keys that
    do something only in some modes."""
    auto = values["auto.auto_parallel"]
    tuned = values["pipeline.group_size"] == "auto"
    grouped = values["pipeline.schedule"] == "kfkb" or (values["pipeline.schedule"] == "auto"
                                                        and auto)
    planned = "auto.auto_parallel true"
    rules = [("pipeline.group_size", grouped, "pipeline.schedule 'kfkb' (or 'auto' with "
              "auto.auto_parallel true)"),
             ("pipeline.retune_steps", tuned, "pipeline.group_size 'auto'"),
             ("pipeline.retune_tolerance", tuned, "pipeline.group_size 'auto'"),
             ("pipeline.schedule", auto or values["pipeline.num_micro_batch"] > 1,
              "pipeline.num_micro_batch above 1, or auto.auto_parallel true"),
             ("auto.global_batch", auto or tuned, f"{planned}, or pipeline.group_size 'auto'"),
             ("auto.search_time_limit_s", auto or values["auto.num_task_graph"] is not None,
              f"{planned}, or auto.num_task_graph"),
             ("batch_norm.sync", values["pipeline.num_micro_batch"] == 1,
              "pipeline.num_micro_batch 1 (a micro-batch cannot wait for later ones' "
              "statistics)")]
    rules += [(key, auto, planned) for key in ("auto.opt_level", "auto.memory_techniques",
                                               "auto.split_heads", "auto.planning_pass")]
    return rules


def _check_modes(values):
    """A key set to other than its default where the config's mode makes it do
    nothing is an error naming the key and the mode it needs (a key silently
    ignored would change what the user thinks runs)."""
    for key, used, mode in _modes(values):
        if not used and values[key] != SCHEMA[key].default:
            raise does_nothing(key, values[key], mode)


def does_nothing(key, value, mode, where="config") -> ConfigError:
    """The error of ``key``, set to ``value``, in a ``where`` whose mode makes it
    do nothing: it needs ``mode``."""
    return ConfigError(f"config key {key!r} ({value!r}) does nothing in this {where}: it needs "
                       f"{mode}; drop it or set that")


class Section:
    """Read-only view of one config section, e.g. ``cfg.pipeline.num_micro_batch``."""

    def __init__(self, config, name):
        object.__setattr__(self, "_config", config)
        object.__setattr__(self, "_name", name)

    def __getattr__(self, attr):
        key = f"{self._name}.{attr}"
        if key not in SCHEMA:
            raise AttributeError(f"config section {self._name!r} has no key {attr!r}")
        return self._config.get(key)

    def __setattr__(self, attr, value):
        raise AttributeError("Config is immutable; use Config.replace()")

    def __repr__(self):
        keys = [k for k in SCHEMA if k.startswith(self._name + ".")]
        items = ", ".join(f"{k.split('.', 1)[1]}={self._config.get(k)!r}" for k in keys)
        return f"Section({self._name!r}, {items})"


class Config:
    """Validated, immutable tfpar configuration.

    ``mapping`` and ``kwargs`` may use dotted keys, nested section dicts and the
    Whale aliases. ``TFPAR_<SECTION>_<KEY>`` variables from ``env`` (default
    ``os.environ``; pass ``{}`` to ignore the environment) override them.
    """

    def __init__(self, mapping=None, *, env=None, **kwargs):
        given = _flatten({} if mapping is None else mapping, kwargs)
        values = {key: opt.default for key, opt in SCHEMA.items()}
        values.update({key: _check(key, value) for key, value in given.items()})
        values.update(_env_overrides(os.environ if env is None else env))
        _check_modes(values)
        object.__setattr__(self, "_values", values)

    @classmethod
    def load(cls, source=None, *, env=None):
        """Build a Config from a Config, mapping, JSON file path, JSON text or None.

        None reads the ``TFPAR_CONFIG`` variable (path or JSON text) if set.
        """
        environ = os.environ if env is None else env
        if source is None:
            source = environ.get(ENV_CONFIG) or {}
        if isinstance(source, Config):
            return source
        if isinstance(source, Mapping):
            return cls(source, env=environ)
        if isinstance(source, str) and source.strip().startswith("{"):
            return cls(_parse_json(source, "JSON text"), env=environ)
        if isinstance(source, (str, os.PathLike)):
            return cls(_read_json_file(source), env=environ)
        raise ConfigError(f"cannot load a config from {type(source).__name__}; expected a "
                          "Config, dict, JSON file path, JSON text or None")

    def get(self, key):
        """Value of a dotted key (or alias)."""
        key = ALIASES.get(key, key)
        if key not in SCHEMA:
            raise _unknown("config key", key, SCHEMA)
        return copy.deepcopy(self._values[key])

    __getitem__ = get

    def __getattr__(self, name):
        if name in _SECTIONS:
            return Section(self, name)
        if name in SCHEMA:  # top-level keys such as "plan"
            return self.get(name)
        raise AttributeError(f"Config has no section or key {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError("Config is immutable; use Config.replace()")

    def to_dict(self):
        """Nested dict of every value, defaults included."""
        out = {}
        for key, value in self._values.items():
            section, _, sub = key.rpartition(".")
            (out.setdefault(section, {}) if section else out)[sub] = copy.deepcopy(value)
        return out

    def changes(self, other: "Config"):
        """{dotted key: (value here, value in ``other``)} where they differ."""
        return {key: (value, other._values.get(key)) for key, value in self._values.items()
                if other._values.get(key) != value}

    def replace(self, mapping=None, **kwargs):
        """New validated Config with the given keys changed (environment not re-applied)."""
        changes = _flatten({} if mapping is None else mapping, kwargs)
        return Config({**self._values, **changes}, env={})

    def __eq__(self, other):
        if not isinstance(other, Config):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    __hash__ = None

    def __reduce__(self):
        return (_restore, (self._values,))

    def __repr__(self):
        changed = {k: v for k, v in self._values.items() if v != SCHEMA[k].default}
        return f"Config({changed!r})"


def _restore(values):
    return Config(values, env={})


def describe(width: int = 100) -> str:
    """Every config key: key, type and default on one line, then its meaning and
    allowed values indented below, wrapped to ``width`` columns."""
    key_width = max(map(len, SCHEMA))
    type_width = max(len(o.type) for o in SCHEMA.values())
    lines = [f"{'key':<{key_width}}  {'type':<{type_width}}  default",
             f"{'-' * key_width}  {'-' * type_width}  -------"]
    for key, opt in SCHEMA.items():
        lines.append(f"{key:<{key_width}}  {opt.type:<{type_width}}  {opt.default!r}")
        for text in (opt.help, f"allowed: {opt.rule[0]}" if opt.rule else ""):
            lines += textwrap.wrap(text, width, initial_indent="    ", subsequent_indent="    ")
    return "\n".join(lines)
