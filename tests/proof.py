"""Proof that a plan ran: what TensorFlow executed, not what tfpar intended.

Equivalence alone cannot tell a parallel program from an untouched one (a graph
tfpar never rewrote computes the single-device numbers too). Every session run
of a test is traced (``RunOptions.FULL_TRACE``), and each graph tfpar rewrote
keeps its plan, its rewrite and the step stats of its runs. ``assert_plan_ran``
then checks, against the executed nodes:

* every device of every TaskGraph of the plan executed ops of that TaskGraph
  (TaskGraphs holding only inputs and no-ops compute nothing and are skipped);
* each TaskGraph has one copy per replica and micro-batch
  (``num_micro_batch x len(replicas)``), and every copy executed;
* a TaskGraph with several copies executed the sums of their gradients.

Tracing is installed per test by ``conftest.py``; it wraps ``Session.run`` and
``Session._make_callable_from_options`` (keras) in the ``Session`` subclass, so
it stays below nothing and above tfpar's own hooks on ``BaseSession``.
"""
import dataclasses
from typing import Dict, List, Set

from tensorflow.core.protobuf import config_pb2
from tensorflow.python.client import session as tf_session

from tfpar.runtime.graph_state import existing_state
from tfpar.runtime.step_trace import executed_ops

__all__ = ["TRACER", "StepTracer", "assert_parallel", "assert_plan_ran", "executed_nodes",
           "ran_on"]


@dataclasses.dataclass
class RewrittenGraph:
    """A graph tfpar rewrote: its plan, its rewrite and its traced runs."""

    plan: object
    rewrite: object
    run_metadata: List[config_pb2.RunMetadata] = dataclasses.field(default_factory=list)


class StepTracer:
    """Traces every session run while installed; remembers rewritten graphs."""

    def __init__(self):
        self.graphs: Dict[object, RewrittenGraph] = {}
        self.devices: Dict[object, Set[str]] = {}

    def install(self):
        tracer = self

        def run(session, fetches, feed_dict=None, options=None, run_metadata=None):
            options, metadata = _traced(options), run_metadata or config_pb2.RunMetadata()
            try:
                return tf_session.BaseSession.run(session, fetches, feed_dict, options, metadata)
            finally:
                tracer.record(session.graph, metadata)

        def make_callable(session, callable_options):
            traced = type(callable_options)()
            traced.CopyFrom(callable_options)
            traced.run_options.trace_level = config_pb2.RunOptions.FULL_TRACE
            call = tf_session.BaseSession._make_callable_from_options(session, traced)

            def traced_call(*args, run_metadata=None):
                metadata = run_metadata or config_pb2.RunMetadata()
                try:
                    return call(*args, run_metadata=metadata)
                finally:
                    tracer.record(session.graph, metadata)
            return traced_call

        tf_session.Session.run = run
        tf_session.Session._make_callable_from_options = make_callable

    @staticmethod
    def uninstall():
        for name in ("run", "_make_callable_from_options"):
            if name in tf_session.Session.__dict__:
                delattr(tf_session.Session, name)

    def record(self, graph, metadata):
        self.devices.setdefault(graph, set()).update(
            _canonical(d.device) for d in metadata.step_stats.dev_stats if d.node_stats)
        state = existing_state(graph)
        if state is None or state.rewrite is None:
            return
        entry = self.graphs.setdefault(graph, RewrittenGraph(state.plan, state.rewrite.rewrite))
        entry.run_metadata.append(metadata)

    def reset(self):
        self.graphs.clear()
        self.devices.clear()

    def ran_on(self, graph) -> Set[str]:
        """Devices that executed nodes of ``graph`` in any traced run."""
        return self.devices.get(graph, set())

    def take(self) -> List[RewrittenGraph]:
        """The rewritten graphs traced since the last call."""
        taken = list(self.graphs.values())
        self.graphs.clear()
        return taken


TRACER = StepTracer()
ran_on = TRACER.ran_on


