"""Keras' weight APIs on a model whose transformer block is split by
``wh.split(2)`` in TF2 (issue 60, item 6): ``get_weights()``,
``model.weights[i].numpy()``, ``set_weights()`` and ``save_weights`` /
``load_weights`` in h5, TF and Keras' v3 (``.weights.h5``) formats give and
take one device's whole values, in one device's order, while the step trains
the shards. Before: ``get_weights()`` gave the shards (the query kernel as two
``(8, 1, 8)`` values where one device has one ``(8, 2, 8)``), ``set_weights``
and the h5 and v3 files wanted them, so files did not load between a split
and a plain model.

``tf2_weights_script.py`` runs a functional and a subclassed model, plainly
and then split (it loads the plain run's files), in two fresh processes."""
import json
import os
import sys

import h5py
import numpy as np
import pytest

import warm_python

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf2_weights_script.py")
KINDS = ("functional", "subclassed")
FORMATS = ("h5", "tf", "keras_v3")


def _run(*args) -> dict:
    run = warm_python.run([sys.executable, SCRIPT, *map(str, args)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(plain run, split run, their directories): the split run reads the plain one's files."""
    plain_dir, split_dir = tmp_path_factory.mktemp("plain"), tmp_path_factory.mktemp("split")
    plain = _run(0, plain_dir)
    return plain, _run(2, split_dir, plain_dir), plain_dir, split_dir


def assert_values(actual, expected, what, rtol=1e-5):
    """``actual`` (a list of arrays, or a recorded error) is ``expected``, value by value."""
    assert not isinstance(actual, dict), f"{what}: {actual}"
    assert [np.shape(a) for a in actual] == [np.shape(e) for e in expected], what
    for index, (a, e) in enumerate(zip(actual, expected)):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=1e-6 if rtol else 0,
                                   err_msg=f"{what}, weight {index}")


@pytest.mark.parametrize("kind", KINDS)
def test_get_weights_and_weights_give_one_devices_whole_values(runs, kind):
    plain, split = runs[0][kind], runs[1][kind]
    np.testing.assert_allclose(split["losses"], plain["losses"], rtol=1e-5)
    assert split["names"] == plain["names"]
    assert split["shapes"] == plain["shapes"]
    assert_values(split["get_weights"], plain["get_weights"], "get_weights()")
    assert_values(split["numpy"], plain["numpy"], "[w.numpy() for w in model.weights]")


@pytest.mark.parametrize("kind", KINDS)
def test_set_weights_takes_whole_values_and_training_goes_on_from_them(runs, kind):
    plain, split = runs[0][kind], runs[1][kind]
    assert_values(split["set"], plain["set"], "get_weights() after set_weights()", rtol=0)
    np.testing.assert_allclose(split["losses_after_set"], plain["losses_after_set"], rtol=1e-5)
    assert_values(split["after_set"], plain["after_set"], "get_weights() after training")


@pytest.mark.parametrize("kind", KINDS)
def test_saved_weights_load_from_a_plain_model_into_a_split_one_and_back(runs, kind):
    """h5, TF format and Keras' v3 format; the split model's h5 file holds
    what the plain model's does, under the same names."""
    plain_runs, split_runs, plain_dir, split_dir = runs
    plain, split = plain_runs[kind], split_runs[kind]
    for fmt in FORMATS:
        assert split[f"saved_{fmt}"] == [], split[f"saved_{fmt}"]
        assert_values(split[f"loaded_plain_{fmt}"], plain["get_weights"],
                      f"split model after load_weights of the plain model's {fmt}", rtol=0)
        assert_values(split[f"plain_loaded_{fmt}"], split["get_weights"],
                      f"plain model after load_weights of the split model's {fmt}", rtol=0)
    with h5py.File(plain_dir / f"{kind}.h5") as plain_file, \
            h5py.File(split_dir / f"{kind}.h5") as split_file:
        assert _h5_shapes(split_file) == _h5_shapes(plain_file)


def _h5_shapes(h5_file) -> dict:
    """{layer: [(weight name, shape)]} of a Keras h5 weights file."""
    def text(names):
        return [n.decode() if isinstance(n, bytes) else n for n in names]
    return {layer: [(name, h5_file[layer][name].shape)
                    for name in text(h5_file[layer].attrs["weight_names"])]
            for layer in text(h5_file.attrs["layer_names"])}


def test_gradients_of_whole_split_weights_say_to_take_the_shards(runs):
    """``model.weights`` shows a split weight whole; a tape asked for its
    gradient says to differentiate ``trainable_variables`` (before: the
    shards' gradients, as ``model.weights`` held them)."""
    said = runs[1]["functional"]["gradients_of_weights"]
    assert isinstance(said, dict), said
    assert said["error"].startswith("PlanError: tfpar: gradients asked of split weight "
                                    "'transformer_block/multi_head_attention/query/kernel:0'")
    assert "model.trainable_variables" in said["error"]
