"""Typed errors raised by tfpar. Every one is a ValueError subclass."""

__all__ = ["TfparError", "ConfigError", "AnnotationError", "PlanError", "ShardingError",
           "ClusterError", "FallbackWarning"]


class TfparError(ValueError):
    """Base class of the errors tfpar raises deliberately."""

    # Exception's own: AutoGraph re-raises an error from a traced tf.function
    # as its own type only for such types (else a StagingError hides it).
    __init__ = Exception.__init__


class ConfigError(TfparError):
    """Invalid configuration: unknown key, wrong type or value, unreadable source."""


class AnnotationError(TfparError):
    """Invalid use of ``replicate``/``split`` scopes or ``set_default_strategy``."""


class PlanError(TfparError):
    """No valid parallel plan, or a pinned plan that does not fit the graph or cluster."""


class ShardingError(ConfigError, PlanError):
    """An op or layer cannot be sharded with the requested pattern. The pattern is
    forced by ``split.patterns`` or by a pinned plan, so this is both a ConfigError
    and a PlanError: callers catching either keep working."""


class ClusterError(TfparError):
    """A worker of a multi-worker cluster is missing or was lost."""


class FallbackWarning(UserWarning):
    """tfpar runs something other than what the script or config asked (what
    was asked, what runs instead, how to get what was asked). Escalate with
    ``warnings.simplefilter("error", tfpar.FallbackWarning)``, or make every
    fallback a ``PlanError`` with ``strict: true`` (``tfpar.fallback``)."""
