"""TF2 training steps as their users write them (issue 60): keras-io's GANs
(a custom ``train_step`` under ``fit`` and a ``tf.function`` loop, two
optimizers, trackers), its VAE (three trackers, even and uneven splits), its
masked English-to-Spanish transformer, a masked loss in a custom loop; a step
reading its batch size statically and one concatenating rows it makes with
the batch's. Each is trained plainly and with tfpar on 4 logical devices in
one process (``real_steps_script.py``), every logged value and every variable
(optimizer slots, tracker totals and counts) compared, the plan proven from
the placed graphs that ran. With them (one process for all), issue 64's TF2
transformers whose attention is raw ops in ``wh.split``
(``raw_attention_models.py``)."""
import functools
import json
import os
import sys

import numpy as np
import pytest

import warm_python

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "real_steps_script.py")
DEVICES = 4
PLANNED = [f"/job:localhost/replica:0/task:0/device:CPU:{i}" for i in range(DEVICES)]
SCENARIOS = ("gan_fit", "gan_loop", "vae_even", "vae_uneven", "seq2seq_fit", "masked_loop",
             "static_batch", "fixed_block", "raw_attention_bert_fit_split2",
             "raw_attention_gpt2_loop_split4")


@functools.lru_cache(maxsize=None)
def results() -> dict:
    """scenario -> its plain and tfpar runs (one process for all)."""
    done = warm_python.run([sys.executable, SCRIPT, str(DEVICES), *SCENARIOS],
                           capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return {run["scenario"]: run for run in runs}


def assert_one_devices_numbers(scenario: str) -> dict:
    """The tfpar run logged and ended with one device's values, in parallel
    on every device; returns it."""
    plain, got = results()[scenario]["plain"], results()[scenario]["tfpar"]
    assert not got["error"] and not got["said"], (got["error"], got["said"])
    np.testing.assert_allclose(got["logged"], plain["logged"], rtol=1e-5, atol=1e-6,
                               err_msg=f"{scenario}: a logged value differs")
    assert len(got["variables"]) == len(plain["variables"])
    for i, (a, b) in enumerate(zip(plain["variables"], got["variables"])):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6,
                                   err_msg=f"{scenario}: variable {i} differs")
    assert set(got["planned"]) == set(PLANNED), (
        f"the step was never parallelised: the plan's devices are {got['planned']}")
    assert set(PLANNED) <= set(got["devices"]), (
        f"the step was never parallelised: it ran on {got['devices']} only")
    return got


@pytest.mark.parametrize("scenario", ["gan_fit", "gan_loop"])
def test_a_gan_updates_its_discriminator_then_trains_the_generator_through_it(scenario):
    """Before: ``InvalidArgumentError: ... nodes in a cycle`` at the first
    step (the replicas' task functions held both losses' forward ops, and the
    discriminator's update waited on all of them). Now the step runs in two
    rounds (``analysis.rounds``): every device computes the discriminator's
    loss and gradients, the update, then the generator's through the updated
    discriminator."""
    got = assert_one_devices_numbers(scenario)
    for device in PLANNED:
        assert {"F", "B", "Fr1", "Br1"} <= {task for d, task in got["tasks"] if d == device}, (
            f"{device} did not run both rounds: {got['tasks']}")


@pytest.mark.parametrize("scenario", ["vae_even", "vae_uneven"])
def test_trackers_count_one_step_per_step(scenario):
    """Before: every replica added its step's mean with weight 1 (a tracker
    counted 4 per step), and with 10 rows on 4 devices the logged loss was
    249.363 where one device logs 246.385. Now a tracker's update runs once,
    on the merged value."""
    assert_one_devices_numbers(scenario)


@pytest.mark.parametrize("scenario", ["seq2seq_fit", "masked_loop"])
def test_a_masked_loss_weighs_every_token_as_one_device_does(scenario):
    """Before: each replica divided its loss by its own count of unmasked
    tokens (the first loss of the translation model 9.611341 against
    9.609913). Now every replica reads the count computed on the whole
    batch."""
    assert_one_devices_numbers(scenario)


def test_a_step_reading_its_batch_size_statically_runs_as_written_and_says_so():
    """Before: ``TypeError: Expected int32, but got None`` from tfpar's trace
    of the step with its batch relaxed, and the script died."""
    plain, got = results()["static_batch"]["plain"], results()["static_batch"]["tfpar"]
    assert not got["error"]
    assert len(got["said"]) == 1 and "x.shape[0]" in got["said"][0], got["said"]
    assert "Expected int32, but got None" in got["said"][0]
    np.testing.assert_allclose(got["logged"], plain["logged"], rtol=1e-6)


def test_rows_a_step_makes_beside_the_batch_are_refused_by_name():
    """Before: every replica trained on all the generated rows beside its
    share of the batch (0.879 where one device gives 0.728), silently."""
    got = results()["fixed_block"]["tfpar"]
    assert "'concat' joins the batch's rows with" in got["error"], got["error"]
    assert "[4, 6]" in got["error"] and "tf.shape(x)[0]" in got["error"]


@pytest.mark.parametrize("scenario", ["raw_attention_bert_fit_split2",
                                      "raw_attention_gpt2_loop_split4"])
def test_raw_op_attention_in_a_split_scope_trains_by_heads_in_tf2(scenario):
    """Keras Dense projections and an attention core of raw ops (BERT's
    separate q, k, v and padding mask under ``fit``, split over 2 devices
    twice; GPT-2's fused qkv and causal mask in a ``tf.function`` loop, over
    4): one device's numbers, and every device ran as many batched matmuls
    as every other (its heads' scores and weighted sums; a core left whole
    runs them all on the first device of each split group). Before, the
    output projection's pattern was chosen in Keras' scratch trace of the
    block, where the core was whole: column instead of row."""
    got = assert_one_devices_numbers(scenario)
    counts = got["batch_matmuls"]
    assert sorted(counts) == PLANNED and len(set(counts.values())) == 1, counts
