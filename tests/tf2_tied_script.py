"""A TF2 eager script training a small language model whose output
projection reuses its Keras ``Embedding`` (tied weights) in 4
``wh.replicate(1)`` stages, 4 micro-batches, with a ``tf.function`` step and
``tf.GradientTape`` (``test_tied_weights_tf2.py``).

    python tf2_tied_script.py DEVICES    # 0: plain TF, without tfpar

Prints one JSON line: the losses, every variable (the model's and the
optimizer's), the devices the steps ran on, the planned devices and the task
functions tfpar defined. A FallbackWarning is an error here.
"""
import contextlib
import json
import sys
import warnings

import numpy as np
import tensorflow as tf
from tensorflow.python.eager import context

import tfpar as wh

VOCAB, SEQ, HIDDEN = 16, 6, 8


def main(devices: int) -> dict:
    if devices:
        wh.init({"cluster.num_devices": devices, "pipeline.num_micro_batch": 4})
        warnings.simplefilter("error", wh.FallbackWarning)
    tf.keras.utils.set_random_seed(3)
    context.context().enable_run_metadata()
    embedding = tf.keras.layers.Embedding(VOCAB, HIDDEN)
    blocks = [tf.keras.layers.Dense(HIDDEN, activation="tanh") for _ in range(2)]
    optimizer = tf.keras.optimizers.Adam(0.01)
    embedding.build((None, SEQ))
    for block in blocks:
        block.build((None, SEQ, HIDDEN))
    trained = embedding.trainable_variables + [
        v for block in blocks for v in block.trainable_variables]
    optimizer.build(trained)

    def stage():
        return wh.replicate(1) if devices else contextlib.nullcontext()

    def loss_of(ids):
        with stage():
            h = embedding(ids)
        for block in blocks:  # [batch, SEQ, HIDDEN]: Dense takes a Tensordot
            with stage():
                h = block(h)
        with stage():
            logits = tf.matmul(tf.reshape(h, [-1, HIDDEN]), embedding.embeddings,
                               transpose_b=True)
            return tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(
                ids[:, 1:], tf.reshape(logits, [-1, SEQ, VOCAB])[:, :-1], from_logits=True))

    @tf.function
    def step(ids):
        with tf.GradientTape() as tape:
            loss = loss_of(ids)
        optimizer.apply_gradients(zip(tape.gradient(loss, trained), trained))
        return loss

    rng = np.random.RandomState(0)
    losses = [float(step(tf.constant(rng.randint(0, VOCAB, (8, SEQ)), tf.int64)))
              for _ in range(3)]
    variables = embedding.weights + [v for block in blocks for v in block.weights]
    metadata = context.context().export_run_metadata()
    plan = wh.current_plan() if devices else None
    return {"losses": losses,
            "variables": [v.numpy().tolist() for v in variables + optimizer.variables],
            "devices": sorted({node.device for function in metadata.function_graphs
                               for graph in function.partition_graphs for node in graph.node
                               if node.op not in ("_Recv", "_Send", "NoOp", "Const")}),
            "planned": [tg.devices for tg in plan.task_graphs] if plan else [],
            "task_functions": sorted(name for name in context.context().list_function_names()
                                     if "tfpar_stage_" in name)}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]))))
