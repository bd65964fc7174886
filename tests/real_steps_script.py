"""TF2 training steps as their users write them (issue 60), each trained
plainly and with tfpar in one process, run by ``test_real_steps_tf2.py``:

    python real_steps_script.py DEVICES SCENARIO [SCENARIO ...]

TensorFlow makes its logical CPU devices before its first op: the script makes
DEVICES of them first, then for each scenario trains it plainly (one device,
no tfpar), then under ``wh.init({"cluster.num_devices": DEVICES})`` (and the
scenario's config), and ``wh.reset()``. It prints one JSON line per scenario:
``plain`` and ``tfpar``, each with every logged value (``fit``'s history or
the loop's returned values) and every variable (the models', the optimizers'
slots and iterations, the metric trackers' totals and counts) in a fixed
order; with tfpar also the devices that ran work in the step's placed graphs,
the calls of tfpar's task functions on each device (``tasks``), the batched
matmuls each device ran (``batch_matmuls``), the plan's
devices, the FallbackWarnings said, and the error raised, if any.

Scenarios (the keras-io programs they come from, at small sizes; random
draws are made outside the step, as the same rows must reach both runs):
  gan_fit        DCGAN's "overriding train_step": a Model subclass with a
                 discriminator and a generator, two optimizers, two Mean
                 trackers; the discriminator is updated, then read again in
                 the generator's tape (22 rows in batches of 8: the last uneven);
  gan_loop       the GAN of "writing a training loop from scratch": a
                 tf.function step with two optimizers, returning both losses;
  vae_even / vae_uneven
                 the VAE's train_step with three Mean trackers (batches of 16
                 and of 10 rows on 4 devices);
  seq2seq_fit    English-to-Spanish translation: a transformer encoder and
                 decoder whose PositionalEmbedding makes a padding mask that
                 reaches the compiled sparse cross-entropy and accuracy;
  masked_loop    a custom loop dividing a masked sum of token losses by the
                 mask's sum, with a loss tracker and a masked accuracy;
  static_batch   a step reading its batch size as a Python number
                 (``real.shape[0]``): it runs on one device, said;
  fixed_block    a step concatenating a fixed number of generated rows with
                 the batch's: refused by name;
and the raw-op attention transformers of ``raw_attention_models.py`` (issue
64), whose blocks are built in ``wh.split`` scopes under tfpar.
"""
import json
import os
import sys
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402
from raw_attention_models import SCENARIOS as RAW_ATTENTION  # noqa: E402
from real_steps_models import SCENARIOS  # noqa: E402
from tf2_script import planned_devices, working_devices  # noqa: E402


def run(scenario: str) -> dict:
    """Train ``scenario`` once; its logged values and variables."""
    tf.keras.backend.clear_session()
    tf.keras.utils.set_random_seed(7)
    logged, variables = {**SCENARIOS, **RAW_ATTENTION}[scenario][0]()
    return {"logged": np.asarray(logged, np.float64).ravel().tolist(),
            "variables": [np.asarray(v).tolist() for v in variables]}


def with_tfpar(scenario: str, devices: int) -> dict:
    """``run`` under ``wh.init``, with what proves the plan ran."""
    context.context().export_run_metadata()  # forget the plain run's graphs
    wh.init({"cluster.num_devices": devices, **{**SCENARIOS, **RAW_ATTENTION}[scenario][1]})
    result = {"error": ""}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", wh.FallbackWarning)
        try:
            result.update(run(scenario))
        except wh.PlanError as error:
            result["error"] = str(error)
    result["said"] = [str(w.message) for w in said if issubclass(w.category, wh.FallbackWarning)]
    metadata = context.context().export_run_metadata()
    result["devices"] = working_devices(metadata)
    result["tasks"] = task_calls(metadata)
    result["batch_matmuls"] = batch_matmuls(metadata)
    result["planned"] = planned_devices()
    wh.reset()
    return result


def task_calls(metadata) -> list:
    """(device, task) of every call of a tfpar task function in the placed
    graphs that ran (``tfpar/replica_1/micro_0/Fr1`` -> ``"Fr1"``)."""
    return sorted({(node.device, node.name.rsplit("/", 1)[1])
                   for function in metadata.function_graphs
                   for graph in function.partition_graphs for node in graph.node
                   if node.op == "StatefulPartitionedCall" and node.name.startswith("tfpar/")})


def batch_matmuls(metadata) -> dict:
    """device -> how many batched matmuls (attention's ``Q K^T`` and ``P V``,
    forward and backward) it ran in the placed graphs."""
    counts: dict = {}
    for function in metadata.function_graphs:
        for graph in function.partition_graphs:
            for node in graph.node:
                if "BatchMatMul" in node.op:  # grappler may rename it (_MklBatchMatMulV2)
                    counts[node.device] = counts.get(node.device, 0) + 1
    return counts


def main(devices: int, scenarios) -> None:
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
    context.context().enable_run_metadata()
    for scenario in scenarios:
        print(json.dumps({"scenario": scenario, "plain": run(scenario),
                          "tfpar": with_tfpar(scenario, devices)}), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2:])
