"""Models of issue 48 as their users write them, in a TF2 eager script, run by
``test_building_blocks_tf2.py`` in a fresh process (TensorFlow makes logical
CPU devices only before its first op).

    python tf2_blocks_script.py SCENARIO DEVICES

DEVICES 0 runs the script plainly; otherwise ``wh.init({"cluster.num_devices":
DEVICES})`` comes first. Prints one JSON line: per phase of the script, the
numbers it trained to (losses and metrics), the devices that ran work in the
functions of that phase (TensorFlow's partition graphs) and the devices and
notes of ``wh.current_plan()`` then; and every variable at the end (weights, optimizer
slots and iterations, metric totals). tfpar's log (INFO) goes to stderr.

Scenarios:
* ``distillation``: Keras' "Knowledge Distillation" example: a teacher
  trained with ``fit`` and evaluated, then a ``Distiller(keras.Model)`` with
  its own ``train_step`` / ``test_step`` trains a student on the teacher's
  soft labels: two models, several rewritten steps in one process.
* ``bilstm``: Keras' "Bidirectional LSTM on IMDB" example (``Embedding`` ->
  ``Bidirectional(LSTM)`` x2 -> ``Dense``; ``fit`` with validation data),
  then a step whose gradients a decorated helper takes, of a small head (it
  really trains on one device, and tfpar says so).
* ``captured``: Horovod's ``tensorflow2_synthetic_benchmark.py`` without its
  Horovod lines: the batch is made eagerly, a ``tf.function`` step reads it
  without arguments; then (a second phase) steps reading captured tensors
  tfpar cannot split: Barlow Twins' loss (a cross-correlation over the
  batch), a batch read with a captured tensor of another leading size, and a
  step that reads no batch at all.
"""
import json
import logging
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from tensorflow import keras  # noqa: E402
from tensorflow.keras import layers  # noqa: E402
from tensorflow.python.eager import context  # noqa: E402

import tfpar as wh  # noqa: E402

_PLUMBING = {"_Arg", "_Retval", "_Send", "_Recv", "_HostSend", "_HostRecv", "Const", "NoOp",
             "Identity"}
_TFPAR = []  # [True] under wh.init()


def phase(numbers) -> dict:
    """The numbers of a phase, the devices its functions ran work on (the run
    metadata collected since the last phase), and the devices and notes of
    the plan of its last step traced."""
    metadata = context.context().export_run_metadata()  # and clears it
    devices = sorted({node.device for function in metadata.function_graphs
                      for graph in function.partition_graphs for node in graph.node
                      if node.op not in _PLUMBING})
    planned, notes = [], []
    if _TFPAR:
        try:
            plan = wh.current_plan()
            planned = sorted({d for tg in plan.task_graphs for d in tg.devices})
            notes = list(plan.notes)
        except wh.PlanError:
            pass  # no step traced yet
    return {"numbers": numbers, "devices": devices, "planned": planned, "notes": notes}


def values(*objects) -> list:
    """Every variable of ``objects`` (models, optimizers, metrics), in order."""
    found = []
    for obj in objects:
        variables = obj.variables() if callable(obj.variables) else obj.variables
        found += [np.asarray(v.numpy()).ravel().tolist() for v in variables]
    return found


class Distiller(keras.Model):
    """As Keras' example writes it."""

    def __init__(self, student, teacher):
        super().__init__()
        self.teacher = teacher
        self.student = student

    def compile(self, optimizer, metrics, student_loss_fn, distillation_loss_fn, alpha=0.1,
                temperature=3):
        super().compile(optimizer=optimizer, metrics=metrics)
        self.student_loss_fn = student_loss_fn
        self.distillation_loss_fn = distillation_loss_fn
        self.alpha = alpha
        self.temperature = temperature

    def train_step(self, data):
        x, y = data
        teacher_predictions = self.teacher(x, training=False)
        with tf.GradientTape() as tape:
            student_predictions = self.student(x, training=True)
            student_loss = self.student_loss_fn(y, student_predictions)
            distillation_loss = self.distillation_loss_fn(
                tf.nn.softmax(teacher_predictions / self.temperature, axis=1),
                tf.nn.softmax(student_predictions / self.temperature, axis=1),
            ) * self.temperature**2
            loss = self.alpha * student_loss + (1 - self.alpha) * distillation_loss
        trainable_vars = self.student.trainable_variables
        gradients = tape.gradient(loss, trainable_vars)
        self.optimizer.apply_gradients(zip(gradients, trainable_vars))
        self.compiled_metrics.update_state(y, student_predictions)
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss, "distillation_loss": distillation_loss})
        return results

    def test_step(self, data):
        x, y = data
        y_prediction = self.student(x, training=False)
        student_loss = self.student_loss_fn(y, y_prediction)
        self.compiled_metrics.update_state(y, y_prediction)
        results = {m.name: m.result() for m in self.metrics}
        results.update({"student_loss": student_loss})
        return results