def assert_parallel() -> None:
    """Every graph tfpar rewrote since the last check ran its plan; at least one did."""
    trained = [entry for entry in TRACER.take() if _ran_a_step(entry)]
    assert trained, ("no graph rewritten by tfpar ran a training step: the numbers compared "
                     "come from graphs tfpar never parallelised")
    for entry in trained:
        assert_plan_ran(entry)


def _ran_a_step(entry: RewrittenGraph) -> bool:
    """Graphs only built and initialized (structure tests), or only evaluated
    (an Estimator's evaluate graph, whose forward tasks may wait on backward
    ones the schedule orders before them), prove nothing either way: a step
    sums gradients over the copies (or, with nothing to sum, runs backward ops)."""
    executed = executed_nodes(entry.run_metadata)
    sums = [t.op for reduced in entry.rewrite.reduced.values() for t in reduced]
    return any(op.name in executed for op in sums or entry.rewrite.selection.backward)


def _traced(options):
    traced = config_pb2.RunOptions()
    if options is not None:
        traced.CopyFrom(options)
    traced.trace_level = config_pb2.RunOptions.FULL_TRACE
    return traced


def executed_nodes(run_metadata: List[config_pb2.RunMetadata]) -> Dict[str, Set[str]]:
    """graph op name -> the devices it executed on, over all ``run_metadata``
    (``step_trace.executed_ops`` of each: TensorFlow's step stats, names
    grappler rewrote mapped back)."""
    nodes: Dict[str, Set[str]] = {}
    for metadata in run_metadata:
        for name, devices in executed_ops(metadata).items():
            nodes.setdefault(name, set()).update(devices)
    return nodes


def _canonical(device: str) -> str:
    return device.split("/stream:")[0]


def assert_plan_ran(entry: RewrittenGraph) -> None:
    """Fail unless the traced runs of ``entry`` executed its plan (module doc)."""
    plan, rw = entry.plan, entry.rewrite
    executed = executed_nodes(entry.run_metadata)
    placement = rw.placement
    stage_ops: Dict[int, Set[str]] = {}
    for op in rw.selection.step_ops + rw.selection.update_ops:
        stage_ops.setdefault(placement.stage(op), set()).add(op.name)
    computing = set(stage_ops)  # a TaskGraph of inputs and no-ops computes nothing
    for stage, maps in enumerate(rw.version_maps):
        for version in maps:
            stage_ops.setdefault(stage, set()).update(op.name for op in version.values())
    for stage, maps in enumerate(rw.device_maps):
        for copies in maps:
            stage_ops.setdefault(stage, set()).update(op.name for op in copies.values())
    for stage, tg in enumerate(plan.task_graphs):
        if stage not in computing:
            continue
        ran_on = {d for name in stage_ops.get(stage, ()) for d in executed.get(name, ())}
        missing = [d for d in tg.devices if _canonical(d) not in ran_on]
        assert not missing, (f"TaskGraph {tg.name!r}: planned on {tg.devices}, but no op of it "
                             f"executed on {missing} (executed on {sorted(ran_on)})")
        expected = plan.num_micro_batch * len(tg.replicas)
        versions = rw.version_maps[stage]
        assert len(versions) == expected, (
            f"TaskGraph {tg.name!r}: {len(versions)} copies, the plan needs {expected} "
            f"({plan.num_micro_batch} micro-batches x {len(tg.replicas)} replicas)")
        for v, version in enumerate(versions[1:], start=1):
            assert any(op.name in executed for op in version.values()), (
                f"TaskGraph {tg.name!r}: copy {v} of {expected} never executed")
        if expected > 1:
            _assert_reduced(rw, stage, executed, tg.name)


def _assert_reduced(rw, stage, executed, name):
    """The summed gradients of a TaskGraph's variables executed."""
    reduced = [t for raw, sums in rw.reduced.items() if rw.placement.stage(raw.op) == stage
               for t in sums]
    if not reduced:
        return  # a TaskGraph that trains no variable reduces nothing
    assert any(t.op.name in executed for t in reduced), (
        f"TaskGraph {name!r}: its gradients were never summed over its copies")
