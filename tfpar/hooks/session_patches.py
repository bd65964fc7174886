"""Sessions: tfpar's devices and target for each new one; before each run,
callable or finalize, the graph is rewritten (once) and fetches translated
to their parallel versions; after a run, the runtime hears how it went."""
import weakref
from typing import Any

from tfpar.compat import tf as internals
from tfpar.compat.tf import config_pb2, ops, tf_errors, tf_session
from tfpar.errors import ClusterError
from tfpar.hooks import capture as cap_lib
from tfpar.hooks import seams
from tfpar.hooks.patching import PatchSet
from tfpar.hooks.session_close import lost_worker

__all__ = ["add_session_patches"]


def add_session_patches(patches: PatchSet) -> None:
    patches.add(ops.Graph, "finalize", _wrap_finalize)
    patches.add(tf_session.BaseSession, "__init__", _wrap_session_init)
    patches.add(tf_session.BaseSession, "run", _wrap_session_run)
    patches.add(tf_session.BaseSession, "_make_callable_from_options", _wrap_make_callable)


def _wrap_session_init(original):
    def __init__(self, target="", graph=None, config=None):
        if seams.runtime is not None:
            config = seams.runtime.session_config(config, graph)
            target = seams.runtime.session_target(target)
        original(self, target, graph, config)
    return __init__


def _wrap_finalize(original):
    def finalize(self):
        if not self.finalized and seams.runtime is not None:
            seams.runtime.before_run(self)
        original(self)
    return finalize


def _before_run(session):
    """The runtime's fetch translator for ``session``'s graph (rewriting it first
    if need be), or None. A session that already ran the graph before the
    rewrite keeps the nodes it was sent (TensorFlow ignores later changes to
    them): it is reopened on the rewritten graph, with the values its variables
    had (``compat.tf.reopen_session``)."""
    if seams.runtime is None:
        return None
    graph = session.graph
    early = session in _sessions_that_ran and seams.runtime.rewrites_next(graph)
    carried = _variable_values(session) if early and not graph.finalized else {}
    translate = seams.runtime.before_run(graph)
    if early and seams.runtime.ran_before_rewrite(graph, len(carried)):
        internals.reopen_session(session)
        if carried:
            session.run([v.initializer for v in carried],
                        {v.initializer.inputs[1]: value for v, value in carried.items()})
    _sessions_that_ran.add(session)
    return translate


# Sessions that have run (their graph's nodes so far were sent to them).
_sessions_that_ran: "weakref.WeakSet" = weakref.WeakSet()
# BaseSession.run as TensorFlow defines it (set when the patch is installed).
_plain_run: Any = None


def _variable_values(session) -> dict:
    """Variable -> its value in ``session``, for every initialized variable of
    the session's graph."""
    graph = session.graph
    variables = list({id(v): v for key in (ops.GraphKeys.GLOBAL_VARIABLES,
                                           ops.GraphKeys.LOCAL_VARIABLES)
                      for v in graph.get_collection(key)}.values())
    if not variables:
        return {}
    with graph.as_default(), cap_lib.recording_paused(), ops.name_scope(None):
        with ops.name_scope("tfpar_carry"):
            flags = [v.is_initialized() for v in variables]
    live = [v for v, ok in zip(variables, _plain_run(session, flags))
            if ok and len(v.initializer.inputs) == 2]  # an assign of its initial value
    return dict(zip(live, _plain_run(session, live)))


def _wrap_make_callable(original):
    def _make_callable_from_options(self, callable_options):
        translate = _before_run(self)
        if translate is not None:
            callable_options = _translated_options(callable_options, translate)
            seams.runtime.made_callable(self.graph)
        return original(self, callable_options)
    return _make_callable_from_options


def _translated_options(options, translate):
    """A copy of CallableOptions whose fetch tensors and target ops are the
    parallel versions (names in, names out)."""
    translated = type(options)()
    translated.CopyFrom(options)
    fetch, target = translate([list(options.fetch), list(options.target)])  # one translation
    del translated.fetch[:]
    translated.fetch.extend(fetch)
    del translated.target[:]
    translated.target.extend(target)
    return translated


def _wrap_session_run(original):
    global _plain_run
    _plain_run = original

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        translate = _before_run(self)
        if translate is not None:
            fetches = translate(fetches)
        if seams.runtime is not None:
            options = seams.runtime.run_options(options, self.graph)
            if run_metadata is None and options is not None and options.trace_level:
                run_metadata = config_pb2.RunMetadata()  # a step the runtime profiles
        try:
            result = original(self, fetches, feed_dict, options, run_metadata)
        except tf_errors.OpError as error:
            if seams.runtime is not None:
                try:
                    seams.runtime.run_failed(error)
                except ClusterError:
                    lost_worker(self)
                    raise
            raise
        if seams.runtime is not None:
            seams.runtime.after_run(self.graph, run_metadata, feed_dict)
        return result
    return run
