"""Reading and checking config values: JSON sources, nested sections and
aliases flattened to dotted keys, ``TFPAR_<SECTION>_<KEY>`` environment
overrides, each value's type and rule, and the mode rules (a key that does
nothing in the config's mode is an error)."""

__all__ = ["ENV_CONFIG", "ENV_NOT_CONFIG", "check", "check_modes", "does_nothing", "env_overrides",
           "flatten", "parse_json", "read_json_file", "unknown"]

import copy
import difflib
import json
import os
import re
from collections.abc import Mapping

from .config_schema import ACCEPTS, ALIASES, SCHEMA, SECTIONS
from .errors import ConfigError

ENV_CONFIG = "TFPAR_CONFIG"  # environment variable holding a config path or JSON text
# TFPAR_* variables that are not config keys: the TensorFlow version gate's escape
# hatch (tfpar.compat.tf, read when TensorFlow's internals are first imported).
ENV_NOT_CONFIG = ("TFPAR_ALLOW_UNTESTED_TENSORFLOW",)
_ENV_VARS = {"TFPAR_" + k.replace(".", "_").upper(): k for k in SCHEMA}
_BOOLS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


def unknown(what, name, candidates):
    close = difflib.get_close_matches(str(name), list(candidates), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown {what} {name!r}{hint} (`tfpar config` lists every key)")


def _loads(text, where):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"malformed JSON in {where}: {e.msg} at line {e.lineno} "
                          f"column {e.colno}") from None


def parse_json(text, where):
    """Parse JSON text that must hold an object."""
    value = _loads(text, where)
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must hold a JSON object, got {type(value).__name__}")
    return value


def read_json_file(path):
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read config file {os.fspath(path)!r}: {e.strerror}") from None
    return parse_json(text, f"config file {os.fspath(path)!r}")


def check(key, value, origin=""):
    """Return the validated, normalised value of ``key``."""
    opt, label = SCHEMA[key], f"config key {key!r}{origin}"
    kinds = opt.type.split("|")
    if "dict" in kinds and isinstance(value, str):
        value = parse_json(value, f"{label} (JSON text)")
    if not any(ACCEPTS[kind](value) for kind in kinds):
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


def flatten(*mappings):
    """Map dotted keys, nested sections and aliases to ``{dotted_key: value}``."""
    flat = {}

    def put(key, value):
        if key not in SCHEMA:
            raise unknown("config key", key, SCHEMA)
        if key in flat and flat[key] != value:
            raise ConfigError(f"config key {key!r} given twice: {flat[key]!r} and {value!r}")
        flat[key] = value

    for mapping in mappings:
        if not isinstance(mapping, Mapping):
            raise ConfigError(f"Config expects a mapping, got {type(mapping).__name__}; "
                              "use Config.load() for paths and JSON text")
        for key, value in mapping.items():
            key = ALIASES.get(key, key)
            if key not in SECTIONS:
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
    return text  # str values; dict values are parsed by check


def env_overrides(env):
    """Validated ``{dotted_key: value}`` from ``TFPAR_<SECTION>_<KEY>`` variables."""
    values = {}
    for var, text in env.items():
        if not var.startswith("TFPAR_") or var == ENV_CONFIG or var in ENV_NOT_CONFIG:
            continue
        if var not in _ENV_VARS:
            raise unknown("environment variable", var, [*_ENV_VARS, ENV_CONFIG, *ENV_NOT_CONFIG])
        key = _ENV_VARS[var]
        value = _parse_env_value(text, SCHEMA[key].type.split("|"), var)
        values[key] = check(key, value, f" (from environment variable {var})")
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
             ("pipeline.virtual_stages", values["pipeline.num_micro_batch"] > 1
              and values["pipeline.schedule"] in ("1f1b", "auto") and not auto,
              "pipeline.num_micro_batch above 1 with the 1f1b schedule (interleaved), "
              "auto.auto_parallel false"),
             ("auto.global_batch", auto or tuned, f"{planned}, or pipeline.group_size 'auto'"),
             ("auto.search_time_limit_s", auto or values["auto.num_task_graph"] is not None,
              f"{planned}, or auto.num_task_graph"),
             ("batch_norm.sync", values["pipeline.num_micro_batch"] == 1,
              "pipeline.num_micro_batch 1 (a micro-batch cannot wait for later ones' "
              "statistics)")]
    rules += [(key, values["measure.after_steps"] > 0, "measure.after_steps above 0")
              for key in ("measure.tolerance", "measure.calibrate")]
    rules += [(key, auto, planned) for key in ("auto.opt_level", "auto.memory_techniques",
                                               "auto.split_heads", "auto.planning_pass")]
    return rules


def check_modes(values):
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
