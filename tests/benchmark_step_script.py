"""Horovod's ``tensorflow2_synthetic_benchmark.py`` without its Horovod lines,
with synchronized batch norm, run by ``test_batch_norm.py`` in a fresh
process (TF2 makes its logical devices before its first op).

    python benchmark_step_script.py DEVICES {mobilenet_v2,conv}

DEVICES 0 runs the script plainly; otherwise ``wh.init({"cluster.num_devices":
DEVICES, "batch_norm.sync": True})`` comes first. The batch (8 rows) is made
eagerly and the ``tf.function`` step reads it without arguments; its loss is
a vector of per-example losses; the optimizer ``tf.optimizers.SGD``; the
step is called under ``tf.device('CPU')`` with a Python bool
(``first_batch``): for ``conv`` three times, tracing it twice; for
``mobilenet_v2`` twice, traced once. ``mobilenet_v2``: keras.applications'
MobileNetV2 at 32x32, in float64 (in float32 this model amplifies rounding:
an input 1 ulp away, or TensorFlow's unfused kernel for its fused one, moves
most weights by more than 1e-4 relatively in one step); ``conv``: a
convolution to a 1x1 map, BatchNormalization (the fused kernel on one
device, over 8 values per channel), ReLU6 and a head, in float32. Prints one
JSON line: every variable of the model and the optimizer, and the devices
that ran the step's work.
"""
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

BATCH, CLASSES = 8, 10
# The step's calls: Horovod's (three, the first with first_batch: two traces),
# or, for MobileNetV2, whose traces and rewrites dominate the run, two of one.
FIRST_BATCH = {"conv": (True, False, False), "mobilenet_v2": (False, False)}
_PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp",
             "Identity"}


def mobilenet_v2():
    tf.keras.backend.set_floatx("float64")
    # alpha 0.35: every layer and BatchNormalization of the model, fewer channels
    return tf.keras.applications.MobileNetV2(weights=None, input_shape=(32, 32, 3), alpha=0.35,
                                             classes=CLASSES), (32, 32, 3), np.float64


def conv():
    layers = tf.keras.layers
    return tf.keras.Sequential([
        tf.keras.Input((4, 4, 3)), layers.Conv2D(6, 3, strides=2, use_bias=False),
        layers.BatchNormalization(), layers.ReLU(6.), layers.Flatten(),
        layers.Dense(CLASSES, activation="softmax")]), (4, 4, 3), np.float32


def main(devices: int, model_name: str) -> dict:
    if devices:
        import tfpar as wh  # pylint: disable=import-outside-toplevel
        wh.init({"cluster.num_devices": devices, "batch_norm.sync": True})
    context.context().enable_run_metadata()
    context.context().enable_graph_collection()
    tf.keras.utils.set_random_seed(1)
    model, shape, dtype = {"mobilenet_v2": mobilenet_v2, "conv": conv}[model_name]()
    opt = tf.optimizers.SGD(0.01)
    rng = np.random.RandomState(0)
    data = tf.constant(rng.rand(BATCH, *shape).astype(dtype))
    target = tf.constant(rng.randint(0, CLASSES - 1, (BATCH, 1)).astype(np.int64))

    @tf.function
    def benchmark_step(first_batch):
        del first_batch  # Horovod broadcasts the variables then
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.losses.sparse_categorical_crossentropy(target, probs)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))

    with tf.device("CPU"):
        for first in FIRST_BATCH[model_name]:
            benchmark_step(first_batch=first)
    metadata = context.context().export_run_metadata()
    return {"variables": {v.name: np.asarray(v.numpy()).tolist()
                          for v in model.variables + opt.variables()},
            "devices": sorted({node.device for function in metadata.function_graphs
                               for graph in function.partition_graphs for node in graph.node
                               if node.op not in _PLUMBING})}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), sys.argv[2])))
