"""Public API: init, replicate, split, set_default_strategy, current_plan."""
import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any, Optional

from tfpar import fallback
from tfpar.config import Config
from tfpar.config_rules import does_nothing
from tfpar.errors import AnnotationError, ConfigError, PlanError
from tfpar.ir.plan import Plan, pinned_plan
from tfpar.ir.plan_fit import fit_to_devices
from tfpar.ir.taskgraph import Strategy

__all__ = ["current_plan", "init", "replicate", "reset", "set_default_strategy", "split"]

log = logging.getLogger("tfpar")


def init(config: Any = None) -> Config:
    """Start tfpar for the graphs built from now on.

    Args:
      config: a ``Config``, a dict, a path to a JSON file, JSON text, or None
        (then ``TFPAR_CONFIG`` is read if set).

    Returns:
      The validated Config in force.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.hooks import capture, tf_patches  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import context, engine, graph_state, planning_pass  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import precision  # pylint: disable=import-outside-toplevel

    caller = sys._getframe(1).f_globals  # pylint: disable=protected-access
    cfg, searched = planning_pass.pinned_by_planning_pass(Config.load(config), caller)
    pinned = pinned_plan(cfg)  # a pinned plan is checked here, once
    fallback.configure(cfg.get("strict"))
    if cfg.get("communication.backend") == "horovod":
        _start_horovod()
    devices, device_type = _discover_devices(cfg)
    low = precision.applied(cfg, device_type)
    precision.check_supported(low, device_type)
    if low is not None and tf.executing_eagerly():
        precision.in_functions(precision.rewrite_option(low, device_type))
    if device_type == "CPU" and tf.executing_eagerly():
        _make_eager_cpus(len(devices))
    previous = context.active()
    cluster = _cluster(previous, cfg, device_type, len(devices))
    names = cluster.device_names(device_type, len(devices)) if cluster is not None else devices
    cfg = _pinned_here(cfg, pinned, names)
    if previous is not None and previous.config != cfg:
        changed = previous.config.changes(cfg)
        log.warning("tfpar: wh.init() called again with another config; it replaces the "
                    "previous one for every graph not yet rewritten (%s)", ", ".join(
                        f"{key}: {old!r} -> {new!r}" for key, (old, new) in changed.items()))
    default = previous.default_strategy if previous is not None else None
    runtime = context.Runtime(config=cfg, devices=names, device_type=device_type,
                              default_strategy=default, cluster=cluster,
                              devices_per_worker=len(devices), search_said=searched)

    tf_patches.install(engine)
    context.activate(runtime)
    # Other graphs (and sessions still running them) keep their rewrites.
    capture.reset_captures(tf.compat.v1.get_default_graph())
    graph_state.reset_states(tf.compat.v1.get_default_graph())
    return cfg


def reset() -> None:
    """Remove every tfpar hook and forget all state (for tests and notebooks)."""
    from tfpar.hooks import capture, tf_patches  # pylint: disable=import-outside-toplevel
    from tfpar.runtime import context, graph_state, precision  # pylint: disable=import-outside-toplevel

    tf_patches.uninstall()
    context.deactivate()
    precision.restore_functions()
    capture.reset_captures()
    graph_state.reset_states()
    fallback.reset()


def _pinned_here(cfg: Config, plan: Optional[Plan], devices) -> Config:
    """``cfg``, its pinned ``plan`` made for more devices than ``devices``
    built on them (``ir.plan_fit``: fewer copies of the model), said."""
    fitted = fit_to_devices(plan, devices) if plan is not None else None
    if fitted is None:
        return cfg
    plan, planned = fitted
    fallback.fall_back(
        f"the pinned plan was made for {planned} devices",
        f"it is built on the {len(devices)} here with {plan.data_parallel_degree} cop"
        f"{'y' if plan.data_parallel_degree == 1 else 'ies'} of the model, each TaskGraph split "
        "and staged as planned (one device's numbers as before; its estimate is the planned "
        "cluster's)", "Pin a plan made for these devices to run as planned here")
    return cfg.replace(plan=plan.to_dict())


def _start_horovod() -> None:
    try:
        import horovod.tensorflow as hvd  # pylint: disable=import-outside-toplevel
    except ImportError as exc:
        raise ConfigError("tfpar: communication.backend 'horovod' needs Horovod built against "
                          "this TensorFlow: run `make horovod`") from exc
    hvd.init()


def _cluster(previous, cfg: Config, device_type: str, per_worker: int):
    """The TF_CONFIG cluster, its server started once per process (on workers
    other than the chief this serves until the chief is done, then exits).

    Raises:
      ConfigError: ``cluster.trusted_network`` without a cluster.
      PlanError: under ``strict``, a server open to whoever reaches this host
        (``_open_server``).
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.cluster import from_tf_config  # pylint: disable=import-outside-toplevel

    if previous is not None and previous.cluster is not None:
        return previous.cluster
    cluster = from_tf_config(os.environ)
    trusted = cfg.get("cluster.trusted_network")
    if cluster is None and trusted:
        raise does_nothing("cluster.trusted_network", trusted, "a TF_CONFIG cluster of 2 or "
                           "more workers", where="process")
    if cluster is not None:
        if not trusted:
            _open_server(cluster)
        timeout = cfg.get("communication.timeout_s")
        cluster.start(cluster.server_config(device_type, per_worker, timeout), timeout,
                      eager=tf.executing_eagerly())
    return cluster