def convnet(width: int, name: str):
    """The example's teacher and student (a smaller width), on 8x8 images."""
    return keras.Sequential([
        keras.Input(shape=(8, 8, 1)),
        layers.Conv2D(width, (3, 3), strides=(2, 2), padding="same"),
        layers.LeakyReLU(alpha=0.2),
        layers.MaxPooling2D(pool_size=(2, 2), strides=(1, 1), padding="same"),
        layers.Conv2D(2 * width, (3, 3), strides=(2, 2), padding="same"),
        layers.Flatten(),
        layers.Dense(10),
    ], name=name)


def distillation() -> dict:
    rng = np.random.RandomState(0)
    x_train, y_train = rng.rand(40, 8, 8, 1).astype("float32"), rng.randint(0, 10, 40)
    teacher, student = convnet(8, "teacher"), convnet(2, "student")
    teacher.compile(optimizer=keras.optimizers.Adam(),
                    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                    metrics=[keras.metrics.SparseCategoricalAccuracy()])
    history = teacher.fit(x_train, y_train, batch_size=16, epochs=2, verbose=0).history
    teacher_phase = phase([history, teacher.evaluate(x_train, y_train, verbose=0)])
    distiller = Distiller(student=student, teacher=teacher)
    distiller.compile(optimizer=keras.optimizers.Adam(),
                      metrics=[keras.metrics.SparseCategoricalAccuracy()],
                      student_loss_fn=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      distillation_loss_fn=keras.losses.KLDivergence(), alpha=0.1, temperature=10)
    history = distiller.fit(x_train, y_train, batch_size=16, epochs=2, verbose=0).history
    student_phase = phase([history, distiller.evaluate(x_train, y_train, verbose=0)])
    return {"phases": [teacher_phase, student_phase],
            "variables": values(teacher, student, teacher.optimizer, distiller.optimizer,
                                *teacher.metrics, *distiller.metrics)}


def bilstm_model(max_features: int):
    """Keras' example, tiny."""
    inputs = keras.Input(shape=(None,), dtype="int32")
    x = layers.Embedding(max_features, 8)(inputs)
    x = layers.Bidirectional(layers.LSTM(4, return_sequences=True))(x)
    x = layers.Bidirectional(layers.LSTM(4))(x)
    outputs = layers.Dense(1, activation="sigmoid")(x)
    return keras.Model(inputs, outputs)


def reviews(count: int, max_features: int, maxlen: int):
    rng = np.random.RandomState(0)
    texts = [rng.randint(1, max_features, rng.randint(2, maxlen + 3)) for _ in range(count)]
    return keras.utils.pad_sequences(texts, maxlen=maxlen), rng.randint(0, 2, count)


def bilstm() -> dict:
    x_train, y_train = reviews(40, 50, 6)
    model = bilstm_model(50)
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["accuracy"])
    history = model.fit(x_train, y_train, batch_size=16, epochs=2,
                        validation_data=(x_train[:8], y_train[:8]), verbose=0).history
    fit_phase = phase([history])

    head, optimizer = layers.Dense(1, "sigmoid"), keras.optimizers.SGD(0.1)
    features = x_train[:16].astype("float32")
    labels = y_train[:16].astype("float32")[:, None]

    @tf.function
    def gradients_of(x, y):  # a decorated helper: not the step's top level
        with tf.GradientTape() as tape:
            loss = keras.losses.binary_crossentropy(y, head(x))
        return tape.gradient(loss, head.trainable_variables)

    @tf.function
    def nested_step(x, y):
        optimizer.apply_gradients(zip(gradients_of(x, y), head.trainable_variables))

    nested_step(features, labels)
    return {"phases": [fit_phase, phase([])],
            "variables": values(model, model.optimizer, *model.metrics, head, optimizer)}


