"""A TF2 script reading, setting, saving and loading the weights of
``keras_transformer``'s text classifier, run by ``test_split_weights_keras.py``
in a fresh process (TensorFlow makes logical CPU devices only before its
first op).

    python tf2_weights_script.py DEVICES DIR [PLAIN_DIR]

DEVICES 0 runs plainly; otherwise ``wh.init({"cluster.num_devices":
DEVICES})`` comes first and the transformer block runs in ``wh.split()``.
Each kind of model (``functional``: the classifier built in eager code, its
block made and called in the split scope; ``subclassed``: a subclassed model
calling the block in the split scope in ``call``) is fitted one epoch, then:

* its ``get_weights()``, ``weights[i].numpy()``, names and shapes are read;
* its weights are saved to DIR in h5 (``<kind>.h5``), TF format
  (``<kind>-tf/ckpt``) and Keras' v3 format (``<kind>.weights.h5``);
* ``set_weights`` takes other values (those of a model of another seed: the
  plain run saves them to DIR, a split run reads PLAIN_DIR's) and it fits one
  more epoch from them;
* a split run then loads each of PLAIN_DIR's files into it (after setting
  those other values again, so each load changes every value) and reads
  ``get_weights()``, and asks a GradientTape for gradients of
  ``model.weights``; at the end, without tfpar (``wh.reset()``), a new plain
  model loads each of the files the split run saved.

A check that raises records its error instead (``{"error": ...}``). Prints
one JSON line: per kind, what each step read.
"""
import contextlib
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfpar as wh  # noqa: E402
from keras_transformer import (FEED_FORWARD, SEQUENCE, VOCABULARY, WIDTH,  # noqa: E402
                               TokenAndPositionEmbedding, TransformerBlock, fit, reviews,
                               text_classifier)

HEADS = 2
FORMATS = {"h5": "{}.h5", "tf": "{}-tf/ckpt", "keras_v3": "{}.weights.h5"}


class Subclassed(tf.keras.Model):
    """The classifier as a subclassed model: its block called in ``scope()``."""

    def __init__(self, scope):
        super().__init__()
        self.scope = scope
        self.embed = TokenAndPositionEmbedding(SEQUENCE, VOCABULARY, WIDTH)
        self.block = TransformerBlock(WIDTH, HEADS, FEED_FORWARD)
        self.pool = tf.keras.layers.GlobalAveragePooling1D()
        self.out = tf.keras.layers.Dense(2, activation="softmax")

    def call(self, ids):
        x = self.embed(ids)
        with self.scope():
            x = self.block(x)
        return self.out(self.pool(x))


def build(kind: str, split: bool):
    """A compiled model of ``kind``, its weights made (names as in a fresh process)."""
    tf.keras.backend.clear_session()
    if kind == "functional":
        return text_classifier(HEADS, *((wh.split, wh.replicate) if split else ()))
    model = Subclassed(wh.split if split else contextlib.nullcontext)
    model.compile(optimizer="adam", loss="sparse_categorical_crossentropy")
    if not split:
        model(reviews()[0][:1])  # h5 files load into a built model
    return model


def checked(read):
    """``read()``, its arrays as lists; its error's text if it raises."""
    try:
        return [np.asarray(value).tolist() for value in read()]
    except Exception as error:  # pylint: disable=broad-except
        return {"error": f"{type(error).__name__}: {error}"[:2000]}


def then(first, read):
    """``read``, once ``first()`` ran (for ``checked``)."""
    def both():
        first()
        return read()
    return both


def other_values(kind: str, directory: str, plain_dir: str) -> list:
    """The initial weights of a plain model of another seed (made and saved in
    DIR by the plain run, read from PLAIN_DIR by a split one)."""
    path = os.path.join(plain_dir or directory, f"{kind}-other.npz")
    if not plain_dir:
        tf.keras.utils.set_random_seed(2)
        np.savez(path, *build(kind, split=False).get_weights())
    with np.load(path) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def gradients(sources) -> list:
    """A GradientTape's gradients of ``sources`` (of a loss not reading them)."""
    with tf.GradientTape() as tape:
        loss = tf.constant(0.0)
    return tape.gradient(loss, sources)


def run(kind: str, split: bool, directory: str, plain_dir: str) -> dict:
    tf.keras.utils.set_random_seed(1)
    model = build(kind, split)
    out = {"losses": fit(model)}
    out["get_weights"] = checked(model.get_weights)
    out["numpy"] = checked(lambda: [w.numpy() for w in model.weights])
    out["names"] = [w.name for w in model.weights]
    out["shapes"] = [w.shape.as_list() for w in model.weights]
    for fmt, path in FORMATS.items():
        out[f"saved_{fmt}"] = checked(then(
            lambda p=path: model.save_weights(os.path.join(directory, p.format(kind))), list))
    other = other_values(kind, directory, plain_dir)
    out["set"] = checked(then(lambda: model.set_weights(other), model.get_weights))
    out["losses_after_set"] = fit(model)
    out["after_set"] = checked(model.get_weights)
    for fmt, path in FORMATS.items() if split else ():
        out[f"loaded_plain_{fmt}"] = checked(then(
            lambda p=path: model.set_weights(other) or model.load_weights(
                os.path.join(plain_dir, p.format(kind))), model.get_weights))
    if split:
        out["gradients_of_weights"] = checked(lambda: gradients(model.weights))
    return out


def load_into_plain(kind: str, directory: str) -> dict:
    """A new plain model's weights after loading each file saved in ``directory``."""
    loaded = {}
    for fmt, path in FORMATS.items():
        model = build(kind, split=False)
        loaded[f"plain_loaded_{fmt}"] = checked(then(
            lambda p=path: model.load_weights(os.path.join(directory, p.format(kind))),
            model.get_weights))
    return loaded


def main(devices: int, directory: str, plain_dir: str = "") -> dict:
    if devices:
        wh.init({"cluster.num_devices": devices})
    results = {kind: run(kind, bool(devices), directory, plain_dir)
               for kind in ("functional", "subclassed")}
    if devices:
        wh.reset()
        for kind, out in results.items():
            out.update(load_into_plain(kind, directory))
    return results


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), *sys.argv[2:4])))