def _open_server(cluster) -> None:
    """Say, before it starts, that this worker's gRPC server is open to whoever
    reaches this host, unless its network has no interface but loopback."""
    from tfpar.runtime.netns import contained  # pylint: disable=import-outside-toplevel

    if contained():
        return
    address = cluster.workers[cluster.task]
    fallback.fall_back(
        f"a gRPC server for /job:worker/task:{cluster.task} at {address}",
        f"TensorFlow 2.15 listens on every interface of this host (*:{address.rsplit(':', 1)[1]})"
        ", with neither authentication nor encryption: whoever connects can run any op here "
        "(read and write this user's files) and read what the workers send",
        "Run the workers where only they reach these ports (a private network, or a firewall "
        "admitting only the cluster's hosts; `tfpar launch` gives local workers a network of "
        "their own), then set cluster.trusted_network: true")


def _make_eager_cpus(count: int) -> None:
    """Give an eager script (its tf.functions) ``count`` logical CPU devices,
    as graph-mode sessions get them from their ConfigProto. TensorFlow makes
    them when it first runs an op; after that this does nothing (a step then
    says it runs on one device)."""
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.compat import tf as internals  # pylint: disable=import-outside-toplevel

    cpu = tf.config.list_physical_devices("CPU")[0]
    present = tf.config.get_logical_device_configuration(cpu)
    if count > 1 and not internals.eager_context_initialized() and (
            present is None or len(present) < count):
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count)


def _discover_devices(cfg: Config):
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.cluster.devices import device_names  # pylint: disable=import-outside-toplevel

    gpus = tf.config.list_physical_devices("GPU")
    wanted = cfg.get("cluster.num_devices")
    if gpus:
        count = len(gpus) if wanted is None else wanted
        if count > len(gpus):
            raise ConfigError(f"tfpar: cluster.num_devices={count} but only {len(gpus)} GPUs "
                              "are visible")
        return device_names("GPU", count), "GPU"
    if wanted is None:
        fallback.fall_back(
            "cluster.num_devices unset, which means every GPU", "no GPU is visible, so the "
            "script runs on one CPU device, as without tfpar", "Set cluster.num_devices to N "
            "for N logical CPU devices (they share this host's cores)")
    return device_names("CPU", wanted or 1), "CPU"