def synthetic_model():
    """Stands for ``applications.ResNet50(weights=None)``: a softmax classifier."""
    return keras.Sequential([keras.Input((8, 8, 3)), layers.Conv2D(4, 3, activation="relu"),
                             layers.GlobalAveragePooling2D(), layers.Dense(10, "softmax")])


def captured() -> dict:
    """The benchmark's model, data and step as Horovod writes them (its
    ``hvd.DistributedGradientTape`` and broadcasts left out)."""
    batch_size = 16
    model = synthetic_model()
    opt = tf.optimizers.SGD(0.01)
    data = tf.random.uniform([batch_size, 8, 8, 3])
    target = tf.random.uniform([batch_size, 1], minval=0, maxval=9, dtype=tf.int64)

    @tf.function
    def benchmark_step(first_batch):
        with tf.GradientTape() as tape:
            probs = model(data, training=True)
            loss = tf.losses.sparse_categorical_crossentropy(target, probs)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))

    losses = []
    for first_batch in (True, False, False):
        benchmark_step(first_batch)
        losses.append(float(tf.reduce_mean(
            tf.losses.sparse_categorical_crossentropy(target, model(data)))))
    benchmark = phase(losses)
    fallbacks = captured_fallbacks()
    return {"phases": [benchmark, fallbacks["phases"][0]], "variables": values(model, opt),
            "fallback_variables": fallbacks["variables"]}


def barlow_twins_loss(z_a, z_b, batch_size: int):
    """Zbontar et al. 2021: the cross-correlation of the normalized embeddings
    of two views, over the batch, pushed towards the identity."""
    def normalized(z):
        return (z - tf.reduce_mean(z, 0)) / (tf.math.reduce_std(z, 0) + 1e-5)
    c = tf.matmul(normalized(z_a), normalized(z_b), transpose_a=True) / batch_size
    on_diagonal = tf.reduce_sum(tf.square(tf.linalg.diag_part(c) - 1))
    off_diagonal = tf.reduce_sum(tf.square(c)) - tf.reduce_sum(tf.square(tf.linalg.diag_part(c)))
    return on_diagonal + 0.005 * off_diagonal


def captured_fallbacks() -> dict:
    model = synthetic_model()
    opt = tf.optimizers.SGD(0.01)
    view_a = tf.random.uniform([16, 8, 8, 3])
    view_b = tf.random.uniform([16, 8, 8, 3])
    class_weight = tf.random.uniform([10])
    target = tf.random.uniform([16], maxval=10, dtype=tf.int64)

    @tf.function
    def twins_step():
        with tf.GradientTape() as tape:
            loss = barlow_twins_loss(model(view_a, training=True), model(view_b, training=True),
                                     16)
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def weighted_step():
        with tf.GradientTape() as tape:
            losses = tf.losses.sparse_categorical_crossentropy(target, model(view_a))
            loss = tf.reduce_mean(losses * tf.gather(class_weight, target))
        gradients = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    scale, scale_opt = tf.Variable(tf.ones([4])), tf.optimizers.SGD(0.1)

    @tf.function
    def decay_step():  # no batch at all
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(scale - 0.5))
        scale_opt.apply_gradients([(tape.gradient(loss, scale), scale)])
        return loss

    losses = [float(step()) for step in (twins_step, weighted_step, decay_step) for _ in range(2)]
    return {"phases": [phase(losses)],
            "variables": values(model, opt, scale_opt) + [scale.numpy().tolist()]}


SCENARIOS = {"distillation": distillation, "bilstm": bilstm, "captured": captured}


def main(scenario: str, devices: int) -> dict:
    logging.getLogger("tfpar").addHandler(logging.StreamHandler(sys.stderr))
    logging.getLogger("tfpar").setLevel(logging.INFO)
    if devices:
        wh.init({"cluster.num_devices": devices})
        _TFPAR.append(True)
    tf.keras.utils.set_random_seed(3)
    context.context().enable_run_metadata()
    context.context().enable_graph_collection()
    return SCENARIOS[scenario]()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))))
