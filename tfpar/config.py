"""tfpar configuration: the validated, immutable ``Config`` and its sections.

Its keys are ``config_schema``'s, its checks ``config_rules``'. Values come
from (lowest to highest precedence) the schema defaults, the mapping or JSON
source, and ``TFPAR_<SECTION>_<KEY>`` environment variables.
"""

__all__ = ["Config", "Section"]

import copy
import os
from collections.abc import Mapping

from .config_rules import (ENV_CONFIG, check, check_modes, env_overrides, flatten, parse_json,
                           read_json_file, unknown)
from .config_schema import ALIASES, SCHEMA, SECTIONS
from .errors import ConfigError


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
        given = flatten({} if mapping is None else mapping, kwargs)
        values = {key: opt.default for key, opt in SCHEMA.items()}
        values.update({key: check(key, value) for key, value in given.items()})
        values.update(env_overrides(os.environ if env is None else env))
        check_modes(values)
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
            return cls(parse_json(source, "JSON text"), env=environ)
        if isinstance(source, (str, os.PathLike)):
            return cls(read_json_file(source), env=environ)
        raise ConfigError(f"cannot load a config from {type(source).__name__}; expected a "
                          "Config, dict, JSON file path, JSON text or None")

    def get(self, key):
        """Value of a dotted key (or alias)."""
        key = ALIASES.get(key, key)
        if key not in SCHEMA:
            raise unknown("config key", key, SCHEMA)
        return copy.deepcopy(self._values[key])

    __getitem__ = get

    def __getattr__(self, name):
        if name in SECTIONS:
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
        changes = flatten({} if mapping is None else mapping, kwargs)
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