class _Scope:
    """A TaskGraph annotation; use with ``with`` (or pass to set_default_strategy)."""

    def __init__(self, strategy: Strategy, device_count: Optional[int], name: Optional[str]):
        if device_count is not None and (isinstance(device_count, bool)
                                         or not isinstance(device_count, int)
                                         or device_count < 1):
            raise AnnotationError(
                f"tfpar: {strategy.value}(device_count={device_count!r}): device_count must "
                "be a positive integer or None (all devices)")
        self.strategy, self.device_count, self.name = strategy, device_count, name
        self._capture = None

    def describe(self) -> str:
        label = f", name={self.name!r}" if self.name else ""
        return f"{self.strategy.value}({self.device_count}{label})"

    def __enter__(self):
        import tensorflow as tf  # pylint: disable=import-outside-toplevel
        from tfpar.hooks import keras_scopes  # pylint: disable=import-outside-toplevel

        rt = _runtime(self.describe())
        if self.device_count is not None and self.device_count > len(rt.devices):
            raise AnnotationError(
                f"tfpar: {self.describe()} asks for {self.device_count} devices but only "
                f"{len(rt.devices)} exist; set cluster.num_devices or lower device_count")
        if tf.executing_eagerly():
            keras_scopes.enter_eagerly(self)
            self._capture = None
            return self
        self._capture = self._open(tf.compat.v1.get_default_graph(), rt, key=None)
        return self

    def __exit__(self, *exc) -> None:
        from tfpar.hooks import keras_scopes  # pylint: disable=import-outside-toplevel

        if self._capture is None:
            if not keras_scopes.exit_eagerly(self) and exc[0] is None:
                fallback.fall_back(
                    f"{self.describe()} around eager code", "no Keras layer was made or called "
                    "in it, so it changes nothing: eager ops run in it as without tfpar",
                    "Put the scope around building or calling the model's layers, or inside "
                    "the tf.function step")
        else:
            self._capture.close_scope()

    def _same_kind(self, spec) -> bool:
        return (spec.strategy == self.strategy and spec.device_count == self.device_count
                and self.name in (None, spec.name))

    def _open(self, graph, rt, key):
        from tfpar.hooks.capture import capture_for  # pylint: disable=import-outside-toplevel
        from tfpar.runtime.split_contexts import make_split_context  # pylint: disable=import-outside-toplevel

        capture = capture_for(graph)
        if capture.in_scope:
            raise AnnotationError(f"tfpar: {self.describe()} is nested inside another scope; "
                                  "replicate/split scopes cannot be nested")
        spec = capture.open_scope(self.strategy, self.device_count, self.name, key)
        if self.strategy == Strategy.SPLIT and spec.index not in capture.split_contexts:
            capture.split_contexts[spec.index] = make_split_context(capture, spec, rt)
        return capture

    @contextlib.contextmanager
    def reopened(self, graph, layer: str):
        """Around a call of Keras layer ``layer`` in a TF2 step ``graph``, this
        scope (entered in eager code where the layer was made or called) as
        one TaskGraph per step graph; nothing more inside a layer of the same
        scope, or inside a scope of the same kind the step opened (a model's
        ``call`` opens its scope in the step as it did when called eagerly)."""
        from tfpar.hooks.capture import capture_for  # pylint: disable=import-outside-toplevel

        capture = capture_for(graph)
        spec, key = capture.innermost()
        if key is self or (spec is not None and key is None and self._same_kind(spec)):
            yield
            return
        if spec is not None:
            raise AnnotationError(
                f"tfpar: Keras layer '{layer}' was made or called in {self.describe()} and "
                "is now called inside another scope; replicate/split scopes cannot be nested")
        self._open(graph, _runtime(self.describe()), key=self)
        try:
            yield
        finally:
            capture.close_scope()


def _runtime(what: str):
    from tfpar.runtime.context import active  # pylint: disable=import-outside-toplevel

    rt = active()
    if rt is None:
        raise AnnotationError(f"tfpar: {what} used before wh.init(); call wh.init() first")
    return rt


