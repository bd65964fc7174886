"""Checkpoints keep single-device names: they restore across 1 and N devices."""
import pytest
import tensorflow as tf

from equivalence import assert_equivalent, checkpoint_session, make_data, mlp_classifier

DATA = make_data(steps=3, batch=8)
BUILD = mlp_classifier(lambda: tf.compat.v1.train.MomentumOptimizer(0.1, 0.9))
# "collective" mirrors variables per replica (restores must be synced to every
# copy); "auto" on CPU devices of one process shares them.
BACKENDS = pytest.mark.parametrize("backend", ["auto", "collective"])


def _session(path_in, path_out, config, data, saver_after_first_run=False):
    return checkpoint_session(BUILD, path_in, path_out, config, data, saver_after_first_run)


@BACKENDS
def test_single_device_checkpoint_restores_into_parallel_graph(tmp_path, backend):
    first, second = (DATA[0][:1], DATA[1][:1]), (DATA[0][1:], DATA[1][1:])
    ckpt = str(tmp_path / "single")
    _session(None, ckpt, None, first)
    reference = _session(ckpt, None, None, second)
    config = {"communication.backend": backend}
    assert_equivalent(reference, _session(ckpt, None, {**config, "cluster.num_devices": 2},
                                          second))
    # A Saver built after the first run still syncs the replicas on restore.
    assert_equivalent(reference, _session(ckpt, None, {**config, "cluster.num_devices": 4},
                                          second, saver_after_first_run=True))


@BACKENDS
def test_parallel_checkpoint_restores_on_one_device(tmp_path, backend):
    first, second = (DATA[0][:1], DATA[1][:1]), (DATA[0][1:], DATA[1][1:])
    ckpt_parallel, ckpt_single = str(tmp_path / "parallel"), str(tmp_path / "single")
    _session(None, ckpt_parallel, {"cluster.num_devices": 4, "communication.backend": backend},
             first)
    _session(None, ckpt_single, None, first)
    names = sorted(n for n, _ in tf.train.list_variables(ckpt_parallel))
    assert names == sorted(n for n, _ in tf.train.list_variables(ckpt_single))
    assert not any("tfpar" in n for n in names)
    assert_equivalent(_session(ckpt_single, None, None, second),
                      _session(ckpt_parallel, None, None, second))
