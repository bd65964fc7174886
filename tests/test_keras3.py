"""Keras 3 (tf.keras on TensorFlow 2.16+, issue 63): a tf.function custom loop
with Keras 3 layers, optimizers and losses trains data parallel and in a
pipeline with one device's numbers, and so do ``fit``, ``evaluate`` and
``predict``; what tfpar does not do with Keras 3 yet (scopes around building
layers in eager code, ``wh.split`` of a Keras 3 layer) is a ``PlanError``
naming the layer and the Keras version, never a scope that silently does
nothing.

``keras3_script.py`` runs in fresh processes without TF_USE_LEGACY_KERAS (this
suite may run with Keras 2 as tf.keras)."""
import functools
import json
import os
import sys

import numpy as np
import pytest

import warm_python

pytestmark = pytest.mark.keras3

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras3_script.py")


@functools.lru_cache(maxsize=None)
def run(scenario: str, devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    done = warm_python.run([sys.executable, SCRIPT, scenario, str(devices)], env=env,
                           capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("scenario,devices", [("loop", 2), ("loop", 4), ("stages", 2),
                                               ("keras_loss", 4), ("fit", 2), ("fit", 4),
                                               ("fit_bn", 2)])
def test_a_keras_3_model_trains_in_parallel_with_the_single_device_numbers(scenario, devices):
    """Before: the Keras 3 optimizer's variables, made in the step's first trace,
    lost their initializers when tfpar dropped that trace
    ("'Operation' object has no attribute '_inputs_val'"); a Keras 3 loss
    object, which divides by the size of the per-example losses it computes, was
    refused (its labels now stand in for their rows); and ``fit`` was refused
    (Keras 3 nests its step in its steps_per_execution loop's tf.function).
    ``fit``: its loss and accuracy of each epoch (batches of 16, 16 and 8),
    then ``evaluate``'s and ``predict``'s values; ``fit_bn``: with a Keras 3
    BatchNormalization under ``batch_norm.sync`` (its moving statistics among
    the weights compared; before, the setting did nothing to Keras 3 layers:
    each replica normalized by its own rows' statistics)."""
    fits = scenario.startswith("fit")
    plain, got = run(scenario if fits else "loop", 0), run(scenario, devices)
    assert got["keras"].startswith("3."), got["keras"]
    np.testing.assert_allclose(got["losses"], plain["losses"], rtol=1e-5, atol=1e-6)
    later = 1 if fits else 3  # the second epoch's loss, the fourth step's
    assert not np.isclose(plain["losses"][0], plain["losses"][later]), "nothing trained"
    for a, b in zip(plain["weights"], got["weights"]):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
    planned = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(devices)]
    assert set(planned) <= set(got["devices"]), f"the step ran only on {got['devices']}"
    assert set(got["planned"]) == set(planned)
    if scenario == "stages":
        assert got["strategies"] == [["replicate", 1]] * 2, got["strategies"]


@pytest.mark.parametrize("scenario,named", [
    ("eager_scope", "Keras 3 layer 'dense' (Dense, keras 3."),
    ("split", "wh.split cannot shard Keras 3 layer 'dense_1' (Dense, keras 3.")])
def test_what_tfpar_does_not_do_with_keras_3_yet_is_refused_naming_it(scenario, named):
    """Before: a scope around Keras 3 layers changed nothing (their calls were
    not seen)."""
    said = run(scenario, 2).get("refused", "")
    assert named in said, said
    assert "TF_USE_LEGACY_KERAS=1" in said, said


def test_a_keras_3_fit_compiled_by_xla_is_said_to_run_uncompiled():
    """tfpar rewrites the step's tf.function, which XLA would compile whole:
    under ``strict`` that is refused, naming the model."""
    said = run("fit_jit", 2).get("refused", "")
    assert "the Keras 3 model 'sequential' (keras 3." in said, said
    assert "asks for jit_compile: its steps run on 2 devices uncompiled" in said, said
