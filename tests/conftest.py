import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(__file__))

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402

tf.compat.v1.disable_eager_execution()


@pytest.fixture(autouse=True)
def _clean_tfpar(monkeypatch):
    """Every test starts and ends with tfpar removed and no TFPAR_* variables."""
    for key in list(os.environ):
        if key.startswith("TFPAR_"):
            monkeypatch.delenv(key)
    wh.reset()
    yield
    wh.reset()
