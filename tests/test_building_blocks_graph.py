"""Issue 48 item 2 in graph mode (Keras ``fit`` after
``tf.compat.v1.disable_eager_execution()``, as this suite runs): the
Bidirectional LSTM classifier of ``tf2_blocks_script`` and several models in
one process, trained plainly and under tfpar on 2 devices and compared
(history, evaluation, every variable with the optimizer's slots and the
metrics' totals; ``proof.assert_parallel``)."""
import warnings

import numpy as np
import tensorflow as tf

import tfpar as wh
from equivalence import assert_equivalent, variable_values
from tf2_blocks_script import bilstm_model, convnet, reviews

CONFIG = {"cluster.num_devices": 2}


def fit_in_one_graph(builds, data, config):
    """Per model of ``builds``, one after the other in one new graph (under
    ``config``; None: plain TF), compiled as Keras' examples do and fit 2
    epochs: (history, evaluation, {variable: value}, the plan's notes then)."""
    fits = []
    with tf.Graph().as_default():
        if config is not None:
            wh.init(config)
        tf.keras.utils.set_random_seed(3)
        for build in builds:
            model = build()
            model.compile(optimizer="adam", metrics=["accuracy"], loss="binary_crossentropy"
                          if model.output.shape[-1] == 1 else
                          tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            history = model.fit(*data, batch_size=16, epochs=2, shuffle=False, verbose=0).history
            evaluation = model.evaluate(*data, verbose=0)
            variables = model.weights + model.optimizer.weights + [
                v for metric in model.metrics for v in metric.variables]
            fits.append((history, evaluation, variable_values(
                tf.compat.v1.keras.backend.get_session(), variables),
                         wh.current_plan().notes if config is not None else ()))
    if config is not None:
        wh.reset()
    return fits


def assert_same_fit(expected, got, parallel=True):
    for key in expected[0]:
        np.testing.assert_allclose(got[0][key], expected[0][key], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5, atol=1e-6)
    assert_equivalent((np.zeros(1), expected[2]), (np.zeros(1), got[2]), rtol=1e-4,
                      parallel=parallel)


def test_a_bidirectional_lstm_classifier_fits_in_parallel_in_graph_mode():
    data = reviews(40, 50, 6)
    build = [lambda: bilstm_model(50)]
    assert_same_fit(fit_in_one_graph(build, data, None)[0],
                    fit_in_one_graph(build, data, CONFIG)[0])


def images():
    rng = np.random.RandomState(0)
    return rng.rand(40, 8, 8, 1).astype("float32"), rng.randint(0, 10, 40)


TEACHER_AND_STUDENT = [lambda: convnet(8, "teacher"), lambda: convnet(2, "student")]


def test_a_model_trained_after_the_graph_was_rewritten_runs_as_built_and_says_so():
    """Keras' graph holds every model: tfpar rewrites it for the first
    model's training step; a second model's, built later, runs as built, on
    one device. Before: without a word. In a graph of its own, as the
    warning advises, the second model trains in parallel (each graph holds
    its task functions in its own library)."""
    expected = fit_in_one_graph(TEACHER_AND_STUDENT, images(), None)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", wh.FallbackWarning)
        got = fit_in_one_graph(TEACHER_AND_STUDENT, images(), CONFIG)
    assert_same_fit(expected[0], got[0])
    assert_same_fit(expected[1], got[1], parallel=False)
    texts = {str(w.message) for w in said if issubclass(w.category, wh.FallbackWarning)}
    assert len(texts) == 1, texts
    text = texts.pop()
    assert ("built after tfpar rewrote this graph for its first training step: they, and the "
            "updates they feed, run as built, on one device. Build every training step before "
            "the graph first runs, or build and train each model in a tf.Graph of its own"
            ) in text
    assert text not in got[0][3] and text in got[1][3], "wh.current_plan() does not say it"
    alone = TEACHER_AND_STUDENT[1:]
    assert_same_fit(fit_in_one_graph(alone, images(), None)[0],
                    fit_in_one_graph(alone, images(), CONFIG)[0])
