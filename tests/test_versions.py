"""TensorFlow versions (issue 63): tfpar runs on TensorFlow 2.15 and 2.16-2.21,
the version gate (``import tfpar.compat.tf``) names that range and refuses
another version unless ``TFPAR_ALLOW_UNTESTED_TENSORFLOW=1``, which then
really lets ``wh.init()`` run (the config does not take it for an unknown key).
The gate's tests fake another version in a fresh process."""
import os
import sys

import pytest
import tensorflow as tf

import tfpar as wh
from tfpar.compat import keras as keras_internals, tf as internals
from tfpar.config_rules import ENV_NOT_CONFIG
import warm_python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKED = """
import tensorflow as tf
tf.__version__ = "2.99.0"  # a TensorFlow tfpar was not tested on
import tfpar as wh
try:
    wh.init()
except ImportError as error:
    print("REFUSED", error)
else:
    print("RAN")
"""


def run_faked(**env) -> str:
    done = warm_python.run([sys.executable, "-c", FAKED], capture_output=True, text=True,
                           timeout=300, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "3",
                                **env})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_this_tensorflow_is_in_the_tested_range():
    low, high = internals.TESTED_RANGE
    assert low <= internals.VERSION <= high, tf.__version__
    assert internals.TESTED == "2.15-2.21"


def test_another_tensorflow_is_refused_naming_the_tested_range():
    said = run_faked()
    assert said.startswith("REFUSED"), said
    assert "2.15-2.21" in said and "2.99.0" in said and "TFPAR_ALLOW_UNTESTED_TENSORFLOW" in said


def test_the_escape_hatch_lets_wh_init_run():
    """Before: the config rejected TFPAR_ALLOW_UNTESTED_TENSORFLOW as an
    unknown TFPAR_* variable, so wh.init() failed anyway."""
    assert run_faked(TFPAR_ALLOW_UNTESTED_TENSORFLOW="1") == "RAN"


def test_the_escape_hatch_is_not_a_config_key_and_others_still_are(monkeypatch):
    assert internals.ALLOW_UNTESTED in ENV_NOT_CONFIG
    monkeypatch.setenv("TFPAR_ALLOW_UNTESTED_TENSORFLOW", "1")
    wh.Config()  # no ConfigError
    monkeypatch.setenv("TFPAR_NO_SUCH_KEY", "1")
    with pytest.raises(wh.ConfigError, match="TFPAR_NO_SUCH_KEY"):
        wh.Config()


def test_keras_2_is_the_package_of_this_tensorflow():
    """Keras 2's internals come from keras.src on 2.15 and tf_keras.src on 2.16+."""
    expected = "tf_keras" if internals.VERSION >= (2, 16) else "keras"
    assert keras_internals.TF_KERAS_IS_KERAS_3 == (
        expected == "tf_keras" and os.environ.get("TF_USE_LEGACY_KERAS") != "1")
    assert keras_internals.KERAS_2_PACKAGE == expected
    assert keras_internals.base_layer.__name__ == f"{expected}.src.engine.base_layer"
