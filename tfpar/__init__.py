"""tfpar: parallelise TensorFlow training graphs by rewriting them.

    import tfpar as wh
    wh.init()
    with wh.replicate(4):
        ...

``import tfpar`` does not import TensorFlow: the names that need it are
imported on first use, so ``tfpar config`` and ``tfpar simulate`` start fast.
"""
import importlib

from tfpar.config import Config
from tfpar.errors import (AnnotationError, ClusterError, ConfigError, FallbackWarning, PlanError,
                          ShardingError, TfparError)
from tfpar.ir.plan import Plan

__all__ = ["AnnotationError", "ClusterError", "Config", "ConfigError", "FallbackWarning", "Plan",
           "PlanError", "ShardingError", "TfparError", "current_plan", "init", "replicate",
           "reset", "set_default_strategy", "split", "step_devices", "step_timeline"]
__version__ = "0.1.0"

_LAZY = {  # public name -> the module defining it, imported on first use
    **dict.fromkeys(["current_plan", "init", "replicate", "reset", "set_default_strategy",
                     "split"], "tfpar.api"),
    **dict.fromkeys(["step_devices", "step_timeline"], "tfpar.runtime.step_trace"),
}


def __getattr__(name):
    """Import a lazy public name's module on first use (PEP 562) and keep the name."""
    if name not in _LAZY:
        raise AttributeError(f"module 'tfpar' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__():
    """Public names, the lazy ones included."""
    return sorted(set(globals()) | set(__all__))
