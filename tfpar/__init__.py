"""tfpar: parallelise TensorFlow training graphs by rewriting them.

    import tfpar as wh
    wh.init()
    with wh.replicate(4):
        ...
"""
from tfpar.api import current_plan, init, replicate, reset, set_default_strategy, split
from tfpar.config import Config
from tfpar.errors import (AnnotationError, ClusterError, ConfigError, PlanError, ShardingError,
                          TfparError)
from tfpar.ir.plan import Plan
from tfpar.runtime.step_trace import step_devices, step_timeline

__all__ = ["AnnotationError", "ClusterError", "Config", "ConfigError", "Plan", "PlanError",
           "ShardingError", "TfparError", "current_plan", "init", "replicate", "reset",
           "set_default_strategy", "split", "step_devices", "step_timeline"]
__version__ = "0.1.0"
