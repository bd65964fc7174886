"""Keras' MobileNetV2, BatchNorm in training mode, trained by ``fit``: run by
``test_batch_norm.py`` in a fresh process (TF2 makes its logical devices
before its first op; the suite runs in graph mode), and imported by it for
the same model in graph mode.

    python batch_norm_script.py {tfpar,mirrored,plain} DEVICES {mobilenet_v2,synchronized}

``tfpar``: ``wh.init({"cluster.num_devices": DEVICES})`` first; ``mirrored``:
``tf.distribute.MirroredStrategy`` over DEVICES logical CPUs, the reference
whose BatchNorm rule tfpar follows; ``plain``: one device. ``synchronized``:
a small convolutional model whose BatchNormalization is Keras'
``synchronized=True`` one. Prints one JSON line: the losses and accuracies,
every variable of the model (moving statistics included), the optimizer's
slots, and the devices that ran the training step's work.
"""
import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

ROWS, BATCH, CLASSES = 32, 16, 4
_PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp",
             "Identity"}


def data():
    rng = np.random.RandomState(0)
    return (rng.randn(ROWS, 32, 32, 3).astype(np.float32),
            rng.randint(0, CLASSES, ROWS).astype(np.int64))


def mobilenet_v2():
    """keras.applications' MobileNetV2 (52 BatchNorm layers, fused, in
    training mode under ``fit``), small, compiled with SGD and momentum (the
    legacy optimizer: the same update in graph mode and TF2)."""
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.applications.MobileNetV2((32, 32, 3), alpha=0.35, weights=None,
                                              classes=CLASSES)
    model.compile(tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
    return model


def synchronized():
    """A convolution, Keras' synchronized BatchNormalization, a head."""
    tf.keras.utils.set_random_seed(1)
    model = tf.keras.Sequential([
        tf.keras.Input((32, 32, 3)), tf.keras.layers.Conv2D(4, 3, strides=4, use_bias=False),
        tf.keras.layers.BatchNormalization(synchronized=True), tf.keras.layers.ReLU(),
        tf.keras.layers.GlobalAveragePooling2D(), tf.keras.layers.Dense(CLASSES, "softmax")])
    model.compile(tf.keras.optimizers.legacy.SGD(0.05, momentum=0.9),
                  tf.keras.losses.SparseCategoricalCrossentropy(), metrics=["accuracy"])
    return model


MODELS = {"mobilenet_v2": mobilenet_v2, "synchronized": synchronized}


def trained(model, values):
    """Fit two steps (one epoch); what ``test_batch_norm`` compares. ``values(variables)``
    reads variables (eagerly, or through the graph's session)."""
    x, y = data()
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0).history
    slots = [model.optimizer.get_slot(v, "momentum") for v in model.trainable_variables]
    return {"losses": history["loss"], "accuracy": history["accuracy"],
            "variables": {v.name: value.tolist()
                          for v, value in zip(model.variables, values(model.variables))},
            "slots": [value.tolist() for value in values(slots)]}


def main(how: str, devices: int, model_name: str) -> dict:
    scope = contextlib.nullcontext()
    if how == "tfpar":
        import tfpar as wh  # pylint: disable=import-outside-toplevel
        wh.init({"cluster.num_devices": devices})
    elif how == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * devices)
        scope = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(devices)]).scope()
    context.context().enable_run_metadata()
    context.context().enable_graph_collection()
    with scope:
        model = MODELS[model_name]()
    result = trained(model, lambda variables: [v.numpy() for v in variables])
    metadata = context.context().export_run_metadata()
    result["devices"] = sorted({node.device for function in metadata.function_graphs
                                for graph in function.partition_graphs for node in graph.node
                                if node.op not in _PLUMBING})
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])))
