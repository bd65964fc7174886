"""The SplitContexts of split TaskGraphs: their devices and shares, a pinned
plan's sharded layers built split, and ``split.patterns`` and
``split.sequence_parallel`` checked."""
from typing import Any, Dict, List, Optional, Sequence, Tuple

from tfpar.cluster.virtual_device import assign_devices
from tfpar.errors import ConfigError, PlanError
from tfpar.fallback import fall_back
from tfpar.hooks.capture import GraphCapture
from tfpar.ir.plan import pinned_plan
from tfpar.ir.taskgraph import TaskGraphSpec
from tfpar.patterns.sharded import SplitContext
from tfpar.planner.layers import heads_units
from tfpar.runtime.automatic import pinned_sharding
from tfpar.runtime.balanced import shard_shares
from tfpar.runtime.context import Runtime, active

__all__ = ["check_forced_units", "make_split_context", "setup_capture"]


def make_split_context(capture: GraphCapture, spec: TaskGraphSpec, rt: Runtime,
                       devices: Optional[Sequence[str]] = None,
                       planned: Optional[Dict[str, str]] = None):
    """The SplitContext of a split TaskGraph: its shard devices, fixed now
    because its variables are built sharded: ``devices``, or its
    VirtualDevice given the TaskGraphs opened so far (Whale §3.2.1); on
    mixed devices, shards in proportion to their speeds, or as a pinned plan
    says (``shard_shares``).
    ``planned`` (a pinned plan's layer -> candidate) forces its column / row
    choices on the dense units named after those layers, and its heads on
    the keras MultiHeadAttention they are in, unless ``split.patterns``
    names them."""
    if devices is None:
        devices = _opened_on(capture, rt)
    return SplitContext(spec.name, devices, rt.config.get("split.patterns"),
                        capture.sharded_tensors, shard_shares(rt, spec.index, devices),
                        {**{scope: how for scope, how in (planned or {}).items()
                            if how in ("column", "row")}, **heads_units(planned or {})},
                        rt.config.get("split.sequence_parallel")
                        or bool(pinned_sharding(rt).get("sequence_parallel")))


def _opened_on(capture: GraphCapture, rt: Runtime) -> Sequence[str]:
    """The devices of the TaskGraph just opened, given those opened before
    it; with ``pipeline.virtual_stages``, its device group's, groups of its
    size taking TaskGraphs in turn over all the devices (SC'21 §2.2: the
    number of groups is known before the scopes after it are)."""
    specs = capture.task_graphs
    virtual = rt.config.get("pipeline.virtual_stages")
    if virtual > 1:
        size = specs[-1].device_count or len(rt.devices)
        group = (len(specs) - 1) % max(len(rt.devices) // size, 1)
        return rt.devices[group * size:(group + 1) * size]
    return assign_devices([(s.name, s.device_count) for s in specs], rt.devices,
                          rt.config.get("cluster.colocate_split_and_replicate")
                          ).virtual_devices[-1][0]


def setup_capture(capture: GraphCapture) -> None:
    """A pinned plan that shards layers: they are built split, on the devices
    the plan gives their TaskGraph, as the model is built."""
    rt = active()
    sharding = pinned_sharding(rt)
    if not sharding.get("layers"):
        return
    stages = sharding.get("stages") or {}
    task_graphs = pinned_plan(rt.config).task_graphs

    def context(cap: GraphCapture, spec: TaskGraphSpec):
        if spec.index >= len(task_graphs) or task_graphs[spec.index].strategy != "split":
            raise PlanError(f"tfpar: the pinned plan has no split TaskGraph {spec.index} for the "
                            f"layers being built; the model differs from the one planned")
        return make_split_context(cap, spec, rt, task_graphs[spec.index].replicas[0],
                                  sharding["layers"])
    capture.plan_split_layers({scope: stages.get(scope, 0) for scope in sharding["layers"]},
                              sharding["tensor_degree"], context, pipelined=bool(stages))


def check_forced_units(capture: GraphCapture, rt: Runtime) -> None:
    """Every ShardingUnit ``split.patterns`` names exists in this graph; what
    the split TaskGraphs were asked and could not do is said (``fall_back``):
    running sequence parallel with nothing to split along the sequence, a
    pinned plan's layer built otherwise."""
    forced = rt.config.get("split.patterns") or {}
    known = {name for ctx in capture.split_contexts.values() for name in ctx.decisions}
    unknown = sorted(set(forced) - known)
    if unknown:
        raise ConfigError(
            f"split.patterns names {', '.join(map(repr, unknown))}, but no ShardingUnit of this "
            f"graph is called so; its units (layer names as in their variables, or op kinds "
            f"numbered _1, _2...): {', '.join(sorted(known)) or 'none (no wh.split scope)'}")
    for what, why, instead, graph in _unsplit_sequences(capture) + _unbuilt_plan(capture):
        fall_back(what, why, instead, graph)


def _unsplit_sequences(capture: GraphCapture) -> List[Tuple[str, str, str, Any]]:
    """(what, why, what to do, graph) of each split TaskGraph asked to run
    sequence parallel where nothing of it could."""
    return [(f"split.sequence_parallel asked to split TaskGraph '{ctx.name}' along the sequence",
             "nothing of it is: it has no row-parallel layer whose output has a sequence axis "
             f"(rank 3 or more, axis 1 of a known length of at least {ctx.size}), so every "
             "such output is summed whole", "Give its layers [batch, sequence, features] inputs "
             "of a static sequence length, or set split.sequence_parallel false to silence this",
             ctx.graph)
            for ctx in capture.split_contexts.values()
            if ctx.sequence_parallel and not ctx.sequence_regions]


def _unbuilt_plan(capture: GraphCapture) -> List[Tuple[str, str, str, Any]]:
    """(what, why, what to do, graph) when a pinned plan's column or row
    layers were built otherwise: no ShardingUnit was forced to their pattern
    (``SplitContext.followed``)."""
    contexts = list(capture.split_contexts.values())
    followed = set().union(*(ctx.followed for ctx in contexts))
    missed = {scope: how for ctx in contexts for scope, how in ctx.planned.items()
              if scope not in followed}
    if not missed:
        return []
    built = sorted({f"{unit} -> {how}" for ctx in contexts for unit, how in ctx.decisions.items()})
    return [("the pinned plan splits " + ", ".join(f"'{scope}' by {how.rstrip('s')}s"
                                                   for scope, how in sorted(missed.items())),
             "they were not built so (no ShardingUnit of their names chose it; units built: "
             + (", ".join(built) or "none")
             + "): tf.compat.v1.get_variable in a split scope is split along its first axis "
             "and its matmul by what that gives", "Build those layers with "
             "tf.compat.v1.layers.dense or keras Dense, whose split follows the plan",
             contexts[0].graph)]