def replicate(device_count: Optional[int] = None, name: Optional[str] = None) -> _Scope:
    """Scope whose ops form a data-parallel TaskGraph on ``device_count`` devices."""
    return _Scope(Strategy.REPLICATE, device_count, name)


def split(device_count: Optional[int] = None, name: Optional[str] = None) -> _Scope:
    """Scope whose ops form a tensor-parallel TaskGraph over ``device_count`` devices."""
    return _Scope(Strategy.SPLIT, device_count, name)


def set_default_strategy(scope: _Scope) -> None:
    """Parallelise ops outside any scope as ``scope`` says (e.g. ``wh.replicate(n)``)."""
    if not isinstance(scope, _Scope):
        raise AnnotationError("tfpar: set_default_strategy expects wh.replicate(...) or "
                              f"wh.split(...), got {scope!r}")
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.hooks.capture import capture_for  # pylint: disable=import-outside-toplevel

    strategy = (scope.strategy, scope.device_count)
    _runtime("set_default_strategy").default_strategy = strategy
    capture_for(tf.compat.v1.get_default_graph()).default_strategy = strategy


def current_plan(to_pin: bool = False) -> Plan:
    """The plan of the current default graph: once it has run its first
    training step, the plan it runs; before, the plan tfpar chose for it
    (works before any session runs). In eager code, the plan of the last
    ``tf.function`` step traced: rewritten, or on one device as traced.

    The automatic search's plan may shard layers a graph was built without
    (no planning pass: tests, notebooks): the graph then runs the best plan
    without sharding, which ``current_plan()`` returns after its first
    run (before, the search's plan, with a note saying what will run).
    ``to_pin=True`` returns the search's plan in every case: pinned
    (``wh.init({"plan": ...})``), a graph built with it shards those layers.

    Raises:
      PlanError: the graph trains but was built before ``wh.init`` (tfpar will
        not parallelise it, so no plan describes what runs); in eager code, no
        training step has been traced yet.
    """
    import tensorflow as tf  # pylint: disable=import-outside-toplevel
    from tfpar.hooks.capture import capture_for  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.graph_state import state_of  # pylint: disable=import-outside-toplevel
    from tfpar.runtime.planning import plans_for  # pylint: disable=import-outside-toplevel

    from tfpar.runtime.built_before_init import built_before_init_message, unseen_training  # pylint: disable=import-outside-toplevel

    rt = _runtime("current_plan")
    if tf.executing_eagerly():
        if rt.function_plan is None:
            raise PlanError("tfpar: no training step of this eager script has been traced yet; "
                            "call the tf.function step (or model.fit) once, then "
                            "wh.current_plan() returns its plan")
        return (rt.function_pick if to_pin else None) or rt.function_plan
    graph = tf.compat.v1.get_default_graph()
    unseen = unseen_training(graph)
    if unseen is not None:
        raise PlanError(built_before_init_message(unseen))
    state = state_of(graph)
    if state.plan is not None:  # what runs, and the search's plan to pin if it differs
        runs, pick = state.plan, state.sharded_plan
    else:
        runs, pick = plans_for(graph, capture_for(graph), rt)
    if pick is None or (state.plan is not None and not to_pin):
        return dataclasses.replace(runs, notes=fallback.notes(graph))  # said since, too
    ahead = () if to_pin or state.plan is not None else (
        "tfpar: this is the search's plan, to pin: it shards layers this graph was built "
        "without, so the graph, as built, will run the best plan without sharding ("
        + ", ".join(f"'{tg.name}': {tg.strategy} on {len(tg.devices)} devices"
                    for tg in runs.task_graphs)
        + f"; data_parallel_degree {runs.data_parallel_degree})",)
    return dataclasses.replace(pick, notes=fallback.notes(graph) + ahead)
