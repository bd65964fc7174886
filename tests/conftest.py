import importlib.util
import io
import logging
import warnings
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
import warm_python  # noqa: E402
from tfpar.compat.keras import KERAS_2_PACKAGE, TF_KERAS_IS_KERAS_3  # noqa: E402
from tfpar.config_rules import ENV_NOT_CONFIG  # noqa: E402

tf.compat.v1.disable_eager_execution()

# What a test needs that only some TensorFlow versions have (pytest.ini's markers): the
# reason it is skipped elsewhere, or None where it runs.
_NEEDS = {
    "estimator": None if importlib.util.find_spec("tensorflow_estimator") else (
        f"needs tf.estimator (TensorFlow 2.15 only; this is {tf.__version__})"),
    "keras2": (f"needs Keras 2 as tf.keras (TensorFlow 2.15, or 2.16+ with "
               f"TF_USE_LEGACY_KERAS=1; this is {tf.__version__} with Keras 3)"
               if TF_KERAS_IS_KERAS_3 else None),
    "keras3": None if KERAS_2_PACKAGE == "tf_keras" else (
        f"needs Keras 3 (TensorFlow 2.16+; this is {tf.__version__})"),
}


def pytest_collection_modifyitems(config, items):  # pylint: disable=unused-argument
    for item in items:
        for name, reason in _NEEDS.items():
            if reason and item.get_closest_marker(name):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker ends here, its results sent: at once, rather than
    freeing every graph and session its tests made (Python's teardown of a
    worker of ``make test-fast`` took about 6 s, which the run waited for)."""
    if hasattr(config, "workerinput"):
        warm_python.stop_servers()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # pylint: disable=protected-access


@pytest.fixture(autouse=True)
def _clean_tfpar(monkeypatch):
    """Every test starts and ends with tfpar removed and no TFPAR_* variables (but the
    TensorFlow version gate's, which a run on an untested TensorFlow needs)."""
    for key in list(os.environ):
        if key.startswith("TFPAR_") and key not in ENV_NOT_CONFIG:
            monkeypatch.delenv(key)
    wh.reset()
    yield
    wh.reset()


@pytest.fixture(autouse=True)
def _keras_session_closed():
    """Keras' graph-mode session (``keras.backend.get_session()``'s) ends with
    the test that made it, rather than when a later test's first Keras call
    replaces it."""
    yield
    keras = sys.modules.get(KERAS_2_PACKAGE)
    if keras is not None and not tf.executing_eagerly():
        keras.backend.clear_session()


class _Said:
    """The FallbackWarnings caught so far, read as text."""

    def __init__(self, caught):
        self._caught = caught

    def getvalue(self) -> str:
        return "\n".join(str(w.message) for w in self._caught
                         if issubclass(w.category, wh.FallbackWarning))


@pytest.fixture
def fallbacks():
    """What tfpar says it ran instead of what was asked during the test
    (``tfpar.FallbackWarning``s, which the test thereby allows)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", wh.FallbackWarning)
        yield _Said(caught)


@pytest.fixture
def tfpar_log():
    """What tfpar logs during the test (works with pytest's logging plugin off)."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logging.getLogger("tfpar").addHandler(handler)
    yield stream
    logging.getLogger("tfpar").removeHandler(handler)


@pytest.fixture(autouse=True)
def _trace_steps():
    """Every session run is traced, so equivalence checks can prove the plan ran
    (``proof.py``); ``TEST_REWRITE_OFF=1`` switches the rewrite off, to show
    that those checks then fail (``test_proof.py``)."""
    from proof import TRACER  # pylint: disable=import-outside-toplevel
    TRACER.reset()
    TRACER.install()
    yield
    TRACER.uninstall()


if os.environ.get("TEST_REWRITE_OFF") == "1":
    from tfpar.runtime import engine  # noqa: E402

    engine.before_run = lambda graph: None
    engine.rewrites_next = lambda graph: False
    # Scripts the tests run (examples) get the switch through sitecustomize.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [os.path.join(os.path.dirname(__file__), "rewrite_off")]
        + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
